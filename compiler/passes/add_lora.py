"""Multi-LoRA serving (`infc build --enable-lora`): every target linear of the layers gets a shrink
and an expand launch over a stacked adapter table (compiler/ops/lora.py), indexed per token by the
step metadata `lora_slots`, so one plan (and one CUDA graph) serves any mix of adapters a step.

    y = linear(x, W)  ->  y0 = linear(x, W); xa = lora_shrink(x, W_lora_a); y = lora_expand(y0, xa,
                          W_lora_b, W_lora_scale)

It runs after fuse_weights, so a fused q|k|v or gate|up linear takes its pieces' adapters side by
side (one shrink over the stacked A matrices, one expand whose pieces read their own rank
columns), and before the fusions that would hide the linear's input or output: those no longer
match (the activation x*mul feeding a down projection is now read twice, so it stays a buffer; a
gate|up linear's output goes through the expand before the activation), and the plan stays
correct with every fusion on.

The tables are plan weights built as zeros at load time (slot 0 stays zeros: no adapter); the
runtime writes an adapter's matrices into a free slot (runtime/lora/). plan["lora"] tells it,
per table, the checkpoint modules of the pieces (PEFT names its tensors by them):

    {"max_loras", "max_rank", "targets": [module leaf names],
     "linears": {a table: {"b", "scale", "layers", "k", "pieces": [{"module", "n"}]}}}

The shrink is split-K (compiler/ops/lora.py): its output xa holds fp32 partials [T, split, P*R],
split from K (_split: ~one K block of 128 a program, so a batch-1 step's shrink runs tens of
programs rather than one walking all of K; at most 64, which bounds the buffer at 256 B a token
and rank column), summed by the shrink's last program into split 0 for the expand;
prefill_split <= 16 of them outside the decode phase, whose row tiles fill the GPU. The kernels
read the step's rows grouped by slot (step metadata lora_rows / lora_segs, runtime/lora/groups.py).

A piece whose module is not a target has "module": null (its rows of the tables stay zeros).
Without --enable-lora the pass does nothing: the plan is unchanged.
"""
from ..contract.errors import ModelDirError
from ..ir import Node, TensorType, Value
from .fuse_weights import register_weight

_WEIGHT = ".weight"
_SPLIT_K_BLOCK, _MAX_SPLIT, _MAX_PREFILL_SPLIT = 128, 64, 16


def _split(k: int) -> dict:
    split = max(1, min(_MAX_SPLIT, -(-k // _SPLIT_K_BLOCK)))
    return {"split": split, "prefill_split": min(split, _MAX_PREFILL_SPLIT)}


def _modules(src: dict) -> list[str] | None:
    """The checkpoint modules (with {i}) a linear weight is read from, one a piece, else None."""
    if set(src) == {"tensor"} and src["tensor"].endswith(_WEIGHT):
        return [src["tensor"][:-len(_WEIGHT)]]
    if set(src) == {"concat", "axis"} and src["axis"] == 0:
        parts = [_modules(s) for s in src["concat"]]
        if all(p is not None and len(p) == 1 for p in parts):
            return [p[0] for p in parts]
    return None


def _pieces(g, n, modules: list[str], targets) -> list[dict] | None:
    """[{module or None, n}] of the linear's output columns, or None where its pieces' widths are
    not known (a fused linear's split names them)."""
    N = g.values[n.inputs[1]].type.shape[0]
    if len(modules) == 1:
        widths = [N]
    else:
        users = g.users(n.outputs[0])
        if len(users) != 1 or users[0].op != "split" or len(users[0].attrs["sizes"]) != len(modules):
            return None
        widths = list(users[0].attrs["sizes"])
    return [{"module": m if m.rsplit(".", 1)[-1] in targets else None, "n": w}
            for m, w in zip(modules, widths)]


def _tables(state, g, w: str, k: int, pieces: list, dtype: str, done: dict) -> tuple:
    """The (a, b, scale) table weights of linear weight w, declared in g (once in the table)."""
    lora = state.lora
    S, R, P = lora["max_loras"] + 1, lora["max_rank"], len(pieces)
    N = sum(p["n"] for p in pieces)
    names = (w + "_lora_a", w + "_lora_b", w + "_lora_scale")
    types = (TensorType((S, P * R, k), dtype), TensorType((S, N, R), dtype), TensorType((S, P), "f32"))
    meta = state.weights[w]
    mine = names[0] in done                  # made for another layer kind's body already
    for name, t in zip(names, types):
        if name in g.values:
            continue
        if name in state.weights and not mine:
            raise state.error(f"--enable-lora: weight name '{name}' is taken", meta.get("line"))
        register_weight(state, g, name, t, {"zeros": list(t.shape)}, meta["layers"], meta.get("line"))
    done[names[0]] = {"b": names[1], "scale": names[2], "layers": meta["layers"], "k": k,
                      "pieces": pieces}
    return names


def _attach(state, g, n, tables: tuple, pieces: list):
    a, b, scale = tables
    x, y0 = n.inputs[0], n.outputs[0]
    split = _split(g.values[x].type.shape[-1])
    later = g.order[g.order.index(n.id) + 1:]
    before = later[0] if later else None
    xa, y = g.fresh("lora_xa"), g.fresh(y0)
    for v in (xa, y):
        g.add_value(Value(v, "act", line=n.line))
    expand = Node(g.new_node_id("lora_expand"), "lora_expand", [y0, xa, b, scale], [y],
                  {"pieces": [p["n"] for p in pieces], "rank": state.lora["max_rank"], **split}, n.line)
    g.add_node(expand, before=before)
    g.add_node(Node(g.new_node_id("lora_shrink"), "lora_shrink", [x, a], [xa], dict(split), n.line),
               before=expand.id)
    g.replace_uses(y0, y, after=expand.id)


def add_lora(state):
    lora = state.lora
    if lora is None:
        return
    if state.parallel:
        raise ModelDirError("--enable-lora with --tensor-parallel-size / --data-parallel-size / "
                            "--enable-expert-parallel: not supported yet (each rank's slice of the "
                            "adapter tables is not planned)")
    if state.quant is not None:
        raise ModelDirError("--enable-lora with a quantized checkpoint: not supported yet")
    targets = set(lora["targets"])
    done: dict = {}
    for g in state.graph.walk():
        if not g.is_body:              # the model-level linears (the lm_head) take no adapter
            continue
        for n in list(g.ordered()):
            if n.op != "linear" or g.values[n.inputs[1]].kind != "weight":
                continue
            w = n.inputs[1]
            modules = _modules(state.weights[w]["source"])
            if modules is None or not any(m.rsplit(".", 1)[-1] in targets for m in modules):
                continue
            pieces = _pieces(g, n, modules, targets)
            if pieces is None:
                state.note("add_lora", f"{g.name}: {w} (line {n.line}): its pieces' widths are not "
                                       f"known; no adapter")
                continue
            xt = g.values[n.inputs[0]].type
            tables = _tables(state, g, w, xt.shape[-1], pieces, xt.dtype, done)
            _attach(state, g, n, tables, pieces)
            state.note("add_lora", f"{g.name}: {w} <- {', '.join(str(p['module']) for p in pieces)}")
    if not done:
        raise ModelDirError(f"--enable-lora: no linear of the model reads a checkpoint module named "
                            f"{sorted(targets)} (--lora-target-modules)")
    state.lora_plan = {"max_loras": lora["max_loras"], "max_rank": lora["max_rank"],
                       "targets": sorted(targets), "linears": dict(sorted(done.items()))}
