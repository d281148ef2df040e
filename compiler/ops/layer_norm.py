"""layer_norm(x[..., N], weight[N] optional, bias[N] optional, eps) over the last axis, as
torch.nn.LayerNorm:

    y = (x - mean(x)) / sqrt(var(x) + eps) * weight + bias      var biased (mean of squares / N)

in fp32 with one rounding at the end (torch's kernel computes in fp32 from bf16 inputs). Any
leading shape; the kernel reads a row-strided x directly (like rms_norm). With no weight and no
bias (`layer_norm(x, eps=e)`: OLMo's non-parametric LayerNorm, F.layer_norm(x, shape, None,
None, eps)) the normalized row is the result; a left-out weight sets attrs has_weight False."""
import numpy as np

from .base import REQUIRED, expect, expect_eps, op


def infer(types, attrs):
    has_w, has_b = attrs.get("has_weight", True), attrs.get("has_bias", False)
    expect_eps("layer_norm", attrs.get("eps"))
    x = types[0]
    expect(len(types) == 1 + has_w + has_b,
           f"layer_norm: {len(types)} tensors for has_weight={has_w}, has_bias={has_b}")
    for name, t in zip([n for n, h in (("weight", has_w), ("bias", has_b)) if h], types[1:]):
        expect(len(t.shape) == 1 and t.shape[0] == x.shape[-1],
               f"layer_norm {name} {t} does not match the last dim of {x}")
    return [x]


def layer_norm(x, w, b, eps):
    x = np.asarray(x, np.float32)
    d = x - x.mean(axis=-1, keepdims=True)
    y = d / np.sqrt(np.mean(d * d, axis=-1, keepdims=True) + np.float32(eps))
    y = y if w is None else y * w
    return y if b is None else y + b


def reference(ctx, x, *wb, eps=None, has_weight=True, has_bias=False):
    wb = iter(wb)
    w = next(wb) if has_weight else None
    return layer_norm(x, w, next(wb) if has_bias else None, eps)


op(name="layer_norm", tensors=["x"], omittable=["weight"], optional=["bias"], attrs={"eps": REQUIRED},
   infer=infer, reference=reference, templates={"triton": "layer_norm"}, strided=True,
   doc="LayerNorm over the last axis (torch.nn.LayerNorm), optional weight and bias")
