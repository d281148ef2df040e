# indexer_topk (DeepSeek-V4's lightning indexer, compiler/ops/compressed_attention.py; split_compression
#   made it from indexer_topk, after compress_write wrote the keys into cache ikv): q [T, Hi=64, Di=128],
#   w [T, Hi] -> idx [T, K=512] i32. A program a query token (grid (T,)): its sequence b is the number of
#   sequences that end at or before its row (seq_starts), its position p = context_lens[b] -
#   (seq_starts[b + 1] - t) (cached + i). Over the entries e < (p + 1) // m, each scored ONCE:
#     score_e = sum_h (w[h] / sqrt(Hi)) relu(q[h] . K_e) / sqrt(Di)
#   BLOCK_N=64 entries at a time on tensor cores (q [Hi, Di] x K^T [Di, BLOCK_N]), gathered into a block
#   of KB=512 (a power of two >= K); each block merges with the running best KB by ONE tl.sort of packed
#   int64 keys: the score's order-preserving int32 (a float's bits, the negative ones' magnitude bits
#   flipped; -0 counted as +0) in the high half, 2^31 - 1 - e in the low half, so a descending sort is
#   (score descending, index ascending), the reference's order. Padding sorts last (the int64 minimum)
#   and comes out as -1 past the visible count. A block whose best key is below the running KB-th is
#   skipped (no sort). (tl.join / reshape / permute / split and tl.sort of int64 run under the interpreter
#   as compiled: tests/kernels/test_compressed_attention.py checks the order, ties included.)
#   Work: a query scores each visible entry once (Hi x Di MACs: 8 k at 64 x 128) and sorts 2 KB keys
#   a block; one program a query reads the whole key cache of its sequence (decode at 32k: 8192 keys,
#   2 MiB of bf16, on one SM: a split over entries would spread a batch-1 decode, not done).
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def indexer_topk(q_ptr, w_ptr, o_ptr, ent_ptr, seq_starts, context_lens, block_tables, max_pages, B,
                 HI: tl.constexpr, D: tl.constexpr, M: tl.constexpr, PS: tl.constexpr, RPP: tl.constexpr,
                 K: tl.constexpr, KB: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, DOT_F32: tl.constexpr, PDL: tl.constexpr):
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
    nvis = (p + 1) // M
    t64 = t.to(tl.int64)
    bt = block_tables + b.to(tl.int64) * max_pages

    d = tl.arange(0, BLOCK_D)
    dm = d < D
    hh = tl.arange(0, BLOCK_H)
    hmask = hh < HI
    q = tl.load(q_ptr + t64 * (HI * D) + hh[:, None] * D + d[None, :], mask=hmask[:, None] & dm[None, :], other=0.0)
    if DOT_F32:                                  # (the interpreter's bf16 dot is wrong: tests/kernels/harness.py)
        q = q.to(tl.float32)
    wt = tl.load(w_ptr + t64 * HI + hh, mask=hmask, other=0.0).to(tl.float32) * (HI ** -0.5 * D ** -0.5)
    kn = tl.arange(0, BLOCK_N)
    chunk = tl.arange(0, KB // BLOCK_N)
    NONE: tl.constexpr = -9223372036854775807 - 1
    top = tl.full([KB], NONE, tl.int64)
    for e0 in range(0, nvis, KB):
        blk = tl.full([KB // BLOCK_N, BLOCK_N], NONE, tl.int64)
        for c in range(0, tl.cdiv(tl.minimum(nvis - e0, KB), BLOCK_N)):
            e = e0 + c * BLOCK_N + kn
            em = e < nvis
            last = e.to(tl.int64) * M + M - 1
            page = tl.load(bt + last // PS, mask=em, other=0).to(tl.int64)
            erow = (last % PS) // M
            kk = tl.load(ent_ptr + ((page * RPP + erow) * D)[:, None] + d[None, :],
                         mask=em[:, None] & dm[None, :], other=0.0)
            if DOT_F32:
                kk = kk.to(tl.float32)
            s = tl.maximum(tl.dot(q, tl.trans(kk)), 0.0)                       # [BLOCK_H, BLOCK_N]
            sc = tl.sum(s * wt[:, None], axis=0)                               # [BLOCK_N]
            sc = tl.where(sc == 0.0, 0.0, sc)                                   # -0 ties +0
            bits = sc.to(tl.int32, bitcast=True)
            ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
            key = (ordered.to(tl.int64) << 32) | (2147483647 - e).to(tl.int64)
            key = tl.where(em, key, NONE)
            blk = tl.where(chunk[:, None] == c, key[None, :], blk)
        flat = tl.reshape(blk, [KB])
        if tl.max(flat, axis=0) > tl.min(top, axis=0):
            both = tl.sort(tl.reshape(tl.join(top, flat), [2 * KB]), descending=True)
            top, _ = tl.split(tl.permute(tl.reshape(both, [2, KB]), [1, 0]))
    r = tl.arange(0, KB)
    idx = tl.where(top == NONE, -1, 2147483647 - (top & 0xFFFFFFFF)).to(tl.int32)
    tl.store(o_ptr + t64 * K + r, idx, mask=r < K)


META = {
    "entry": "indexer_topk",
    "params": [
        ["q_ptr", "*bf16", "in:0"],
        ["w_ptr", "*bf16", "in:1"],
        ["o_ptr", "*i32", "out:0"],
        ["ent_ptr", "*bf16", "cache:ikv"],
        ["seq_starts", "*i32", "meta:seq_starts"],
        ["context_lens", "*i32", "meta:context_lens"],
        ["block_tables", "*i32", "meta:block_tables"],
        ["max_pages", "i32", "meta:max_pages"],
        ["B", "i32", "dim:B"],
    ],
    "constexprs": {"HI": 64, "D": 128, "M": 4, "PS": 16, "RPP": 4, "K": 512,
                   "KB": 512, "BLOCK_D": 128, "BLOCK_H": 64, "BLOCK_N": 64,
                   "BLOCK_B": 64, "DOT_F32": False, "PDL": True},
    "pdl": True,
    "grid": ["T", 1, 1],
    "num_warps": 4,
    "num_stages": 1,
}
