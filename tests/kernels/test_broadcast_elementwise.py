"""The spec-language additions Qwen3.5 needed, on their own (issue 12): add / mul with a second
operand broadcast over the first's leading dims (and f32 promotion), or over its trailing ones
where the second has size-1 axes there (issue 45: [T, 1] against [T, H]), the sigmoid / softplus
activations' references at the edges, and the shape rules of split and the broadcast.

The add / mul kernels run under the interpreter against the ops' numpy references; the
activations' kernels are covered with every other activation in test_generic_kernels.py.
"""
import numpy as np
import pytest
import torch

from infc.compiler.ir import TensorType
from infc.compiler.ops import REGISTRY, ShapeError
from infc.compiler.ops.activation import softplus

from .harness import poison, rand, render, run


@pytest.mark.parametrize("name", ["add", "mul"])
@pytest.mark.parametrize("a_shape,b_shape,a_dtype,b_dtype,out_dtype", [
    (("T", 37), (37,), "bf16", "bf16", "bf16"),          # a per-head vector over [T, H]
    (("T", 5, 24), (5, 24), "bf16", "f32", "f32"),        # promoted: f32 weight, f32 result
    (("T", 5, 24), (24,), "f32", "bf16", "f32"),
    (("T", 37), ("T", 1), "bf16", "bf16", "bf16"),       # a per-token scalar (a shared expert's gate)
    (("T", 5, 24), ("T", 1, 1), "bf16", "bf16", "bf16"),
    (("T", 5, 24), ("T", 5, 1), "bf16", "f32", "f32"),    # one a head
])
def test_broadcast_add_mul(name, a_shape, b_shape, a_dtype, b_dtype, out_dtype):
    T = 13
    gen = np.random.default_rng(len(a_shape) + len(b_shape))
    a = rand((T,) + a_shape[1:], a_dtype, gen=gen)
    b = rand(tuple(T if d == "T" else d for d in b_shape), b_dtype, gen=gen)
    op = REGISTRY[name]
    (t,) = op.infer([TensorType(a_shape, a_dtype), TensorType(b_shape, b_dtype)], {})
    assert t == TensorType(a_shape, out_dtype)
    k = render(name, name, [("a", a_shape, a_dtype), ("b", b_shape, b_dtype)], [("c", a_shape, out_dtype)],
               tune={"BLOCK": 64})
    out = poison((T,) + a_shape[1:], out_dtype)
    run(k, {"in:0": a, "in:1": b, "out:0": out}, {"T": T, "B": T})
    want = op.reference(None, a.float().numpy(), b.float().numpy())
    got = out.float().numpy()
    if out_dtype == "bf16":
        want = torch.from_numpy(want.astype(np.float32)).to(torch.bfloat16).float().numpy()
        assert np.array_equal(got, want)
    else:
        assert np.abs(got - want).max() <= 1e-6 * np.abs(want).max()


def test_same_shape_render_is_unchanged():
    """Without broadcasting the kernel source has no trace of it (committed plans unchanged)."""
    k = render("add", "add", [("a", ["T", 8], "bf16"), ("b", ["T", 8], "bf16")], [("c", ["T", 8], "bf16")])
    assert "%" not in k.source.split("META")[0] and "broadcast" not in k.source


@pytest.mark.parametrize("b_shape", [(5,), ("T", 24), (2, 5, 24), (5, 23), ("T", 1, 24), (1, 5, 24), (1, 1, 1)])
def test_broadcast_rule_refuses_other_shapes(b_shape):
    with pytest.raises(ShapeError, match="operands differ in shape"):
        REGISTRY["mul"].infer([TensorType(("T", 5, 24), "bf16"), TensorType(b_shape, "bf16")], {})


def test_softplus_and_sigmoid_references():
    x = np.array([-100.0, -30.0, -1.0, 0.0, 1.0, 19.9, 20.0, 20.5, 80.0], np.float32)
    want = torch.nn.functional.softplus(torch.from_numpy(x)).numpy()
    assert np.allclose(softplus(x), want, rtol=1e-6, atol=0) and softplus(x).dtype == np.float32
    sig = REGISTRY["sigmoid"].reference(None, x)
    assert np.allclose(sig, torch.sigmoid(torch.from_numpy(x)).numpy(), rtol=1e-6, atol=1e-30)


def test_split_rule():
    split = REGISTRY["split"]
    assert not split.internal                       # specs may write it
    parts = split.infer([TensorType(("T", 10), "bf16")], {"sizes": [4, 4, 2]})
    assert [p.shape for p in parts] == [("T", 4), ("T", 4), ("T", 2)]
    with pytest.raises(ShapeError, match="2-D"):
        split.infer([TensorType(("T", 2, 10), "bf16")], {"sizes": [4, 6]})
    with pytest.raises(ShapeError, match="do not sum"):
        split.infer([TensorType(("T", 10), "bf16")], {"sizes": [4, 4]})


@pytest.mark.parametrize("bounds", [dict(min=-0.7, max=0.5), dict(min=-1.25), dict(max=0.3)])
def test_clamp_kernel_and_reference(bounds):
    """clamp(x, min, max) (issue 45's vocabulary): the reference is torch.clamp, the kernel (act.py.j2)
    matches it under the interpreter on bf16 rows of an odd width, either bound alone included."""
    T, shape = 11, ("T", 37)
    x = rand((T, 37), "bf16", gen=np.random.default_rng(4))
    op = REGISTRY["clamp"]
    attrs = {"min": None, "max": None, **bounds}
    want = op.reference(None, x.float().numpy(), **attrs)
    lo, hi = attrs["min"], attrs["max"]
    assert np.array_equal(want, torch.clamp(x.float(), lo, hi).numpy())
    assert (want != x.float().numpy()).any()                  # the bounds bite
    k = render("act", "clamp", [("x", shape, "bf16")], [("y", shape, "bf16")], attrs, tune={"BLOCK": 64})
    out = poison((T, 37), "bf16")
    run(k, {"in:0": x, "out:0": out}, {"T": T, "B": T})
    assert np.array_equal(out.float().numpy(), torch.from_numpy(want).to(torch.bfloat16).float().numpy())


@pytest.mark.parametrize("attrs,match", [({"min": None, "max": None}, "needs"), ({"min": 1.0, "max": 0.0}, "above"),
                                         ({"min": "a", "max": None}, "number")])
def test_clamp_rule(attrs, match):
    with pytest.raises(ShapeError, match=match):
        REGISTRY["clamp"].infer([TensorType(("T", 4), "bf16")], attrs)
