"""GEMV/GEMM-family templates under the interpreter, against their ops' numpy references.

Every case uses random (never zero) inputs, NaN-poisoned outputs and shapes that the blocks do
not cover (small tune overrides), and exercises each kernel path: the CUDA-core rows path and
the tensor-core path of the GEMVs, split-K with its counters left zero, masked edges of the GEMM.
"""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from infc.compiler.codegen.render import TemplateError
from infc.compiler.ops import REGISTRY

from .harness import poison, rand, rel_err, render, run

TOL = 1e-2


def f32(t):
    return t.float().numpy()


def check_scratch_zero(scratch):
    """The split-K arrival counters are left zero for the next launch (the partial-sum slots are
    overwritten by every split before they are read, so they may keep values)."""
    for name, s in scratch.items():
        if name == "counters":
            assert int(s.abs().sum()) == 0, f"scratch '{name}' not left zero"


# (T, N, K, tune, path): small blocks so that N and K are not multiples of them.
GEMV_CASES = [
    (1, 100, 72, {"BLOCK_N": 16, "BLOCK_K": 16, "FMA_BLOCK_K": 32, "SPLIT_K": 3}, "fma+split"),
    (3, 100, 72, {"BLOCK_N": 32, "BLOCK_K": 16, "FMA_BLOCK_K": 16, "BLOCK_T": 16, "FMA_T": 4}, "fma rows"),
    (5, 96, 136, {"BLOCK_N": 16, "BLOCK_N_DOT": 32, "BLOCK_K": 32, "FMA_BLOCK_K": 32, "BLOCK_T": 16,
                  "SPLIT_K_DOT": 4}, "dot+split"),
    (17, 100, 136, {"BLOCK_N": 32, "BLOCK_N_DOT": 16, "BLOCK_K": 32, "FMA_BLOCK_K": 16, "BLOCK_T": 16,
                    "SPLIT_K_DOT": 4}, "dot 2 row blocks+split"),
    (2, 130, 256, {}, "defaults"),
]


@pytest.mark.parametrize("T,N,K,tune,path", GEMV_CASES, ids=[c[-1] for c in GEMV_CASES])
def test_gemv(T, N, K, tune, path):
    gen = np.random.default_rng(T * 1000 + N)
    x, w = rand((T, K), gen=gen), rand((N, K), gen=gen, scale=K ** -0.5)
    k = render("gemv", "linear", [("x", ["T", K], "bf16"), ("w", [N, K], "bf16", "weight")],
               [("y", ["T", N], "bf16")], tune=tune)
    y = poison((T, N))
    scratch = run(k, {"in:0": x, "in:1": w, "out:0": y}, {"T": T, "B": 1})
    check_scratch_zero(scratch)
    assert (len(scratch) > 0) == ("split" in path)
    want = REGISTRY["linear"].reference(None, f32(x), f32(w))
    assert rel_err(f32(y), want) <= TOL


GEMM_CASES = [
    (1, 100, 72, {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32}),
    (17, 100, 72, {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2}),
    (70, 130, 200, {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 2}),
    (37, 130, 200, {}),
]


@pytest.mark.parametrize("T,N,K,tune", GEMM_CASES)
def test_gemm(T, N, K, tune):
    gen = np.random.default_rng(T * 1000 + N + 1)
    x, w = rand((T, K), gen=gen), rand((N, K), gen=gen, scale=K ** -0.5)
    k = render("gemm", "linear", [("x", ["T", K], "bf16"), ("w", [N, K], "bf16", "weight")],
               [("y", ["T", N], "bf16")], phase="prefill", tune=tune)
    y = poison((T, N))
    run(k, {"in:0": x, "in:1": w, "out:0": y}, {"T": T, "B": 1})
    want = REGISTRY["linear"].reference(None, f32(x), f32(w))
    assert rel_err(f32(y), want) <= TOL


def _silu_mul_case(template, phase, T, N, F, tune):
    gen = np.random.default_rng(T * 1000 + N + F)
    gu, w = rand((T, 2 * F), gen=gen, scale=2.0), rand((N, F), gen=gen, scale=F ** -0.5)
    k = render(template, "linear_silu_mul", [("gu", ["T", 2 * F], "bf16"), ("w", [N, F], "bf16", "weight")],
               [("y", ["T", N], "bf16")], phase=phase, tune=tune)
    y = poison((T, N))
    scratch = run(k, {"in:0": gu, "in:1": w, "out:0": y}, {"T": T, "B": 1})
    check_scratch_zero(scratch)
    want = REGISTRY["linear_silu_mul"].reference(None, f32(gu), f32(w))
    assert rel_err(f32(y), want) <= TOL


@pytest.mark.parametrize("T,N,F,tune", [
    (1, 100, 72, {"BLOCK_N": 16, "BLOCK_K": 16, "FMA_BLOCK_K": 32, "SPLIT_K": 2}),
    (3, 100, 72, {"BLOCK_N": 32, "BLOCK_K": 16, "FMA_BLOCK_K": 16, "BLOCK_T": 16, "FMA_T": 4}),
    (17, 100, 72, {"BLOCK_N": 32, "BLOCK_N_DOT": 32, "BLOCK_K": 32, "FMA_BLOCK_K": 32, "BLOCK_T": 16,
                   "SPLIT_K_DOT": 2}),
])
def test_gemv_silu_mul(T, N, F, tune):
    _silu_mul_case("gemv_silu_mul", "decode", T, N, F, tune)


@pytest.mark.parametrize("T,N,F,tune", [
    (1, 100, 72, {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32}),
    (17, 100, 72, {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2}),
    (40, 130, 200, {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64}),
])
def test_gemm_silu_mul(T, N, F, tune):
    _silu_mul_case("gemm_silu_mul", "prefill", T, N, F, tune)


# (T, B, V, H, residual, tune)
LM_HEAD_CASES = [
    (5, 1, 100, 72, True, {"BLOCK_N": 16, "BLOCK_K": 16, "FMA_BLOCK_K": 32}),
    (9, 3, 100, 72, False, {"BLOCK_N": 32, "BLOCK_K": 16, "FMA_BLOCK_K": 16, "BLOCK_T": 16, "FMA_T": 4}),
    (40, 17, 100, 72, True, {"BLOCK_N": 32, "BLOCK_N_DOT": 32, "BLOCK_K": 32, "FMA_BLOCK_K": 32, "BLOCK_T": 16}),
    (6, 2, 90, 136, True, {}),
]


@pytest.mark.parametrize("T,B,V,H,residual,tune", LM_HEAD_CASES)
def test_lm_head_last(T, B, V, H, residual, tune):
    gen = np.random.default_rng(T * 100 + B)
    x, d = rand((T, H), gen=gen), rand((T, H), gen=gen)
    norm, w = rand((H,), gen=gen, scale=0.3) + 1.0, rand((V, H), gen=gen, scale=H ** -0.5)
    last = np.sort(gen.choice(T, size=B, replace=False)).astype(np.int32)
    inputs = [("x", ["T", H], "bf16")] + ([("d", ["T", H], "bf16")] if residual else [])
    inputs += [("norm", [H], "bf16", "weight"), ("w", [V, H], "bf16", "weight")]
    attrs = {"eps": 1e-6, "residual": residual}
    k = render("lm_head_last", "lm_head_last", inputs, [("logits", ["B", V], "f32")], attrs=attrs, tune=tune)
    arrays = [x] + ([d] if residual else []) + [norm, w]
    out = poison((B, V), "f32")
    bindings = {f"in:{i}": a for i, a in enumerate(arrays)}
    bindings.update({"out:0": out, "meta:last_rows": torch.from_numpy(last)})
    scratch = run(k, bindings, {"T": T, "B": B})
    check_scratch_zero(scratch)
    ctx = SimpleNamespace(last_rows=last.astype(np.int64))
    want = REGISTRY["lm_head_last"].reference(ctx, *[f32(a) for a in arrays], **attrs)
    assert rel_err(out.numpy(), want) <= TOL


def test_lm_head_last_refuses_split_k():
    with pytest.raises(TemplateError, match="cannot_split"):
        render("lm_head_last", "lm_head_last", [("x", ["T", 64], "bf16"), ("norm", [64], "bf16", "weight"),
                                                ("w", [100, 64], "bf16", "weight")],
               [("logits", ["B", 100], "f32")], attrs={"eps": 1e-6, "residual": False}, tune={"SPLIT_K": 2})


# (T, KT, E, H, F, tune_gate_up, tune_down)
MOE_CASES = [
    (1, 3, 5, 72, 40, {"BLOCK_F": 16, "BLOCK_K": 32}, {"BLOCK_H": 16, "BLOCK_F": 16}),
    (3, 2, 4, 64, 24, {"BLOCK_F": 16, "BLOCK_K": 16}, {"BLOCK_H": 8, "BLOCK_F": 16}),
    (5, 8, 10, 72, 40, {"BLOCK_F": 32}, {}),
    (17, 2, 3, 40, 24, {"BLOCK_F": 32, "BLOCK_K": 32}, {"BLOCK_H": 32, "BLOCK_F": 16}),
]


def _moe_inputs(T, KT, E, H, F):
    gen = np.random.default_rng(T * 10 + KT)
    x = rand((T, H), gen=gen)
    ids = np.stack([gen.choice(E, size=KT, replace=False) for _ in range(T)]).astype(np.int32)
    rw = torch.from_numpy(gen.random((T, KT)).astype(np.float32) + 0.1)
    gu = rand((E, 2 * F, H), gen=gen, scale=H ** -0.5)
    down = rand((E, H, F), gen=gen, scale=F ** -0.5)
    return x, torch.from_numpy(ids), rw, gu, down


@pytest.mark.parametrize("T,KT,E,H,F,tune,_", MOE_CASES)
def test_moe_gate_up(T, KT, E, H, F, tune, _):
    x, ids, rw, gu, down = _moe_inputs(T, KT, E, H, F)
    k = render("moe_gate_up", "moe_gate_up", [("x", ["T", H], "bf16"), ("ids", ["T", KT], "i32"),
                                              ("gate_up", [E, 2 * F, H], "bf16", "weight")],
               [("act", ["T", KT, F], "bf16")], tune=tune)
    act = poison((T, KT, F))
    run(k, {"in:0": x, "in:1": ids, "in:2": gu, "out:0": act}, {"T": T, "B": 1})
    want = REGISTRY["moe_gate_up"].reference(None, f32(x), ids.numpy(), f32(gu))
    assert rel_err(f32(act), want) <= TOL


@pytest.mark.parametrize("T,KT,E,H,F,_,tune", MOE_CASES)
def test_moe_down(T, KT, E, H, F, _, tune):
    x, ids, rw, gu, down = _moe_inputs(T, KT, E, H, F)
    act = rand((T, KT, F), gen=np.random.default_rng(T), scale=0.5)
    k = render("moe_down", "moe_down", [("act", ["T", KT, F], "bf16"), ("weights", ["T", KT], "f32"),
                                        ("ids", ["T", KT], "i32"), ("down", [E, H, F], "bf16", "weight")],
               [("y", ["T", H], "bf16")], tune=tune)
    y = poison((T, H))
    run(k, {"in:0": act, "in:1": rw, "in:2": ids, "in:3": down, "out:0": y}, {"T": T, "B": 1})
    want = REGISTRY["moe_down"].reference(None, f32(act), rw.numpy(), ids.numpy(), f32(down))
    assert rel_err(f32(y), want) <= TOL
