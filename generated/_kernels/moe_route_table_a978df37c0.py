# moe_route_table (ops/moe_table.py): experts[t, :] = table[ids[t], :] (K = 6), weights[t, j] = the
# sqrtsoftplus score of logits[t] (E = 256) at experts[t, j], renormalized, times 1.5.
# ROWS = 64 tokens per program.
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def moe_route_table(ids_ptr, table_ptr, logits_ptr, w_ptr, e_ptr, T, K: tl.constexpr, KP: tl.constexpr,
                    ROWS: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
    if PDL:
        gdc_wait()   # earlier kernels' writes are visible from here on
    t = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    j = tl.arange(0, KP)
    ok = t < T
    m = ok[:, None] & (j < K)[None, :]
    tok = tl.load(ids_ptr + t, mask=ok, other=0).to(tl.int64)
    e = tl.load(table_ptr + tok[:, None] * K + j[None, :], mask=m, other=0)
    tl.store(e_ptr + t[:, None] * K + j[None, :], e, mask=m)
    l = tl.load(logits_ptr + t[:, None] * 256 + e, mask=m, other=0.0).to(tl.float32)
    # log1p(u) for u = e^-|x| <= 1: its series below 1e-3 (log(1 + u) would lose u's digits), as moe_route's
    u = tl.exp(-tl.abs(l))
    lp = tl.where(u < 1e-3, u * (1.0 - u * (0.5 - u / 3.0)), tl.log(1.0 + u))
    w = tl.sqrt(tl.where(l > 20.0, l, tl.maximum(l, 0.0) + lp))
    w = tl.where(m, w, 0.0)
    w = w / tl.where(ok, tl.sum(w, axis=1), 1.0)[:, None]
    tl.store(w_ptr + t[:, None] * K + j[None, :], w * 1.5, mask=m)


META = {
    "entry": "moe_route_table",
    "params": [["ids_ptr", "*i32", "in:0"], ["table_ptr", "*i32", "in:1"], ["logits_ptr", "*bf16", "in:2"], ["w_ptr", "*fp32", "out:0"],
               ["e_ptr", "*i32", "out:1"], ["T", "i32", "dim:T"]],
    "constexprs": {"K": 6, "KP": 8, "ROWS": 64, "PDL": True},
    "pdl": True,
    "grid": ["cdiv(T, 64)", 1, 1],
    "num_warps": 4,
    "num_stages": 1,
}
