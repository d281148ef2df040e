"""The small kernels a rank plan's collective launches need on the GPU, rendered and compiled
ahead of time with the plan's own kernels (the runtime has no JIT).

A collective launch (backend "nccl", no template: compiler/ops/collectives.py) is issued by the
runtime's Collectives (runtime/cuda/collectives.py), which does some of it with kernels:

    all_reduce, ep_combine   device_copy: rank_sum over the N ranks' buffers on one GPU (fp32,
                             rank order: the numpy reference's bits on every rank)
                             cast: rank_sum of one flat buffer of T elements, where the
                             partials are fp32 and the output bf16 (NCCL reduces in fp32, this
                             rounds once: runtime/cuda/collectives.py)
                             p2p: peer_sum, the one-shot all-reduce over the ranks' mapped
                             regions (runtime/cuda/p2p.py), the same sum and bits
    ep_dispatch              device_copy: ep_dispatch reading each row from its owner rank's
                             buffer; nccl: ep_dispatch over the owners' rows gathered by NCCL
    all_gather               copies only
    dp_dispatch              select: ep_dispatch's kernel (one source) over every rank's rows,
                             gathered into staging buffers (G rows) by NCCL or device copies
    dp_combine               device_copy: rank_sum of the ranks' row blocks r (T rows each);
                             nccl: none (ncclReduceScatter)

Each collective launch records its helpers' kernel ids as launch["helpers"] = {mode: id}, and
the kernels join plan["kernels"] (so the runner loads them with the others).
"""
from pathlib import Path

from .render import EXT, Kernel, _env, _tensor, render_template

# peer_sum's most programs per call (its META's max_programs); runtime/cuda/p2p.py's regions have
# flag words for up to p2p.MAX_PROGRAMS and refuse a kernel that could run more
P2P_MAX_PROGRAMS = 32


def _render(env, template: str, ins: list, outs: list, attrs: dict) -> Kernel:
    ctx = {"op": template, "phase": "collective", "inputs": ins, "outputs": outs, "attrs": attrs,
           "tune": {}}
    return render_template("triton", template, ctx, env)


def render_rank_kernels(plan: dict) -> dict[str, Kernel]:
    """Render the helpers of every collective launch of a rank plan; sets launch["helpers"].
    A plan without a `parallel` section has none: {}."""
    from infc.compiler.contract.program import launches
    par = plan.get("parallel")
    if not par:
        return {}
    world, env, kernels = par["world"], _env(), {}
    for program in plan["programs"].values():
        for launch, _ in launches(program):
            if launch["backend"] != "nccl":
                continue
            ins = [_tensor(plan, n, False) for n in launch["inputs"]]
            outs = [_tensor(plan, n, False) for n in launch["outputs"]]
            helpers = {}
            if launch["op"] in ("all_reduce", "ep_combine"):
                helpers["device_copy"] = _render(env, "rank_sum", ins[:1] * world, outs[:1] * world, {})
                helpers["p2p"] = _render(env, "peer_sum", ins[:1], outs[:1],
                                         {"world": world, "max_programs": P2P_MAX_PROGRAMS})
                if ins[0]["dtype"] != outs[0]["dtype"]:
                    # NCCL sums in the partials' dtype (fp32); this rounds the sum (or a rank's
                    # share of it) once: flat, T elements, T any count
                    flat = lambda t: {**t, "shape": ["T"]}  # noqa: E731
                    helpers["cast"] = _render(env, "rank_sum", [flat(ins[0])], [flat(outs[0])], {})
            elif launch["op"] == "dp_dispatch":
                # the gathered inputs: G rows of x, weights and ids, in the inputs' dtypes
                gathered = [{**o, "dtype": i["dtype"]} for i, o in zip(ins, outs)]
                attrs = {"sources": 1, "world": world, "experts_per_rank": launch["attrs"]["experts_per_rank"]}
                helpers["select"] = _render(env, "ep_dispatch", gathered, outs, attrs)
            elif launch["op"] == "dp_combine":
                share = {**outs[0], "dtype": ins[0]["dtype"]}            # one rank's block: T rows
                helpers["device_copy"] = _render(env, "rank_sum", [share] * world, outs[:1] * world, {})
            elif launch["op"] == "ep_dispatch":
                for mode, sources in (("device_copy", world), ("nccl", 1)):
                    attrs = {"sources": sources, "world": world,
                             "experts_per_rank": launch["attrs"]["experts_per_rank"]}
                    helpers[mode] = _render(env, "ep_dispatch", ins[:1] * sources + ins[1:], outs, attrs)
            for k in helpers.values():
                kernels.setdefault(k.id, k)
            launch["helpers"] = {mode: k.id for mode, k in helpers.items()}
    return kernels


def attach_rank_kernels(plan: dict, out: Path) -> dict[str, Kernel]:
    """render_rank_kernels, their sources written to out/kernels/ and recorded in
    plan["kernels"] as compiler.build.generate records the others (call it after generate)."""
    kernels = render_rank_kernels(plan)
    kdir = Path(out) / "kernels"
    kdir.mkdir(parents=True, exist_ok=True)
    for kid, k in sorted(kernels.items()):
        path = kdir / f"{kid}{EXT[k.backend]}"
        if not path.exists() or path.read_text() != k.source:
            path.write_text(k.source)
        plan.setdefault("kernels", {})[kid] = {"backend": k.backend, "template": k.template,
                                               "source": f"kernels/{kid}{EXT[k.backend]}", **k.meta}
    return kernels
