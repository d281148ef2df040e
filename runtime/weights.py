"""Build the plan's weights from a checkpoint by following each weight's `source` recipe:
{"tensor": name} | {"tied": weight} | {"stack": name with {e}, "count": E} |
{"concat": [sources], "axis": a}. Layer weights substitute {i}; shapes are checked against the
plan and a mismatch names the tensor.
"""
import numpy as np

from infc.compiler.errors import ModelDirError


def _build(ckpt, src, layer):
    if "tensor" in src:
        name = src["tensor"].replace("{i}", str(layer))
        return ckpt.float32(name), name
    if "stack" in src:
        names = [src["stack"].replace("{i}", str(layer)).replace("{e}", str(e)) for e in range(src["count"])]
        return np.stack([ckpt.float32(n) for n in names]), src["stack"].replace("{i}", str(layer))
    if "concat" in src:
        parts = [_build(ckpt, s, layer) for s in src["concat"]]
        return np.concatenate([p for p, _ in parts], axis=src["axis"]), " + ".join(n for _, n in parts)
    raise ValueError(f"unknown weight source {src}")


def load_weights(plan: dict, ckpt) -> dict:
    """name -> array (float32), or a list of arrays (one per layer) for per-layer weights."""
    out = {}
    layers = plan["config"].get("L", 1)
    tied = []
    for name, w in plan["weights"].items():
        if "tied" in w["source"]:
            tied.append((name, w))
            continue
        arrays = []
        for i in range(layers if w["per_layer"] else 1):
            a, what = _build(ckpt, w["source"], i)
            if tuple(a.shape) != tuple(w["shape"]):
                raise ModelDirError(f"{ckpt.dir}: tensor '{what}' has shape {list(a.shape)}, "
                                    f"the plan expects {w['shape']} for weight '{name}'")
            arrays.append(a)
        out[name] = arrays if w["per_layer"] else arrays[0]
    for name, w in tied:
        out[name] = out[w["source"]["tied"]]
    return out
