"""`infc inspect`: the map from spec to kernel launch, generated from the compiler itself.

Prints the graph before and after fusion, the pass log, the launches of each phase (with the
count per layer), and the routing table op -> pass -> template -> launch.
"""
import json
from collections import Counter

from infc.compiler.contract.program import bodies, count_launches, is_repeat, launches, layer_counts

from infc.compiler.contract.schema import nbytes
from infc.compiler.contract.weight_roles import FILL_KINDS, fill_key, is_derived

from .build import compile_model
from .ir import Graph
from .memory_budget import budget_lines, snapshot_lines
from .quant.report import quant_note, weights_section



def _graph_text(g: Graph, indent="") -> list[str]:
    lines = []
    for n in g.ordered():
        if n.op == "layers":
            lines.append(f"{indent}{', '.join(n.outputs)} = layers({', '.join(n.inputs)})  x{n.attrs['count']}")
            counts = Counter(n.attrs["schedule"])
            for kind, body in n.bodies.items():
                lines.append(f"{indent}  layer kind {kind} x{counts[kind]} ({', '.join(body.inputs)}) -> "
                             f"({', '.join(body.outputs)}):")
                lines += _graph_text(body, indent + "    ")
            continue
        types = ", ".join(str(g.values[o].type) if g.values[o].type else "cache" for o in n.outputs)
        lines.append(f"{indent}{'line ' + str(n.line) if n.line else '':>8}  {', '.join(n.outputs)} = "
                     f"{n.op}({', '.join(n.inputs)})  -> {types}")
    return lines


def _launch_table(plan: dict, program: list, bin_dir=None, indent="  ") -> list[str]:
    lines = []
    for l in program:
        if is_repeat(l):
            counts = layer_counts(l)
            for kind, body in bodies(l).items():
                lines.append(f"{indent}repeat {l['repeat']}, kind {kind} x{counts[kind]} layers: "
                             f"{len(body)} launches per layer")
                lines += _launch_table(plan, body, bin_dir, indent + "    ")
            continue
        kid = l.get("kernel_id", "-")
        cubin = "-"
        if bin_dir is not None and kid != "-":
            p = bin_dir / f"{kid}.cubin"
            cubin = _short(p) if p.exists() else "(not compiled: infc build)"
        lines.append(f"{indent}{l['op']:<20} {l['backend']:<8} {kid:<32} "
                     f"({', '.join(l['inputs'])}) -> ({', '.join(l['outputs'])})  cubin {cubin}"
                     + quant_note(plan, l))
    return lines


def _short(p) -> str:
    from .build import REPO
    try:
        return str(p.relative_to(REPO))
    except ValueError:
        return str(p)


def routing_table(plan: dict, phases=None) -> list[str]:
    rows = Counter()
    for phase in list(plan["programs"]) if phases is None else phases:
        for l, mult in launches(plan["programs"][phase]):
            key = ("+".join(l["fuses"]) or "-", l["pass"], l["op"], phase, f"{l['backend']}:{l['kernel']}")
            rows[key] += mult
    head = f"  {'spec ops':<44} {'pass':<24} {'launch op':<20} {'phase':<8} {'template':<26} {'launches/step':>13}"
    out = [head, "  " + "-" * (len(head) - 2)]
    for (fuses, pss, op, phase, tmpl), n in rows.items():
        out.append(f"  {fuses:<44} {pss:<24} {op:<20} {phase:<8} {tmpl:<26} {n:>13}")
    return out


def to_dot(plan: dict, phase: str = "decode") -> str:
    lines = ["digraph plan {", "  rankdir=TB; node [shape=box, fontname=monospace];"]
    producer = {}

    def visit(prog, prefix):
        for k, l in enumerate(prog):
            if is_repeat(l):
                counts = layer_counts(l)
                for j, (kind, body) in enumerate(bodies(l).items()):
                    lines.append(f"  subgraph cluster_{kind} {{ label=\"{kind} x{counts[kind]}\";")
                    visit(body, f"{prefix}L{j}_")
                    lines.append("  }")
                continue
            nid = f"{prefix}{k}"
            lines.append(f"  {nid} [label=\"{l['op']}\\n{l['backend']}:{l['kernel']}\"];")
            for i in l["inputs"]:
                if i in producer:
                    lines.append(f"  {producer[i]} -> {nid} [label=\"{i}\"];")
            for o in l["outputs"]:
                producer[o] = nid

    visit(plan["programs"][phase], "n")
    lines.append("}")
    return "\n".join(lines) + "\n"


def collectives(plan: dict, phases=None) -> list[str]:
    """The launches that move data between ranks, per phase (with --tensor-parallel-size)."""
    out = []
    for phase in list(plan["programs"]) if phases is None else phases:
        rows = Counter()
        for l, mult in launches(plan["programs"][phase]):
            if l["backend"] == "nccl":
                rows[(l["op"], l.get("line"), ", ".join(l["inputs"]), ", ".join(l["outputs"]))] += mult
        out.append(f"  {phase}: {sum(rows.values())} per step")
        for (op, line, ins, outs), n in rows.items():
            out.append(f"    {op:<12} line {str(line):<5} ({ins}) -> ({outs})  x{n}")
    return out


def inspect(model=None, spec_path=None, model_dir=None, dot=None, phases=None, spec_dirs=None,
            tensor_parallel_size=1, enable_expert_parallel=False, rank=None, data_parallel_size=1,
            lora=None, narrow_tokens=None) -> str:
    """narrow_tokens: compile_model's (a speculative build's k + 1: its verify program); one-GPU only."""
    from .parallel import settings
    par = settings(tensor_parallel_size, enable_expert_parallel, data_parallel_size=data_parallel_size)
    if par is None:
        return _inspect_one(model, spec_path, model_dir, dot, phases, spec_dirs, lora=lora,
                            narrow_tokens=narrow_tokens)
    ranks = range(par["world"]) if rank is None else [rank]
    if rank is not None and not 0 <= rank < par["world"]:
        raise ValueError(f"--rank {rank}: the ranks are 0..{par['world'] - 1}")
    dp = f", dp {par['dp']}" if par.get("dp") else ""
    return "\n\n".join(f"######## rank {r} of {par['world']} (tp {par['tp']}, ep {par['ep']}{dp})\n" +
                       _inspect_one(model, spec_path, model_dir, dot if r == ranks[0] else None,
                                    phases, spec_dirs, {**par, "rank": r}, lora) for r in ranks)


def _inspect_one(model, spec_path, model_dir, dot, phases, spec_dirs, parallel=None, lora=None,
                 narrow_tokens=None) -> str:
    snapshots = {}

    state, plan = compile_model(model, spec_path, model_dir, observe=lambda name, st:
                                snapshots.__setitem__(name, _graph_text(st.graph, "    ")),
                                spec_dirs=spec_dirs, parallel=parallel, lora=lora,
                                narrow_tokens=narrow_tokens)
    import tempfile
    from pathlib import Path
    from .build import GENERATED, generate
    from .codegen.render import TemplateError
    unrendered = None
    with tempfile.TemporaryDirectory() as tmp:
        try:
            generate(plan, Path(tmp))             # kernel ids, as `infc build` names them
        except TemplateError as e:                # the plan is still worth reading
            unrendered = str(e)
    bin_dir = GENERATED / state.model / "bin"
    out = [f"model {plan['model']}  (family {plan['family']}, spec {state.spec.path})",
           "config: " + ", ".join(f"{k}={v}" for k, v in plan["config"].items()
                                  if not isinstance(v, (dict, list))),
           "", "== graph before fusion (after infer_types)"] + snapshots["infer_types"]
    if unrendered:
        out[2:2] = [f"kernels: not rendered ({unrendered}); launches show no kernel id"]
    out += ["", "== passes"] + [f"  {p:<24} {m}" for p, m in state.log]
    out += ["", "== graph after fusion"] + snapshots[list(snapshots)[-1]]
    a = plan["arena"]
    out += ["", f"== memory: arena = {a['bytes_per_token']}*T + {a['bytes_per_seq']}*B + {a['bytes']} bytes"]
    stacks = {launch["outputs"][0] for program in plan["programs"].values() for launch, _ in launches(program)
              if launch["op"] == "expert_upcast" and launch["outputs"][0] in plan["buffers"]}
    if stacks:            # (plan_memory reuses one buffer for every layer's, gate|up's and down's)
        held = {}
        for b in stacks:
            at = json.dumps(plan["buffers"][b]["offset"])
            held[at] = max(held.get(at, 0), nbytes("bf16", plan["buffers"][b]["shape"]))
        out += [f"  of the fixed bytes, {sum(held.values())} hold the bf16 expert stacks of many-token steps "
                f"(compiler/passes/upcast_experts.py: {len(stacks)} stacks in {len(held)} buffer(s))"]
    resident = [n for n, w in plan["weights"].items() if is_derived(w["source"])]
    if resident:          # (compiler/passes/upcast_experts.py resident mode: weights, not arena)
        size = sum(nbytes(plan["weights"][n]["dtype"], plan["weights"][n]["shape"])
                   * len(plan["weights"][n]["layers"] or [None]) for n in resident)
        out += [f"  derived weights (written once by the load program): {', '.join(resident)}, {size} bytes"]
    absent = [p for p in phases or [] if p not in plan["programs"]]
    for p in absent:          # "wide", "short", "narrow" and "verify" exist only where they run differently
        out += ["", f"== launches: {p}  (none: this plan has no {p} program; its steps run "
                    f"{'decode' if p in ('wide', 'narrow', 'verify') else 'mixed / prefill'})"]
    phases = [p for p in phases if p in plan["programs"]] if phases else list(plan["programs"])
    out += [""] + weights_section(plan, phases)
    out += [""] + budget_lines(plan)
    if snapshot_lines(plan):
        out += [""] + snapshot_lines(plan)
    for phase in phases:
        total, per_layer = count_launches(plan["programs"][phase])
        when = {"short": f"; prefill / mixed steps of <= {plan.get('short_tokens')} tokens",
                "wide": f"; decode steps of >= {plan.get('wide_tokens')} sequences",
                "narrow": f"; decode steps of <= {plan.get('narrow_tokens')} tokens",
                "verify": f"; decode steps of {plan.get('narrow_tokens', 0) + 1}-{plan.get('verify_tokens')} "
                          f"tokens: the narrow launches {plan.get('verify_tokens')} rows wide",
                "load": "; once, after the weights, before any step: it writes the derived weights"}.get(phase, "")
        per = "in all" if phase == "load" else "per step"
        out += ["", f"== launches: {phase}  ({per_layer} per layer, {total} {per}{when})"]
        out += _launch_table(plan, plan["programs"][phase], bin_dir)
    if plan.get("sampler"):
        out += ["", "== sampler: after each step, on the logits, outside the decode graph (runtime/cuda/sampler.py)"]
        out += [f"  {name:<12} {kid}" for name, kid in plan["sampler"].items()]
    if plan.get("weight_init"):
        out += ["", "== weight init: --load-format dummy fills each weight on the device, before the first step"]
        out += [f"  {'fill_random':<12} {plan['weight_init']}"]
        out += [f"  {'fill (' + kind + ')':<12} {plan[fill_key(kind)]}" for kind in FILL_KINDS
                if kind != "bf16" and plan.get(fill_key(kind))]
    if parallel:
        out += ["", "== collectives (backend nccl: the runtime's communicator, no kernel)"]
        out += collectives(plan, phases)
    out += ["", "== routing table: spec ops -> pass -> launch op -> template (launches per step)"]
    out += routing_table(plan, phases)
    if dot:
        with open(dot, "w") as f:
            f.write(to_dot(plan))
        out += ["", f"wrote {dot}"]
    return "\n".join(out)
