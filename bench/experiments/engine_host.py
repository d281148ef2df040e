"""The host's share of a throughput run: the engine and scheduler of `infc bench throughput`
(1024 in / 128 out, 256 concurrent, 512 requests, max_num_batched_tokens 8192, 16-token pages)
over a runner that does nothing (every sampled token is 7), so what is timed is the Python work
between steps that the GPU waits for. It runs anywhere; on the GPU host it says how fast that
host's CPU does this work, which `bench throughput` reports as `host_s`.

    python3 bench/experiments/engine_host.py [--concurrency 256] [--reps 3] [--profile]

--import-torch imports torch and transformers first (a process full of other objects, as one
that ran HF beside), and INFC_GC_FREEZE / --freeze reproduce bench/NOTES.md's gc.freeze numbers.
"""
import argparse
import sys

import numpy as np

from infc.config import DEFAULT_PAGE_SIZE


class NoopRunner:
    """The runner interface the engine steps (num_pages, page_size, vocab_size, execute)."""

    def __init__(self, num_pages: int, page_size: int = DEFAULT_PAGE_SIZE, vocab_size: int = 151936):
        self.num_pages, self.page_size, self.vocab_size = num_pages, page_size, vocab_size
        self.steps = 0

    def execute(self, meta, sampling):
        from infc.runtime.engine.runner import Sample
        self.steps += 1
        return [None if s is None else Sample(7, None, None) for s in sampling]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--import-torch", action="store_true")
    ap.add_argument("--freeze", action="store_true", help="runtime/engine/gc_freeze.py first")
    ap.add_argument("--profile", action="store_true", help="cProfile one more run, by own time")
    a = ap.parse_args(argv)
    if a.import_torch:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    from infc.bench.throughput import run_point
    from infc.runtime.engine.engine import Engine
    if a.freeze:
        from infc.runtime.engine.gc_freeze import freeze_startup
        freeze_startup()

    def one():
        r = NoopRunner(num_pages=24000)
        e = Engine(r, max_model_len=1 << 20, max_num_batched_tokens=8192, max_num_seqs=a.concurrency)
        p = run_point(e, r.vocab_size, a.concurrency, 1024, 128, np.random.default_rng(0))
        return p, r.steps

    walls = []
    for _ in range(a.reps):
        p, steps = one()
        walls.append(p["wall_s"])
        print(f"host {p['steps']['host_s']:.3f} s over {steps} steps ({p['wall_s'] / steps * 1e3:.2f} ms a step)",
              flush=True)
    print(f"median {float(np.median(walls)):.3f} s")
    if a.profile:
        import cProfile
        import pstats
        prof = cProfile.Profile()
        prof.enable()
        one()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    return 0


if __name__ == "__main__":
    sys.exit(main())
