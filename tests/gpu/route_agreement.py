"""Whether a golden-gate fixture's routing is decisive: the experts HF picks in bf16 are the ones it
picks in float32, at every position of every layer (issue 45).

A top-k router turns a last-bit difference at a near-tie into another expert, and from that
position on the reference is another model: a gate against it cannot tell infc's bug from HF's
rounding. gpu_families builds GPT-OSS's fixture so that this cannot happen (its docstring); this
check is that premise, measured on the gate's own sequences, so a fixture that stops being decisive
fails here by name instead of as an unexplained miss of infc."""
import numpy as np
import torch


def choice_margin(router, logits: torch.Tensor) -> torch.Tensor:
    """[T] how far each position's pick is from another pick, in the router's own ranking. A top-k
    router (GPT-OSS): the k-th minus the (k+1)-th logit. DeepSeek-V3's group-limited router (it
    holds e_score_correction_bias): sigmoid score plus bias ranks, a group scores its top-2, the
    top `topk_group` groups are kept and the top-k of their experts picked; the margin is the smaller
    of the two cuts' (group: kept minus first dropped; expert: k-th minus (k+1)-th among the kept).
    DeepSeek-V4's scored router: its score function plus the bias, k-th minus (k+1)-th; its hash
    router (a table picks): infinite."""
    x = logits.float().reshape(-1, logits.shape[-1])
    k = router.top_k
    if hasattr(router, "tid2eid"):              # DeepSeek-V4's hash router: the table picks
        return torch.full_like(x[:, 0], float("inf"))
    bias = getattr(router, "e_score_correction_bias", None)
    if bias is None:
        top = x.topk(k + 1, dim=-1).values
        return top[:, k - 1] - top[:, k]
    if not hasattr(router, "num_group"):        # DeepSeek-V4's: score plus bias, no groups
        top = (router.score_fn(x) + bias.float()).topk(k + 1, dim=-1).values
        return top[:, k - 1] - top[:, k]
    s = x.sigmoid() + bias.float()
    G, kg = router.num_group, router.topk_group
    group = s.view(len(s), G, -1).topk(2, dim=-1).values.sum(-1)            # [T, G]
    gtop = group.sort(dim=-1, descending=True).values
    gmargin = gtop[:, kg - 1] - gtop[:, kg] if kg < G else torch.full_like(gtop[:, 0], float("inf"))
    keep = torch.zeros_like(group).scatter_(1, group.topk(kg, dim=-1).indices, 1.0)
    masked = s.masked_fill(keep.repeat_interleave(s.shape[1] // G, dim=1) == 0, float("-inf"))
    top = masked.topk(k + 1, dim=-1).values
    return torch.minimum(gmargin, top[:, k - 1] - top[:, k])


def routes(hf, seqs, suffix: str, device="cuda", logits: list | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each sequence's (picked experts [layers, T, k], sorted; choice_margin [layers, T]) from the
    router modules named `suffix`, whose output is (logits, weights, indices). logits: a list that
    gets each sequence's model logits [T, V] (float32) from the same forward."""
    mods = [m for n, m in hf.named_modules() if n.endswith(suffix)]
    if not mods:
        raise ValueError(f"no module named '*{suffix}' in {type(hf).__name__}")
    seen = []
    hooks = [m.register_forward_hook(lambda m, _i, o: seen.append(
        (o[2].reshape(-1, o[2].shape[-1]).sort(-1).values.cpu(), choice_margin(m, o[0]).cpu()))) for m in mods]
    out = []
    try:
        with torch.no_grad():
            for s in seqs:
                seen.clear()
                got = hf(torch.tensor([s], device=device))
                if logits is not None:
                    logits.append(got.logits[0].float().cpu().numpy())
                out.append((torch.stack([p for p, _ in seen]).numpy(), torch.stack([m for _, m in seen]).numpy()))
    finally:
        for h in hooks:
            h.remove()
    return out


def route_agreement(a, b):
    """(fraction of (layer, position) where `routes` a and b pick the same experts, how many do not,
    a's smallest choice margin per layer)."""
    same = np.concatenate([(pa == pb).all(-1).ravel() for (pa, _), (pb, _) in zip(a, b)])
    margin = np.concatenate([m for _, m in a], 1).min(1)
    return float(same.mean()), int((~same).sum()), margin
