# compress_carry (DeepSeek-V4's compressor, compiler/ops/compressed_attention.py; split_compression
#   made it, after compress_write): the compressor's kv / gate [T, W=512], bias [m=128, W]. A program a token
#   row (grid (T,)): a row among its sequence's last 128 positions (the partial block,
#   all a later step's entries read) goes, as (kv, gate + bias[p % m]) in f32, into row p % 128 of the
#   sequence's slot of hca_buf; the other rows are never read again. A launch of its own: these
#   rows overwrite the slot rows of earlier steps that compress_write's entries read.
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def compress_carry(ckv_ptr, cgate_ptr, cbias_ptr, buf_ptr, seq_starts, context_lens, state_slots, B,
                   Wd: tl.constexpr, M: tl.constexpr, ROWS: tl.constexpr, BLOCK_W: tl.constexpr,
                   BLOCK_B: tl.constexpr, PDL: tl.constexpr):
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
    if p < L - ROWS:
        return
    slot = tl.load(state_slots + b).to(tl.int64)
    w = tl.arange(0, BLOCK_W)
    wm = w < Wd
    t64 = t.to(tl.int64)
    kvr = tl.load(ckv_ptr + t64 * Wd + w, mask=wm, other=0.0).to(tl.float32)
    gr = (tl.load(cgate_ptr + t64 * Wd + w, mask=wm, other=0.0).to(tl.float32)
          + tl.load(cbias_ptr + (p % M) * Wd + w, mask=wm, other=0.0).to(tl.float32))
    dst = buf_ptr + (slot * ROWS + p % ROWS) * (2 * Wd)
    tl.store(dst + w, kvr, mask=wm)
    tl.store(dst + Wd + w, gr, mask=wm)


META = {
    "entry": "compress_carry",
    "params": [
        ["ckv_ptr", "*bf16", "in:0"],
        ["cgate_ptr", "*bf16", "in:1"],
        ["cbias_ptr", "*fp32", "in:2"],
        ["buf_ptr", "*fp32", "cache:hca_buf"],
        ["seq_starts", "*i32", "meta:seq_starts"],
        ["context_lens", "*i32", "meta:context_lens"],
        ["state_slots", "*i32", "meta:state_slots"],
        ["B", "i32", "dim:B"],
    ],
    "constexprs": {"Wd": 512, "M": 128, "ROWS": 128, "BLOCK_W": 512, "BLOCK_B": 64, "PDL": True},
    "pdl": True,
    "grid": ["T", 1, 1],
    "num_warps": 4,
    "num_stages": 1,
}
