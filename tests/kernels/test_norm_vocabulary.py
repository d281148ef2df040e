"""Weightless norms, F.normalize and xIELU under the interpreter, against their numpy references
(compiler/ops/rms_norm.py, layer_norm.py, normalize.py, activation.py) and those against torch's
own definitions: random non-zero inputs, widths that are not multiples of the tile, strided rows,
rows longer than one block."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from infc.compiler.ops import REGISTRY

from .harness import bf16, poison, rand, render, run

EPS = 1e-5


def _strided(shape, stride, gen, scale=2.0):
    """x of `shape` as the first columns of a wider [T, stride] buffer (a fused projection's slice)."""
    width = int(np.prod(shape[1:]))
    wide = rand((shape[0], stride or width), scale=scale, gen=gen)
    return wide, wide[:, :width].reshape(shape)


@pytest.mark.parametrize("op,shape,stride,block", [
    ("rms_norm", (5, 3, 20), 3 * 20 + 12, None), ("rms_norm", (3, 1000), None, 256),
    ("layer_norm", (7, 100), None, None), ("layer_norm", (3, 1000), None, 256)])
def test_weightless_norm_kernels(op, shape, stride, block):
    """No weight pointer, one rounding: equal to the reference rounded to bf16 (but for the odd
    last-bit difference of an fp32 sum), and to torch's weightless forms."""
    gen = np.random.default_rng(sum(shape))
    wide, x = _strided(shape, stride, gen)
    if op == "layer_norm":
        x = x + 3.0          # a large mean: LayerNorm's centering matters
        wide = x.reshape(shape[0], -1)
    sym = ["T"] + list(shape[1:])
    extra = {"row_stride": stride} if stride else {}
    k = render(op, op, [("x", sym, "bf16", "buffer", extra)], [("y", sym, "bf16")],
               {"eps": EPS, "has_weight": False}, tune={"BLOCK": block} if block else None)
    assert "w_ptr" not in k.source
    out = poison(shape)
    run(k, {"in:0": wide, "out:0": out}, {"T": shape[0], "B": 1})
    want = REGISTRY[op].reference(None, x.float().numpy(), eps=EPS, has_weight=False)
    xt = x.float()
    hf = (xt * torch.rsqrt(xt.pow(2).mean(-1, keepdim=True) + EPS) if op == "rms_norm"
          else F.layer_norm(xt, (shape[-1],), None, None, EPS)).numpy()
    np.testing.assert_allclose(want, hf, rtol=1e-5, atol=1e-5)
    got = out.float().numpy()
    assert (got == bf16(want)).mean() > 0.98
    assert np.abs(got - want).max() <= 2 ** -8 * np.abs(want).max()


def test_layer_norm_bias_without_weight_kernel():
    """F.layer_norm(x, shape, None, b): the bias is the second input when the weight is left out."""
    gen = np.random.default_rng(3)
    x, b = rand((4, 77), gen=gen), rand((77,), gen=gen)
    k = render("layer_norm", "layer_norm", [("x", ["T", 77], "bf16"), ("b", [77], "bf16", "weight")],
               [("y", ["T", 77], "bf16")], {"eps": EPS, "has_weight": False, "has_bias": True})
    out = poison((4, 77))
    run(k, {"in:0": x, "in:1": b, "out:0": out}, {"T": 4, "B": 1})
    want = F.layer_norm(x.float(), (77,), None, b.float(), EPS).numpy()
    np.testing.assert_allclose(REGISTRY["layer_norm"].reference(None, x.float().numpy(), b.float().numpy(),
                               eps=EPS, has_weight=False, has_bias=True), want, rtol=1e-5, atol=1e-5)
    assert np.abs(out.float().numpy() - want).max() <= 2 ** -8 * np.abs(want).max()


@pytest.mark.parametrize("shape,stride,eps", [((7, 3, 20), None, 1e-12), ((5, 2, 33), 2 * 33 + 5, 1e-12),
                                              ((6, 40), None, 0.5)])
def test_normalize_kernel(shape, stride, eps):
    """F.normalize(x, dim=-1, eps): rows scaled to unit length, those shorter than eps divided by
    eps (eps 0.5 with some rows made small), not x * rsqrt(sum + eps)."""
    gen = np.random.default_rng(sum(shape))
    wide, x = _strided(shape, stride, gen)
    if eps == 0.5:
        wide[::2] *= 0.02         # rows whose norm is below eps
    sym = ["T"] + list(shape[1:])
    extra = {"row_stride": stride} if stride else {}
    k = render("l2_norm", "normalize", [("x", sym, "bf16", "buffer", extra)], [("y", sym, "bf16")], {"eps": eps})
    out = poison(shape)
    run(k, {"in:0": wide, "out:0": out}, {"T": shape[0], "B": 1})
    want = REGISTRY["normalize"].reference(None, x.float().numpy(), eps=eps)
    np.testing.assert_allclose(want, F.normalize(x.float(), dim=-1, eps=eps).numpy(), rtol=1e-6, atol=1e-7)
    other = REGISTRY["l2_norm"].reference(None, x.float().numpy(), eps=eps)
    if eps == 0.5:
        assert np.abs(want - other).max() > 0.02           # the two sum-style norms differ
    got = out.float().numpy()
    assert np.abs(got - want).max() <= 2 ** -8 * np.abs(want).max()


def _hf_xielu(x, ap, an, beta, eps):
    from transformers.activations import XIELUActivation
    m = XIELUActivation(beta=beta, eps=eps, dtype=torch.float32)
    with torch.no_grad():
        m.alpha_p.copy_(torch.tensor([ap]))
        m.alpha_n.copy_(torch.tensor([an]))
        return m(torch.as_tensor(x)).numpy()


@pytest.mark.parametrize("shape,beta,eps", [((5, 77), 0.5, -1e-6), ((3, 2, 1100), 0.25, -1e-3)])
def test_xielu_kernel_and_reference(shape, beta, eps):
    """transformers' XIELUActivation (its python path) with set parameters: the reference equals it,
    the kernel the reference, on both sides of 0 and near it (expm1's cancellation)."""
    gen = np.random.default_rng(sum(shape))
    x = rand(shape, scale=3.0, gen=gen)
    x.view(-1)[:40] = torch.linspace(-1e-3, 1e-3, 40).to(torch.bfloat16)
    ap, an = torch.tensor([0.3], dtype=torch.bfloat16), torch.tensor([-0.7], dtype=torch.bfloat16)
    sym = ["T"] + list(shape[1:])
    k = render("act", "xielu", [("x", sym, "bf16"), ("ap", [1], "bf16", "weight"), ("an", [1], "bf16", "weight")],
               [("y", sym, "bf16")], {"beta": beta, "eps": eps}, tune={"BLOCK": 256})
    out = poison(shape)
    run(k, {"in:0": x, "in:1": ap, "in:2": an, "out:0": out}, {"T": shape[0], "B": 1})
    xf = x.float().numpy()
    want = REGISTRY["xielu"].reference(None, xf, ap.float().numpy(), an.float().numpy(), beta=beta, eps=eps)
    np.testing.assert_allclose(want, _hf_xielu(xf, ap.float().item(), an.float().item(), beta, eps),
                               rtol=1e-5, atol=1e-7)
    got = out.float().numpy()
    assert np.abs(got - want).max() <= 2 ** -8 * np.abs(want).max()
    small = np.abs(xf) < 2e-3        # near 0: the series, not exp(z) - 1
    assert np.abs(got[small] - want[small]).max() <= 2 ** -8 * np.abs(want[small]).max() + 1e-9


@pytest.mark.parametrize("shape,threshold,value", [((5, 77), 0.3, 0.0), ((3, 2, 1100), -0.5, 2.5)])
def test_threshold_kernel(shape, threshold, value):
    """F.threshold(x, threshold, value): the reference equals torch's, the kernel the reference."""
    gen = np.random.default_rng(sum(shape))
    x = rand(shape, gen=gen)
    sym = ["T"] + list(shape[1:])
    k = render("act", "threshold", [("x", sym, "bf16")], [("y", sym, "f32")],
               {"threshold": threshold, "value": value}, tune={"BLOCK": 256})
    out = poison(shape, "f32")
    run(k, {"in:0": x, "out:0": out}, {"T": shape[0], "B": 1})
    want = REGISTRY["threshold"].reference(None, x.float().numpy(), threshold=threshold, value=value)
    assert np.array_equal(want, F.threshold(x.float(), threshold, value).numpy())
    assert np.array_equal(out.numpy(), want)
