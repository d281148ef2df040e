# moe_route: router logits [T, 64] (bf16) -> weights f32 [T, 8], ids i32 [T, 8]:
#   p = softmax(logits[t])                       (fp32)
#   ids[t] = the 8 experts of largest p, in descending p; ties: lower expert id first
#   w[t] = p[ids[t]]
#   and, as moe_align: counts[e] = tokens that chose e, rows[e, 0 .. counts[e]-1] = those tokens
#   (rows i32 [64, T], counts i32 [64]; arrival order).
# One program per token: the row of E = 64 experts sits in registers; top-k is K rounds of
# (max, lowest index holding it, knock it out).
# Then the token joins each chosen expert's list at the place an atomic cursor gives it; the last
# program to finish copies the cursors out as the counts and leaves its scratch zero.
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _align_add(ids, new, t, rows_ptr, cur_ptr, T):
    """Append token t to the list of each expert in ids where `new` (a slot that does not repeat an
    earlier slot's expert): its place is the expert's cursor, taken atomically (arrival order)."""
    r = tl.atomic_add(cur_ptr + ids, 1, mask=new, sem="relaxed")
    tl.store(rows_ptr + ids.to(tl.int64) * T + r, t, mask=new)


@triton.jit
def _align_close(cur_ptr, counts_ptr, E: tl.constexpr, BLOCK_E: tl.constexpr):
    """The last program to finish copies the E cursors (the counts) out and zeroes them and the
    arrival counter (cur_ptr[BLOCK_E]) for the next launch."""
    tl.debug_barrier()   # every thread's cursor adds are issued before the release below
    arrived = tl.atomic_add(cur_ptr + BLOCK_E, 1, sem="acq_rel")
    if arrived == tl.num_programs(0) - 1:
        tl.debug_barrier()
        ex = tl.arange(0, BLOCK_E)
        c = tl.atomic_xchg(cur_ptr + ex, 0, mask=ex < E, sem="relaxed")
        tl.store(counts_ptr + ex, c, mask=ex < E)
        tl.store(cur_ptr + BLOCK_E, 0)


@triton.jit
def moe_route(logits_ptr, w_ptr, ids_ptr, rows_ptr, counts_ptr, T, cur_ptr, E: tl.constexpr,
              K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, NORMALIZE: tl.constexpr,
              EX: tl.constexpr, BLOCK_EX: tl.constexpr, PDL: tl.constexpr):
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
    _align_add(ids, kk < K, t.to(tl.int32), rows_ptr, cur_ptr, T)   # a token's top-k ids are distinct
    _align_close(cur_ptr, counts_ptr, EX, BLOCK_EX)


META = {
    "entry": "moe_route",
    "params": [["logits_ptr", "*bf16", "in:0"], ["w_ptr", "*fp32", "out:0"],
               ["ids_ptr", "*i32", "out:1"],
               ["rows_ptr", "*i32", "out:2"], ["counts_ptr", "*i32", "out:3"], ["T", "i32", "dim:T"],
               ["cur_ptr", "*i32", "scratch:counters"]],
    "constexprs": {"E": 64, "K": 8, "BLOCK_E": 64, "BLOCK_K": 8, "NORMALIZE": False,
                   "EX": 64, "BLOCK_EX": 64, "PDL": True},
    "pdl": True,
    "grid": ["T", 1, 1],
    "scratch": {"counters": "260"},
    "num_warps": 4,
    "num_stages": 1,
}
