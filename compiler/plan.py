"""The plan: everything the runtime needs from the model, as versioned, byte-deterministic JSON.

    config      bound config symbols
    weights     name -> shape, dtype, layers (global layer indices, or null for a model-level
                weight), source (how to build it from checkpoint tensors)
    caches      name -> kind (paged per token | slot per sequence), shape, dtype, layers: the
                per-sequence state the ops declare (compiler/contract/caches.py lays it out)
    arena       bytes as bytes_per_token*T + bytes_per_seq*B + bytes
    buffers     value -> shape, dtype, offset {T, B, bytes} (views: col_offset, row_stride);
                a data-parallel plan's buffers over every rank's rows have the dim G = world * T
                (counted in the offsets' T coefficient; compiler/contract/bind.py step_dims)
    programs    phase -> ordered launches; {"repeat": "layers", "schedule": [kind per layer],
                "kinds": {kind: launches}} runs layer i with the launches of its kind.
                programs["load"] (only where a pass marks launches for it): run once after the
                weights are in place, before any step or graph capture, never captured; its
                launches write derived weights (source {"derived": ...}), which no other
                program writes (compiler/passes/select_kernels.py LOAD)
    short_tokens  a prefill or mixed step of at most this many tokens runs programs["short"]
                (compiler/contract/program.py `program_name`)
    wide_tokens   a decode step of at least this many tokens runs programs["wide"]: the GEMVs'
                row tiles for many sequences, the experts' grouped GEMMs
                (select_kernels.WIDE_TOKENS_PER_EXPERT, WIDE_DENSE_TOKENS without experts)
    narrow_tokens  a decode step of at most this many tokens runs programs["narrow"]: launches
                merged for that phase (compiler/passes/merge_prologues.py); a merged launch's
                "prologue" names the producer it runs first ({op, inputs: how many of the launch's
                inputs are its, output: the index of its output the consumer reads, value: that
                output's name (not written), writes: how many of the launch's outputs are its,
                feeds: the consumer's input that value was, where not 0 (a LoRA shrink's), attrs});
                an "epilogue" names a consumer it runs after (compiler/passes/merge_epilogues.py:
                {op, output: the launch output it reads, value, shape: that value's (a reshape of
                it), writes: how many of the launch's last outputs are its, attrs})
    verify_tokens  (speculative builds only: compile_model's narrow_tokens = k + 1) a decode step
                of more than narrow_tokens and at most this many tokens runs programs["verify"]:
                the narrow program's launches rendered this many rows wide
                (compiler/passes/select_kernels.py SAME_LAUNCHES)
    lora        (--enable-lora plans only) the adapter tables and the modules they serve
                (compiler/passes/add_lora.py); step_metadata then has lora_slots and the rows grouped
                by slot, lora_rows / lora_segs (runtime/lora/groups.py)
    row_logits  {tail, inputs}: the launches (by first output) that turn per-token values into
                logits at last_rows, re-run at other rows for prompt logprobs (passes/row_logits.py)
    parallel    (rank plans of `--tensor-parallel-size N` / `--data-parallel-size N` only)
                {world, rank, tp, ep[, dp]}: this plan is rank `rank`'s share (compiler/parallel.py);
                its collective launches have backend "nccl" and no kernel. With dp, each rank runs
                its own sequences over its own pages, its own step metadata (docs/architecture.md, contract 12: "rank 0
                broadcasts each step's metadata; page ids are the same on every rank" holds for
                tp / ep plans only)
"""
import json

from infc.config import NARROW_TOKENS

from .contract.schema import CACHE_MARKER, DTYPE_BYTES, SCHEMA, step_metadata
from .ir import Graph
from .ops import REGISTRY
from .passes.merge_lora import lora_launch
from .passes.merge_epilogues import epilogue_launch
from .passes.merge_prologues import merged_launch
from .passes.quantize_kv_cache import declare as declare_kv_cache
from .passes.select_kernels import SAME_LAUNCHES, SHORT_TOKENS, wide_tokens

def _jsonable(v):
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    return str(v)


def _buffers(state) -> dict:
    out = {}
    for g in state.graph.walk():
        for n in g.ordered():
            for o in n.outputs:
                v = g.values[o]
                if v.type is None or v.kind == "weight":   # a derived weight the load program writes
                    continue
                out[o] = _buffer(state, g, o)
        for i in g.inputs:          # step inputs, and a layer body's carried inputs
            out[i] = _buffer(state, g, i)
    # in the order values were declared (inputs, then each graph's values): stable and readable
    order = {}
    for g in state.graph.walk():
        for v in g.values:
            order.setdefault(v, len(order))
    return {k: out[k] for k in sorted(out, key=lambda k: order.get(k, len(order)))}


def _buffer(state, g: Graph, name: str) -> dict:
    mem = state.memory
    v = g.values[name]
    root = mem["root"][name]
    t, b, c = mem["slot_offsets"][mem["slot_of"][root]]
    entry = {"shape": list(v.type.shape), "dtype": v.type.dtype}
    col, cur = 0, name
    while g.values[cur].alias_of is not None:
        p = g.producer(cur)
        if p is not None and p.op == "split":
            k = p.outputs.index(cur)
            col += sum(p.attrs["sizes"][:k])
            entry["row_stride"] = sum(p.attrs["sizes"])
        cur = g.values[cur].alias_of
    entry["offset"] = {"T": t, "B": b, "bytes": c + col * DTYPE_BYTES[v.type.dtype]}
    if root != name:
        entry["shares"] = root
    return entry


def _node_caches(g: Graph, n) -> dict:
    op = REGISTRY[n.op]
    if op.caches is None:
        return {}
    return op.caches([g.values[i].type for i in n.inputs], n.attrs)


def _launches(state, g: Graph, phase: str) -> list:
    merged_as = SAME_LAUNCHES.get(phase, phase)      # the verify program is the narrow one's launches
    merges = state.merges.get(merged_as, {})
    into = {c: p for p, c in merges.items()}
    # epilogues by the phase's own name: merge_epilogues plans none for the verify program, whose
    # k + 1 rows the one-row gated GEMV's codes epilogue does not cover
    epilogues = state.epilogues.get(phase, {})       # producer -> the consumer in its launch
    tails = set(epilogues.values())
    sites = state.lora_sites.get(merged_as, {})      # LoRA in the GEMV's launch (merge_lora)
    apart = merged_as in state.lora_apart             # the shrinks launched on their own, before it
    inside = {i for site in sites.values() for i in site}
    out = []
    for n in g.ordered():
        if n.op == "layers":
            first = next(iter(n.bodies.values()))
            out.append({"repeat": "layers", "count": n.attrs["count"],
                        "schedule": n.attrs["schedule"], "carried": list(first.inputs),
                        "inputs": n.inputs, "outputs": n.outputs,
                        "kinds": {k: _launches(state, b, phase) for k, b in n.bodies.items()}})
            continue
        if REGISTRY[n.op].view or n.id in merges or n.id in inside or n.id in tails:   # runs in another's launch
            continue
        if n.id not in state.kernels[phase]:           # an op this program does not launch (OpDef.phases)
            continue
        launch = _launch(state, g, n, phase)
        if n.id in into:
            p = g.nodes[into[n.id]]
            launch = merged_launch(p, n, _launch(state, g, p, phase), launch)
        if n.id in epilogues:
            c = g.nodes[epilogues[n.id]]
            launch = epilogue_launch(g, n, c, launch, _launch(state, g, c, phase))
        if n.id in sites:
            s, e = (g.nodes[i] for i in sites[n.id])
            if apart:          # the shrink reads only the linear's x: its launch goes first
                out.append(_launch(state, g, s, phase))
            launch = lora_launch(s, e, launch, apart)
        out.append(launch)
    return out


def _launch(state, g: Graph, n, phase: str) -> dict:
    backend, template = state.kernels[phase][n.id]
    name = lambda x: CACHE_MARKER if g.values[x].kind == "marker" else x  # noqa: E731
    launch = {"op": n.op, "kernel": template, "backend": backend,
              "inputs": [name(i) for i in n.inputs], "outputs": [name(o) for o in n.outputs],
              "attrs": _jsonable(n.attrs), "fuses": n.fused_from, "pass": n.made_by,
              "line": n.line}
    caches = _node_caches(g, n)
    if caches:
        launch["caches"] = sorted(caches)
    return launch


def _caches(state) -> dict:
    """Every cache an op declares, with the global layers whose bodies hold that op."""
    out: dict = {}
    for n in state.graph.ordered():
        if n.op != "layers":
            for name in _node_caches(state.graph, n):
                raise state.error(f"{n.op} keeps per-layer state (cache '{name}') but runs outside "
                                  f"layers(...)", n.line)
            continue
        for kind, body in n.bodies.items():
            layers = [i for i, k in enumerate(n.attrs["schedule"]) if k == kind]
            for m in body.ordered():
                for name, decl in _node_caches(body, m).items():
                    decl = {k: _jsonable(v) for k, v in decl.items()}
                    have = out.get(name)
                    if have is not None and {k: v for k, v in have.items() if k != "layers"} != decl:
                        raise state.error(f"cache '{name}' is declared twice with different layouts: "
                                          f"{decl} vs {have}", m.line)
                    entry = out.setdefault(name, {**decl, "layers": []})
                    entry["layers"] = sorted(set(entry["layers"]) | set(layers))
    return declare_kv_cache(state, dict(sorted(out.items())))


def emit_plan(state) -> dict:
    env = state.env
    weights = {}
    for g in state.graph.walk():
        for v in g.values.values():
            if v.kind == "weight":
                w = state.weights[v.name]
                weights[v.name] = {"shape": list(v.type.shape), "dtype": v.type.dtype,
                                   "layers": w["layers"], "source": w["source"]}
    buffers = _buffers(state)
    caches = _caches(state)
    clash = set(buffers) & set(weights)
    assert not clash, f"buffer and weight names clash: {clash}"
    a = state.memory["arena"]
    g = state.graph
    return {
        "schema": SCHEMA,
        "model": state.model,
        "family": state.spec.family,
        "architectures": state.spec.architectures,
        "config": _jsonable({k: v for k, v in env.items()}),
        "inputs": {i: buffers[i] for i in g.inputs},
        "step_metadata": step_metadata(caches, lora=state.lora_plan and state.lora_plan["max_loras"] + 1),
        "outputs": dict(zip(g.output_names, g.outputs)),
        "weights": weights,
        "caches": caches,
        "arena": {"bytes_per_token": a[0], "bytes_per_seq": a[1], "bytes": a[2]},
        "buffers": buffers,
        "programs": {phase: _launches(state, g, phase) for phase in state.kernels},
        **({"short_tokens": SHORT_TOKENS} if "short" in state.kernels else {}),
        **({"wide_tokens": wide_tokens(state)} if "wide" in state.kernels else {}),
        **({"narrow_tokens": min(state.narrow_tokens, NARROW_TOKENS)} if "narrow" in state.kernels else {}),
        **({"verify_tokens": state.narrow_tokens} if "verify" in state.kernels else {}),
        **({"row_logits": state.row_logits} if state.row_logits else {}),
        **({"lora": _jsonable(state.lora_plan)} if state.lora_plan else {}),
    }


def dumps(plan: dict) -> str:
    return json.dumps(plan, indent=1, ensure_ascii=True) + "\n"
