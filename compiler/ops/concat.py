"""concat(a[..., Na], b[..., Nb]) -> [..., Na + Nb]: the two tensors side by side along their last
axis (their leading dims equal, their dtypes too). DeepSeek MLA builds its absorbed query
[q_lat | roped q_pe] and its latent row [normed c_kv | roped k_pe] with it."""
import numpy as np

from .base import expect, op, tt


def infer(types, attrs):
    a, b = types
    expect(len(a.shape) >= 1 and len(a.shape) == len(b.shape) and a.shape[:-1] == b.shape[:-1],
           f"concat joins tensors of equal leading dims along the last axis; got {a} and {b}")
    expect(a.dtype == b.dtype, f"concat of {a.dtype} and {b.dtype}: the dtypes must agree")
    return [tt(a.shape[:-1] + (a.shape[-1] + b.shape[-1],), a.dtype)]


def reference(ctx, a, b):
    return np.concatenate([np.asarray(a, np.float32), np.asarray(b, np.float32)], axis=-1)


op(name="concat", tensors=["a", "b"], infer=infer, reference=reference, templates={"triton": "concat"},
   doc="two tensors side by side along the last axis (MLA's [q_lat | q_pe], [c_kv | k_pe])")
