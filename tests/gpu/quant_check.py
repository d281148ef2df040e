"""Which side of the quantized golden gate is off: the GPU kernels against the CPU reference
executor (the format's definition in float32, compiler/ops/quant.py) and HF's emulation
(tests/gpu/hf_quant.py) against the same, on one prompt of a quantized model the GPU machine wrote.

    python3 tests/gpu/quant_check.py NAME [PROMPT_TOKENS]     (NAME: a models.QUANTIZED entry)

Prints the max |difference| and the top-1 agreement of the last-token logits of each pair, and the
per-layer picture is left to the next step: this says which side to look at.
"""
import json
import sys
import time
from contextlib import closing
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import models  # noqa: E402


def main(name: str, n: int = 24) -> None:
    import torch
    from infc.compiler.contract.safetensors_io import Checkpoint
    from infc.runtime.cuda.runner import CudaRunner
    from infc.runtime.reference.executor import ReferenceExecutor, SeqChunk
    from infc.runtime.weights.load import load_weights
    from driver_loop import Pages, step
    from infc.runtime.engine.step import Chunk
    import hf_quant

    d, art = models.model_dir(name), Path(".cache/artifacts") / name
    plan = json.loads((art / "plan.json").read_text())
    ids = [int(t) for t in np.random.default_rng(0).integers(0, plan["config"].get("V", 1000), n)]
    t = time.time()
    with closing(CudaRunner(str(art), str(d), max_num_batched_tokens=4096, max_num_seqs=4,
                            cuda_graphs=False, buckets=[1], num_pages=256)) as runner:
        gpu = step(runner, Pages(runner.num_pages, runner.page_size), [Chunk(0, ids, 0)])[0]
    print(f"gpu done {time.time() - t:.0f} s", flush=True)
    hf = hf_quant.load(d, torch.float32).cuda().eval()
    with torch.no_grad():
        emu = hf(torch.tensor([ids], device="cuda")).logits[0, -1].float().cpu().numpy()
    del hf
    torch.cuda.empty_cache()
    print(f"hf done {time.time() - t:.0f} s", flush=True)
    report(gpu, emu, "gpu kernels vs hf emulation")
    ref = ReferenceExecutor(plan, load_weights(plan, Checkpoint(d))).step([SeqChunk(0, ids, 0)])[0]
    print(f"reference done {time.time() - t:.0f} s", flush=True)
    report(gpu, ref, "gpu kernels vs reference")
    report(emu, ref, "hf emulation (f32) vs reference")


def report(a, b, what: str):
    print(f"{what}: max |d| {np.abs(a - b).max():.4f}, rel L2 {np.linalg.norm(a - b) / np.linalg.norm(b):.4f}, "
          f"top-1 {'same' if a.argmax() == b.argmax() else 'differs'}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:]))
