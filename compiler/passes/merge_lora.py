"""A narrow or decode step's LoRA sites in the base GEMV's launch (--enable-lora; compiler/passes/add_lora.py
makes the sites): [y0 = linear(x, W); xa = lora_shrink(x, A); y = lora_expand(y0, xa, B, scale)]
-> one GEMV launch (codegen_templates/triton/gemv.py.j2, `lora`), and a gate|up site's
lora_expand_act -> one gated GEMV launch (act(gate + dg) * (up + du) in its epilogue).

Why: at batch 1 the adapter's work is tiny (a rank-16 site reads ~0.1-0.4 MB of tables against the
linear's 5-40 MB), so its own launches cost their drain and fill, not their bytes: an H200
profile measured 4.68 ms a qwen3-4b step with the LoRA launches against 2.28 ms without
(bench/NOTES.md, issue 46). The expand needs the shrink's sum over all of K before it adds
into any output column, which no single GEMV program has: programs of the launch's own (past the
GEMV's column blocks; by default a range each, up to 24) claim the shrink's K ranges (an atomic
counter; ranges of 16 KB of A by default: a claim costs round trips, not bytes) while the GEMV's
programs stream W, the last to finish a range sums the ranges in a fixed order, and the programs
that add the delta (split 0's, in their epilogue) wait for that sum. Those look at the sum once
after their W stream and, where it is not ready, claim until none is left before they wait, so
every range is held by a program that is running and never waits before finishing it: no
deadlock, whatever order the GPU starts programs in (_lora_tiles.j2's ticket rule, here by
claims). The schedule (LORA_KS, LORA_PROGRAMS, LORA_EARLY, LORA_PARTS, LORA_FIRST) is tunable per launch: `infc tune`'s
narrow grid times it under the site's own table key (codegen/render.py lora_key).

A decode step (2 up to the wide program's rows) takes its sites the same way, on the GEMV's
tensor-core path with the rows as a block (codegen_templates/triton/_lora_rows.j2): there the
separate launches cost 8 a layer over tables of every slot the step's rows use. Its scratch is
sized by the wide program's row count, so a plan without a wide program keeps the decode phase's
separate launches (compiler/passes/select_kernels.py drops its sites), as does a build with
infc/config.py LORA_DECODE_SITES off (the A/B switch). With it off, LORA_DECODE_EXPAND takes a
decode step's expands alone into their GEMVs (state.lora_apart): the shrink stays a launch of its
own, emitted just before the GEMV (it reads only the linear's x), whose epilogue adds the delta from
the shrink's output: 4 launches a layer fewer than the separate form, and no in-launch shrink.

The graph keeps the three nodes (every other phase launches them as before); this pass records
the sites, state.lora_sites[phase] = {linear id: [shrink id, expand id]}, and plan.py builds
the one launch (lora_launch). merge_prologues then still merges the residual add + RMSNorm into
the linear (the site's shrink reads the same normalized x, in the same launch), so a LoRA layer
of a narrow step is as many launches as the base model's.

A site merges only where: the shrink's output feeds its expand alone, the expand reads the
linear's output alone, the linear reads the shrink's x, nothing but views run between them, the
linear's narrow template is the GEMV (no row-parallel fp32 output, no feature backend), and its
rows are T. Without --enable-lora there is no lora_shrink: the pass does nothing.
"""
from ..ops import REGISTRY

PHASE = "narrow"
# the phases whose GEMVs take the site: a narrow step's rows one at a time (the CUDA-core path), a
# decode step's as a block (the tensor-core path: codegen_templates/triton/_lora_rows.j2)
PHASES = (PHASE, "decode")


def _site(state, g, s, phase: str = PHASE) -> tuple | None:
    xa = s.outputs[0]
    users = g.users(xa)
    if len(users) != 1 or g.uses(xa) != 1:
        return None
    e = users[0]
    if e.op not in ("lora_expand", "lora_expand_act") or e.inputs[1] != xa:
        return None
    lin = g.producer(e.inputs[0])
    if lin is None or lin.op != "linear" or lin.inputs[0] != s.inputs[0] or g.uses(e.inputs[0]) != 1:
        return None
    if lin.attrs.get("out_dtype") == "f32" or lin.attrs.get("quant") is not None:
        return None
    if REGISTRY[lin.op].template(state.backend, phase) != "gemv":
        return None
    if any(REGISTRY[n.op].template(b, phase, inherit=False) for n in (lin, s, e) for b in state.features):
        return None
    i0, i1 = g.order.index(lin.id), g.order.index(e.id)
    if any(n != s.id and not REGISTRY[g.nodes[n].op].view for n in g.order[i0 + 1:i1]) \
            or g.order.index(s.id) < i0:
        return None
    if g.values[s.inputs[0]].type.shape[:1] != ("T",):
        return None
    return lin.id, e.id


def merge_lora(state):
    if state.lora_plan is None or (state.parallel or {}).get("dp", 1) > 1:
        return
    from infc import config       # read at the pass's run: a variant build sets it (prepare.py)
    decode = config.LORA_DECODE_SITES or config.LORA_DECODE_EXPAND
    for phase in PHASES if decode else (PHASE,):
        sites = {}
        for g in state.graph.walk():
            for s in g.ordered():
                if s.op == "lora_shrink" and (site := _site(state, g, s, phase)) is not None:
                    sites[site[0]] = [s.id, site[1]]
                    state.note("merge_lora", f"{g.name}: line {s.line}: {g.nodes[site[1]].op} in the "
                                             f"GEMV's launch, {phase} phase")
        if sites:
            state.lora_sites[phase] = sites
            if phase != PHASE and not config.LORA_DECODE_SITES:
                state.lora_apart.add(phase)


def fused_shrinks(state, phase: str = PHASE) -> set:
    """The lora_shrink node ids that run inside their linear's launch in the phase."""
    return {s for s, _ in state.lora_sites.get(phase, {}).values()}


def lora_launch(s, e, launch: dict, apart: bool = False) -> dict:
    """The linear's launch (with its merged prologue, if any) taking site (shrink s, expand e):
    the tables A, B, scale after its inputs (apart: the shrink's output in place of A, lora.shrink
    "apart"), the expand's output in place of the linear's; a lora_expand_act site renders the
    gated GEMV (gemv_gated: fn in its attrs)."""
    out = dict(launch)
    out["inputs"] = launch["inputs"] + [s.outputs[0] if apart else s.inputs[1], e.inputs[2], e.inputs[3]]
    out["outputs"] = launch["outputs"][:-1] + [e.outputs[0]]
    if e.op == "lora_expand_act":
        out["kernel"] = "gemv_gated"
        out["attrs"] = {**launch["attrs"], "fn": e.attrs["fn"]}
    out["lora"] = {"inputs": 3, "pieces": list(e.attrs["pieces"]), "rank": e.attrs["rank"],
                   "ops": [s.op, e.op], "attrs": [dict(s.attrs), dict(e.attrs)], "value": launch["outputs"][-1], "lines": [s.line, e.line]}
    if apart:
        out["lora"]["shrink"] = "apart"
    out["fuses"] = launch["fuses"] + ([] if apart else s.fused_from) + e.fused_from
    out["pass"] = "merge_lora"
    return out
