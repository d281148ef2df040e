"""What `infc inspect` says of a plan's weight bytes: the model's total (by dtype), and for each
quantized launch its scheme and the weight bytes it reads, codes and companions (scales, zero
points, group indices) apart: the floor a decode step's weight reads set."""
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


def quant_note(plan: dict, launch: dict) -> str:
    """The launch table's note on a quantized launch ("" for others)."""
    got = launch_reads(plan, launch)
    if got is None:
        return ""
    _, codes, comps = got
    return f"  [quant {QuantScheme.from_attrs(launch['attrs']['quant'])}: reads {codes} B codes + {comps} B scales]"


def weights_section(plan: dict, phases=None) -> list[str]:
    """The model's weight bytes, and per phase (all, or `phases`) the quantized launches' reads
    per step."""
    total, by = weight_bytes(plan)
    out = [f"== weights: {_mib(total)} in all (" + ", ".join(f"{d} {_mib(n)}" for d, n in sorted(by.items())) + ")"]
    for phase in phases or list(plan["programs"]):
        program = plan["programs"][phase]
        rows, codes_all, comps_all, plain = Counter(), 0, 0, 0
        for launch, mult in launches(program):
            got = launch_reads(plan, launch)
            if got is None:
                plain += mult * sum(nbytes(plan["weights"][i]["dtype"], plan["weights"][i]["shape"])
                                    for i in launch["inputs"] if i in plan["weights"])
                continue
            w, codes, comps = got
            rows[(launch["op"], w, str(QuantScheme.from_attrs(launch["attrs"]["quant"])), codes, comps)] += mult
            codes_all, comps_all = codes_all + codes * mult, comps_all + comps * mult
        if rows:
            out.append(f"  {phase}: quantized launches read {_mib(codes_all)} codes + {_mib(comps_all)} scales "
                       f"a step (the other launches' weights: {_mib(plain)})")
            for (op, w, scheme, codes, comps), n in rows.items():
                out.append(f"    {op:<14} {w:<16} {scheme:<40} {codes:>10} B codes {comps:>8} B scales  x{n}")
    return out
