"""layer_norm(x[..., N], weight[N], bias[N] optional, eps) over the last axis, as torch.nn.LayerNorm:

    y = (x - mean(x)) / sqrt(var(x) + eps) * weight + bias      var biased (mean of squares / N)

in fp32 with one rounding at the end (torch's kernel computes in fp32 from bf16 inputs). Any
leading shape; the kernel reads a row-strided x directly (like rms_norm)."""
import numpy as np

from .base import REQUIRED, expect, op


def infer(types, attrs):
    x, w = types[:2]
    expect(len(types) == (3 if attrs.get("has_bias") else 2),
           f"layer_norm: {len(types)} tensors for has_bias={attrs.get('has_bias', False)}")
    for name, t in zip(["weight", "bias"], types[1:]):
        expect(len(t.shape) == 1 and t.shape[0] == x.shape[-1],
               f"layer_norm {name} {t} does not match the last dim of {x}")
    return [x]


def layer_norm(x, w, b, eps):
    x = np.asarray(x, np.float32)
    d = x - x.mean(axis=-1, keepdims=True)
    y = d / np.sqrt(np.mean(d * d, axis=-1, keepdims=True) + np.float32(eps)) * w
    return y if b is None else y + b


def reference(ctx, x, weight, bias=None, eps=None, has_bias=False):
    return layer_norm(x, weight, bias if has_bias else None, eps)


op(name="layer_norm", tensors=["x", "weight"], optional=["bias"], attrs={"eps": REQUIRED},
   infer=infer, reference=reference, templates={"triton": "layer_norm"}, strided=True,
   doc="LayerNorm over the last axis (torch.nn.LayerNorm), optional bias")
