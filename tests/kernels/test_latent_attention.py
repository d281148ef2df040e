"""Multi-head latent attention (compiler/ops/latent_attention.py): the absorbed path's numpy
references against transformers' DeepseekV2Attention (with and without q_lora, prompt split into
a cached prefix and a continuation), and the Triton templates (head_linear, latent_attention
decode split-KV and prefill/mixed) under the interpreter against the references, with ragged
lengths, several sequences, cached prefixes and page boundaries not aligned. Latent caches are laid
out as the runtime's: [num_pages + 1, page_size, Dc + Dr]; pages permuted; unowned pages, page tails
and block-table padding are NaN, so reading a surplus row shows up as NaN."""
import numpy as np
import pytest
import torch

from infc.compiler.contract.errors import TemplateError
from infc.compiler.ops import REGISTRY, ShapeError
from infc.compiler.ops.rope import rotate
from infc.compiler.ir import TensorType

from tests.exhaustive import EXHAUSTIVE

from .harness import poison, rand, rel_err, render, run
from .test_attention_kernels import PS, Ctx, cdiv

TOL = 1e-2


def latent_caches(width):
    return {"latent": {"kind": "paged", "shape": [width], "dtype": "bf16", "layers": [0]}}


class LatentPaged:
    """A paged latent cache for sequences given as (cached, q_len): the cached rows are in the
    cache, this step's rows are kv (with their slots in slot_mapping, the runtime's layout)."""

    def __init__(self, gen, specs, d, extra_pages=3):
        self.specs, self.B = specs, len(specs)
        lens = [c + n for c, n in specs]
        n_pages = [cdiv(L, PS) for L in lens]
        total = sum(n_pages) + extra_pages
        perm = [int(p) for p in gen.permutation(total)]
        self.poison_page = perm.pop()
        self.pages = [[perm.pop() for _ in range(n)] for n in n_pages]
        self.max_pages = max(n_pages) + 2
        bt = np.full((self.B, self.max_pages), self.poison_page, np.int32)
        for i, p in enumerate(self.pages):
            bt[i, :len(p)] = p
        self.block_tables = torch.from_numpy(bt)
        self.context_lens = torch.tensor(lens, dtype=torch.int32)
        starts = np.cumsum([0] + [n for _, n in specs]).astype(np.int32)
        self.seq_starts = torch.from_numpy(starts)
        self.T = int(starts[-1])
        self.cache = poison((total + 1, PS, d))
        slots = []
        self.kv = rand((self.T, d), gen=gen)
        for i, (c, n) in enumerate(specs):
            old = rand((c, d), gen=gen)
            for j in range(c):
                self.cache[self.pages[i][j // PS], j % PS] = old[j]
            slots += [self.pages[i][j // PS] * PS + j % PS for j in range(c, c + n)]
        self.slot_mapping = torch.tensor(slots, dtype=torch.int32)
        self.ctx = Ctx(specs, {"latent": self.cache.float().numpy()}, slot_mapping=slots, block_tables=bt)

    def bindings(self):
        return {"cache:latent": self.cache, "meta:block_tables": self.block_tables,
                "meta:context_lens": self.context_lens, "meta:seq_starts": self.seq_starts,
                "meta:max_pages": self.max_pages, "meta:slot_mapping": self.slot_mapping}


def _latent(template, phase, page, h, dc, dr, tune, dims, scale=0.2):
    gen = np.random.default_rng(3)
    d = dc + dr
    q = rand((page.T, h, d), gen=gen)
    attrs = {"scale": scale, "rope_dim": dr}
    k = render(template, "latent_attention", [("q", ["T", h, d], "bf16"), ("kv", ["T", d], "bf16")],
               [("o", ["T", h, dc], "bf16")], attrs=attrs, phase=phase, caches=latent_caches(d), tune=tune)
    o_full = poison((page.T + 3, h, dc))
    o = o_full[:page.T]
    run(k, {"in:0": q, "in:1": page.kv, "out:0": o, **page.bindings()}, dims)
    assert torch.isnan(o_full[page.T:].float()).all(), "wrote output rows past T"
    want = REGISTRY["latent_attention"].reference(page.ctx, q.float().numpy(), page.kv.float().numpy(), **attrs)
    # the cache now holds what the reference wrote (its new rows, and nothing else changed)
    got_cache, want_cache = page.cache.float().numpy(), page.ctx.cache("latent")
    assert np.array_equal(np.isnan(got_cache), np.isnan(want_cache))
    assert np.array_equal(np.nan_to_num(got_cache), np.nan_to_num(want_cache))
    return rel_err(o.float().numpy(), want)


DECODE_CASES = [
    # h, dc, dr, context lens, tune
    (4, 32, 16, [1, 15, 17, 70], {"NUM_SPLITS": 4, "BLOCK_N": 16}),
    (3, 40, 8, [33, 200], {"NUM_SPLITS": 8, "BLOCK_N": 32, "MERGE_CHUNK": 2}),    # padded Dc, H
    (16, 32, 16, [130, 3], {"NUM_SPLITS": 16, "BLOCK_N": 16, "TARGET_CTAS": 4}),   # ns = 2
    (2, 16, 16, [40, 5], {}),                                                     # default tune
]


@pytest.mark.parametrize("h,dc,dr,lens,tune", DECODE_CASES)
def test_latent_attention_decode(h, dc, dr, lens, tune):
    page = LatentPaged(np.random.default_rng(len(lens) + dc), [(L - 1, 1) for L in lens], dc + dr)
    B = len(lens)
    assert _latent("latent_attention_decode", "decode", page, h, dc, dr, tune, {"T": B, "B": B}) <= TOL


# More heads than one program holds (DeepSeek-V3's 128, Kimi-K2's 64 under data-parallel attention):
# BLOCK_H heads a program, a third grid dimension over the head blocks, and the split-K merge per
# (sequence, head block). Tiny head dims keep the interpreter fast; H and BLOCK_H are what matter.
HEAD_BLOCK_CASES = [
    # h, dc, dr, context lens, tune
    # 3 blocks, the last of 16 heads; splits of up to 3 merge per (sequence, block); L = 1 unsplit
    pytest.param(80, 32, 16, [1, 37, 70], {"BLOCK_H": 32, "NUM_SPLITS": 4, "BLOCK_N": 16}, id="h80-bh32-splits"),
    pytest.param(80, 32, 16, [45, 3], {"BLOCK_H": 32, "NUM_SPLITS": 1, "BLOCK_N": 16}, id="h80-bh32-one-split",
                 marks=EXHAUSTIVE),
    # the default block (64) at H = 128: two blocks of 64 on a split-K merge, then unsplit
    pytest.param(128, 16, 16, [70, 1, 33], {"NUM_SPLITS": 8, "BLOCK_N": 16, "MERGE_CHUNK": 2}, id="h128-splits",
                 marks=EXHAUSTIVE),
    pytest.param(128, 16, 16, [70, 20], {"NUM_SPLITS": 1}, id="h128-one-split", marks=EXHAUSTIVE),
    # a block that is no power of two (48 of 72: rows padded to 64), ns from cdiv(TARGET_CTAS, B * NHB)
    pytest.param(72, 40, 8, [100, 17], {"BLOCK_H": 48, "NUM_SPLITS": 16, "TARGET_CTAS": 12, "BLOCK_N": 16},
                 id="h72-bh48-ctas", marks=EXHAUSTIVE),
]


@pytest.mark.parametrize("h,dc,dr,lens,tune", HEAD_BLOCK_CASES)
def test_latent_attention_decode_head_blocks(h, dc, dr, lens, tune):
    page = LatentPaged(np.random.default_rng(h + len(lens)), [(L - 1, 1) for L in lens], dc + dr)
    B = len(lens)
    assert _latent("latent_attention_decode", "decode", page, h, dc, dr, tune, {"T": B, "B": B}) <= TOL


def _decode_meta(h, dc=512, dr=64, tune=None, page_size=16):
    d = dc + dr
    k = render("latent_attention_decode", "latent_attention", [("q", ["T", h, d], "bf16"), ("kv", ["T", d], "bf16")],
               [("o", ["T", h, dc], "bf16")], attrs={"scale": 0.1, "rope_dim": dr}, phase="decode",
               caches=latent_caches(d), tune=tune, page_size=page_size)
    return k.meta


def test_latent_attention_decode_head_block_default():
    """All heads in one program up to 64 (no third grid dimension: those plans render as before
    head blocks), blocks of 64 past it; a (sequence, head block) counter each; partial rows for
    B + TARGET_CTAS / NHB (B * ns of them, ns <= cdiv(TARGET_CTAS, B * NHB))."""
    for h in (16, 64):
        meta = _decode_meta(h)
        assert meta["grid"][2] == 1 and "BLOCK_H" not in meta["constexprs"]
        assert meta["scratch"]["counter"] == "B * 4"
    meta = _decode_meta(128)
    assert meta["grid"] == ["B", "min(32, max(1, cdiv(264, B * 2)))", 2]
    assert meta["constexprs"]["BLOCK_H"] == 64 and meta["constexprs"]["H_PAD"] == 64
    assert meta["scratch"] == {"partial_o": f"(B + 132) * {128 * 512 * 4}", "partial_ml": f"(B + 132) * {2 * 128 * 4}",
                               "counter": "B * 8"}
    assert _decode_meta(128, tune={"BLOCK_H": 256})["grid"][2] == 1      # a block past H is all of H
    with pytest.raises(TemplateError, match="BLOCK_H must be a positive int"):
        _decode_meta(128, tune={"BLOCK_H": 0})


@EXHAUSTIVE
@pytest.mark.parametrize("h,page_size", [(128, 16), (128, 64), (64, 64)])
def test_latent_attention_decode_fits_sm90_shared_memory(h, page_size, tmp_path, monkeypatch):
    """DeepSeek-V3's 128 heads of 512 + 64 (and Kimi-K2's 64) compile for sm_90 within its shared
    memory at the default tune, for both tables' pages (H100 16 tokens, H200 64): all 128 heads in
    one program needed 262,144 bytes (294,912 on 64-token pages), past sm_90's 232,448. Compiled
    here by Triton (no GPU) in the build's own worker (a spawned process: this one interprets),
    into an empty kernel cache, and refused by its own check (aot.check_shared) were it past."""
    from infc.compiler.codegen import aot
    monkeypatch.setattr(aot, "CACHE", tmp_path / "kcache")
    monkeypatch.setenv("INFC_CACHE", str(tmp_path / "kcache"))      # the spawned worker reads it
    d = 576
    k = render("latent_attention_decode", "latent_attention", [("q", ["T", h, d], "bf16"), ("kv", ["T", d], "bf16")],
               [("o", ["T", h, 512], "bf16")], attrs={"scale": 0.1, "rope_dim": 64}, phase="decode",
               caches=latent_caches(d), page_size=page_size)
    res = aot.compile_kernels({k.id: k}, tmp_path / "bin", "sm_90", jobs=1, progress=False)
    assert res["compiled"] == [k.id]
    assert 0 < res["kernels"][k.id]["shared"] <= aot.MAX_SHARED[90], res["kernels"][k.id]["shared"]


PREFILL_CASES = [
    # h, dc, dr, (cached, q_len) per sequence, tune
    (4, 32, 16, [(0, 17), (0, 1), (0, 40)], {"BLOCK_M": 8, "BLOCK_H": 2, "BLOCK_N": 16}),    # prefill
    (3, 40, 8, [(40, 1), (0, 23), (19, 9), (5, 1)], {"BLOCK_M": 16, "BLOCK_H": 2, "BLOCK_N": 16}),  # mixed
    (4, 32, 16, [(33, 20), (0, 3)], {}),                                          # default tune
]


@pytest.mark.parametrize("h,dc,dr,specs,tune", PREFILL_CASES)
def test_latent_attention_prefill(h, dc, dr, specs, tune):
    page = LatentPaged(np.random.default_rng(len(specs) + dc), specs, dc + dr)
    dims = {"T": page.T, "B": page.B}
    assert _latent("latent_attention_prefill", "mixed", page, h, dc, dr, tune, dims) <= TOL


HEAD_LINEAR_CASES = [
    # rows, H, N, K, tune
    (5, 3, 24, 40, {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16}),
    (19, 2, 70, 9, {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16}),
    (1, 4, 16, 33, {}),
    # decode's default for a long K (each program's W tile at most 32 KB): BLOCK_N 16, BLOCK_K 128,
    # N and K past whole tiles
    (2, 2, 40, 600, {}),
]


@pytest.mark.parametrize("rows,h,n,kd,tune", HEAD_LINEAR_CASES)
def test_head_linear(rows, h, n, kd, tune):
    gen = np.random.default_rng(rows)
    x, w = rand((rows, h, kd), gen=gen), rand((h, n, kd), gen=gen)
    k = render("head_linear", "head_linear", [("x", ["T", h, kd], "bf16"), ("w", [h, n, kd], "bf16", "weight")],
               [("y", ["T", h, n], "bf16")], phase="decode", tune=tune)
    y_full = poison((rows + 2, h, n))
    y = y_full[:rows]
    run(k, {"in:0": x, "in:1": w, "out:0": y}, {"T": rows, "B": 1})
    assert torch.isnan(y_full[rows:].float()).all()
    want = REGISTRY["head_linear"].reference(None, x.float().numpy(), w.float().numpy())
    assert rel_err(y.float().numpy(), want) <= TOL


def test_head_linear_reads_a_column_slice_in_place():
    """x as the first columns of a wider fused row (MLA's q_nope inside q | q_pe | kv_a): the
    kernel reads it at its row stride, nothing copies it."""
    rows, h, n, kd, extra = 5, 3, 40, 24, 37
    gen = np.random.default_rng(9)
    wide, w = rand((rows, h * kd + extra), gen=gen), rand((h, n, kd), gen=gen)
    k = render("head_linear", "head_linear",
               [("x", ["T", h, kd], "bf16", "buffer", {"row_stride": h * kd + extra}), ("w", [h, n, kd], "bf16", "weight")],
               [("y", ["T", h, n], "bf16")], phase="decode", tune={"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16})
    y = poison((rows, h, n))
    run(k, {"in:0": wide, "in:1": w, "out:0": y}, {"T": rows, "B": 1})
    x = wide[:, : h * kd].reshape(rows, h, kd)
    want = REGISTRY["head_linear"].reference(None, x.float().numpy(), w.float().numpy())
    assert rel_err(y.float().numpy(), want) <= TOL


def test_infer_rules():
    la, hl = REGISTRY["latent_attention"], REGISTRY["head_linear"]
    q, kv = TensorType(("T", 4, 576), "bf16"), TensorType(("T", 576), "bf16")
    (o,) = la.infer([q, kv], {"scale": 0.1, "rope_dim": 64})
    assert o.shape == ("T", 4, 512)
    assert la.caches([q, kv], {}) == {"latent": {"kind": "paged", "shape": [576], "dtype": "bf16"}}
    with pytest.raises(ShapeError):
        la.infer([q, TensorType(("T", 512), "bf16")], {"scale": 0.1, "rope_dim": 64})
    with pytest.raises(ShapeError):
        la.infer([q, kv], {"scale": None, "rope_dim": 64})
    (y,) = hl.infer([TensorType(("T", 4, 128), "bf16"), TensorType((4, 512, 128), "bf16")], {})
    assert y.shape == ("T", 4, 512)
    with pytest.raises(ShapeError):
        hl.infer([TensorType(("T", 4, 128), "bf16"), TensorType((4, 512, 64), "bf16")], {})


# ---------------------------------------------------------------------------------------------
# the absorbed path against transformers' DeepseekV2Attention

def _rms(x, w, eps):
    x = np.asarray(x, np.float32)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + np.float32(eps)) * w


@pytest.mark.parametrize("q_lora", [None, 24])
def test_absorbed_mla_matches_hf_deepseek_v2(q_lora):
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Attention, DeepseekV2RotaryEmbedding
    torch.manual_seed(0)
    H, Dn, Dr, Dv, Dc, hidden, T = 4, 8, 4, 6, 16, 32, 11
    cfg = DeepseekV2Config(hidden_size=hidden, num_attention_heads=H, num_key_value_heads=H, q_lora_rank=q_lora,
                           kv_lora_rank=Dc, qk_nope_head_dim=Dn, qk_rope_head_dim=Dr, v_head_dim=Dv,
                           intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=1,
                           max_position_embeddings=64, attention_bias=False)
    cfg._attn_implementation = "eager"
    att = DeepseekV2Attention(cfg, 0).eval()
    with torch.no_grad():
        for p in att.parameters():          # norm weights too (HF initialises them to one)
            p.copy_(torch.randn_like(p) * (0.3 if p.ndim > 1 else 0.2) + (1.0 if p.ndim == 1 else 0.0))
    rot = DeepseekV2RotaryEmbedding(cfg)
    assert rot.inv_freq.shape[0] == Dr // 2
    x = torch.randn(1, T, hidden)
    pos = torch.arange(T)[None]
    mask = torch.triu(torch.full((T, T), float("-inf")), 1)[None, None]
    with torch.no_grad():
        want = att(x, attention_mask=mask, position_embeddings=rot(x, pos))[0][0].numpy()

    W = {n: p.detach().numpy().astype(np.float32) for n, p in att.named_parameters()}
    eps, theta = cfg.rms_norm_eps, cfg.rope_parameters["rope_theta"]
    xs = x[0].numpy()
    positions = np.arange(T)
    if q_lora is None:
        q = xs @ W["q_proj.weight"].T
    else:
        q = _rms(xs @ W["q_a_proj.weight"].T, W["q_a_layernorm.weight"], eps) @ W["q_b_proj.weight"].T
    q = q.reshape(T, H, Dn + Dr)
    q_nope, q_pe = q[..., :Dn], q[..., Dn:]
    ckv = xs @ W["kv_a_proj_with_mqa.weight"].T
    c = _rms(ckv[:, :Dc], W["kv_a_layernorm.weight"], eps)
    k_pe = ckv[:, None, Dc:]
    # HF's rope here is interleaved (complex pairs x[2j], x[2j+1]) over all Dr dims
    q_pe = rotate(q_pe, positions, theta, None, rotary_dim=Dr, interleaved=True)
    k_pe = rotate(k_pe, positions, theta, None, rotary_dim=Dr, interleaved=True)[:, 0]
    # the weight transforms the spec will express: kv_b_proj.weight [H * (Dn + Dv), Dc]
    Wb = W["kv_b_proj.weight"].reshape(H, Dn + Dv, Dc)
    w_uk = Wb[:, :Dn, :].transpose(0, 2, 1)        # [H, Dc, Dn]: q_lat[h] = W_uk[h]^T q_nope[h]
    w_uv = Wb[:, Dn:, :]                           # [H, Dv, Dc]
    hl, la = REGISTRY["head_linear"].reference, REGISTRY["latent_attention"].reference
    q_lat = np.concatenate([hl(None, q_nope, w_uk), q_pe], -1)    # [T, H, Dc + Dr]
    kv = np.concatenate([c, k_pe], -1)                           # [T, Dc + Dr]
    scale = (Dn + Dr) ** -0.5                                    # HF's scaling (no YaRN mscale here)

    # the prompt in two steps: a 5-token prefix, then 6 tokens over the cached prefix (page 4)
    ps, split = 4, 5
    cache = np.full((5, ps, Dc + Dr), np.nan, np.float32)
    bt = np.array([[3, 0, 2, 4, 4]], np.int32)
    o_lat = np.zeros((T, H, Dc), np.float32)
    for lo, hi in ((0, split), (split, T)):
        slots = [bt[0, j // ps] * ps + j % ps for j in range(lo, hi)]
        ctx = Ctx([(lo, hi - lo)], {"latent": cache}, slot_mapping=slots, block_tables=bt, page_size=ps)
        o_lat[lo:hi] = la(ctx, q_lat[lo:hi], kv[lo:hi], scale=scale, rope_dim=Dr)
    o = hl(None, o_lat, w_uv).reshape(T, H * Dv)
    got = o @ W["o_proj.weight"].T
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-4
