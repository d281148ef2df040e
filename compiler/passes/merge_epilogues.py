"""Per-phase launch merges, the other way round: a consumer run as its producer's epilogue.

An fp8 o_proj reads its activation codes from a `quantize_act` launch after attention
(compiler/passes/act_codes.py). In a decode step (narrow: a few tokens) that launch is
~4 KB of work a token paying a whole drain and fill (~2-3 us on an H200, bench/NOTES.md "Issue
42: the dense FP8 codes made once a step"), while decode attention's program that stores a
(token, head) row holds all head_dim columns of it: where the activation group is head_dim
columns, that row is one group, so the program (or the split merge that writes it) takes the
group's amax, scale and e4m3 codes of the bf16 row it stored, the bits quantize_act would read:

    narrow, decode, wide:  [o = attention_cached(q, cache); codes, s = quantize_act(view(o))]
             -> one launch attention_cached(q, cache) -> (o, codes, s) (narrow: (cache, o, codes,
             s), its qk_norm_rope_cache prologue merged too),
             launch["epilogue"] = {op: quantize_act, output: o's index, writes: 2, attrs, ...}

The decode programs' attention is decode attention (one row a sequence); prefill, mixed and
short keep the quantize_act launch (their attention tiles other shapes; the graph is one for
every phase, so the merge is a plan-level one, as merge_prologues' are).

Down's codes, in a one-token narrow step: the gated GEMV's codes path stores 32 act columns a
program, a quarter of a 128-column group, so its epilogue cannot take a group's amax alone; every
program of a group's column blocks (and K splits) counts in on a counter a group after its stores,
and the last to arrive reads the group back from L2 and quantizes it (the split-K merge's pattern;
codegen_templates/triton/gemv.py.j2):

    narrow:  [act = linear_gated(codes, W, ...); codes', s' = quantize_act(act)]
             -> linear_gated(codes, W, ...) -> (act, codes', s'), launch["epilogue"]
plan_memory keeps the producer's inputs live until the consumer's place (the codes are defined
there but written at the producer's), as for a merged prologue.
Not merged (left to its launch): activation groups other than head_dim, per-token or static
scales (a row-wide amax spans every head's programs), data-parallel plans (rows are G), and a
feature backend that takes either launch.

A linear-attention layer's short conv, in a one-token narrow step: the conv over one new token is
per channel (the channel's K - 1 cached inputs and the new one, then the cache shifted by one),
and the q|k|v GEMV's program that stores a channel holds it, so that program convolves it, writes
the conv's output and shifts the channel's slot (each channel has one writer: no race on the
cache, where a program of the delta rule would share its q / k channels with the other v-heads'):

    narrow:  [y = linear(x, W); qkv, ... = split(y); c = causal_conv1d(qkv, w_conv)]
             -> linear(x, W, w_conv) -> (y, c), launch["epilogue"] = {op: causal_conv1d,
                columns: qkv's first column in y, reads: 1 (+1 with a bias), ...}
Only a one-token narrow step (its GEMV has one row on the CUDA-core path, unsplit); a bf16 W
without a LoRA site; the decode, wide and verify programs keep the conv's launch (their rows are
several sequences').
"""
from infc.config import NARROW_TOKENS

from ..ops import REGISTRY
from ..ops.quant import scheme_of

# the phases whose attention is decode attention (select_kernels: wide inherits decode's template)
PHASES = ("narrow", "decode", "wide")
# consumer op -> producer op -> the templates that write the consumer's outputs in their epilogue
# (codegen_templates/triton/attention_decode.py.j2, gemv.py.j2's gated narrow codes path and its
# narrow conv)
PRODUCER_TEMPLATES = {"quantize_act": {"attention_cached": {"attention_decode"}, "linear_gated": {"gemv_gated"}},
                      "causal_conv1d": {"linear": {"gemv"}}}
# the gated GEMV's narrow codes path stores BLOCK_N / 2 = 32 act columns a program (its default
# tile): groups of a multiple of that hold whole programs (a tuned BLOCK_N that splits a group
# fails the render, as a K tile that splits one does)
GATED_COLUMNS = 32
CONSUMERS = tuple(PRODUCER_TEMPLATES)


def _producer(g, c):
    """(producer node, its output index) whose value c reads, through reshapes only; else None."""
    x = c.inputs[0]
    p = g.producer(x)
    while p is not None and p.op == "view":
        x = p.inputs[0]
        p = g.producer(x)
    if p is None or p.op not in PRODUCER_TEMPLATES[c.op]:
        return None
    return p, p.outputs.index(x)


def _column_source(g, value):
    """(producer node, its output index, first column) of a 2-D value that is a split's part of
    (or is) a node's [T, N] output; else None."""
    p = g.producer(value)
    column = 0
    if p is not None and p.op == "split":
        i = p.outputs.index(value)
        column = sum(p.attrs["sizes"][:i])
        value = p.inputs[0]
        p = g.producer(value)
    if p is None:
        return None
    return p, p.outputs.index(value), column


def _merge(state, g, c, phase):
    """The producer node c runs inside in this phase, or None (why not: see each test)."""
    if c.op == "causal_conv1d":
        return _merge_conv(state, g, c, phase)
    found = _producer(g, c)
    if found is None:
        return None
    p, out = found
    s = scheme_of({"quant": c.attrs.get("act_quant")})
    o = g.values[p.outputs[out]].type
    if s is None or s.act != "dynamic_group" or c.attrs.get("has_x_scale") or o.shape[:1] != ("T",):
        return None
    if p.op == "attention_cached":
        # one (token, head) row is one activation group (the program that stores it holds it whole)
        if o.shape[-1] != s.act_group or len(o.shape) != 3:
            return None
    elif not _gated_codes(state, p, phase) or s.act_group % GATED_COLUMNS:
        return None
    return p.id if _one_launch(state, g, p, c, phase) else None


def _one_launch(state, g, p, c, phase) -> bool:
    """Whether producer p's template in this phase writes c's outputs, neither op is a feature
    backend's, and only views lie between them (the merged launch writes c's outputs at p's place)."""
    if REGISTRY[p.op].template(state.backend, phase) not in PRODUCER_TEMPLATES[c.op][p.op]:
        return False
    if any(REGISTRY[n.op].template(b, phase, inherit=False) for n in (p, c) for b in state.features):
        return False
    between = g.order[g.order.index(p.id) + 1:g.order.index(c.id)]
    return all(REGISTRY[g.nodes[n].op].view for n in between)


def _merge_conv(state, g, c, phase):
    """The linear whose output's columns causal_conv1d c reads, where its one-token narrow GEMV
    convolves them (see the docstring), or None."""
    found = _column_source(g, c.inputs[0])
    if found is None or phase != "narrow" or min(state.narrow_tokens, NARROW_TOKENS) != 1:
        return None
    p, out, _ = found
    if p.op not in PRODUCER_TEMPLATES[c.op] or out != 0 or p.attrs.get("quant") or p.attrs.get("out_dtype"):
        return None
    if p.id in state.lora_sites.get(phase, {}) or g.values[c.inputs[0]].type.shape[:1] != ("T",):
        return None
    return p.id if _one_launch(state, g, p, c, phase) else None


def _gated_codes(state, p, phase) -> bool:
    """Whether the gated GEMV takes its narrow codes path unsplit in this phase: a one-token
    narrow step (the kernel has no tensor-core path), e4m3 W read with ready codes (act_codes),
    no LoRA site in its launch. (The template checks the tile and the split: it fails loudly.)
    The narrow program's rows are min(state.narrow_tokens, NARROW_TOKENS): a speculative build's
    k + 1 (state.narrow_tokens) widens its verify program, which plans no epilogue (not in PHASES),
    and leaves the narrow program one row wide, so it merges down's codes as a one-token build's."""
    s = scheme_of(p.attrs)
    return phase == "narrow" and min(state.narrow_tokens, NARROW_TOKENS) == 1 and bool(p.attrs.get("has_a_scale")) \
        and s is not None and s.codes == "f8e4m3" and not s.g_idx and p.attrs.get("out_dtype") != "f32" \
        and p.id not in state.lora_sites.get(phase, {})


def merge_epilogues(state):
    if (state.parallel or {}).get("dp", 1) > 1:     # a data-parallel plan's rows are G, not T
        return
    for phase in PHASES:
        found = {}
        for g in state.graph.walk():
            for c in g.ordered():
                if c.op in CONSUMERS and (p := _merge(state, g, c, phase)) is not None and p not in found:
                    found[p] = c.id
                    state.note("merge_epilogues", f"{g.name}: {c.op} (line {c.line}) into "
                                                  f"{g.nodes[p].op}'s epilogue, {phase} phase")
        if found:
            state.epilogues[phase] = found


def epilogue_launch(g, p, c, producer_launch: dict, consumer_launch: dict) -> dict:
    """One launch for producer p (its launch dict, possibly with a merged prologue) and the
    consumer c it runs as an epilogue: the producer's inputs, its outputs then the consumer's;
    launch["epilogue"]["output"] names the launch output the consumer reads (reshaped to its rows)."""
    out = dict(producer_launch)
    value = c.inputs[0]
    out["outputs"] = producer_launch["outputs"] + consumer_launch["outputs"]
    if c.op == "causal_conv1d":
        _, src, column = _column_source(g, value)
    else:
        (_, src), column = _producer(g, c), 0
    # the index of the producer's output the consumer reads, within the launch's outputs (after a
    # merged prologue's writes)
    writes = len(producer_launch["outputs"]) - len(p.outputs)
    # the consumer's other inputs (a conv's weight and bias) after the producer's, and its caches
    reads = consumer_launch["inputs"][1:]
    out["inputs"] = producer_launch["inputs"] + reads
    if consumer_launch.get("caches"):
        out["caches"] = sorted(set(producer_launch.get("caches", [])) | set(consumer_launch["caches"]))
    out["epilogue"] = {"op": c.op, "output": writes + src, "value": value,
                       "shape": list(g.values[value].type.shape),
                       **({"column": column, "reads": len(reads)} if c.op == "causal_conv1d" else {}),
                       "writes": len(c.outputs), "attrs": consumer_launch["attrs"],
                       "fuses": c.fused_from, "line": c.line}
    out["fuses"] = producer_launch["fuses"] + c.fused_from
    out["pass"] = "merge_epilogues"
    return out

