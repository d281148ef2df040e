"""DeepSeek-V4 attention ops (compiler/ops/compressed_attention.py): the numpy references, run
through the reference executor's paged / slot caches (SeqPages), against transformers'
DeepseekV4Attention (with its HCA / CSA compressor and lightning indexer) on random float32
weights. Each layer type's whole attention block (q / kv projections, the ops, the inverse rope,
the grouped output projection) is compared at every position, one shot and in chunks that cut
compression blocks and the window at odd places.
"""
import numpy as np
import pytest
import torch

from infc.compiler.contract import caches as cache_layout
from infc.compiler.ir import TensorType
from infc.compiler.ops import REGISTRY, ShapeError
from infc.compiler.ops.compressed_attention import rotate_tail
from infc.runtime.engine.step import Chunk
from infc.runtime.reference.executor import SeqPages

from tests.exhaustive import EXHAUSTIVE

PAGE = 8


def tiny_config(**kw):
    from transformers import DeepseekV4Config
    base = dict(vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, head_dim=16,
                q_lora_rank=24, qk_rope_head_dim=8, o_groups=2, o_lora_rank=8, index_n_heads=4,
                index_head_dim=8, index_topk=3, sliding_window=6, moe_intermediate_size=16,
                n_routed_experts=4, num_experts_per_tok=2, hc_mult=2,
                compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
                layer_types=["sliding_attention", "compressed_sparse_attention",
                             "heavily_compressed_attention"],
                mlp_layer_types=["hash_moe", "moe", "moe"],
                rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                                 "beta_fast": 32, "beta_slow": 1},
                max_position_embeddings=128, attn_implementation="eager")
    base.update(kw)
    return DeepseekV4Config(**base)


def hf_attention(cfg, layer, seed=0):
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as m
    torch.manual_seed(seed)
    mod = m.DeepseekV4Attention(cfg, layer).float().eval()
    with torch.no_grad():
        for p in mod.parameters():
            p.copy_(torch.randn_like(p) * (0.5 if p.dim() == 1 else p.shape[-1] ** -0.5))
        for name, p in mod.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
    return mod, m


def hf_forward(cfg, mod, m, hidden):
    S = hidden.shape[0]
    pos = torch.arange(S)[None]
    rot = m.DeepseekV4RotaryEmbedding(cfg)
    x = torch.from_numpy(hidden)[None]
    pe = {k: rot(x, pos, layer_type=k) for k in ("main", "compress")}
    i = torch.arange(S)
    ok = (i[None, :] <= i[:, None]) & (i[:, None] - i[None, :] < cfg.sliding_window)
    mask = torch.where(ok, 0.0, float("-inf"))[None, None]
    with torch.no_grad():
        return mod(x, pe, pos, mask, None)[0][0].numpy()


def _w(t):
    return t.detach().float().numpy()


def _rms(x, w, eps):
    return w * (x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps))


class Ours:
    """The spec's attention graph for one layer, in numpy, with the ops' references."""

    def __init__(self, cfg, mod):
        self.cfg, self.mod = cfg, mod
        self.kind = cfg.layer_types[mod.layer_idx]
        rp = cfg.rope_parameters
        self.rope = (cfg.rope_theta, None) if self.kind == "sliding_attention" else \
            (cfg.compress_rope_theta, rp["compress"])
        self.R = cfg.qk_rope_head_dim
        self.rate = cfg.compress_rates.get(self.kind)
        self.cache_name = {"compressed_sparse_attention": "csa", "heavily_compressed_attention": "hca"}.get(self.kind)
        decl = {}
        if self.kind == "sliding_attention":
            decl.update(REGISTRY["attention"].caches(self._types(), {}))
        else:
            decl.update(REGISTRY["compressed_attention"].caches(self._types(), self._attrs()))
            if self.kind == "compressed_sparse_attention":
                decl.update(REGISTRY["indexer_topk"].caches(self._itypes(), self._iattrs()))
        self.decl = {n: dict(d, layers=[0]) for n, d in decl.items()}

    def _types(self):
        c, D = self.cfg, self.cfg.head_dim
        if self.kind == "sliding_attention":
            return [TensorType(("T", c.num_attention_heads, D), "f32"), TensorType(("T", 1, D), "f32")]
        w = self.mod.compressor.kv_proj.weight.shape[0]
        return [TensorType(s, "f32") for s in (("T", c.num_attention_heads, D), ("T", D), (c.num_attention_heads,),
                                              ("T", w), ("T", w), (self.rate, w), (D,))]

    def _attrs(self):
        return dict(rate=self.rate, window=self.cfg.sliding_window, cache=self.cache_name, eps=self.cfg.rms_norm_eps,
                    theta=self.rope[0], scaling=self.rope[1], rotary_dim=self.R)

    def _itypes(self):
        c = self.cfg
        Hi, Di = c.index_n_heads, c.index_head_dim
        return [TensorType(s, "f32") for s in (("T", Hi, Di), ("T", Hi), ("T", 2 * Di), ("T", 2 * Di),
                                              (self.rate, 2 * Di), (Di,))]

    def _iattrs(self):
        return dict(rate=self.rate, topk=self.cfg.index_topk, cache="ikv", eps=self.cfg.rms_norm_eps,
                    theta=self.rope[0], scaling=self.rope[1], rotary_dim=self.R)

    def run(self, hidden, steps):
        """The layer's output [S, H], the prompt run as chunks of the given sizes."""
        pages = SeqPages(self.decl, page_size=PAGE)
        out, at = [], 0
        for n in steps:
            ctx = pages.context([Chunk(0, list(range(n)), at)])
            out.append(self.step(ctx, hidden[at:at + n]))
            at += n
        return np.concatenate(out)

    def step(self, ctx, h):
        a, c, eps = self.mod, self.cfg, self.cfg.rms_norm_eps
        T, H, D = h.shape[0], c.num_attention_heads, c.head_dim
        theta, scaling = self.rope
        q_res = _rms(h @ _w(a.q_a_proj.weight).T, _w(a.q_a_norm.weight), eps)
        q = _rms((q_res @ _w(a.q_b_proj.weight).T).reshape(T, H, D), 1.0, eps)
        q = rotate_tail(q, ctx.positions, theta, scaling, self.R)
        kv = _rms(h @ _w(a.kv_proj.weight).T, _w(a.kv_norm.weight), eps)
        kv = rotate_tail(kv[:, None], ctx.positions, theta, scaling, self.R)[:, 0]
        sinks = _w(a.sinks)
        if self.kind == "sliding_attention":
            o = REGISTRY["attention"].reference(ctx, q, kv[:, None], kv[:, None], sinks,
                                                window=c.sliding_window, has_sinks=True)
        else:
            comp = a.compressor
            args = [q, kv, sinks, h @ _w(comp.kv_proj.weight).T, h @ _w(comp.gate_proj.weight).T,
                    _w(comp.position_bias), _w(comp.kv_norm.weight)]
            if self.kind == "compressed_sparse_attention":
                ix = comp.indexer
                iq = (q_res @ _w(ix.q_b_proj.weight).T).reshape(T, c.index_n_heads, c.index_head_dim)
                iq = rotate_tail(iq, ctx.positions, theta, scaling, self.R)
                idx = REGISTRY["indexer_topk"].reference(
                    ctx, iq, h @ _w(ix.scorer.weights_proj.weight).T, h @ _w(ix.kv_proj.weight).T,
                    h @ _w(ix.gate_proj.weight).T, _w(ix.position_bias), _w(ix.kv_norm.weight), **self._iattrs())
                args.append(idx)
            o = REGISTRY["compressed_attention"].reference(ctx, *args, **self._attrs(),
                                                           has_index=len(args) == 8)
        o = rotate_tail(o, ctx.positions, theta, scaling, self.R, inverse=True)
        G = c.o_groups
        wa = _w(a.o_a_proj.weight).reshape(G, -1, H * D // G)
        y = np.einsum("tgk,gnk->tgn", o.reshape(T, G, H * D // G), wa).reshape(T, -1)
        return y @ _w(a.o_b_proj.weight).T


CASES = [(0, [37]), (0, [5, 1, 14, 17]), (1, [37]), (1, [3, 6, 1, 1, 9, 17]), (2, [37]), (2, [7, 9, 1, 20])]


@pytest.mark.parametrize("layer,steps", [CASES[1], CASES[3], CASES[5]] +
                         [pytest.param(*c, marks=EXHAUSTIVE) for c in (CASES[0], CASES[2], CASES[4])])
def test_attention_block_matches_transformers(layer, steps):
    cfg = tiny_config()
    mod, m = hf_attention(cfg, layer, seed=layer)
    S = sum(steps)
    hidden = np.random.default_rng(layer).standard_normal((S, cfg.hidden_size)).astype(np.float32)
    want = hf_forward(cfg, mod, m, hidden)
    got = Ours(cfg, mod).run(hidden, steps)
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < 1e-5, (cfg.layer_types[layer], err)


def test_indexer_matches_transformers_topk():
    """indexer_topk's choices are the set transformers' DeepseekV4Indexer keeps, query by query
    (more visible entries than topk from position 16 on)."""
    cfg = tiny_config()
    mod, m = hf_attention(cfg, 1, seed=3)
    ix = mod.compressor.indexer
    S = 30
    h = np.random.default_rng(3).standard_normal((S, cfg.hidden_size)).astype(np.float32)
    q_res = _rms(h @ _w(mod.q_a_proj.weight).T, _w(mod.q_a_norm.weight), cfg.rms_norm_eps)
    with torch.no_grad():
        want = ix(torch.from_numpy(h)[None], torch.from_numpy(q_res.astype(np.float32))[None],
                  torch.arange(S)[None], None, 1)[0].numpy()
    ours = Ours(cfg, mod)
    ctx = SeqPages(ours.decl, page_size=PAGE).context([Chunk(0, list(range(S)), 0)])
    iq = (q_res @ _w(ix.q_b_proj.weight).T).reshape(S, cfg.index_n_heads, cfg.index_head_dim)
    iq = rotate_tail(iq, ctx.positions, *ours.rope, ours.R)
    got = REGISTRY["indexer_topk"].reference(
        ctx, iq, h @ _w(ix.scorer.weights_proj.weight).T, h @ _w(ix.kv_proj.weight).T,
        h @ _w(ix.gate_proj.weight).T, _w(ix.position_bias), _w(ix.kv_norm.weight), **ours._iattrs())
    for t in range(S):
        assert set(got[t][got[t] >= 0]) == set(want[t][want[t] >= 0]), t
    assert (got >= 0).sum(1).max() == cfg.index_topk


def test_compressed_cache_layout():
    """One row per m tokens in the page of the block's last token; bytes per token are 1/m."""
    c = {"kind": "paged", "every": 4, "shape": [16], "dtype": "bf16", "layers": [0, 1]}
    h = {"kind": "paged", "every": 32, "shape": [16], "dtype": "bf16", "layers": [2]}
    assert cache_layout.storage_shape(c, 16, 10) == (11, 4, 16)
    assert cache_layout.storage_shape(h, 16, 10) == (11, 1, 16)
    assert cache_layout.entry_address(c, 16, [7, 3], 5) == (3, 1)          # tokens 20..23
    assert cache_layout.entry_address(h, 16, [7, 3, 9, 5], 1) == (5, 0)    # tokens 32..63
    assert cache_layout.token_bytes({"c": c}) == 16 * 2 * 2 // 4
    assert cache_layout.page_bytes({"c": c, "h": h}, 16) == 4 * 16 * 2 * 2 + 16 * 2
    with pytest.raises(ValueError, match="divides"):
        cache_layout.storage_shape(dict(c, every=3), 16, 2)
    with pytest.raises(ValueError, match="every"):
        cache_layout.check({"x": dict(c, kind="slot")})


def test_bad_shapes_are_refused():
    op = REGISTRY["compressed_attention"]
    t = [TensorType(s, "f32") for s in (("T", 4, 16), ("T", 16), (4,), ("T", 32), ("T", 32), (3, 32), (16,))]
    attrs = dict(rate=4, window=6, cache="csa", theta=1e4, rotary_dim=8)
    with pytest.raises(ShapeError, match="bias must be"):
        op.infer(t, attrs)
    t[5] = TensorType((4, 32), "f32")
    op.infer(t, attrs)
    with pytest.raises(ShapeError, match="rotary_dim"):
        op.infer(t, dict(attrs, rotary_dim=7))
