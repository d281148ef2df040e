"""Kernel selection: for each launch and phase, the backend and template that implement it.

Triton is the default and covers every op; `--features tilelang,cuda` lets another backend
take a launch wherever the op's home declares a template for that backend and phase.
"""
from infc.config import NARROW_TOKENS

from ..ops import REGISTRY

PHASES = ("prefill", "decode", "mixed", "short", "wide", "narrow")
# "narrow": a decode step of at most plan["narrow_tokens"] tokens, the decode program with
# launches merged for that phase only (state.merges; compiler/passes/merge_prologues.py). Its GEMVs
# take their CUDA-core path at one row, the tensor-core path at more, both with the merged
# prologue. A plan without such a merge has no narrow program, unless a linear reads ready fp8
# activation codes (compiler/passes/act_codes.py): a narrow GEMV dots them on tensor cores
# (triton/_gemv_narrow_codes.j2) where the decode one converts W on CUDA cores.
# A prefill or mixed step of at most this many tokens runs the "short" program (compiler/contract/program.py
# `program_name`; recorded as plan["short_tokens"]): its linears take the decode GEMV templates,
# which stream the weight once at any row count, where the prefill GEMM's long-prompt tiles
# waste most of their work on a few dozen rows. Attention stays attention_prefill (several
# tokens per sequence); every other op runs as in mixed (OpDef.template: short -> mixed).
SHORT_TOKENS = 64
# "verify": a speculative build's (state.narrow_tokens = k + 1 > infc/config.py NARROW_TOKENS)
# decode steps of NARROW_TOKENS + 1 .. k + 1 rows (verify(k) at batch 1; plan["verify_tokens"]):
# the narrow program's launches (its merges and LoRA sites: SAME_LAUNCHES), rendered k + 1 rows
# wide (its GEMVs keep the tensor-core path for 2+ rows, its attention writes the other verify
# rows' keys). The narrow program stays one row wide, its kernels byte-identical to a one-token
# build's: compiled into the same kernel, the tensor-core path cost the one-row step 19 % on an
# H200 even untaken (bench/NOTES.md, "Measured after the session's merges").
SAME_LAUNCHES = {"verify": "narrow"}
# A decode step whose experts get at least this many tokens each on average (T * k / E, E the
# whole model's routed experts) runs the "wide" program (plan["wide_tokens"] = the T where that
# starts): the decode program with the experts' grouped GEMMs (moe_align's lists, one tensor-core
# tile per expert and column block) in place of the per-expert GEMVs, whose cost grows with the
# tokens each expert serves. Measured on qwen3-30b-a3b (H100, bench/NOTES.md): at 64 decodes the
# two are even, at 128 the grouped GEMMs take 3.8 ms less a step, at 200 11 ms less.
WIDE_TOKENS_PER_EXPERT = 8
# The decode GEMVs tile their rows (BLOCK_T): each row block streams W again, so a block of 32
# rows, right for a few sequences, reads gate|up 8 times at 255 decodes (115 us against a 33 us
# floor, H100). In the wide program the gated and act_mul GEMVs keep their templates with the
# wide phase's own row tiles (the template's wide defaults, then the tuning table's "wide|..."
# entries), and a plain linear takes the GEMM's decode tiles (compiler/ops/linear.py): every plan
# with such a launch has a wide program. Without experts it starts at WIDE_DENSE_TOKENS decodes,
# where the measured tiles part (bench/NOTES.md, "wide decode steps", qwen3-4b on an H100: at 64
# decodes the two are even, the wide GEMVs take ~1.4 ms less a step at 128 and ~3.5 ms at 256).
ROW_TILED = frozenset({"gemv", "gemv_act_mul", "gemv_gated", "lm_head_last"})
WIDE_DENSE_TOKENS = 128
# "load": launches run once, after the weights are in place and before any step or graph capture
# (runtime/cuda/runner.py, runtime/reference/executor.py), never captured: they write derived
# weights (a weight source {"derived": ...}, runtime/weights/recipes.py). Only a node a pass marks
# with attrs[LOAD_ATTR] is launched there, and such a node by no other program; a plan without
# one has no load program (every other plan unchanged).
LOAD = "load"
LOAD_ATTR = "at_load"


def at_load(n) -> bool:
    """Whether node n runs in the load program alone."""
    return bool(n.attrs.get(LOAD_ATTR))


def select_kernels(state):
    for phase in PHASES + (LOAD,):
        table = {}
        for g in state.graph.walk():
            for n in g.ordered():
                if n.op == "layers" or REGISTRY[n.op].view:
                    continue
                op = REGISTRY[n.op]
                if at_load(n) != (phase == LOAD):
                    continue             # the load program's launches, and only those, run there
                if phase != LOAD and op.phases is not None and phase not in op.phases:
                    continue             # not launched by this program (plan.py leaves it out)
                if op.collective:        # between ranks: NCCL on the runner's stream, no template
                    table[n.id] = ("nccl", None)
                    continue
                backend, tmpl = state.backend, None
                # The feature backends implement each op's plain form: a launch with an optional
                # tensor (a bias) or without an omittable one (a weightless norm) stays on the
                # default backend, which covers every form.
                # Nor do they implement an op's triton_only_attrs (attention's ALiBi, chunks, ...).
                # They also assume bf16 outputs over the step's T rows, and no f32 operand (an
                # f32 norm weight: the 1 + w of Gemma's and Qwen3.5's RMSNorms).
                plain = not any(n.attrs.get(f"has_{p}") for p in op.optional + op.extra_optional + op.keyword_optional
                                + op.pass_inputs) \
                    and not any(n.attrs.get(f"has_{p}") is False for p in op.omittable) \
                    and all(g.values[o].type is None or g.values[o].type.dtype == "bf16" for o in n.outputs) \
                    and all(g.values[i].type is None or g.values[i].type.dtype != "f32" for i in n.inputs) \
                    and (not n.inputs or g.values[n.inputs[0]].type.shape[:1] == ("T",)) \
                    and not any(n.attrs.get(a) is not None for a in op.triton_only_attrs)
                features = list(state.features) if plain else []
                for b in features + [state.backend]:
                    # a feature backend takes a short launch only where it names the phase
                    # (its mixed GEMM is what short replaces)
                    tmpl = op.template(b, phase, inherit=b == state.backend)
                    if tmpl is not None:
                        backend = b
                        break
                # An op without a template (unfused attention, rope) still runs on the
                # reference executor; code generation refuses it with the op and line.
                table[n.id] = (backend, tmpl)
        state.kernels[phase] = table
    if state.kernels["wide"] == state.kernels["decode"] and \
            not any(t in ROW_TILED for _, t in state.kernels["wide"].values()):
        del state.kernels["wide"]                 # nothing runs differently: no program of its own
        # a decode launch's LoRA site sizes its scratch by the rows below the wide program's
        # (codegen_templates/triton/_lora_rows.j2): without one, the separate launches
        state.lora_sites.pop("decode", None)
        state.lora_apart.discard("decode")
    ready_codes = any(n.attrs.get("has_a_scale") for g in state.graph.walk() for n in g.ordered())
    if not state.merges.get("narrow") and not state.lora_sites.get("narrow") and not ready_codes:
        del state.kernels["narrow"]
    if not state.kernels[LOAD]:
        del state.kernels[LOAD]                   # nothing to run at load: no program
    if "narrow" in state.kernels and state.narrow_tokens > NARROW_TOKENS:
        state.kernels["verify"] = dict(state.kernels["narrow"])
    state.note("select_kernels", ", ".join(f"{p}: {len(t)} launches" for p, t in state.kernels.items()))


def wide_tokens(state) -> int:
    """The fewest decode tokens that give every routed expert WIDE_TOKENS_PER_EXPERT tokens on
    average, over the model's MoE layers (the largest such T); WIDE_DENSE_TOKENS without experts.
    Under expert parallelism a rank holds E / ep of the experts, and the ids name the whole
    model's: E is the model's."""
    par = state.parallel or {}
    ep = par.get("ep", 1) if par.get("world", 1) > 1 else 1
    need = []
    for g in state.graph.walk():
        for n in g.ordered():
            if n.op == "moe_gate_up":
                # shared experts folded in as always-on ones (fold_shared_experts) get every token:
                # the rule counts the routed experts and their slots only
                route = g.producer(n.inputs[1])
                shared = route.attrs.get("shared", 0) if route is not None and route.op.startswith("moe_route") else 0
                E = (g.values[n.inputs[2]].type.shape[0] - shared) * ep
                k = g.values[n.inputs[1]].type.shape[1] - shared
                need.append(-(-WIDE_TOKENS_PER_EXPERT * E // k))
    return max(need) if need else WIDE_DENSE_TOKENS
