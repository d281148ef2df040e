# hc_mix (ops/hyper_connection.py): mix[t] = (x[t] @ fn^T) * rsqrt(mean(x[t]^2) + eps) over the K = 16384
# stream elements (N = 4, H = 4096) and M = 24 rows of fn, all in fp32 (CUDA cores: a tf32 dot
# would round the mix the Sinkhorn rounds then amplify). ROWS = 4 tokens a program, K in
# BLOCK_K = 64 slices.
# Split-K (launches of at most 16 rows: grid z = 128): program z sums its K range (whole
# BLOCK_Ks) into its own fp32 scratch slot, both x . fn and x . x; the last program to arrive at the
# token block (a counter a block) adds the slots in order z = 0 .. Z-1 and writes mix: a fixed
# order, so identical launches give identical bits. It leaves the counter zero.
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def hc_mix(x_ptr, fn_ptr, mix_ptr, part_ptr, cnt_ptr, T, K: tl.constexpr, M: tl.constexpr, MP: tl.constexpr,
           EPS: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, SLOT: tl.constexpr, ZMAX: tl.constexpr,
           PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
    if PDL:
        gdc_wait()   # earlier kernels' writes are visible from here on
    tile = tl.program_id(0)
    t = tile.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    ok = t < T
    m = tl.arange(0, MP)
    nz = tl.num_programs(2)
    k_chunk = tl.cdiv(tl.cdiv(K, nz), BLOCK_K) * BLOCK_K
    k_lo = tl.program_id(2) * k_chunk
    ss = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, MP], tl.float32)
    for k0 in range(k_lo, tl.minimum(k_lo + k_chunk, K), BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        km = k < K
        x = tl.load(x_ptr + t[:, None] * K + k[None, :], mask=ok[:, None] & km[None, :], other=0.0).to(tl.float32)
        w = tl.load(fn_ptr + m[:, None] * K + k[None, :], mask=(m < M)[:, None] & km[None, :], other=0.0).to(tl.float32)
        ss += tl.sum(x * x, axis=1)
        acc += tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    r = tl.arange(0, ROWS)
    if nz > 1:
        # scratch is untyped bytes (the interpreter hands int32, and has no f32 xchg): the partials
        # travel as int32 bits through L2 atomics that the counter's acq_rel orders
        bits = part_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
        slot = bits + (tile * ZMAX + tl.program_id(2)) * SLOT
        tl.atomic_xchg(slot + r[:, None] * (MP + 1) + m[None, :], acc.to(tl.int32, bitcast=True), sem="relaxed")
        tl.atomic_xchg(slot + r * (MP + 1) + MP, ss.to(tl.int32, bitcast=True), sem="relaxed")
        tl.debug_barrier()   # every thread's partials are issued before the release below
        arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
        if arrived == nz - 1:
            tl.debug_barrier()   # the whole program reads after the acquire above
            acc = tl.zeros([ROWS, MP], tl.float32)
            ss = tl.zeros([ROWS], tl.float32)
            for z in range(0, nz):
                slot = bits + (tile * ZMAX + z) * SLOT
                acc += tl.load(slot + r[:, None] * (MP + 1) + m[None, :], cache_modifier=".cg").to(tl.float32, bitcast=True)
                ss += tl.load(slot + r * (MP + 1) + MP, cache_modifier=".cg").to(tl.float32, bitcast=True)
            mix = acc / tl.sqrt(ss / K + EPS)[:, None]
            tl.store(mix_ptr + t[:, None] * M + m[None, :], mix, mask=ok[:, None] & (m < M)[None, :])
            tl.store(cnt_ptr + tile, 0)
    else:
        mix = acc / tl.sqrt(ss / K + EPS)[:, None]
        tl.store(mix_ptr + t[:, None] * M + m[None, :], mix, mask=ok[:, None] & (m < M)[None, :])


META = {
    "entry": "hc_mix",
    "params": [["x_ptr", "*bf16", "in:0"], ["fn_ptr", "*fp32", "in:1"],
               ["mix_ptr", "*fp32", "out:0"], ["part_ptr", "*fp32", "scratch:partials"],
               ["cnt_ptr", "*i32", "scratch:counters"], ["T", "i32", "dim:T"]],
    "constexprs": {"K": 16384, "M": 24, "MP": 32, "EPS": 1e-06, "ROWS": 4,
                   "BLOCK_K": 64, "SLOT": 132, "ZMAX": 128, "PDL": True},
    "pdl": True,
    "grid": ["cdiv(T, 4)", 1, "1 + 127 * max(0, min(1, 17 - T))"],
    "scratch": {"partials": "270336", "counters": "16"},
    "num_warps": 4,
    "num_stages": 1,
}
