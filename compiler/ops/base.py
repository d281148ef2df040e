"""What every op declares, and the registry that makes each op's file its only home.

An op file holds the op's parameters, its shape/dtype rule (`infer`), its numpy reference
(`reference`), and the kernel templates that implement it per backend and phase. Nothing else
in the compiler knows an op's semantics.
"""
from dataclasses import dataclass, field
from typing import Callable

from ..ir import TensorType

REGISTRY: dict[str, "OpDef"] = {}


class ShapeError(Exception):
    """An op's inputs do not fit its rule; the caller adds file and line."""


@dataclass
class OpDef:
    name: str
    tensors: list[str]                     # positional tensor parameters
    optional: list[str] = field(default_factory=list)  # optional tensors after them (bias, ...):
                                           # a present one follows the required inputs and sets
                                           # attrs["has_<name>"] = True
    attrs: dict = field(default_factory=dict)   # attribute name -> default (REQUIRED if none)
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
    doc: str = ""

    def template(self, backend: str, phase: str) -> str | None:
        t = self.templates.get(backend)
        if isinstance(t, dict):
            return t.get(phase) or t.get("default")
        return t


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


def tt(shape, dtype) -> TensorType:
    return TensorType(tuple(shape), dtype)
