# moe_align: ids i32 [T, 6] -> rows i32 [256, T], counts i32 [256]:
#   counts[e] = number of tokens t with e in ids[t] (a token naming e in several slots counts once;
#   id -1, expert parallelism's "another rank's expert", counts nowhere),
#   rows[e, 0 .. counts[e]-1] = those tokens, in arrival order (the reference: token order; no
#   consumer's result depends on a token's place in its expert's list).
#
# One program per TB = 64 tokens: each new (token, expert) pair takes the next place of its
# expert's list from a cursor (an atomic add; cursors and an arrival counter live in scratch);
# the last program to finish copies the cursors out as the counts and leaves the scratch zero.
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
def moe_align(ids_ptr, rows_ptr, counts_ptr, T, cur_ptr,
              E: tl.constexpr, KT: tl.constexpr, KTP: tl.constexpr, BLOCK_E: tl.constexpr,
              TB: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
    if PDL:
        gdc_wait()   # earlier kernels' writes are visible from here on
    t = tl.program_id(0) * TB + tl.arange(0, TB)
    j = tl.arange(0, KTP)
    valid = (t[:, None] < T) & (j[None, :] < KT)
    ids = tl.load(ids_ptr + t[:, None] * KT + j[None, :], mask=valid, other=-1)
    # a slot is a new pair unless an earlier slot of its token named the same expert
    new = valid & (ids >= 0)
    for jj in tl.static_range(KT):
        prev = tl.sum(tl.where(j[None, :] == jj, ids, 0), 1)
        new = new & ~((j[None, :] > jj) & (ids == prev[:, None]))
    _align_add(ids, new, t[:, None] + 0 * j[None, :], rows_ptr, cur_ptr, T)
    _align_close(cur_ptr, counts_ptr, E, BLOCK_E)


META = {
    "entry": "moe_align",
    "params": [["ids_ptr", "*i32", "in:0"], ["rows_ptr", "*i32", "out:0"], ["counts_ptr", "*i32", "out:1"],
               ["T", "i32", "dim:T"], ["cur_ptr", "*i32", "scratch:counters"]],
    "constexprs": {"E": 256, "KT": 6, "KTP": 8, "BLOCK_E": 256, "TB": 64, "PDL": True},
    "pdl": True,
    "grid": ["cdiv(T, 64)", 1, 1],
    "scratch": {"counters": "1028"},
    "num_warps": 4,
    "num_stages": 1,
}
