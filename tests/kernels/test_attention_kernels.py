"""The attention-side kernels under the interpreter, against their ops' numpy references:
rope (default / linear / llama3 / yarn, partial rotary, row-strided input), kv_write, the fused
qk_norm_rope_cache, and paged attention (prefill / mixed and split-KV decode) with GQA, custom
scale, sliding window and logit softcap. The numpy rope reference is itself checked against
transformers' rope init functions and rotate-half application (float32).

Caches are laid out as the runtime's: [num_pages + 1, page_size, Hkv, D] per layer (the last page
is the CUDA-graph padding page). Pages are permuted, non-contiguous page assignment; pages no
sequence owns, the tails of last pages and the block-table entries past a sequence's pages are NaN
(or point at a NaN page), so a read of a surplus key or page shows up as NaN in the output. Context
lengths are not multiples of the page or tile sizes.
"""
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from infc.compiler.ops import REGISTRY, ShapeError
from infc.compiler.ops.rope import rope_parameters, rotate

from .harness import poison, rand, rel_err, render, run

PS = 16
TOL = 1e-2
LLAMA3 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
LINEAR = {"rope_type": "linear", "factor": 4.0}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}
YARN_MSCALE = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
               "mscale": 1.0, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1}   # DeepSeek-style
YARN_NOTRUNC = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 2048,
                "truncate": False, "attention_factor": 1.3, "beta_fast": 24}


def cdiv(a, b):
    return -(-a // b)


def kv_caches(hkv, d):
    entry = {"kind": "paged", "shape": [hkv, d], "dtype": "bf16", "layers": [0]}
    return {"k": dict(entry), "v": dict(entry)}


class Ctx:
    """What op references receive (the reference executor's ctx API): sequences given as
    (cached, n new) in batch order, step metadata, and this layer's float32 caches."""

    def __init__(self, specs, caches=None, slot_mapping=None, block_tables=None, page_size=PS):
        self.seqs, pos, rows = [], [], 0
        for b, (cached, n) in enumerate(specs):
            self.seqs.append((b, rows, n, cached))
            pos += range(cached, cached + n)
            rows += n
        self.T, self.B, self.layer, self.page_size = rows, len(specs), 0, page_size
        self.positions = np.asarray(pos, np.int64)
        self.last_rows = np.cumsum([n for _, n in specs]) - 1
        self.meta = SimpleNamespace(
            slot_mapping=None if slot_mapping is None else np.asarray(slot_mapping, np.int64),
            block_tables=block_tables, context_lens=np.asarray([c + n for c, n in specs]),
            seq_starts=np.cumsum([0] + [n for _, n in specs]))
        self.caches = caches or {}

    def cache(self, name):
        return self.caches[name]

    def dim(self, d):
        return {"T": self.T, "B": self.B}.get(d, d)


# ---------------------------------------------------------------------------------------------
# rope: the numpy reference against transformers

def _hf_rope(x, pos, theta, params, head_dim):
    """transformers' rope for these parameters: its init function's (inv_freq, attention_scaling),
    then what every *RotaryEmbedding.forward + apply_rotary_pos_emb does, in float32."""
    from transformers import StableLmConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.stablelm.modeling_stablelm import StableLmRotaryEmbedding, rotate_half
    factor = params.get("factor") or 1.0
    old = params.get("original_max_position_embeddings", 4096)
    cfg = StableLmConfig(hidden_size=head_dim * 4, num_attention_heads=4, partial_rotary_factor=1.0,
                         max_position_embeddings=int(old * factor),
                         rope_parameters={"rope_theta": theta, **params})
    kind = params.get("rope_type", "default")
    init = StableLmRotaryEmbedding.compute_default_rope_parameters if kind == "default" else ROPE_INIT_FUNCTIONS[kind]
    inv, att = init(cfg)
    freqs = (inv[None, :, None].float() @ torch.from_numpy(pos)[None, None, :].float()).transpose(1, 2)[0]
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = (emb.cos() * att)[:, None], (emb.sin() * att)[:, None]
    xt = torch.from_numpy(x)
    r = 2 * inv.shape[0]
    out = torch.cat([xt[..., :r] * cos + rotate_half(xt[..., :r]) * sin, xt[..., r:]], -1)
    return out.numpy(), inv.numpy(), att, r


HF_CASES = [
    # scaling, head_dim, partial_rotary_factor
    ({"rope_type": "default"}, 64, None),
    ({"rope_type": "default"}, 128, 0.5),
    ({"rope_type": "default"}, 80, 0.25),        # R = 20: R/2 not a power of two
    (LINEAR, 64, None),
    (LLAMA3, 128, None),
    (YARN, 64, None),
    (YARN_MSCALE, 64, None),
    (YARN_NOTRUNC, 128, 0.75),
    ({**YARN, "factor": 0.5}, 96, None),          # factor <= 1: attention factor 1
]


@pytest.mark.parametrize("scaling,head_dim,partial", HF_CASES)
def test_rope_reference_matches_transformers(scaling, head_dim, partial):
    gen = np.random.default_rng(head_dim)
    params = {**scaling, **({"partial_rotary_factor": partial} if partial else {})}
    theta = 10000.0
    small = np.arange(24)
    big = gen.integers(1000, 40000, 16)
    pos = np.concatenate([small, big]).astype(np.int64)
    x = gen.standard_normal((len(pos), 3, head_dim)).astype(np.float32)
    want, hf_inv, hf_att, r = _hf_rope(x, pos, theta, params, head_dim)
    inv, att = rope_parameters(r, theta, params)
    # inv_freq: ours is fp64 rounded once, HF's is fp32 throughout: a few ulp apart
    assert np.abs(inv / hf_inv - 1).max() < 1e-6
    assert att == pytest.approx(hf_att, rel=1e-12)
    # the rotary dim comes from partial_rotary_factor in the scaling dict, or from rotary_dim
    got = rotate(x, pos, theta, params)
    assert np.array_equal(got, rotate(x, pos, theta, scaling, rotary_dim=r))
    n = len(small)
    assert np.abs(got[:n] - want[:n]).max() < 4e-6 * max(att, 1.0)
    # at large positions an ulp of inv_freq moves the fp32 angle by ~p * 6e-8 (in HF too)
    assert np.abs(got[n:] - want[n:]).max() < 4e-3
    assert np.array_equal(got[..., r:], x[..., r:])


@pytest.mark.parametrize("scaling,match", [
    ({"rope_type": "dynamic", "factor": 2.0}, "unsupported rope_type 'dynamic'"),
    ({"rope_type": "longrope", "short_factor": [1.0]}, "unsupported rope_type 'longrope'"),
    ({"rope_type": "yarn", "factor": 4.0}, "needs 'original_max_position_embeddings'"),
    ({"rope_type": "linear"}, "needs 'factor'"),
    ({"full_attention": {"rope_type": "default"}, "sliding_attention": {"rope_type": "default"}}, "nested"),
    ({"partial_rotary_factor": 0.5, "rope_type": "default"}, None),
])
def test_rope_refuses_what_it_cannot_do(scaling, match):
    from infc.compiler.ir import TensorType
    op = REGISTRY["rope"]
    x = TensorType(("T", 4, 64), "bf16")
    if match is None:
        assert op.infer([x], {"theta": 1e4, "scaling": scaling, "rotary_dim": 32}) == [x]
        # a given rotary_dim wins over the factor (a fraction of HF's head_dim, not x's)
        assert op.infer([x], {"theta": 1e4, "scaling": scaling, "rotary_dim": 16}) == [x]
        from infc.compiler.ops.rope import rotary_dims
        assert rotary_dims(64, scaling, 16) == 16 and rotary_dims(64, scaling, None) == 32
        with pytest.raises(ShapeError, match="must be even"):
            op.infer([x], {"theta": 1e4, "scaling": None, "rotary_dim": 33})
        return
    with pytest.raises(ShapeError, match=match):
        op.infer([x], {"theta": 1e4, "scaling": scaling, "rotary_dim": None})


# ---------------------------------------------------------------------------------------------
# rope kernel

ROPE_CASES = [
    # heads, D, rotary_dim, scaling, row_stride (None: contiguous), tune, positions
    (4, 64, None, None, None, {}, [0, 1, 5, 17, 4095, 4096, 70000]),
    (3, 128, 64, YARN, 3 * 128 + 40, {"BLOCK_H": 2, "BLOCK_T": 3}, list(range(9)) + [9000, 131000]),
    (5, 80, 40, LINEAR, 1000, {"BLOCK_H": 8}, [3, 2000, 50000, 7]),       # R/2 = 20, pass-through 40
    (2, 128, None, LLAMA3, None, {"BLOCK_T": 2}, [0, 8191, 8192, 120000, 33]),
    (4, 96, None, YARN_MSCALE, 4 * 96 + 8, {}, [1, 100, 4096, 160000, 12]),
    (1, 64, 48, YARN_NOTRUNC, None, {"BLOCK_H": 1, "BLOCK_T": 1}, [0, 300, 20000]),
]


@pytest.mark.parametrize("heads,d,rot,scaling,stride,tune,positions", ROPE_CASES)
def test_rope_kernel(heads, d, rot, scaling, stride, tune, positions):
    gen = np.random.default_rng(heads * 1000 + d)
    attrs = {"theta": 1000000.0 if scaling is None else 10000.0, "scaling": scaling, "rotary_dim": rot}
    extra = {"row_stride": stride} if stride else {}
    k = render("rope", "rope", [("x", ["T", heads, d], "bf16", "buffer", extra)], [("o", ["T", heads, d], "bf16")],
               attrs=attrs, phase="prefill", tune=tune)
    T = len(positions)
    width = stride or heads * d
    wide = rand((T + 2, width), gen=gen, scale=2.0)          # the view starts at column 0 of a wider row
    x = wide[:T, : heads * d].reshape(T, heads, d)
    out_full = poison((T + 2, heads, d))
    out = out_full[:T]
    run(k, {"in:0": wide.view(-1), "out:0": out,
            "meta:positions": torch.tensor(positions, dtype=torch.int32)}, {"T": T, "B": 1})
    assert torch.isnan(out_full[T:].float()).all(), "wrote rows past T"
    ctx = Ctx([(0, T)])
    ctx.positions = np.asarray(positions, np.int64)
    want = REGISTRY["rope"].reference(ctx, x.float().numpy(), **attrs)
    got = out.float().numpy()
    assert rel_err(got, want) <= TOL
    assert np.abs(got - want).max() <= 2 ** -7 * np.abs(want).max()
    r = rot or d
    assert np.array_equal(got[..., r:], x.float().numpy()[..., r:])       # pass-through is a copy


# ---------------------------------------------------------------------------------------------
# kv_write

@pytest.mark.parametrize("hkv,d,strided,tune", [
    (2, 64, True, {}),
    (3, 96, False, {"BLOCK_H": 2, "BLOCK_T": 3}),
    (1, 128, True, {"BLOCK_T": 1}),
])
def test_kv_write(hkv, d, strided, tune):
    gen = np.random.default_rng(hkv * 10 + d)
    hq = 2 * hkv
    width = (hq + 2 * hkv) * d if strided else hkv * d
    extra = {"row_stride": width} if strided else {}
    k = render("kv_write", "kv_write", [("k", ["T", hkv, d], "bf16", "buffer", extra),
                                        ("v", ["T", hkv, d], "bf16", "buffer", extra)],
               [("cache", [], "", "cache")], caches=kv_caches(hkv, d), phase="prefill", tune=tune)
    specs = [(0, 19), (40, 1), (3, 6)]
    T = sum(n for _, n in specs) + 1                 # one padding row (slot -1) at the end
    n_pages = 12
    slots = _slots(gen, [(c, n) for c, n in specs], n_pages) + [-1]
    if strided:                                      # k and v are column slices of one qkv buffer
        qkv = rand((T, width), gen=gen)
        kin, vin = qkv.view(-1)[hq * d:], qkv.view(-1)[(hq + hkv) * d:]
        kval = qkv[:, hq * d:(hq + hkv) * d].reshape(T, hkv, d)
        vval = qkv[:, (hq + hkv) * d:].reshape(T, hkv, d)
    else:
        kin, vin = rand((T, hkv, d), gen=gen), rand((T, hkv, d), gen=gen)
        kval, vval = kin, vin
    kc, vc = poison((n_pages + 1, PS, hkv, d)), poison((n_pages + 1, PS, hkv, d))
    run(k, {"in:0": kin, "in:1": vin, "cache:k": kc, "cache:v": vc,
            "meta:slot_mapping": torch.tensor(slots, dtype=torch.int32)}, {"T": T, "B": len(specs) + 1})
    ref = {"k": np.full(kc.shape, np.nan, np.float32), "v": np.full(vc.shape, np.nan, np.float32)}
    ctx = Ctx(specs + [(7, 1)], ref, slot_mapping=slots)
    REGISTRY["kv_write"].reference(ctx, kval.float().numpy(), vval.float().numpy())
    for got, want in ((kc, ref["k"]), (vc, ref["v"])):
        got = got.float().numpy()
        assert np.array_equal(np.isnan(got), np.isnan(want)), "wrote a slot it should not have"
        assert np.array_equal(got[~np.isnan(got)], want[~np.isnan(want)])   # bf16 copied exactly


# ---------------------------------------------------------------------------------------------
# qk_norm_rope_cache

def _slots(gen, starts_lens, n_pages):
    """Slot of each new token: logical pages mapped to distinct random physical pages."""
    perm = list(gen.permutation(n_pages))
    slots = []
    for start, n in starts_lens:
        phys = {}
        for p in range(start, start + n):
            if p // PS not in phys:
                phys[p // PS] = perm.pop()
            page = phys[p // PS]
            slots.append(int(page) * PS + p % PS)
    return slots


@pytest.mark.parametrize("hq,hkv,d,q_norm,k_norm,scaling,rot,tune,seqs", [
    (4, 2, 64, True, True, None, None, {"BLOCK_H": 2, "BLOCK_T": 4},
     [(0, 17), (70000, 3), (4090, 12)]),                                      # qwen3-like, long position
    (8, 2, 128, False, False, LLAMA3, None, {"BLOCK_H": 4, "BLOCK_T": 3},
     [(0, 5), (131000, 2), (8190, 4)]),                                       # llama3 scaling
    (2, 2, 64, True, False, LLAMA3, None, {"BLOCK_H": 8}, [(30, 1), (90000, 1)]),  # q|k heads in one tile
    (3, 1, 24, False, True, None, None, {}, [(1, 7)]),                       # head_dim not a power of 2
    (4, 2, 64, True, True, YARN, 32, {"BLOCK_H": 4, "BLOCK_T": 2},
     [(0, 9), (20000, 3)]),                                                   # partial rotary + yarn
    (6, 2, 96, True, True, {**LINEAR, "partial_rotary_factor": 0.5}, None, {},
     [(5, 6), (3000, 2)]),                                                    # R from the scaling dict
    (2, 1, 128, False, False, YARN_MSCALE, 80, {"BLOCK_H": 2}, [(0, 4), (100000, 1)]),   # no norms, R < D
])
def test_qk_norm_rope_cache(hq, hkv, d, q_norm, k_norm, scaling, rot, tune, seqs, extra=0):
    """extra: columns after [q | k | v] in each row (another part of the fused projection, Qwen3.5's
    output gate), never read."""
    gen = np.random.default_rng(hq * 100 + d)
    theta = 500000.0 if scaling else 1000000
    attrs = {"q_heads": hq, "kv_heads": hkv, "head_dim": d, "eps": 1e-6, "theta": theta, "scaling": scaling,
             "rotary_dim": rot, "q_norm": q_norm, "k_norm": k_norm}
    W = (hq + 2 * hkv) * d + extra
    inputs = [("qkv", ["T", W], "bf16")]
    inputs += [("q_norm", [d], "bf16", "weight")] * q_norm + [("k_norm", [d], "bf16", "weight")] * k_norm
    k = render("qk_norm_rope_cache", "qk_norm_rope_cache", inputs,
               [("q", ["T", hq, d], "bf16"), ("cache", [], "", "cache")], attrs=attrs,
               caches=kv_caches(hkv, d), tune=tune)
    # one extra padding row (slot -1) after the sequences: it must not touch the cache
    T = sum(n for _, n in seqs) + 1
    GUARD = 5          # rows past T in every per-token buffer: a program must not touch them
    qkv = rand((T + GUARD, W), gen=gen, scale=3.0)
    qkv[:, (hq + 2 * hkv) * d:] = float("nan")                   # the columns it must not read
    norms = [1 + 0.3 * rand((d,), gen=gen).float() for _ in range(q_norm + k_norm)]
    norms = [w.to(torch.bfloat16) for w in norms]
    n_pages = sum(cdiv(n, PS) + 1 for _, n in seqs) + 4
    slots = _slots(gen, seqs, n_pages) + [-1]
    free = [s for s in range(n_pages * PS) if s not in set(slots)]
    k_cache, v_cache = poison((n_pages + 1, PS, hkv, d)), poison((n_pages + 1, PS, hkv, d))
    q_full = poison((T + GUARD, hq, d))
    q = q_full[:T]
    positions = [p for start, n in seqs for p in range(start, start + n)] + [5]
    b = {"in:0": qkv[:T], "out:0": q, "cache:k": k_cache, "cache:v": v_cache,
         "meta:positions": torch.tensor(positions + [7] * GUARD, dtype=torch.int32)[:T],
         "meta:slot_mapping": torch.tensor(slots + free[:GUARD], dtype=torch.int32)[:T]}
    for i, w in enumerate(norms):
        b[f"in:{i + 1}"] = w
    run(k, b, {"T": T, "B": len(seqs) + 1})
    assert torch.isnan(q_full[T:].float()).all(), "wrote q rows past T"
    qkv = qkv[:T]

    # reference: the fused op's own numpy reference (rms + rotate + kv write)
    ref = {n: np.full(k_cache.shape, np.nan, np.float32) for n in ("k", "v")}
    ctx = Ctx(seqs + [(5, 1)], ref, slot_mapping=slots)
    want_q, _ = REGISTRY["qk_norm_rope_cache"].reference(ctx, qkv.float().numpy(),
                                                          *[w.float().numpy() for w in norms], **attrs)
    assert rel_err(q.float().numpy(), want_q) <= TOL
    flat = lambda c: c.reshape(-1, hkv, d)                       # noqa: E731
    got_slots = np.asarray(slots[:-1])
    assert rel_err(flat(k_cache.float().numpy())[got_slots], flat(ref["k"])[got_slots]) <= TOL
    assert np.array_equal(flat(v_cache.float().numpy())[got_slots], flat(ref["v"])[got_slots])  # v copied
    untouched = np.ones(flat(ref["k"]).shape[0], bool)
    untouched[got_slots] = False
    assert torch.isnan(k_cache.view(-1, hkv, d)[torch.from_numpy(untouched)].float()).all()
    assert torch.isnan(v_cache.view(-1, hkv, d)[torch.from_numpy(untouched)].float()).all()
    r = rot or d * (scaling or {}).get("partial_rotary_factor", 1)
    if r < d and not q_norm:                                     # pass-through dims: copied exactly
        src = qkv[:, :hq * d].reshape(T, hq, d)[..., int(r):]
        assert torch.equal(q[..., int(r):], src)


@pytest.mark.parametrize("hq,hkv,d,q_norm,k_norm,scaling,rot,tune,seqs", [
    (4, 2, 64, True, True, None, 16, {"BLOCK_H": 2, "BLOCK_T": 4}, [(0, 17), (4090, 12)]),   # Qwen3.5-like
    (2, 1, 128, False, False, YARN_MSCALE, 80, {"BLOCK_H": 2}, [(0, 4), (100000, 1)]),
])
def test_qk_norm_rope_cache_reads_q_k_v_of_a_wider_row(hq, hkv, d, q_norm, k_norm, scaling, rot, tune, seqs):
    """A row of [q | k | v | gate] (Qwen3.5's fused projection): q, k, v as from [q | k | v] alone,
    the gate's columns (NaN here) never read."""
    test_qk_norm_rope_cache(hq, hkv, d, q_norm, k_norm, scaling, rot, tune, seqs, extra=hq * d)


@pytest.mark.parametrize("wdtype", ["bf16", "f32"])
def test_qk_norm_order_of_roundings_follows_the_weight_dtype(wdtype):
    """HF's q/k RMSNorm: a bf16 weight multiplies the bf16-rounded normalized head (Qwen3's
    `w * n.to(dtype)`), an f32 weight (the 1 + w.float() of Gemma3 and Qwen3.5, which the compiler
    keeps f32) multiplies in fp32 before one rounding. Checked exactly on the pass-through dims
    (normed, not rotated: rotary_dim 32 of 64), which the kernel stores as the norm left them."""
    from .test_norm_kernels import assert_hf_order, hf_scale, norm_weight, other_order
    gen = np.random.default_rng(11)
    hq, hkv, d, rot = 4, 2, 64, 32
    attrs = {"q_heads": hq, "kv_heads": hkv, "head_dim": d, "eps": 1e-6, "theta": 1e6, "scaling": None,
             "rotary_dim": rot, "q_norm": True, "k_norm": True}
    k = render("qk_norm_rope_cache", "qk_norm_rope_cache",
               [("qkv", ["T", (hq + 2 * hkv) * d], "bf16"), ("q_norm", [d], wdtype, "weight"),
                ("k_norm", [d], wdtype, "weight")],
               [("q", ["T", hq, d], "bf16"), ("cache", [], "", "cache")], attrs=attrs,
               caches=kv_caches(hkv, d))
    T = 9
    qkv = rand((T, (hq + 2 * hkv) * d), gen=gen, scale=3.0)
    wq, wk = norm_weight(d, wdtype, gen), norm_weight(d, wdtype, gen)
    k_cache, v_cache = poison((4, PS, hkv, d)), poison((4, PS, hkv, d))
    q = poison((T, hq, d))
    run(k, {"in:0": qkv, "in:1": wq, "in:2": wk, "out:0": q, "cache:k": k_cache, "cache:v": v_cache,
            "meta:positions": torch.arange(T, dtype=torch.int32),
            "meta:slot_mapping": torch.arange(T, dtype=torch.int32)}, {"T": T, "B": 1})
    x = qkv[:, :hq * d].float().numpy().astype(np.float64).reshape(T, hq, d)
    normed = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + 1e-6)
    want = hf_scale(normed, wq)[..., rot:]
    assert_hf_order(q.float().numpy()[..., rot:], want, other_order(normed, wq)[..., rot:])


def test_rope_positions_beyond_4096_are_not_aliased():
    """A position table of 4096 would wrap; the rotation at 70000 must differ from 70000 % 4096."""
    gen = np.random.default_rng(7)
    d, hq = 64, 2
    attrs = {"q_heads": hq, "kv_heads": 1, "head_dim": d, "eps": 0.0, "theta": 10000.0, "scaling": None,
             "q_norm": False, "k_norm": False}
    k = render("qk_norm_rope_cache", "qk_norm_rope_cache", [("qkv", ["T", (hq + 2) * d], "bf16")],
               [("q", ["T", hq, d], "bf16"), ("cache", [], "", "cache")], attrs=attrs, caches=kv_caches(1, d))
    row = rand((1, (hq + 2) * d), gen=gen)
    qkv = row.repeat(2, 1)
    positions = torch.tensor([70000, 70000 % 4096], dtype=torch.int32)
    q = poison((2, hq, d))
    kc, vc = poison((2, PS, 1, d)), poison((2, PS, 1, d))
    run(k, {"in:0": qkv, "out:0": q, "cache:k": kc, "cache:v": vc, "meta:positions": positions,
            "meta:slot_mapping": torch.tensor([0, 1], dtype=torch.int32)}, {"T": 2, "B": 2})
    want = rotate(qkv[:, :hq * d].float().numpy().reshape(2, hq, d), positions.numpy(), 10000.0, None)
    assert rel_err(q[0].float().numpy(), want[0]) <= TOL
    assert rel_err(q[0].float().numpy(), want[1]) > 0.1


# ---------------------------------------------------------------------------------------------
# attention

class Paged:
    """A paged KV cache for sequences given as (cached, q_len), keys written for all of each
    sequence's context_len = cached + q_len positions. Sequence 1 may share sequence 0's first
    `share` pages (a shared prefix: same physical pages, same contents). Storage has the runtime's
    extra padding page at the end; block-table padding points at an all-NaN page."""

    def __init__(self, gen, specs, hkv, d, share=0, extra_pages=3, page_size=PS):
        self.specs, self.B, self.ps = specs, len(specs), page_size
        PS = page_size
        lens = [c + n for c, n in specs]
        n_pages = [cdiv(L, PS) for L in lens]
        own = [n - (share if i == 1 else 0) for i, n in enumerate(n_pages)]
        total = sum(own) + extra_pages
        perm = [int(p) for p in gen.permutation(total)]
        self.poison_page = perm.pop()                 # block-table padding points here (all NaN)
        self.pages = []
        for i, n in enumerate(own):
            mine = [perm.pop() for _ in range(n)]
            self.pages.append((self.pages[0][:share] if i == 1 else []) + mine)
        self.max_pages = max(n_pages) + 2
        bt = np.full((self.B, self.max_pages), self.poison_page, np.int32)
        for i, p in enumerate(self.pages):
            bt[i, :len(p)] = p
        self.block_tables = torch.from_numpy(bt)
        self.context_lens = torch.tensor(lens, dtype=torch.int32)
        starts = np.cumsum([0] + [n for _, n in specs]).astype(np.int32)
        self.seq_starts = torch.from_numpy(starts)
        self.T = int(starts[-1])
        self.k_cache = poison((total + 1, PS, hkv, d))
        self.v_cache = poison((total + 1, PS, hkv, d))
        kv = {}
        for i, L in enumerate(lens):
            K, V = rand((L, hkv, d), gen=gen), rand((L, hkv, d), gen=gen)
            if i == 1 and share:
                K[:share * PS], V[:share * PS] = kv[0][0][:share * PS], kv[0][1][:share * PS]
            kv[i] = (K, V)
            for j in range(L):
                page = self.pages[i][j // PS]
                self.k_cache[page, j % PS], self.v_cache[page, j % PS] = K[j], V[j]
        self.ctx = Ctx(specs, {"k": self.k_cache.float().numpy(), "v": self.v_cache.float().numpy()},
                       block_tables=bt, page_size=PS)

    def bindings(self):
        return {"cache:k": self.k_cache, "cache:v": self.v_cache, "meta:block_tables": self.block_tables,
                "meta:context_lens": self.context_lens, "meta:seq_starts": self.seq_starts,
                "meta:max_pages": self.max_pages}

    def hide_below_window(self, window, chunk=None):
        """Point each sequence's block-table entries for pages entirely below its first query's
        window (or chunk: both when both are given) at the NaN page: a kernel that reads a key
        there unmasked outputs NaN (the reference keeps reading the real pages)."""
        bt = self.block_tables.clone()
        for i, (c, n) in enumerate(self.specs):
            first_q = c                                   # the earliest query position
            lo = max(first_q - (window or first_q + 1) + 1, (first_q // chunk * chunk) if chunk else 0, 0)
            bt[i, : lo // self.ps] = self.poison_page
        self.block_tables = bt
        return self


def _attention(template, phase, page, hq, d, tune, dims, scale=None, window=None, softcap=None, q_scale=1.0,
               sinks=None, **mods):
    """The kernel's relative error against the reference; sinks: the per-head sink logits (f32 [hq]);
    mods: attention_cached's extra attrs (alibi, chunk, temp_floor / temp_scale)."""
    gen = np.random.default_rng(1)
    hkv = page.k_cache.shape[2]
    q = rand((page.T, hq, d), gen=gen, scale=q_scale)
    attrs = {"kv_heads": hkv, "scale": scale, "window": window, "softcap": softcap, **mods}
    inputs = [("q", ["T", hq, d], "bf16"), ("cache", [], "", "cache")]
    bind, extra = {}, ()
    if sinks is not None:
        attrs["has_sinks"] = True
        inputs.append(("sinks", [hq], "f32"))
        bind["in:2"] = torch.from_numpy(np.asarray(sinks, np.float32))
        extra = (np.asarray(sinks, np.float32),)
    k = render(template, "attention_cached", inputs,
               [("o", ["T", hq, d], "bf16")], attrs=attrs, phase=phase, caches=kv_caches(hkv, d), tune=tune,
               page_size=page.ps)
    o_full = poison((page.T + 3, hq, d))             # rows past T must stay unwritten
    o = o_full[:page.T]
    run(k, {"in:0": q, "out:0": o, **bind, **page.bindings()}, dims)
    assert torch.isnan(o_full[page.T:].float()).all(), "wrote output rows past T"
    want = REGISTRY["attention_cached"].reference(page.ctx, q.float().numpy(), None, *extra, **attrs)
    return rel_err(o.float().numpy(), want)


DECODE_CASES = [
    # hq, hkv, d, context lens, tune, extra attrs
    (2, 2, 64, [1, 15, 17, 70], {"NUM_SPLITS": 4, "BLOCK_N": 16}, {}),                 # G = 1
    (4, 2, 128, [33, 600], {"NUM_SPLITS": 8, "BLOCK_N": 32, "MERGE_CHUNK": 2}, {}),    # long context
    (8, 2, 64, [70, 5, 600], {"NUM_SPLITS": 16, "BLOCK_N": 16}, {}),                   # G = 4, 16 splits
    (8, 2, 64, [600, 3, 129], {"NUM_SPLITS": 16, "BLOCK_N": 32, "TARGET_CTAS": 8}, {}),  # ns = 2
    (4, 1, 64, [40, 200], {}, {}),                                                     # default tune
    (6, 2, 96, [77, 300], {"NUM_SPLITS": 4, "BLOCK_N": 32}, {"scale": 0.0625}),        # D = 96, scale
    (4, 2, 64, [300, 40, 9, 161], {"NUM_SPLITS": 4, "BLOCK_N": 16}, {"window": 37}),   # sliding window
    (8, 4, 128, [500, 64, 65], {"NUM_SPLITS": 8, "BLOCK_N": 32}, {"window": 64}),      # window = page multiple
    (4, 1, 64, [260, 31], {"BLOCK_N": 64}, {"window": 100}),                           # default splits
    (4, 2, 64, [90, 7, 333], {"NUM_SPLITS": 4, "BLOCK_N": 32}, {"softcap": 5.0}),      # softcap saturates
    (2, 1, 128, [150, 41], {"NUM_SPLITS": 2, "BLOCK_N": 16},
     {"softcap": 50.0, "window": 48, "scale": 0.1}),                                   # Gemma 2-like
]


@pytest.mark.parametrize("hq,hkv,d,lens,tune,extra", DECODE_CASES)
def test_attention_decode(hq, hkv, d, lens, tune, extra):
    gen = np.random.default_rng(len(lens) * 10 + d)
    page = Paged(gen, [(L - 1, 1) for L in lens], hkv, d)
    if extra.get("window"):
        page.hide_below_window(extra["window"])
    B = len(lens)
    q_scale = 4.0 if extra.get("softcap") == 5.0 else 1.0
    err = _attention("attention_decode", "decode", page, hq, d, tune, {"T": B, "B": B}, q_scale=q_scale, **extra)
    assert err <= TOL


def test_attention_decode_shared_prefix():
    gen = np.random.default_rng(5)
    page = Paged(gen, [(99, 1), (140, 1), (20, 1)], 2, 64, share=6)
    assert page.pages[0][:6] == page.pages[1][:6]
    assert _attention("attention_decode", "decode", page, 4, 64, {"NUM_SPLITS": 4, "BLOCK_N": 32},
                      {"T": 3, "B": 3}) <= TOL


def test_window_changes_the_result():
    """The window really drops keys: attention with a window differs from without."""
    gen = np.random.default_rng(9)
    page = Paged(gen, [(199, 1)], 1, 64)
    q = np.random.default_rng(2).standard_normal((1, 2, 64)).astype(np.float32)
    ref = REGISTRY["attention_cached"].reference
    full = ref(page.ctx, q, None, kv_heads=1)
    windowed = ref(page.ctx, q, None, kv_heads=1, window=20)
    assert rel_err(windowed, full) > 0.1
    # HF's overlay: key j is visible from position p iff p - j < window; window = L sees everything
    assert np.array_equal(ref(page.ctx, q, None, kv_heads=1, window=200), full)
    assert rel_err(ref(page.ctx, q, None, kv_heads=1, window=199), full) > 1e-4


PREFILL_CASES = [
    # hq, hkv, d, (cached, q_len) per sequence, share, tune, extra attrs
    (4, 2, 64, [(0, 17), (0, 1), (0, 70)], 0, {"BLOCK_M": 16, "BLOCK_N": 16}, {}),             # prefill
    (8, 2, 128, [(32, 15), (48, 20)], 2, {"BLOCK_M": 32, "BLOCK_N": 32}, {}),                  # shared prefix
    (2, 2, 64, [(40, 1), (0, 23), (100, 1), (17, 9)], 0, {"BLOCK_M": 16, "BLOCK_N": 32}, {}),  # mixed, G = 1
    # mixed, G = 4; prefixes 14 and 31 put the first masked tile's start right at a block's first key
    (8, 2, 64, [(69, 1), (0, 15), (14, 20), (0, 33), (5, 1), (31, 5)], 0,
     {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_B": 2}, {}),
    (4, 2, 64, [(16, 40), (0, 3)], 0, {}, {}),                                                 # default tune
    (6, 2, 96, [(0, 30), (20, 11)], 0, {"BLOCK_M": 32, "BLOCK_N": 16}, {"scale": 0.05}),       # D = 96, scale
    # sliding window: prompts longer than the window, over several pages; tiles below, inside and
    # above each block's window; a decode row and a chunk continuing past the window
    (4, 2, 64, [(0, 90), (60, 1), (0, 5), (45, 30)], 0, {"BLOCK_M": 16, "BLOCK_N": 16}, {"window": 21}),
    (8, 2, 64, [(0, 150), (100, 40)], 0, {"BLOCK_M": 32, "BLOCK_N": 32}, {"window": 48}),
    (4, 1, 128, [(0, 133), (7, 2)], 0, {}, {"window": 64}),                                    # default tune
    (4, 2, 64, [(0, 40), (33, 1), (10, 19)], 0, {"BLOCK_M": 16, "BLOCK_N": 16}, {"softcap": 5.0}),
    (2, 1, 128, [(0, 70), (50, 9)], 0, {"BLOCK_M": 16, "BLOCK_N": 32},
     {"softcap": 50.0, "window": 32, "scale": 0.1}),                                           # Gemma 2-like
]


@pytest.mark.parametrize("hq,hkv,d,specs,share,tune,extra", PREFILL_CASES)
def test_attention_prefill(hq, hkv, d, specs, share, tune, extra):
    gen = np.random.default_rng(len(specs) * 10 + d + share)
    page = Paged(gen, specs, hkv, d, share=share)
    if share:
        assert page.pages[0][:share] == page.pages[1][:share]
    if extra.get("window"):
        page.hide_below_window(extra["window"])
    dims = {"T": page.T, "B": page.B}
    q_scale = 4.0 if extra.get("softcap") == 5.0 else 1.0
    assert _attention("attention_prefill", "mixed", page, hq, d, tune, dims, q_scale=q_scale, **extra) <= TOL


MIXED_CASES = [
    # hq, hkv, d, (cached, q_len) per sequence, phase, tune, extra attrs. attention_mixed: flash
    # tiles for sequences of more than QMAX new tokens, split-KV programs (merged in-launch) for
    # the rest; TARGET_CTAS small enough that some steps split and some do not
    (8, 2, 64, [(69, 1), (0, 15), (14, 20), (5, 1), (300, 1)], "mixed",
     {"BLOCK_M": 16, "BLOCK_N": 16, "SPLIT_BLOCK_N": 16, "NUM_SPLITS": 4, "TARGET_CTAS": 64}, {}),
    (8, 2, 64, [(69, 1), (0, 15), (300, 1)], "mixed", {"BLOCK_M": 16, "BLOCK_N": 16}, {}),  # defaults
    (4, 4, 64, [(250, 16), (0, 9), (40, 3), (123, 17)], "short",                            # G = 1
     {"BLOCK_M": 16, "BLOCK_N": 16, "SPLIT_BLOCK_N": 32, "NUM_SPLITS": 8}, {}),
    (8, 2, 128, [(500, 16), (33, 5)], "short", {"SPLIT_BLOCK_N": 16, "NUM_SPLITS": 8}, {}),  # 16 over a long prefix
    (8, 2, 128, [(500, 16), (33, 5)], "short",                                                # merged a split a pass
     {"SPLIT_BLOCK_N": 16, "NUM_SPLITS": 8, "SPLIT_MIN_KEYS": 16, "SPLIT_MERGE_CHUNK": 1}, {}),
    (8, 2, 128, [(500, 16), (33, 5)], "short",                                                # ... or 4 (7 splits)
     {"SPLIT_BLOCK_N": 16, "NUM_SPLITS": 8, "SPLIT_MIN_KEYS": 16, "SPLIT_MERGE_CHUNK": 4}, {}),
    (6, 2, 96, [(200, 7), (0, 30)], "short", {"BLOCK_M": 32, "BLOCK_N": 16, "QMAX": 8}, {"scale": 0.05}),
    (4, 2, 64, [(300, 5), (60, 1), (0, 40), (45, 30)], "short",
     {"BLOCK_M": 16, "BLOCK_N": 16, "SPLIT_BLOCK_N": 16, "NUM_SPLITS": 4}, {"window": 21}),
    (4, 2, 64, [(90, 3), (33, 1), (10, 19)], "short",
     {"BLOCK_M": 16, "BLOCK_N": 16, "SPLIT_BLOCK_N": 16, "NUM_SPLITS": 4}, {"softcap": 5.0}),
    (2, 1, 128, [(150, 4), (50, 9)], "mixed", {"BLOCK_M": 16, "BLOCK_N": 32, "QMAX": 4, "NUM_SPLITS": 2},
     {"softcap": 50.0, "window": 48, "scale": 0.1}),                                          # Gemma 2-like
    # many query heads a kv head (G = 48, D = 64): the short step's default QMAX is 512 // 48 = 10,
    # so the 16- and 11-token suffixes take the flash role and the 9- and 3-token ones the split role
    (48, 1, 64, [(120, 16), (40, 9), (0, 11), (70, 3)], "short", {"BLOCK_M": 64, "BLOCK_N": 16, "SPLIT_BLOCK_N": 16}, {}),
    # whole prompts beside a few decodes (a saturated server's step): more flash programs than
    # split ones, each split role program one whole sequence
    (8, 2, 64, [(0, 61), (130, 1), (20, 45), (77, 1)], "mixed",
     {"BLOCK_M": 16, "BLOCK_N": 16, "SPLIT_BLOCK_N": 16, "NUM_SPLITS": 2, "TARGET_CTAS": 8}, {}),
    # the split role's programs first in the grid (SPLIT_FIRST): unsplit, then split and merged
    (8, 2, 64, [(0, 61), (130, 1), (20, 45), (77, 1)], "mixed",
     {"BLOCK_M": 16, "BLOCK_N": 16, "SPLIT_BLOCK_N": 16, "NUM_SPLITS": 2, "TARGET_CTAS": 8, "SPLIT_FIRST": 1}, {}),
    (8, 2, 64, [(69, 1), (0, 15), (14, 20), (5, 1), (300, 1)], "mixed",
     {"BLOCK_M": 16, "BLOCK_N": 16, "SPLIT_BLOCK_N": 16, "NUM_SPLITS": 4, "TARGET_CTAS": 64,
      "SPLIT_MIN_KEYS": 16, "SPLIT_FIRST": 1}, {}),
]


@pytest.mark.parametrize("hq,hkv,d,specs,phase,tune,extra", MIXED_CASES)
def test_attention_mixed(hq, hkv, d, specs, phase, tune, extra):
    gen = np.random.default_rng(len(specs) * 10 + d)
    page = Paged(gen, specs, hkv, d)
    if extra.get("window"):
        page.hide_below_window(extra["window"])
    dims = {"T": page.T, "B": page.B}
    q_scale = 4.0 if extra.get("softcap") == 5.0 else 1.0
    assert _attention("attention_mixed", phase, page, hq, d, tune, dims, q_scale=q_scale, **extra) <= TOL


def test_a_short_steps_split_role_keeps_its_q_tile_within_32k_elements():
    """QMAX x G rows (padded) of next_pow2(D) columns: Falcon-7B's G = 71 at D = 64 gave 2,048 rows
    at QMAX 16 (295 KB of shared memory, past an sm_90 SM's 227 KB: its build failed), Qwen3.5-397B's
    G = 16 at D = 256 262 KB; G x D <= 2,048 keeps 16 tokens."""
    def qmax(hq, hkv, d):
        k = render("attention_mixed", "attention_cached", [("q", ["T", hq, d], "bf16"), ("cache", [], "", "cache")],
                   [("o", ["T", hq, d], "bf16")], attrs={"kv_heads": hkv, "scale": None, "window": None,
                                                         "softcap": None}, phase="short", caches=kv_caches(hkv, d))
        return int(re.search(r"q_len <= QMAX=(\d+)", k.source).group(1))
    assert [qmax(32, 8, 128), qmax(32, 2, 128), qmax(64, 4, 128), qmax(71, 1, 64), qmax(32, 2, 256),
            qmax(64, 1, 512)] == [16, 16, 16, 7, 8, 1]


# The flash role's K/V by TMA (KV_TMA, on where a tile lies in one page: PS % BLOCK_N == 0) against
# the pointer gather on the same tiles; 64-token pages with 64- and 32-key tiles. The tails of last
# pages are NaN, so a masked TMA tile that let a slot past the context through shows as NaN.
KV_TMA_CASES = [
    # hq, hkv, d, (cached, q_len) per sequence, page size, template, phase, tune, extra attrs
    (8, 2, 128, [(0, 150), (70, 1), (64, 65), (200, 31)], 64, "attention_mixed", "mixed",
     {"BLOCK_M": 32, "BLOCK_N": 64, "NUM_SPLITS": 2}, {}),
    (8, 2, 128, [(0, 150), (70, 1), (64, 65), (200, 31)], 64, "attention_mixed", "mixed",
     {"BLOCK_M": 32, "BLOCK_N": 64, "NUM_SPLITS": 2, "KV_TMA": 0}, {}),
    (4, 2, 64, [(0, 130), (9, 40)], 64, "attention_prefill", "prefill", {"BLOCK_M": 16, "BLOCK_N": 32}, {}),
    (4, 2, 64, [(0, 130), (9, 40)], 64, "attention_prefill", "prefill",
     {"BLOCK_M": 16, "BLOCK_N": 32, "KV_TMA": 0}, {}),
    (4, 2, 64, [(0, 140), (100, 30)], 64, "attention_prefill", "prefill", {"BLOCK_M": 16, "BLOCK_N": 32},
     {"window": 50}),
    (4, 2, 64, [(0, 90), (60, 1), (45, 30)], 16, "attention_mixed", "short",
     {"BLOCK_M": 16, "BLOCK_N": 16, "KV_TMA": 0, "SPLIT_BLOCK_N": 16, "NUM_SPLITS": 4}, {"softcap": 5.0}),
]


@pytest.mark.parametrize("hq,hkv,d,specs,ps,template,phase,tune,extra", KV_TMA_CASES)
def test_attention_kv_tma(hq, hkv, d, specs, ps, template, phase, tune, extra):
    gen = np.random.default_rng(len(specs) * 10 + d + ps)
    page = Paged(gen, specs, hkv, d, page_size=ps)
    if extra.get("window"):
        page.hide_below_window(extra["window"])
    k = render(template, "attention_cached", [("q", ["T", hq, d], "bf16"), ("cache", [], "", "cache")],
               [("o", ["T", hq, d], "bf16")], attrs={"kv_heads": hkv}, phase=phase,
               caches=kv_caches(hkv, d), tune=tune, page_size=ps)
    assert ("make_tensor_descriptor" in k.source) == bool(tune.get("KV_TMA", 1))
    q_scale = 4.0 if extra.get("softcap") == 5.0 else 1.0
    dims = {"T": page.T, "B": page.B}
    assert _attention(template, phase, page, hq, d, tune, dims, q_scale=q_scale, **extra) <= TOL


def test_attention_mixed_splits_and_leaves_counters_zero():
    """The split role really splits (one program per split would not read the whole prefix) and
    leaves its scratch counters zero for the next launch: run the same launch twice."""
    gen = np.random.default_rng(3)
    page = Paged(gen, [(400, 16), (0, 20)], 2, 64)
    tune = {"SPLIT_BLOCK_N": 16, "NUM_SPLITS": 8, "BLOCK_M": 16, "BLOCK_N": 16}
    dims = {"T": page.T, "B": page.B}
    for _ in range(2):
        assert _attention("attention_mixed", "short", page, 8, 64, tune, dims) <= TOL


def test_attention_refuses_bad_attrs():
    from infc.compiler.ir import TensorType
    q, k = TensorType(("T", 4, 64), "bf16"), TensorType(("T", 2, 64), "bf16")
    att = REGISTRY["attention"]
    with pytest.raises(ShapeError, match="only causal"):
        att.infer([q, k, k], {"causal": False})
    with pytest.raises(ShapeError, match="window"):
        att.infer([q, k, k], {"window": 0})
    with pytest.raises(ShapeError, match="softcap"):
        att.infer([q, k, k], {"softcap": -1.0})
    with pytest.raises(ShapeError, match="needs attrs kv_heads"):
        REGISTRY["attention_cached"].infer([q, None], {"scale": None})
    assert REGISTRY["attention_cached"].caches([q, None], {"kv_heads": 2}) == {
        n: {"kind": "paged", "shape": [2, 64], "dtype": "bf16"} for n in ("k", "v")}


# ---------------------------------------------------------------------------------------------
# attention sinks (GPT-OSS): one logit per query head in the softmax's denominator only. The
# sinks are of the scores' size (some heads' larger than every score, some far below), so the
# outputs' scale moves per head; decode folds them in at the one split or at the merge, the flash
# role at its end, the mixed split role at both.

def _sinks(hq, seed=4):
    s = np.random.default_rng(seed).standard_normal(hq).astype(np.float32) * 3.0
    s[0] = 8.0                                       # a head whose sink outweighs every key
    return s


SINK_CASES = [
    # template, phase, hq, hkv, d, (cached, q_len) per sequence, tune, extra attrs
    ("attention_decode", "decode", 4, 2, 64, [(299, 1), (39, 1), (8, 1)], {"NUM_SPLITS": 4, "BLOCK_N": 16}, {}),
    ("attention_decode", "decode", 8, 2, 64, [(140, 1), (7, 1)], {"NUM_SPLITS": 1, "BLOCK_N": 16}, {"window": 37}),
    ("attention_prefill", "prefill", 4, 2, 64, [(0, 45), (10, 19)], {"BLOCK_M": 16, "BLOCK_N": 16}, {"window": 21}),
    ("attention_mixed", "mixed", 8, 2, 64, [(69, 1), (0, 15), (14, 20), (300, 1)],
     {"BLOCK_M": 16, "BLOCK_N": 16, "SPLIT_BLOCK_N": 16, "NUM_SPLITS": 4, "TARGET_CTAS": 64}, {}),
    ("attention_mixed", "short", 4, 2, 64, [(300, 5), (60, 1), (0, 40)],
     {"BLOCK_M": 16, "BLOCK_N": 16, "SPLIT_BLOCK_N": 16, "NUM_SPLITS": 1}, {"window": 21}),
]


@pytest.mark.parametrize("template,phase,hq,hkv,d,specs,tune,extra", SINK_CASES)
def test_attention_sinks(template, phase, hq, hkv, d, specs, tune, extra):
    gen = np.random.default_rng(len(specs) * 10 + d + hq)
    page = Paged(gen, specs, hkv, d)
    if extra.get("window"):
        page.hide_below_window(extra["window"])
    dims = {"T": page.T, "B": page.B}
    assert _attention(template, phase, page, hq, d, tune, dims, sinks=_sinks(hq), **extra) <= TOL


def test_sinks_change_the_result():
    """The reference's sinks really take weight: with them the output differs from without, a
    very negative sink changes nothing, and a sink far above every score drives the head to 0."""
    page = Paged(np.random.default_rng(9), [(99, 1)], 1, 64)
    q = np.random.default_rng(2).standard_normal((1, 2, 64)).astype(np.float32)
    ref = REGISTRY["attention_cached"].reference
    plain = ref(page.ctx, q, None, kv_heads=1)
    assert rel_err(ref(page.ctx, q, None, np.float32([3.0, 4.0]), kv_heads=1, has_sinks=True), plain) > 0.05
    assert np.allclose(ref(page.ctx, q, None, np.float32([-80, -80]), kv_heads=1, has_sinks=True), plain, atol=1e-6)
    gone = ref(page.ctx, q, None, np.float32([60, 0]), kv_heads=1, has_sinks=True)
    assert np.abs(gone[0, 0]).max() < 1e-12 and np.abs(gone[0, 1]).max() > 1e-3
