"""HF's figures beside `infc bench quant-accuracy`'s (issue 42): the same sequences, the same
KL(P_bf16 || P_quant) and top-1 agreement, with HF's bf16 model of the reference directory and HF's
model of the quantized checkpoint (hf_quant.load: the format's definition). A random-weight model
is chaotic enough that quantizing it moves its logits far; what infc must show is the distance
HF shows for the same checkpoint.

    python3 tests/gpu/hf_quant_accuracy.py --reference BF16_DIR --model-path QUANT_DIR \
        --sequences 16 --prompt-len 512 --out DIR
"""
import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hf_quant  # noqa: E402
from infc.bench.common import header, save  # noqa: E402
from infc.bench.quant_accuracy import DECODE, compare, sequences  # noqa: E402


def logits(model, seqs, decode) -> list:
    """[decode, V] per sequence: the rows after its prompt and after each forced token."""
    out = []
    with torch.no_grad():
        for s in seqs:
            n = len(s) - decode
            lg = model(torch.tensor([s], device="cuda")).logits[0]
            out.append(lg[n - 1: n - 1 + decode].float().cpu().numpy())
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--reference", required=True)
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--sequences", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    cfg = json.loads((Path(a.reference) / "config.json").read_text())
    seqs = sequences(cfg["vocab_size"], a.sequences, a.prompt_len, DECODE, a.seed)
    from transformers import AutoModelForCausalLM
    runs = []
    for load in (lambda: AutoModelForCausalLM.from_pretrained(a.reference, dtype=torch.bfloat16),
                 lambda: hf_quant.load(a.model_path, torch.bfloat16)):
        model = load().cuda().eval()
        runs.append(logits(model, seqs, DECODE))
        del model
        torch.cuda.empty_cache()
    res = {**header(torch.cuda.get_device_name(), Path(a.model_path).name), "engine": "hf",
           "reference": str(a.reference), "sequences": len(seqs), "decode": DECODE, **compare(*runs)}
    print(f"HF: {res['model']} vs {Path(a.reference).name} ({res['positions']} positions): mean KL "
          f"{res['mean_kl']:.3g} nats (p99 {res['p99_kl']:.3g}), top-1 agreement {res['top1_agreement']:.1%}")
    print(f"wrote {save('quant-accuracy-hf', res, a.out)}")


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
