"""A plan's caches in bytes per token of context, from its cache declarations (plan["caches"]) and
the decode launches that read them; CPU only, no GPU:

    python3 -m infc.bench.cache_bytes --artifact ART         # a built artifact's plan.json
    python3 -m infc.bench.cache_bytes --model deepseek-v4-flash   # a variant, compiled here
    python3 -m infc.bench.cache_bytes --model-path DIR        # a config.json, compiled here

Three figures a token of context, every layer:
  - stored: what the paged caches hold (caches.token_bytes: a compressed cache, "every": m, one
    row per m tokens), by cache;
  - uncompressed: one KV row of every layer for every token, the row being the layer's widest
    paged row (DeepSeek-V4's shared K = V row of D values; the compressed entries are rows of the
    same width), i.e. the layout of full attention over every token with no compression;
  - read by a batch-1 decode step at a context of n tokens (read_bytes): a cache read by a
    launch with a window W, min(n, W) rows; the compressed entries of an indexed attention
    (compressed_attention_cached with has_index), min(n / m, top-k) of them, k from the same
    layer's indexer_topk_cached; every other paged cache all its n / m rows. bench/active_floor.py takes its
    cache term from here.
The slot caches (a compressed cache's partial block, a recurrent state) are bytes a sequence,
reported apart (caches.slot_bytes).
"""
import argparse
import json
from pathlib import Path

from infc.compiler.contract import caches
from infc.compiler.contract.program import unrolled
from infc.compiler.contract.schema import DTYPE_BYTES


def _row_bytes(c: dict) -> int:
    """Bytes of one row of cache declaration `c` in one layer."""
    return caches.unit_elems(c) * DTYPE_BYTES[c["dtype"]]


# the launches' op names: split_compression's readers (a plan from before it, the spec ops)
INDEXERS = ("indexer_topk_cached", "indexer_topk")
INDEXED = ("compressed_attention_cached", "compressed_attention")


def read_bounds(plan: dict) -> dict:
    """{(cache, layer): the most rows a decode step reads of it} for the caches the decode
    program's launches bound: a window (attention_cached, compressed_attention's sliding branch)
    or an indexer's top-k (compressed_attention with has_index). A cache absent is read whole."""
    bound, topk = {}, {}
    launches = list(unrolled(plan["programs"]["decode"]))
    for launch, layer in launches:
        a = launch.get("attrs", {})
        if launch["op"] in INDEXERS:
            topk[layer] = int(a["topk"])
    for launch, layer in launches:
        a = launch.get("attrs", {})
        for name in launch.get("caches", []):
            c = plan["caches"].get(name)
            if c is None or c["kind"] != "paged":
                continue
            if c.get("every", 1) == 1 and a.get("window"):
                bound[(name, layer)] = int(a["window"])
            elif launch["op"] in INDEXED and a.get("has_index") and name == a.get("cache"):
                if layer not in topk:
                    raise ValueError(f"layer {layer}: an indexed compressed_attention but no indexer_topk "
                                     f"launch to say how many of '{name}' it reads")
                bound[(name, layer)] = topk[layer]
    return bound


def read_bytes(plan: dict, ctx: float) -> float:
    """Paged cache bytes a batch-1 decode step reads at a context of ctx tokens (see above)."""
    decl = caches.of_plan(plan)
    bound = read_bounds(plan)
    total = 0.0
    for name, c in decl.items():
        if c["kind"] != "paged":
            continue
        rows = ctx / c.get("every", 1)
        for layer in c["layers"]:
            b = bound.get((name, layer))
            total += (rows if b is None else min(rows, b)) * _row_bytes(c)
    return total


def summary(plan: dict, contexts=(1024, 32768, 131072)) -> dict:
    decl = caches.of_plan(plan)
    paged = {n: c for n, c in decl.items() if c["kind"] == "paged"}
    by_cache = {n: {"every": c.get("every", 1), "layers": len(c["layers"]), "row_bytes": _row_bytes(c),
                    "bytes_per_token": _row_bytes(c) * len(c["layers"]) / c.get("every", 1)}
                for n, c in paged.items()}
    widest = {}                          # layer -> its widest paged row
    for c in paged.values():
        for layer in c["layers"]:
            widest[layer] = max(widest.get(layer, 0), _row_bytes(c))
    stored = caches.token_bytes(decl)
    uncompressed = sum(widest.values())
    compressed = sum(v["bytes_per_token"] for v in by_cache.values() if v["every"] > 1)
    return {"model": plan.get("model"), "layers": len(widest), "stored_bytes_per_token": stored,
            "uncompressed_bytes_per_token": uncompressed,
            "compressed_entries_bytes_per_token": compressed,
            "stored_over_uncompressed": stored / uncompressed if uncompressed else None,
            "by_cache": by_cache, "slot_bytes_per_seq": caches.slot_bytes(decl),
            "read_bytes_by_context": {str(n): read_bytes(plan, n) for n in contexts},
            "uncompressed_read_bytes_by_context": {str(n): uncompressed * n for n in contexts}}


def report(s: dict) -> str:
    lines = [f"{s['model']}: caches per token of context over {s['layers']} layers: "
             f"{s['stored_bytes_per_token']:,} B stored against {s['uncompressed_bytes_per_token']:,} B "
             f"uncompressed (one KV row of every layer for every token): "
             f"{s['stored_over_uncompressed']:.3f}x; the compressed entries alone "
             f"{s['compressed_entries_bytes_per_token']:,.2f} B "
             f"({s['compressed_entries_bytes_per_token'] / s['uncompressed_bytes_per_token']:.4f}x)",
             "| cache | tokens a row | layers | row B | B / token |", "| --- | --- | --- | --- | --- |"]
    for n, v in s["by_cache"].items():
        lines.append(f"| {n} | {v['every']} | {v['layers']} | {v['row_bytes']} | {v['bytes_per_token']:,.2f} |")
    lines.append(f"slot caches (partial blocks, states): {s['slot_bytes_per_seq']:,} B a sequence")
    for n, b in s["read_bytes_by_context"].items():
        u = s["uncompressed_read_bytes_by_context"][n]
        lines.append(f"a batch-1 decode step at {n} tokens reads {b / 2**20:,.2f} MiB of cache "
                     f"(uncompressed: {u / 2**20:,.2f} MiB, {u / b:.1f}x)")
    return "\n".join(lines)


def _plan(a) -> dict:
    if a.artifact:
        return json.loads((Path(a.artifact) / "plan.json").read_text())
    from infc.compiler.build import compile_model
    return compile_model(model=a.model, model_dir=a.model_path, check_checkpoint=False)[1]


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python3 -m infc.bench.cache_bytes")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--artifact", help="a built artifact (its plan.json)")
    src.add_argument("--model", help="a variant name (compiled here, no checkpoint)")
    src.add_argument("--model-path", help="a directory with config.json (compiled here)")
    ap.add_argument("--json", help="also write the figures to this file")
    a = ap.parse_args(argv)
    s = summary(_plan(a))
    print(report(s))
    if a.json:
        Path(a.json).write_text(json.dumps(s, indent=1) + "\n")
    return s


if __name__ == "__main__":
    main()
