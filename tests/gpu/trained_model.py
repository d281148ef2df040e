"""A tiny Llama trained on the GPU machine in ~20 s, for tests that compare greedy outputs.

Random weights give nearly flat distributions: top-2 logprob gaps of 0.005-0.07 nat are common,
and bf16 rounding that differs between two valid kernel paths (a decode row computed in a mixed
step, KV recomputed after preemption) flips those near-ties. A trained model is confident, so
greedy outputs are a function of the context, not of rounding.

The task needs the KV cache: x[t+1] = perm[x[t-1]] (the token two back, mapped by a fixed
permutation), so every prediction reads the previous position's key and value. A prompt that
follows the rule is continued by the rule; any page mix-up breaks it.
"""
import json
from pathlib import Path

import numpy as np

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256,
          "intermediate_size": 768, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 1024,
          "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
          "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
          "attention_bias": False, "mlp_bias": False, "torch_dtype": "bfloat16"}
PERM = np.random.default_rng(2024).permutation(CONFIG["vocab_size"])


def follow(start: list[int], n: int) -> list[int]:
    """The rule's sequence: start (two tokens or more) extended to n tokens."""
    x = list(start)
    while len(x) < n:
        x.append(int(PERM[x[-2]]))
    return x


def prompt(rng, n: int) -> list[int]:
    return follow(rng.integers(0, CONFIG["vocab_size"], 2).tolist(), n)


def config_json() -> dict:
    """config.json as the trained model's directory holds it (prepare.py builds its serving
    artifact from the same dict, so the GPU machine compiles nothing)."""
    from transformers import LlamaConfig
    cfg = {k: v for k, v in CONFIG.items() if k not in ("architectures", "model_type", "torch_dtype")}
    out = LlamaConfig(**cfg).to_dict()
    out.update({"architectures": CONFIG["architectures"], "torch_dtype": "bfloat16"})
    out.pop("transformers_version", None)
    return out


def ensure_trained(out: Path, steps: int = 2000, log=print) -> Path:
    out = Path(out)
    if (out / "model.safetensors").exists():
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = {k: v for k, v in CONFIG.items() if k not in ("architectures", "model_type", "torch_dtype")}
    model = LlamaForCausalLM(LlamaConfig(**cfg)).cuda()
    perm = torch.tensor(PERM, device="cuda")
    V, B, S = CONFIG["vocab_size"], 256, 256
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps, pct_start=0.1)

    powers = [torch.arange(V, device="cuda")]            # perm applied k times, k < S / 2
    for _ in range(S // 2 - 1):
        powers.append(perm[powers[-1]])
    powers = torch.stack(powers)

    def batch():
        start = torch.randint(0, V, (B, 2), device="cuda")
        return powers[:, start].permute(1, 0, 2).reshape(B, S)   # x[2k + j] = perm^k(start[j])

    for step in range(steps):
        x = batch()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(x).logits[:, 1:-1]          # position 0 cannot know x[1]
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, V), x[:, 2:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if log and step % 250 == 0:
            log(f"  train step {step}: loss {loss.item():.4f}")
    model = model.to(torch.bfloat16).eval()
    with torch.no_grad():
        x = batch()
        lp = model(x).logits[:, 1:-1].float().log_softmax(-1)
        acc = (lp.argmax(-1) == x[:, 2:]).float().mean().item()
        top2 = lp.topk(2, -1).values
        gap = (top2[..., 0] - top2[..., 1]).min().item()
    if log:
        log(f"  trained: accuracy {acc:.5f}, smallest top-2 gap {gap:.2f} nat")
    if acc < 0.999 or gap < 1.0:
        raise RuntimeError(f"the tiny model did not learn its task (accuracy {acc:.4f}, min gap {gap:.2f})")
    model.save_pretrained(out, safe_serialization=True)
    (out / "config.json").write_text(json.dumps(config_json(), indent=1))
    return out
