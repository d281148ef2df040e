"""What the GPU kernels (codegen_templates/triton) take of a quantized scheme, checked by
`infc build` (compiler/build.py) before it renders them, so that a checkpoint they cannot run
fails naming its config key rather than with a kernel's refusal of one launch.

The CPU backend (the numpy definition, compiler/ops/quant.py) computes every scheme the formats
read, so compile_model does not check this (tests run 16 x 48 and 8 x 8 fp8 blocks there).

Activation groups (dynamic_group's act_group: an fp8 block's columns, compressed-tensors'
input_activations.group_size): a K tile quantizes whole groups, so
    gemv.py.j2 / gemm.py.j2     BLOCK_K defaults to the group and must be a multiple of it, the
                                GEMV's FMA_BLOCK_K (a power of two) too, and Triton's tiles are
                                powers of two: a power of two; the GEMM's tiles are at least 16
    _quant.j2 expert_setup      the MoE experts' K tiles: 16 to 512
"""
from ..contract.program import launches
from .scheme import QuantScheme

ACT_GROUP_MIN = 16
EXPERT_ACT_GROUP_MAX = 512
EXPERT_OPS = ("moe_gate_up", "moe_down")


def act_group_refusal(group: int, expert: bool) -> str | None:
    """Why the kernels refuse activation groups of `group` columns (expert: in an MoE expert
    stack's launch), else None."""
    if group < ACT_GROUP_MIN or group & (group - 1):
        return (f"the GPU kernels quantize activations in groups of a power of two of at least "
                f"{ACT_GROUP_MIN} columns (at most {EXPERT_ACT_GROUP_MAX} in MoE experts)")
    if expert and group > EXPERT_ACT_GROUP_MAX:
        return (f"the GPU kernels of MoE experts quantize activations in groups of a power of two from "
                f"{ACT_GROUP_MIN} to {EXPERT_ACT_GROUP_MAX} columns")
    return None


def check_kernel_schemes(fmt, plan: dict):
    """Raise the format's error (naming the config key) for the first quantized launch of the plan
    whose scheme the kernels refuse."""
    if fmt is None:
        return
    for program in plan.get("programs", {}).values():
        for launch, _ in launches(program):
            q = launch.get("attrs", {}).get("quant")
            if not q or q.get("act") != "dynamic_group":
                continue
            s = QuantScheme.from_attrs(q)
            why = act_group_refusal(s.act_group, launch["op"] in EXPERT_OPS)
            if why:
                raise fmt.act_group_error(s, why)
