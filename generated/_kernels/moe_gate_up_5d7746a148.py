# moe_gate_up: act[t, j, f] = bf16(silu(g) * u),  e = ids[t, j],
#   g = bf16(sum_k x[t, k] * w[e, f, k]),  u = bf16(sum_k x[t, k] * w[e, 2048 + f, k]),
#   silu(g) = g / (1 + exp(-g)) in fp32 (g and u rounded to bf16 as the unfused model stores them).
#   x [T, 7168] bf16, ids i32 [T, 8], w [256, 4096, 7168] bf16 (rows 0..2047 gate,
#   2048..4095 up), act [T, 8, 2048] bf16; fp32 accumulate.
#
# Decode: a few tokens, each naming 8 experts, so the step reads only the chosen experts'
# rows, and each of them once. Grid (min(256, T * 8) distinct-expert slots, 64 blocks of
# BLOCK_F = 32 gate rows and the matching up rows): program (u, b) takes the u-th smallest
# chosen expert e (a histogram of the step's ids; slots past the number of distinct experts exit),
# finds the tokens that chose e (in token order), and runs a GEMV over its row block for them,
# like gemv.py.j2:
#  * at most FMA_T = 0 tokens: CUDA cores; the block's gate and up rows stream in
#    [BLOCK_F, FMA_BLOCK_K] tiles of 16-byte loads (evict_first), one fp32 partial product per
#    row and token, reduced once at the end;
#  * more: tensor cores, swap-AB: acc[f, t] += W_tile[BLOCK_F, BLOCK_K] @ X^T over BLOCK_T
#    gathered token rows at a time (more than BLOCK_T tokens re-read the tile, from L2).
# A token that names e in two slots gets the same row in both; a slot of id -1 (another rank's
# expert, ep_dispatch) names none and its act row is left unwritten.
# The path depends only on how many tokens chose e, and each token's sums are its own: the
# same bits from run to run.
# Quantized experts: f8e4m3 codes, scales per 128 rows x 128 columns (1792 an
#   expert, expert e's from e * 1792 on), dequantized in registers; x quantized dynamic_group (groups of 128: K tiles hold whole groups).
#   x arrives as ready e4m3 codes with a scale a row and 128 columns (made once a step): the
#   tensor-core path, taken at every token count, dots a [2 BLOCK_F, BLOCK_K] tile of W codes (gate
#   and up rows interleaved) with x's codes (exact products,
#   fp32 sums) and scales a tile's sums by w_scale[row block] * a_scale[token]:
#   acc[f, t] += dot(w_codes[f, k-tile], x_codes[t, k-tile]) * w_scale[f] * a_scale[t, tile].
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
def _w_raw(w_rows, k0, k_end, BK: tl.constexpr):
    """The stored codes of W[rows, k0 : k0 + BK], zero past k_end: w_rows [BN, 1] row pointers
    (7168 bytes a row), k0 a multiple of BK -> f8e4m3 [BN, BK]."""
    k = k0 + tl.arange(0, BK)[None, :]
    p = w_rows + k
    p = tl.multiple_of(p, [1, 16])
    return tl.load(p, mask=k < k_end, other=0.0, eviction_policy="evict_first")


@triton.jit
def _w_values(raw):
    """The codes' values (fp32) in K order: [BN, BK]."""
    return raw.to(tl.float32)


@triton.jit
def _w_group(t_ptr, srow, k0, k_end, BK: tl.constexpr):
    """t[srow, g(k)] (w_scale or w_zero: 56 groups a row) over the tile's columns
    k0 .. k0 + BK: srow [BN, 1] the W rows' scale rows -> [BN, 1] (the tile in one group),
    [BN, BK / 128] (one a group of the tile) or [BN, BK] (a group per column)."""
    if 128 % BK == 0:
        return tl.load(t_ptr + srow * 56 + tl.minimum(k0 // 128, 55))
    elif BK % 128 == 0:
        g = tl.minimum(k0 // 128 + tl.arange(0, BK // 128), 55)[None, :]
        return tl.load(t_ptr + srow * 56 + g)
    else:
        k = k0 + tl.arange(0, BK)[None, :]
        return tl.load(t_ptr + srow * 56 + tl.minimum(k // 128, 55))


@triton.jit
def _w_deq_unmasked(raw, srow, w_scale_ptr, k0, k_end, BK: tl.constexpr):
    """W[rows, k0 : k0 + BK] in fp32 from the raw tile (_w_raw); past k_end whatever the zero codes
    give ((0 - zero) * scale for integers): for a caller whose A is zero there."""
    v = _w_values(raw)
    s = _w_group(w_scale_ptr, srow, k0, k_end, BK)
    z = 0.0
    if s.shape[1] == 1 or s.shape[1] == BK:
        w = v * s
    else:
        # a scale (and zero) per group of the tile's 128 columns: the tile seen as [BN, groups, 128]
        v = tl.reshape(v, [v.shape[0], s.shape[1], 128])
        w = tl.reshape(v * s[:, :, None], [v.shape[0], BK])
    return w


@triton.jit
def _w_deq(raw, srow, w_scale_ptr, k0, k_end, BK: tl.constexpr):
    """W[rows, k0 : k0 + BK] in fp32 from the raw tile (_w_raw), zero past k_end."""
    w = _w_deq_unmasked(raw, srow, w_scale_ptr, k0, k_end, BK)
    k = k0 + tl.arange(0, BK)[None, :]
    return tl.where(k < k_end, w, 0.0)


@triton.jit
def _a_scale(amax):
    """An activation group's scale: amax / 448, 1 where the group is all zeros."""
    return tl.where(amax > 0, tl.math.div_rn(amax, 448.0), 1.0)


@triton.jit
def _a_quant(a):
    """The A tile, [BK] or [R, BK], as the dynamic_group activation quantizer leaves it: e4m3(x / s) * s in
    fp32."""
    x = a.to(tl.float32)
    # each group's amax by a masked reduction in a's own layout (a reshape to [.., groups, act_group]
    # costs the CUDA-core path its registers: 255 and spills on sm_90)
    col = tl.arange(0, x.shape[len(x.shape) - 1]) // 128
    s = tl.zeros_like(x)
    for g in tl.static_range(x.shape[len(x.shape) - 1] // 128):
        amax = tl.max(tl.where(col == g, tl.abs(x), 0.0), axis=len(x.shape) - 1, keep_dims=True)
        s = tl.where(col == g, _a_scale(amax), s)
    return tl.math.div_rn(x, s).to(tl.float8e4nv).to(tl.float32) * s


@triton.jit
def _a_codes(a):
    """(e4m3 codes [R, BK], scales [R]) of an A tile holding one activation group a row."""
    x = a.to(tl.float32)
    s = _a_scale(tl.max(tl.abs(x), axis=1))
    return tl.math.div_rn(x, s[:, None]).to(tl.float8e4nv), s


@triton.jit
def _a_ready(code_rows, scale_rows, k0, k, mask, BK: tl.constexpr):
    """A[rows, k] in fp32 from ready codes: code_rows / scale_rows the rows' first code and scale
    ([R, 1] pointers with k [1, BK], or one row's with k [BK]), k = k0 + 0 .. BK - 1 (k0 a multiple
    of BK); zero where masked. A tile inside one group loads one scale a row (a scale an element
    would be staged in shared memory beside the codes: 4x their bytes)."""
    c = tl.load(code_rows + k, mask=mask, other=0.0).to(tl.float32)
    if 128 % BK == 0:
        s = tl.load(scale_rows + k0 // 128)
    else:
        s = tl.load(scale_rows + tl.minimum(k // 128, 55), mask=mask, other=0.0)
    return tl.where(mask, c * s, 0.0)


@triton.jit
def moe_gate_up(x_ptr, ids_ptr, w_ptr, act_ptr, T, w_scale_ptr, as_ptr,
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
        g_rows = w_ptr + e.to(tl.int64) * 29360128 + f_rows * 7168
        u_rows = g_rows + 14680064
        srow_g = f_rows // 128
        srow_u = (f_rows + F) // 128
        ws = w_scale_ptr + e.to(tl.int64) * 1792   # expert e's scales

        # the codes form's tile: row r is gate row f (r even) or up row F + f (r odd), f = offs_f[r // 2]
        r2 = tl.arange(0, 2 * BLOCK_F)
        p_row = (tl.minimum(pid_f * BLOCK_F + r2 // 2, F - 1) + (r2 % 2) * F).to(tl.int64)[:, None]
        p_rows = w_ptr + e.to(tl.int64) * 29360128 + p_row * 7168
        srow_p = p_row // 128
        toks, ok, n = _tokens_of(ids_ptr, e, T, 0, KT, KTP, TC, FMA_TP)
        if n <= FMA_T:
            # ---- CUDA-core path: tokens r < n, one W tile per step ----
            rows = tl.arange(0, FMA_TP)
            for k0 in range(0, H, FMA_BLOCK_K):
                k = k0 + tl.arange(0, FMA_BLOCK_K)
                wg = _w_deq(_w_raw(g_rows, k0, H, FMA_BLOCK_K), srow_g, ws, k0, H, FMA_BLOCK_K)
                wu = _w_deq(_w_raw(u_rows, k0, H, FMA_BLOCK_K), srow_u, ws, k0, H, FMA_BLOCK_K)
            g = tl.zeros([FMA_TP, BLOCK_F], tl.float32)
            v = tl.zeros([FMA_TP, BLOCK_F], tl.float32)
            _store_act(act_ptr, ids_ptr, _silu_mul(g, v), toks, ok, e, offs_f, F, KT, KTP)
        else:
            # ---- tensor-core path: BLOCK_T tokens at a time, acc[f, t] = W @ X^T ----
            for s in range(0, n, BLOCK_T):
                toks_t, ok_t, _ = _tokens_of(ids_ptr, e, T, s, KT, KTP, TC, BLOCK_T)
                x_rows = x_ptr + toks_t.to(tl.int64)[:, None] * H
                s_rows = as_ptr + toks_t.to(tl.int64)[:, None] * 56
                acc = tl.zeros([2 * BLOCK_F, BLOCK_T], tl.float32)
                for k0 in range(0, H, BLOCK_K):
                    k = k0 + tl.arange(0, BLOCK_K)[None, :]
                    # e4m3 x e4m3 on tensor cores: the tile is one activation group, one W scale a row
                    xc = tl.load(x_rows + k, mask=ok_t[:, None] & (k < H), other=0.0)
                    a_s = tl.load(s_rows + k0 // 128, mask=ok_t[:, None], other=0.0)   # [BLOCK_T, 1]
                    acc += tl.dot(_w_raw(p_rows, k0, H, BLOCK_K), tl.trans(xc)) \
                        * (_w_group(ws, srow_p, k0, H, BLOCK_K) * tl.trans(a_s))
                # the gate and up sums apart again: [BLOCK_T, BLOCK_F, 2] -> two [BLOCK_F, BLOCK_T]
                acc_g, acc_u = tl.split(tl.reshape(tl.trans(acc), [BLOCK_T, BLOCK_F, 2]))
                acc_g, acc_u = tl.trans(acc_g), tl.trans(acc_u)
                _store_act(act_ptr, ids_ptr, tl.trans(_silu_mul(acc_g, acc_u)), toks_t, ok_t, e, offs_f, F, KT, KTP)


META = {
    "entry": "moe_gate_up",
    "params": [["x_ptr", "*fp8e4nv", "in:0"], ["ids_ptr", "*i32", "in:1"],
               ["w_ptr", "*fp8e4nv", "in:2"], ["act_ptr", "*bf16", "out:0"],
               ["T", "i32", "dim:T"], ["w_scale_ptr", "*fp32", "in:5"], ["as_ptr", "*fp32", "in:6"]],
    "constexprs": {"H": 7168, "F": 2048, "KT": 8, "KTP": 8, "BLOCK_E": 256,
                   "BLOCK_F": 32, "FMA_BLOCK_K": 256, "FMA_T": 0,
                   "FMA_TP": 1, "BLOCK_K": 128, "BLOCK_T": 16,
                   "PC": 256, "TC": 32, "DOT_F32": False, "PDL": True},
    "pdl": True,
    "grid": ["min(256, T * 8)", 64, 1],
    "num_warps": 4,
    "num_stages": 4,
}
