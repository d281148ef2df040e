"""What `infc inspect` says of a plan's weight bytes: the model's total (by dtype), and for each
quantized launch its scheme and the weight bytes it reads, codes and companions (scales, zero
points, group indices) apart: the floor a decode step's weight reads set.

A quantized expert launch (moe_gate_up / moe_down over a stack of E experts) reads, per token,
only the experts its router picks: its note gives one expert's bytes and how many a token reads
(the router's k, plus the always-on shared experts), and the per-step totals count that share
of the stack (a batch-1 step's reads, as bench/active_floor.py counts them)."""
from collections import Counter

from ..contract.program import launches
from ..contract.schema import nbytes
from ..contract.weight_roles import quant_roles
from .scheme import QuantScheme


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n} B"


def weight_bytes(plan: dict) -> tuple[int, Counter]:
    """(the bytes of every stored weight, every layer's copy, bytes by dtype); tied weights once."""
    by = Counter()
    for w in plan["weights"].values():
        if "tied" not in w["source"]:
            by[w["dtype"]] += nbytes(w["dtype"], w["shape"]) * len(w["layers"] or [None])
    return sum(by.values()), by


def launch_reads(plan: dict, launch: dict) -> tuple[str, int, int] | None:
    """(codes weight, codes bytes, companion bytes) a quantized launch reads; None for others."""
    if not launch.get("attrs", {}).get("quant"):
        return None
    roles = quant_roles({"weights": plan["weights"], "programs": {"one": [launch]}})
    size = {n: nbytes(plan["weights"][n]["dtype"], plan["weights"][n]["shape"]) for n in roles}
    codes = next(n for n, (role, _, _) in roles.items() if role == "codes")
    return codes, size[codes], sum(size.values()) - size[codes]


EXPERT_OPS = ("moe_gate_up", "moe_down")


def routed_k(plan: dict, launch: dict) -> int | None:
    """The experts a routing launch (moe_route*) picks a token: its k, or for a frozen table
    (moe_route_table: [V, K] ids, whose attrs say none) K; None where neither is there."""
    a = launch.get("attrs", {})
    if "k" in a:
        return int(a["k"])
    if launch["op"] == "moe_route_table" and len(launch["inputs"]) > 1 and launch["inputs"][1] in plan["weights"]:
        return int(plan["weights"][launch["inputs"][1]]["shape"][-1])
    return None


def _per_token(plan: dict) -> int | None:
    """The experts a token reads (the router's k + shared), from the plan's first routing launch."""
    for program in plan["programs"].values():
        for launch, _ in launches(program):
            if launch["op"].startswith("moe_route"):
                k = routed_k(plan, launch)
                if k is not None:
                    return k + int(launch["attrs"].get("shared", 0))
    return None


def expert_share(plan: dict, launch: dict, codes: str) -> tuple[int, int] | None:
    """(experts in the stack, experts a token reads) of an expert launch; None for others."""
    if launch["op"] not in EXPERT_OPS:
        return None
    k = _per_token(plan)
    return (plan["weights"][codes]["shape"][0], k) if k else None


def quant_note(plan: dict, launch: dict) -> str:
    """The launch table's note on a quantized launch ("" for others)."""
    got = launch_reads(plan, launch)
    if got is None:
        return ""
    w, codes, comps = got
    scheme = QuantScheme.from_attrs(launch["attrs"]["quant"])
    share = expert_share(plan, launch, w)
    if share:
        e, k = share
        return (f"  [quant {scheme}: {e} experts of {codes // e} B codes + {comps // e} B scales each, "
                f"{k} a token]")
    return f"  [quant {scheme}: reads {codes} B codes + {comps} B scales]"


def weights_section(plan: dict, phases=None) -> list[str]:
    """The model's weight bytes, and per phase (all, or `phases`) the quantized launches' reads
    per step."""
    total, by = weight_bytes(plan)
    out = [f"== weights: {_mib(total)} in all (" + ", ".join(f"{d} {_mib(n)}" for d, n in sorted(by.items())) + ")"]
    for phase in phases or list(plan["programs"]):
        program = plan["programs"][phase]
        rows, codes_all, comps_all, plain, experts = Counter(), 0, 0, 0, False
        upcasts = Counter()
        for launch, mult in launches(program):
            if launch["op"] == "expert_upcast":      # runs only in steps of attrs.rows rows or more
                w, codes, comps = launch_reads(plan, launch)
                out_bytes = nbytes("bf16", plan["weights"][w]["shape"])
                upcasts[(w, launch["attrs"]["rows"], codes, comps, out_bytes)] += mult
                continue
            got = launch_reads(plan, launch)
            if got is None:
                plain += mult * sum(nbytes(plan["weights"][i]["dtype"], plan["weights"][i]["shape"])
                                    for i in launch["inputs"] if i in plan["weights"])
                continue
            w, codes, comps = got
            # bytes a weight element, scales included (as stored on the device: f32 companions)
            elems = 1
            for d in plan["weights"][w]["shape"]:
                elems *= d
            per = f"{(codes + comps) / elems:.3f} B a weight"
            share = expert_share(plan, launch, w)
            experts = experts or bool(share)
            if share:           # a batch-1 step reads k of the E experts
                codes, comps = codes * share[1] // share[0], comps * share[1] // share[0]
            rows[(launch["op"], w, str(QuantScheme.from_attrs(launch["attrs"]["quant"])), codes, comps,
                  f"  ({share[1]} of {share[0]} experts, {per})" if share else f"  ({per})")] += mult
            codes_all, comps_all = codes_all + codes * mult, comps_all + comps * mult
        if rows:
            out.append(f"  {phase}: quantized launches read {_mib(codes_all)} codes + {_mib(comps_all)} scales "
                       f"a step{' (experts: a batch-1 step' + chr(39) + 's share)' if experts else ''} (the other "
                       f"launches' weights: {_mib(plain)})")
            for (op, w, scheme, codes, comps, note), n in rows.items():
                out.append(f"    {op:<14} {w:<16} {scheme:<40} {codes:>10} B codes {comps:>8} B scales  x{n}{note}")
        for (w, at, codes, comps, wrote), n in upcasts.items():
            out.append(f"    {'expert_upcast':<14} {w:<16} in steps of >= {at} rows: reads {codes} B codes + "
                       f"{comps} B scales, writes {wrote} B bf16  x{n}  (then the grouped GEMMs read the bf16 "
                       f"stack: compiler/passes/upcast_experts.py)")
    return out
