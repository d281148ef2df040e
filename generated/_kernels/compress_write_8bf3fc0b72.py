# compress_write (DeepSeek-V4's compressor, compiler/ops/compressed_attention.py; split_compression
#   made it from indexer_topk): the compressor's kv / gate [T, W=256] (overlap: Ca | Cb halves),
#   bias [m=4, W], norm [Dc=128]. A program a token row (grid (T,)):
#   where its position p completes block e = p // m (p % m == m - 1), entry e: per channel, the
#   softmax over the block's rows (and the first halves of the block before: overlap) of gate + bias[q % m], the weighted
#   sum of the kv values, RMSNorm (norm, eps=1e-06), RoPE of its last R=64 dims (interleaved) at
#   position e m, into the compressed paged cache ikv (one row per m tokens, in the page of the
#   block's last token: 4 row(s) a page). The rows of earlier steps come from the slot ikv_buf
#   (8 rows); compress_carry writes this step's there after this launch. Work: 8 x 128 a block, all
#   blocks at once (a 32k prefill: 8192 programs with an entry).
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def compress_write(ckv_ptr, cgate_ptr, cbias_ptr, cnorm_ptr, ent_ptr, buf_ptr,
                   seq_starts, context_lens, slot_mapping, block_tables, max_pages, state_slots, B,
                   D: tl.constexpr, Wd: tl.constexpr, M: tl.constexpr, ROWS: tl.constexpr, PS: tl.constexpr,
                   RPP: tl.constexpr, OVERLAP: tl.constexpr, EPS: tl.constexpr, BLOCK_D: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_HALF: tl.constexpr, HALF: tl.constexpr, PASS: tl.constexpr,
                   BLOCK_B: tl.constexpr, THETA: tl.constexpr, ROT: tl.constexpr, FACTOR: tl.constexpr, OLD_LEN: tl.constexpr, BETA_FAST: tl.constexpr, BETA_SLOW: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
    if PDL:
        gdc_wait()   # earlier kernels' writes are visible from here on
    t = tl.program_id(0)
    b = t * 0
    for c in range(0, B, BLOCK_B):
        bi = c + tl.arange(0, BLOCK_B)
        ends = tl.load(seq_starts + bi + 1, mask=bi < B, other=2147483647)
        b += tl.sum((ends <= t).to(tl.int32), 0)
    if b >= B:                                   # a padding row past the step's sequences
        return
    start = tl.load(seq_starts + b)
    L = tl.load(context_lens + b)
    cached = L - (tl.load(seq_starts + b + 1) - start)
    p = cached + (t - start)
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    if p % M != M - 1:                           # completes no block
        return
    slot = tl.load(state_slots + b).to(tl.int64)
    bt = block_tables + b.to(tl.int64) * max_pages
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
    e = p // M
    rr = tl.arange(0, BLOCK_R)
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
    held = buf_ptr + slot * (ROWS * 2 * Wd) + (tok % ROWS) * (2 * Wd)
    src = (start + tok - cached).to(tl.int64) * Wd
    # channels BLOCK_C at a time (the softmax runs over rows, per channel): an HCA block is 128
    # rows of 512, past the registers as one tile; the RMSNorm needs every channel's value, so a
    # first pass sums the squares and a second recomputes each chunk and stores it normalized
    ss = tl.zeros([BLOCK_C], tl.float32)
    for c0 in range(0, BLOCK_D, BLOCK_C):
        dc = c0 + tl.arange(0, BLOCK_C)
        dcm = dc < D
        cols = col[:, None] + dc[None, :]
        m2 = ok[:, None] & dcm[None, :]
        new = (tok >= cached)[:, None] & m2                      # this step's rows: the input
        old = (tok < cached)[:, None] & m2                       # earlier steps': the slot
        vals = (tl.load(ckv_ptr + src[:, None] + cols, mask=new, other=0.0).to(tl.float32)
                + tl.load(held[:, None] + cols, mask=old, other=0.0))
        gates = (tl.load(cgate_ptr + src[:, None] + cols, mask=new, other=0.0).to(tl.float32)
                 + tl.load(cbias_ptr + (tok % M)[:, None] * Wd + cols, mask=new, other=0.0).to(tl.float32)
                 + tl.load(held[:, None] + Wd + cols, mask=old, other=0.0))
        gates = tl.where(m2, gates, float("-inf"))
        pr = tl.exp(gates - tl.max(gates, axis=0)[None, :])
        pr = tl.where(m2, pr, 0.0)
        ent = tl.where(dcm, tl.sum(pr * vals, axis=0) / tl.sum(pr, axis=0), 0.0)
        ss += ent * ent
    rstd = 1.0 / tl.sqrt(tl.sum(ss, axis=0) / D + EPS)
    page = tl.load(bt + p // PS).to(tl.int64)                   # the page of the block's last token
    erow = (p % PS) // M
    dst = ent_ptr + (page * RPP + erow) * D
    for c0 in range(0, BLOCK_D, BLOCK_C):
        dc = c0 + tl.arange(0, BLOCK_C)
        dcm = dc < D
        cols = col[:, None] + dc[None, :]
        m2 = ok[:, None] & dcm[None, :]
        new = (tok >= cached)[:, None] & m2                      # this step's rows: the input
        old = (tok < cached)[:, None] & m2                       # earlier steps': the slot
        vals = (tl.load(ckv_ptr + src[:, None] + cols, mask=new, other=0.0).to(tl.float32)
                + tl.load(held[:, None] + cols, mask=old, other=0.0))
        gates = (tl.load(cgate_ptr + src[:, None] + cols, mask=new, other=0.0).to(tl.float32)
                 + tl.load(cbias_ptr + (tok % M)[:, None] * Wd + cols, mask=new, other=0.0).to(tl.float32)
                 + tl.load(held[:, None] + Wd + cols, mask=old, other=0.0))
        gates = tl.where(m2, gates, float("-inf"))
        pr = tl.exp(gates - tl.max(gates, axis=0)[None, :])
        pr = tl.where(m2, pr, 0.0)
        ent = tl.where(dcm, tl.sum(pr * vals, axis=0) / tl.sum(pr, axis=0), 0.0)
        ent = ent * rstd * tl.load(cnorm_ptr + dc, mask=dcm, other=0.0).to(tl.float32)
        tl.store(dst + dc, ent.to(ent_ptr.dtype.element_ty), mask=dcm)
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


META = {
    "entry": "compress_write",
    "params": [
        ["ckv_ptr", "*bf16", "in:0"],
        ["cgate_ptr", "*bf16", "in:1"],
        ["cbias_ptr", "*fp32", "in:2"],
        ["cnorm_ptr", "*bf16", "in:3"],
        ["ent_ptr", "*bf16", "cache:ikv"],
        ["buf_ptr", "*fp32", "cache:ikv_buf"],
        ["seq_starts", "*i32", "meta:seq_starts"],
        ["context_lens", "*i32", "meta:context_lens"],
        ["slot_mapping", "*i32", "meta:slot_mapping"],
        ["block_tables", "*i32", "meta:block_tables"],
        ["max_pages", "i32", "meta:max_pages"],
        ["state_slots", "*i32", "meta:state_slots"],
        ["B", "i32", "dim:B"],
    ],
    "constexprs": {"D": 128, "Wd": 256, "M": 4, "ROWS": 8, "PS": 16, "RPP": 4,
                   "OVERLAP": True, "EPS": 1e-06, "BLOCK_D": 128, "BLOCK_R": 8,
                   "BLOCK_C": 128, "BLOCK_HALF": 32, "HALF": 32, "PASS": 64, "BLOCK_B": 64,
                   "THETA": 160000.0, "ROT": 64, "FACTOR": 16.0, "OLD_LEN": 65536.0,
                   "BETA_FAST": 32.0, "BETA_SLOW": 1.0, "PDL": True},
    "pdl": True,
    "grid": ["T", 1, 1],
    "num_warps": 4,
    "num_stages": 1,
}
