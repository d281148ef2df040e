"""The host KV tier's cost on the engine thread, on the CPU (issue 44).

`bench throughput`'s 1024/128 point at 256 concurrent (two waves of requests, each finished one
replaced at once), run by the real Engine, scheduler and block manager over a runner that computes
nothing (a constant token a row) and, with the tier on, a copier that moves no bytes and hands out
fences as the CUDA one does (runtime/cuda/kv_copies.py). What differs between the runs is the
tier's Python on the engine thread: the block manager's hooks (offer on release, reusing on
allocation) and the two flushes a step. Both are timed where they are called (perf_counter around
each), so the per-sequence figure does not depend on the wall time of a shared CPU.

    python -m infc.bench.tier_host [--page-size N] [--pages N] [--host-rows N] [--reps 3]
    python -m infc.bench.tier_host --hits 16384,32768 [--cold 4] [--pages 28402] [--profile]

--pages: the device's pages (default: room for every sequence twice, as on an H200, where freed
pages are not handed out again for a while); fewer puts the cache under pressure, so saved pages
are reused at once and steps wait for their saves. --host-rows: the pool (default: a third of the
blocks the run saves, so most saves evict, as 32 GiB does for qwen3-4b's 9.4 MB blocks).

--hits: `bench prefix --tier hbm`'s requests instead (--cold prompts of each length, one of them
again, then warm hits: that prompt + 16 tokens), each hit timed from add_request to its first
token: the host time a warm HBM hit spends in the engine, scheduler and block manager, tier off
and on (write-back: no block is saved while the device has room). Pages: qwen3-4b's on an H200.
"""
import argparse
import time

import numpy as np

from .common import TimedCalls


# qwen3-4b's KV bytes a token (36 layers, K and V, 8 heads of 128, bf16) and its paged regions
QWEN3_4B_TOKEN_BYTES, QWEN3_4B_REGIONS = 36 * 2 * 8 * 128 * 2, 36 * 2
QWEN3_4B_H200_PAGES = 28402                  # its KV pool on an H200 at the default settings


class _NullCopies:
    """The CUDA copier's interface (fences: ints, in order) without copies; counts the driver
    calls its save batches would take (runtime/cuda/kv_copies.py) for qwen3-4b's blocks: 2D copies
    (one a region and run of pages and rows), the kernel on the mapped slab (an upload and a
    launch), the kernel through staging (an upload, a launch a chunk, a copy a run of rows)."""
    block_bytes = 64

    def __init__(self, stage_rows: int):
        self.issued = self.saved = 0
        self.stage_rows = stage_rows
        self.calls = {"2d": 0, "mapped": 0, "staged": 0}

    def make_slab(self, rows):
        return np.zeros((rows, self.block_bytes), np.uint8)

    def _fence(self):
        self.issued += 1
        return self.issued - 1

    def save(self, pages, rows):
        from infc.runtime.cuda.block_copy_args import pair_runs, row_runs
        self.saved += len(pages)
        self.calls["2d"] += len(pair_runs(zip(pages, rows))) * QWEN3_4B_REGIONS
        self.calls["mapped"] += 2
        st = self.stage_rows
        self.calls["staged"] += 1 + sum(1 + len(row_runs(rows[at:at + st])) for at in range(0, len(rows), st))
        return self._fence()

    def load(self, pages, rows, after_steps=True):
        return self._fence()

    def step_waits(self, fence):
        pass

    def host_wait(self, fence):
        pass


def _runner(num_pages: int, page_size: int):
    from infc.runtime.engine.runner import ComputedAtLaunch, Sample

    class NullRunner(ComputedAtLaunch):
        vocab_size = 1000

        def __init__(self):
            self.num_pages, self.page_size = num_pages, page_size
            self.copies = None

        def execute(self, meta, sampling):
            return [None if s is None else Sample(7) for s in sampling]

        def kv_copies(self):
            from infc import envs
            stage = envs.value("INFC_KV_SAVE_STAGING_BYTES") // (QWEN3_4B_TOKEN_BYTES * page_size)
            self.copies = _NullCopies(max(1, stage))
            return self.copies
    return NullRunner()


def run(tier: bool, page_size: int, num_pages: int | None, host_rows: int | None,
        concurrency: int = 256, in_len: int = 1024, out_len: int = 128, total: int | None = None,
        seed: int = 0) -> dict:
    from infc.runtime.engine.engine import Engine
    from infc.runtime.engine.kv_tier.tiers import GIB, OffloadConfig
    from infc.runtime.engine.sampling import SamplingParams
    total = total or 2 * concurrency
    blocks = -(-(in_len + out_len) // page_size)
    num_pages = num_pages or 2 * total * blocks
    rows = host_rows or max(1, total * blocks // 3)
    config = OffloadConfig(host_gib=rows * _NullCopies.block_bytes / GIB) if tier else None
    runner = _runner(num_pages, page_size)
    eng = Engine(runner, max_num_seqs=concurrency, max_num_batched_tokens=16384,
                 max_model_len=1 << 20, kv_offloading=config)
    clock = TimedCalls(eng.tiers, ("flush", "released", "reusing")) if tier else None
    rng = np.random.default_rng(seed)
    params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
    prompts = [rng.integers(0, 1000, in_len).tolist() for _ in range(total)]
    added = done = steps = 0
    t0 = time.perf_counter()
    for _ in range(min(concurrency, total)):
        eng.add_request(prompts[added], params, f"r{added}")
        added += 1
    while eng.has_unfinished():
        steps += 1
        for o in eng.step():
            if o.request_finished:
                done += 1
                if added < total:
                    eng.add_request(prompts[added], params, f"r{added}")
                    added += 1
    wall = time.perf_counter() - t0
    out = {"tier": tier, "sequences": done, "steps": steps, "wall_s": wall,
           "wall_us_per_seq": wall / done * 1e6}
    if tier:
        out.update(tier_s=clock.seconds, tier_calls=clock.calls,
                   tier_us_per_seq=clock.seconds / done * 1e6, tier_us_per_step=clock.seconds / steps * 1e6,
                   blocks_saved=runner.copies.saved, batches=runner.copies.issued,
                   saved_us_per_block=clock.seconds / max(1, runner.copies.saved) * 1e6,
                   host_rows=eng.tiers.capacity_rows, save_calls=runner.copies.calls)
        eng.bm.check()
    return out


def hits(tier: bool, lengths, page_size: int, num_pages: int, cold: int = 4, warm: int = 5,
         seed: int = 0) -> dict:
    """Median host seconds of warm +16 hits at each length (see the module's doc)."""
    from infc.runtime.engine.engine import Engine
    from infc.runtime.engine.gc_freeze import freeze_startup
    from infc.runtime.engine.kv_tier.tiers import GIB, OffloadConfig
    from infc.runtime.engine.sampling import SamplingParams
    config = OffloadConfig(host_gib=num_pages * _NullCopies.block_bytes / GIB) if tier else None
    runner = _runner(num_pages, page_size)
    eng = Engine(runner, max_num_seqs=64, max_num_batched_tokens=16384, max_model_len=1 << 20,
                 kv_offloading=config)
    freeze_startup()                            # as bench prefix does after loading
    rng = np.random.default_rng(seed)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    n = 0

    def first_token(prompt) -> float:
        nonlocal n
        t0 = time.perf_counter()
        eng.add_request(prompt, one, f"r{n}")
        n += 1
        while eng.has_unfinished():
            eng.step()
        return time.perf_counter() - t0

    out = {"tier": tier}
    for length in lengths:
        prompts = [rng.integers(0, 1000, length).tolist() for _ in range(cold)]
        for p in prompts:
            first_token(p)
        base = prompts[0]
        out[length] = float(np.median([first_token(base + rng.integers(0, 1000, 16).tolist())
                                       for _ in range(warm)]))
    eng.bm.check()
    out["hit_tokens"] = eng.bm.hit_tokens
    if tier:
        out["blocks_saved"] = runner.copies.saved
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--page-size", type=int, help="default: the H200 tuning table's")
    ap.add_argument("--pages", type=int, default=None)
    ap.add_argument("--host-rows", type=int, default=None)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="cProfile one tier-on run instead")
    ap.add_argument("--hits", default=None, help="prompt lengths (comma-separated): time warm hits")
    ap.add_argument("--cold", type=int, default=4, help="--hits: cold prompts of each length first")
    a = ap.parse_args(argv)
    if a.page_size is None:
        from infc.compiler.tuning_table import default_page_size
        a.page_size = default_page_size("h200")
    if a.hits:
        lengths = [int(x) for x in a.hits.split(",")]
        kw = dict(page_size=a.page_size, num_pages=a.pages or QWEN3_4B_H200_PAGES, cold=a.cold)
        if a.profile:
            import cProfile
            import pstats
            cProfile.runctx("hits(True, lengths, **kw)", globals(), {"hits": hits, "lengths": lengths, "kw": kw},
                            "/tmp/tier_hits.prof")
            pstats.Stats("/tmp/tier_hits.prof").sort_stats("tottime").print_stats(25)
            return
        for rep in range(a.reps):
            for tier in (False, True):
                r = hits(tier, lengths, **kw)
                print(f"rep {rep} tier {'on ' if tier else 'off'}: " + ", ".join(
                    f"{n}: {r[n] * 1e3:.2f} ms" for n in lengths), flush=True)
        return
    kw = dict(page_size=a.page_size, num_pages=a.pages, host_rows=a.host_rows, concurrency=a.concurrency)
    if a.profile:
        import cProfile
        import pstats
        cProfile.runctx("run(True, **kw)", globals(), {"run": run, "kw": kw}, "/tmp/tier_host.prof")
        pstats.Stats("/tmp/tier_host.prof").sort_stats("tottime").print_stats(25)
        return
    for rep in range(a.reps):
        for tier in (False, True):              # alternating: the shared CPU's drift hits both
            r = run(tier, **kw)
            extra = (f"  tier {r['tier_us_per_seq']:.0f} us/seq, {r['tier_us_per_step']:.0f} us/step, "
                     f"{r['saved_us_per_block']:.2f} us/saved block ({r['blocks_saved']} blocks, "
                     f"{r['batches']} batches, {r['host_rows']} rows; driver calls {r['save_calls']})") if tier else ""
            print(f"rep {rep} tier {'on ' if tier else 'off'}: {r['sequences']} seqs, {r['steps']} steps, "
                  f"wall {r['wall_s']:.2f} s ({r['wall_us_per_seq']:.0f} us/seq){extra}", flush=True)


if __name__ == "__main__":
    main()
