"""`infc bench quant-accuracy`: how far a quantized model's next-token distributions are from its
bf16 model's, on the same token sequences, beside the speed numbers (issue 42).

    infc bench quant-accuracy --reference BF16_DIR --model-path QUANT_DIR [--device cpu]
    infc bench quant-accuracy --reference BF16_DIR --reference-artifact ART \
        --model-path QUANT_DIR --artifact QART --device cuda

Each sequence is a prompt then DECODE teacher-forced tokens (random token ids from --seed, or
--prompts-file: a JSON list of token-id lists, each prompt + forced tokens); both models see the
same tokens, and at each of the DECODE positions (after the prompt, after each forced token) the
two logit rows give

    KL(P_bf16 || P_quant) = sum_v p_bf16(v) (log p_bf16(v) - log p_quant(v))     (nats)
    top-1 agreement       = argmax of both rows equal

reported as the mean over positions (and KL's p99 and max). The CPU runs the numpy reference
executor (a tiny model in tests), the GPU the CUDA runner on each artifact, one model at a time.
"""
import argparse
import json
import sys
from pathlib import Path

import numpy as np

from infc.compiler.contract.errors import ModelDirError, SpecError

from .common import header, save

DECODE = 16


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def compare(reference: list, quantized: list) -> dict:
    """The accuracy figures of two models' logit rows ([positions, V] per sequence, alike)."""
    ref, q = np.concatenate(reference), np.concatenate(quantized)
    if ref.shape != q.shape:
        raise ValueError(f"logits of shape {ref.shape} and {q.shape}: not the same positions and vocabulary")
    lp, lq = log_softmax(ref), log_softmax(q)
    kl = (np.exp(lp) * (lp - lq)).sum(-1)
    return {"positions": int(len(kl)), "mean_kl": float(kl.mean()), "p99_kl": float(np.quantile(kl, 0.99)),
            "max_kl": float(kl.max()), "top1_agreement": float((ref.argmax(-1) == q.argmax(-1)).mean())}


def teacher_forced(step, seqs: list, decode: int) -> list:
    """Each sequence's logits ([decode, V]) after its prompt and after each forced token, all
    sequences in each step. step(chunks) -> f32 [B, V], a row per chunk."""
    from infc.runtime.engine.step import Chunk
    prompts = [len(s) - decode for s in seqs]
    if min(prompts) < 1:
        raise ValueError(f"every sequence needs a prompt of at least 1 token before its {decode} forced ones")
    rows = [[] for _ in seqs]
    for t in range(decode):
        chunks = [Chunk(i, s[:n] if t == 0 else [s[n + t - 1]], 0 if t == 0 else n + t - 1)
                  for i, (s, n) in enumerate(zip(seqs, prompts))]
        for i, row in enumerate(step(chunks)):
            rows[i].append(np.array(row, np.float32))
    return [np.stack(r) for r in rows]


def cpu_logits(model_dir, seqs: list, decode: int) -> list:
    """The numpy reference executor on the model directory (its checkpoint, quantized or not)."""
    from infc.compiler.build import compile_model
    from infc.compiler.contract.safetensors_io import Checkpoint
    from infc.runtime.reference.executor import ReferenceExecutor
    from infc.runtime.weights.load import load_weights
    _, plan = compile_model(model_dir=str(model_dir))
    ex = ReferenceExecutor(plan, load_weights(plan, Checkpoint(model_dir)))
    return teacher_forced(ex.step, seqs, decode)


def cuda_logits(artifact, model_dir, seqs: list, decode: int, gpu: list | None = None) -> list:
    """The CUDA runner on an artifact (its device memory given back before the next model); the
    GPU's name is appended to `gpu`."""
    from infc.runtime.cuda.runner import CudaRunner
    from infc.runtime.engine.step import build_step
    longest = max(len(s) for s in seqs)
    runner = CudaRunner(artifact, model_dir, max_num_batched_tokens=max(sum(len(s) for s in seqs), 256),
                        max_num_seqs=max(len(seqs), 1), max_model_len=longest, cuda_graphs=False)
    if gpu is not None:
        gpu.append(runner.ctx.name)
    try:
        per = -(-longest // runner.page_size)
        if per * len(seqs) > runner.num_pages:
            raise ValueError(f"{len(seqs)} sequences of {longest} tokens need {per * len(seqs)} KV pages, "
                             f"the runner has {runner.num_pages}")
        pages = {i: list(range(i * per, (i + 1) * per)) for i in range(len(seqs))}
        slots = (lambda seq: seq) if getattr(runner, "num_slots", 0) else None   # hybrid models' state

        def step(chunks):
            return runner.logits(build_step(chunks, pages.__getitem__, runner.page_size, slot_of=slots))
        return teacher_forced(step, seqs, decode)
    finally:
        runner.close()


def sequences(vocab: int, count: int, prompt_len: int, decode: int, seed: int) -> list:
    rng = np.random.default_rng(seed)
    lens = rng.integers(max(1, prompt_len // 2), prompt_len + 1, count)
    return [[int(t) for t in rng.integers(0, vocab, n + decode)] for n in lens]


def run(reference, model_path, device="cpu", reference_artifact=None, artifact=None, seqs=None,
        count=8, prompt_len=64, decode=DECODE, seed=0) -> dict:
    """The accuracy result (a dict, as saved) of the model at model_path against reference."""
    cfg = json.loads((Path(reference) / "config.json").read_text())
    seqs = seqs or sequences(cfg["vocab_size"], count, prompt_len, decode, seed)
    gpu = []
    if device == "cpu":
        ref, q = cpu_logits(reference, seqs, decode), cpu_logits(model_path, seqs, decode)
    else:
        if not (reference_artifact and artifact):
            raise ValueError("--device cuda needs --reference-artifact and --artifact")
        ref = cuda_logits(reference_artifact, reference, seqs, decode, gpu)
        q = cuda_logits(artifact, model_path, seqs, decode)
    qcfg = json.loads((Path(model_path) / "config.json").read_text()).get("quantization_config")
    return {**header(gpu[0] if gpu else device, Path(model_path).name), "reference": str(reference), "quantization_config": qcfg,
            "device": device, "sequences": len(seqs), "decode": decode, **compare(ref, q)}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="infc bench quant-accuracy", description=__doc__.split("\n\n")[0])
    ap.add_argument("--reference", required=True, help="the bf16 model directory")
    ap.add_argument("--model-path", required=True, help="the quantized model directory")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--reference-artifact", help="the bf16 build (--device cuda)")
    ap.add_argument("--artifact", help="the quantized build (--device cuda)")
    ap.add_argument("--sequences", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64, help="prompts of prompt-len / 2 .. prompt-len tokens")
    ap.add_argument("--decode", type=int, default=DECODE, help="teacher-forced positions a sequence")
    ap.add_argument("--prompts-file", help="a JSON list of token-id lists (prompt + the forced tokens)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    try:
        seqs = json.loads(Path(a.prompts_file).read_text()) if a.prompts_file else None
        res = run(a.reference, a.model_path, a.device, a.reference_artifact, a.artifact, seqs,
                  a.sequences, a.prompt_len, a.decode, a.seed)
    except (ValueError, OSError, ModelDirError, SpecError) as e:
        sys.exit(f"infc bench quant-accuracy: {e}")
    print(f"{res['model']} vs {Path(a.reference).name} ({a.device}, {res['positions']} positions): "
          f"mean KL {res['mean_kl']:.3g} nats (p99 {res['p99_kl']:.3g}), top-1 agreement {res['top1_agreement']:.1%}")
    print(f"wrote {save('quant-accuracy', res, a.out)}")


if __name__ == "__main__":
    main()
