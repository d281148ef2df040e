"""Quantized MoE experts: the stacks lower_experts builds (gate|up [E, 2F, H], down [E, H, F]) read
as a checkpoint publishes each expert's projection, codes and companions per expert, stacked:

    moe_gate_up(x, ids, W, rows, counts) -> moe_gate_up(x, ids, W:codes, rows, counts, W_qscale[, W_qzero])
    moe_down(act, r, ids, W, rows, counts) -> moe_down(act, r, ids, W:codes, rows, counts, W_qscale[, W_qzero])
                                              attrs["quant"] = the scheme

Each canonical tensor's recipe is the bf16 weight's recipe with every expert stack
({"stack": "...experts.{e}.gate_proj.weight"}) replaced by the stack of the format's recipe for
that tensor ({"stack": {"fp8": "...experts.{e}.gate_proj.weight"}}), so the gate|up
concatenation and an expert-parallel rank's slice of the experts carry over to the codes and
scales alike (companions lead with E like the codes). gate|up concatenates rows, so each part's
rows must be whole scale blocks (F a multiple of block_n), as fuse_weights asks of q|k|v.

A spec that reads its experts from one [E, K, N] parameter (transformers 5's GptOssExperts:
`experts: E` with no {e}, each expert's matrix transposed, gate|up maybe a strided column slice)
is mapped to the format's tensors of that parameter (fmt.param_sources: MXFP4's `P_blocks` /
`P_scales`), which store each expert as [N, K] already: the transpose is dropped and the column
slice becomes the same slice of the rows.

A routed expert's scheme is the format's expert_scheme_for (fp8's expert_dtype fp4: e2m1 experts
beside e4m3 linears). Every expert of every layer must share one scheme. Act-order group indices (one per column,
gate's and up's differing) and static activation scales (one per expert and projection) are not
carried into the stacked launches: such a checkpoint fails naming the weight, as does a stack
this pass does not recognize (fold_shared_experts' shared chunks).
"""
from ..contract.errors import ModelDirError
from ..ir import TensorType
from ..quant.scheme import COMPANIONS
from .fuse_weights import register_weight

EXPERT_OPS = {"moe_gate_up": 2, "moe_down": 3}        # op -> the input index of its expert stack
_WEIGHT = ".weight"
SUFFIX = {"w_scale": "_qscale", "w_zero": "_qzero", "w_gidx": "_qgidx", "x_scale": "_xscale"}


class _Unknown(Exception):
    """A recipe shape this pass does not rewrite (the caller's check names the weight)."""


def _param(src: dict):
    """(parameter name, its row slice in the stored [E, N, K] form or None) of a recipe that reads
    one [E, K, N] expert parameter transposed per expert (optionally a column slice of it, before
    the transpose), else None."""
    if "transpose" not in src or not src.get("per_head"):
        return None
    inner = src["transpose"]
    if isinstance(inner.get("tensor"), str) and "{e}" not in inner["tensor"]:
        return inner["tensor"], None
    if "slice" in inner and inner["axis"] == 2 and "groups" not in inner \
            and isinstance(inner["slice"].get("tensor"), str) and "{e}" not in inner["slice"]["tensor"]:
        rows = {"axis": 1, "start": inner["start"], "stop": inner["stop"]}
        if inner.get("step", 1) != 1:
            rows["step"] = inner["step"]
        return inner["slice"]["tensor"], rows
    return None


def _stacks(src: dict) -> list:
    """The expert stacks (name pattern, count) a supported recipe reads (count None: one [E, ...]
    parameter), else _Unknown."""
    if isinstance(src.get("stack"), str) and src["stack"].endswith(_WEIGHT):
        return [(src["stack"][:-len(_WEIGHT)], src["count"])]
    if _param(src) is not None:
        return [(_param(src)[0], None)]
    if "concat" in src and src["axis"] == 1:
        return [s for part in src["concat"] for s in _stacks(part)]
    if "slice" in src and src["axis"] == 0 and src.get("groups", 1) == 1 \
            and ("stack" in src["slice"] or _param(src["slice"]) is not None):   # a rank's experts
        return _stacks(src["slice"])
    raise _Unknown


def _mapped(src: dict, c: str, sources, param_sources=None) -> dict:
    """The recipe of canonical tensor c: src with each stack's leaf replaced by the format's."""
    if _param(src) is not None:
        name, rows = _param(src)
        leaf = param_sources(name)[c]
        return leaf if rows is None else {"slice": leaf, **rows}
    if "stack" in src:
        return {"stack": sources(src["stack"][:-len(_WEIGHT)])[c], "count": src["count"]}
    if "concat" in src:
        return {"concat": [_mapped(p, c, sources, param_sources) for p in src["concat"]], "axis": 1}
    return {**src, "slice": _mapped(src["slice"], c, sources, param_sources)}


def _scheme(fmt, name: str, meta: dict, stacks: list):
    where = f"weight '{name}'" + (f" (spec line {meta['line']})" if meta.get("line") else "")
    schemes = {}
    for module, count in stacks:
        if count is None:                  # one [E, ...] parameter: its module's scheme
            module, count = module.rsplit(".", 1)[0], 1
        for i in (meta["layers"] or [None]):
            for e in range(count):
                m = module.replace("{e}", str(e)) if i is None else \
                    module.replace("{i}", str(i)).replace("{e}", str(e))
                schemes.setdefault(fmt.expert_scheme_for(m), m)
    if len(schemes) > 1:
        got = "; ".join(f"{m}: {s or 'not quantized'}" for s, m in schemes.items())
        raise ModelDirError(f"{where}: the checkpoint stores its experts in more than one scheme ({got}); "
                            f"infc needs one scheme for every expert of a stack")
    s = next(iter(schemes))
    if s is not None and (s.g_idx or s.act == "static"):
        why = "act-order group indices" if s.g_idx else "static activation scales"
        raise ModelDirError(f"{where}: the checkpoint quantizes its experts with {why} ({s}); infc reads "
                            f"quantized experts without them so far")
    return s, where


def rewrite_experts(state, g, node, fmt, done: dict):
    """Quantize the expert stack `node` (moe_gate_up / moe_down) reads, where the checkpoint does;
    `done` caches each weight's rewrite (a stack several layer kinds share)."""
    name = node.inputs[EXPERT_OPS[node.op]]
    if g.values[name].kind != "weight":
        return
    if name not in done:
        meta = state.weights[name]
        try:
            stacks = _stacks(meta["source"])
        except _Unknown:
            done[name] = None                     # not rewritten: _check_all_rewritten names it
            return
        s, where = _scheme(fmt, name, meta, stacks)
        if s is None:
            done[name] = None
            return
        e, n, k = meta["type"].shape
        parts = len(stacks)
        if n % parts or (parts > 1 and (n // parts) % s.block_n):
            raise ModelDirError(f"{where}: its {parts} concatenated expert projections have {n // parts} rows "
                                f"each, not whole scale blocks of {s.block_n} rows ({s}): the stacked scales "
                                f"would misname rows")
        srcs = lambda module: fmt.sources(module, s, n // parts, k)     # noqa: E731

        def param_srcs(param):
            try:
                return fmt.param_sources(param, s)
            except NotImplementedError:
                raise ModelDirError(f"{where}: reads its experts from one parameter '{param}', which "
                                    f"infc reads quantized only from MXFP4 checkpoints so far ({s})") from None
        names = {c: name + SUFFIX[c] for c in s.companions()}
        comp = {c: _mapped(meta["source"], c, srcs, param_srcs) for c in names}
        meta["source"] = _mapped(meta["source"], "codes", srcs, param_srcs)
        meta["type"] = TensorType((e, n, k), s.codes)
        meta["quant"] = str(s)
        done[name] = (s, names, comp, (e, n, k))
        state.note("quantize_weights", f"{name}: {stacks[0][0]} ({parts} stack{'s' * (parts > 1)} of {e} "
                                       f"experts) as {s}")
    got = done[name]
    if got is None:
        return
    s, names, comp, (e, n, k) = got
    g.values[name].type = TensorType((e, n, k), s.codes)
    for c, v in names.items():
        if v not in g.values:
            register_weight(state, g, v, TensorType((e,) + s.scale_shape(n, k), "f32"), comp[c],
                            state.weights[name]["layers"], state.weights[name].get("line"))
    # the companions follow rows, counts and the expert bias (if any)
    attach_companions(node, EXPERT_OPS[node.op] + 3 + bool(node.attrs.get("has_bias")), s, names)


def attach_companions(node, base: int, s, names: dict):
    """node's inputs after its first `base` (the operands the quantized op keeps) become the
    scheme's companions in COMPANIONS order, with the scheme and a has_<companion> flag each in
    its attrs (a linear's and an expert stack's alike)."""
    node.inputs = node.inputs[:base] + [names[c] for c in COMPANIONS if c in names]
    node.attrs["quant"] = s.attrs()
    for c in names:
        node.attrs["has_" + c] = True
