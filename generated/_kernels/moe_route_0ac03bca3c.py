# moe_route: router logits [T, 32] (bf16) -> weights f32 [T, 8], ids i32 [T, 8]:
#   p = softmax(logits[t])                       (fp32)
#   ids[t] = the 8 experts of largest p, in descending p; ties: lower expert id first
#   w[t] = p[ids[t]] / sum(p[ids[t]])   (normalize)
# One program per token: the row of E = 32 experts sits in registers; top-k is K rounds of
# (max, lowest index holding it, knock it out).
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def moe_route(logits_ptr, w_ptr, ids_ptr, E: tl.constexpr,
              K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, NORMALIZE: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
    if PDL:
        gdc_wait()   # earlier kernels' writes are visible from here on
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    l = tl.load(logits_ptr + t * E + e, mask=e < E, other=float("-inf")).to(tl.float32)
    ex = tl.exp(l - tl.max(l, axis=0))
    p = ex / tl.sum(ex, axis=0)
    cand = tl.where(e < E, p, -1.0)          # probabilities are >= 0: -1 marks "not available"
    kk = tl.arange(0, BLOCK_K)
    w = tl.zeros([BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(K):
        best = tl.max(cand, axis=0)
        idx = tl.min(tl.where(cand == best, e, BLOCK_E), axis=0)
        w = tl.where(kk == j, best, w)
        ids = tl.where(kk == j, idx, ids)
        cand = tl.where(e == idx, -1.0, cand)
    if NORMALIZE:
        w = w / tl.sum(w, axis=0)
    tl.store(w_ptr + t * K + kk, w, mask=kk < K)
    tl.store(ids_ptr + t * K + kk, ids, mask=kk < K)


META = {
    "entry": "moe_route",
    "params": [["logits_ptr", "*bf16", "in:0"], ["w_ptr", "*fp32", "out:0"],
               ["ids_ptr", "*i32", "out:1"]],
    "constexprs": {"E": 32, "K": 8, "BLOCK_E": 32, "BLOCK_K": 8, "NORMALIZE": True, "PDL": True},
    "pdl": True,
    "grid": ["T", 1, 1],
    "num_warps": 4,
    "num_stages": 1,
}
