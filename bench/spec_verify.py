"""`infc bench spec-verify`: what verifying k speculative drafts costs against one decode step
(issue 43), at batch B and context C, on one runner.

    infc bench spec-verify --artifact ART --model-path DIR [--load-format dummy] \
        [--batches 1,8,32] [--drafts 0,1,2,3,4,5,6,7] [--context 1024] [--reps 30]

A verify step is a decode step whose rows are the draft positions (runtime/engine/speculative/):
each of B sequences at context C contributes k + 1 one-token rows at positions C .. C + k, each
row attending to everything before it. So verify(k) at batch B is a decode step of B * (k + 1)
rows: the weights are read once, attention once per row. Each (B, k) is timed as the engine
runs it (runner.execute with a greedy sample per row, CUDA graphs where the runner captured that
row count), median of --reps after warm-up; `ratio` is its time over the decode step's (k = 0)
at the same B. Row counts past the runner's sequences limit are left out (said in the output).
The tokens are random and the pages uninitialized: timing only, as bench latency's decode.
"""
import argparse
import sys
import time

import numpy as np

from .common import header, save


def verify_meta(B: int, k: int, context: int, page_size: int, pages_per_seq: int, rng, vocab: int):
    """The step of B sequences verifying k drafts each at `context` tokens of KV."""
    from infc.runtime.engine.step import Chunk, build_step
    chunks = [Chunk(b, [int(rng.integers(0, vocab))], context + j) for b in range(B) for j in range(k + 1)]
    tables = {b: list(range(b * pages_per_seq, (b + 1) * pages_per_seq)) for b in range(B)}
    return build_step(chunks, tables.__getitem__, page_size)


def time_steps(runner, meta, reps: int, warmup: int = 3, clock=time.perf_counter) -> float:
    """Median ms of runner.execute(meta) with a greedy row per chunk (the token read back)."""
    from infc.runtime.engine.runner import RowSampling
    from infc.runtime.engine.sampling import SamplingParams
    rows = [RowSampling(SamplingParams(temperature=0.0), 0, 0)] * meta.B
    times = []
    for i in range(warmup + reps):
        t0 = clock()
        runner.execute(meta, rows)
        if i >= warmup:
            times.append((clock() - t0) * 1e3)
    return float(np.median(times))


def measure(runner, batches, drafts, context: int, reps: int, seed: int = 0) -> tuple[list, list]:
    """(rows of {batch, drafts, rows, ms, ratio}, skipped (B, k) pairs)."""
    rng = np.random.default_rng(seed)
    limit = getattr(runner, "max_seqs", None) or getattr(runner, "max_num_seqs", None)
    per = -(-(context + max(drafts) + 1) // runner.page_size)
    out, skipped = [], []
    for B in batches:
        if B * per > runner.num_pages:
            raise ValueError(f"batch {B} at context {context} needs {B * per} KV pages, the runner has {runner.num_pages}")
        base = None
        for k in sorted(drafts):
            if limit is not None and B * (k + 1) > limit:
                skipped.append((B, k))
                continue
            ms = time_steps(runner, verify_meta(B, k, context, runner.page_size, per, rng, runner.vocab_size), reps)
            base = ms if k == 0 else base
            out.append({"batch": B, "drafts": k, "rows": B * (k + 1), "ms": ms,
                        "ratio": ms / base if base else None})
            print(f"batch {B:3d}, {k} drafts ({B * (k + 1):3d} rows): {ms:.3f} ms"
                  + (f", {ms / base:.2f}x the decode step" if base else ""), flush=True)
    return out, skipped


def _ints(text: str, flag: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag}: {text!r} is not a comma-separated list of whole numbers") from None
    if not vals or min(vals) < 0:
        raise ValueError(f"{flag}: {text!r}: give one or more whole numbers >= 0")
    return vals


def main(argv=None):
    ap = argparse.ArgumentParser(prog="infc bench spec-verify", description=__doc__.split("\n\n")[0])
    ap.add_argument("--artifact", required=True)
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--load-format", default="auto", choices=("auto", "dummy"))
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--drafts", default="0,1,2,3,4,5,6,7", help="draft counts k (0: the decode step itself)")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    try:
        batches, drafts = _ints(a.batches, "--batches"), _ints(a.drafts, "--drafts")
        if 0 not in drafts:
            drafts = [0] + drafts                       # the ratio's denominator
        from infc.config import DEFAULT_PAGE_SIZE
        from infc.runtime.cuda.runner import CudaRunner
        rows = max(batches) * (max(drafts) + 1)
        per = -(-(a.context + max(drafts) + 1) // DEFAULT_PAGE_SIZE) + 1
        runner = CudaRunner(a.artifact, a.model_path, max_num_batched_tokens=max(rows, 256), max_num_seqs=rows,
                            num_pages=max(batches) * per * 2 + 64, load_format=a.load_format)
    except (ValueError, OSError) as e:
        sys.exit(f"infc bench spec-verify: {e}")
    try:
        res = header(runner.ctx, runner.plan["model"])
        results, skipped = measure(runner, batches, drafts, a.context, a.reps)
    finally:
        runner.close()
    res.update({"context": a.context, "reps": a.reps, "load_format": a.load_format, "results": results,
                "skipped": [{"batch": b, "drafts": k} for b, k in skipped]})
    if skipped:
        print(f"left out (rows past the runner's limit): {skipped}")
    print(f"wrote {save('spec-verify', res, a.out)}")


if __name__ == "__main__":
    main()
