"""Gated DeltaNet ops (compiler/ops/linear_attention.py): the numpy references against
transformers' Qwen3.5 functions, and the Triton kernels under the interpreter against the
references.

Slot caches are laid out as the runtime's: [num_slots + 1, *shape] per layer. Slots are assigned
in a shuffled order; a new sequence's slot (nothing cached) and every slot no sequence owns are
NaN, so a kernel that reads a slot it must not, or writes one it does not own, shows up.
Sequence lengths are ragged (1, 7, 40, 70: not multiples of the chunk), head dims are not powers
of two, and steps mix new sequences with continuing ones. A prompt run as two steps (the state
carried through the slot) must give what one step gives.
"""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from infc.compiler.ir import TensorType
from infc.compiler.ops import REGISTRY, ShapeError

from .harness import TORCH, bf16, poison, rand, rel_err, render, run

EPS = 1e-6
NSLOTS = 6                         # usable slots; index NSLOTS is the padding slot


def i32(x):
    return torch.tensor(np.asarray(x), dtype=torch.int32)


class Ctx:
    """The reference executor's ctx API: sequences as (cached, n new) in batch order, their slots,
    step metadata (seq_starts, context_lens, state_slots), and this layer's float32 caches."""

    def __init__(self, specs, slots, caches):
        self.seqs, rows = [], 0
        for b, (cached, n) in enumerate(specs):
            self.seqs.append((b, rows, n, cached))
            rows += n
        self.T, self.B, self.layer = rows, len(specs), 0
        self.meta = SimpleNamespace(seq_starts=np.cumsum([0] + [n for _, n in specs]),
                                    context_lens=np.asarray([c + n for c, n in specs]),
                                    state_slots=np.asarray(slots))
        self.caches = caches

    def cache(self, name):
        return self.caches[name]


def meta_bindings(specs, slots):
    return {"meta:seq_starts": i32(np.cumsum([0] + [n for _, n in specs])),
            "meta:context_lens": i32([c + n for c, n in specs]),
            "meta:state_slots": i32(slots)}


def poisoned_slots(shape, specs, slots, gen, dtype):
    """Slot storage [NSLOTS + 1, *shape]: random state in the slots of sequences with tokens
    cached, NaN everywhere else. Returns (torch storage in `dtype`, float32 numpy copy)."""
    store = torch.full((NSLOTS + 1, *shape), float("nan"), dtype=torch.float32)
    for (cached, _), s in zip(specs, slots):
        if cached > 0:
            store[s] = torch.from_numpy(gen.standard_normal(shape).astype(np.float32) * 0.5)
    store = store.to(dtype)
    return store, store.float().numpy().copy()


def owned(store, specs, slots):
    """The slots this step's sequences own (what a kernel may write), and the rest."""
    mine = sorted({s for s in slots})
    rest = [s for s in range(NSLOTS + 1) if s not in mine]
    return store[mine], store[rest]


# ---------------------------------------------------------------------------------------------
# references against transformers (float32)

def _hf():
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m
    return m


def test_l2_norm_and_gated_rms_norm_references_match_transformers():
    m = _hf()
    gen = np.random.default_rng(0)
    x = gen.standard_normal((9, 3, 20)).astype(np.float32) * 2
    want = m.l2norm(torch.from_numpy(x), dim=-1, eps=1e-6).numpy()
    got = REGISTRY["l2_norm"].reference(None, x, eps=1e-6)
    assert np.abs(got - want).max() < 1e-5

    z = gen.standard_normal(x.shape).astype(np.float32)
    norm = m.Qwen3_5RMSNormGated(20, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.from_numpy(1 + 0.3 * gen.standard_normal(20).astype(np.float32)))
        want = norm(torch.from_numpy(x), torch.from_numpy(z)).numpy()
    got = REGISTRY["gated_rms_norm"].reference(None, x, z, norm.weight.detach().numpy(), eps=1e-6)
    assert np.abs(got - want).max() < 1e-5 * max(1.0, np.abs(want).max())


@pytest.mark.parametrize("has_bias,activation", [(False, "silu"), (True, "silu"), (True, None)])
def test_causal_conv1d_reference_matches_transformers(has_bias, activation):
    m = _hf()
    gen = np.random.default_rng(1)
    C, K = 12, 4
    w = gen.standard_normal((C, K)).astype(np.float32)
    bias = gen.standard_normal(C).astype(np.float32) if has_bias else None
    specs, slots = [(0, 7), (0, 2), (5, 3), (9, 1)], [4, 0, 2, 5]
    T = sum(n for _, n in specs)
    x = gen.standard_normal((T, C)).astype(np.float32)
    state = np.full((NSLOTS + 1, K - 1, C), np.nan, np.float32)
    for (cached, _), s in zip(specs, slots):
        if cached:
            state[s] = gen.standard_normal((K - 1, C))
    old = state.copy()
    ctx = Ctx(specs, slots, {"conv": state})
    args = (bias,) if has_bias else ()
    got = REGISTRY["causal_conv1d"].reference(ctx, x, w, *args, activation=activation, has_bias=has_bias)
    tb = None if bias is None else torch.from_numpy(bias)
    for b, start, n, cached in ctx.seqs:
        xs = torch.from_numpy(x[start:start + n].T[None].copy())            # HF: [batch, C, seq]
        if cached == 0:
            want = m.causal_conv1d_fn(xs, torch.from_numpy(w), tb, activation=activation)
            # HF's cache keeps the last K inputs, left-padded with zeros
            conv_state = torch.nn.functional.pad(xs, (max(K - n, 0), 0))[..., -K:]
        else:
            # HF's decode-time update: its state holds K columns; the oldest is not used by the conv
            conv_state = torch.cat([torch.zeros(1, C, 1), torch.from_numpy(old[slots[b]].T[None].copy())], -1)
            want = m.causal_conv1d_update(xs, conv_state, torch.from_numpy(w), tb, activation)
        assert np.abs(got[start:start + n] - want[0].T.numpy()).max() < 1e-5
        assert np.abs(state[slots[b]] - conv_state[0, :, 1:].T.numpy()).max() == 0


def _delta_inputs(gen, T, hk, hv, dk, dv):
    q = gen.standard_normal((T, hk, dk)).astype(np.float32)
    k = gen.standard_normal((T, hk, dk)).astype(np.float32)
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = gen.standard_normal((T, hv, dv)).astype(np.float32)
    # HF: g = -exp(A_log) * softplus(a + dt_bias) (<= 0), beta = sigmoid(b)
    g = (-np.exp(gen.uniform(-2, 0.5, hv)) * np.log1p(np.exp(gen.standard_normal((T, hv))))).astype(np.float32)
    beta = (1 / (1 + np.exp(-gen.standard_normal((T, hv))))).astype(np.float32)
    return q, k, v, g, beta


def test_gated_delta_rule_reference_matches_transformers():
    m = _hf()
    gen = np.random.default_rng(2)
    hk, hv, dk, dv = 2, 4, 24, 20
    specs, slots = [(0, 70), (0, 7), (13, 40), (3, 1)], [3, 0, 5, 1]
    T = sum(n for _, n in specs)
    q, k, v, g, beta = _delta_inputs(gen, T, hk, hv, dk, dv)
    store = np.full((NSLOTS + 1, hv, dk, dv), np.nan, np.float32)
    for (cached, _), s in zip(specs, slots):
        if cached:
            store[s] = gen.standard_normal((hv, dk, dv)) * 0.3
    old = store.copy()
    ctx = Ctx(specs, slots, {"recurrent": store})
    got = REGISTRY["gated_delta_rule"].reference(ctx, q, k, v, g, beta)
    t = lambda a: torch.from_numpy(np.ascontiguousarray(a))[None]  # noqa: E731
    for b, start, n, cached in ctx.seqs:
        sl = slice(start, start + n)
        init = t(old[slots[b]]) if cached else None
        for fn, kw in ((m.torch_recurrent_gated_delta_rule, {}), (m.torch_chunk_gated_delta_rule, {"chunk_size": 16})):
            o, s = fn(t(q[sl]), t(k[sl]), t(v[sl]), g=t(g[sl]), beta=t(beta[sl]), initial_state=init,
                      output_final_state=True, use_qk_l2norm_in_kernel=False, **kw)
            assert np.abs(got[sl] - o[0].numpy()).max() < 1e-5, fn.__name__
            assert np.abs(store[slots[b]] - s[0].numpy()).max() < 1e-5, fn.__name__


def test_op_shapes_and_caches():
    x = TensorType(("T", 64), "bf16")
    w = TensorType((64, 4), "bf16")
    conv = REGISTRY["causal_conv1d"]
    assert conv.infer([x, w], {"activation": "silu"}) == [x]
    assert conv.caches([x, w], {}) == {"conv": {"kind": "slot", "shape": [3, 64], "dtype": "bf16"}}
    with pytest.raises(ShapeError, match="activation"):
        conv.infer([x, w], {"activation": "gelu"})
    with pytest.raises(ShapeError, match=r"\[C, K\]"):
        conv.infer([x, TensorType((32, 4), "bf16")], {"activation": "silu"})
    q = TensorType(("T", 2, 24), "bf16")
    v = TensorType(("T", 4, 20), "bf16")
    gb = TensorType(("T", 4), "f32")
    rule = REGISTRY["gated_delta_rule"]
    assert rule.infer([q, q, v, gb, gb], {}) == [v]
    assert rule.caches([q, q, v, gb, gb], {}) == {"recurrent": {"kind": "slot", "shape": [4, 24, 20], "dtype": "f32"}}
    with pytest.raises(ShapeError, match="multiple"):
        rule.infer([q, q, TensorType(("T", 3, 20), "bf16"), TensorType(("T", 3), "f32"),
                    TensorType(("T", 3), "f32")], {})
    with pytest.raises(ShapeError, match="beta"):
        rule.infer([q, q, v, gb, TensorType(("T", 2), "f32")], {})
    with pytest.raises(ShapeError, match="gate"):
        REGISTRY["gated_rms_norm"].infer([v, TensorType(("T", 4, 21), "bf16"), TensorType((20,), "bf16")], {})


# ---------------------------------------------------------------------------------------------
# l2_norm, gated_rms_norm kernels

@pytest.mark.parametrize("shape,stride,rows", [((7, 3, 20), None, None), ((5, 2, 32), 2 * 32 + 24, 4),
                                               ((9, 128), None, 1), ((1, 4, 24), None, None)])
def test_l2_norm_kernel(shape, stride, rows):
    gen = np.random.default_rng(sum(shape))
    extra = {"row_stride": stride} if stride else {}
    sym = ["T"] + list(shape[1:])
    k = render("l2_norm", "l2_norm", [("x", sym, "bf16", "buffer", extra)], [("y", sym, "bf16")], {"eps": EPS},
               tune={"ROWS": rows} if rows else None)
    T = shape[0]
    width = stride or int(np.prod(shape[1:]))
    wide = rand((T, width), scale=2.0, gen=gen)
    x = wide[:, : int(np.prod(shape[1:]))].reshape(shape)
    out_full = poison((T + 1, *shape[1:]))
    run(k, {"in:0": wide, "out:0": out_full}, {"T": T, "B": 1})
    assert torch.isnan(out_full[T:].float()).all(), "wrote rows past T"
    want = REGISTRY["l2_norm"].reference(None, x.float().numpy(), eps=EPS)
    got = out_full[:T].float().numpy()
    assert np.array_equal(got, bf16(want)) or np.abs(got - want).max() <= 2 ** -8 * np.abs(want).max()
    assert rel_err(got, want) < 4e-3


@pytest.mark.parametrize("shape,stride", [((7, 3, 20), None), ((5, 2, 32), 2 * 32 + 24)])
def test_l2_norm_kernel_f32_output(shape, stride):
    """l2_norm(x, dtype=f32): bf16 x in, the fp32 result stored unrounded (HF's q/k l2norm)."""
    gen = np.random.default_rng(sum(shape) + 7)
    extra = {"row_stride": stride} if stride else {}
    sym = ["T"] + list(shape[1:])
    k = render("l2_norm", "l2_norm", [("x", sym, "bf16", "buffer", extra)], [("y", sym, "f32")],
               {"eps": EPS, "dtype": "f32"})
    assert '"out_ptr", "*fp32"' in k.source
    T = shape[0]
    wide = rand((T, stride or int(np.prod(shape[1:]))), scale=2.0, gen=gen)
    x = wide[:, : int(np.prod(shape[1:]))].reshape(shape)
    out = poison(shape, "f32")
    run(k, {"in:0": wide, "out:0": out}, {"T": T, "B": 1})
    want = REGISTRY["l2_norm"].reference(None, x.float().numpy(), eps=EPS)
    got = out.numpy()
    assert not np.array_equal(got, bf16(got)), "rounded to bf16"
    assert np.abs(got - want).max() <= 1e-6


def test_l2_norm_output_dtype_rule():
    rule = REGISTRY["l2_norm"]
    x = TensorType(("T", 4, 8), "bf16")
    assert rule.infer([x], {"eps": EPS, "dtype": None}) == [x]
    assert rule.infer([x], {"eps": EPS, "dtype": "f32"}) == [TensorType(("T", 4, 8), "f32")]
    with pytest.raises(ShapeError, match="dtype must be one of"):
        rule.infer([x], {"eps": EPS, "dtype": "f64"})


@pytest.mark.parametrize("shape,xs,zs", [((7, 3, 20), None, None), ((6, 4, 32), None, 4 * 32 + 8 + 2 * 32),
                                         ((3, 48), 80, 48 + 16)])
def test_gated_rms_norm_kernel(shape, xs, zs):
    gen = np.random.default_rng(sum(shape) + 1)
    n = shape[-1]
    inner = int(np.prod(shape[1:]))
    sym = ["T"] + list(shape[1:])
    k = render("gated_rms_norm", "gated_rms_norm",
               [("x", sym, "bf16", "buffer", {"row_stride": xs} if xs else {}),
                ("z", sym, "bf16", "buffer", {"row_stride": zs} if zs else {}), ("w", [n], "bf16", "weight")],
               [("y", sym, "bf16")], {"eps": EPS})
    T = shape[0]
    xw, zw = rand((T, xs or inner), scale=2.0, gen=gen), rand((T, zs or inner), scale=1.5, gen=gen)
    x, z = xw[:, :inner].reshape(shape), zw[:, zs - inner if zs else 0:][:, :inner].reshape(shape)
    zin = zw.view(-1)[zs - inner:] if zs else zw
    w = torch.from_numpy(1 + 0.3 * gen.standard_normal(n).astype(np.float32)).to(torch.bfloat16)
    out = poison(shape)
    run(k, {"in:0": xw, "in:1": zin, "in:2": w, "out:0": out}, {"T": T, "B": 1})
    xf, zf, wf = (a.float().numpy() for a in (x, z, w))
    want = REGISTRY["gated_rms_norm"].reference(None, xf, zf, wf, eps=EPS)
    got = out.float().numpy()
    assert rel_err(got, want) < 1e-2
    # HF's roundings in a bf16 model: round(round(w * round(x * rsqrt(...))) * silu(z))
    x64 = xf.astype(np.float64)
    hf = bf16(bf16(wf * bf16(x64 / np.sqrt(np.mean(x64 * x64, -1, keepdims=True) + EPS))) * (zf / (1 + np.exp(-zf))))
    assert np.abs(got - hf).max() <= 2 ** -7 * np.abs(hf).max() + 1e-6
    assert (got == hf).mean() >= 0.98


# ---------------------------------------------------------------------------------------------
# causal_conv1d kernel

def _conv_launch(phase, C, K, has_bias, activation, x_stride, tune):
    ins = [("x", ["T", C], "bf16", "buffer", {"row_stride": x_stride} if x_stride else {}),
           ("w", [C, K], "bf16", "weight")] + ([("b", [C], "bf16", "weight")] if has_bias else [])
    caches = {"conv": {"kind": "slot", "shape": [K - 1, C], "dtype": "bf16", "layers": [0]}}
    return render("causal_conv1d", "causal_conv1d", ins, [("y", ["T", C], "bf16")],
                  {"activation": activation, "has_bias": has_bias}, phase=phase, caches=caches, tune=tune)


def _conv_step(gen, specs, slots, C, K, w, bias, store, ref, activation="silu", x_stride=None, tune=None,
               phase="prefill", x=None):
    """One step through the kernel (torch bf16 store) and the reference (float32 ref); returns (got, want, x)."""
    has_bias = bias is not None
    k = _conv_launch(phase, C, K, has_bias, activation, x_stride, tune)
    T = sum(n for _, n in specs)
    if x is None:
        wide = rand((T, x_stride or C), gen=gen)
        x = wide[:, :C]
    else:
        wide = torch.zeros((T, x_stride or C), dtype=torch.bfloat16)
        wide[:, :C] = x
    out = poison((T, C))
    b = {"in:0": wide, "in:1": w, "out:0": out, "cache:conv": store, **meta_bindings(specs, slots)}
    if has_bias:
        b["in:2"] = bias
    run(k, b, {"T": T, "B": len(specs)})
    ctx = Ctx(specs, slots, {"conv": ref})
    args = (bias.float().numpy(),) if has_bias else ()
    want = REGISTRY["causal_conv1d"].reference(ctx, x.float().numpy(), w.float().numpy(), *args,
                                               activation=activation, has_bias=has_bias)
    return out.float().numpy(), want, x


def _check_conv(got, want, store, ref, specs, slots):
    assert rel_err(got, want) < 1e-2
    assert np.abs(got - want).max() <= 2 ** -7 * np.abs(want).max() + 1e-6
    s = store.float().numpy()
    mine, rest = owned(s, specs, slots)
    rmine, rrest = owned(ref, specs, slots)
    assert np.array_equal(mine, rmine), "the conv slots must hold the last K-1 inputs exactly"
    assert np.isnan(rest).all(), "wrote a slot no sequence of the step owns"


@pytest.mark.parametrize("C,K,has_bias,activation,x_stride,tune,specs,slots", [
    (40, 4, False, "silu", None, {"BLOCK_C": 16, "BLOCK_T": 8}, [(0, 7), (0, 40), (0, 1), (0, 2)], [3, 0, 5, 1]),
    (40, 4, True, "silu", 40 + 24, {"BLOCK_C": 32, "BLOCK_T": 4}, [(5, 1), (0, 19), (2, 2), (9, 30)], [2, 4, 0, 1]),
    (24, 3, True, None, None, {}, [(1, 1), (0, 70), (6, 9)], [5, 2, 3]),
    (20, 2, False, "silu", 36, {"BLOCK_C": 16, "BLOCK_T": 1}, [(0, 3), (4, 5)], [1, 0]),   # K = 2, one-token blocks
])
def test_causal_conv1d_prefill_mixed(C, K, has_bias, activation, x_stride, tune, specs, slots):
    gen = np.random.default_rng(C * 7 + K)
    w = rand((C, K), scale=0.5, gen=gen)
    bias = rand((C,), scale=0.5, gen=gen) if has_bias else None
    store, ref = poisoned_slots((K - 1, C), specs, slots, gen, torch.bfloat16)
    old = ref.copy()
    got, want, x = _conv_step(gen, specs, slots, C, K, w, bias, store, ref, activation, x_stride, tune)
    _check_conv(got, want, store, ref, specs, slots)
    if activation == "silu":
        # HF in bf16: silu of the conv's bf16-rounded output, rounded again
        args = (bias.float().numpy(),) if bias is not None else ()
        pre = REGISTRY["causal_conv1d"].reference(Ctx(specs, slots, {"conv": old}), x.float().numpy(),
                                                  w.float().numpy(), *args, activation=None,
                                                  has_bias=bias is not None)
        hf = bf16(bf16(pre) / (1 + np.exp(-bf16(pre))))
        assert np.abs(got - hf).max() <= 2 ** -7 * np.abs(hf).max()
        assert (got == hf).mean() >= 0.98


def test_causal_conv1d_two_steps_equal_one_and_decode():
    """A prompt split over two steps (the state carried in the slot) gives what one step gives; then
    decode steps (the decode kernel) continue it, with a padding row (context 0, padding slot)."""
    gen = np.random.default_rng(11)
    C, K = 36, 4
    w, bias = rand((C, K), scale=0.5, gen=gen), rand((C,), scale=0.5, gen=gen)
    lens, split, slots = [70, 9, 2, 33], [40, 1, 1, 0], [4, 1, 0, 2]
    T = sum(lens)
    x = rand((T, C), gen=gen)
    starts = np.cumsum([0] + lens)
    tune = {"BLOCK_C": 16, "BLOCK_T": 8}

    one, one_ref = poisoned_slots((K - 1, C), [(0, n) for n in lens], slots, gen, torch.bfloat16)
    got1, want1, _ = _conv_step(gen, [(0, n) for n in lens], slots, C, K, w, bias, one, one_ref, tune=tune, x=x)

    two, two_ref = poisoned_slots((K - 1, C), [(0, n) for n in lens], slots, gen, torch.bfloat16)
    first = [(0, s) for s in split if s]
    xa = torch.cat([x[starts[i]:starts[i] + s] for i, s in enumerate(split) if s])
    sl_a = [slots[i] for i, s in enumerate(split) if s]
    got_a, want_a, _ = _conv_step(gen, first, sl_a, C, K, w, bias, two, two_ref, tune=tune, x=xa)
    second = [(s, n - s) for s, n in zip(split, lens)]
    xb = torch.cat([x[starts[i] + s:starts[i + 1]] for i, s in enumerate(split)])
    got_b, want_b, _ = _conv_step(gen, second, slots, C, K, w, bias, two, two_ref, tune=tune, x=xb, phase="mixed")
    _check_conv(got_b, want_b, two, two_ref, second, slots)
    # reassemble per sequence and compare with the one-shot step
    ra, rb, parts = 0, 0, []
    for i, (s, n) in enumerate(zip(split, lens)):
        if s:
            parts.append(got_a[ra:ra + s])
            ra += s
        parts.append(got_b[rb:rb + n - s])
        rb += n - s
    assert np.array_equal(np.concatenate(parts), got1)
    assert np.array_equal(two.float().numpy(), one.float().numpy(), equal_nan=True)

    # decode: one token per sequence; then the same step with a CUDA-graph padding row as the
    # runner pads it (context 1: nothing cached; the spare slot NSLOTS)
    for step in range(3):
        specs = [(n + step, 1) for n in lens] + [(0, 1)]
        dslots = slots + [NSLOTS]
        store = one.clone()
        got, want, xd = _conv_step(gen, specs[:-1], slots, C, K, w, bias, one, one_ref, phase="decode")
        _check_conv(got, want, one, one_ref, specs[:-1], slots)
        # the same step with the padding row appended: real rows and slots unchanged
        xpad = torch.cat([xd, rand((1, C), gen=gen)])
        k = _conv_launch("decode", C, K, True, "silu", None, None)
        out = poison((len(dslots), C))
        run(k, {"in:0": xpad, "in:1": w, "in:2": bias, "out:0": out, "cache:conv": store,
                "meta:seq_starts": i32(np.arange(len(dslots) + 1)),
                "meta:context_lens": i32([c + 1 for c, _ in specs[:-1]] + [1]), "meta:state_slots": i32(dslots)},
            {"T": len(dslots), "B": len(dslots)})
        assert np.array_equal(out[:-1].float().numpy(), got)
        assert np.array_equal(store[slots].float().numpy(), one[slots].float().numpy())


# ---------------------------------------------------------------------------------------------
# gated_delta_rule kernels

def _rule_launch(phase, hk, hv, dk, dv, tune=None, gdtype="f32", qk=("bf16", "bf16")):
    ins = [("q", ["T", hk, dk], qk[0]), ("k", ["T", hk, dk], qk[1]), ("v", ["T", hv, dv], "bf16"),
           ("g", ["T", hv], gdtype), ("beta", ["T", hv], gdtype)]
    caches = {"recurrent": {"kind": "slot", "shape": [hv, dk, dv], "dtype": "f32", "layers": [0]}}
    template = "gated_delta_rule_decode" if phase == "decode" else "gated_delta_rule_chunk"
    assert REGISTRY["gated_delta_rule"].template("triton", phase) == template
    return render(template, "gated_delta_rule", ins, [("o", ["T", hv, dv], "bf16")], {}, phase=phase,
                  caches=caches, tune=tune)


def _rule_inputs(gen, T, hk, hv, dk, dv, gdtype="f32", qk=("bf16", "bf16")):
    """qk: the dtypes of q and k (Qwen3.5's spec gives f32 ones, l2_norm(..., dtype=f32), as HF)."""
    q, k, v, g, beta = _delta_inputs(gen, T, hk, hv, dk, dv)
    to = lambda a, d: torch.from_numpy(a).to(TORCH[d])  # noqa: E731
    return to(q, qk[0]), to(k, qk[1]), to(v, "bf16"), to(g, gdtype), to(beta, gdtype)


def _rule_step(specs, slots, inputs, store, ref, phase="prefill", tune=None):
    q, k, v, g, beta = inputs
    hk, dk = q.shape[1:]
    hv, dv = v.shape[1:]
    dt = lambda a: "f32" if a.dtype == torch.float32 else "bf16"  # noqa: E731
    kern = _rule_launch(phase, hk, hv, dk, dv, tune, dt(g), (dt(q), dt(k)))
    T = q.shape[0]
    out = poison((T, hv, dv))
    run(kern, {"in:0": q, "in:1": k, "in:2": v, "in:3": g, "in:4": beta, "out:0": out, "cache:recurrent": store,
               **meta_bindings(specs, slots)}, {"T": T, "B": len(specs)})
    ctx = Ctx(specs, slots, {"recurrent": ref})
    want = REGISTRY["gated_delta_rule"].reference(ctx, *(a.float().numpy() for a in inputs))
    return out.float().numpy(), want


def _check_rule(got, want, store, ref, specs, slots, tol=1e-2):
    assert rel_err(got, want) < tol
    assert np.abs(got - want).max() <= 2 ** -7 * np.abs(want).max() + 1e-5
    mine, rest = owned(store.numpy(), specs, slots)
    rmine, _ = owned(ref, specs, slots)
    assert rel_err(mine, rmine) < 1e-5, "final state differs"   # fp32 state (the interpreter: fp32 dots)
    assert np.isnan(rest).all(), "wrote a slot no sequence of the step owns"


F32_QK = ("f32", "f32")


@pytest.mark.parametrize("hk,hv,dk,dv,tune,specs,slots,gdtype,qk", [
    (2, 4, 24, 20, {"BT": 16}, [(0, 70), (0, 7), (0, 1)], [3, 0, 5], "f32", ("bf16", "bf16")),  # prefill, 5 chunks
    (2, 4, 24, 20, {}, [(0, 70), (12, 1), (3, 7)], [1, 4, 2], "f32", ("bf16", "bf16")),        # mixed, BT = 64
    (1, 2, 32, 32, {"BT": 32, "BV": 16}, [(5, 40), (0, 1), (9, 2), (0, 33)], [5, 2, 0, 3], "bf16",
     ("bf16", "bf16")),                                                                       # 2 v blocks
    (3, 3, 16, 24, {"BT": 16, "BV": 16}, [(30, 17), (1, 1)], [0, 1], "f32", ("bf16", "bf16")),  # Hv = Hk, Dv masked
    # f32 q, k (Qwen3.5: l2_norm(..., dtype=f32)), and q, k of different dtypes
    (2, 4, 24, 20, {"BT": 16}, [(0, 40), (5, 7), (0, 1)], [3, 0, 5], "f32", F32_QK),
    (1, 2, 16, 20, {"BT": 16}, [(0, 19), (2, 3)], [1, 4], "f32", ("f32", "bf16")),
])
def test_gated_delta_rule_chunk(hk, hv, dk, dv, tune, specs, slots, gdtype, qk):
    gen = np.random.default_rng(hk * 100 + dk + len(specs))
    T = sum(n for _, n in specs)
    inputs = _rule_inputs(gen, T, hk, hv, dk, dv, gdtype, qk)
    store, ref = poisoned_slots((hv, dk, dv), specs, slots, gen, torch.float32)
    got, want = _rule_step(specs, slots, inputs, store, ref, tune=tune,
                           phase="prefill" if all(c == 0 for c, _ in specs) else "mixed")
    _check_rule(got, want, store, ref, specs, slots)


def test_gated_delta_rule_two_steps_equal_one_then_decode():
    """Chunked prefill: a prompt run as two steps (the second a mixed step with a new sequence
    beside) gives what one step gives, and the reference; then decode steps continue each
    sequence through the recurrent kernel, with a padding row."""
    gen = np.random.default_rng(5)
    hk, hv, dk, dv = 2, 4, 24, 20
    tune = {"BT": 16}
    lens, split, slots = [70, 9, 1, 33], [40, 1, 0, 7], [4, 1, 0, 2]
    T = sum(lens)
    allin = _rule_inputs(gen, T, hk, hv, dk, dv)
    starts = np.cumsum([0] + lens)

    one, one_ref = poisoned_slots((hv, dk, dv), [(0, n) for n in lens], slots, gen, torch.float32)
    got1, want1 = _rule_step([(0, n) for n in lens], slots, allin, one, one_ref, tune=tune)
    _check_rule(got1, want1, one, one_ref, [(0, n) for n in lens], slots)

    two, two_ref = poisoned_slots((hv, dk, dv), [(0, n) for n in lens], slots, gen, torch.float32)
    pick = lambda rows: tuple(a[rows] for a in allin)  # noqa: E731
    rows_a = np.concatenate([np.arange(starts[i], starts[i] + s) for i, s in enumerate(split) if s])
    first = [(0, s) for s in split if s]
    got_a, want_a = _rule_step(first, [slots[i] for i, s in enumerate(split) if s], pick(rows_a), two, two_ref,
                               tune=tune)
    rows_b = np.concatenate([np.arange(starts[i] + s, starts[i + 1]) for i, s in enumerate(split)])
    second = [(s, n - s) for s, n in zip(split, lens)]
    got_b, want_b = _rule_step(second, slots, pick(rows_b), two, two_ref, phase="mixed", tune=tune)
    _check_rule(got_b, want_b, two, two_ref, second, slots)
    got2 = np.zeros_like(got1)
    got2[rows_a], got2[rows_b] = got_a, got_b
    assert np.abs(got2 - got1).max() <= 2 ** -7 * np.abs(got1).max()
    assert rel_err(got2, got1) < 5e-3
    mine2, _ = owned(two.numpy(), second, slots)
    mine1, _ = owned(one.numpy(), second, slots)
    assert rel_err(mine2, mine1) < 1e-4

    for step in range(3):
        specs = [(n + step, 1) for n in lens]
        d_in = _rule_inputs(gen, len(lens), hk, hv, dk, dv)
        got, want = _rule_step(specs, slots, d_in, one, one_ref, phase="decode")
        _check_rule(got, want, one, one_ref, specs, slots)
        # a mixed step of one-token sequences through the chunk kernel gives the same
        got_c, _ = _rule_step(specs, slots, d_in, two, two_ref.copy(), phase="mixed", tune=tune)
        assert np.abs(got_c - got).max() <= 2 ** -7 * np.abs(got).max()
        two = one.clone()
        two_ref = one_ref.copy()

    # a padding row as the CUDA runner pads (context 1, the spare slot) beside real ones: real rows
    # and slots unchanged
    specs = [(n + 3, 1) for n in lens]
    d_in = _rule_inputs(gen, len(lens) + 1, hk, hv, dk, dv)
    store = one.clone()
    got, _ = _rule_step(specs, slots, tuple(a[:-1] for a in d_in), one, one_ref, phase="decode")
    kern = _rule_launch("decode", hk, hv, dk, dv)
    out = poison((len(lens) + 1, hv, dv))
    run(kern, {"in:0": d_in[0], "in:1": d_in[1], "in:2": d_in[2], "in:3": d_in[3], "in:4": d_in[4], "out:0": out,
               "cache:recurrent": store, "meta:context_lens": i32([c + 1 for c, _ in specs] + [1]),
               "meta:state_slots": i32(slots + [NSLOTS])}, {"T": len(lens) + 1, "B": len(lens) + 1})
    assert np.array_equal(out[:-1].float().numpy(), got)
    assert np.array_equal(store[slots].numpy(), one[slots].numpy())
    assert torch.isfinite(store[NSLOTS]).all()


def test_gated_delta_rule_decode_f32_qk():
    """The decode kernel with f32 q, k (Qwen3.5's, as HF's): new and continuing sequences, and the
    chunk kernel on the same one-token step gives the same."""
    gen = np.random.default_rng(21)
    hk, hv, dk, dv = 2, 4, 24, 20
    specs, slots = [(5, 1), (0, 1), (12, 1)], [2, 5, 0]
    d_in = _rule_inputs(gen, len(specs), hk, hv, dk, dv, qk=F32_QK)
    store, ref = poisoned_slots((hv, dk, dv), specs, slots, gen, torch.float32)
    store2, ref2 = store.clone(), ref.copy()
    got, want = _rule_step(specs, slots, d_in, store, ref, phase="decode")
    assert '"q_ptr", "*fp32"' in _rule_launch("decode", hk, hv, dk, dv, qk=F32_QK).source
    _check_rule(got, want, store, ref, specs, slots)
    got_c, _ = _rule_step(specs, slots, d_in, store2, ref2, phase="mixed", tune={"BT": 16})
    assert np.abs(got_c - got).max() <= 2 ** -7 * np.abs(got).max()


def test_references_through_the_oracle_context():
    """The references on the reference executor's own step context (runtime/reference/executor.py:
    its slot allocator, ctx.meta.state_slots, ctx.cache): two steps equal one, per sequence."""
    from infc.runtime.reference.executor import SeqPages
    from infc.runtime.engine.step import Chunk
    gen = np.random.default_rng(9)
    C, K, hk, hv, dk, dv = 10, 4, 1, 2, 8, 6
    decl = {"conv": {"kind": "slot", "shape": [K - 1, C], "dtype": "bf16", "layers": [0]},
            "recurrent": {"kind": "slot", "shape": [hv, dk, dv], "dtype": "f32", "layers": [0]}}
    lens, split = [9, 5, 1], [4, 1, 0]
    x = gen.standard_normal((sum(lens), C)).astype(np.float32)
    w = gen.standard_normal((C, K)).astype(np.float32)
    rule_in = _delta_inputs(gen, sum(lens), hk, hv, dk, dv)
    starts = np.cumsum([0] + lens)

    def run_steps(steps):
        pages = SeqPages(decl, page_size=4, num_pages=8)
        conv_out, rule_out = np.zeros_like(x), np.zeros((sum(lens), hv, dv), np.float32)
        for step in steps:                      # [(seq, first, last)]
            chunks = [Chunk(s, [0] * (b - a), a) for s, a, b in step if b > a]
            rows = np.concatenate([np.arange(starts[s] + a, starts[s] + b) for s, a, b in step if b > a])
            ctx = pages.context(chunks)
            conv_out[rows] = REGISTRY["causal_conv1d"].reference(ctx, x[rows], w, activation="silu")
            rule_out[rows] = REGISTRY["gated_delta_rule"].reference(ctx, *(a[rows] for a in rule_in))
        return conv_out, rule_out

    one = run_steps([[(i, 0, n) for i, n in enumerate(lens)]])
    two = run_steps([[(i, 0, s) for i, s in enumerate(split)], [(i, s, n) for i, (s, n) in enumerate(zip(split, lens))]])
    for a, b in zip(one, two):
        assert np.abs(a - b).max() < 1e-5


# the gates made inside the delta rule (compiler/passes/fuse_delta_rule.py): raw a, b as strided
# views of one projection output, dt_bias and A f32
def _gate_inputs(gen, T, hv, width=None):
    """a, b (bf16 [T, Hv] views of a [T, width] projection), dt_bias, A, and the row stride."""
    width = width or 3 * hv + 5
    proj = torch.from_numpy(gen.standard_normal((T, width)).astype(np.float32) * 2).to(torch.bfloat16)
    a, b = proj[:, 1:1 + hv], proj[:, 2 + hv:2 + 2 * hv]
    dt_bias = torch.from_numpy(gen.standard_normal(hv).astype(np.float32) * 0.5)
    A = torch.from_numpy(-np.exp(gen.uniform(-2, 0.5, hv)).astype(np.float32))
    return a, b, dt_bias, A, width


def raw_rule_inputs(gen, T, hk, hv, dk, dv):
    """The fused rule's inputs as a layer makes them: q, k raw bf16 views of the conv's [T, qk_width]
    output (not unit rows), v, a, b (views of a [T, gate_width] projection), dt_bias, A; then
    gate_width and qk_width."""
    qk_width = 2 * hk * dk + 7
    conv = torch.from_numpy(gen.standard_normal((T, qk_width)).astype(np.float32) * 3).to(torch.bfloat16)
    q = conv[:, 3:3 + hk * dk].view(T, hk, dk)
    k = conv[:, 5 + hk * dk:5 + 2 * hk * dk].view(T, hk, dk)
    _, _, v, _, _ = _rule_inputs(gen, T, hk, hv, dk, dv)
    a, b, dt_bias, A, gate_width = _gate_inputs(gen, T, hv)
    return q, k, v, a, b, dt_bias, A, gate_width, qk_width


def _gated_launch(phase, hk, hv, dk, dv, width, tune=None, beta_dtype="bf16", qk_norm=None, qk_width=None):
    """qk_norm: q, k raw bf16 views of a [T, qk_width] row (the conv's output), normalized inside."""
    qk = ("f32", {}) if qk_norm is None else ("bf16", {"row_stride": qk_width})
    ins = [("q", ["T", hk, dk], qk[0], "buffer", qk[1]), ("k", ["T", hk, dk], qk[0], "buffer", qk[1]),
           ("v", ["T", hv, dv], "bf16"),
           ("a", ["T", hv], "bf16", "buffer", {"row_stride": width}), ("b", ["T", hv], "bf16", "buffer", {"row_stride": width}),
           ("dt_bias", [hv], "f32", "weight"), ("A", [hv], "f32", "weight")]
    caches = {"recurrent": {"kind": "slot", "shape": [hv, dk, dv], "dtype": "f32", "layers": [0]}}
    template = "gated_delta_rule_decode" if phase == "decode" else "gated_delta_rule_chunk"
    attrs = {"gates": beta_dtype, "has_dt_bias": True, "has_A": True, **({"qk_norm": qk_norm} if qk_norm else {})}
    return render(template, "gated_delta_rule", ins, [("o", ["T", hv, dv], "bf16")], attrs, phase=phase,
                  caches=caches, tune=tune)


@pytest.mark.parametrize("phase,tune,specs,slots", [
    ("prefill", {"BT": 16}, [(0, 37), (0, 5)], [3, 0]),
    ("mixed", {}, [(0, 70), (12, 1), (3, 9)], [1, 4, 2]),
    ("decode", None, [(5, 1), (0, 1), (12, 1)], [2, 5, 0]),
])
def test_gated_delta_rule_normalizes_its_q_and_k(phase, tune, specs, slots):
    """q, k raw bf16 strided views (not unit rows, of another scale each), l2-normalized inside the
    kernel in fp32: the plain rule on the l2_norm reference's rows, and the fused reference is
    that chain bit for bit."""
    gen = np.random.default_rng(len(specs) * 11 + len(phase))
    hk, hv, dk, dv = 2, 4, 24, 20
    T = sum(n for _, n in specs)
    q, k, v, a, b, dt_bias, A, gw, width = raw_rule_inputs(gen, T, hk, hv, dk, dv)
    store, ref = poisoned_slots((hv, dk, dv), specs, slots, gen, torch.float32)
    before = ref.copy()
    kern = _gated_launch(phase, hk, hv, dk, dv, gw, tune, qk_norm=1e-6, qk_width=width)
    out = poison((T, hv, dv))
    run(kern, {"in:0": q, "in:1": k, "in:2": v, "in:3": a, "in:4": b, "in:5": dt_bias, "in:6": A, "out:0": out,
               "cache:recurrent": store, **meta_bindings(specs, slots)}, {"T": T, "B": len(specs)})
    rule = REGISTRY["gated_delta_rule"]
    q_, k_, v_, a_, b_, dt_, A_ = (x.float().numpy() for x in (q, k, v, a, b, dt_bias, A))
    qn, kn = (REGISTRY["l2_norm"].reference(None, x, eps=1e-6) for x in (q_, k_))
    g = REGISTRY["mul"].reference(None, REGISTRY["softplus"].reference(None, REGISTRY["add"].reference(None, a_, dt_)), A_)
    beta = REGISTRY["sigmoid"].reference(None, b_)
    rounded = torch.from_numpy(beta).to(torch.bfloat16).float().numpy()
    want = rule.reference(Ctx(specs, slots, {"recurrent": ref}), qn, kn, v_, g, rounded)
    _check_rule(out.float().numpy(), want, store, ref, specs, slots)
    chain, fused = before.copy(), before.copy()
    want_chain = rule.reference(Ctx(specs, slots, {"recurrent": chain}), qn, kn, v_, g, beta)
    got_fused = rule.reference(Ctx(specs, slots, {"recurrent": fused}), q_, k_, v_, a_, b_, dt_, A_, gates="bf16",
                               qk_norm=1e-6, has_dt_bias=True, has_A=True)
    assert np.array_equal(got_fused, want_chain) and np.array_equal(fused, chain, equal_nan=True)


@pytest.mark.parametrize("phase,tune,specs,slots", [
    ("prefill", {"BT": 16}, [(0, 37), (0, 5)], [3, 0]),          # ragged chunks: rows past the end
    ("mixed", {}, [(0, 70), (12, 1), (3, 9)], [1, 4, 2]),          # BT = 64
    ("decode", None, [(5, 1), (0, 1), (12, 1)], [2, 5, 0]),
])
def test_gated_delta_rule_makes_its_gates(phase, tune, specs, slots):
    """g = A softplus(a + dt_bias) in fp32 and beta = sigmoid(b) rounded to bf16 inside the kernel,
    from strided bf16 views, as the chain's launches computed and stored them; and the fused op's
    reference is the chain's, bit for bit."""
    gen = np.random.default_rng(len(specs) * 7 + len(phase))
    hk, hv, dk, dv = 2, 4, 24, 20
    T = sum(n for _, n in specs)
    q, k, v, _, _ = _rule_inputs(gen, T, hk, hv, dk, dv, qk=F32_QK)
    a, b, dt_bias, A, width = _gate_inputs(gen, T, hv)
    store, ref = poisoned_slots((hv, dk, dv), specs, slots, gen, torch.float32)
    before = ref.copy()
    kern = _gated_launch(phase, hk, hv, dk, dv, width, tune)
    out = poison((T, hv, dv))
    run(kern, {"in:0": q, "in:1": k, "in:2": v, "in:3": a, "in:4": b, "in:5": dt_bias, "in:6": A, "out:0": out,
               "cache:recurrent": store, **meta_bindings(specs, slots)}, {"T": T, "B": len(specs)})
    rule = REGISTRY["gated_delta_rule"]
    q_, k_, v_, a_, b_, dt_, A_ = (x.float().numpy() for x in (q, k, v, a, b, dt_bias, A))
    g = REGISTRY["mul"].reference(None, REGISTRY["softplus"].reference(None, REGISTRY["add"].reference(None, a_, dt_)), A_)
    beta = REGISTRY["sigmoid"].reference(None, b_)
    rounded = torch.from_numpy(beta).to(torch.bfloat16).float().numpy()       # the sigmoid launch's store
    want = rule.reference(Ctx(specs, slots, {"recurrent": ref}), q_, k_, v_, g, rounded)
    _check_rule(out.float().numpy(), want, store, ref, specs, slots)
    chain, fused = before.copy(), before.copy()
    want_chain = rule.reference(Ctx(specs, slots, {"recurrent": chain}), q_, k_, v_, g, beta)
    got_fused = rule.reference(Ctx(specs, slots, {"recurrent": fused}), q_, k_, v_, a_, b_, dt_, A_, gates="bf16",
                               has_dt_bias=True, has_A=True)
    assert np.array_equal(got_fused, want_chain) and np.array_equal(fused, chain, equal_nan=True)
