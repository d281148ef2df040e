"""`infc bench startup --gil-watch`: put on the server's PYTHONPATH, this starts a thread in it that
sleeps 1 ms at a time. A wake-up more than 20 ms late means another thread held the GIL all along
(a C call that never lets it go: a Rust tokenizer's load, a large dict built in one call), which
stalls every other thread, the loading one too. Each stall goes to $GIL_WATCH_OUT as
"<time.perf_counter() when it began> <seconds>" (the clock is system-wide: the benchmark subtracts
its spawn time). Then the sitecustomize this one shadows, if any, runs as it would have."""
import importlib
import os
import sys
import threading
import time


def _watch(path: str, limit_s: float = 60.0):
    t0 = last = time.perf_counter()
    with open(path, "a", buffering=1) as f:
        while last - t0 < limit_s:
            time.sleep(0.001)
            now = time.perf_counter()
            if now - last > 0.02:
                f.write(f"{last:.4f} {now - last:.4f}\n")
            last = now


if os.environ.get("GIL_WATCH_OUT"):
    threading.Thread(target=_watch, args=(os.environ["GIL_WATCH_OUT"],), name="gil-watch", daemon=True).start()

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
del sys.modules["sitecustomize"]
try:
    importlib.import_module("sitecustomize")
except ImportError:
    pass
