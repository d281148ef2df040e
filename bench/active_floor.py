"""The batch-1 decode floor of an MoE plan from the bytes a step actually reads, applied to a
`bench latency` result of the same plan and run:

    python3 -m infc.bench.active_floor --artifact ART --latency OUT/latency-<model>-<gpu>.json --out OUT

`bench latency` divides every weight byte by the copy bandwidth: right for a dense model, far too
high for a sparse one (DeepSeek-V2-Lite stores 15.7 B parameters and reads about 2.5 B of them per
token at batch 1). The active bytes of one batch-1 decode step, read off the plan's decode program
(each launch of each layer, layer kind by layer kind, program.unrolled):
  - the embedding table: one row (one token's), not the table; likewise a hash-routed layer's
    token-id-to-experts table (DeepSeek-V4's tid2eid);
  - an experts weight (stacked [E, ...] from E experts' tensors, or stored stacked as GPT-OSS's
    MXFP4 blocks are, an input of the moe_* launches):
    k of its E experts' slices, k and E from that layer's routing launch (attrs k, experts; a
    hash-routed layer's moe_route_table: k the token-id table's width, E its moe_align's); a
    stack with the shared experts folded in (compiler/passes/fold_shared_experts.py: attr shared
    = n, the stack's last n entries, every token's) reads k + n of its E;
  - every other weight a launch reads (attention, the dense layers' MLP, the router, the shared
    experts, the norms, lm_head): all of it, once per layer that reads it (a tied lm_head reads
    the whole embedding table, so the table then counts in full);
  - the paged caches of the context at the mean context of the timed decode, prompt +
    output_len / 2: the rows a step reads (bench/cache_bytes.py read_bytes: every row of a
    cache, for MLA the latent rows, one per m tokens of a compressed cache, but only the last W
    of a cache read through a window and the top-k of an indexed one, DeepSeek-V4's sliding
    branch and compressed sparse entries), and the slot caches read and written
    (2 x caches.slot_bytes). bench/latency.py's stored-bytes floor counts every cached row.
floor_ms = active bytes / the copy bandwidth `bench latency` measured in the same run (its
copy_GBps). The result (latency-active-<model>-<gpu>.json) is the latency result plus the active
floor per prompt, its ratio to the TPOT (target >= 0.5, issue 13), the active bytes per weight,
and the cache bytes per token beside those of a non-latent layout (mla_kv_comparison).
"""
import argparse
import json
from pathlib import Path

from infc.compiler.contract import caches
from infc.compiler.contract.program import unrolled
from infc.compiler.contract.schema import nbytes
from infc.compiler.contract.weight_roles import is_derived
from infc.compiler.quant.report import routed_k, weight_bytes as _weight_bytes

from .cache_bytes import read_bytes


def _stacked(src) -> int | None:
    """The expert count of a weight built by stacking per-expert tensors (its recipe's `stack`
    count), else None."""
    if isinstance(src, dict):
        if "stack" in src:
            return int(src["count"])
        for v in src.values():
            n = _stacked(v)
            if n:
                return n
    elif isinstance(src, list):
        for v in src:
            n = _stacked(v)
            if n:
                return n
    return None


def weight_bytes(plan: dict) -> int:
    """Every stored weight byte (tied weights once; quantized codes packed as stored), as the
    runtime's Weights.bytes counts them."""
    return _weight_bytes(plan)[0]


def active_bytes(plan: dict) -> dict:
    """{weight name: bytes a batch-1 decode step reads from it, over all layers}."""
    weights = plan["weights"]

    def stored(name):                       # a tied weight reads its target's storage
        src = weights[name]["source"]
        return src["tied"] if "tied" in src else name

    route = {}                              # layer -> (k, experts, shared) of its routing launch
    aligned = {}                            # layer -> the experts its moe_align launch sorts rows to
    for launch, layer in unrolled(plan["programs"]["decode"]):
        a = launch.get("attrs", {})
        if launch["op"] == "moe_align":
            aligned[layer] = int(a["experts"])
        elif launch["op"].startswith("moe_route"):
            # hash routing (DeepSeek-V4's moe_route_table): k the token-id table's width, E the align's
            e = None if launch["op"] == "moe_route_table" else int(a["experts"])
            route[layer] = (routed_k(plan, launch), e, int(a.get("shared", 0)))
    for layer, (k, e, n) in list(route.items()):
        if e is None:
            if layer not in aligned:
                raise ValueError(f"layer {layer}: a moe_route_table launch but no moe_align to say "
                                 f"over how many experts it routes")
            route[layer] = (k, aligned[layer], n)
    share = {}                              # (weight, layer) -> the fraction of it read
    for launch, layer in unrolled(plan["programs"]["decode"]):
        for name in launch.get("inputs", []):
            if name not in weights:
                continue
            name = stored(name)
            w = weights[name]
            if is_derived(w["source"]):
                # a copy the load program makes (upcast_experts' resident bf16 stacks): the grouped
                # kernels read it at many tokens an expert only, a batch-1 step the codes beside it
                continue
            experts = _stacked(w["source"])
            if launch["op"] == "embedding" or (launch["op"] == "moe_route_table" and name == launch["inputs"][1]):
                frac = 1 / w["shape"][0]        # one token's row (of the ids' table, or of the hash table)
            elif launch["op"].startswith("moe_") and not launch["op"].startswith("moe_route") and (
                    experts or (layer in route and w["shape"][0] == route[layer][1])):
                # stacked from E tensors (its recipe), or stored stacked [E, ...] (GPT-OSS's MXFP4
                # blocks, scales and biases): a token reads k of its E slices
                if layer not in route:
                    raise ValueError(f"layer {layer}: '{name}' is an experts weight but the layer has "
                                     f"no moe_route launch to say how many experts a token reads")
                k, e, n = route[layer]
                if experts and (e != experts + n or w["shape"][0] != e):
                    raise ValueError(f"'{name}': {w['shape'][0]} stacked experts ({experts} from the "
                                     f"checkpoint), routing over {e} ({n} shared)")
                frac = (k + n) / e
            else:
                frac = 1.0
            key = (name, layer)
            share[key] = max(share.get(key, 0.0), frac)
    out = {}
    for (name, layer), frac in share.items():
        w = weights[name]
        out[name] = out.get(name, 0) + frac * nbytes(w["dtype"], w["shape"])
    return {k: int(round(v)) for k, v in out.items()}


def mla_kv_comparison(plan: dict) -> dict | None:
    """Cache bytes per token of context (all layers) of the plan's latent layout, beside what a
    non-latent layout of the same attention would hold: per head a key of Dn + Dr and a value of
    Dv (DeepSeek-V2's expanded K / V, as HF's cache keeps them), same dtype, same layers. None for a
    plan without the latent cache or the MLA symbols."""
    decl = caches.of_plan(plan)
    c = plan["config"]
    if "latent" not in decl or not all(s in c for s in ("Hq", "Dn", "Dr", "Dv")):
        return None
    lat = decl["latent"]
    expanded = {"k": dict(lat, shape=[c["Hq"], c["Dn"] + c["Dr"]]),
                "v": dict(lat, shape=[c["Hq"], c["Dv"]])}
    ours, theirs = caches.token_bytes(decl), caches.token_bytes(caches.check(expanded))
    return {"latent_bytes_per_token": ours, "non_latent_bytes_per_token": theirs,
            "latent_values_per_token_layer": caches.unit_elems(lat),
            "non_latent_values_per_token_layer": caches.unit_elems(expanded["k"]) + caches.unit_elems(expanded["v"]),
            "non_latent_over_latent": theirs / ours}


def floor(plan: dict, res: dict, output_len: int) -> dict:
    """The latency result `res` (bench latency's JSON, same plan) plus the active-bytes floor."""
    bw = res["copy_GBps"] * 1e9
    decl = caches.of_plan(plan)
    per_token, per_seq = caches.token_bytes(decl), caches.slot_bytes(decl)
    total = weight_bytes(plan)
    if total != res["weight_bytes"]:
        raise ValueError(f"the run loaded {res['weight_bytes']} weight bytes, this plan has {total}: "
                         f"not the artifact that was timed")
    by_weight = active_bytes(plan)
    act = sum(by_weight.values())
    out = dict(res)
    out.update({"active_weight_bytes": act, "active_bytes_by_weight": by_weight,
                "active_share_of_weights": act / total, "output_len": output_len,
                "active_floor_ms_by_prompt": {}, "active_floor_ratio_by_prompt": {}})
    for n, tpot in res["tpot_ms_by_prompt"].items():
        ctx = int(n) + output_len / 2
        cache = per_token * ctx + 2 * per_seq
        full = (total + cache) / bw * 1e3
        if abs(full - res["floor_ms_by_prompt"][n]) > 1e-6 * full:     # same terms as bench latency
            raise ValueError(f"prompt {n}: bench latency's floor {res['floor_ms_by_prompt'][n]:.4f} ms is "
                             f"not {full:.4f} ms: was it run with --output-len {output_len}?")
        f = (act + read_bytes(plan, ctx) + 2 * per_seq) / bw * 1e3
        out["active_floor_ms_by_prompt"][n] = f
        out["active_floor_ratio_by_prompt"][n] = f / tpot
    first = next(iter(res["tpot_ms_by_prompt"]))
    out["active_floor_ms"] = out["active_floor_ms_by_prompt"][first]
    out["active_floor_ratio"] = out["active_floor_ratio_by_prompt"][first]
    kv = mla_kv_comparison(plan)
    if kv is not None:
        out["mla_kv_comparison"] = kv
    return out


def report(out: dict) -> str:
    lines = [f"{out['model']} on {out['gpu']}: copy {out['copy_GBps']:.0f} GB/s, weights "
             f"{out['weight_bytes'] / 1e9:.2f} GB stored, {out['active_weight_bytes'] / 1e9:.3f} GB read "
             f"per batch-1 decode step ({100 * out['active_share_of_weights']:.1f} %)"]
    for n, tpot in out["tpot_ms_by_prompt"].items():
        lines.append(f"prompt {n}: TTFT {out['ttft_ms'][n]:.2f} ms, TPOT {tpot:.3f} ms, active floor "
                     f"{out['active_floor_ms_by_prompt'][n]:.3f} ms ({100 * out['active_floor_ratio_by_prompt'][n]:.0f} % "
                     f"of it), all-weights floor {out['floor_ms_by_prompt'][n]:.3f} ms")
    kv = out.get("mla_kv_comparison")
    if kv:
        lines.append(f"cache per token of context: {kv['latent_bytes_per_token']} B latent "
                     f"({kv['latent_values_per_token_layer']} values a layer) vs {kv['non_latent_bytes_per_token']} B "
                     f"non-latent ({kv['non_latent_values_per_token_layer']} a layer): {kv['non_latent_over_latent']:.2f}x less")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python3 -m infc.bench.active_floor")
    ap.add_argument("--artifact", required=True, help="the artifact bench latency timed (its plan.json)")
    ap.add_argument("--latency", required=True, help="bench latency's JSON result of that run")
    ap.add_argument("--output-len", type=int, default=128, help="bench latency's --output-len")
    ap.add_argument("--out", help="where latency-active-<model>-<gpu>.json goes (default: beside --latency)")
    a = ap.parse_args(argv)
    from .common import save
    plan = json.loads((Path(a.artifact) / "plan.json").read_text())
    res = json.loads(Path(a.latency).read_text())
    out = floor(plan, res, a.output_len)
    path = save("latency-active", out, a.out or Path(a.latency).parent)
    print(report(out))
    print(f"wrote {path}")
    return out


if __name__ == "__main__":
    main()
