# moe_gate_up: act[t, j, f] = bf16(silu(g) * u),  e = ids[t, j],
#   g = bf16(sum_k x[t, k] * w[e, f, k]),  u = bf16(sum_k x[t, k] * w[e, 768 + f, k]),
#   silu(g) = g / (1 + exp(-g)) in fp32 (g and u rounded to bf16 as the unfused model stores them).
#   x [T, 2048] bf16, ids i32 [T, 8], w [128, 1536, 2048] bf16 (rows 0..767 gate,
#   768..1535 up), act [T, 8, 768] bf16; fp32 accumulate.
#
# One program per (token-expert pair p = t * 8 + j, BLOCK_F rows of gate and of up): a GEMV that
# streams the expert's gate and up row tiles [BLOCK_F, BLOCK_K] with 16-byte loads, keeps fp32
# [BLOCK_F, BLOCK_K] partial products and reduces them once at the end. Pairs are the grid's first
# axis (T * 8 can pass 65535). Decode reads each chosen expert's gate_up once per pair that
# chose it; experts shared by several tokens in a batch are re-read, mostly from L2.
# Prefill would instead sort the pairs by expert (counts, prefix sum, a permutation padded to
# BLOCK_M per expert: one small routing kernel) and run a grouped tensor-core GEMM: one program
# per (expert row block of gathered tokens, F block), so each expert's weights stream once per
# BLOCK_M tokens instead of once per pair.
import triton
import triton.language as tl


@triton.jit
def _ptr(base, offs):
    """base + offs, with the 16-byte alignment of each contiguous run of 8 bf16 made known to the
    compiler (rows are multiples of 8 elements and buffers 16-byte aligned), for vector loads."""
    p = base + offs
    if len(p.shape) == 1:
        p = tl.multiple_of(p, [16])
    else:
        p = tl.multiple_of(p, [1, 16])
    return p


@triton.jit
def moe_gate_up(x_ptr, ids_ptr, w_ptr, act_ptr,
                H: tl.constexpr, F: tl.constexpr, KT: tl.constexpr,
                BLOCK_F: tl.constexpr, BLOCK_K: tl.constexpr):
    p = tl.program_id(0)
    offs_f = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    f_mask = offs_f < F
    t = p // KT
    e = tl.load(ids_ptr + p).to(tl.int64)
    # gate row f and up row F + f of expert e; rows past F are clamped for loading
    f_rows = tl.minimum(offs_f, F - 1).to(tl.int64)[:, None]
    g_rows = w_ptr + e * (2 * F * H) + f_rows * H
    u_rows = g_rows + F * H
    x_row = x_ptr + t.to(tl.int64) * H
    acc_g = tl.zeros([BLOCK_F, BLOCK_K], tl.float32)
    acc_u = tl.zeros([BLOCK_F, BLOCK_K], tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(_ptr(x_row, k), mask=k < H, other=0.0).to(tl.float32)[None, :]
        wg = tl.load(_ptr(g_rows, k[None, :]), mask=k[None, :] < H, other=0.0, eviction_policy="evict_first")
        wu = tl.load(_ptr(u_rows, k[None, :]), mask=k[None, :] < H, other=0.0, eviction_policy="evict_first")
        acc_g += wg.to(tl.float32) * x
        acc_u += wu.to(tl.float32) * x
    g = tl.sum(acc_g, axis=1).to(tl.bfloat16).to(tl.float32)
    u = tl.sum(acc_u, axis=1).to(tl.bfloat16).to(tl.float32)
    act = g / (1.0 + tl.exp(-g)) * u
    tl.store(act_ptr + p.to(tl.int64) * F + offs_f, act.to(act_ptr.dtype.element_ty), mask=f_mask)


META = {
    "entry": "moe_gate_up",
    "params": [["x_ptr", "*bf16", "in:0"], ["ids_ptr", "*i32", "in:1"],
               ["w_ptr", "*bf16", "in:2"], ["act_ptr", "*bf16", "out:0"]],
    "constexprs": {"H": 2048, "F": 768, "KT": 8, "BLOCK_F": 16, "BLOCK_K": 256},
    "grid": ["T * 8", 48, 1],
    "num_warps": 4,
    "num_stages": 1,
}
