"""Quantized checkpoints: the linears whose weights the checkpoint stores quantized read them as
published, as codes and scales (compiler/quant/scheme.py), driven by config.json's
`quantization_config` (compiler/quant/formats/). The spec is unchanged: a family's spec serves
its bf16 and its quantized checkpoints alike.

    linear(x, W[, b])  ->  linear(x, W:codes[, b], W_qscale[, W_qzero][, W_qgidx][, W_xscale])
                           attrs["quant"] = the scheme

Each companion is a plan weight with its own load recipe, so the fusions after this pass (q|k|v
and gate|up concatenation, the gated epilogue, the narrow prologue) carry the quantized operands
as they carry a bias. MoE experts (moe_gate_up / moe_down's stacks) are rewritten the same way,
per expert (passes/quantize_experts.py). A weight the checkpoint quantizes but this pass cannot
rewrite (a weight built by a transform, shared experts folded into a stack) fails the build
naming it: it would otherwise be read as bf16 from fp8 or packed-integer bytes.
"""
from ..contract.errors import ModelDirError
from ..ir import TensorType, Value
from ..quant.scheme import QuantScheme
from .fuse_weights import register_weight
from .quantize_experts import EXPERT_OPS, SUFFIX, attach_companions, rewrite_experts
LINEARS = ("linear",)
# ops whose weights are matrices a checkpoint may store quantized (HF quantizes nn.Linear modules:
# never embeddings or norms), whether or not this pass can rewrite them yet
MATMULS = ("linear", "head_linear", "moe_gate_up", "moe_down")
_WEIGHT = ".weight"


def _rank_slice(meta: dict):
    """(the recipe under a tensor-parallel rank's slice, (axis, start, stop)) of a weight
    shard_ranks sliced, else (its recipe, None)."""
    src = meta["source"]
    if set(src) == {"slice", "axis", "start", "stop"}:
        return src["slice"], (src["axis"], src["start"], src["stop"])
    return src, None


def _module(meta: dict) -> str | None:
    """The checkpoint module ({i} for the layer) a weight is read from as published, else None."""
    src, _ = _rank_slice(meta)
    if set(src) == {"tensor"} and src["tensor"].endswith(_WEIGHT):
        return src["tensor"][:-len(_WEIGHT)]
    return None


def _sliced_sources(name: str, s, srcs: dict, cut, full: tuple) -> dict:
    """A tensor-parallel rank's slice of the canonical tensors: the codes (logical [N, K]: the
    recipes give them unpacked) as shard_ranks sliced the weight, the scales and zero points by
    the blocks and groups the slice spans, which it must hold whole; g_idx and x_scale whole (a
    column split with act-order groups is refused: its group ids name the whole row's scales)."""
    axis, start, stop = cut
    per = s.block_n if axis == 0 else s.block_k
    if axis == 1 and s.g_idx:
        raise ModelDirError(f"weight '{name}': --tensor-parallel-size splits its columns, and the checkpoint "
                            f"names its scale groups per column (act-order g_idx): not supported")
    if axis == 1 and s.act == "dynamic_group" and (start % s.act_group or stop % s.act_group):
        raise ModelDirError(f"weight '{name}': a rank's columns [{start}:{stop}] split activation groups of "
                            f"{s.act_group}")
    out = {"codes": {"slice": srcs["codes"], "axis": axis, "start": start, "stop": stop}}
    for c, src in srcs.items():
        if c in ("w_scale", "w_zero"):
            if per is None:          # one group a row: a column split keeps every row's scale
                out[c] = src
                continue
            if start % per or (stop % per and stop != full[axis]):
                what = "rows" if axis == 0 else "columns"
                raise ModelDirError(f"weight '{name}': a rank's {what} [{start}:{stop}] are not whole "
                                    f"scale blocks of {per} ({s}); use a --tensor-parallel-size that "
                                    f"splits on block boundaries")
            out[c] = {"slice": src, "axis": axis, "start": start // per, "stop": -(-stop // per)}
        elif c != "codes":
            out[c] = src
    return out


def _row_regrouped(meta: dict):
    """The checkpoint tensor a weight reads through row slices only (rows [a, b) of G row
    groups, any depth), else None: such a weight keeps each row's codes and, with one scale a row,
    its scales (the recipe's `row_blocks`), so it can be read quantized."""
    src, _ = _rank_slice(meta)
    if "slice" not in src:
        return None
    while set(src) - {"groups"} == {"slice", "axis", "start", "stop"} and src["axis"] == 0:
        src = src["slice"]
    if set(src) == {"tensor"} and src["tensor"].endswith(_WEIGHT):
        return src["tensor"]
    return None


def _replace_leaf(src, t: str, leaf):
    """src with each read of checkpoint tensor t replaced by `leaf`."""
    if isinstance(src, dict):
        if src == {"tensor": t}:
            return leaf
        return {k: _replace_leaf(v, t, leaf) for k, v in src.items()}
    if isinstance(src, list):
        return [_replace_leaf(v, t, leaf) for v in src]
    return src


def _regrouped_sources(fmt, s, t: str, src: dict):
    """(per-row scheme, sources) of a row-regrouped weight (_row_regrouped) of a block-scaled
    float checkpoint, or None where the format has no per-row form here."""
    if s.zeros or s.g_idx or s.act == "static" or s.block_n == 1 and s.block_k is None:
        return None
    module = t[:-len(_WEIGHT)]
    base = fmt.sources(module, s, 1, 1)
    if set(base) != {"codes", "w_scale"} or not {"tensor", "e8m0"} & set(base["w_scale"]):
        return None
    row = QuantScheme(s.codes, 1, s.block_k, act=s.act, act_group=s.act_group)
    return row, {"codes": _replace_leaf(src, t, base["codes"]),
                 "w_scale": _replace_leaf(src, t, {"row_blocks": base["w_scale"], "block": s.block_n,
                                                   "rows_of": t})}


def _scheme(state, fmt, name: str, module: str, layers):
    schemes = {fmt.scheme_for(module.replace("{i}", str(i))) for i in (layers or [None])}
    if len(schemes) > 1:
        raise ModelDirError(f"weight '{name}' ({module}): the checkpoint quantizes it in some layers "
                            f"and not in others; infc needs one scheme for every layer of a weight")
    return schemes.pop()


def _companion_type(c: str, scheme, n: int, k: int) -> TensorType:
    if c == "w_gidx":
        return TensorType((k,), "i32")
    if c == "x_scale":
        return TensorType((1,), "f32")
    return TensorType(scheme.scale_shape(n, k), "f32")


def _rewrite_weight(state, g, name: str, fmt, done: dict):
    """Quantize weight `name` (once) and declare its companions in graph g; returns (scheme,
    companion value names) or None where the checkpoint keeps it in bf16."""
    if name not in done:
        meta = state.weights[name]
        module, regrouped = _module(meta), _row_regrouped(meta)
        if module is None and regrouped is not None:
            module = regrouped[:-len(_WEIGHT)]
        s = None if module is None else _scheme(state, fmt, name, module, meta["layers"])
        if s is not None and regrouped is not None:
            got = _regrouped_sources(fmt, s, regrouped, _rank_slice(meta)[0])
            s, whole = (None, None) if got is None else got
            if s is None:
                return None             # _check_all_rewritten names it
        if s is None:
            done[name] = None
            return None
        n, k = meta["type"].shape
        _, cut = _rank_slice(meta)
        if cut is None:
            srcs = whole if regrouped else fmt.sources(module, s, n, k)
        else:
            full = (n * state.parallel["tp"], k) if cut[0] == 0 else (n, k * state.parallel["tp"])
            srcs = _sliced_sources(name, s, whole if regrouped else fmt.sources(module, s, *full), cut, full)
        names = {c: name + SUFFIX[c] for c in s.companions()}
        meta["source"] = srcs["codes"]
        meta["type"] = TensorType((n, k), s.codes)
        meta["quant"] = str(s)
        done[name] = (s, names, srcs, (n, k))
        state.note("quantize_weights", f"{name}: {module} as {s}")
    got = done[name]
    if got is None:
        return None
    s, names, srcs, (n, k) = got
    g.values[name].type = TensorType((n, k), s.codes)
    for c, v in names.items():
        if v not in g.values:
            register_weight(state, g, v, _companion_type(c, s, n, k), srcs[c],
                            state.weights[name]["layers"], state.weights[name].get("line"))
    return s, names


def _checkpoint_tensors(src: dict) -> list[str]:
    """Every checkpoint tensor name (patterns) a weight recipe reads."""
    out = []
    for key, v in src.items():
        if key in ("tensor", "stack") and isinstance(v, str):
            out.append(v)
        elif isinstance(v, dict):
            out += _checkpoint_tensors(v)
        elif isinstance(v, list):
            out += [t for s in v if isinstance(s, dict) for t in _checkpoint_tensors(s)]
    return out


def _check_all_rewritten(state, fmt, done: dict, heads: set):
    """A matrix read as bf16 from a tensor the checkpoint stores quantized: one that no linear reads
    (MLA's W_uk / W_uv, cut per head out of kv_b_proj for head_linear) is dequantized at load when
    its codes are e4m3 (the weight then streams as bf16); any other is refused."""
    matrices = {i for g in state.graph.walk() for n in g.ordered() if n.op in MATMULS
                for i in n.inputs if g.values[i].kind == "weight"}
    linears = {n.inputs[1] for g in state.graph.walk() for n in g.ordered() if n.op in LINEARS}
    for name, meta in state.weights.items():
        if name not in matrices or name in heads or done.get(name) is not None or "tied" in meta["source"] \
                or "quant" in meta:
            continue
        for t in _checkpoint_tensors(meta["source"]):
            if not t.endswith(_WEIGHT):
                continue
            # the layers the weight is read in (a router exists in the sparse layers only)
            s = next((s for i in (meta["layers"] or [0])
                      if (s := fmt.scheme_for(t[:-len(_WEIGHT)].replace("{i}", str(i)).replace("{e}", "0")))
                      is not None), None)
            if s is None:
                continue
            line = meta.get("line")
            # a linear's input is quantized by the format: dequantizing its weight alone would
            # compute another function; a per-head matmul of the absorbed MLA reads no activation
            # the checkpoint's linear did (vLLM dequantizes kv_b_proj for it too)
            if s.codes == "f8e4m3" and not s.zeros and not s.g_idx and s.act != "static" and name not in linears:
                # W by the format's definition, in float32, before the transforms that follow
                # (runtime/weights/quant_recipes.py `dequantized`)
                meta["source"] = _replace_leaf(meta["source"], t, {
                    "dequantized": fmt.sources(t[:-len(_WEIGHT)], s, 1, 1), "scheme": s.attrs()})
                state.note("quantize_weights", f"{name}: {t} ({s}) dequantized at load: the spec "
                                               f"transforms it (read as {meta['type'].dtype})")
                continue
            raise ModelDirError(
                f"weight '{name}'{f' (spec line {line})' if line else ''} reads '{t}', which the "
                f"checkpoint stores quantized ({s}); infc reads quantized weights as plain linear "
                f"weights and MoE expert stacks, and dequantizes e4m3 ones at load where the spec "
                f"transforms them, not this format")


def quantize_weights(state):
    fmt = state.quant
    if fmt is None:
        return
    tp = state.parallel.get("tp", 1) if state.parallel else 1
    ep = state.parallel.get("ep", 1) if state.parallel else 1
    done: dict = {}
    heads: set = set()      # the output head's weight, where the format keeps it bf16
    for g in state.graph.walk():
        for n in g.ordered():
            if n.op in EXPERT_OPS:
                if tp > 1 and ep == 1:       # with expert parallelism each rank holds whole experts
                    raise ModelDirError("a quantized checkpoint's MoE experts with --tensor-parallel-size > 1: "
                                        "not supported yet (each rank's slice of the expert codes and scales is "
                                        "not planned); add --enable-expert-parallel, which gives each rank whole experts")
                rewrite_experts(state, g, n, fmt, done)
                continue
            if n.op not in LINEARS or g.values[n.inputs[1]].kind != "weight":
                continue
            if fmt.keeps_output_head and g is state.graph and n.outputs[0] in g.outputs:
                state.note("quantize_weights", f"{n.inputs[1]}: the output head stays bf16 ({fmt.method})")
                done[n.inputs[1]] = None
                heads.add(n.inputs[1])
                continue
            got = _rewrite_weight(state, g, n.inputs[1], fmt, done)
            if got is None:
                continue
            s, names = got
            attach_companions(n, 3 if n.attrs.get("has_bias") else 2, s, names)
    _check_all_rewritten(state, fmt, done, heads)
