"""--kv-cache-dtype fp8 on a GPU: an auto and an fp8 build of one model (random weights made on the
device, --load-format dummy), each against its plan's numpy reference (the oracle) and against each
other on the same steps, with the KV pages each fits at one --gpu-memory-utilization and the decode
step time of 8 sequences at 16k context (KV-read bound).
    python3 tests/gpu/kv_fp8_check.py CONFIG_DIR AUTO_ARTIFACT FP8_ARTIFACT OUT.json
"""
import json
import sys
import time

import numpy as np

sys.path.insert(0, "tests/gpu")
from driver_loop import Pages, step  # noqa: E402

from infc.runtime.cuda.runner import CudaRunner  # noqa: E402
from infc.runtime.engine.step import Chunk  # noqa: E402
from infc.runtime.reference.executor import ReferenceExecutor  # noqa: E402
from infc.runtime.weights.dummy import dummy_weights  # noqa: E402


def rel(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def steps(rng, vocab):
    """A prefill of three prompts, then four decode steps of fixed tokens."""
    prompts = [rng.integers(0, vocab, n).tolist() for n in (97, 230, 13)]
    out = [[Chunk(i, p, 0) for i, p in enumerate(prompts)]]
    for s in range(4):
        out.append([Chunk(i, [100 + 7 * s + i], len(p) + s) for i, p in enumerate(prompts)])
    return out


def long_context_ms(r, B=8, ctx=16384, n=20) -> float:
    pages = Pages(r.num_pages, r.page_size)
    rng = np.random.default_rng(1)
    chunk = 8192 // B
    for start in range(0, ctx, chunk):
        step(r, pages, [Chunk(b, rng.integers(0, 1000, chunk).tolist(), start) for b in range(B)])
    t0 = time.perf_counter()
    for s in range(n):
        step(r, pages, [Chunk(b, [5 + b], ctx + s) for b in range(B)])
    return (time.perf_counter() - t0) / n * 1e3


def main(cfg, auto, fp8, out):
    res, got, ref = {}, {}, {}
    for kv, art in (("auto", auto), ("fp8", fp8)):
        r = CudaRunner(art, cfg, load_format="dummy", max_num_batched_tokens=8192, max_num_seqs=16,
                       gpu_memory_utilization=0.9)
        plan = r.plan
        todo = steps(np.random.default_rng(0), int(r.vocab_size))
        pages = Pages(r.num_pages, r.page_size)
        got[kv] = np.concatenate([step(r, pages, s) for s in todo])
        res[kv] = {"num_pages": r.num_pages, "page_size": r.page_size,
                   "kv_dtype": plan["caches"]["k"]["dtype"],
                   "decode_ms_8x16k": long_context_ms(r)}
        r.close()
        ex = ReferenceExecutor(plan, dummy_weights(plan))
        ref[kv] = np.concatenate([ex.step(s) for s in todo])
        res[kv]["rel_vs_reference"] = rel(got[kv], ref[kv])
        res[kv]["argmax_vs_reference"] = float((got[kv].argmax(-1) == ref[kv].argmax(-1)).mean())
        print(kv, res[kv], flush=True)
    res["fp8_vs_auto_gpu"] = rel(got["fp8"], got["auto"])
    res["fp8_vs_auto_reference"] = rel(ref["fp8"], ref["auto"])
    res["argmax_fp8_vs_auto_gpu"] = float((got["fp8"].argmax(-1) == got["auto"].argmax(-1)).mean())
    res["pages_ratio"] = res["fp8"]["num_pages"] / res["auto"]["num_pages"]
    print(json.dumps(res, indent=1))
    with open(out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:5])
