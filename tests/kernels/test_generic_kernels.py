"""The generic (unfused) elementwise and normalisation kernels under the interpreter, against their
ops' numpy references: every activation (also through act(x, fn) with HF spellings), affine,
softcap, layer_norm with and without bias, rms_norm on [T, heads, D] / [B, H] / row-strided
views, copy of a strided view, and add / mul / last / embedding on the shapes the ops allow.

Shapes are not multiples of the blocks; bf16 outputs are checked to one bf16 rounding of the
reference, f32 outputs to float32 precision. Inputs are random and never zero.
"""
import math

import numpy as np
import pytest
import torch

from infc.compiler.codegen.render import TEMPLATES, _env, render_template
from infc.compiler.ops import REGISTRY
from infc.compiler.ops.activation import ACTIVATIONS, HF_NAMES, erf

from .harness import TORCH, bf16, poison, rand, rel_err, render, run

EPS = 1e-5


def check(out, want, dtype, roundings=1):
    """bf16: within `roundings` bf16 roundings of the fp32 reference (rms_norm rounds twice, as
    HF does); f32: float32 precision."""
    got = out.float().numpy()
    assert rel_err(got, want) < (1e-2 if dtype == "bf16" else 1e-5)
    scale = np.abs(want).max() + 1e-30
    tol = roundings * 2 ** -8 if dtype == "bf16" else 1e-6
    assert np.abs(got - want).max() <= tol * scale, np.abs(got - want).max() / scale


def sym(shape, lead="T"):
    return [lead] + list(shape[1:])


def render_ctx(template, op, inputs, outputs, attrs=None, tune=None):
    """harness.render, but a tensor spec may end with a dict of extra keys (row_stride)."""
    def t(spec):
        extra = spec[-1] if isinstance(spec[-1], dict) else {}
        name, shape, dtype = spec[:3]
        return {"name": name, "shape": list(shape), "dtype": dtype, "kind": "buffer", **extra}
    ctx = {"op": op, "phase": "prefill", "inputs": [t(s) for s in inputs], "outputs": [t(s) for s in outputs],
           "attrs": attrs or {}, "config": {}, "kv": {}, "caches": {}, "page_size": 16, "tune": tune or {}}
    return render_template("triton", template, ctx)


def strided_view(rows, width, col0, inner, gen, dtype="bf16"):
    """A [rows, width] buffer and the flat tensor starting at column col0 (what the kernel's
    pointer sees), plus the view's values [rows, inner] as numpy float32."""
    wide = rand((rows, width), dtype, scale=2.0, gen=gen)
    return wide, wide.view(-1)[col0:], wide[:, col0:col0 + inner].float().numpy()


# -- the op homes name templates that exist ---------------------------------------------------

GENERIC = ["silu", "gelu", "gelu_tanh", "relu", "relu2", "act", "affine", "softcap", "layer_norm",
           "rms_norm", "copy", "add", "mul", "last", "embedding"]


@pytest.mark.parametrize("name", GENERIC)
def test_template_exists(name):
    t = REGISTRY[name].template("triton", "decode")
    assert (TEMPLATES / "triton" / f"{t}.py.j2").is_file(), t


def test_strided_ops_declare_it():
    assert REGISTRY["copy"].strided and REGISTRY["rms_norm"].strided and REGISTRY["layer_norm"].strided
    assert REGISTRY["copy"].internal and REGISTRY["affine"].internal and not REGISTRY["softcap"].internal


# -- activations ------------------------------------------------------------------------------

def test_erf_reference_matches_math_erf():
    x = np.concatenate([np.linspace(-9, 9, 20001), [0.0, -0.0, 1e-300, 2.4999999, 2.5, -2.5, 30.0]])
    want = np.array([math.erf(v) for v in x])
    assert np.abs(erf(x) - want).max() < 2e-15


def test_jinja_and_python_activation_tables_agree():
    mod = _env().get_template("triton/_activation.j2").module
    assert mod.HF == HF_NAMES
    assert set(HF_NAMES.values()) == set(ACTIVATIONS)


ACT_SHAPES = [((1, 1), "T", "bf16", None), ((5, 97), "T", "bf16", None), ((3, 1000), "T", "f32", 512),
              ((2, 3, 50), "T", "bf16", 64), ((4, 333), "B", "bf16", None)]


@pytest.mark.parametrize("fn", sorted(ACTIVATIONS))
@pytest.mark.parametrize("shape,lead,out_dtype,block", ACT_SHAPES)
def test_activation(fn, shape, lead, out_dtype, block):
    gen = np.random.default_rng(sum(shape) + len(fn))
    x = rand(shape, scale=3.0, gen=gen)
    s = sym(shape, lead)
    k = render("act", fn, [("x", s, "bf16")], [("y", s, out_dtype)], tune={"BLOCK": block} if block else None)
    assert k.meta["entry"] == fn
    out = poison(shape, out_dtype)
    run(k, {"in:0": x, "out:0": out}, {"T": shape[0], "B": shape[0]})
    check(out, REGISTRY[fn].reference(None, x.float().numpy()), out_dtype)


@pytest.mark.parametrize("fn,shape,width,block", [("sigmoid", (5, 97), 301, None), ("gelu_tanh", (3, 1000), 1020, 512),
                                               ("silu", (7, 2, 48), 200, 64)])
def test_activation_of_a_column_slice(fn, shape, width, block):
    """x a column slice of wider rows (a split part of a fused projection, row_stride = width): the
    kernel reads it in place (no copy before it); the columns around it (NaN) are never read."""
    gen = np.random.default_rng(width)
    row = int(np.prod(shape[1:]))
    wide = poison((shape[0], width), "bf16")
    wide[:, 11:11 + row] = rand((shape[0], row), scale=3.0, gen=gen)
    s = sym(shape, "T")
    k = render("act", fn, [("x", s, "bf16", "buffer", {"row_stride": width})], [("y", s, "bf16")],
               tune={"BLOCK": block} if block else None)
    out = poison(shape, "bf16")
    run(k, {"in:0": wide[:, 11:], "out:0": out}, {"T": shape[0]})
    want = REGISTRY[fn].reference(None, wide[:, 11:11 + row].float().numpy().reshape(shape))
    check(out, want, "bf16")


@pytest.mark.parametrize("hf", sorted(HF_NAMES))
def test_act_hf_spellings(hf):
    gen = np.random.default_rng(len(hf))
    x = rand((3, 77), scale=3.0, gen=gen)
    k = render("act", "act", [("x", ["T", 77], "bf16")], [("y", ["T", 77], "f32")], {"fn": hf})
    # act(x, fn) renders the same source as the op it names: one kernel for both
    assert k.source == render("act", HF_NAMES[hf], [("x", ["T", 77], "bf16")], [("y", ["T", 77], "f32")]).source
    out = poison((3, 77), "f32")
    run(k, {"in:0": x, "out:0": out}, {"T": 3, "B": 1})
    check(out, REGISTRY["act"].reference(None, x.float().numpy(), fn=hf), "f32")


def test_act_unknown_name_fails_to_render():
    with pytest.raises(Exception, match="unknown activation"):
        render("act", "act", [("x", ["T", 8], "bf16")], [("y", ["T", 8], "bf16")], {"fn": "swishy"})


def test_tanh_helper_is_float32_accurate():
    """softcap with cap 1 is tanh: both branches of _tanh (series below 1/8, exp above), tiny
    values (relative error), saturation, no overflow at large |x|."""
    x = np.concatenate([np.linspace(-30, 30, 2001), np.geomspace(1e-8, 0.3, 500), -np.geomspace(1e-8, 0.3, 500),
                        [0.124999, 0.125, 0.125001, 89.0, -89.0, 1e30]]).astype(np.float32)
    n = x.size
    k = render("softcap", "softcap", [("x", ["T"], "f32")], [("y", ["T"], "f32")], {"cap": 1.0})
    out = poison((n,), "f32")
    run(k, {"in:0": torch.from_numpy(x), "out:0": out}, {"T": n, "B": 1})
    want = np.tanh(x.astype(np.float64))
    got = out.numpy().astype(np.float64)
    assert np.all(np.abs(got - want) <= 4e-7 * np.abs(want) + 1e-9)


# -- scalar ops ---------------------------------------------------------------------------------

@pytest.mark.parametrize("mul,add", [(0.5, 0.0), (1.0, -3.25), (0.08838834764831845, 1.0), (-7, 2)])
@pytest.mark.parametrize("shape,lead,in_dtype,out_dtype", [((5, 97), "T", "bf16", "bf16"), ((3, 1000), "B", "f32", "f32"),
                                                           ((2, 3, 50), "T", "bf16", "bf16")])
def test_affine(mul, add, shape, lead, in_dtype, out_dtype):
    gen = np.random.default_rng(sum(shape))
    x = rand(shape, in_dtype, scale=3.0, gen=gen)
    s = sym(shape, lead)
    k = render("scalar", "affine", [("x", s, in_dtype)], [("y", s, out_dtype)], {"mul": mul, "add": add},
               tune={"BLOCK": 256})
    out = poison(shape, out_dtype)
    run(k, {"in:0": x, "out:0": out}, {"T": shape[0], "B": shape[0]})
    want = REGISTRY["affine"].reference(None, x.float().numpy(), mul=mul, add=add)
    assert want.dtype == np.float32
    exact = bf16(want) if out_dtype == "bf16" else want
    assert np.array_equal(out.float().numpy(), exact)       # fp32 math, one rounding


@pytest.mark.parametrize("shape,lead,dtype,cap,scale", [((3, 1000), "B", "f32", 30.0, 50.0),
                                                        ((7, 97), "T", "bf16", 50.0, 20.0),
                                                        ((2, 4, 33), "T", "bf16", 5.0, 8.0)])
def test_softcap(shape, lead, dtype, cap, scale):
    gen = np.random.default_rng(sum(shape))
    x = rand(shape, dtype, scale=scale, gen=gen)
    s = sym(shape, lead)
    k = render("softcap", "softcap", [("x", s, dtype)], [("y", s, dtype)], {"cap": cap}, tune={"BLOCK": 512})
    out = poison(shape, dtype)
    run(k, {"in:0": x, "out:0": out}, {"T": shape[0], "B": shape[0]})
    want = REGISTRY["softcap"].reference(None, x.float().numpy(), cap=cap)
    check(out, want, dtype)
    assert np.abs(out.float().numpy()).max() <= cap


# -- layer_norm -----------------------------------------------------------------------------------

def ln_weights(n, gen, dtype="bf16"):
    w = torch.from_numpy(1 + 0.3 * gen.standard_normal(n).astype(np.float32)).to(TORCH[dtype])
    b = torch.from_numpy(0.5 * gen.standard_normal(n).astype(np.float32)).to(TORCH[dtype])
    return w, b


def test_layer_norm_reference_matches_torch():
    gen = np.random.default_rng(1)
    x = (gen.standard_normal((6, 97)) * 3 + 5).astype(np.float32)
    w, b = (gen.standard_normal(97).astype(np.float32) for _ in range(2))
    want = torch.nn.functional.layer_norm(torch.from_numpy(x), (97,), torch.from_numpy(w), torch.from_numpy(b), EPS)
    got = REGISTRY["layer_norm"].reference(None, x, w, b, eps=EPS, has_bias=True)
    assert np.allclose(got, want.numpy(), rtol=1e-5, atol=1e-5)
    nob = REGISTRY["layer_norm"].reference(None, x, w, eps=EPS)
    assert np.allclose(nob, want.numpy() - b, rtol=1e-5, atol=1e-5)


LN_SHAPES = [((1, 1), "T", None), ((7, 97), "T", None), ((3, 4, 64), "T", None), ((5, 3000), "T", 1024),
             ((2, 9000), "T", None), ((4, 1000), "B", 256)]


@pytest.mark.parametrize("has_bias", [False, True])
@pytest.mark.parametrize("shape,lead,block", LN_SHAPES)
def test_layer_norm(has_bias, shape, lead, block):
    gen = np.random.default_rng(sum(shape) + has_bias)
    n = shape[-1]
    x = torch.from_numpy((gen.standard_normal(shape) * 2 + 3).astype(np.float32)).to(torch.bfloat16)  # mean 3
    w, b = ln_weights(n, gen)
    s = sym(shape, lead)
    ins = [("x", s, "bf16"), ("w", [n], "bf16")] + ([("b", [n], "bf16")] if has_bias else [])
    attrs = {"eps": EPS, **({"has_bias": True} if has_bias else {})}
    k = render("layer_norm", "layer_norm", ins, [("y", s, "bf16")], attrs, tune={"BLOCK": block} if block else None)
    assert (k.meta["constexprs"]["CHUNKS"] > 1) == (block is not None and n > block or n > 8192)
    out = poison(shape)
    binds = {"in:0": x, "in:1": w, "out:0": out, **({"in:2": b} if has_bias else {})}
    run(k, binds, {"T": shape[0], "B": shape[0]})
    args = [x.float().numpy(), w.float().numpy()] + ([b.float().numpy()] if has_bias else [])
    want = REGISTRY["layer_norm"].reference(None, *args, **attrs)
    if n == 1:                              # var 0: out = b exactly (or 0)
        assert np.array_equal(out.float().numpy(), bf16(want))
        return
    check(out, want, "bf16")


def test_layer_norm_f32():
    gen = np.random.default_rng(3)
    x = rand((5, 2000), "f32", scale=4.0, gen=gen)
    w, b = ln_weights(2000, gen, "f32")
    k = render("layer_norm", "layer_norm", [("x", ["T", 2000], "f32"), ("w", [2000], "f32"), ("b", [2000], "f32")],
               [("y", ["T", 2000], "f32")], {"eps": EPS, "has_bias": True}, tune={"BLOCK": 512})
    out = poison((5, 2000), "f32")
    run(k, {"in:0": x, "in:1": w, "in:2": b, "out:0": out}, {"T": 5, "B": 1})
    want = REGISTRY["layer_norm"].reference(None, x.numpy(), w.numpy(), b.numpy(), eps=EPS, has_bias=True)
    check(out, want, "f32")


# -- norms on strided views -------------------------------------------------------------------------

@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
@pytest.mark.parametrize("T,width,col0,heads,D,block", [(5, 1000, 96, 4, 97, None), (3, 700, 128, 1, 500, 128),
                                                        (6, 256, 64, 3, 64, None)])
def test_norm_strided(op, T, width, col0, heads, D, block):
    """The norm reads x = a column slice [col0, col0 + heads*D) of a [T, width] buffer (a split
    of a fused projection) viewed as [T, heads, D]: row_stride = width."""
    gen = np.random.default_rng(T + width)
    wide, flat, xv = strided_view(T, width, col0, heads * D, gen)
    w, b = ln_weights(D, gen)
    shape = [T, heads, D] if heads > 1 else [T, D]
    s = sym(shape)
    attrs = {"eps": EPS}
    k = render_ctx(op, op, [("x", s, "bf16", {"row_stride": width}), ("w", [D], "bf16")], [("y", s, "bf16")],
                   attrs, tune={"BLOCK": block} if block else None)
    before = wide.clone()
    out = poison(shape)
    run(k, {"in:0": flat, "in:1": w, "out:0": out}, {"T": T, "B": 1})
    assert torch.equal(wide, before)
    want = REGISTRY[op].reference(None, xv.reshape(shape), w.float().numpy(), **attrs)
    check(out, want, "bf16", roundings=2 if op == "rms_norm" else 1)


@pytest.mark.parametrize("shape,lead", [((7, 8, 128), "T"), ((1, 2, 64), "T"), ((3, 1000), "B"), ((5, 3, 97), "T"),
                                        ((2, 9000), "B"), ((1, 1), "T")])
def test_rms_norm_shapes(shape, lead):
    gen = np.random.default_rng(sum(shape))
    n = shape[-1]
    x = rand(shape, scale=2.0, gen=gen)
    w = torch.from_numpy(1 + 0.2 * gen.standard_normal(n).astype(np.float32)).to(torch.bfloat16)
    s = sym(shape, lead)
    k = render("rms_norm", "rms_norm", [("x", s, "bf16"), ("w", [n], "bf16", "weight")], [("y", s, "bf16")],
               {"eps": EPS})
    out = poison(shape)
    run(k, {"in:0": x, "in:1": w, "out:0": out}, {"T": shape[0], "B": shape[0]})
    check(out, REGISTRY["rms_norm"].reference(None, x.float().numpy(), w.float().numpy(), eps=EPS), "bf16", 2)


# -- copy -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["bf16", "f32"])
@pytest.mark.parametrize("T,width,col0,inner,block", [(5, 1000, 300, 97, None), (3, 3000, 8, 2900, 1024),
                                                      (1, 64, 0, 64, None), (4, 512, 256, (2, 128), 64)])
def test_copy_strided(dtype, T, width, col0, inner, block):
    gen = np.random.default_rng(T + width)
    tail = list(inner) if isinstance(inner, tuple) else [inner]
    n = int(np.prod(tail))
    wide, flat, xv = strided_view(T, width, col0, n, gen, dtype)
    s = ["T"] + tail
    k = render_ctx("copy", "copy", [("x", s, dtype, {"row_stride": width})], [("y", s, dtype)],
                   tune={"BLOCK": block} if block else None)
    out = poison([T] + tail, dtype)
    run(k, {"in:0": flat, "out:0": out}, {"T": T, "B": 1})
    want = REGISTRY["copy"].reference(None, xv.reshape([T] + tail))
    assert np.array_equal(out.float().numpy(), want)


def test_copy_contiguous_default():
    """Without row_stride the input is contiguous: a plain copy."""
    gen = np.random.default_rng(9)
    x = rand((4, 3, 50), gen=gen)
    k = render("copy", "copy", [("x", ["B", 3, 50], "bf16")], [("y", ["B", 3, 50], "bf16")])
    assert k.meta["grid"][0] == "B" and k.meta["constexprs"]["STRIDE"] == 150
    out = poison((4, 3, 50))
    run(k, {"in:0": x, "out:0": out}, {"T": 9, "B": 4})
    assert torch.equal(out, x)


# -- add / mul / last / embedding on the shapes their rules allow -----------------------------------

@pytest.mark.parametrize("name", ["add", "mul"])
@pytest.mark.parametrize("shape,lead,dtype", [((4, 1000), "B", "f32"), ((3, 5, 97), "T", "bf16"), ((2, 3000), "T", "f32")])
def test_add_mul_shapes(name, shape, lead, dtype):
    gen = np.random.default_rng(sum(shape))
    a, b = rand(shape, dtype, gen=gen), rand(shape, dtype, gen=gen)
    s = sym(shape, lead)
    k = render(name, name, [("a", s, dtype), ("b", s, dtype)], [("c", s, dtype)])
    out = poison(shape, dtype)
    run(k, {"in:0": a, "in:1": b, "out:0": out}, {"T": shape[0], "B": shape[0]})
    want = REGISTRY[name].reference(None, a.float().numpy(), b.float().numpy())
    assert np.array_equal(out.float().numpy(), bf16(want) if dtype == "bf16" else want)


@pytest.mark.parametrize("tail,dtype", [((4, 97), "f32"), ((1000,), "bf16")])
def test_last_shapes(tail, dtype):
    gen = np.random.default_rng(len(tail))
    T, rows = 9, [3, 4, 8]
    x = rand((T,) + tail, dtype, gen=gen)
    k = render("gather_last", "last", [("x", ["T", *tail], dtype)], [("y", ["B", *tail], dtype)], tune={"BLOCK": 256})
    out = poison((len(rows),) + tail, dtype)
    run(k, {"in:0": x, "meta:last_rows": torch.tensor(rows, dtype=torch.int32), "out:0": out}, {"T": T, "B": 3})
    assert torch.equal(out, x[rows])


@pytest.mark.parametrize("dtype,H", [("f32", 97), ("bf16", 3000)])
def test_embedding_shapes(dtype, H):
    gen = np.random.default_rng(H)
    table = rand((50, H), dtype, gen=gen)
    ids = torch.from_numpy(gen.integers(0, 50, 7).astype(np.int32))
    k = render("embedding", "embedding", [("tokens", ["T"], "i32"), ("embed", [50, H], dtype, "weight")],
               [("x", ["T", H], dtype)])
    out = poison((7, H), dtype)
    run(k, {"in:0": ids, "in:1": table, "out:0": out}, {"T": 7, "B": 1})
    assert torch.equal(out, table[ids.long()])
