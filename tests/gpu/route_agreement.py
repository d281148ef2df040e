"""Whether a golden-gate fixture's routing is decisive: the experts HF picks in bf16 are the ones it
picks in float32, at every position of every layer (issue 45).

A top-k router turns a last-bit difference at a near-tie into another expert, and from that
position on the reference is another model: a gate against it cannot tell infc's bug from HF's
rounding. gpu_families builds GPT-OSS's fixture so that this cannot happen (its docstring); this
check is that premise, measured on the gate's own sequences, so a fixture that stops being decisive
fails here by name instead of as an unexplained miss of infc."""
import numpy as np
import torch


def router_logits(hf, seqs, suffix: str, device="cuda") -> list[np.ndarray]:
    """Each sequence's router logits [layers, T, E] (float32), from the modules named `suffix`
    (the router's output is (logits, ...) or logits)."""
    mods = [m for n, m in hf.named_modules() if n.endswith(suffix)]
    if not mods:
        raise ValueError(f"no module named '*{suffix}' in {type(hf).__name__}")
    seen = []
    hooks = [m.register_forward_hook(
        lambda _m, _i, o: seen.append((o[0] if isinstance(o, tuple) else o).float().cpu())) for m in mods]
    out = []
    try:
        with torch.no_grad():
            for s in seqs:
                seen.clear()
                hf(torch.tensor([s], device=device))
                out.append(torch.stack([x.reshape(-1, x.shape[-1]) for x in seen]).numpy())
    finally:
        for h in hooks:
            h.remove()
    return out


def agreement(a: list[np.ndarray], b: list[np.ndarray], k: int):
    """(fraction of (layer, position) whose top-k sets agree, how many do not, the smallest
    k-th minus (k+1)-th logit of `a` per layer)."""
    same, margins = [], []
    for x, y in zip(a, b):
        sx = np.sort(np.argsort(-x, -1)[..., :k], -1)
        sy = np.sort(np.argsort(-y, -1)[..., :k], -1)
        same.append((sx == sy).all(-1).ravel())
        top = -np.sort(-x, -1)
        margins.append(top[..., k - 1] - top[..., k])
    same = np.concatenate(same)
    margin = np.concatenate(margins, 1).min(1)
    return float(same.mean()), int((~same).sum()), margin
