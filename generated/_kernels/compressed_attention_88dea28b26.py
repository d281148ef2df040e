# compressed_attention (DeepSeek-V4, compiler/ops/compressed_attention.py, whose docstring is the math;
#   split_compression made it, after compress_write wrote the window's rows into swa and the entries into
#   csa): q [T, H=64, D=512] (shared-KV MQA: one K = V head), sinks [H] f32, index [T, K=512] i32.
# A program a query token and BLOCK_H=16 of its heads (grid (T, 4)): the heads share every key, so
#   q [BLOCK_H, D] x keys^T [D, BLOCK_N=32] and p [BLOCK_H, BLOCK_N] x keys [BLOCK_N, D] are tensor-core
#   MMAs. Its sequence b is the number of sequences ending at or before its row, its position
#   p = context_lens[b] - (seq_starts[b + 1] - t). One softmax, online over key blocks, with the head's
#   sink logit (no value) over the window keys p - 128 < j <= p (paged cache swa) and the compressed
#   entries (those index[t] names (>= 0); one row per m=4 tokens, in the page of the block's
#   last token), scores q . k * 0.04419417382415922, fp32 accumulation.
# Why head blocks and not all H in one program: the accumulator is [heads, D] fp32, 128 KiB at
#   DeepSeek-V4-Flash's 64 x 512, past one program's registers; at 16 heads it is 32 KiB, and the
#   H / 16 programs of a token re-read the same keys from L2.
# Split-KV is not needed: a query reads at most window + K keys (CSA: 128 + 512) or window + L / 128
#   (HCA: 1152 at 128k, 1.2 MB of bf16 keys a program, ~10 us on one SM), and a batch-1 decode step
#   already runs H / BLOCK_H programs a layer; at 128k HCA's ~10 us a layer is ~5 % of a 43-layer
#   step's weight stream (bench/NOTES.md, issue 47).
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def compressed_attention(q_ptr, sink_ptr, idx_ptr, o_ptr, swa_ptr, ent_ptr, seq_starts,
                         context_lens, block_tables, max_pages, B,
                         H: tl.constexpr, D: tl.constexpr, M: tl.constexpr, PS: tl.constexpr, RPP: tl.constexpr,
                         HAS_INDEX: tl.constexpr, KIDX: tl.constexpr, WINDOW: tl.constexpr, SCALE: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr,
                         DOT_F32: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
    if PDL:
        gdc_wait()   # earlier kernels' writes are visible from here on
    t = tl.program_id(0)
    h0 = tl.program_id(1) * BLOCK_H
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
    t64 = t.to(tl.int64)
    bt = block_tables + b.to(tl.int64) * max_pages

    d = tl.arange(0, BLOCK_D)
    dm = d < D
    hh = h0 + tl.arange(0, BLOCK_H)
    hmask = hh < H
    qm = hmask[:, None] & dm[None, :]
    q = tl.load(q_ptr + t64 * (H * D) + hh[:, None] * D + d[None, :], mask=qm, other=0.0)
    if DOT_F32:                                  # (the interpreter's bf16 dot is wrong: tests/kernels/harness.py)
        q = q.to(tl.float32)
    m_i = tl.load(sink_ptr + hh, mask=hmask, other=0.0).to(tl.float32)     # the sink: e^sink in the denominator
    l_i = tl.zeros([BLOCK_H], tl.float32) + 1.0
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    kn = tl.arange(0, BLOCK_N)

    # the window keys, then the compressed entries: one online softmax
    w_lo = tl.maximum(p - WINDOW + 1, 0)
    n_win = tl.cdiv(p + 1 - w_lo, BLOCK_N)
    n_ent = tl.cdiv(KIDX, BLOCK_N)
    for blk in range(0, n_win + n_ent):
        if blk < n_win:
            key = w_lo + blk * BLOCK_N + kn
            km = key <= p
            page = tl.load(bt + key // PS, mask=km, other=0).to(tl.int64)
            row = page * PS + key % PS
            base = swa_ptr
        else:
            e0 = (blk - n_win) * BLOCK_N
            sel = tl.load(idx_ptr + t64 * KIDX + e0 + kn, mask=e0 + kn < KIDX, other=-1)
            km = sel >= 0
            last = sel.to(tl.int64) * M + M - 1
            page = tl.load(bt + last // PS, mask=km, other=0).to(tl.int64)
            row = page * RPP + (last % PS) // M
            base = ent_ptr
        kk = tl.load(base + (row * D)[:, None] + d[None, :], mask=km[:, None] & dm[None, :], other=0.0)
        if DOT_F32:
            kk = kk.to(tl.float32)
        s = tl.dot(q, tl.trans(kk)) * SCALE                                     # [BLOCK_H, BLOCK_N]
        s = tl.where(km[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        pr = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(pr, axis=1)
        acc = acc * alpha[:, None] + tl.dot(pr.to(kk.dtype), kk)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(o_ptr + t64 * (H * D) + hh[:, None] * D + d[None, :], out.to(o_ptr.dtype.element_ty), mask=qm)


META = {
    "entry": "compressed_attention",
    "params": [
        ["q_ptr", "*bf16", "in:0"],
        ["sink_ptr", "*fp32", "in:2"],
        ["idx_ptr", "*i32", "in:3"],
        ["o_ptr", "*bf16", "out:0"],
        ["swa_ptr", "*bf16", "cache:swa"],
        ["ent_ptr", "*bf16", "cache:csa"],
        ["seq_starts", "*i32", "meta:seq_starts"],
        ["context_lens", "*i32", "meta:context_lens"],
        ["block_tables", "*i32", "meta:block_tables"],
        ["max_pages", "i32", "meta:max_pages"],
        ["B", "i32", "dim:B"],
    ],
    "constexprs": {"H": 64, "D": 512, "M": 4, "PS": 16, "RPP": 4,
                   "HAS_INDEX": True, "KIDX": 512, "WINDOW": 128, "SCALE": 0.04419417382415922,
                   "BLOCK_D": 512, "BLOCK_H": 16, "BLOCK_N": 32, "BLOCK_B": 64,
                   "DOT_F32": False, "PDL": True},
    "pdl": True,
    "grid": ["T", 4, 1],
    "num_warps": 4,
    "num_stages": 1,
}
