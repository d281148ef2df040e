"""Norm, elementwise, gather and router kernels under the interpreter, against numpy references.

add_rms_norm and rms_norm are also checked against a bf16 emulation of HF's order of operations
(the residual sum rounded to bf16 before the norm; with a bf16 weight the normalized value rounded
before the weight multiply, Llama's order; with an f32 weight, Gemma's and Qwen3.5's 1 + w.float(),
the product rounded once).
The exact bf16 comparisons rely on harness.py making the interpreter round fp32 -> bf16 to
nearest even, as the GPU does (Triton's interpreter truncates).
"""
import numpy as np
import pytest
import torch

from infc.compiler.ops import REGISTRY

from .harness import bf16, poison, rand, rel_err, render, run

EPS = 1e-6


def hf_scale(n, w):
    """HF's RMSNorm weight multiply on the normalized rows n (float64): a bf16 weight multiplies
    bf16(n), rounded again (Llama, Qwen3: `w * n.to(dtype)`); an f32 weight multiplies n in fp32,
    rounded once (Gemma, Qwen3.5: `(n * (1 + w.float())).to(dtype)`)."""
    if w.dtype == torch.float32:
        return bf16(n * w.numpy())
    return bf16(bf16(n) * w.float().numpy())


def hf_add_rms_norm(x, d, w, eps):
    """HF: residual = bf16(x + d); h = hf_scale(s * rsqrt(mean(s^2) + eps), w)."""
    s = bf16(x.float().numpy() + d.float().numpy())
    var = np.mean(s.astype(np.float64) ** 2, axis=-1, keepdims=True)
    return s, hf_scale(s / np.sqrt(var + eps), w)


def norm_weight(n, wdtype, gen):
    """A norm weight around 1 (bf16), or 1 + w with w bf16 kept f32 (the offset form's load)."""
    if wdtype == "f32":
        w = torch.from_numpy(0.2 * gen.standard_normal(n).astype(np.float32)).to(torch.bfloat16)
        return 1.0 + w.float()
    return torch.from_numpy(1 + 0.2 * gen.standard_normal(n).astype(np.float32)).to(torch.bfloat16)


def other_order(n, w):
    """The order of roundings the other weight dtype would give (the test's counterfactual)."""
    if w.dtype == torch.float32:
        return bf16(bf16(n) * w.numpy())
    return bf16(n * w.float().numpy())


def assert_hf_order(got, want, counterfactual):
    """bf16 outputs differ from the emulation by at most one bf16 rounding step, and rarely (the
    kernel's fp32 sum of squares is not numpy's), while the other order of roundings would make
    many elements differ: the test tells the two orders apart."""
    assert np.abs(got - want).max() <= 2 ** -7 * np.abs(want).max() + 1e-6
    assert (got == want).mean() >= 0.99
    if got.size >= 100:
        assert (got == counterfactual).mean() < 0.95


@pytest.mark.parametrize("T,H,block", [(1, 1, None), (3, 100, None), (5, 2600, None), (4, 1000, 256),
                                       (2, 9000, None)])
@pytest.mark.parametrize("wdtype", ["bf16", "f32"])
def test_add_rms_norm_in_place(T, H, block, wdtype):
    gen = np.random.default_rng(H)
    x, d = rand((T, H), gen=gen), rand((T, H), scale=0.5, gen=gen)
    w = norm_weight(H, wdtype, gen)
    k = render("add_rms_norm", "add_rms_norm",
               [("x", ["T", H], "bf16"), ("d", ["T", H], "bf16"), ("w", [H], wdtype, "weight")],
               [("x", ["T", H], "bf16"), ("h", ["T", H], "bf16")], {"eps": EPS},
               tune={"BLOCK": block} if block else None)
    x_in = x.clone()
    h = poison((T, H))
    run(k, {"in:0": x, "in:1": d, "in:2": w, "out:0": x, "out:1": h}, {"T": T, "B": 1})

    s_hf, h_hf = hf_add_rms_norm(x_in, d, w, EPS)
    assert np.array_equal(x.float().numpy(), s_hf), "residual sum is not bf16(x + d), written in place"
    assert rel_err(h.float(), h_hf) < 1e-2
    s64 = s_hf.astype(np.float64)
    n = s64 / np.sqrt(np.mean(s64 * s64, -1, keepdims=True) + EPS)
    assert_hf_order(h.float().numpy(), h_hf, other_order(n, w))
    s_ref, h_ref = REGISTRY["add_rms_norm"].reference(None, x_in.float().numpy(), d.float().numpy(),
                                                      w.float().numpy(), eps=EPS)
    assert rel_err(x.float(), s_ref) < 1e-2 and rel_err(h.float(), h_ref) < 1e-2


@pytest.mark.parametrize("shape,block", [((1, 1), None), ((7, 100), None), ((3, 4, 128), None),
                                         ((2, 2600), None), ((3, 1000), 256)])
@pytest.mark.parametrize("wdtype", ["bf16", "f32"])
def test_rms_norm(shape, block, wdtype):
    gen = np.random.default_rng(sum(shape))
    n = shape[-1]
    x = rand(shape, scale=2.0, gen=gen)
    w = norm_weight(n, wdtype, gen)
    sym = ["T"] + list(shape[1:])
    k = render("rms_norm", "rms_norm", [("x", sym, "bf16"), ("w", [n], wdtype, "weight")],
               [("y", sym, "bf16")], {"eps": EPS}, tune={"BLOCK": block} if block else None)
    out = poison(shape)
    run(k, {"in:0": x, "in:1": w, "out:0": out}, {"T": shape[0], "B": 1})
    want = REGISTRY["rms_norm"].reference(None, x.float().numpy(), w.float().numpy(), eps=EPS)
    assert rel_err(out.float(), want) < 1e-2
    xf = x.float().numpy().astype(np.float64)
    normed = xf / np.sqrt(np.mean(xf * xf, -1, keepdims=True) + EPS)
    assert_hf_order(out.float().numpy(), hf_scale(normed, w), other_order(normed, w))


ELEMENTWISE_SHAPES = [((1, 1), None), ((5, 1000), None), ((3, 2600), 512), ((2, 3, 50), None)]


@pytest.mark.parametrize("name", ["add", "mul"])
@pytest.mark.parametrize("shape,block", ELEMENTWISE_SHAPES)
def test_add_mul(name, shape, block):
    gen = np.random.default_rng(len(name) + sum(shape))
    a, b = rand(shape, gen=gen), rand(shape, gen=gen)
    sym = ["T"] + list(shape[1:])
    k = render(name, name, [("a", sym, "bf16"), ("b", sym, "bf16")], [("c", sym, "bf16")],
               tune={"BLOCK": block} if block else None)
    out = poison(shape)
    run(k, {"in:0": a, "in:1": b, "out:0": out}, {"T": shape[0], "B": 1})
    want = REGISTRY[name].reference(None, a.float().numpy(), b.float().numpy())
    assert np.array_equal(out.float().numpy(), bf16(want))      # fp32 op, one rounding


@pytest.mark.parametrize("shape,block", ELEMENTWISE_SHAPES)
def test_silu(shape, block):
    gen = np.random.default_rng(sum(shape))
    x = rand(shape, scale=3.0, gen=gen)
    sym = ["T"] + list(shape[1:])
    k = render("act", "silu", [("x", sym, "bf16")], [("y", sym, "bf16")], tune={"BLOCK": block} if block else None)
    out = poison(shape)
    run(k, {"in:0": x, "out:0": out}, {"T": shape[0], "B": 1})
    want = REGISTRY["silu"].reference(None, x.float().numpy())
    assert rel_err(out.float(), want) < 1e-2
    assert np.abs(out.float().numpy() - want).max() <= 2 ** -8 * np.abs(want).max() + 1e-6


@pytest.mark.parametrize("T,rows,tail,block", [(1, [0], (1,), None), (10, [2, 6, 9], (100,), None),
                                               (20, [4, 5, 11, 19], (2600,), 1024), (6, [1, 5], (4, 30), 64)])
def test_gather_last(T, rows, tail, block):
    gen = np.random.default_rng(T)
    x = rand((T,) + tail, gen=gen)
    B = len(rows)
    k = render("gather_last", "last", [("x", ["T", *tail], "bf16")], [("y", ["B", *tail], "bf16")],
               tune={"BLOCK": block} if block else None)
    out = poison((B,) + tail)
    last_rows = torch.tensor(rows, dtype=torch.int32)
    run(k, {"in:0": x, "meta:last_rows": last_rows, "out:0": out}, {"T": T, "B": B})

    class Ctx:
        pass
    ctx = Ctx()
    ctx.last_rows = np.array(rows)
    assert np.array_equal(out.float().numpy(), REGISTRY["last"].reference(ctx, x.float().numpy()))


def router_logits(T, E, gen, ties):
    """Distinct logits 1/8 apart (exact in bf16, no near-ties), with exact ties planted where
    they decide the choice: ranks k-1 and k (the last kept slot), and ranks 0 and 1."""
    l = np.stack([(gen.permutation(E) - E // 2) * 0.125 for _ in range(T)]).astype(np.float32)
    for t, (a, b) in zip(range(T), ties):
        order = np.argsort(-l[t], kind="stable")
        l[t, order[b]] = l[t, order[a]]
    return torch.from_numpy(l).to(torch.bfloat16)


@pytest.mark.parametrize("T,E,K,normalize", [(1, 8, 2, True), (5, 128, 8, True), (3, 512, 16, False),
                                             (4, 60, 4, True)])
def test_moe_route(T, E, K, normalize):
    gen = np.random.default_rng(E)
    logits = router_logits(T, E, gen, ties=[(K - 1, K), (0, 1)])
    k = render("moe_route", "moe_route", [("logits", ["T", E], "bf16")],
               [("w", ["T", K], "f32"), ("ids", ["T", K], "i32")], {"k": K, "normalize": normalize})
    w, ids = poison((T, K), "f32"), poison((T, K), "i32")
    run(k, {"in:0": logits, "out:0": w, "out:1": ids}, {"T": T, "B": 1})
    w_ref, ids_ref = REGISTRY["moe_route"].reference(None, logits.float().numpy(), k=K, normalize=normalize)
    assert np.array_equal(ids.numpy(), ids_ref)
    assert np.allclose(w.numpy(), w_ref, rtol=1e-5, atol=1e-7)
    # the planted ties decide: row 0 at the last kept slot (the lower id is kept, the other is
    # not), row 1 at the top (the lower id comes first)
    l, got = logits.float().numpy(), ids.numpy()
    tied = np.nonzero(l[0] == l[0, got[0, K - 1]])[0]
    assert len(tied) == 2 and got[0, K - 1] == tied.min() and tied.max() not in got[0]
    if T > 1:
        assert l[1, got[1, 0]] == l[1, got[1, 1]] and got[1, 0] < got[1, 1]
