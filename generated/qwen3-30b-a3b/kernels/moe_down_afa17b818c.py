# moe_down: y[t, h] = bf16(sum_j r[t, j] * sum_f act[t, j, f] * w[e, h, f]),  e = ids[t, j]
#   act [T, 8, 768] bf16, r f32 [T, 8], ids i32 [T, 8], w [128, 2048, 768] bf16,
#   y [T, 2048] bf16; the whole sum in fp32, one program owns each output element (no atomics).
#
# One program per (token t, BLOCK_H output rows): a GEMV over the flattened reduction axis
# (slot j, f), 8 x 768 long. Each step loads a [BLOCK_H, KP * BLOCK_F] tile whose column
# c = j * BLOCK_F + i is w[ids[t, j], h, f0 + i] (all KP = 8 slots at once, so a program keeps
# KP x more bytes in flight than one expert at a time), in 16-byte runs, against the matching
# activations scaled by r[t, j]; fp32 partial products are reduced once at the end. Decode reads
# each chosen expert's rows once per token that chose it.
# Prefill would instead gather the pairs sorted by expert (the same routing permutation as
# moe_gate_up) and run a grouped tensor-core GEMM per (expert row block, H block), adding each
# pair's weighted output into y with a second, per-token reduction pass (or atomics) since a
# token's experts then live in different programs.
import triton
import triton.language as tl


@triton.jit
def moe_down(act_ptr, rw_ptr, ids_ptr, w_ptr, y_ptr,
             H: tl.constexpr, F: tl.constexpr, KT: tl.constexpr, KP: tl.constexpr,
             BLOCK_H: tl.constexpr, BLOCK_F: tl.constexpr):
    t = tl.program_id(0)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < H
    # column c of a step: slot j = c // BLOCK_F, feature f0 + c % BLOCK_F
    c = tl.arange(0, KP * BLOCK_F)
    j = c // BLOCK_F
    i = c % BLOCK_F
    j_mask = j < KT
    pair = t * KT + j
    e = tl.load(ids_ptr + pair, mask=j_mask, other=0).to(tl.int64)
    r = tl.load(rw_ptr + pair, mask=j_mask, other=0.0)
    a_cols = act_ptr + pair.to(tl.int64) * F + i
    w_cols = e * (H * F) + i
    # rows past H are clamped for loading; their sums are dropped at the store
    w_rows = w_ptr + tl.minimum(offs_h, H - 1).to(tl.int64)[:, None] * F
    acc = tl.zeros([BLOCK_H, KP * BLOCK_F], tl.float32)
    for f0 in range(0, F, BLOCK_F):
        m = j_mask & (f0 + i < F)
        a = tl.load(a_cols + f0, mask=m, other=0.0).to(tl.float32) * r
        p = w_rows + (w_cols + f0)[None, :]
        # each slot's BLOCK_F columns are one contiguous, 16-byte aligned run of an expert's row
        p = tl.max_contiguous(tl.multiple_of(p, [1, 16]), [1, BLOCK_F])
        w = tl.load(p, mask=m[None, :], other=0.0, eviction_policy="evict_first")
        acc += w.to(tl.float32) * a[None, :]
    y = tl.sum(acc, axis=1)
    tl.store(y_ptr + t.to(tl.int64) * H + offs_h, y.to(y_ptr.dtype.element_ty), mask=h_mask)


META = {
    "entry": "moe_down",
    "params": [["act_ptr", "*bf16", "in:0"], ["rw_ptr", "*fp32", "in:1"],
               ["ids_ptr", "*i32", "in:2"], ["w_ptr", "*bf16", "in:3"],
               ["y_ptr", "*bf16", "out:0"]],
    "constexprs": {"H": 2048, "F": 768, "KT": 8, "KP": 8,
                   "BLOCK_H": 8, "BLOCK_F": 64},
    "grid": ["T", 256, 1],
    "num_warps": 4,
    "num_stages": 1,
}
