"""How much of the golden gate's error is HF bf16's own? (an experiment, not a test)

    python3 tests/gpu/golden_noise.py NAME [NAME ...] [--out DIR]

For each model: HF in bf16 and the same weights in fp32, on the GPU, over the golden gate's
sequences (test_golden.LENS + the family's long prompts, 16 teacher-forced tokens), and infc
eager batch 1. Prints gate(HF bf16 vs HF fp32), gate(infc vs HF fp32) and gate(infc vs HF bf16)
with test_golden's metrics (regret nat, mean and p99 |delta logprob| over the top 8). If infc is
as close to fp32 as HF bf16 is, a miss against HF bf16 is HF's rounding as much as ours."""
import json
import sys
from contextlib import closing
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_families  # noqa: E402
import models  # noqa: E402
from test_golden import DECODE, LENS, gate, hf_logits, run  # noqa: E402
from infc.runtime.cuda.runner import CudaRunner  # noqa: E402


def summary(pairs):
    g = [gate(a, b) for a, b in pairs]
    return {"regret": max(x[0] for x in g), "mean": float(np.mean([x[1] for x in g])),
            "p99": max(x[2] for x in g)}


def main(names, out):
    res = {}
    for name in names:
        d, art = models.model_dir(name), models.artifact(name)
        from transformers import AutoModelForCausalLM
        rng = np.random.default_rng(0)
        hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.bfloat16).cuda().eval()
        V = hf.config.vocab_size
        lens = list(LENS) + gpu_families.LONG_PROMPTS.get(name, [])
        seqs = [[int(t) for t in rng.integers(0, V, n + DECODE)] for n in lens]
        want = {}
        for dtype in ("bf16", "fp32"):
            if dtype == "fp32":
                hf = hf.float()
            want[dtype] = hf_logits(hf, seqs)
        del hf
        torch.cuda.empty_cache()
        with closing(CudaRunner(art, d, max_num_batched_tokens=16384, max_num_seqs=16, cuda_graphs=False,
                                buckets=[1], num_pages=2048)) as runner:
            got = run(runner, seqs, 1)
        res[name] = {"hf_bf16_vs_fp32": summary(zip(want["bf16"], want["fp32"])),
                     "infc_vs_fp32": summary(zip(got, want["fp32"])),
                     "infc_vs_bf16": summary(zip(got, want["bf16"]))}
        print(name, json.dumps(res[name]), flush=True)
        models.remove(name)
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "golden-noise.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    args = sys.argv[1:]
    out = None
    if "--out" in args:
        i = args.index("--out")
        out = args[i + 1]
        del args[i:i + 2]
    main(args, out)
