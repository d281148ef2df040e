"""copy(x) -> x, contiguous. Internal: the compiler inserts it before an op whose kernels take
contiguous inputs when its input is a row-strided view (a column slice of a wider buffer, whose
tensor dict carries `row_stride`: element [r, ...] of the view starts at r * row_stride)."""
import numpy as np

from .base import op


def _one(types, attrs):
    return [types[0]]


def reference(ctx, x):
    return np.array(x, copy=True)


op(name="copy", tensors=["x"], infer=_one, reference=reference, templates={"triton": "copy"},
   internal=True, strided=True, doc="make a row-strided view contiguous")
