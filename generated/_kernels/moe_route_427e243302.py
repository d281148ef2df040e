# moe_route: router logits [T, 64] (bf16) -> weights f32 [T, 5], ids i32 [T, 5]:
#   p = sigmoid(logits[t])                       (fp32)
#   c = p + bias   (bias f32 [64]: it chooses, it does not weigh)
#   ids[t] = the 4 experts of largest c, in descending c; ties: lower expert id first
#   w[t] = p[ids[t]] / sum(p[ids[t]])   (normalize) * 1.8   (scale)
#   then the 1 shared experts, always on: ids[t, 4 + s] = 64 + s, w[t, 4 + s] = 1
# One program per token: the row of E = 64 experts sits in registers; top-k is K rounds of
# (max, lowest index holding it, knock it out).
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def moe_route(logits_ptr, bias_ptr, w_ptr, ids_ptr, E: tl.constexpr,
              K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, NORMALIZE: tl.constexpr,
              SCALE: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
    if PDL:
        gdc_wait()   # earlier kernels' writes are visible from here on
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    l = tl.load(logits_ptr + t * E + e, mask=e < E, other=float("-inf")).to(tl.float32)
    p = 1.0 / (1.0 + tl.exp(-l))
    # the choice scores; padding lanes -inf. A dropped group's experts get -3e38: after every
    # kept expert but before the ones already taken (-inf), lowest id first, as the reference's
    # stable sort of -inf puts them
    c = tl.where(e < E, p + tl.load(bias_ptr + e, mask=e < E, other=0.0).to(tl.float32), float("-inf"))
    cand = c
    kk = tl.arange(0, BLOCK_K)
    w = tl.zeros([BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(K):
        best = tl.max(cand, axis=0)
        idx = tl.min(tl.where(cand == best, e, BLOCK_E), axis=0)
        w = tl.where(kk == j, tl.sum(tl.where(e == idx, p, 0.0), axis=0), w)   # its p, not its c
        ids = tl.where(kk == j, idx, ids)
        cand = tl.where(e == idx, float("-inf"), cand)
    if NORMALIZE:
        w = w / tl.sum(w, axis=0)
    w = w * SCALE
    shared = (kk >= K) & (kk < K + 1)
    w = tl.where(shared, 1.0, w)
    ids = tl.where(shared, E + kk - K, ids)
    tl.store(w_ptr + t * 5 + kk, w, mask=kk < 5)
    tl.store(ids_ptr + t * 5 + kk, ids, mask=kk < 5)


META = {
    "entry": "moe_route",
    "params": [["logits_ptr", "*bf16", "in:0"], ["bias_ptr", "*fp32", "in:1"], ["w_ptr", "*fp32", "out:0"],
               ["ids_ptr", "*i32", "out:1"]],
    "constexprs": {"E": 64, "K": 4, "BLOCK_E": 64, "BLOCK_K": 8, "NORMALIZE": True,
                   "SCALE": 1.8, "PDL": True},
    "pdl": True,
    "grid": ["T", 1, 1],
    "num_warps": 4,
    "num_stages": 1,
}
