"""The delta rule in two launches (compiler/passes/split_delta_rule.py): delta_rule_wy solves every
chunk's WY form at once, then the chunked rule walks the chunks in order reading W and U.

The reference of delta_rule_wy is checked by walking its chunks with the state in numpy against
the token-by-token rule; its kernel and the rule's kernel that reads W and U are checked under
the interpreter against the references, on the layouts of tests/kernels/test_linear_attention.py:
ragged sequences (rows past a sequence's end in its last chunk), new and continuing sequences
(NaN in every slot a kernel must not read), heads dims that are not powers of two, two v blocks,
and q / k / a / b as strided bf16 views made raw (the gates and the norms inside).
"""
import numpy as np
import pytest
import torch

from infc.compiler.ir import TensorType
from infc.compiler.ops import REGISTRY, ShapeError

from .harness import poison, rel_err, render, run
from .test_linear_attention import (Ctx, _check_rule, _delta_inputs, _gate_inputs, _rule_inputs, meta_bindings,
                                    poisoned_slots, raw_rule_inputs)

RULE, WY = REGISTRY["gated_delta_rule"], REGISTRY["delta_rule_wy"]


def _walk(ctx, q, k, W, U, g, chunk, scale):
    """The rule from W and U: per chunk, the state's products only (what the chunked kernel keeps)."""
    hv = W.shape[1]
    qh, kh = (np.repeat(x, hv // x.shape[1], axis=1) for x in (q, k))
    store = ctx.cache("recurrent")
    out = np.zeros(U.shape, np.float32)
    for b, start, n, cached in ctx.seqs:
        slot = int(ctx.meta.state_slots[b])
        S = store[slot].copy() if cached > 0 else np.zeros((hv, kh.shape[2], U.shape[2]), np.float32)
        for c0 in range(0, n, chunk):
            rows = slice(start + c0, start + min(n, c0 + chunk))
            qc, kc, Wc, Uc = (x[rows].transpose(1, 0, 2) for x in (qh, kh, W, U))     # [Hv, L, D]
            G = np.cumsum(g[rows].T, axis=1)
            L = G.shape[1]
            D = np.exp(np.where(np.tril(np.ones((L, L), bool)), G[:, :, None] - G[:, None, :], -np.inf))
            vn = Uc - Wc @ S
            o = (qc * np.exp(G)[:, :, None]) @ S + ((qc @ kc.transpose(0, 2, 1)) * D) @ vn
            out[rows] = (o * scale).transpose(1, 0, 2)
            S = S * np.exp(G[:, -1])[:, None, None] + (kc * np.exp(G[:, -1:] - G)[:, :, None]).transpose(0, 2, 1) @ vn
        store[slot] = S
    return out


@pytest.mark.parametrize("chunk", [16, 64])
def test_wy_reference_walked_by_chunks_is_the_rule(chunk):
    gen = np.random.default_rng(chunk)
    hk, hv, dk, dv = 2, 4, 24, 20
    specs, slots = [(0, 70), (0, 7), (13, 40), (3, 1)], [3, 0, 5, 1]
    T = sum(n for _, n in specs)
    q, k, v, g, beta = _delta_inputs(gen, T, hk, hv, dk, dv)
    store = np.full((6 + 1, hv, dk, dv), np.nan, np.float32)
    for (cached, _), s in zip(specs, slots):
        if cached:
            store[s] = gen.standard_normal((hv, dk, dv)) * 0.3
    walked, ruled = store.copy(), store.copy()
    W, U = WY.reference(Ctx(specs, slots, {}), k, v, g, beta, chunk=chunk)
    got = _walk(Ctx(specs, slots, {"recurrent": walked}), q, k, W, U, g, chunk, dk ** -0.5)
    want = RULE.reference(Ctx(specs, slots, {"recurrent": ruled}), q, k, v, g, beta)
    assert rel_err(got, want) < 1e-5
    assert np.nanmax(np.abs(walked - ruled)) < 1e-4 and np.array_equal(np.isnan(walked), np.isnan(ruled))


def test_wy_reference_makes_the_gates_and_norms_as_the_rule():
    gen = np.random.default_rng(9)
    hk, hv, dk, dv, T = 2, 4, 24, 20, 45
    specs, slots = [(0, 38), (4, 7)], [2, 4]
    _, k, v, _, _ = _delta_inputs(gen, T, hk, hv, dk, dv)
    k = k * gen.uniform(0.5, 3, (T, hk, 1)).astype(np.float32)          # raw: not unit rows
    a, b, dt_bias, A, _ = (x.float().numpy() if torch.is_tensor(x) else x for x in _gate_inputs(gen, T, hv))
    W, U = WY.reference(Ctx(specs, slots, {}), k, v, a, b, dt_bias, A, chunk=32, gates="f32", qk_norm=1e-6,
                        has_dt_bias=True, has_A=True)
    kn = REGISTRY["l2_norm"].reference(None, k, eps=1e-6)
    g = REGISTRY["softplus"].reference(None, a + dt_bias) * A
    beta = REGISTRY["sigmoid"].reference(None, b)
    W2, U2 = WY.reference(Ctx(specs, slots, {}), kn, v, g, beta, chunk=32)
    assert np.array_equal(W, W2) and np.array_equal(U, U2)


def test_infer_checks_chunk_and_shapes():
    t = lambda *s, d="bf16": TensorType(s, d)  # noqa: E731
    k, v, gb = t("T", 2, 24), t("T", 4, 20), t("T", 4, d="f32")
    w, u = WY.infer([k, v, gb, gb], {"chunk": 64})
    assert w == t("T", 4, 24, d="f32") and u == t("T", 4, 20, d="f32")
    for bad in (None, 48, 128, True):
        with pytest.raises(ShapeError, match="chunk"):
            WY.infer([k, v, gb, gb], {"chunk": bad})
    q = k
    with pytest.raises(ShapeError, match="W, U"):
        RULE.infer([q, k, v, gb, gb, w, t("T", 4, 20)], {"has_wy_w": True, "has_wy_u": True, "chunk": 64})
    with pytest.raises(ShapeError, match="chunk"):
        RULE.infer([q, k, v, gb, gb, w, u], {"has_wy_w": True, "has_wy_u": True})
    assert RULE.infer([q, k, v, gb, gb, w, u], {"has_wy_w": True, "has_wy_u": True, "chunk": 16}) == [v]


def _launches(phase, hk, hv, dk, dv, chunk, tune=None, gated=None):
    """(delta_rule_wy's kernel, the rule's chunked kernel reading W and U); gated: (width of a, b's
    row, width of q, k's row) for the fused form (raw strided bf16 views, gates and norms inside)."""
    if gated:
        gw, qw = gated
        qk = [("q", ["T", hk, dk], "bf16", "buffer", {"row_stride": qw}),
              ("k", ["T", hk, dk], "bf16", "buffer", {"row_stride": qw})]
        gates = [("a", ["T", hv], "bf16", "buffer", {"row_stride": gw}), ("b", ["T", hv], "bf16", "buffer", {"row_stride": gw}),
                 ("dt_bias", [hv], "f32", "weight"), ("A", [hv], "f32", "weight")]
        attrs = {"gates": "bf16", "has_dt_bias": True, "has_A": True, "qk_norm": 1e-6}
    else:
        qk = [("q", ["T", hk, dk], "bf16"), ("k", ["T", hk, dk], "bf16")]
        gates = [("g", ["T", hv], "f32"), ("beta", ["T", hv], "f32")]
        attrs = {}
    v = ("v", ["T", hv, dv], "bf16")
    wu = [("wy_w", ["T", hv, dk], "f32"), ("wy_u", ["T", hv, dv], "f32")]
    caches = {"recurrent": {"kind": "slot", "shape": [hv, dk, dv], "dtype": "f32", "layers": [0]}}
    assert WY.template("triton", phase) == "delta_rule_wy" and phase in WY.phases
    wy = render("delta_rule_wy", "delta_rule_wy", [qk[1], v, *gates], wu, {"chunk": chunk, **attrs}, phase=phase,
                tune=tune)
    rule = render("gated_delta_rule_chunk", "gated_delta_rule", [*qk, v, *gates, *wu], [("o", ["T", hv, dv], "bf16")],
                  {"chunk": chunk, "has_wy_w": True, "has_wy_u": True, **attrs}, phase=phase, caches=caches,
                  tune=tune)
    return wy, rule


@pytest.mark.parametrize("phase,chunk,tune,specs,slots", [
    ("prefill", 16, None, [(0, 70), (0, 7), (0, 1)], [3, 0, 5]),                   # 5 + 1 + 1 chunks, ragged
    ("mixed", 64, None, [(0, 70), (12, 1), (3, 7)], [1, 4, 2]),                      # decodes beside a prompt
    ("short", 32, {"BV": 16}, [(5, 40), (0, 1), (9, 2), (0, 33)], [5, 2, 0, 3]),     # two v blocks
])
def test_wy_then_rule_kernels_equal_the_rule(phase, chunk, tune, specs, slots):
    gen = np.random.default_rng(chunk + len(specs))
    hk, hv, dk, dv = 2, 4, 24, 20
    T = sum(n for _, n in specs)
    q, k, v, g, beta = _rule_inputs(gen, T, hk, hv, dk, dv)
    store, ref = poisoned_slots((hv, dk, dv), specs, slots, gen, torch.float32)
    wy, rule = _launches(phase, hk, hv, dk, dv, chunk, tune)
    W, U = poison((T, hv, dk), "f32"), poison((T, hv, dv), "f32")
    meta = meta_bindings(specs, slots)
    run(wy, {"in:0": k, "in:1": v, "in:2": g, "in:3": beta, "out:0": W, "out:1": U, **meta}, {"T": T, "B": len(specs)})
    arrays = [x.float().numpy() for x in (q, k, v, g, beta)]
    Wr, Ur = WY.reference(Ctx(specs, slots, {}), *arrays[1:], chunk=chunk)
    assert rel_err(W.numpy(), Wr) < 1e-5 and rel_err(U.numpy(), Ur) < 1e-5        # every row written
    out = poison((T, hv, dv))
    run(rule, {"in:0": q, "in:1": k, "in:2": v, "in:3": g, "in:4": beta, "in:5": W, "in:6": U, "out:0": out,
               "cache:recurrent": store, **meta}, {"T": T, "B": len(specs)})
    want = RULE.reference(Ctx(specs, slots, {"recurrent": ref}), *arrays)
    _check_rule(out.float().numpy(), want, store, ref, specs, slots)


def test_wy_then_rule_kernels_make_their_gates_and_norms():
    gen = np.random.default_rng(31)
    hk, hv, dk, dv = 2, 4, 24, 20
    specs, slots = [(0, 37), (6, 9), (0, 5)], [3, 0, 1]
    T = sum(n for _, n in specs)
    q, k, v, a, b, dt_bias, A, gw, qw = raw_rule_inputs(gen, T, hk, hv, dk, dv)
    store, ref = poisoned_slots((hv, dk, dv), specs, slots, gen, torch.float32)
    wy, rule = _launches("mixed", hk, hv, dk, dv, 16, gated=(gw, qw))
    W, U = poison((T, hv, dk), "f32"), poison((T, hv, dv), "f32")
    meta = meta_bindings(specs, slots)
    run(wy, {"in:0": k, "in:1": v, "in:2": a, "in:3": b, "in:4": dt_bias, "in:5": A, "out:0": W, "out:1": U, **meta},
        {"T": T, "B": len(specs)})
    out = poison((T, hv, dv))
    run(rule, {"in:0": q, "in:1": k, "in:2": v, "in:3": a, "in:4": b, "in:5": dt_bias, "in:6": A, "in:7": W,
               "in:8": U, "out:0": out, "cache:recurrent": store, **meta}, {"T": T, "B": len(specs)})
    q_, k_, v_, a_, b_, dt_, A_ = (x.float().numpy() for x in (q, k, v, a, b, dt_bias, A))
    qn, kn = (REGISTRY["l2_norm"].reference(None, x, eps=1e-6) for x in (q_, k_))
    g = REGISTRY["softplus"].reference(None, a_ + dt_) * A_
    beta = torch.from_numpy(REGISTRY["sigmoid"].reference(None, b_)).to(torch.bfloat16).float().numpy()  # as stored
    Wr, Ur = WY.reference(Ctx(specs, slots, {}), kn, v_, g, beta, chunk=16)
    assert rel_err(W.numpy(), Wr) < 1e-5 and rel_err(U.numpy(), Ur) < 1e-5
    want = RULE.reference(Ctx(specs, slots, {"recurrent": ref}), qn, kn, v_, g, beta)
    _check_rule(out.float().numpy(), want, store, ref, specs, slots)
