"""The attention kernels over FP8 K/V caches (--kv-cache-dtype fp8: e4m3 codes, per-tensor scales
k_scale != v_scale != 1) under the interpreter, against the ops' numpy references reading the same
cache declarations: kv_write and qk_norm_rope_cache quantize (their codes checked against torch's
own float8_e4m3fn cast of x / scale, an e4m3 rounding independent of the reference's, saturation
at +-448 included), attention_decode (alone and with qk_norm_rope_cache merged in front),
attention_prefill and attention_mixed (its split role) dequantize. GQA, head dims and context
lengths that are not multiples of the pages or tiles; a kernel that drops the read's scale fails
every attention test here. (The harness converts to e4m3 as the GPU does, rounding to nearest even
and saturating: tests/kernels/harness.py.)"""
import numpy as np
import pytest
import torch

from infc.compiler.ops import REGISTRY
from infc.compiler.ops.quant import round_e4m3

from exhaustive import EXHAUSTIVE

from .harness import poison, rand, rel_err, render, run
from .test_attention_kernels import PS, TOL, Ctx, Paged, _slots

K_SCALE, V_SCALE = 0.37, 2.5            # per-tensor scales of layer 0 (not 1: a dropped scale shows)


def fp8_caches(hkv, d):
    entry = {"kind": "paged", "shape": [hkv, d], "dtype": "f8e4m3", "layers": [0]}
    return {"k": dict(entry, scales=[K_SCALE]), "v": dict(entry, scales=[V_SCALE])}


class FP8Ctx(Ctx):
    """The reference's ctx with the plan's cache declarations (their dtype and scales)."""

    def __init__(self, *a, decl, **kw):
        super().__init__(*a, **kw)
        self.decl = decl

    def cache_decl(self, name):
        return self.decl[name]


def torch_codes(x, scale) -> torch.Tensor:
    """e4m3 codes of x / scale by torch's cast (saturated first: the cast itself gives NaN past 448)."""
    return (torch.as_tensor(x, dtype=torch.float32) / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


def scales():
    return {"scale:k": K_SCALE, "scale:v": V_SCALE}


def test_kv_write_fp8_quantizes_like_torch_and_the_reference():
    gen = np.random.default_rng(3)
    hkv, d = 3, 40
    k = render("kv_write", "kv_write", [("k", ["T", hkv, d], "bf16"), ("v", ["T", hkv, d], "bf16")],
               [("cache", [], "", "cache")], caches=fp8_caches(hkv, d), phase="prefill", tune={"BLOCK_T": 3})
    specs = [(0, 19), (40, 3)]
    T = sum(n for _, n in specs) + 1                  # a padding row (slot -1)
    n_pages = 8
    slots = _slots(gen, specs, n_pages) + [-1]
    kin = rand((T, hkv, d), gen=gen, scale=120.0)     # |k| / 0.37 past 448: saturates
    vin = rand((T, hkv, d), gen=gen, scale=0.02)      # / 2.5: e4m3 subnormals
    kc, vc = poison((n_pages + 1, PS, hkv, d), "f8e4m3"), poison((n_pages + 1, PS, hkv, d), "f8e4m3")
    run(k, {"in:0": kin, "in:1": vin, "cache:k": kc, "cache:v": vc, **scales(),
            "meta:slot_mapping": torch.tensor(slots, dtype=torch.int32)}, {"T": T, "B": 3})
    ref = {n: np.full(kc.shape, np.nan, np.float32) for n in ("k", "v")}
    ctx = FP8Ctx(specs + [(7, 1)], ref, slot_mapping=slots, decl=fp8_caches(hkv, d))
    REGISTRY["kv_write"].reference(ctx, kin.float().numpy(), vin.float().numpy())
    flat = lambda c: c.reshape(-1, hkv, d)                        # noqa: E731
    s = np.asarray(slots[:-1])
    for got, want, x, scale in ((kc, ref["k"], kin, K_SCALE), (vc, ref["v"], vin, V_SCALE)):
        got = got.float().numpy()
        assert np.array_equal(np.isnan(got), np.isnan(want)), "wrote a slot it should not have"
        assert np.array_equal(flat(got)[s], flat(want)[s])                         # the reference's codes
        assert np.array_equal(flat(got)[s], torch_codes(x[:-1].float(), scale).float().numpy())
    assert np.abs(flat(kc.float().numpy())[s]).max() == 448.0                      # saturated, not NaN
    assert (np.abs(flat(vc.float().numpy())[s]) < 2.0 ** -6).any()                # subnormal codes kept


def test_qk_norm_rope_cache_fp8():
    gen = np.random.default_rng(5)
    hq, hkv, d = 4, 2, 48
    attrs = {"q_heads": hq, "kv_heads": hkv, "head_dim": d, "eps": 1e-6, "theta": 1e6, "scaling": None,
             "rotary_dim": None, "q_norm": True, "k_norm": True}
    inputs = [("qkv", ["T", (hq + 2 * hkv) * d], "bf16"), ("q_norm", [d], "bf16", "weight"),
              ("k_norm", [d], "bf16", "weight")]
    k = render("qk_norm_rope_cache", "qk_norm_rope_cache", inputs,
               [("q", ["T", hq, d], "bf16"), ("cache", [], "", "cache")], attrs=attrs,
               caches=fp8_caches(hkv, d), tune={"BLOCK_H": 4, "BLOCK_T": 2})
    seqs = [(0, 7), (300, 2)]
    T = sum(n for _, n in seqs) + 1
    qkv = rand((T, (hq + 2 * hkv) * d), gen=gen, scale=3.0)
    norms = [(1 + 0.3 * rand((d,), gen=gen).float()).to(torch.bfloat16) for _ in range(2)]
    n_pages = 6
    slots = _slots(gen, seqs, n_pages) + [-1]
    kc, vc = poison((n_pages + 1, PS, hkv, d), "f8e4m3"), poison((n_pages + 1, PS, hkv, d), "f8e4m3")
    q = poison((T, hq, d))
    positions = [p for start, n in seqs for p in range(start, start + n)] + [5]
    run(k, {"in:0": qkv, "in:1": norms[0], "in:2": norms[1], "out:0": q, "cache:k": kc, "cache:v": vc,
            **scales(), "meta:positions": torch.tensor(positions, dtype=torch.int32),
            "meta:slot_mapping": torch.tensor(slots, dtype=torch.int32)}, {"T": T, "B": 3})
    ref = {n: np.full(kc.shape, np.nan, np.float32) for n in ("k", "v")}
    ctx = FP8Ctx(seqs + [(5, 1)], ref, slot_mapping=slots, decl=fp8_caches(hkv, d))
    want_q, _ = REGISTRY["qk_norm_rope_cache"].reference(ctx, qkv.float().numpy(),
                                                          *[w.float().numpy() for w in norms], **attrs)
    assert rel_err(q.float().numpy(), want_q) <= TOL
    flat = lambda c: c.reshape(-1, hkv, d)                        # noqa: E731
    s = np.asarray(slots[:-1])
    got_k = flat(kc.float().numpy())[s]
    # K: the kernel's fp32 norm + rope and numpy's differ in the last bits, so a few codes round the
    # other way (one e4m3 step: 1/8 relative); V is a copy: its codes are the reference's exactly
    assert rel_err(got_k * K_SCALE, flat(ref["k"])[s] * K_SCALE) <= 0.03
    assert (got_k == flat(ref["k"])[s]).mean() > 0.97
    v = qkv[:-1, (hq + hkv) * d:].float().reshape(-1, hkv, d)
    assert np.array_equal(flat(vc.float().numpy())[s], torch_codes(v, V_SCALE).float().numpy())
    assert np.array_equal(flat(vc.float().numpy())[s], flat(ref["v"])[s])
    untouched = np.ones(flat(ref["k"]).shape[0], bool)
    untouched[s] = False
    assert torch.isnan(kc.view(-1, hkv, d)[torch.from_numpy(untouched)].float()).all()


class FP8Paged(Paged):
    """Paged's caches as e4m3 codes of K / k_scale and V / v_scale (NaN pages stay NaN)."""

    def __init__(self, gen, specs, hkv, d, **kw):
        super().__init__(gen, specs, hkv, d, **kw)
        self.k_cache = torch_codes(self.k_cache.float(), K_SCALE)
        self.v_cache = torch_codes(self.v_cache.float(), V_SCALE)
        assert torch.isnan(self.k_cache.float()).any()            # the poison pages stay NaN
        ctx = FP8Ctx(specs, {"k": self.k_cache.float().numpy(), "v": self.v_cache.float().numpy()},
                     block_tables=self.ctx.meta.block_tables, page_size=self.ps, decl=fp8_caches(hkv, d))
        self.ctx = ctx

    def bindings(self):
        return {**super().bindings(), **scales()}


def _attention(template, phase, page, hq, d, tune, dims, q_mult=1.0, **extra):
    gen = np.random.default_rng(1)
    hkv = page.k_cache.shape[2]
    q = rand((page.T, hq, d), gen=gen)
    if q_mult != 1.0:
        q = (q.float() * q_mult).to(q.dtype)
    attrs = {"kv_heads": hkv, "scale": None, "window": None, "softcap": None, **extra}
    k = render(template, "attention_cached", [("q", ["T", hq, d], "bf16"), ("cache", [], "", "cache")],
               [("o", ["T", hq, d], "bf16")], attrs=attrs, phase=phase, caches=fp8_caches(hkv, d), tune=tune,
               page_size=page.ps)
    o_full = poison((page.T + 2, hq, d))
    o = o_full[:page.T]
    run(k, {"in:0": q, "out:0": o, **page.bindings()}, dims)
    assert torch.isnan(o_full[page.T:].float()).all(), "wrote output rows past T"
    want = REGISTRY["attention_cached"].reference(page.ctx, q.float().numpy(), None, **attrs)
    return rel_err(o.float().numpy(), want)


@pytest.mark.parametrize("hq,hkv,d,lens,tune,extra", [
    (4, 2, 40, [1, 23, 70], {"NUM_SPLITS": 4, "BLOCK_N": 16}, {}),                     # splits merge
    (6, 2, 64, [90, 7], {"NUM_SPLITS": 2, "BLOCK_N": 32}, {"window": 37, "softcap": 20.0}),
    pytest.param(2, 2, 64, [1, 15, 17, 70], {"NUM_SPLITS": 4, "BLOCK_N": 16}, {}, marks=EXHAUSTIVE),  # G = 1
    pytest.param(8, 2, 128, [600, 3, 129], {"NUM_SPLITS": 16, "BLOCK_N": 32, "TARGET_CTAS": 8}, {},
                 marks=EXHAUSTIVE),                                                       # G = 4, long
    pytest.param(8, 4, 96, [500, 64, 65], {"NUM_SPLITS": 8, "BLOCK_N": 32}, {"window": 64, "scale": 0.07},
                 marks=EXHAUSTIVE),
])
def test_attention_decode_fp8(hq, hkv, d, lens, tune, extra):
    page = FP8Paged(np.random.default_rng(len(lens) + d), [(L - 1, 1) for L in lens], hkv, d)
    assert _attention("attention_decode", "decode", page, hq, d, tune, {"T": len(lens), "B": len(lens)},
                      **extra) <= TOL


def test_attention_decode_fp8_q_past_f16_range():
    """The decode kernel dots the codes in f16: a query past f16's range (|q| up to ~1e5 here) is
    brought under it by a power of two, not turned into inf."""
    page = FP8Paged(np.random.default_rng(3), [(L - 1, 1) for L in (9, 40)], 2, 32)
    assert _attention("attention_decode", "decode", page, 4, 32, {"NUM_SPLITS": 2, "BLOCK_N": 16},
                      {"T": 2, "B": 2}, q_mult=4.0e4, scale=1e-5) <= TOL


SPLIT = {"NUM_SPLITS": 2, "SPLIT_BLOCK_N": 16, "SPLIT_MIN_KEYS": 16}


@pytest.mark.parametrize("template,phase,hq,hkv,d,specs,share,tune,extra", [
    ("attention_prefill", "prefill", 4, 2, 40, [(0, 21), (20, 11)], 0, {"BLOCK_M": 16, "BLOCK_N": 16}, {}),
    # a mixed step: the flash role for the 19-token chunk, the split role for the decode rows
    ("attention_mixed", "mixed", 4, 2, 40, [(40, 1), (0, 19), (100, 1)], 0,
     {"BLOCK_M": 16, "BLOCK_N": 16, **SPLIT}, {}),
    pytest.param("attention_prefill", "prefill", 8, 2, 128, [(32, 15), (48, 20)], 2,
                 {"BLOCK_M": 32, "BLOCK_N": 32}, {}, marks=EXHAUSTIVE),                     # shared prefix
    pytest.param("attention_prefill", "prefill", 4, 2, 64, [(0, 90), (60, 1), (45, 30)], 0,
                 {"BLOCK_M": 16, "BLOCK_N": 16}, {"window": 21, "softcap": 30.0}, marks=EXHAUSTIVE),
    # 64-token pages: the flash tiles take their K/V codes by TMA (KV_TMA), the masked tile's V zeroed
    pytest.param("attention_prefill", "prefill", 4, 2, 64, [(0, 150), (70, 9)], 0,
                 {"BLOCK_M": 32, "BLOCK_N": 64, "page_size": 64}, {}, marks=EXHAUSTIVE),
    # a short step: a 9-token suffix over a cached prefix in the split role (QMAX 16)
    pytest.param("attention_mixed", "short", 6, 2, 96, [(70, 9), (0, 5)], 0,
                 {"BLOCK_M": 16, "BLOCK_N": 16, **SPLIT}, {}, marks=EXHAUSTIVE),
])
def test_attention_prefill_and_mixed_fp8(template, phase, hq, hkv, d, specs, share, tune, extra):
    tune = dict(tune)
    page = FP8Paged(np.random.default_rng(7), specs, hkv, d, share=share, page_size=tune.pop("page_size", PS))
    assert _attention(template, phase, page, hq, d, tune, {"T": page.T, "B": page.B}, **extra) <= TOL


def test_merged_attention_decode_fp8():
    """The narrow phase's launch (qk_norm_rope_cache merged in front of attention_decode) over FP8
    caches: the new token's codes as the unmerged kernel writes them, the output as the two
    references give it."""
    gen = np.random.default_rng(11)
    hq, hkv, d, lens = 4, 2, 48, [40, 9]
    B = len(lens)
    qk_attrs = {"q_heads": hq, "kv_heads": hkv, "head_dim": d, "eps": 1e-6, "theta": 1e6, "scaling": None,
                "rotary_dim": None, "q_norm": True, "k_norm": True}
    attn_attrs = {"kv_heads": hkv, "scale": None, "window": None, "softcap": None}
    page = FP8Paged(gen, [(L - 1, 1) for L in lens], hkv, d)
    slots = [page.pages[b][(L - 1) // PS] * PS + (L - 1) % PS for b, L in enumerate(lens)]
    for s in slots:                                   # the launch writes the new token's K and V
        page.k_cache.view(-1, hkv, d)[s] = float("nan")
        page.v_cache.view(-1, hkv, d)[s] = float("nan")
    qkv = rand((B, (hq + 2 * hkv) * d), gen=gen, scale=3.0)
    norms = [(1 + 0.3 * rand((d,), gen=gen).float()).to(torch.bfloat16) for _ in range(2)]
    meta = {"meta:positions": torch.tensor([L - 1 for L in lens], dtype=torch.int32),
            "meta:slot_mapping": torch.tensor(slots, dtype=torch.int32)}
    qk_in = [("qkv", ["T", (hq + 2 * hkv) * d], "bf16"), ("q_norm", [d], "bf16", "weight"),
             ("k_norm", [d], "bf16", "weight")]
    dims = {"T": B, "B": B}
    caches = {"cache:k": page.k_cache.clone(), "cache:v": page.v_cache.clone()}
    k1 = render("qk_norm_rope_cache", "qk_norm_rope_cache", qk_in,
                [("q", ["T", hq, d], "bf16"), ("cache", [], "", "cache")], attrs=qk_attrs, caches=fp8_caches(hkv, d))
    run(k1, {"in:0": qkv, "in:1": norms[0], "in:2": norms[1], "out:0": poison((B, hq, d)), **meta, **caches,
             **scales()}, dims)
    prologue = {"op": "qk_norm_rope_cache", "inputs": len(qk_in), "output": 0, "value": "q", "writes": 1,
                "attrs": qk_attrs}
    k = render("attention_decode", "attention_cached", qk_in + [("cache", [], "", "cache")],
               [("cache", [], "", "cache"), ("o", ["T", hq, d], "bf16")], attrs=attn_attrs,
               caches=fp8_caches(hkv, d), tune={"NUM_SPLITS": 4, "BLOCK_N": 16}, prologue=prologue, narrow=True)
    o = poison((B, hq, d))
    run(k, {"in:0": qkv, "in:1": norms[0], "in:2": norms[1], "out:1": o, **meta, **page.bindings()}, dims)
    bits = lambda t: t.view(torch.uint8)                             # noqa: E731 (NaN pages too)
    assert torch.equal(bits(page.k_cache), bits(caches["cache:k"]))
    assert torch.equal(bits(page.v_cache), bits(caches["cache:v"]))
    ctx = page.ctx
    ctx.meta.slot_mapping = np.asarray(slots, np.int64)
    ctx.positions = np.asarray([L - 1 for L in lens], np.int64)
    want_q, _ = REGISTRY["qk_norm_rope_cache"].reference(ctx, qkv.float().numpy(),
                                                          *[w.float().numpy() for w in norms], **qk_attrs)
    want = REGISTRY["attention_cached"].reference(ctx, want_q, None, **attn_attrs)
    assert rel_err(o.float().numpy(), want) <= TOL
