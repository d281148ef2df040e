"""Build the plan's weights from a checkpoint by following each weight's `source` recipe:
{"tensor": name} | {"tied": weight} | {"stack": name with {e}, "count": E} |
{"concat": [sources], "axis": a}. Layer weights substitute {i}; shapes are checked against the
plan and a mismatch names the tensor.
"""
import numpy as np

from infc.compiler.errors import ModelDirError


def _build(ckpt, src, layer, read):
    if "tensor" in src:
        name = src["tensor"].replace("{i}", str(layer))
        return read(name), name
    if "stack" in src:
        names = [src["stack"].replace("{i}", str(layer)).replace("{e}", str(e)) for e in range(src["count"])]
        parts = [read(n) for n in names]
        if len({p.shape for p in parts}) != 1:
            raise ModelDirError(f"{ckpt.dir}: experts of '{src['stack']}' differ in shape")
        return np.stack(parts), src["stack"].replace("{i}", str(layer))
    if "concat" in src:
        parts = [_build(ckpt, s, layer, read) for s in src["concat"]]
        names = " + ".join(n for _, n in parts)
        try:
            return np.concatenate([p for p, _ in parts], axis=src["axis"]), names
        except ValueError:
            shapes = ", ".join(f"{n} {list(p.shape)}" for p, n in parts)
            raise ModelDirError(f"{ckpt.dir}: cannot concatenate {shapes}") from None
    raise ValueError(f"unknown weight source {src}")


def iter_weights(plan: dict, ckpt, read):
    """Yields (name, layer or None, array) for every weight, tied ones as ("name", None, tied_to)."""
    layers = plan["config"].get("L", 1)
    for name, w in plan["weights"].items():
        if "tied" in w["source"]:
            yield name, None, w["source"]["tied"]
            continue
        for i in range(layers if w["per_layer"] else 1):
            a, what = _build(ckpt, w["source"], i, read)
            if tuple(a.shape) != tuple(w["shape"]):
                raise ModelDirError(f"{ckpt.dir}: tensor '{what}' has shape {list(a.shape)}, "
                                    f"the plan expects {w['shape']} for weight '{name}'")
            yield name, (i if w["per_layer"] else None), a


def load_weights(plan: dict, ckpt) -> dict:
    """name -> array (float32), or a list of arrays (one per layer) for per-layer weights."""
    out, tied = {}, []
    for name, layer, a in iter_weights(plan, ckpt, ckpt.float32):
        if layer is None and isinstance(a, str):
            tied.append((name, a))
        elif layer is None:
            out[name] = a
        else:
            out.setdefault(name, []).append(a)
    for name, target in tied:
        out[name] = out[target]
    return out
