# moe_down: y[t, h] = bf16(sum_j r[t, j] * sum_f act[t, j, f] * w[e, h, f]),  e = ids[t, j]
#   act [T, 4, 2880] bf16, r f32 [T, 4], ids i32 [T, 4], w [128, 2880, 2880] bf16,
#   y [T, 2880] bf16; fp32 sums, one rounding.
#
# Decode: grid (min(128, T * 4) distinct-expert slots, 90 blocks of BLOCK_H = 32 output
# rows): program (u, b) takes the u-th smallest chosen expert e and the tokens that chose it, and
# streams e's row block once for all of them (moe_gate_up.py.j2's two paths: CUDA cores for at
# most FMA_T = 4 tokens, else swap-AB tensor-core tiles of BLOCK_T tokens); the A operand
# of token t is act[t, j] for the slot j that chose e (of largest weight if several did: the
# others weigh 0: ids not made by moe_route). Slots of id -1 name no expert.
# Combine, deterministic: each program parks r[t, j] * (its sums) in an fp32 scratch [B, 4, 2880]
# for every slot j of t that chose e and counts itself in at the tile (t, b); the program that
# completes the token's distinct experts adds the token's 4 partials in slot order and writes
# y[t] (the same bits whatever order the experts finish in), leaving the counter zero.
# Quantized experts: e2m1 codes, scales per 1 rows x 32 columns (259200 an
#   expert, expert e's from e * 259200 on); act rows quantized none.
#   OCP MXFP4 (e2m1 codes, a power-of-two scale per row and 32 columns, stored as the float 2^(b - 127)):
#   at most FMA_T = 4 tokens the CUDA-core path decodes int32 words of codes by bit
#   placement (triton/_mx_fma.j2) and scales a group's sums once; past it the tensor-core path
#   hands a [BLOCK_H, BLOCK_K / 2] tile of packed codes and its [BLOCK_H, BLOCK_K / 32] e8m0 scale bytes to tl.dot_scaled with act^T in bf16:
#   acc[h, t] += sum_f value(code[h, f]) * 2^(b[h, f // 32] - 127) * act[t, j, f]   (the value of W
#   exactly, fp32 sums).
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
def _main_slot(ids_ptr, rw_ptr, toks, ok, e, KT: tl.constexpr):
    """For each token t that chose expert e, the slot j whose act row the down projection reads:
    the one of largest routing weight among the slots naming e (the first on ties). A token names
    an expert in several slots only where its ids were not moe_route's; the extra slots weigh 0
    and add nothing whichever row they are given."""
    best = tl.zeros_like(toks)
    best_r = tl.full(toks.shape, -1.0, tl.float32)
    for jj in tl.static_range(KT):
        t_j = toks.to(tl.int64) * KT + jj
        ej = tl.load(ids_ptr + t_j, mask=ok, other=-1)
        rj = tl.load(rw_ptr + t_j, mask=ok, other=0.0)
        better = (ej == e) & (rj > best_r)
        best = tl.where(better, jj, best)
        best_r = tl.where(better, rj, best_r)
    return best


@triton.jit
def _down_finish(acc, toks, ok, e, offs_h, nb, ids_ptr, rw_ptr, y_ptr, part_ptr, cnt_ptr,
                 H: tl.constexpr, KT: tl.constexpr, KTP: tl.constexpr, NB: tl.constexpr,
                 PDT: tl.constexpr):
    """acc [NT, BH] fp32: expert e's down projection of tokens toks (where ok), columns offs_h
    (column block nb). Parks r[t, j] * acc as the partial sum of every slot j of t that chose e
    (PDT: fp32 or bf16 scratch [T, KT, H]), then counts the expert in at the token's tile (t, nb);
    the program that brings the count to the token's number of distinct experts sums the token's
    KT partials in slot order j = 0 .. KT-1 (a fixed order: the same bits whatever order the
    experts arrive in; slots of id -1 have none), writes y[t] and leaves the counter zero."""
    j = tl.arange(0, KTP)
    t64 = toks.to(tl.int64)
    h_mask = offs_h < H
    pp = part_ptr.to(tl.pointer_type(PDT), bitcast=True)
    idt, mine, first, again = _mine(ids_ptr, toks, ok, e, KT, KTP)
    r = tl.load(rw_ptr + t64 * KT + first, mask=ok, other=0.0)
    tl.store(pp + (t64 * KT + first)[:, None] * H + offs_h[None, :], (acc * r[:, None]).to(PDT),
             mask=ok[:, None] & h_mask[None, :])
    if again:                # a token naming e in more slots: the same sums, their own weights
        for jj in tl.static_range(1, KT):
            ej = tl.sum(tl.where(j[None, :] == jj, idt, 0), 1)
            more = ok & (ej == e) & (first < jj)
            r = tl.load(rw_ptr + t64 * KT + jj, mask=more, other=0.0)
            tl.store(pp + (t64 * KT + jj)[:, None] * H + offs_h[None, :], (acc * r[:, None]).to(PDT),
                     mask=more[:, None] & h_mask[None, :])
    # the token's distinct experts: slots that no earlier slot of the token repeats
    experts = tl.zeros_like(toks)
    for jj in tl.static_range(KT):
        ej = tl.sum(tl.where(j[None, :] == jj, idt, 0), 1)
        seen = tl.max(((j[None, :] < jj) & (idt == ej[:, None])).to(tl.int32), 1)
        experts += (ok & (seen == 0) & (ej >= 0)).to(tl.int32)
    tl.debug_barrier()   # every thread's partials are issued before the release below
    arrived = tl.atomic_add(cnt_ptr + t64 * NB + nb, 1, mask=ok, sem="acq_rel")
    last = ok & (arrived == experts - 1)
    tl.debug_barrier()   # the whole program reads after the acquire above
    total = tl.zeros_like(acc)
    for jj in range(KT):     # a loop, not unrolled: one slot's tile in registers at a time
        # a slot of id -1 (no expert on this rank) has no partial: its scratch is stale
        named = last & (tl.load(ids_ptr + t64 * KT + jj, mask=last, other=-1) >= 0)
        got = tl.load(pp + (t64 * KT + jj)[:, None] * H + offs_h[None, :],
                      mask=named[:, None] & h_mask[None, :], other=0.0, cache_modifier=".cg")
        total += got.to(tl.float32)
    tl.store(y_ptr + t64[:, None] * H + offs_h[None, :], total.to(y_ptr.dtype.element_ty),
             mask=last[:, None] & h_mask[None, :])
    tl.store(cnt_ptr + t64 * NB + nb, 0, mask=last)


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
def moe_down(act_ptr, rw_ptr, ids_ptr, w_ptr, y_ptr, T, part_ptr, cnt_ptr, b_ptr, w_scale_ptr,
             H: tl.constexpr, F: tl.constexpr, KT: tl.constexpr, KTP: tl.constexpr,
             BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, FMA_BLOCK_K: tl.constexpr,
             FMA_T: tl.constexpr, FMA_TP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr,
             PC: tl.constexpr, TC: tl.constexpr, NB: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
    if PDL:
        gdc_wait()   # earlier kernels' writes are visible from here on
    u = tl.program_id(0)
    nb = tl.program_id(1)
    e, slots = _expert_of(ids_ptr, u, T * KT, BLOCK_E, PC)
    if slots > 0:
        offs_h = nb * BLOCK_H + tl.arange(0, BLOCK_H)
        # rows past H are clamped for loading (unmasked, vectorized); their sums are dropped
        h_rows = tl.minimum(offs_h, H - 1).to(tl.int64)[:, None]
        w_rows = w_ptr + e.to(tl.int64) * 4147200 + h_rows * 1440
        srow = h_rows // 1
        ws = w_scale_ptr + e.to(tl.int64) * 259200   # expert e's scales

        # expert e's bias row, added to its output before the routing weight
        b_h = tl.load(b_ptr + e.to(tl.int64) * H + offs_h, mask=offs_h < H, other=0.0).to(tl.float32)
        toks, ok, n = _tokens_of(ids_ptr, e, T, 0, KT, KTP, TC, FMA_TP)
        if n <= FMA_T:
            # ---- CUDA-core path: tokens r < n, one W tile per step ----
            rows = tl.arange(0, FMA_TP)
            a_off = (toks.to(tl.int64) * KT + _main_slot(ids_ptr, rw_ptr, toks, ok, e, KT)) * F
            ok0 = tl.sum(tl.where((rows == 0) & ok, 1, 0), 0, keep_dims=True) > 0   # [1]
            a0_row = act_ptr + tl.sum(tl.where(rows == 0, a_off, 0), 0)
            ok1 = tl.sum(tl.where((rows == 1) & ok, 1, 0), 0, keep_dims=True) > 0   # [1]
            a1_row = act_ptr + tl.sum(tl.where(rows == 1, a_off, 0), 0)
            ok2 = tl.sum(tl.where((rows == 2) & ok, 1, 0), 0, keep_dims=True) > 0   # [1]
            a2_row = act_ptr + tl.sum(tl.where(rows == 2, a_off, 0), 0)
            ok3 = tl.sum(tl.where((rows == 3) & ok, 1, 0), 0, keep_dims=True) > 0   # [1]
            a3_row = act_ptr + tl.sum(tl.where(rows == 3, a_off, 0), 0)
            # MXFP4 words decoded in registers, a group's scale once (triton/_mx_fma.j2); one token
            # (batch 1) takes a loop of its own: the FMA_T-token loop computes every slot
            if n == 1:
                q4 = tl.arange(0, 4)
                g4 = 4 * tl.arange(0, FMA_BLOCK_K // 32)
                w_h = w_rows.to(tl.pointer_type(tl.int32), bitcast=True)[:, :, None]   # a row's 360 words
                s_h = (ws + srow * 90)[:, :, None]
                acc_h0 = tl.zeros([w_rows.shape[0], FMA_BLOCK_K // 32, 1], tl.float32)
                for k0 in range(0, 2880, FMA_BLOCK_K):
                    wi = k0 // 8 + g4[:, None] + q4[None, :]            # [G, 4]: the tile's words
                    wm = wi < 360
                    col = 8 * wi                                        # the first column of each word
                    c_h = _mx_words(w_h, wi, wm)
                    lo_h, hi_h = _e2m1_pair(c_h, 0)
                    xl = _mx_x(a0_row, col + 0, ok0 & wm)
                    xh = _mx_x(a0_row, col + 4, ok0 & wm)
                    p_h0 = lo_h * xl     # (FFMAs: one a weight)
                    p_h0 = p_h0 + hi_h * xh
                    lo_h, hi_h = _e2m1_pair(c_h, 1)
                    xl = _mx_x(a0_row, col + 1, ok0 & wm)
                    xh = _mx_x(a0_row, col + 5, ok0 & wm)
                    p_h0 = p_h0 + lo_h * xl     # (FFMAs: one a weight)
                    p_h0 = p_h0 + hi_h * xh
                    lo_h, hi_h = _e2m1_pair(c_h, 2)
                    xl = _mx_x(a0_row, col + 2, ok0 & wm)
                    xh = _mx_x(a0_row, col + 6, ok0 & wm)
                    p_h0 = p_h0 + lo_h * xl     # (FFMAs: one a weight)
                    p_h0 = p_h0 + hi_h * xh
                    lo_h, hi_h = _e2m1_pair(c_h, 3)
                    xl = _mx_x(a0_row, col + 3, ok0 & wm)
                    xh = _mx_x(a0_row, col + 7, ok0 & wm)
                    p_h0 = p_h0 + lo_h * xl     # (FFMAs: one a weight)
                    p_h0 = p_h0 + hi_h * xh
                    sc = _mx_scales(s_h, k0, 90, FMA_BLOCK_K // 32)
                    acc_h0 += tl.sum(p_h0, axis=2, keep_dims=True) * sc
                s_h0 = tl.sum(tl.sum(acc_h0, axis=2), axis=1) * 16384.0     # the decode's 2^-14 back

                out = tl.zeros([FMA_TP, BLOCK_H], tl.float32)
                out = tl.where(rows[:, None] == 0, s_h0[None, :], out)
            else:
                q4 = tl.arange(0, 4)
                g4 = 4 * tl.arange(0, FMA_BLOCK_K // 32)
                w_h = w_rows.to(tl.pointer_type(tl.int32), bitcast=True)[:, :, None]   # a row's 360 words
                s_h = (ws + srow * 90)[:, :, None]
                acc_h0 = tl.zeros([w_rows.shape[0], FMA_BLOCK_K // 32, 1], tl.float32)
                acc_h1 = tl.zeros([w_rows.shape[0], FMA_BLOCK_K // 32, 1], tl.float32)
                acc_h2 = tl.zeros([w_rows.shape[0], FMA_BLOCK_K // 32, 1], tl.float32)
                acc_h3 = tl.zeros([w_rows.shape[0], FMA_BLOCK_K // 32, 1], tl.float32)
                for k0 in range(0, 2880, FMA_BLOCK_K):
                    wi = k0 // 8 + g4[:, None] + q4[None, :]            # [G, 4]: the tile's words
                    wm = wi < 360
                    col = 8 * wi                                        # the first column of each word
                    c_h = _mx_words(w_h, wi, wm)
                    lo_h, hi_h = _e2m1_pair(c_h, 0)
                    xl = _mx_x(a0_row, col + 0, ok0 & wm)
                    xh = _mx_x(a0_row, col + 4, ok0 & wm)
                    p_h0 = lo_h * xl     # (FFMAs: one a weight)
                    p_h0 = p_h0 + hi_h * xh
                    xl = _mx_x(a1_row, col + 0, ok1 & wm)
                    xh = _mx_x(a1_row, col + 4, ok1 & wm)
                    p_h1 = lo_h * xl     # (FFMAs: one a weight)
                    p_h1 = p_h1 + hi_h * xh
                    xl = _mx_x(a2_row, col + 0, ok2 & wm)
                    xh = _mx_x(a2_row, col + 4, ok2 & wm)
                    p_h2 = lo_h * xl     # (FFMAs: one a weight)
                    p_h2 = p_h2 + hi_h * xh
                    xl = _mx_x(a3_row, col + 0, ok3 & wm)
                    xh = _mx_x(a3_row, col + 4, ok3 & wm)
                    p_h3 = lo_h * xl     # (FFMAs: one a weight)
                    p_h3 = p_h3 + hi_h * xh
                    lo_h, hi_h = _e2m1_pair(c_h, 1)
                    xl = _mx_x(a0_row, col + 1, ok0 & wm)
                    xh = _mx_x(a0_row, col + 5, ok0 & wm)
                    p_h0 = p_h0 + lo_h * xl     # (FFMAs: one a weight)
                    p_h0 = p_h0 + hi_h * xh
                    xl = _mx_x(a1_row, col + 1, ok1 & wm)
                    xh = _mx_x(a1_row, col + 5, ok1 & wm)
                    p_h1 = p_h1 + lo_h * xl     # (FFMAs: one a weight)
                    p_h1 = p_h1 + hi_h * xh
                    xl = _mx_x(a2_row, col + 1, ok2 & wm)
                    xh = _mx_x(a2_row, col + 5, ok2 & wm)
                    p_h2 = p_h2 + lo_h * xl     # (FFMAs: one a weight)
                    p_h2 = p_h2 + hi_h * xh
                    xl = _mx_x(a3_row, col + 1, ok3 & wm)
                    xh = _mx_x(a3_row, col + 5, ok3 & wm)
                    p_h3 = p_h3 + lo_h * xl     # (FFMAs: one a weight)
                    p_h3 = p_h3 + hi_h * xh
                    lo_h, hi_h = _e2m1_pair(c_h, 2)
                    xl = _mx_x(a0_row, col + 2, ok0 & wm)
                    xh = _mx_x(a0_row, col + 6, ok0 & wm)
                    p_h0 = p_h0 + lo_h * xl     # (FFMAs: one a weight)
                    p_h0 = p_h0 + hi_h * xh
                    xl = _mx_x(a1_row, col + 2, ok1 & wm)
                    xh = _mx_x(a1_row, col + 6, ok1 & wm)
                    p_h1 = p_h1 + lo_h * xl     # (FFMAs: one a weight)
                    p_h1 = p_h1 + hi_h * xh
                    xl = _mx_x(a2_row, col + 2, ok2 & wm)
                    xh = _mx_x(a2_row, col + 6, ok2 & wm)
                    p_h2 = p_h2 + lo_h * xl     # (FFMAs: one a weight)
                    p_h2 = p_h2 + hi_h * xh
                    xl = _mx_x(a3_row, col + 2, ok3 & wm)
                    xh = _mx_x(a3_row, col + 6, ok3 & wm)
                    p_h3 = p_h3 + lo_h * xl     # (FFMAs: one a weight)
                    p_h3 = p_h3 + hi_h * xh
                    lo_h, hi_h = _e2m1_pair(c_h, 3)
                    xl = _mx_x(a0_row, col + 3, ok0 & wm)
                    xh = _mx_x(a0_row, col + 7, ok0 & wm)
                    p_h0 = p_h0 + lo_h * xl     # (FFMAs: one a weight)
                    p_h0 = p_h0 + hi_h * xh
                    xl = _mx_x(a1_row, col + 3, ok1 & wm)
                    xh = _mx_x(a1_row, col + 7, ok1 & wm)
                    p_h1 = p_h1 + lo_h * xl     # (FFMAs: one a weight)
                    p_h1 = p_h1 + hi_h * xh
                    xl = _mx_x(a2_row, col + 3, ok2 & wm)
                    xh = _mx_x(a2_row, col + 7, ok2 & wm)
                    p_h2 = p_h2 + lo_h * xl     # (FFMAs: one a weight)
                    p_h2 = p_h2 + hi_h * xh
                    xl = _mx_x(a3_row, col + 3, ok3 & wm)
                    xh = _mx_x(a3_row, col + 7, ok3 & wm)
                    p_h3 = p_h3 + lo_h * xl     # (FFMAs: one a weight)
                    p_h3 = p_h3 + hi_h * xh
                    sc = _mx_scales(s_h, k0, 90, FMA_BLOCK_K // 32)
                    acc_h0 += tl.sum(p_h0, axis=2, keep_dims=True) * sc
                    acc_h1 += tl.sum(p_h1, axis=2, keep_dims=True) * sc
                    acc_h2 += tl.sum(p_h2, axis=2, keep_dims=True) * sc
                    acc_h3 += tl.sum(p_h3, axis=2, keep_dims=True) * sc
                s_h0 = tl.sum(tl.sum(acc_h0, axis=2), axis=1) * 16384.0     # the decode's 2^-14 back
                s_h1 = tl.sum(tl.sum(acc_h1, axis=2), axis=1) * 16384.0     # the decode's 2^-14 back
                s_h2 = tl.sum(tl.sum(acc_h2, axis=2), axis=1) * 16384.0     # the decode's 2^-14 back
                s_h3 = tl.sum(tl.sum(acc_h3, axis=2), axis=1) * 16384.0     # the decode's 2^-14 back

                out = tl.zeros([FMA_TP, BLOCK_H], tl.float32)
                out = tl.where(rows[:, None] == 0, s_h0[None, :], out)
                out = tl.where(rows[:, None] == 1, s_h1[None, :], out)
                out = tl.where(rows[:, None] == 2, s_h2[None, :], out)
                out = tl.where(rows[:, None] == 3, s_h3[None, :], out)
            out += b_h[None, :]
            _down_finish(out, toks, ok, e, offs_h, nb, ids_ptr, rw_ptr, y_ptr, part_ptr, cnt_ptr,
                         H, KT, KTP, NB, tl.float32)
        else:
            # ---- tensor-core path: BLOCK_T tokens at a time, acc[h, t] = W @ A^T ----
            for s in range(0, n, BLOCK_T):
                toks_t, ok_t, _ = _tokens_of(ids_ptr, e, T, s, KT, KTP, TC, BLOCK_T)
                a_rows = act_ptr + ((toks_t.to(tl.int64) * KT + _main_slot(ids_ptr, rw_ptr, toks_t, ok_t, e, KT)) * F)[:, None]
                acc = tl.zeros([BLOCK_H, BLOCK_T], tl.float32)
                for k0 in range(0, F, BLOCK_K):
                    k = k0 + tl.arange(0, BLOCK_K)[None, :]
                    # e2m1 codes x e8m0 scales x bf16 on tensor cores (codes past F are zero)
                    a = tl.load(_ptr(a_rows, k), mask=ok_t[:, None] & (k < F), other=0.0)
                    acc = tl.dot_scaled(_w_raw(w_rows, k0, F, BLOCK_K), _w_e8m0(ws, srow, k0, BLOCK_K), "e2m1",
                                        tl.trans(a.to(tl.bfloat16)), None, "bf16", acc)
                acc += b_h[:, None]
                _down_finish(tl.trans(acc), toks_t, ok_t, e, offs_h, nb, ids_ptr, rw_ptr, y_ptr, part_ptr,
                             cnt_ptr, H, KT, KTP, NB, tl.float32)


META = {
    "entry": "moe_down",
    "params": [["act_ptr", "*bf16", "in:0"], ["rw_ptr", "*fp32", "in:1"],
               ["ids_ptr", "*i32", "in:2"], ["w_ptr", "*u8", "in:3"],
               ["y_ptr", "*bf16", "out:0"], ["T", "i32", "dim:T"],
               ["part_ptr", "*fp32", "scratch:partials"], ["cnt_ptr", "*i32", "scratch:counters"], ["b_ptr", "*bf16", "in:6"], ["w_scale_ptr", "*fp32", "in:7"]],
    "constexprs": {"H": 2880, "F": 2880, "KT": 4, "KTP": 4, "BLOCK_E": 128,
                   "BLOCK_H": 32, "FMA_BLOCK_K": 512, "FMA_T": 4,
                   "FMA_TP": 4, "BLOCK_K": 256, "BLOCK_T": 16,
                   "PC": 256, "TC": 32, "NB": 90, "DOT_F32": False, "PDL": True},
    "pdl": True,
    "grid": ["min(128, T * 4)", 90, 1],
    "scratch": {"partials": "B * 46080", "counters": "B * 360"},
    "num_warps": 4,
    "num_stages": 4,
    "maxnreg": 168,
}
