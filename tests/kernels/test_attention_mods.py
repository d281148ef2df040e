"""attention_cached's extra attrs under the interpreter, against the numpy reference: ALiBi
(BLOOM / MPT slopes from the head count), chunked (block-local) attention (Llama-4's
attention_chunk_size) and the position-dependent query temperature (Llama-4's
attn_temperature_tuning), through every attention template: flash prefill, the mixed / short
launch's flash and split-KV roles, and split-KV decode (one split and merged).

The reference's own formulas are checked first against independent computations: the slopes
against transformers' BLOOM build_alibi_tensor (and MPT's interleaving for a head count that is
no power of two), the chunk mask against transformers' chunked_overlay, the temperature against
Llama-4's expression. Pages wholly below each sequence's first visible key point at an all-NaN
page (test_attention_kernels.Paged.hide_below_window), so a kernel that reads keys the chunk hides
outputs NaN. Context lengths cross chunk, page and tile boundaries.
"""
import numpy as np
import pytest
import torch

from infc.compiler.ir import TensorType
from infc.compiler.ops import REGISTRY, ShapeError
from infc.compiler.ops.attention import alibi_slopes
from infc.compiler.ops.pos_scale import factor

from exhaustive import EXHAUSTIVE
from .harness import rel_err, render
from .test_attention_kernels import TOL, Paged, _attention, kv_caches

REF = REGISTRY["attention_cached"].reference


# -- the reference's formulas against independent ones ------------------------------------------

@pytest.mark.parametrize("hq", [1, 4, 6, 12, 16, 20])
def test_alibi_slopes_match_bloom(hq):
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor
    # BLOOM's alibi for an all-ones mask is slope[h] * j at key j: its j = 1 column is the slopes
    want = build_alibi_tensor(torch.ones(1, 3), hq, torch.float32)[:, 0, 1].numpy()
    assert np.allclose(alibi_slopes(hq), want, rtol=1e-6, atol=0)


def test_alibi_slopes_mpt_form():
    """MPT's gen_slopes (max bias M over the next power of two, odd terms first) is BLOOM's for
    M = 8; with another alibi_bias_max it scales every exponent."""
    def mpt(n, m):
        n2 = 1 << (n - 1).bit_length()
        s = 1.0 / 2.0 ** (np.arange(1, n2 + 1) * (m / n2))
        return np.concatenate([s[1::2], s[::2]])[:n] if n2 != n else s
    for n in (6, 8, 12):
        assert np.allclose(alibi_slopes(n), mpt(n, 8.0), rtol=1e-6)
        assert np.allclose(alibi_slopes(n, 4.0), mpt(n, 4.0), rtol=1e-6)


def test_reference_mods_change_the_result():
    """Each attr takes effect in the reference as its formula says: the chunk hides exactly the
    keys of earlier chunks (a row at a chunk's start sees only itself), ALiBi's bias is shift-free
    (so one key gives the plain result), the temperature scales q by Llama-4's factor."""
    from transformers.masking_utils import chunked_overlay
    page = Paged(np.random.default_rng(9), [(0, 40)], 1, 32)
    q = np.random.default_rng(2).standard_normal((40, 2, 32)).astype(np.float32)
    plain = REF(page.ctx, q, None, kv_heads=1)
    chunked = REF(page.ctx, q, None, kv_heads=1, chunk=16)
    V = page.v_cache.float().numpy()[page.pages[0]].reshape(-1, 1, 32)[:40]
    overlay = chunked_overlay(16, torch.zeros(1, dtype=torch.long))
    for p in range(40):
        seen = [j for j in range(p + 1) if overlay(0, 0, p, j)]
        assert seen[0] == p // 16 * 16                         # transformers' chunk = this reference's
        if p % 16 == 0:                                        # alone in its chunk: o = its own value
            assert np.allclose(chunked[p, :, :], V[p, 0], atol=1e-6)
        if p < 16:
            assert np.allclose(chunked[p], plain[p], atol=1e-6)
    assert rel_err(chunked[16:], plain[16:]) > 0.05
    assert np.allclose(REF(page.ctx, q, None, kv_heads=1, chunk=64), plain, atol=1e-6)
    alibi = REF(page.ctx, q, None, kv_heads=1, alibi=8.0)
    assert np.allclose(alibi[0], plain[0], atol=1e-6) and rel_err(alibi, plain) > 0.05
    hot = REF(page.ctx, q, None, kv_heads=1, temp_floor=4.0, temp_scale=0.5)
    tau = np.log1p(np.floor((np.arange(40) + 1.0) / 4.0)) * 0.5 + 1.0
    assert np.allclose(factor(np.arange(40), 4.0, 0.5, shift=1), tau, rtol=1e-6)
    assert np.allclose(hot, REF(page.ctx, q * tau[:, None, None].astype(np.float32), None, kv_heads=1),
                       atol=1e-5)
    assert np.allclose(hot[:3], plain[:3], atol=1e-6) and rel_err(hot, plain) > 0.05


def test_attention_refuses_bad_mods():
    q, k = TensorType(("T", 4, 64), "bf16"), TensorType(("T", 2, 64), "bf16")
    att = REGISTRY["attention"]
    for attrs, what in (({"chunk": 0}, "chunk must be a positive integer"),
                        ({"chunk": 2.5}, "chunk must be a positive integer"),
                        ({"alibi": -1.0}, "alibi must be true or a positive max bias"),
                        ({"alibi": "yes"}, "alibi must be true"),
                        ({"temp_floor": 8192.0}, "temp_floor and temp_scale go together"),
                        ({"temp_floor": 0.0, "temp_scale": 0.1}, "temp_floor must be a positive")):
        with pytest.raises(ShapeError, match=what):
            att.infer([q, k, k], attrs)


def test_templates_without_mods_render_no_trace_of_them():
    """A launch without the attrs renders none of their code (shipped plans' kernels unchanged)."""
    for template, phase in (("attention_prefill", "prefill"), ("attention_mixed", "mixed"),
                            ("attention_decode", "decode")):
        src = render(template, "attention_cached", [("q", ["T", 4, 64], "bf16"), ("cache", [], "", "cache")],
                     [("o", ["T", 4, 64], "bf16")], attrs={"kv_heads": 2, "window": 8}, phase=phase,
                     caches=kv_caches(2, 64)).source
        assert not any(w in src for w in ("ALiBi", "qlo", "tau", "Chunked", "temperature")), template


# -- the kernels -----------------------------------------------------------------------------

SMALL_SPLIT = {"BLOCK_M": 16, "BLOCK_N": 16, "SPLIT_BLOCK_N": 16, "NUM_SPLITS": 4, "TARGET_CTAS": 64}
CASES = [
    # template, phase, hq, hkv, d, (cached, q_len) per sequence, tune, attrs
    # chunked: prompts over several chunks, a chunk continuing a cached prefix mid-chunk, a chunk
    # of one page and of a tile's non-multiple; decode rows right at and past a chunk boundary
    ("attention_prefill", "prefill", 4, 2, 64, [(0, 75), (30, 21), (0, 3)], {"BLOCK_M": 16, "BLOCK_N": 16},
     {"chunk": 24}),
    ("attention_mixed", "mixed", 8, 2, 64, [(69, 1), (0, 40), (16, 20), (47, 1), (300, 1)], SMALL_SPLIT,
     {"chunk": 16}),
    ("attention_mixed", "short", 4, 2, 64, [(300, 5), (95, 1), (0, 40), (45, 30)], SMALL_SPLIT, {"chunk": 48}),
    ("attention_decode", "decode", 4, 2, 64, [(299, 1), (64, 1), (63, 1), (8, 1)],
     {"NUM_SPLITS": 4, "BLOCK_N": 16}, {"chunk": 64}),
    ("attention_decode", "decode", 8, 2, 64, [(140, 1), (33, 1)], {"NUM_SPLITS": 1, "BLOCK_N": 16},
     {"chunk": 40, "window": 37}),                                                  # both bounds
    # ALiBi: 6 heads (no power of two: the interleaved slopes), GQA
    ("attention_prefill", "prefill", 6, 2, 64, [(0, 70), (20, 11)], {"BLOCK_M": 32, "BLOCK_N": 16},
     {"alibi": 8.0}),
    ("attention_mixed", "mixed", 6, 3, 64, [(69, 1), (0, 15), (14, 20), (300, 1)], SMALL_SPLIT, {"alibi": 8.0}),
    ("attention_decode", "decode", 4, 1, 64, [(299, 1), (39, 1), (8, 1)], {"NUM_SPLITS": 4, "BLOCK_N": 16},
     {"alibi": 8.0}),
    # the query temperature (a floor of 8 so that it grows over these positions)
    ("attention_prefill", "prefill", 4, 2, 64, [(0, 50), (33, 9)], {"BLOCK_M": 16, "BLOCK_N": 16},
     {"temp_floor": 8.0, "temp_scale": 0.3}),
    ("attention_mixed", "short", 4, 2, 64, [(200, 5), (60, 1), (0, 40)], SMALL_SPLIT,
     {"temp_floor": 8.0, "temp_scale": 0.3}),
    ("attention_decode", "decode", 8, 2, 64, [(150, 1), (7, 1)], {"NUM_SPLITS": 4, "BLOCK_N": 16},
     {"temp_floor": 8.0, "temp_scale": 0.3}),
    # all three with a softcap (every modifier on one score)
    ("attention_mixed", "mixed", 4, 2, 64, [(90, 1), (0, 45), (30, 19)], SMALL_SPLIT,
     {"chunk": 32, "alibi": 4.0, "temp_floor": 16.0, "temp_scale": 0.2, "softcap": 30.0}),
]
FAST = {0, 3, 7, 10, 11}               # every template and attr once; the rest with --exhaustive


@pytest.mark.parametrize("case", [pytest.param(c, id=f"{c[0]}-{c[1]}-{'-'.join(c[-1])}",
                                               marks=() if i in FAST else EXHAUSTIVE)
                                  for i, c in enumerate(CASES)])
def test_attention_mods(case):
    template, phase, hq, hkv, d, specs, tune, attrs = case
    gen = np.random.default_rng(len(specs) * 10 + d + hq)
    page = Paged(gen, specs, hkv, d)
    if attrs.get("chunk") or attrs.get("window"):
        page.hide_below_window(attrs.get("window"), attrs.get("chunk"))
    dims = {"T": page.T, "B": page.B}
    assert _attention(template, phase, page, hq, d, tune, dims, **attrs) <= TOL


def test_chunked_prefix_hit():
    """A prefix hit under chunked attention: sequence 1's first two pages are sequence 0's (the
    same physical pages), its 9 new tokens continue mid-chunk and cross a chunk boundary (48);
    pages below each first query's chunk are NaN. (The split role's prefix hit: test_attention_vocab's
    whole-model runs, --exhaustive.)"""
    page = Paged(np.random.default_rng(11), [(70, 1), (40, 9)], 2, 64, share=2)
    assert page.pages[0][:2] == page.pages[1][:2]
    page.hide_below_window(None, 24)
    for template, phase in (("attention_prefill", "prefill"),):
        assert _attention(template, phase, page, 4, 64, SMALL_SPLIT, {"T": page.T, "B": page.B}, chunk=24) <= TOL
