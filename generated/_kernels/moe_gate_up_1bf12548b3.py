# moe_gate_up: act[t, j, f] = bf16(silu(g) * u),  e = ids[t, j],
#   g = bf16(sum_k x[t, k] * w[e, f, k]),  u = bf16(sum_k x[t, k] * w[e, 2048 + f, k]),
#   silu(g) = g / (1 + exp(-g)) in fp32 (g and u rounded to bf16 as the unfused model stores them).
#   x [T, 6144] bf16, ids i32 [T, 9], w [129, 4096, 6144] bf16 (rows 0..2047 gate,
#   2048..4095 up), act [T, 9, 2048] bf16; fp32 accumulate.
#
# Decode: a few tokens, each naming 9 experts, so the step reads only the chosen experts'
# rows, and each of them once. Grid (min(129, T * 9) distinct-expert slots, 128 blocks of
# BLOCK_F = 16 gate rows and the matching up rows): program (u, b) takes the u-th smallest
# chosen expert e (a histogram of the step's ids; slots past the number of distinct experts exit),
# finds the tokens that chose e (in token order), and runs a GEMV over its row block for them,
# like gemv.py.j2:
#  * at most FMA_T = 1 tokens: CUDA cores; the block's gate and up rows stream in
#    [BLOCK_F, FMA_BLOCK_K] tiles of 16-byte loads (evict_first), one fp32 partial product per
#    row and token, reduced once at the end;
#  * more: tensor cores, swap-AB: acc[f, t] += W_tile[BLOCK_F, BLOCK_K] @ X^T over BLOCK_T
#    gathered token rows at a time (more than BLOCK_T tokens re-read the tile, from L2).
# A token that names e in two slots gets the same row in both; a slot of id -1 (another rank's
# expert, ep_dispatch) names none and its act row is left unwritten.
# The path depends only on how many tokens chose e, and each token's sums are its own: the
# same bits from run to run.
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


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
def _expert_of(ids_ptr, u, P, BLOCK_E: tl.constexpr, PC: tl.constexpr):
    """The u-th smallest expert id among the P = T * KT chosen slots, and how many slots chose it
    (0 when fewer than u + 1 distinct experts were chosen): a histogram of the ids (-1, no
    expert, left out), then a scan."""
    ex = tl.arange(0, BLOCK_E)
    hist = tl.zeros([BLOCK_E], tl.int32)
    for p0 in range(0, P, PC):
        p = p0 + tl.arange(0, PC)
        ids = tl.load(ids_ptr + p, mask=p < P, other=-1)
        hist += tl.histogram(ids, BLOCK_E, mask=(p < P) & (ids >= 0))
    present = (hist > 0).to(tl.int32)
    sel = (present > 0) & (tl.cumsum(present, 0) == u + 1)
    return tl.sum(tl.where(sel, ex, 0), 0), tl.sum(tl.where(sel, hist, 0), 0)


@triton.jit
def _tokens_of(ids_ptr, e, T, start, KT: tl.constexpr, KTP: tl.constexpr, TC: tl.constexpr,
               NT: tl.constexpr):
    """The tokens that chose expert e, in token order, ranks start .. start + NT - 1: token ids [NT]
    (0 where missing), which are present [NT], and how many tokens chose e in all. Scans the ids
    in chunks of TC tokens; a chunk's hits are ranked by a prefix sum."""
    i = tl.arange(0, NT)
    j = tl.arange(0, KTP)
    toks = tl.zeros([NT], tl.int32)
    found = tl.zeros([NT], tl.int32)
    seen = tl.sum(tl.zeros([TC], tl.int32), 0)
    for t0 in range(0, T, TC):
        t = t0 + tl.arange(0, TC)
        idt = tl.load(ids_ptr + t[:, None] * KT + j[None, :], mask=(t[:, None] < T) & (j[None, :] < KT),
                      other=-1)
        hit = tl.max((idt == e).to(tl.int32), 1)
        rank = tl.cumsum(hit, 0) - 1 + seen - start
        m = (hit > 0)[None, :] & (rank[None, :] == i[:, None])
        toks += tl.sum(tl.where(m, t[None, :], 0), 1)
        found += tl.sum(m.to(tl.int32), 1)
        seen += tl.sum(hit, 0)
    return toks, found > 0, seen


@triton.jit
def _mine(ids_ptr, toks, ok, e, KT: tl.constexpr, KTP: tl.constexpr):
    """Token rows' ids [NT, KTP] (-1 past KT or where not ok), which slots name expert e, the first
    of them and whether any row names e more than once (moe_route's ids never do; ids made
    otherwise may, with the extra slots weighing 0)."""
    j = tl.arange(0, KTP)
    idt = tl.load(ids_ptr + toks.to(tl.int64)[:, None] * KT + j[None, :],
                  mask=ok[:, None] & (j[None, :] < KT), other=-1)
    mine = idt == e
    first = tl.min(tl.where(mine, j[None, :], KTP), 1)
    again = tl.max(tl.sum(mine.to(tl.int32), 1), 0) > 1
    return idt, mine, first, again


@triton.jit
def _store_act(act_ptr, ids_ptr, a, toks, ok, e, offs_f, F: tl.constexpr, KT: tl.constexpr,
               KTP: tl.constexpr):
    """a [NT, BF]: expert e's activations of tokens toks (where ok), columns offs_f -> act[t, j, f]
    of every slot j of t that chose e: one store to the first such slot, and only where some row
    names e twice, a pass over the other slots (a token naming e twice gets the same row twice)."""
    t64 = toks.to(tl.int64)
    f_mask = offs_f < F
    idt, mine, first, again = _mine(ids_ptr, toks, ok, e, KT, KTP)
    tl.store(act_ptr + (t64 * KT + first)[:, None] * F + offs_f[None, :], a,
             mask=ok[:, None] & f_mask[None, :])
    if again:
        j = tl.arange(0, KTP)
        for jj in tl.static_range(1, KT):
            ej = tl.sum(tl.where(j[None, :] == jj, idt, 0), 1)
            more = ok & (ej == e) & (first < jj)
            tl.store(act_ptr + (t64 * KT + jj)[:, None] * F + offs_f[None, :], a,
                     mask=more[:, None] & f_mask[None, :])


@triton.jit
def _silu_mul(g, u):
    """act = bf16(silu(g) * u), g and u rounded to bf16 first (as the unfused model stores them)."""
    g = g.to(tl.bfloat16).to(tl.float32)
    u = u.to(tl.bfloat16).to(tl.float32)
    return (g / (1.0 + tl.exp(-g)) * u).to(tl.bfloat16)


@triton.jit
def moe_gate_up(x_ptr, ids_ptr, w_ptr, act_ptr, T,
                H: tl.constexpr, F: tl.constexpr, KT: tl.constexpr, KTP: tl.constexpr,
                BLOCK_E: tl.constexpr, BLOCK_F: tl.constexpr, FMA_BLOCK_K: tl.constexpr,
                FMA_T: tl.constexpr, FMA_TP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr,
                PC: tl.constexpr, TC: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
    if PDL:
        gdc_wait()   # earlier kernels' writes are visible from here on
    u = tl.program_id(0)
    pid_f = tl.program_id(1)
    e, slots = _expert_of(ids_ptr, u, T * KT, BLOCK_E, PC)
    if slots > 0:
        offs_f = pid_f * BLOCK_F + tl.arange(0, BLOCK_F)
        # gate row f and up row F + f of expert e; rows past F are clamped for loading (unmasked,
        # vectorized), their results dropped at the store
        f_rows = tl.minimum(offs_f, F - 1).to(tl.int64)[:, None]
        g_rows = w_ptr + e.to(tl.int64) * (2 * F * H) + f_rows * H
        u_rows = g_rows + F * H
        toks, ok, n = _tokens_of(ids_ptr, e, T, 0, KT, KTP, TC, FMA_TP)
        if n <= FMA_T:
            # ---- CUDA-core path: tokens r < n, one W tile per step ----
            rows = tl.arange(0, FMA_TP)
            ok0 = tl.sum(tl.where((rows == 0) & ok, 1, 0), 0, keep_dims=True) > 0   # [1]
            x0_row = x_ptr + tl.sum(tl.where(rows == 0, toks, 0), 0).to(tl.int64) * H
            acc_g0 = tl.zeros([BLOCK_F, FMA_BLOCK_K], tl.float32)
            acc_u0 = tl.zeros([BLOCK_F, FMA_BLOCK_K], tl.float32)
            for k0 in range(0, H, FMA_BLOCK_K):
                k = k0 + tl.arange(0, FMA_BLOCK_K)
                wg = tl.load(_ptr(g_rows, k[None, :]), mask=k[None, :] < H, other=0.0,
                             eviction_policy="evict_first").to(tl.float32)
                wu = tl.load(_ptr(u_rows, k[None, :]), mask=k[None, :] < H, other=0.0,
                             eviction_policy="evict_first").to(tl.float32)
                x0 = tl.load(_ptr(x0_row, k), mask=ok0 & (k < H), other=0.0).to(tl.float32)[None, :]
                acc_g0 += wg * x0
                acc_u0 += wu * x0
            g = tl.zeros([FMA_TP, BLOCK_F], tl.float32)
            v = tl.zeros([FMA_TP, BLOCK_F], tl.float32)
            g = tl.where(rows[:, None] == 0, tl.sum(acc_g0, axis=1)[None, :], g)
            v = tl.where(rows[:, None] == 0, tl.sum(acc_u0, axis=1)[None, :], v)
            _store_act(act_ptr, ids_ptr, _silu_mul(g, v), toks, ok, e, offs_f, F, KT, KTP)
        else:
            # ---- tensor-core path: BLOCK_T tokens at a time, acc[f, t] = W @ X^T ----
            for s in range(0, n, BLOCK_T):
                toks_t, ok_t, _ = _tokens_of(ids_ptr, e, T, s, KT, KTP, TC, BLOCK_T)
                x_rows = x_ptr + toks_t.to(tl.int64)[:, None] * H
                acc_g = tl.zeros([BLOCK_F, BLOCK_T], tl.float32)
                acc_u = tl.zeros([BLOCK_F, BLOCK_T], tl.float32)
                for k0 in range(0, H, BLOCK_K):
                    k = k0 + tl.arange(0, BLOCK_K)[None, :]
                    xa = tl.load(_ptr(x_rows, k), mask=ok_t[:, None] & (k < H), other=0.0)
                    wg = tl.load(_ptr(g_rows, k), mask=k < H, other=0.0, eviction_policy="evict_first")
                    wu = tl.load(_ptr(u_rows, k), mask=k < H, other=0.0, eviction_policy="evict_first")
                    if DOT_F32:
                        acc_g = tl.dot(wg.to(tl.float32), tl.trans(xa.to(tl.float32)), acc_g, input_precision="ieee")
                        acc_u = tl.dot(wu.to(tl.float32), tl.trans(xa.to(tl.float32)), acc_u, input_precision="ieee")
                    else:
                        acc_g = tl.dot(wg, tl.trans(xa), acc_g)
                        acc_u = tl.dot(wu, tl.trans(xa), acc_u)
                _store_act(act_ptr, ids_ptr, tl.trans(_silu_mul(acc_g, acc_u)), toks_t, ok_t, e, offs_f, F, KT, KTP)


META = {
    "entry": "moe_gate_up",
    "params": [["x_ptr", "*bf16", "in:0"], ["ids_ptr", "*i32", "in:1"],
               ["w_ptr", "*bf16", "in:2"], ["act_ptr", "*bf16", "out:0"],
               ["T", "i32", "dim:T"]],
    "constexprs": {"H": 6144, "F": 2048, "KT": 9, "KTP": 16, "BLOCK_E": 256,
                   "BLOCK_F": 16, "FMA_BLOCK_K": 256, "FMA_T": 1,
                   "FMA_TP": 1, "BLOCK_K": 64, "BLOCK_T": 16,
                   "PC": 256, "TC": 32, "DOT_F32": False, "PDL": True},
    "pdl": True,
    "grid": ["min(129, T * 9)", 128, 1],
    "num_warps": 4,
    "num_stages": 4,
}
