"""The one walker of a plan's programs (schema infc.plan/2).

A program is an ordered list of launches; one entry may instead be the layer repeat
    {"repeat": "layers", "count": L, "schedule": [kind of layer 0, ...], "kinds": {kind: [launches]},
     "carried": {...}, "inputs": [...], "outputs": [...]}
whose layer i runs kinds[schedule[i]] with global layer index i (for weights and caches).
Every executor, the inspector, the tuner and the renderer walk programs through this module, so
the repeat's shape is known in one place. Pure Python: the compiler imports it too.
"""
from collections import Counter


def is_repeat(entry: dict) -> bool:
    return "repeat" in entry


def bodies(repeat: dict) -> dict[str, list]:
    """kind -> its launches, checked against the schedule (a malformed repeat fails here)."""
    kinds, schedule = repeat.get("kinds"), repeat.get("schedule")
    if not isinstance(kinds, dict) or not isinstance(schedule, list):
        raise ValueError(f"repeat '{repeat.get('repeat')}' has no kinds/schedule (a plan older than "
                         f"infc.plan/2? rebuild it)")
    if len(schedule) != repeat["count"]:
        raise ValueError(f"repeat '{repeat['repeat']}': schedule names {len(schedule)} layers, "
                         f"count is {repeat['count']}")
    unknown = sorted(set(schedule) - set(kinds))
    if unknown:
        raise ValueError(f"repeat '{repeat['repeat']}': schedule uses unknown kinds {unknown}")
    return kinds


def layer_counts(repeat: dict) -> Counter:
    """kind -> how many layers run it."""
    bodies(repeat)
    return Counter(repeat["schedule"])


def repeats(program: list) -> list[dict]:
    """The program's repeat entries (a plan has at most one today: the layers)."""
    return [e for e in program if is_repeat(e)]


def unrolled(program: list):
    """Yields (launch, layer) in execution order; layer is the global layer index inside the
    repeat, None outside it."""
    for entry in program:
        if not is_repeat(entry):
            yield entry, None
            continue
        kinds = bodies(entry)
        for i, kind in enumerate(entry["schedule"]):
            for launch in kinds[kind]:
                if is_repeat(launch):
                    raise ValueError("nested repeats are not supported")
                yield launch, i


def launches(program: list):
    """Yields (launch, runs per step) for each distinct launch once, in program order: a kind's
    launch runs once per layer of that kind. For passes over launch dicts (render, tune)."""
    for entry in program:
        if not is_repeat(entry):
            yield entry, 1
            continue
        counts = layer_counts(entry)
        for kind, body in bodies(entry).items():
            for launch in body:
                yield launch, counts[kind]


def count_launches(program: list) -> tuple[int, int]:
    """(launches per step, launches per layer of the most common kind)."""
    total = sum(n for _, n in launches(program))
    per_layer = 0
    for r in repeats(program):
        kind, _ = layer_counts(r).most_common(1)[0] if r["count"] else (None, 0)
        per_layer = len(bodies(r)[kind]) if kind is not None else 0
    return total, per_layer


def program_name(plan: dict, phase: str, T: int) -> str:
    """The program a step of this phase and T tokens runs: "short" for a prefill or mixed step of
    at most plan["short_tokens"] tokens (its linears stream the weights with the decode GEMVs),
    "wide" for a decode step of at least plan["wide_tokens"] (the GEMVs' row tiles for many
    sequences; the experts' grouped GEMMs); see compiler/passes/select_kernels.py. "narrow" for a
    decode step of at most plan["narrow_tokens"] (one: launches merged for a token,
    compiler/passes/merge_prologues.py), "verify" for one of more tokens than that and at most
    plan["verify_tokens"] (a speculative build's: the narrow launches rendered k + 1 rows wide, a
    verify step's rows at batch 1). Else the phase's own. A plan without those keys runs every
    step as its phase."""
    if phase in ("prefill", "mixed") and T <= plan.get("short_tokens", 0) and "short" in plan["programs"]:
        return "short"
    if phase == "decode" and "narrow" in plan["programs"] and T <= plan.get("narrow_tokens", 0):
        return "narrow"
    if phase == "decode" and "verify" in plan["programs"] and T <= plan.get("verify_tokens", 0):
        return "verify"
    if phase == "decode" and "wide" in plan["programs"] and T >= plan.get("wide_tokens", 1 << 62):
        return "wide"
    return phase
