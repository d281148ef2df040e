"""expert_upcast(codes[E, N, K], w_scale[, w_zero]) -> W bf16 [E, N, K]: a quantized expert stack
dequantized once, by the scheme's definition (compiler/ops/quant.py dequantize), for the grouped
expert GEMMs of a step with many tokens an expert (compiler/passes/upcast_experts.py, which uses
it for weight-only 4-bit codes; the op and its kernel take any expert scheme).

    W[e, n, k] = bf16((value(codes[e, n, k]) - zero[e, n // block_n, g(k)]) * scale[e, n // block_n, g(k)])

which is the tile a grouped GEMM dequantizes in its registers, rounded to bf16 as that GEMM
rounds it before its dot: a GEMM reading W here computes what it computes from the codes.
attrs: quant (the scheme), rows (the launch runs only in steps of at least that many rows of the
dim `dim`, T or a data-parallel plan's G; below it the GEMMs read the codes), as its consumer's
upcast_rows. Internal: launched only by the prefill and mixed programs; the others read the
codes: short (at most 64 tokens: below any rows but a model whose every expert is always on) and
the decode programs (decode, narrow, verify, and wide, whose grouped GEMMs serve a decode step's
one or two blocks of tokens an expert). The grouped templates render the branch for these phases
alone.
Resident mode (attrs at_load; its consumers' upcast_resident): launched by the load program alone,
once, rows 1, writing a derived weight (compiler/passes/upcast_experts.py); the grouped GEMMs of
RESIDENT_PHASES read it at their upcast_rows and above, the decode, narrow and verify GEMVs the
codes.
"""
from .base import REQUIRED, expect, op, tt
from .quant import COMPANIONS, dequantize, scheme_of

# the programs that launch it (the grouped templates' UP takes the same list)
UPCAST_PHASES = ("prefill", "mixed")
# the programs whose grouped GEMMs read a resident stack (attrs upcast_resident): every program
# that runs the grouped templates (short through mixed's, wide its own)
RESIDENT_PHASES = ("prefill", "mixed", "short", "wide")


def reading_phases(attrs: dict) -> tuple:
    """The programs whose grouped GEMMs read an expert op's bf16 stack (attrs has_w_upcast) at
    its upcast_rows and above: stack_written below, and the grouped templates' UP
    (triton/moe_*_grouped.py.j2, through compiler/codegen/render.py's `upcast_reads` filter)."""
    return RESIDENT_PHASES if attrs.get("upcast_resident") else UPCAST_PHASES


def infer(types, attrs):
    w = types[0]
    s = scheme_of(attrs)
    expect(s is not None, "expert_upcast: needs attrs.quant (the stack's scheme)")
    expect(len(w.shape) == 3 and w.dtype == s.codes, f"expert_upcast: codes must be {s.codes} [E, N, K], got {w}")
    names = s.companions()
    expect(not s.g_idx and not s.act == "static" and [c for c in COMPANIONS if attrs.get("has_" + c)] == names
           and len(types) == 1 + len(names),
           f"expert_upcast: scheme {s} needs inputs {names} after the codes (no g_idx, no x_scale)")
    expect(isinstance(attrs.get("rows"), int) and attrs["rows"] > 0,
           f"expert_upcast: rows must be a positive int, got {attrs.get('rows')!r}")
    expect(attrs.get("dim") in ("T", "G"), f"expert_upcast: dim must be T or G, got {attrs.get('dim')!r}")
    return [tt(w.shape, "bf16")]


def stack_written(ctx, rows: int, attrs: dict) -> bool:
    """Whether an expert op's reference reads the stack expert_upcast wrote this step (its attrs
    has_w_upcast, upcast_rows; rows: the rows it is launched over, T or G): as its grouped kernel,
    in the programs that launch the upcast and at its rows. ctx.program names the program the
    executor runs (no ctx, or None, outside a plan's step: the codes)."""
    return (bool(attrs.get("has_w_upcast")) and getattr(ctx, "program", None) in reading_phases(attrs)
            and rows >= attrs["upcast_rows"])


def reference(ctx, w, *rest, quant, rows, dim="T", **attrs):
    # below its rows the launch's grid is empty: nothing is written (the buffer keeps whatever it
    # held, the executor's NaN poison), and the experts' references read the codes, as the kernels
    # (the load program's launch: no ctx, rows 1, always written)
    if ctx is not None and ctx.dim(dim) < rows:
        return None
    s = scheme_of({"quant": quant})
    got = dict(zip(s.companions(), rest))
    return dequantize(w, s, got["w_scale"], got.get("w_zero"))


op(name="expert_upcast", tensors=["codes"], pass_inputs=["w_scale", "w_zero"],
   attrs={"quant": REQUIRED, "rows": REQUIRED, "dim": "T"}, infer=infer, reference=reference, internal=True,
   templates={"triton": {"prefill": "expert_upcast", "mixed": "expert_upcast", "load": "expert_upcast"}},
   phases=UPCAST_PHASES,
   doc="a quantized expert stack dequantized to bf16 once, for the grouped GEMMs of a many-token step")
