"""Build the plan's weights from a checkpoint (float32, numpy) by following each weight's
`source` recipe (runtime/weights/recipes.py). A per-layer weight (`layers`: the global layer
indices that have it) is a list ordered like `layers`; `at(plan, weights, name, layer)` finds a
layer's copy. Shapes are checked against the plan and a mismatch names the tensor.
"""
from infc.compiler.contract.errors import ModelDirError

from .recipes import CheckpointReader, build


def layers_of(w: dict) -> list:
    """[None] for a model-level weight, else its global layer indices (plan contract 1)."""
    if "layers" not in w:
        raise ValueError("plan weight has no 'layers' (a plan older than infc.plan/2? rebuild it)")
    return [None] if w["layers"] is None else list(w["layers"])


def at(plan: dict, weights: dict, name: str, layer):
    """The array (or device pointer) of weight `name` at global layer `layer`; weights maps
    name -> value or per-layer list (as load_weights / DeviceWeights make them)."""
    w = weights[name]
    if not isinstance(w, list):
        return w
    layers = plan["weights"][name]["layers"]
    try:
        return w[layers.index(layer)]
    except ValueError:
        raise KeyError(f"weight '{name}' has no copy for layer {layer} (its layers: {layers})") from None


def check_shape(ckpt, name: str, w: dict, shape, what: str):
    if tuple(shape) != tuple(w["shape"]):
        raise ModelDirError(f"{ckpt.dir}: tensor '{what}' has shape {list(shape)}, "
                            f"the plan expects {w['shape']} for weight '{name}'")


def iter_weights(plan: dict, ckpt, read=None):
    """Yields (name, layer or None, float32 array) for every weight, tied ones as
    (name, None, the weight it is tied to). read(tensor name) defaults to the checkpoint's float32
    reader. A quantized weight's codes come as the float32 values they encode, its companions as
    float32 (compiler/quant/scheme.py)."""
    read = read or CheckpointReader(ckpt)
    for name, w in plan["weights"].items():
        if "tied" in w["source"]:
            yield name, None, w["source"]["tied"]
            continue
        for layer in layers_of(w):
            a, what = build(w["source"], layer, read, str(ckpt.dir))
            check_shape(ckpt, name, w, a.shape, what)
            yield name, layer, a


def load_weights(plan: dict, ckpt) -> dict:
    """name -> array (float32), or a list of arrays ordered like the weight's `layers`."""
    out, tied = {}, []
    for name, layer, a in iter_weights(plan, ckpt):
        if layer is None and isinstance(a, str):
            tied.append((name, a))
        elif plan["weights"][name]["layers"] is None:
            out[name] = a
        else:
            out.setdefault(name, []).append(a)
    for name, target in tied:
        out[name] = out[target]
    return out
