# moe_gate_up: act[t, j, f] = bf16(silu(g) * u),  e = ids[t, j],
#   g = bf16(sum_k x[t, k] * w[e, f, k]),  u = bf16(sum_k x[t, k] * w[e, 2880 + f, k]),
#   silu(g) = g / (1 + exp(-g)) in fp32 (g and u rounded to bf16 as the unfused model stores them).
#   x [T, 2880] bf16, ids i32 [T, 4], w [32, 5760, 2880] bf16 (rows 0..2879 gate,
#   2880..5759 up), act [T, 4, 2880] bf16; fp32 accumulate.
#
# Decode: a few tokens, each naming 4 experts, so the step reads only the chosen experts'
# rows, and each of them once. Grid (min(32, T * 4) distinct-expert slots, 90 blocks of
# BLOCK_F = 32 gate rows and the matching up rows): program (u, b) takes the u-th smallest
# chosen expert e (a histogram of the step's ids; slots past the number of distinct experts exit),
# finds the tokens that chose e (in token order), and runs a GEMV over its row block for them,
# like gemv.py.j2:
#  * at most FMA_T = 4 tokens: CUDA cores; the block's gate and up rows stream in
#    [BLOCK_F, FMA_BLOCK_K] tiles of 16-byte loads (evict_first), one fp32 partial product per
#    row and token, reduced once at the end;
#  * more: tensor cores, swap-AB: acc[f, t] += W_tile[BLOCK_F, BLOCK_K] @ X^T over BLOCK_T
#    gathered token rows at a time (more than BLOCK_T tokens re-read the tile, from L2).
# A token that names e in two slots gets the same row in both; a slot of id -1 (another rank's
# expert, ep_dispatch) names none and its act row is left unwritten.
# Expert bias b [32, 5760] (gate | up, like w's rows) added to g and u before the activation.
# The activation is clamped_swiglu (alpha 1.702, limit 7.0), not silu(g) * u.
# The path depends only on how many tokens chose e, and each token's sums are its own: the
# same bits from run to run.
# Quantized experts: e2m1 codes, scales per 1 rows x 32 columns (518400 an
#   expert, expert e's from e * 518400 on); x quantized none.
#   OCP MXFP4 (e2m1 codes, a power-of-two scale per row and 32 columns, stored as the float 2^(b - 127)):
#   at most FMA_T = 4 tokens the CUDA-core path decodes int32 words of codes by bit
#   placement (triton/_mx_fma.j2) and scales a group's sums once; past it the tensor-core path
#   hands a [BLOCK_F, BLOCK_K / 2] tile of packed codes and its [BLOCK_F, BLOCK_K / 32] e8m0 scale bytes to tl.dot_scaled with x^T in bf16:
#   acc[f, t] += sum_k value(code[f, k]) * 2^(b[f, k // 32] - 127) * x[t, k]   (the value of W exactly,
#   fp32 sums), for gate's and up's rows apart.
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
def _gated_act(g, u):
    """act = bf16((u' + 1) g' sigmoid(alpha g')), g' = min(g, limit), u' = clamp(u, -limit, limit)
    (GPT-OSS's experts: alpha 1.702, limit 7.0); g and u rounded to bf16 first, as
    the unfused model stores them."""
    g = tl.minimum(g.to(tl.bfloat16).to(tl.float32), 7.0)
    u = tl.minimum(tl.maximum(u.to(tl.bfloat16).to(tl.float32), -7.0), 7.0)
    return ((u + 1.0) * g / (1.0 + tl.exp(-1.702 * g))).to(tl.bfloat16)


@triton.jit
def _w_raw(w_rows, k0, k_end, BK: tl.constexpr):
    """The stored codes of W[rows, k0 : k0 + BK], zero past k_end: w_rows [BN, 1] row pointers
    (1440 bytes a row), k0 a multiple of BK -> bytes [BN, BK / 2], two codes each."""
    j = k0 // 2 + tl.arange(0, BK // 2)[None, :]
    p = w_rows + j
    p = tl.multiple_of(p, [1, 16])
    # byte j holds codes 2j and 2j + 1: the mask is j < ceil(k_end / 2), written on j itself so the
    # compiler sees it constant over runs of bytes (2 * j < k_end hid that: byte-wide loads, and the
    # tensor-core paths lost their cp.async pipelining)
    return tl.load(p, mask=j < (k_end + 1) // 2, other=0, eviction_policy="evict_first")


@triton.jit
def _w_values(raw):
    """The codes' values (fp32) in K order: [BN, BK]."""
    c = tl.reshape(tl.join(raw & 15, raw >> 4), [raw.shape[0], raw.shape[1] * 2]).to(tl.int32)
    m = (c & 1).to(tl.float32)
    e = (c >> 1) & 3
    mag = tl.where(e == 0, 0.5 * m, (1 << e).to(tl.float32) * (0.5 + 0.25 * m))
    return tl.where((c & 8) != 0, -mag, mag)


@triton.jit
def _w_group(t_ptr, srow, k0, k_end, BK: tl.constexpr):
    """t[srow, g(k)] (w_scale or w_zero: 90 groups a row) over the tile's columns
    k0 .. k0 + BK: srow [BN, 1] the W rows' scale rows -> [BN, 1] (the tile in one group),
    [BN, BK / 32] (one a group of the tile) or [BN, BK] (a group per column)."""
    if 32 % BK == 0:
        return tl.load(t_ptr + srow * 90 + tl.minimum(k0 // 32, 89))
    elif BK % 32 == 0:
        g = tl.minimum(k0 // 32 + tl.arange(0, BK // 32), 89)[None, :]
        return tl.load(t_ptr + srow * 90 + g)
    else:
        k = k0 + tl.arange(0, BK)[None, :]
        return tl.load(t_ptr + srow * 90 + tl.minimum(k // 32, 89))


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
        # a scale (and zero) per group of the tile's 32 columns: the tile seen as [BN, groups, 32]
        v = tl.reshape(v, [v.shape[0], s.shape[1], 32])
        w = tl.reshape(v * s[:, :, None], [v.shape[0], BK])
    return w


@triton.jit
def _w_deq(raw, srow, w_scale_ptr, k0, k_end, BK: tl.constexpr):
    """W[rows, k0 : k0 + BK] in fp32 from the raw tile (_w_raw), zero past k_end."""
    w = _w_deq_unmasked(raw, srow, w_scale_ptr, k0, k_end, BK)
    k = k0 + tl.arange(0, BK)[None, :]
    return tl.where(k < k_end, w, 0.0)


@triton.jit
def _w_e8m0(t_ptr, srow, k0, BK: tl.constexpr):
    """The e8m0 bytes of w_scale[srow, g] for the tile's BK / 32 groups from k0 -> u8 [BN, BK / 32]:
    the plan stores an MX scale as the float 2^(b - 127), whose exponent field is b (b = 0's
    2^-127 a subnormal with field 0). Groups past the row's 90 read 127 (1.0): their codes
    are zero, and a NaN scale would make 0 * scale NaN."""
    g = k0 // 32 + tl.arange(0, BK // 32)[None, :]
    s = tl.load(t_ptr + srow * 90 + g, mask=g < 90, other=1.0)
    return ((s.to(tl.int32, bitcast=True) >> 23) & 255).to(tl.uint8)


@triton.jit
def _mx_words(rows32, wi, wm):
    """The tile's int32 words: rows32 [BN, 1, 1] the rows' first words, wi [G, 4] word indices
    (wm: inside the row) -> [BN, G, 4], 0 (a code of value 0) past the row."""
    return tl.load(rows32 + wi[None, :, :], mask=wm[None, :, :], other=0, eviction_policy="evict_first")


@triton.jit
def _e2m1_pair(w, i: tl.constexpr):
    """Codes i and i + 4 of every word (bits 4i .. 4i + 3 and 4i + 16 .. 4i + 19) -> their values
    times 2^-14 in fp32, (code i, code i + 4): each nibble's e1 e0 m moved to bits 11..9 of its
    16-bit half and s to bit 15, read as an f16 (exact, subnormals included)."""
    if i == 3:
        mag = (w >> 3) & 0x0E000E00
        sgn = w & -2147450880                 # 0x80008000 as an int32
    else:
        mag = (w << (9 - 4 * i)) & 0x0E000E00
        sgn = (w << (12 - 4 * i)) & -2147450880
    h = mag | sgn
    lo = h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = (h >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _mx_x(x_row, col, m):
    """x[col] in fp32 ([G, 4] columns of one row; 0 where not m)."""
    return tl.load(x_row + col, mask=m, other=0.0).to(tl.float32)[None, :, :]


@triton.jit
def _mx_scales(s_rows, k0, GROUPS: tl.constexpr, G: tl.constexpr):
    """The tile's group scales: s_rows [BN, 1, 1] the rows' first scales -> [BN, G, 1] (0 past the
    row's GROUPS: their codes are 0 too). 3-D like the word tile, so that the group sums
    (tl.sum(axis=2, keep_dims=True)) meet them in their own layout: no conversion a K step."""
    # (the index as a quotient: the compiler sees no run of contiguous scales, so the load takes a
    # scale a thread in the word tile's own thread order rather than a vector layout of its own)
    g = (k0 + 32 * tl.arange(0, G)[None, :, None]) // 32
    return tl.load(s_rows + g, mask=g < GROUPS, other=0.0)


@triton.jit
def moe_gate_up(x_ptr, ids_ptr, w_ptr, act_ptr, T, b_ptr, w_scale_ptr,
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
        g_rows = w_ptr + e.to(tl.int64) * 8294400 + f_rows * 1440
        u_rows = g_rows + 4147200
        srow_g = f_rows // 1
        srow_u = (f_rows + F) // 1
        ws = w_scale_ptr + e.to(tl.int64) * 518400   # expert e's scales

        b_m = offs_f < F
        b_g = tl.load(b_ptr + e.to(tl.int64) * (2 * F) + offs_f, mask=b_m, other=0.0).to(tl.float32)
        b_u = tl.load(b_ptr + e.to(tl.int64) * (2 * F) + F + offs_f, mask=b_m, other=0.0).to(tl.float32)
        toks, ok, n = _tokens_of(ids_ptr, e, T, 0, KT, KTP, TC, FMA_TP)
        if n <= FMA_T:
            # ---- CUDA-core path: tokens r < n, one W tile per step ----
            rows = tl.arange(0, FMA_TP)
            ok0 = tl.sum(tl.where((rows == 0) & ok, 1, 0), 0, keep_dims=True) > 0   # [1]
            x0_row = x_ptr + tl.sum(tl.where(rows == 0, toks, 0), 0).to(tl.int64) * H
            ok1 = tl.sum(tl.where((rows == 1) & ok, 1, 0), 0, keep_dims=True) > 0   # [1]
            x1_row = x_ptr + tl.sum(tl.where(rows == 1, toks, 0), 0).to(tl.int64) * H
            ok2 = tl.sum(tl.where((rows == 2) & ok, 1, 0), 0, keep_dims=True) > 0   # [1]
            x2_row = x_ptr + tl.sum(tl.where(rows == 2, toks, 0), 0).to(tl.int64) * H
            ok3 = tl.sum(tl.where((rows == 3) & ok, 1, 0), 0, keep_dims=True) > 0   # [1]
            x3_row = x_ptr + tl.sum(tl.where(rows == 3, toks, 0), 0).to(tl.int64) * H
            # MXFP4 words decoded in registers, a group's scale once (triton/_mx_fma.j2); one token
            # (batch 1) takes a loop of its own: the FMA_T-token loop computes every slot
            if n == 1:
                q4 = tl.arange(0, 4)
                g4 = 4 * tl.arange(0, FMA_BLOCK_K // 32)
                w_g = g_rows.to(tl.pointer_type(tl.int32), bitcast=True)[:, :, None]   # a row's 360 words
                s_g = (ws + srow_g * 90)[:, :, None]
                acc_g0 = tl.zeros([g_rows.shape[0], FMA_BLOCK_K // 32, 1], tl.float32)
                w_u = u_rows.to(tl.pointer_type(tl.int32), bitcast=True)[:, :, None]   # a row's 360 words
                s_u = (ws + srow_u * 90)[:, :, None]
                acc_u0 = tl.zeros([u_rows.shape[0], FMA_BLOCK_K // 32, 1], tl.float32)
                for k0 in range(0, 2880, FMA_BLOCK_K):
                    wi = k0 // 8 + g4[:, None] + q4[None, :]            # [G, 4]: the tile's words
                    wm = wi < 360
                    col = 8 * wi                                        # the first column of each word
                    c_g = _mx_words(w_g, wi, wm)
                    c_u = _mx_words(w_u, wi, wm)
                    lo_g, hi_g = _e2m1_pair(c_g, 0)
                    lo_u, hi_u = _e2m1_pair(c_u, 0)
                    xl = _mx_x(x0_row, col + 0, ok0 & wm)
                    xh = _mx_x(x0_row, col + 4, ok0 & wm)
                    p_g0 = lo_g * xl     # (FFMAs: one a weight)
                    p_g0 = p_g0 + hi_g * xh
                    p_u0 = lo_u * xl     # (FFMAs: one a weight)
                    p_u0 = p_u0 + hi_u * xh
                    lo_g, hi_g = _e2m1_pair(c_g, 1)
                    lo_u, hi_u = _e2m1_pair(c_u, 1)
                    xl = _mx_x(x0_row, col + 1, ok0 & wm)
                    xh = _mx_x(x0_row, col + 5, ok0 & wm)
                    p_g0 = p_g0 + lo_g * xl     # (FFMAs: one a weight)
                    p_g0 = p_g0 + hi_g * xh
                    p_u0 = p_u0 + lo_u * xl     # (FFMAs: one a weight)
                    p_u0 = p_u0 + hi_u * xh
                    lo_g, hi_g = _e2m1_pair(c_g, 2)
                    lo_u, hi_u = _e2m1_pair(c_u, 2)
                    xl = _mx_x(x0_row, col + 2, ok0 & wm)
                    xh = _mx_x(x0_row, col + 6, ok0 & wm)
                    p_g0 = p_g0 + lo_g * xl     # (FFMAs: one a weight)
                    p_g0 = p_g0 + hi_g * xh
                    p_u0 = p_u0 + lo_u * xl     # (FFMAs: one a weight)
                    p_u0 = p_u0 + hi_u * xh
                    lo_g, hi_g = _e2m1_pair(c_g, 3)
                    lo_u, hi_u = _e2m1_pair(c_u, 3)
                    xl = _mx_x(x0_row, col + 3, ok0 & wm)
                    xh = _mx_x(x0_row, col + 7, ok0 & wm)
                    p_g0 = p_g0 + lo_g * xl     # (FFMAs: one a weight)
                    p_g0 = p_g0 + hi_g * xh
                    p_u0 = p_u0 + lo_u * xl     # (FFMAs: one a weight)
                    p_u0 = p_u0 + hi_u * xh
                    sc = _mx_scales(s_g, k0, 90, FMA_BLOCK_K // 32)
                    acc_g0 += tl.sum(p_g0, axis=2, keep_dims=True) * sc
                    sc = _mx_scales(s_u, k0, 90, FMA_BLOCK_K // 32)
                    acc_u0 += tl.sum(p_u0, axis=2, keep_dims=True) * sc
                s_g0 = tl.sum(tl.sum(acc_g0, axis=2), axis=1) * 16384.0     # the decode's 2^-14 back
                s_u0 = tl.sum(tl.sum(acc_u0, axis=2), axis=1) * 16384.0     # the decode's 2^-14 back

                g = tl.zeros([FMA_TP, BLOCK_F], tl.float32)
                v = tl.zeros([FMA_TP, BLOCK_F], tl.float32)
                g = tl.where(rows[:, None] == 0, s_g0[None, :], g)
                v = tl.where(rows[:, None] == 0, s_u0[None, :], v)
            else:
                q4 = tl.arange(0, 4)
                g4 = 4 * tl.arange(0, FMA_BLOCK_K // 32)
                w_g = g_rows.to(tl.pointer_type(tl.int32), bitcast=True)[:, :, None]   # a row's 360 words
                s_g = (ws + srow_g * 90)[:, :, None]
                acc_g0 = tl.zeros([g_rows.shape[0], FMA_BLOCK_K // 32, 1], tl.float32)
                acc_g1 = tl.zeros([g_rows.shape[0], FMA_BLOCK_K // 32, 1], tl.float32)
                acc_g2 = tl.zeros([g_rows.shape[0], FMA_BLOCK_K // 32, 1], tl.float32)
                acc_g3 = tl.zeros([g_rows.shape[0], FMA_BLOCK_K // 32, 1], tl.float32)
                w_u = u_rows.to(tl.pointer_type(tl.int32), bitcast=True)[:, :, None]   # a row's 360 words
                s_u = (ws + srow_u * 90)[:, :, None]
                acc_u0 = tl.zeros([u_rows.shape[0], FMA_BLOCK_K // 32, 1], tl.float32)
                acc_u1 = tl.zeros([u_rows.shape[0], FMA_BLOCK_K // 32, 1], tl.float32)
                acc_u2 = tl.zeros([u_rows.shape[0], FMA_BLOCK_K // 32, 1], tl.float32)
                acc_u3 = tl.zeros([u_rows.shape[0], FMA_BLOCK_K // 32, 1], tl.float32)
                for k0 in range(0, 2880, FMA_BLOCK_K):
                    wi = k0 // 8 + g4[:, None] + q4[None, :]            # [G, 4]: the tile's words
                    wm = wi < 360
                    col = 8 * wi                                        # the first column of each word
                    c_g = _mx_words(w_g, wi, wm)
                    c_u = _mx_words(w_u, wi, wm)
                    lo_g, hi_g = _e2m1_pair(c_g, 0)
                    lo_u, hi_u = _e2m1_pair(c_u, 0)
                    xl = _mx_x(x0_row, col + 0, ok0 & wm)
                    xh = _mx_x(x0_row, col + 4, ok0 & wm)
                    p_g0 = lo_g * xl     # (FFMAs: one a weight)
                    p_g0 = p_g0 + hi_g * xh
                    p_u0 = lo_u * xl     # (FFMAs: one a weight)
                    p_u0 = p_u0 + hi_u * xh
                    xl = _mx_x(x1_row, col + 0, ok1 & wm)
                    xh = _mx_x(x1_row, col + 4, ok1 & wm)
                    p_g1 = lo_g * xl     # (FFMAs: one a weight)
                    p_g1 = p_g1 + hi_g * xh
                    p_u1 = lo_u * xl     # (FFMAs: one a weight)
                    p_u1 = p_u1 + hi_u * xh
                    xl = _mx_x(x2_row, col + 0, ok2 & wm)
                    xh = _mx_x(x2_row, col + 4, ok2 & wm)
                    p_g2 = lo_g * xl     # (FFMAs: one a weight)
                    p_g2 = p_g2 + hi_g * xh
                    p_u2 = lo_u * xl     # (FFMAs: one a weight)
                    p_u2 = p_u2 + hi_u * xh
                    xl = _mx_x(x3_row, col + 0, ok3 & wm)
                    xh = _mx_x(x3_row, col + 4, ok3 & wm)
                    p_g3 = lo_g * xl     # (FFMAs: one a weight)
                    p_g3 = p_g3 + hi_g * xh
                    p_u3 = lo_u * xl     # (FFMAs: one a weight)
                    p_u3 = p_u3 + hi_u * xh
                    lo_g, hi_g = _e2m1_pair(c_g, 1)
                    lo_u, hi_u = _e2m1_pair(c_u, 1)
                    xl = _mx_x(x0_row, col + 1, ok0 & wm)
                    xh = _mx_x(x0_row, col + 5, ok0 & wm)
                    p_g0 = p_g0 + lo_g * xl     # (FFMAs: one a weight)
                    p_g0 = p_g0 + hi_g * xh
                    p_u0 = p_u0 + lo_u * xl     # (FFMAs: one a weight)
                    p_u0 = p_u0 + hi_u * xh
                    xl = _mx_x(x1_row, col + 1, ok1 & wm)
                    xh = _mx_x(x1_row, col + 5, ok1 & wm)
                    p_g1 = p_g1 + lo_g * xl     # (FFMAs: one a weight)
                    p_g1 = p_g1 + hi_g * xh
                    p_u1 = p_u1 + lo_u * xl     # (FFMAs: one a weight)
                    p_u1 = p_u1 + hi_u * xh
                    xl = _mx_x(x2_row, col + 1, ok2 & wm)
                    xh = _mx_x(x2_row, col + 5, ok2 & wm)
                    p_g2 = p_g2 + lo_g * xl     # (FFMAs: one a weight)
                    p_g2 = p_g2 + hi_g * xh
                    p_u2 = p_u2 + lo_u * xl     # (FFMAs: one a weight)
                    p_u2 = p_u2 + hi_u * xh
                    xl = _mx_x(x3_row, col + 1, ok3 & wm)
                    xh = _mx_x(x3_row, col + 5, ok3 & wm)
                    p_g3 = p_g3 + lo_g * xl     # (FFMAs: one a weight)
                    p_g3 = p_g3 + hi_g * xh
                    p_u3 = p_u3 + lo_u * xl     # (FFMAs: one a weight)
                    p_u3 = p_u3 + hi_u * xh
                    lo_g, hi_g = _e2m1_pair(c_g, 2)
                    lo_u, hi_u = _e2m1_pair(c_u, 2)
                    xl = _mx_x(x0_row, col + 2, ok0 & wm)
                    xh = _mx_x(x0_row, col + 6, ok0 & wm)
                    p_g0 = p_g0 + lo_g * xl     # (FFMAs: one a weight)
                    p_g0 = p_g0 + hi_g * xh
                    p_u0 = p_u0 + lo_u * xl     # (FFMAs: one a weight)
                    p_u0 = p_u0 + hi_u * xh
                    xl = _mx_x(x1_row, col + 2, ok1 & wm)
                    xh = _mx_x(x1_row, col + 6, ok1 & wm)
                    p_g1 = p_g1 + lo_g * xl     # (FFMAs: one a weight)
                    p_g1 = p_g1 + hi_g * xh
                    p_u1 = p_u1 + lo_u * xl     # (FFMAs: one a weight)
                    p_u1 = p_u1 + hi_u * xh
                    xl = _mx_x(x2_row, col + 2, ok2 & wm)
                    xh = _mx_x(x2_row, col + 6, ok2 & wm)
                    p_g2 = p_g2 + lo_g * xl     # (FFMAs: one a weight)
                    p_g2 = p_g2 + hi_g * xh
                    p_u2 = p_u2 + lo_u * xl     # (FFMAs: one a weight)
                    p_u2 = p_u2 + hi_u * xh
                    xl = _mx_x(x3_row, col + 2, ok3 & wm)
                    xh = _mx_x(x3_row, col + 6, ok3 & wm)
                    p_g3 = p_g3 + lo_g * xl     # (FFMAs: one a weight)
                    p_g3 = p_g3 + hi_g * xh
                    p_u3 = p_u3 + lo_u * xl     # (FFMAs: one a weight)
                    p_u3 = p_u3 + hi_u * xh
                    lo_g, hi_g = _e2m1_pair(c_g, 3)
                    lo_u, hi_u = _e2m1_pair(c_u, 3)
                    xl = _mx_x(x0_row, col + 3, ok0 & wm)
                    xh = _mx_x(x0_row, col + 7, ok0 & wm)
                    p_g0 = p_g0 + lo_g * xl     # (FFMAs: one a weight)
                    p_g0 = p_g0 + hi_g * xh
                    p_u0 = p_u0 + lo_u * xl     # (FFMAs: one a weight)
                    p_u0 = p_u0 + hi_u * xh
                    xl = _mx_x(x1_row, col + 3, ok1 & wm)
                    xh = _mx_x(x1_row, col + 7, ok1 & wm)
                    p_g1 = p_g1 + lo_g * xl     # (FFMAs: one a weight)
                    p_g1 = p_g1 + hi_g * xh
                    p_u1 = p_u1 + lo_u * xl     # (FFMAs: one a weight)
                    p_u1 = p_u1 + hi_u * xh
                    xl = _mx_x(x2_row, col + 3, ok2 & wm)
                    xh = _mx_x(x2_row, col + 7, ok2 & wm)
                    p_g2 = p_g2 + lo_g * xl     # (FFMAs: one a weight)
                    p_g2 = p_g2 + hi_g * xh
                    p_u2 = p_u2 + lo_u * xl     # (FFMAs: one a weight)
                    p_u2 = p_u2 + hi_u * xh
                    xl = _mx_x(x3_row, col + 3, ok3 & wm)
                    xh = _mx_x(x3_row, col + 7, ok3 & wm)
                    p_g3 = p_g3 + lo_g * xl     # (FFMAs: one a weight)
                    p_g3 = p_g3 + hi_g * xh
                    p_u3 = p_u3 + lo_u * xl     # (FFMAs: one a weight)
                    p_u3 = p_u3 + hi_u * xh
                    sc = _mx_scales(s_g, k0, 90, FMA_BLOCK_K // 32)
                    acc_g0 += tl.sum(p_g0, axis=2, keep_dims=True) * sc
                    acc_g1 += tl.sum(p_g1, axis=2, keep_dims=True) * sc
                    acc_g2 += tl.sum(p_g2, axis=2, keep_dims=True) * sc
                    acc_g3 += tl.sum(p_g3, axis=2, keep_dims=True) * sc
                    sc = _mx_scales(s_u, k0, 90, FMA_BLOCK_K // 32)
                    acc_u0 += tl.sum(p_u0, axis=2, keep_dims=True) * sc
                    acc_u1 += tl.sum(p_u1, axis=2, keep_dims=True) * sc
                    acc_u2 += tl.sum(p_u2, axis=2, keep_dims=True) * sc
                    acc_u3 += tl.sum(p_u3, axis=2, keep_dims=True) * sc
                s_g0 = tl.sum(tl.sum(acc_g0, axis=2), axis=1) * 16384.0     # the decode's 2^-14 back
                s_g1 = tl.sum(tl.sum(acc_g1, axis=2), axis=1) * 16384.0     # the decode's 2^-14 back
                s_g2 = tl.sum(tl.sum(acc_g2, axis=2), axis=1) * 16384.0     # the decode's 2^-14 back
                s_g3 = tl.sum(tl.sum(acc_g3, axis=2), axis=1) * 16384.0     # the decode's 2^-14 back
                s_u0 = tl.sum(tl.sum(acc_u0, axis=2), axis=1) * 16384.0     # the decode's 2^-14 back
                s_u1 = tl.sum(tl.sum(acc_u1, axis=2), axis=1) * 16384.0     # the decode's 2^-14 back
                s_u2 = tl.sum(tl.sum(acc_u2, axis=2), axis=1) * 16384.0     # the decode's 2^-14 back
                s_u3 = tl.sum(tl.sum(acc_u3, axis=2), axis=1) * 16384.0     # the decode's 2^-14 back

                g = tl.zeros([FMA_TP, BLOCK_F], tl.float32)
                v = tl.zeros([FMA_TP, BLOCK_F], tl.float32)
                g = tl.where(rows[:, None] == 0, s_g0[None, :], g)
                v = tl.where(rows[:, None] == 0, s_u0[None, :], v)
                g = tl.where(rows[:, None] == 1, s_g1[None, :], g)
                v = tl.where(rows[:, None] == 1, s_u1[None, :], v)
                g = tl.where(rows[:, None] == 2, s_g2[None, :], g)
                v = tl.where(rows[:, None] == 2, s_u2[None, :], v)
                g = tl.where(rows[:, None] == 3, s_g3[None, :], g)
                v = tl.where(rows[:, None] == 3, s_u3[None, :], v)
            g += b_g[None, :]
            v += b_u[None, :]
            _store_act(act_ptr, ids_ptr, _gated_act(g, v), toks, ok, e, offs_f, F, KT, KTP)
        else:
            # ---- tensor-core path: BLOCK_T tokens at a time, acc[f, t] = W @ X^T ----
            for s in range(0, n, BLOCK_T):
                toks_t, ok_t, _ = _tokens_of(ids_ptr, e, T, s, KT, KTP, TC, BLOCK_T)
                x_rows = x_ptr + toks_t.to(tl.int64)[:, None] * H
                acc_g = tl.zeros([BLOCK_F, BLOCK_T], tl.float32)
                acc_u = tl.zeros([BLOCK_F, BLOCK_T], tl.float32)
                for k0 in range(0, H, BLOCK_K):
                    k = k0 + tl.arange(0, BLOCK_K)[None, :]
                    xt = tl.trans(tl.load(_ptr(x_rows, k), mask=ok_t[:, None] & (k < H), other=0.0).to(tl.bfloat16))
                    # e2m1 codes x e8m0 scales x bf16 on tensor cores (codes past H are zero)
                    acc_g = tl.dot_scaled(_w_raw(g_rows, k0, H, BLOCK_K), _w_e8m0(ws, srow_g, k0, BLOCK_K), "e2m1",
                                          xt, None, "bf16", acc_g)
                    acc_u = tl.dot_scaled(_w_raw(u_rows, k0, H, BLOCK_K), _w_e8m0(ws, srow_u, k0, BLOCK_K), "e2m1",
                                          xt, None, "bf16", acc_u)
                acc_g += b_g[:, None]
                acc_u += b_u[:, None]
                _store_act(act_ptr, ids_ptr, tl.trans(_gated_act(acc_g, acc_u)), toks_t, ok_t, e, offs_f, F, KT, KTP)


META = {
    "entry": "moe_gate_up",
    "params": [["x_ptr", "*bf16", "in:0"], ["ids_ptr", "*i32", "in:1"],
               ["w_ptr", "*u8", "in:2"], ["act_ptr", "*bf16", "out:0"],
               ["T", "i32", "dim:T"], ["b_ptr", "*bf16", "in:5"], ["w_scale_ptr", "*fp32", "in:6"]],
    "constexprs": {"H": 2880, "F": 2880, "KT": 4, "KTP": 4, "BLOCK_E": 32,
                   "BLOCK_F": 32, "FMA_BLOCK_K": 512, "FMA_T": 4,
                   "FMA_TP": 4, "BLOCK_K": 256, "BLOCK_T": 16,
                   "PC": 256, "TC": 32, "DOT_F32": False, "PDL": True},
    "pdl": True,
    "grid": ["min(32, T * 4)", 90, 1],
    "num_warps": 4,
    "num_stages": 4,
    "maxnreg": 168,
}
