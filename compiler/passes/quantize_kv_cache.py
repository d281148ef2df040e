"""--kv-cache-dtype fp8 (vLLM's flag): the paged K and V caches hold e4m3 codes, one per-tensor
scale per layer (the checkpoint's k_scale / v_scale, else 1.0: compiler/kv_scales.py).

    plan caches k, v: dtype bf16  ->  dtype f8e4m3, scales [one per layer]

Every kernel that touches them reads the cache's dtype from the plan (codegen_templates/triton/
_kv_fp8.j2): a write stores e4m3(x / scale), saturated at +-448; a read dequantizes, code * scale.
The numpy reference does the same (compiler/ops/attention.py write_kv / read_kv), so it stays
the oracle. The graph is unchanged: only the caches' declarations are, in emit_plan
(compiler/plan.py) from state.kv_cache. Per-sequence state caches (a hybrid model's conv and
recurrent slots) keep their dtype, as vLLM keeps its mamba state apart from --kv-cache-dtype; other
paged caches (latent attention's) have no FP8 form yet: the build fails naming the op.
"""
from ..contract.caches import FP8
from ..kv_scales import DEFAULT_SCALE
from ..ops import REGISTRY

KV = ("k", "v")


def quantize_kv_cache(state):
    kv = state.kv_cache
    if kv is None:
        return
    for g in state.graph.walk():
        for n in g.ordered():
            op = REGISTRY.get(n.op)
            if op is None or op.caches is None:             # "layers": its bodies are walked too
                continue
            decl = op.caches([g.values[i].type for i in n.inputs], n.attrs)
            other = sorted(c for c, d in decl.items() if d["kind"] == "paged" and c not in KV)
            if other:
                raise state.error(f"--kv-cache-dtype {kv['flag']}: op '{n.op}' keeps the paged cache(s) "
                                  f"{other}, which have no FP8 form (only the K/V caches of standard "
                                  f"attention do); build with --kv-cache-dtype auto", n.line)
    state.note("quantize_kv_cache", f"caches k, v as {FP8} (per-tensor scales per layer)")


def declare(state, caches: dict) -> dict:
    """The plan's caches with K and V as FP8 codes and their layers' scales (emit_plan)."""
    kv = state.kv_cache
    if kv is None:
        return caches
    out = dict(caches)
    for name in KV:
        if name in out:
            layers = out[name]["layers"]
            scales = kv["scales"].get(name, {})
            out[name] = {**out[name], "dtype": FP8,
                         "scales": [float(scales.get(i, DEFAULT_SCALE)) for i in layers]}
    return out
