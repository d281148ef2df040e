"""Where a narrow LoRA site may keep its sync words in sets (gemv.py.j2 LORA_SETS).

A launch of such a kernel uses set (layer + 1) % SETS of the kernel's scratch and zeroes every other
set, instead of having each program depart so that the last can zero the words. That is right only
if the launch of the same kernel that runs next never uses the same set: it would find the words
this launch left. Every program of the plan may run at any step after any other, so for each kernel
the sets of its launches must differ back to back inside every program, and from the last launch
of every program to the first of every program (itself included: the next step). A kernel that
fails gets its launches rendered with lora.sets false (the departures), which changes the kernel
(render.py repeats this until every kernel holds).
"""
from infc.compiler.contract.bind import LORA_SET_COUNT as SETS, LORA_SETS as SCRATCH
from infc.compiler.contract.program import unrolled


def set_of(layer) -> int:
    """The set a launch at this global layer index uses (-1: outside the layers)."""
    return ((-1 if layer is None else layer) + 1) % SETS


def sequences(plan: dict, kernels: dict) -> dict[str, dict[str, list[int]]]:
    """kernel id -> program -> the sets of its launches in execution order, for the kernels that
    keep their words in sets."""
    out: dict[str, dict[str, list[int]]] = {}
    for phase, program in plan["programs"].items():
        for launch, layer in unrolled(program):
            k = kernels.get(launch.get("kernel_id"))
            if k is not None and SCRATCH in k.meta.get("scratch", {}):
                out.setdefault(k.id, {}).setdefault(phase, []).append(set_of(layer))
    return out


def clashing(plan: dict, kernels: dict) -> set[str]:
    """The kernels (ids) whose launches could run back to back on the same set."""
    bad = set()
    for kid, per in sequences(plan, kernels).items():
        firsts = {seq[0] for seq in per.values()}
        if any(a == b for seq in per.values() for a, b in zip(seq, seq[1:])) \
                or any(seq[-1] in firsts for seq in per.values()):
            bad.add(kid)
    return bad
