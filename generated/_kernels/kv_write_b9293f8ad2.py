# kv_write: k, v [T, Hkv=8, D=128] (token rows 1024 / 7168 elements apart) into this layer's
# paged caches k, v [pages, page_size=16, Hkv, D] (bf16): for each token t with slot s = slot_mapping[t],
#   K[s] = k[t],  V[s] = v[t]        (s = page * page_size + offset; a slot < 0 is a padding row: no write)
# Grid: (cdiv(T, BLOCK_T), cdiv(Hkv, BLOCK_H)); a program copies BLOCK_H=8 heads of BLOCK_T=4 tokens.
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def kv_write(k_ptr, v_ptr, k_cache, v_cache, slot_ptr, T,
             HKV: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
             BLOCK_T: tl.constexpr, K_STRIDE: tl.constexpr, V_STRIDE: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
    if PDL:
        gdc_wait()   # earlier kernels' writes are visible from here on
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    col = h[:, None] * D + d[None, :]
    m = (h < HKV)[:, None] & (d < D)[None, :]
    for i in range(BLOCK_T):
        t = tl.program_id(0).to(tl.int64) * BLOCK_T + i
        tc = tl.minimum(t, T - 1)
        slot = tl.load(slot_ptr + tc).to(tl.int64)
        # a tensor compare: the interpreter mis-types tensor & scalar bools
        ok = m & ((tl.zeros([BLOCK_H], tl.int64) + t < T) & (tl.zeros([BLOCK_H], tl.int64) + slot >= 0))[:, None]
        k = tl.load(k_ptr + tc * K_STRIDE + col, mask=ok, other=0.0)
        v = tl.load(v_ptr + tc * V_STRIDE + col, mask=ok, other=0.0)
        tl.store(k_cache + slot * (HKV * D) + col, k.to(k_cache.dtype.element_ty), mask=ok)
        tl.store(v_cache + slot * (HKV * D) + col, v.to(v_cache.dtype.element_ty), mask=ok)


META = {
    "entry": "kv_write",
    "params": [
        ["k_ptr", "*bf16", "in:0"],
        ["v_ptr", "*bf16", "in:1"],
        ["k_cache", "*bf16", "cache:k"],
        ["v_cache", "*bf16", "cache:v"],
        ["slot_ptr", "*i32", "meta:slot_mapping"],
        ["T", "i32", "dim:T"],
    ],
    "constexprs": {"HKV": 8, "D": 128, "BLOCK_D": 128, "BLOCK_H": 8,
                   "BLOCK_T": 4, "K_STRIDE": 1024, "V_STRIDE": 7168, "PDL": True},
    "pdl": True,
    "grid": ["cdiv(T, 4)", 1, 1],
    "num_warps": 2,
    "num_stages": 1,
}
