"""What every op declares, and the registry that makes each op's file its only home.

An op file holds the op's parameters, its shape/dtype rule (`infer`), its numpy reference
(`reference`), and the kernel templates that implement it per backend and phase. Nothing else
in the compiler knows an op's semantics.
"""
from dataclasses import dataclass, field
from typing import Callable

from ..ir import TensorType

REGISTRY: dict[str, "OpDef"] = {}

# A phase that runs as another one except where an op names it: a short step (prefill or mixed of
# at most SHORT_TOKENS tokens, compiler/passes/select_kernels.py) is a mixed step whose linears
# stream their weights with the decode GEMVs; a wide step (a decode step of many sequences) is a
# decode step whose GEMVs tile their rows for many sequences and whose experts (in a model with
# them) run the grouped GEMMs of prefill; a narrow step (a decode step of a few tokens) is a decode
# step with some launches merged (compiler/passes/merge_prologues.py).
PHASE_PARENT = {"short": "mixed", "wide": "decode", "narrow": "decode"}


class ShapeError(Exception):
    """An op's inputs do not fit its rule; the caller adds file and line."""


@dataclass
class OpDef:
    name: str
    tensors: list[str]                     # positional tensor parameters
    omittable: list[str] = field(default_factory=list)  # tensors after them a spec may leave
                                           # out (a norm's weight): present, they leave no trace
                                           # (older plans unchanged); absent, attrs["has_<name>"]
                                           # = False and the later inputs move up
    optional: list[str] = field(default_factory=list)  # optional tensors after them (bias, ...):
                                           # a present one follows the required inputs and sets
                                           # attrs["has_<name>"] = True
    extra_optional: list[str] = field(default_factory=list)  # optional tensors added later (an
                                           # attention's sinks, an expert's biases): after the
                                           # optional ones; a present one sets has_<name>, an
                                           # absent one sets nothing, so older plans are unchanged
    pass_inputs: list[str] = field(default_factory=list)  # optional tensors only passes add, after
                                           # the optional ones (a quantized weight's scales:
                                           # compiler/ops/quant.py); a present one sets has_<name>
    attrs: dict = field(default_factory=dict)   # attribute name -> default (REQUIRED if none)
    extra_attrs: dict = field(default_factory=dict)  # attrs added later (name -> default): a node
                                           # carries one only where its spec gives it, so the
                                           # plans of specs that don't are unchanged
    triton_only_attrs: list[str] = field(default_factory=list)  # attrs only the default (Triton)
                                           # templates implement: a launch with one set stays
                                           # off the feature backends (select_kernels)
    keyword_optional: list[str] = field(default_factory=list)  # optional tensors after the attrs,
                                           # given by keyword (an op whose existing specs pass
                                           # attrs by position, moe_route's bias): absent, no trace
    infer: Callable = None                 # (types: list[TensorType], attrs) -> list[TensorType]
    reference: Callable = None             # (ctx, *arrays, **attrs) -> array | tuple
    templates: dict = field(default_factory=dict)   # backend -> template or {phase: template}
    n_outputs: int = 1
    view: bool = False                     # a view launches nothing: it aliases its input
    inplace: dict = field(default_factory=dict)  # output index -> input index it overwrites
    internal: bool = False                 # made by passes, not written in specs
    strided: bool = False                  # its kernels read row-strided inputs (split views);
                                           # other ops get a `copy` inserted before them
    caches: Callable = None                # (types, attrs) -> {cache name: {kind, shape, dtype}}
                                           # the per-sequence state it writes or reads
    collective: bool = False               # moves data between ranks (ops/collectives.py): its
                                           # reference reads ctx.exchange; launched by NCCL
    phases: tuple | None = None            # the programs that launch it (None: every one); in the
                                           # others its output is read by no launch (expert_upcast)
    unread: bool = False                   # only kernels read its outputs (their ops' references
                                           # compute what they hold): the executors skip its launch
    doc: str = ""

    def template(self, backend: str, phase: str, inherit: bool = True) -> str | None:
        """The template for this backend and phase: the phase's entry, else (inherit) the entry
        of the phase it derives from (short -> mixed, wide -> decode), else "default"; a plain string serves
        every phase. inherit=False: a phase that derives from another takes only its own entry
        (or "default"): select_kernels asks the feature backends that way."""
        t = self.templates.get(backend)
        if not isinstance(t, dict):
            return t
        p = phase
        while p is not None:
            if t.get(p):
                return t[p]
            p = PHASE_PARENT.get(p) if inherit else None
        return t.get("default")


REQUIRED = object()


def op(**kw) -> OpDef:
    d = OpDef(**kw)
    assert d.name not in REGISTRY, d.name
    REGISTRY[d.name] = d
    return d


def same_dim(a, b) -> bool:
    return a == b


def numel_static(shape) -> tuple[int, tuple]:
    """(product of static dims, sorted dynamic symbols)."""
    n, dyn = 1, []
    for d in shape:
        if isinstance(d, str):
            dyn.append(d)
        else:
            n *= d
    return n, tuple(sorted(dyn))


def expect(cond: bool, msg: str):
    if not cond:
        raise ShapeError(msg)


def finite_number(v) -> bool:
    """v is an int or float (not a bool) and finite: an attribute a kernel computes with."""
    import math
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def expect_eps(op_name: str, eps):
    """A norm's epsilon: a finite number >= 0 (a negative one takes the root of a negative
    variance: NaN logits; a string or list fails only when the step runs)."""
    expect(finite_number(eps) and eps >= 0,
           f"{op_name}: eps must be a number >= 0 (the config's norm epsilon), got {eps!r}")


def tt(shape, dtype) -> TensorType:
    return TensorType(tuple(shape), dtype)
