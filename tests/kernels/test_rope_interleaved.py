"""rope(x, theta, ..., interleaved=true): RoPE on the pairs (x[2j], x[2j+1]) (GPT-J, Cohere) instead
of the halves (x[j], x[j + R/2]) (Llama, NeoX).

- the numpy reference against transformers' cohere apply_rotary_pos_emb (its rotate_half over
  even/odd lanes, cos/sin repeat_interleave'd) with CohereRotaryEmbedding's cos/sin, float32;
- the generic rope Triton kernel under the interpreter against the reference and against HF:
  random bf16 inputs, odd head counts, head dims whose R/2 is not a power of two, partial rotary
  (GPT-J's rotary_dim), scaled RoPE, a row-strided input, positions past 64k;
- the attribute's default (None) renders the rotate-half kernel unchanged, and the fused
  qk_norm_rope_cache path (rotate-half only) leaves an interleaved rope alone.
"""
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from infc.compiler.ops import REGISTRY, ShapeError
from infc.compiler.ops.rope import rotate

from .harness import poison, rand, rel_err, render, run

SPECS = Path(__file__).resolve().parents[2] / "specs"
TOL = 1e-2
LINEAR = {"rope_type": "linear", "factor": 4.0}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}


def _hf_cohere(x, pos, theta, scaling, head_dim):
    """transformers' Cohere RoPE of x[T, H, D] at positions pos (float32)."""
    from transformers import CohereConfig
    from transformers.models.cohere.modeling_cohere import CohereRotaryEmbedding, apply_rotary_pos_emb
    heads = x.shape[1]
    cfg = CohereConfig(hidden_size=heads * head_dim, num_attention_heads=heads,
                       num_key_value_heads=heads, head_dim=head_dim, vocab_size=32,
                       rope_parameters={"rope_type": "default", **(scaling or {}), "rope_theta": theta})
    emb = CohereRotaryEmbedding(cfg)
    q = torch.from_numpy(np.ascontiguousarray(x.transpose(1, 0, 2)))[None]     # [1, H, T, D]
    cos, sin = emb(q, torch.from_numpy(np.asarray(pos, np.int64))[None])
    out, _ = apply_rotary_pos_emb(q, q, cos, sin)
    return out[0].numpy().transpose(1, 0, 2)


@pytest.mark.parametrize("heads,d,scaling", [(3, 64, None), (5, 128, None), (1, 96, LINEAR),
                                             (7, 32, None)])
def test_interleaved_reference_matches_cohere(heads, d, scaling):
    gen = np.random.default_rng(heads * 100 + d)
    small = np.arange(24)
    big = gen.integers(1000, 40000, 8)
    pos = np.concatenate([small, big]).astype(np.int64)
    x = gen.standard_normal((len(pos), heads, d)).astype(np.float32)
    theta = 10000.0
    want = _hf_cohere(x, pos, theta, scaling, d)
    got = rotate(x, pos, theta, scaling, interleaved=True)
    n = len(small)
    assert np.abs(got[:n] - want[:n]).max() < 4e-6
    # at large positions an ulp of inv_freq moves the fp32 angle by ~p * 6e-8 (in HF too)
    assert np.abs(got[n:] - want[n:]).max() < 4e-3
    # and the layout matters: rotate-half is far off (position 0 is the identity in both)
    half = rotate(x, pos, theta, scaling)
    assert np.abs(half[1:n] - want[1:n]).max() > 0.1


KERNEL_CASES = [
    # heads, D, rotary_dim, scaling, row_stride (None: contiguous), tune, phase, positions
    (3, 64, None, None, None, {}, "prefill", [0, 1, 5, 17, 4095, 4096, 70000]),
    (5, 128, None, LINEAR, 5 * 128 + 40, {"BLOCK_H": 2, "BLOCK_T": 3}, "prefill",
     list(range(9)) + [9000, 131000]),
    (7, 32, None, None, None, {"BLOCK_H": 4}, "prefill", list(range(11))),
    (1, 96, None, YARN, None, {"BLOCK_H": 1, "BLOCK_T": 1}, "prefill", [1, 100, 4096, 160000, 12]),
    (3, 80, 40, None, 1000, {}, "prefill", [3, 2000, 50000, 7]),   # R/2 = 20, 40 dims pass through
    (5, 64, None, None, None, {}, "decode", [33, 0, 2047]),
]


@pytest.mark.parametrize("heads,d,rot,scaling,stride,tune,phase,positions", KERNEL_CASES)
def test_interleaved_rope_kernel(heads, d, rot, scaling, stride, tune, phase, positions):
    gen = np.random.default_rng(heads * 1000 + d)
    theta = 10000.0
    attrs = {"theta": theta, "scaling": scaling, "rotary_dim": rot, "interleaved": True}
    extra = {"row_stride": stride} if stride else {}
    k = render("rope", "rope", [("x", ["T", heads, d], "bf16", "buffer", extra)],
               [("o", ["T", heads, d], "bf16")], attrs=attrs, phase=phase, tune=tune)
    T = len(positions)
    width = stride or heads * d
    wide = rand((T + 2, width), gen=gen, scale=2.0)          # the view starts at column 0 of a wider row
    x = wide[:T, : heads * d].reshape(T, heads, d)
    out_full = poison((T + 2, heads, d))
    out = out_full[:T]
    run(k, {"in:0": wide.view(-1), "out:0": out,
            "meta:positions": torch.tensor(positions, dtype=torch.int32)}, {"T": T, "B": 1})
    assert torch.isnan(out_full[T:].float()).all(), "wrote rows past T"
    xf = x.float().numpy()
    want = REGISTRY["rope"].reference(SimpleNamespace(positions=np.asarray(positions, np.int64)),
                                      xf, **attrs)
    got = out.float().numpy()
    assert rel_err(got, want) <= TOL
    assert np.abs(got - want).max() <= 2 ** -7 * np.abs(want).max()
    r = rot or d
    assert np.array_equal(got[..., r:], xf[..., r:])          # pass-through is a copy
    if rot is None and scaling in (None, LINEAR):               # what Cohere itself computes
        hf = _hf_cohere(xf, positions, theta, scaling, d)
        assert rel_err(got, hf) <= TOL


def test_interleaved_attribute_is_a_bool():
    from infc.compiler.ir import TensorType
    op = REGISTRY["rope"]
    x = TensorType(("T", 3, 64), "bf16")
    for ok in (None, True, False):
        assert op.infer([x], {"theta": 1e4, "scaling": None, "interleaved": ok}) == [x]
    with pytest.raises(ShapeError, match="interleaved must be true or false"):
        op.infer([x], {"theta": 1e4, "scaling": None, "interleaved": "yes"})


def test_default_renders_the_rotate_half_kernel_unchanged():
    """interleaved None (every spec that does not name it) renders exactly the kernel a launch
    without the attribute renders; true renders another."""
    def src(**extra):
        return render("rope", "rope", [("x", ["T", 3, 64], "bf16")], [("o", ["T", 3, 64], "bf16")],
                      attrs={"theta": 1e4, "scaling": None, "rotary_dim": None, **extra},
                      phase="prefill").source
    assert src(interleaved=None) == src()
    assert src(interleaved=True) != src()
    assert "2 * j[None, :]" in src(interleaved=True) and "2 * j" not in src()


def _layer_launches(plan):
    body = next(r for r in plan["programs"]["decode"] if "repeat" in r)
    return [l for ls in body["kinds"].values() for l in ls]


def test_fused_path_leaves_an_interleaved_rope_alone():
    """Cohere's q/k ropes are interleaved: fuse_qk_norm_rope_cache (rotate-half only) must not
    take them, so they run as rope launches next to a kv_write; a rotate-half family still fuses,
    and its fused op carries no interleaved attribute."""
    from infc.compiler.build import compile_model
    _, plan = compile_model("c4ai-command-r-v01", spec_path=str(SPECS / "cohere.yaml"))
    launches = _layer_launches(plan)
    ropes = [l for l in launches if l["op"] == "rope"]
    assert len(ropes) == 2 and all(l["attrs"]["interleaved"] is True for l in ropes)
    assert any(l["op"] == "kv_write" for l in launches)
    assert not any(l["op"] == "qk_norm_rope_cache" for l in launches)

    _, plan = compile_model("llama-3.2-1b", spec_path=str(SPECS / "llama.yaml"))
    fused = [l for l in _layer_launches(plan) if l["op"] == "qk_norm_rope_cache"]
    assert len(fused) == 1 and "interleaved" not in fused[0]["attrs"]
    assert not any(l["op"] == "rope" for l in _layer_launches(plan))
