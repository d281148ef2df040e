# indexer_topk (DeepSeek-V4's lightning indexer, compiler/ops/compressed_attention.py): q [T, Hi=64, Di=128],
#   w [T, Hi], the indexer's compressor kv / gate [T, 256] (overlapping), bias [m=4, 256], norm [Di]
#   -> idx [T, K=512] i32. One program a sequence (grid (B,)): first its rows through the compressor
#   (triton/_compress.j2: the slot's blocks, each completed block's key into cache ikv), then for
#   each query at p over the entries e < (p + 1) // m:
#     score_e = sum_h (w[h] / sqrt(Hi)) relu(q[h] . K_e) / sqrt(Di)
#   and the K best by (score descending, index ascending), found in K passes over the entries (pass k
#   takes the best after pass k - 1's in that order); -1 once none is left. Naive: K passes of all the
#   visible keys a query (a correctness kernel, not the production indexer).
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def indexer_topk(q_ptr, w_ptr, ckv_ptr, cgate_ptr, cbias_ptr, cnorm_ptr, o_ptr, ent_ptr, buf_ptr,
                 seq_starts, context_lens, block_tables, max_pages, state_slots,
                 HI: tl.constexpr, D: tl.constexpr, Wd: tl.constexpr, M: tl.constexpr, ROWS: tl.constexpr,
                 PS: tl.constexpr, RPP: tl.constexpr, OVERLAP: tl.constexpr, K: tl.constexpr, EPS: tl.constexpr,
                 BLOCK_D: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_HALF: tl.constexpr, HALF: tl.constexpr, PASS: tl.constexpr,
                 THETA: tl.constexpr, ROT: tl.constexpr, FACTOR: tl.constexpr, OLD_LEN: tl.constexpr, BETA_FAST: tl.constexpr, BETA_SLOW: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
    if PDL:
        gdc_wait()   # earlier kernels' writes are visible from here on
    b = tl.program_id(0)
    start = tl.load(seq_starts + b)
    n = tl.load(seq_starts + b + 1) - start
    L = tl.load(context_lens + b)
    cached = L - n
    slot = tl.load(state_slots + b).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    bt = block_tables + b.to(tl.int64) * max_pages

    # 2. the compressor: rows into the slot's blocks, each completed block's entry
    w = tl.arange(0, BLOCK_W)
    wm = w < Wd
    rr = tl.arange(0, BLOCK_R)                 # (not r: the rope macro's angle is r)
    buf = buf_ptr + slot * (ROWS * 2 * Wd)
    j = tl.arange(0, BLOCK_HALF)
    # inv_freq in fp64 (as the reference computes it), rounded to fp32; once per program
    log2_theta = tl.log2(tl.full([], THETA, tl.float64))
    freq = tl.exp2(j.to(tl.float64) * (log2_theta * tl.full([], -2.0 / ROT, tl.float64)))
    # HF's yarn: correction dims d(b) = R ln(old_len / (2 pi b)) / (2 ln theta) for b = beta_fast,
    # beta_slow floored / ceiled, clamped to [0, R - 1]; ramp_j = clamp((j - lo) / (hi - lo), 0, 1);
    # inv_freq_j = inv_freq_j / factor * ramp_j + inv_freq_j * (1 - ramp_j)
    two_ln_theta = 2.0 * tl.log(tl.full([], THETA, tl.float64))
    lo = ROT * tl.log(tl.full([], OLD_LEN / (BETA_FAST * 6.283185307179586), tl.float64)) / two_ln_theta
    hi = ROT * tl.log(tl.full([], OLD_LEN / (BETA_SLOW * 6.283185307179586), tl.float64)) / two_ln_theta
    lo = tl.floor(lo)
    hi = tl.ceil(hi)
    lo = tl.maximum(lo, 0.0)
    hi = tl.minimum(hi, ROT - 1.0)
    hi = tl.where(lo == hi, hi + 0.001, hi)                      # HF's zero-width guard
    ramp = tl.minimum(tl.maximum((j.to(tl.float64) - lo) / (hi - lo), 0.0), 1.0)
    freq = (freq / FACTOR) * ramp + freq * (1.0 - ramp)
    # attention_factor (multiplies cos and sin):
    att = 1.0                      # given
    freq = freq.to(tl.float32)
    for i in range(n):
        p = cached + i
        t = (start + i).to(tl.int64)
        kvr = tl.load(ckv_ptr + t * Wd + w, mask=wm, other=0.0).to(tl.float32)
        gr = tl.load(cgate_ptr + t * Wd + w, mask=wm, other=0.0).to(tl.float32)
        gr += tl.load(cbias_ptr + (p % M) * Wd + w, mask=wm, other=0.0).to(tl.float32)
        tl.store(buf + (p % ROWS) * (2 * Wd) + w, kvr, mask=wm)
        tl.store(buf + (p % ROWS) * (2 * Wd) + Wd + w, gr, mask=wm)
        tl.debug_barrier()
        if p % M == M - 1:
            e = p // M
            if OVERLAP:
                # rows 0..M-1: block e - 1's first halves (none for e = 0); rows M..2M-1: block e's second halves
                prev = rr < M
                tok = tl.where(prev, (e - 1) * M + rr, e * M + rr - M)
                ok = (rr < 2 * M) & (tok >= 0)            # block -1 (e = 0): no rows
                col = (1 - prev.to(tl.int32)) * D
            else:
                tok = e * M + rr
                ok = rr < M
                col = tl.zeros([BLOCK_R], tl.int32)
            at = buf + ((tok % ROWS) * (2 * Wd) + col)[:, None] + d[None, :]
            m2 = ok[:, None] & dm[None, :]
            vals = tl.load(at, mask=m2, other=0.0)
            gates = tl.load(at + Wd, mask=m2, other=float("-inf"))
            mx = tl.max(gates, axis=0)
            pr = tl.exp(gates - mx[None, :])
            pr = tl.where(m2, pr, 0.0)
            ent = tl.sum(pr * vals, axis=0) / tl.sum(pr, axis=0)
            ent = tl.where(dm, ent, 0.0)
            ent = ent / tl.sqrt(tl.sum(ent * ent, axis=0) / D + EPS)
            ent = ent * tl.load(cnorm_ptr + d, mask=dm, other=0.0).to(tl.float32)
            last = e * M + M - 1
            page = tl.load(bt + last // PS).to(tl.int64)
            erow = (last % PS) // M
            dst = ent_ptr + (page * RPP + erow) * D
            tl.store(dst + d, ent.to(ent_ptr.dtype.element_ty), mask=dm)
            tl.debug_barrier()
            # RoPE of the last R dims at the block's first position (the pairs re-read from the entry)
            pos = (e * M).to(tl.float32)
            hm = j < HALF
            x1 = tl.load(dst + PASS + 2 * j, mask=hm, other=0.0).to(tl.float32)
            x2 = tl.load(dst + PASS + 2 * j + 1, mask=hm, other=0.0).to(tl.float32)
            ang = pos * freq
            # reduce mod 2 pi: C1 + C2 = 2 pi to ~1e-15; k * C1 is exact in the fma
            k2pi = tl.floor(ang * 0.15915493667125702 + 0.5)
            r = tl.fma(k2pi, -6.2831854820251465, ang)
            r = tl.fma(k2pi, 1.7484555314695172e-07, r)
            cos = (tl.cos(r) * att)[None, :]
            sin = (tl.sin(r) * att)[None, :]

            tl.debug_barrier()
            tl.store(dst + PASS + 2 * j[None, :], (x1[None, :] * cos - x2[None, :] * sin).to(ent_ptr.dtype.element_ty), mask=hm[None, :])
            tl.store(dst + PASS + 2 * j[None, :] + 1, (x2[None, :] * cos + x1[None, :] * sin).to(ent_ptr.dtype.element_ty), mask=hm[None, :])
            tl.debug_barrier()
    hh = tl.arange(0, BLOCK_H)
    hmask = hh < HI
    qm = hmask[:, None] & dm[None, :]
    kn = tl.arange(0, BLOCK_N)
    one = tl.arange(0, 1)
    for i in range(n):
        p = cached + i
        t = (start + i).to(tl.int64)
        q = tl.load(q_ptr + t * (HI * D) + hh[:, None] * D + d[None, :], mask=qm, other=0.0).to(tl.float32)
        wt = tl.load(w_ptr + t * HI + hh, mask=hmask, other=0.0).to(tl.float32) * (HI ** -0.5)
        nvis = (p + 1) // M
        prev_s = tl.full([1], float("inf"), tl.float32)
        prev_i = tl.full([1], -1, tl.int32)
        for k in range(K):
            best_s = tl.full([1], float("-inf"), tl.float32)
            best_i = tl.full([1], -1, tl.int32)
            for e0 in range(0, nvis, BLOCK_N):
                e = e0 + kn
                em = e < nvis
                last = e.to(tl.int64) * M + M - 1
                page = tl.load(bt + last // PS, mask=em, other=0).to(tl.int64)
                erow = (last % PS) // M
                kk = tl.load(ent_ptr + ((page * RPP + erow) * D)[:, None] + d[None, :],
                             mask=em[:, None] & dm[None, :], other=0.0).to(tl.float32)
                s = tl.maximum(tl.sum(q[:, None, :] * kk[None, :, :], axis=2), 0.0) * (D ** -0.5)
                sc = tl.sum(s * wt[:, None], axis=0)                                    # [BLOCK_N]
                ok = em & ((sc < prev_s) | ((sc == prev_s) & (e > prev_i)))
                sc = tl.where(ok, sc, float("-inf"))
                blk_s = tl.max(sc, axis=0)
                blk_i = tl.min(tl.where(ok & (sc == blk_s), e, 2147483647), axis=0)
                take = (blk_i < 2147483647) & ((blk_s > best_s) | ((blk_s == best_s) & (blk_i < best_i)))
                best_s = tl.where(take, blk_s, best_s)
                best_i = tl.where(take, blk_i, best_i)
            tl.store(o_ptr + t * K + k + one, best_i)
            prev_s = best_s
            prev_i = best_i


META = {
    "entry": "indexer_topk",
    "params": [
        ["q_ptr", "*bf16", "in:0"],
        ["w_ptr", "*bf16", "in:1"],
        ["ckv_ptr", "*bf16", "in:2"],
        ["cgate_ptr", "*bf16", "in:3"],
        ["cbias_ptr", "*fp32", "in:4"],
        ["cnorm_ptr", "*bf16", "in:5"],
        ["o_ptr", "*i32", "out:0"],
        ["ent_ptr", "*bf16", "cache:ikv"],
        ["buf_ptr", "*fp32", "cache:ikv_buf"],
        ["seq_starts", "*i32", "meta:seq_starts"],
        ["context_lens", "*i32", "meta:context_lens"],
        ["block_tables", "*i32", "meta:block_tables"],
        ["max_pages", "i32", "meta:max_pages"],
        ["state_slots", "*i32", "meta:state_slots"],
    ],
    "constexprs": {"HI": 64, "D": 128, "Wd": 256, "M": 4, "ROWS": 8, "PS": 16,
                   "RPP": 4, "OVERLAP": True, "K": 512, "EPS": 1e-06,
                   "BLOCK_D": 128, "BLOCK_W": 256, "BLOCK_H": 64, "BLOCK_R": 8,
                   "BLOCK_N": 16, "BLOCK_HALF": 32, "HALF": 32, "PASS": 64,
                   "THETA": 160000.0, "ROT": 64, "FACTOR": 16.0, "OLD_LEN": 65536.0,
                   "BETA_FAST": 32.0, "BETA_SLOW": 1.0, "PDL": True},
    "pdl": True,
    "grid": ["B", 1, 1],
    "num_warps": 4,
    "num_stages": 1,
}
