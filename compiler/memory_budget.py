"""What one GPU (one rank of a parallel plan) holds to serve a plan: its weights, the paged cache
of sequences at a long context, the step's activation arena, against the card's memory. `infc
inspect` prints it per rank, so a parallel layout can be chosen for a model before any GPU runs it
(the frontier MoE lines at 8 ranks, issue 45).

    budget_lines(plan, context=131072) -> ["== memory per GPU ...", ...]
    snapshot_lines(plan) -> the state snapshots of a plan with slot caches (hybrid prefix caching)

The arena is the plan's liveness-planned activations at the serving defaults' step size
(infc/config.py: BATCHED_TOKENS on CUDA, DEFAULT_MAX_NUM_SEQS); the cache is caches.token_bytes
per token of context (every layer's paged caches, latent or K/V, in the plan's cache dtype);
`fits` is how many sequences of that context the card's memory holds after weights and arena,
at DEFAULT_GPU_MEMORY_UTILIZATION, as the runner sizes its KV pool.
"""
from infc.config import BATCHED_TOKENS, DEFAULT_GPU_MEMORY_UTILIZATION, DEFAULT_MAX_NUM_SEQS, DEFAULT_PAGE_SIZE

from .contract import caches
from .quant.report import weight_bytes

# The cards' memory as nvidia-smi reports it on the device machines (memory.total, MiB: an H200's
# in every bench/results gpu.txt; an H100 SXM's 81,559).
GPU_MIB = {"H200": 143_771, "H100": 81_559}
GIB = 1 << 30


def budget(plan: dict, context: int, gpu_mib: int, tokens: int | None = None, seqs: int | None = None) -> dict:
    """The bytes: weights, cache per sequence at `context`, arena at `tokens` / `seqs`, and how
    many such sequences fit in gpu_mib at the default memory utilization."""
    tokens = tokens or BATCHED_TOKENS[("cuda", True)]
    seqs = seqs or DEFAULT_MAX_NUM_SEQS
    weights, _ = weight_bytes(plan)
    decl = caches.of_plan(plan)
    per_seq = caches.token_bytes(decl) * context + caches.slot_bytes(decl)
    a = plan["arena"]
    arena = a["bytes_per_token"] * tokens + a["bytes_per_seq"] * seqs + a["bytes"]
    usable = gpu_mib * (1 << 20) * DEFAULT_GPU_MEMORY_UTILIZATION
    left = usable - weights - arena
    return {"weights": weights, "cache_per_seq": per_seq, "arena": arena, "usable": usable,
            "fits": int(left // per_seq) if per_seq and left > 0 else 0, "left": left,
            "tokens": tokens, "seqs": seqs, "context": context}


def budget_lines(plan: dict, context: int = 131072) -> list[str]:
    out = [f"== memory per GPU, sequences of {context:,} tokens (weights + arena at the serving "
           f"defaults + each sequence's cache, against {DEFAULT_GPU_MEMORY_UTILIZATION:.0%} of the card)"]
    for card, mib in GPU_MIB.items():
        b = budget(plan, context, mib)
        verdict = (f"{b['fits']} sequences fit" if b["fits"] else
                   "does not fit" + (" (weights and arena alone exceed it)" if b["left"] <= 0 else
                                     " (not one sequence's cache)"))
        out.append(f"  {card} ({mib / 1024:.1f} GiB): weights {b['weights'] / GIB:.2f} GiB + arena "
                   f"{b['arena'] / GIB:.2f} GiB (T = {b['tokens']}, B = {b['seqs']}) + "
                   f"{b['cache_per_seq'] / GIB:.3f} GiB a sequence: {verdict}")
    return out


def snapshot_lines(plan: dict) -> list[str]:
    """A plan with slot caches: what its state snapshots (runtime/engine/state_snapshots.py) cost,
    a snapshot and the default pool (one per sequence slot), and per cached token. [] otherwise."""
    decl = caches.of_plan(plan)
    if not caches.has_slots(decl):
        return []
    one, kv = caches.slot_bytes(decl), caches.token_bytes(decl)
    ps = plan.get("build", {}).get("page_size") or DEFAULT_PAGE_SIZE
    pool = caches.snapshot_pool_bytes(decl, DEFAULT_MAX_NUM_SEQS)
    return ["== state snapshots (prefix caching over slot caches: one slot of every slot cache a snapshot)",
            f"  a snapshot {one / (1 << 20):.2f} MiB = the KV of {one / max(kv, 1):,.0f} tokens "
            f"({kv / 1024:.1f} KiB a token); the default pool ({DEFAULT_MAX_NUM_SEQS}, --num-state-snapshots) "
            f"{pool / GIB:.2f} GiB",
            f"  per cached token: {one / 1024 / 1024:.1f} KiB at one snapshot a 1k-token prefix, "
            f"{one / ps / 1024:.1f} KiB at one a {ps}-token block"]


def draft_pages(target_caches: dict, draft_caches: dict, page_size: int, budget: int,
                target_slots: int = 0) -> int:
    """Pages of `page_size` tokens that a target and its draft model (speculative decoding, one
    GPU) each get from one cache budget of `budget` bytes. The draft's cache holds the same tokens
    as the target's: each sequence that speculates has a shadow there holding the target's tokens
    (runtime/engine/speculative/draft_model.py), so a smaller draft cache would stop drafting
    before the target's runs out and a larger one would hold tokens no sequence has. The split is
    then by bytes per token: the two declarations as one, sized by caches.pages_for_budget (each
    cache's padding page and alignment; target_slots: the target's state slots and snapshot
    pool, runner.cache_slots; a draft has no slot caches)."""
    both = {**{f"target.{n}": c for n, c in target_caches.items()},
            **{f"draft.{n}": c for n, c in draft_caches.items()}}
    return caches.pages_for_budget(both, page_size, budget, target_slots)


def draft_split_line(target_caches: dict, draft_caches: dict, page_size: int, pages: int,
                     budget: int | None) -> str:
    """The startup line that says how the cache budget (None: pages asked for) went to the
    target and the draft."""
    t, d = (caches.page_bytes(x, page_size) * (pages + 1) for x in (target_caches, draft_caches))
    of = "as asked" if budget is None else f"of {budget / GIB:.2f} GiB"
    return (f"KV cache split: target {t / GIB:.2f} GiB + draft {d / GIB:.2f} GiB {of}, "
            f"{pages} pages x {page_size} tokens each (the draft holds the tokens the target holds; "
            f"{caches.token_bytes(target_caches) / 1024:.0f} and {caches.token_bytes(draft_caches) / 1024:.0f} "
            f"KiB a token)")
