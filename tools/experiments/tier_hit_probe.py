"""Issue 44: what an HBM prefix hit waits for while the host tier saves the blocks before it.

`bench prefix --tier hbm --kv-offloading-size 16` measured warm +16 hits at 16k / 32k 25-40 %
slower than with the tier off (bench/NOTES.md, "the staged saves measured, and HBM hits beside
saves"); saving in 8 MiB pieces did not change it. This runs the same requests (cold prompts,
the prefix, then the warm hits) under variants that each take one piece of the saves' work
away, and times every warm hit three ways: its TTFT (host), its step on the main stream (the
runner's InFlight events: first upload to the sampled token's copy) and the host time spent
launching that step.

    variants: off         the tier off
              on          the tier on, as shipped (staged saves: gather kernel + copy engine)
              settle      on, 0.5 s after the prefix before the hits (its saves done)
              nocopy      on, every save's copies skipped (the tier's bookkeeping alone)
              gather      on, the staging gathers only (no device-to-host copy)
              dtoh        on, the device-to-host copies only (no gather)
    (`on` gathers on a stream of their own, kv_copies.py; the form before, gathers and copies in
    turn on the copy stream, is `on` under INFC_KV_SAVE_CHAINED=1: the stage's entry
    chained=INFC_KV_SAVE_CHAINED=1)

    python3 tools/experiments/tier_hit_probe.py MODEL_DIR OUT.json VARIANT [--lengths 16384,32768]

The mapped slab (call 1's `mapped`) is `on` under INFC_KV_SAVE_STAGING_BYTES=0 (the stage's
NAME=ENV=VALUE entries set it: infc/envs.py is where INFC_ variables are read).

The GPU machine's command (dummy weights, qwen3-4b's config): see tests/gpu/session.sh stage
`tier-probe`.
"""
import argparse
import json
import os
import time

import numpy as np

VARIANTS = ("off", "on", "settle", "nocopy", "gather", "dtoh")


def _patch_copies(variant: str):
    """DeviceCopies with one piece of a save's work left out (the variant's)."""
    from infc.runtime.cuda import kv_copies
    from infc.runtime.cuda.block_copy_args import pairs, row_runs
    orig = kv_copies.DeviceCopies._batch

    def staged(self, staged_ring, pages, rows):
        ctx, bb, stage = self.ctx, self.block_bytes, self.stage_rows
        n = pairs(pages, np.arange(len(pages)) % stage, staged_ring)
        ctx.htod_raw(self._pairs, staged_ring.ctypes.data, n * 8, self.stream)
        host = self.slab.ctypes.data
        for at in range(0, n, stage):
            m = min(stage, n - at)
            if variant == "gather":
                self._gather("stage", self._pairs + at * 8, m)
            else:
                for k, row, count in row_runs(rows[at:at + m]):
                    ctx.dtoh_raw(host + row * bb, self._stage + k * bb, count * bb, self.stream)

    def batch(self, pages, rows, to_host, after_steps=True):
        if variant == "nocopy" and to_host:
            fence, self.issued = self.issued, self.issued + 1
            self.events[fence % kv_copies.RING].record(self.stream)
            return fence
        return orig(self, pages, rows, to_host, after_steps)

    kv_copies.DeviceCopies._batch = batch
    if variant in ("gather", "dtoh"):
        kv_copies.DeviceCopies._staged = staged


def run(model_dir: str, variant: str, lengths: list[int], reps: int, new: int = 16, device=None) -> dict:
    if variant in ("nocopy", "gather", "dtoh"):
        _patch_copies(variant)
    from infc.backend import load_backend
    from infc.runtime.engine.sampling import SamplingParams
    kw = {} if variant == "off" else {"kv_offloading_size": float(os.environ.get("TIER_PROBE_GIB", 16))}
    b = load_backend(model_dir, load_format="dummy", enable_prefix_caching=True, asynchronous=False,
                     log=lambda *a: None, **kw, **({"device": device} if device else {}))
    engine, runner = b.engine, b.engine.runner
    from infc.runtime.engine.gc_freeze import freeze_startup
    freeze_startup()                            # as `infc serve` and `bench prefix` do once loaded
    launches, gpu = [], []
    orig_launch, orig_collect = runner.launch_forward, runner.collect

    ctx = getattr(runner, "ctx", None)
    mark = {"event": ctx.event() if ctx is not None else None, "host": 0.0}
    lags, starts = [], {}

    def launch_forward(meta, feed=()):
        t0 = time.perf_counter()
        out = orig_launch(meta, feed)
        launches.append(time.perf_counter() - t0)
        starts[id(out)] = t0
        return out

    def collect(step):
        out = orig_collect(step)
        gpu.append(step.gpu_ms())
        if mark["event"] is not None and id(step) in starts:
            # how much later the main stream reached the step's start event than the host recorded
            # it, against the request's first moment (the stream idle there, marked and waited for)
            lags.append(step.start.ms_since(mark["event"]) - (starts.pop(id(step)) - mark["host"]) * 1e3)
        return out

    runner.launch_forward, runner.collect = launch_forward, collect
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    rng = np.random.default_rng(0)
    count = iter(range(1 << 40))

    def submit(prompt):
        rid = f"p{next(count)}"
        launches.clear(), gpu.clear(), lags.clear()
        if mark["event"] is not None:
            mark["event"].record()
            mark["event"].wait()
            mark["host"] = time.perf_counter()
        t0 = time.perf_counter()
        engine.add_request(prompt, params, rid)
        ttft = None
        while ttft is None:
            for o in engine.step():
                if o.request_id == rid:
                    ttft = time.perf_counter() - t0
        while engine.has_unfinished():
            engine.step()
        return {"ttft_ms": ttft * 1e3, "launch_ms": [x * 1e3 for x in launches], "gpu_ms": list(gpu),
                "start_lag_ms": max(lags) if lags else 0.0}

    def make(n):
        return rng.integers(1000, 100000, size=n).tolist()

    submit(make(32))
    out = {"variant": variant, "tier": engine.tiers is not None, "lengths": {},
           "env": {k: v for k, v in os.environ.items() if k.startswith("INFC_")}}
    for L in lengths:
        submit(make(L + new))
        cold = [submit(make(L + new)) for _ in range(2)]
        prefix = make(L)
        submit(prefix)
        if variant == "settle":
            time.sleep(0.5)
        prof = None
        if os.environ.get("TIER_PROBE_PROFILE"):           # the warm hits' host time, by function
            import cProfile
            prof = cProfile.Profile()
            submit(prefix + make(new))
            prof.enable()
        warm = [submit(prefix + make(new)) for _ in range(reps + 1)][1:]
        if prof is not None:
            import io
            import pstats
            prof.disable()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
            with open(os.environ["TIER_PROBE_PROFILE"] + f"-{variant}-{L}.txt", "w") as f:
                f.write(buf.getvalue())
        med = lambda key, rs: float(np.median([sum(r[key]) if isinstance(r[key], list) else r[key] for r in rs]))
        out["lengths"][str(L)] = {"cold_ttft_ms": med("ttft_ms", cold), "warm_ttft_ms": med("ttft_ms", warm),
                                  "warm_gpu_ms": med("gpu_ms", warm), "warm_launch_ms": med("launch_ms", warm),
                                  "warm_start_lag_ms": med("start_lag_ms", warm),
                                  "warm": warm}
        r = out["lengths"][str(L)]
        print(f"{variant:7s} L={L}: warm TTFT {r['warm_ttft_ms']:.2f} ms, step on the GPU {r['warm_gpu_ms']:.2f}, "
              f"launch (host) {r['warm_launch_ms']:.2f}, the stream reached it {r['warm_start_lag_ms']:.2f} late; "
              f"cold {r['cold_ttft_ms']:.1f}", flush=True)
        if getattr(engine.tiers, "copies", None) is not None and hasattr(engine.tiers.copies, "last_ms"):
            # one more cold prompt, its save timed alone after it
            submit(make(L + new))
            ms = engine.tiers.copies.last_ms(True) or 0.0
            nbytes = (L + new) // b.page_size * engine.tiers.block_bytes
            r["save_ms"], r["save_GBps"] = ms, nbytes / ms / 1e6 if ms else None
            if ms:
                print(f"{variant:7s} L={L}: a cold prompt's save {ms:.1f} ms, {r['save_GBps']:.1f} GB/s", flush=True)
            else:                               # write-back: its blocks stay dirty on their pages
                print(f"{variant:7s} L={L}: a cold prompt's blocks not saved (write-back)", flush=True)
    if engine.tiers is not None:
        st = engine.tiers.stats
        out["bytes_to_host"] = st.bytes_to_host
    b.close() if hasattr(b, "close") else None
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("out")
    ap.add_argument("variant", choices=VARIANTS)
    ap.add_argument("--lengths", default="16384,32768")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--device", default=None)
    a = ap.parse_args()
    res = run(a.model_dir, a.variant, [int(x) for x in a.lengths.split(",")], a.reps, device=a.device)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
