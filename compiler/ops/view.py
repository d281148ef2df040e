"""view(x, shape) -> x with a new shape; same elements, no copy, no launch."""
from .base import REQUIRED, expect, numel_static, op, tt


def infer(types, attrs):
    (x,) = types
    shape = tuple(attrs["shape"])
    expect(numel_static(x.shape) == numel_static(shape),
           f"view: cannot view {x} as [{', '.join(map(str, shape))}] (element counts differ)")
    return [tt(shape, x.dtype)]


def reference(ctx, x, shape):
    return x.reshape([ctx.dim(d) for d in shape])


op(name="view", tensors=["x"], attrs={"shape": REQUIRED}, infer=infer, reference=reference,
   view=True, doc="reshape without copying")
