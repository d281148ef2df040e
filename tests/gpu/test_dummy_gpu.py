"""--load-format dummy on the GPU: a directory with only llama-3.2-1b's config.json loads by the
fill_random kernel, with the very bf16 numbers the CPU backend makes (runtime/weights/dummy.py),
fast (no file read, no host staging), and runs steps with finite, reproducible logits."""
import math
import shutil

import numpy as np

from driver_loop import Pages
from infc.runtime.cuda.runner import CudaRunner
from infc.runtime.weights.dummy import weight_values
from infc.compiler.contract.safetensors_io import f32_to_bf16_bits
from infc.runtime.engine.step import Chunk, build_step

MODEL = "llama-3.2-1b"


def prefill_logits(runner) -> np.ndarray:
    rng = np.random.default_rng(3)
    pages = Pages(runner.num_pages, runner.page_size)
    chunks = [Chunk(i, rng.integers(0, runner.vocab_size, n).tolist(), 0) for i, n in enumerate([7, 64])]
    for c in chunks:
        pages.ensure(c.seq_id, len(c.tokens))
    return runner.logits(build_step(chunks, pages.of.__getitem__, runner.page_size)).copy()


def test_dummy_weights_on_the_device(model_dir, artifact, tmp_path):
    d = tmp_path / "config-only"
    d.mkdir()
    shutil.copy(model_dir(MODEL) / "config.json", d / "config.json")
    kw = dict(max_num_batched_tokens=256, max_num_seqs=8, num_pages=64, buckets=[1, 2], load_format="dummy")
    r = CudaRunner(artifact(MODEL), d, **kw)
    try:
        gbps = r.weights.bytes / r.weights.load_s / 1e9
        print(f"\ndummy fill: {r.weights.bytes / 2**30:.2f} GiB in {r.weights.load_s * 1e3:.1f} ms ({gbps:.0f} GB/s)")
        assert gbps > 100                            # on the device: no read, no staging
        plan = r.plan
        # layer 0's weights and the small model-level ones (numpy hashes ~50 M elements a second)
        for name, w in plan["weights"].items():
            if "tied" in w["source"] or math.prod(w["shape"]) > 1 << 26:
                continue
            layer = None if w["layers"] is None else w["layers"][0]
            want = f32_to_bf16_bits(weight_values(name, w, layer)).reshape(-1)
            got = r.ctx.dtoh(np.empty(want.size, np.uint16), r.weights.ptr(name, layer))
            r.ctx.sync()
            assert (got != want).mean() < 1e-6, (name, layer)    # a rare fma-emulation double rounding
        a = prefill_logits(r)
        assert np.isfinite(a).all() and a.std() > 0
    finally:
        r.close()
    r = CudaRunner(artifact(MODEL), d, **kw)
    try:
        assert np.array_equal(prefill_logits(r), a)  # the same weights again
    finally:
        r.close()
