"""DeepSeek-V4's non-attention kernels under the interpreter against the ops' numpy references:
the hyper-connection ops (hc_mix, hc_weights / hc_head_weights, hc_collapse, hc_expand, hc_streams) and
moe_route_table's scored form (the hash router weighed by the router's scores). Shapes fit no
block: N = 3 streams pad to 4 lanes, T and H are not multiples of ROWS / BLOCK. (The clamped_silu
expert activation is in test_moe_gated_kernels.py.)"""
import numpy as np
import pytest
import torch

from infc.compiler.ops import REGISTRY

from .harness import poison, rand, rel_err, render, run


def ref(name, *args, **attrs):
    return REGISTRY[name].reference(None, *args, **attrs)


def f32(t):
    return t.float().numpy()


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_hc_mix(dtype):
    gen = np.random.default_rng(11)
    T, n, H, M = 6, 3, 40, 15              # K = 120: two BLOCK_K = 64 slices, the second partial
    x, fn = rand((T, n, H), dtype, gen=gen), rand((M, n * H), "f32", 0.1, gen)
    k = render("hc_mix", "hc_mix", [("x", ["T", n, H], dtype), ("fn", [M, n * H], "f32", "weight")],
               [("mix", ["T", M], "f32")], attrs={"eps": 1e-6})
    mix = poison((T + 1, M), "f32")
    run(k, {"in:0": x, "in:1": fn, "out:0": mix}, {"T": T, "B": 1})
    np.testing.assert_allclose(mix[:T].numpy(), ref("hc_mix", f32(x), fn.numpy(), eps=1e-6), rtol=1e-5, atol=1e-6)
    assert torch.isnan(mix[T:]).all(), "wrote rows past T"

    # after last(): the rows are the step's B sequences, not its T tokens
    k = render("hc_mix", "hc_mix", [("x", ["B", n, H], dtype), ("fn", [M, n * H], "f32", "weight")],
               [("mix", ["B", M], "f32")], attrs={"eps": 1e-6})
    mix = poison((T + 1, M), "f32")
    run(k, {"in:0": x, "in:1": fn, "out:0": mix}, {"T": 40, "B": 2})
    np.testing.assert_allclose(mix[:2].numpy(), ref("hc_mix", f32(x[:2]), fn.numpy(), eps=1e-6), rtol=1e-5, atol=1e-6)
    assert torch.isnan(mix[2:]).all(), "wrote rows past B"


@pytest.mark.parametrize("T", [1, 6, 20])
def test_hc_mix_split_k(T):
    """The few-token launches' split-K (fn read by SPLIT programs a token block, the last to arrive
    adds their partials in order): 3 uneven K ranges of whole BLOCK_Ks; T = 20 is over SPLIT_ROWS
    (16), one program a token block, no split."""
    gen = np.random.default_rng(T)
    n, H, M = 3, 40, 15                     # K = 120: BLOCK_K = 16 slices, ranges of 48, 48, 24
    x, fn = rand((T, n, H), "bf16", gen=gen), rand((M, n * H), "f32", 0.1, gen)
    k = render("hc_mix", "hc_mix", [("x", ["T", n, H], "bf16"), ("fn", [M, n * H], "f32", "weight")],
               [("mix", ["T", M], "f32")], attrs={"eps": 1e-6}, tune={"SPLIT_K": 3, "BLOCK_K": 16})
    assert k.meta["constexprs"]["ZMAX"] == 3
    mix = poison((T + 1, M), "f32")
    run(k, {"in:0": x, "in:1": fn, "out:0": mix}, {"T": T, "B": 1})
    np.testing.assert_allclose(mix[:T].numpy(), ref("hc_mix", f32(x), fn.numpy(), eps=1e-6), rtol=1e-5, atol=1e-6)
    assert torch.isnan(mix[T:]).all(), "wrote rows past T"


@pytest.mark.parametrize("n,iters", [(3, 5), (4, 20)])
def test_hc_weights(n, iters):
    gen = np.random.default_rng(n)
    T, M = 19, (2 + n) * n
    mix, base, scale = rand((T, M), "f32", 2.0, gen), rand((M,), "f32", 0.5, gen), rand((3,), "f32", 1.0, gen)
    k = render("hc_weights", "hc_weights", [("mix", ["T", M], "f32"), ("base", [M], "f32", "weight"),
                                             ("scale", [3], "f32", "weight")],
               [("pre", ["T", n], "f32"), ("post", ["T", n], "f32"), ("comb", ["T", n, n], "f32")],
               attrs={"iters": iters, "eps": 1e-6})
    out = [poison((T + 2, n), "f32"), poison((T + 2, n), "f32"), poison((T + 2, n, n), "f32")]
    run(k, {"in:0": mix, "in:1": base, "in:2": scale, "out:0": out[0], "out:1": out[1], "out:2": out[2]}, {"T": T, "B": 1})
    want = ref("hc_weights", mix.numpy(), base.numpy(), scale.numpy(), iters=iters, eps=1e-6)
    for got, w in zip(out, want):
        np.testing.assert_allclose(got[:T].numpy(), w, rtol=1e-5, atol=1e-6)
        assert torch.isnan(got[T:]).all(), "wrote rows past T"


def test_hc_head_weights():
    gen = np.random.default_rng(7)
    T, n = 19, 3
    mix, base, scale = rand((T, n), "f32", 2.0, gen), rand((n,), "f32", 0.5, gen), rand((1,), "f32", 1.0, gen)
    k = render("hc_weights", "hc_head_weights", [("mix", ["T", n], "f32"), ("base", [n], "f32", "weight"),
                                                  ("scale", [1], "f32", "weight")], [("pre", ["T", n], "f32")],
               attrs={"eps": 1e-6})
    pre = poison((T, n), "f32")
    run(k, {"in:0": mix, "in:1": base, "in:2": scale, "out:0": pre}, {"T": T, "B": 1})
    np.testing.assert_allclose(pre.numpy(), ref("hc_head_weights", mix.numpy(), base.numpy(), scale.numpy(), eps=1e-6),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_hc_collapse_expand_streams(dtype):
    gen = np.random.default_rng(3)
    T, n, H = 5, 3, 40
    tune = {"BLOCK": 16}
    x, y = rand((T, n, H), dtype, gen=gen), rand((T, H), dtype, gen=gen)
    pre, post = rand((T, n), "f32", gen=gen), rand((T, n), "f32", gen=gen)
    comb = rand((T, n, n), "f32", gen=gen)
    tol = 1e-6 if dtype == "f32" else 1e-2

    k = render("hc_collapse", "hc_collapse", [("x", ["T", n, H], dtype), ("pre", ["T", n], "f32")],
               [("out", ["T", H], dtype)], tune=tune)
    out = poison((T, H), dtype)
    run(k, {"in:0": x, "in:1": pre, "out:0": out}, {"T": T, "B": 1})
    assert rel_err(f32(out), ref("hc_collapse", f32(x), pre.numpy())) < tol

    k = render("hc_expand", "hc_expand", [("y", ["T", H], dtype), ("x", ["T", n, H], dtype), ("post", ["T", n], "f32"),
                                          ("comb", ["T", n, n], "f32")], [("out", ["T", n, H], dtype)], tune=tune)
    out = poison((T, n, H), dtype)
    run(k, {"in:0": y, "in:1": x, "in:2": post, "in:3": comb, "out:0": out}, {"T": T, "B": 1})
    want = ref("hc_expand", f32(y), f32(x), post.numpy(), comb.numpy())
    assert rel_err(f32(out), want) < tol
    # comb is read as [j, k] (the sum over its first axis): its transpose would be far off
    assert rel_err(want, ref("hc_expand", f32(y), f32(x), post.numpy(), comb.numpy().transpose(0, 2, 1))) > 100 * tol

    k = render("hc_streams", "hc_streams", [("x", ["T", H], dtype)], [("out", ["T", n, H], dtype)], attrs={"n": n}, tune=tune)
    out = poison((T, n, H), dtype)
    run(k, {"in:0": y, "out:0": out}, {"T": T, "B": 1})
    np.testing.assert_array_equal(f32(out), ref("hc_streams", f32(y), n=n))


@pytest.mark.parametrize("scoring,normalize,scale,shared", [("sqrtsoftplus", True, 1.5, 0), ("softmax", False, 1.0, 0),
                                                            ("sigmoid", True, 2.0, 0), ("sqrtsoftplus", True, 1.5, 1),
                                                            ("softmax", False, 1.0, 3)])
def test_route_table_scored(scoring, normalize, scale, shared):
    """shared: the shared experts folded in (fold_shared_experts) as slots K .. K + shared - 1,
    experts E .. E + shared - 1 at weight 1 after the table's (3 slots pad to 4 lanes)."""
    gen = np.random.default_rng(5)
    T, V, K, E = 70, 40, 3, 9
    table = torch.from_numpy(np.stack([gen.choice(E, K, replace=False) for _ in range(V)]).astype(np.int32))
    ids = torch.from_numpy(gen.integers(0, V, T).astype(np.int32))
    logits = rand((T, E), "f32", 3.0, gen)
    logits[0, :] = -30.0          # sqrtsoftplus's tail (log1p's series)
    attrs = {"has_logits": True, "scoring": scoring, "normalize": normalize, "scale": scale,
             **({"shared": shared} if shared else {})}
    KO = K + shared
    k = render("moe_route_table", "moe_route_table", [("ids", ["T"], "i32"), ("table", [V, K], "i32", "weight"),
                                                      ("logits", ["T", E], "f32")],
               [("w", ["T", KO], "f32"), ("e", ["T", KO], "i32")], attrs=attrs)
    w, e = poison((T + 2, KO), "f32"), poison((T + 2, KO), "i32")
    run(k, {"in:0": ids, "in:1": table, "in:2": logits, "out:0": w, "out:1": e}, {"T": T, "B": 1})
    want_w, want_e = ref("moe_route_table", ids.numpy(), table.numpy(), logits.numpy(), **attrs)
    assert want_e.shape == (T, KO) and (want_e[:, K:] == np.arange(E, E + shared)).all()
    assert (want_w[:, K:] == 1.0).all()
    assert np.array_equal(e[:T].numpy(), want_e)
    np.testing.assert_allclose(w[:T].numpy(), want_w, rtol=3e-5, atol=1e-6)   # log(1 + u) in f32 vs log1p
    assert torch.isnan(w[T:]).all() and (e[T:] == -7777).all(), "wrote rows past T"
