"""capture_hidden(x[T, H], aux[T, n*H], layers) -> aux: at the layers listed, the residual stream
entering the layer written into aux's columns [j*H, (j+1)*H) (j: the layer's place in `layers`);
at any other layer aux is left as it is. Outside the loop (after it: the last layer's output)
the node stands for layer `outside`. In place: aux is a value the layer loop carries.

The speculation capability (compiler/passes/capture_hidden.py) puts it at the top of every layer
body, so one body serves every layer (the layer index decides, as it decides each layer's weights
and caches): an EAGLE-3 head reads the target's hidden states at three layers this way."""
import numpy as np

from .base import REQUIRED, expect, op, tt


def infer(types, attrs):
    x, aux = types
    n = len(attrs["layers"])
    expect(len(x.shape) == 2 and x.shape[0] == "T", f"capture_hidden takes x [T, H], got {x}")
    expect(aux.shape == ("T", n * x.shape[1]),
           f"capture_hidden: aux must be [T, {n} x {x.shape[1]}] for {n} layers, got {aux}")
    return [tt(aux.shape, aux.dtype)]


def reference(ctx, x, aux, layers, outside=None):
    out = np.array(aux, np.float32)
    layer = ctx.layer if ctx.layer is not None else outside
    H = x.shape[1]
    for j, l in enumerate(layers):               # a layer listed twice fills both places
        if layer is not None and l == layer:
            out[:, j * H:(j + 1) * H] = x
    return out


op(name="capture_hidden", tensors=["x", "aux"], attrs={"layers": REQUIRED, "outside": None}, infer=infer,
   reference=reference, templates={"triton": "capture_hidden"}, internal=True, inplace={0: 1},
   doc="the residual stream entering chosen layers, into columns of a carried [T, n*H] value")
