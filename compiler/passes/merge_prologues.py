"""Per-phase launch merges: a producer folded into its one consumer's launch in one phase only.

One graph serves every phase, but some fusions pay in one phase and lose in another. In a decode
step of a few tokens (one, or a speculative verify step's k + 1 rows):
- the residual add + RMSNorm before a linear: every GEMV program can re-read the row (x and d,
  2 x H bf16 from L2) and normalize it while its first weight tiles are in flight (the preload
  before the PDL wait), which costs a little less than the launch between the two kernels; at
  2+ rows the tensor-core path does the same per row block (codegen_templates/triton/gemv.py.j2);
- q/k RMSNorm + RoPE + the KV-cache write before decode attention: each split of a (sequence, kv
  head) computes its query heads and the new token's key itself, where a launch of its own was a
  drain and a fill between the qkv GEMV and attention. A verify step's rows of one sequence read
  keys that its earlier rows write in the same launch: each split writes those it reads itself
  (the same bits), so no split reads a key before it is written
  (codegen_templates/triton/attention_decode.py.j2).
Together -0.085 / -0.13 ms a qwen3-4b step at prompts 32 / 1k on an H100 (bench/NOTES.md, sixth
session).
- a LoRA site's shrink before its expand (--enable-lora: compiler/passes/add_lora.py): one launch
  whose first programs compute the adapter's split-K sums and whose others wait for them and
  expand (codegen_templates/triton/_lora_tiles.j2): at batch 1 the two launches did ~2 rows of
  work each, so the second launch's drain and fill was most of its cost. The shrink's output feeds
  the expand's input 1 (FEEDS), and its partials live in the merged kernel's scratch (the plan's
  xa buffer is not read in this phase). At 64 rows the GEMV's re-read is per row block and column block, and a prompt's keys
must be in the cache before other programs read them, so the graph keeps the ops and the merges
are made for the "narrow" program only: decode steps of plan["narrow_tokens"] = 1 token
(compiler/contract/program.py `program_name`; infc/config.py NARROW_TOKENS says why one). A
speculative build's verify program runs the same launches (compiler/passes/select_kernels.py
SAME_LAUNCHES) rendered state.narrow_tokens = k + 1 <= 8 rows wide: a verify step of up to 7
drafts at batch 1 (issue 43: the decode program's separate norm and qk-norm/rope launches made
verify(4) 1.52x the one-token step on an H200), or a few sequences decoding; past it the GEMVs'
per-row-block prologue re-reads every row of its block, and a verify row's split writes each of
its sequence's earlier rows it reads.

    narrow:  [x', h = add_rms_norm(x, d, w); y = linear(h, W)]  ->  one launch
             linear(x, d, w, W) -> (x', y), launch["prologue"] = {op, inputs: 3, output: 1, value: h, ...}

An fp8 linear's norm that makes its activation codes (add_rms_norm_quant: compiler/passes/act_codes.py)
merges the same way where infc/config.py NARROW_MERGE_QUANT_NORMS says so: the launch is the plain
norm's merge, and the linear reads h as a linear without ready codes does (its programs quantize
their K range: codegen_templates/triton/_gemv_narrow_codes.j2), so the codes, their scales and h
must have no other reader:

    [x', h, c, s = add_rms_norm_quant(x, d, w); y = linear(c, W, Ws, s)]  ->  linear(x, d, w, W, Ws) -> (x', y)

The merged launch's residual output x' is written by one program while every program reads x,
so x' must not share x's memory: the producer's in-place alias is dropped here, before
plan_memory (x' gets a buffer of its own in every phase; the unmerged kernel writes it there),
and a merge after which x' would still share x's buffer is not made.
"""
from ..ops import REGISTRY
from .merge_lora import fused_shrinks
from .plan_memory import memory_classes

from infc.config import NARROW_TOKENS_MAX
# producer op -> the index of its output that the consumer reads (the others are written by the
# merged launch as they were)
PROLOGUES = {"add_rms_norm": 1, "add_rms_norm_quant": 2, "qk_norm_rope_cache": 0, "lora_shrink": 0}
# producer op -> the consumer's input that output feeds (0 where not named)
FEEDS = {"lora_shrink": 1}
# producer op -> the consumer's narrow templates that take it as a prologue
# (codegen_templates/triton/gemv.py.j2, attention_decode.py.j2)
CONSUMER_TEMPLATES = {"add_rms_norm": {"gemv", "gemv_gated"}, "add_rms_norm_quant": {"gemv", "gemv_gated"},
                      "qk_norm_rope_cache": {"attention_decode"},
                      "lora_shrink": {"lora_expand", "lora_expand_act"}}
PHASE = "narrow"
# the merged LoRA launch keeps the partials of at most 16 rows in its scratch (_lora_tiles.j2 MAX_ROWS)
assert NARROW_TOKENS_MAX <= 16, "lora_expand's merged narrow launch holds at most 16 rows"


def _merge(state, g, p, fused: set) -> str | None:
    """The consumer node p merges into in the narrow phase, or None (why not: see each test).
    fused: the lora_shrinks merge_lora put into their linear's launch (one reader of h there)."""
    if p.id in fused:                            # runs in its linear's GEMV (merge_lora)
        return None
    h = p.outputs[PROLOGUES[p.op]]
    # a LoRA site's shrink reads its linear's x inside the linear's launch (merge_lora): not a reader
    inside = [u for u in g.users(h) if u.id in fused]
    users = [u for u in g.users(h) if u.id not in fused]
    if len(users) != 1 or g.uses(h) - sum(u.inputs.count(h) for u in inside) != 1:   # h read twice, or a layer's output
        return None
    if any(state.lora_sites[PHASE].get(users[0].id, [None])[0] != u.id for u in inside):
        return None
    c = users[0]
    # adjacent launches: the merged one reads the producer's inputs at the consumer's place, and
    # plan_memory may give a slot whose last reader is the producer to a launch in between
    between = g.order[g.order.index(p.id) + 1:g.order.index(c.id)]
    if any(not REGISTRY[g.nodes[n].op].view for n in between):
        return None
    if c.inputs[FEEDS.get(p.op, 0)] != h or \
            REGISTRY[c.op].template(state.backend, PHASE) not in CONSUMER_TEMPLATES[p.op]:
        return None
    # a row-parallel linear's fp32 partials take the tensor-core path at every row count (the
    # GEMV template's FMA_ROWS), which has no prologue
    if c.attrs.get("out_dtype") == "f32":
        return None
    # a feature backend that names the narrow phase would take one of the two launches
    if any(REGISTRY[n.op].template(b, PHASE, inherit=False) for n in (p, c) for b in state.features):
        return None
    if g.values[h].type.shape[:1] != ("T",):
        return None
    if p.op == "add_rms_norm_quant" and not _codes_merge(g, p, c, inside):
        return None
    return c.id


def _codes_merge(g, p, c, inside) -> bool:
    """Whether the narrow launch may make add_rms_norm_quant's codes in its consumer's programs:
    the switch is on, and c (a linear on those ready codes) is the only reader of the codes and
    their scales (its last input), and nothing reads the bf16 h."""
    from infc import config
    _, h, _, scales = p.outputs
    return (config.NARROW_MERGE_QUANT_NORMS and not inside and c.attrs.get("has_a_scale")
            and g.uses(h) == 0 and g.uses(scales) == 1 and c.inputs[-1] == scales)


# ops whose in-place output is a memory saving only (their kernels write another buffer as well)
IN_PLACE_OPTIONAL = {"add_rms_norm", "add_rms_norm_quant"}


def _later_in_place(g, p, nodes) -> list:
    """(graph, value) of the outputs that unmerged IN_PLACE_OPTIONAL launches write in place of
    a value merge p writes."""
    merged = {q.id for _, q, _ in nodes.values()}
    out = []
    for o in _written(p):
        for u in g.users(o):
            if u.op in IN_PLACE_OPTIONAL and u.id not in merged:
                out += [(g, v) for v in u.outputs if g.values[v].alias_of == o]
    return out


def _written(p) -> list[str]:
    """The producer's outputs the merged launch writes (all but the one its consumer reads; of
    add_rms_norm_quant's, the residual alone: the codes are made in the consumer's programs)."""
    if p.op == "add_rms_norm_quant":
        return p.outputs[:1]
    return [o for k, o in enumerate(p.outputs) if k != PROLOGUES[p.op]]


def merge_prologues(state):
    if (state.parallel or {}).get("dp", 1) > 1:     # a data-parallel plan's rows are G, not T
        return
    nodes = {}                                       # producer id -> (graph, producer, consumer id)
    fused = fused_shrinks(state, PHASE)
    for g in state.graph.walk():
        for p in g.ordered():
            if p.op in PROLOGUES and (c := _merge(state, g, p, fused)) is not None:
                nodes[p.id] = (g, p, c)
    # A merged launch writes its producer's outputs (one program) while every program reads the
    # producer's inputs, so those must be other memory: the producer's in-place alias is dropped.
    # A merge whose written output still shares a buffer with one of its inputs (through a later
    # in-place op that is not merged, or the layer's carried values) is not made; dropping it
    # restores its alias, which may undo another's, so this runs to a fixed point.
    original = {o: g.values[o].alias_of for g, p, _ in nodes.values() for o in _written(p)}
    for g, p, _ in nodes.values():
        for o in _written(p):
            g.values[o].alias_of = None
    # A clash through a later unmerged add_rms_norm that writes its residual in place of the
    # merged launch's (the MoE layer's second norm, whose h feeds the router and the experts: two
    # readers, so it stays a launch of its own, and its in-place residual is the layer's carried
    # value): that residual takes a buffer of its own first (one [T, H] buffer), and only a clash
    # that remains drops the merge.
    from infc import config
    frees = config.NARROW_MERGE_FREES_RESIDUALS
    freed: dict[str, list] = {}                      # merge -> [(graph, value)] whose alias it dropped
    while True:
        roots = memory_classes(state.graph)
        clash = [pid for pid, (g, p, _) in nodes.items()
                 if {roots.find(o) for o in _written(p)} & {roots.find(i) for i in p.inputs}]
        if not clash:
            break
        unalias = {pid: _later_in_place(*nodes[pid][:2], nodes) for pid in clash if pid not in freed} if frees else {}
        if any(unalias.values()):
            for pid, vals in unalias.items():
                freed[pid] = [(g, v, g.values[v].alias_of) for g, v in vals]
                for g, v in vals:
                    g.values[v].alias_of = None
            continue
        for pid in clash:
            g, p, _ = nodes.pop(pid)
            for o in _written(p):
                g.values[o].alias_of = original[o]
            for g2, v, alias in freed.pop(pid, []):
                g2.values[v].alias_of = alias
    for g, p, c in nodes.values():
        state.note("merge_prologues", f"{g.name}: {p.op} (line {p.line}) into {g.nodes[c].op} "
                                      f"(line {g.nodes[c].line}), {PHASE} phase")
    if nodes:
        state.merges[PHASE] = {pid: c for pid, (_, _, c) in nodes.items()}


def merged_launch(p, c, prologue_launch: dict, consumer_launch: dict) -> dict:
    """One launch for producer p and consumer c (their launch dicts as plan._launches makes them):
    the producer's inputs, then the consumer's other inputs (all but input FEEDS[p.op], default 0,
    which prologue["feeds"] names where it is not 0); the producer's outputs but the one the
    consumer read, then the consumer's."""
    if p.op == "add_rms_norm_quant":
        return _codes_merged_launch(p, c, prologue_launch, consumer_launch)
    feed, into = PROLOGUES[p.op], FEEDS.get(p.op, 0)
    h = p.outputs[feed]
    out = dict(consumer_launch)
    out["inputs"] = prologue_launch["inputs"] + [i for k, i in enumerate(consumer_launch["inputs"]) if k != into]
    out["outputs"] = [o for k, o in enumerate(prologue_launch["outputs"]) if k != feed] + consumer_launch["outputs"]
    out["prologue"] = {"op": p.op, "inputs": len(p.inputs), "output": feed, "value": h,
                       "writes": len(p.outputs) - 1, **({"feeds": into} if into else {}),
                       "attrs": prologue_launch["attrs"], "fuses": p.fused_from, "line": p.line}
    out["fuses"] = p.fused_from + c.fused_from
    out["pass"] = "merge_prologues"
    return out


def _codes_merged_launch(p, c, prologue_launch: dict, consumer_launch: dict) -> dict:
    """add_rms_norm_quant's merge (_codes_merge): the plain norm's merged launch, whose linear reads
    h (bf16) and makes its codes itself (no has_a_scale, no scales input): the same codes and
    scales bit for bit (compiler/passes/act_codes.py), so the same sums."""
    x_out, h = p.outputs[:2]
    out = dict(consumer_launch)
    out["inputs"] = prologue_launch["inputs"] + consumer_launch["inputs"][1:-1]
    out["outputs"] = [x_out] + consumer_launch["outputs"]
    out["attrs"] = {k: v for k, v in consumer_launch["attrs"].items() if k != "has_a_scale"}
    attrs = {k: v for k, v in prologue_launch["attrs"].items() if k != "act_quant"}
    out["prologue"] = {"op": "add_rms_norm", "inputs": len(p.inputs), "output": 1, "value": h,
                       "writes": 1, "attrs": attrs, "fuses": p.fused_from, "line": p.line}
    out["fuses"] = p.fused_from + c.fused_from
    out["pass"] = "merge_prologues"
    return out
