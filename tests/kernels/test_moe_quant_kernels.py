"""The MoE templates on quantized experts (triton/_quant.j2's helpers in moe_gate_up / moe_down and
their grouped forms) under the interpreter, against the ops' references (compiler/ops/quant.py's
definition, the activations quantized as the scheme says).

Stacks of random codes per expert (valid e4m3; u4 / e2m1 packed two a byte) with random scales
(and zero points) per expert; H = 48 and F = 40 are ragged against the K tiles and the groups of
32, F against BLOCK_F / BLOCK_H. Schemes: Qwen3-30B-A3B-FP8's fp8 blocks with dynamic group
activations (at test scale, 8-row blocks so that gate's rows end on a block as the pass asks),
Kimi-K2's int4 symmetric group 32, GPT-OSS's MXFP4 (e2m1, power-of-two scales, group 32: tl.dot_scaled); then
fp8 at the published 128 x 128 (one ragged group, whole-group tiles raised to 128), asymmetric
u4 and u8. Both decode paths (CUDA cores at one token, tensor cores past FMA_T) and the grouped
GEMMs (gate_up's interleaved PAIR and two-dot forms), one fast case per format, the rest with
--exhaustive; fp8 per channel with per-token activations (a row pass for each A row's amax).
"""
import itertools
import zlib

import numpy as np
import pytest
import torch

from infc.compiler.codegen.render import TemplateError
from infc.compiler.ops import REGISTRY
from infc.compiler.quant.scheme import QuantScheme
from infc.runtime.weights.quant_pack import to_storage

from exhaustive import EXHAUSTIVE

from .harness import poison, rand, rel_err, render, run
from .test_moe_kernels import E, F, H, TOL, f32, grouping, named, routing, zero_counters
from .test_quant_linear_kernels import _codes

SCHEMES = {
    "fp8-8x32-group32": QuantScheme("f8e4m3", 8, 32, act="dynamic_group", act_group=32),
    "u4-g32-sym": QuantScheme("u4", 1, 32),
    "e2m1-g32": QuantScheme("e2m1", 1, 32),
    "fp8-128x128-group128": QuantScheme("f8e4m3", 128, 128, act="dynamic_group", act_group=128),
    "u4-g16-zero": QuantScheme("u4", 1, 16, zeros=True),
    "u8-channel": QuantScheme("u8", 1, None),
    # compressed-tensors FP8 per channel with dynamic per-token activations (a row pass first)
    "fp8-channel-token": QuantScheme("f8e4m3", 1, None, act="dynamic_token"),
}
FAST = ["fp8-8x32-group32", "u4-g32-sym", "e2m1-g32"]


def quantized_stack(s: QuantScheme, n: int, k: int, gen):
    """(storage tensor [E, n, k] codes, values float32, companions {name: float32 [E, ...]}) of
    random experts whose dequantized entries are ~1/sqrt(k)."""
    values = _codes(s, (E, n, k), gen)
    typical = {"f8e4m3": 60.0, "e2m1": 3.0, "u4": 4.0, "u8": 64.0}[s.codes]
    comp = {"w_scale": (gen.uniform(0.5, 1.5, (E,) + s.scale_shape(n, k)) / (typical * k ** 0.5)).astype(np.float32)}
    if s.codes == "e2m1":
        # MX scales are e8m0, powers of two (what the e8m0 recipe loads): spread over five of them
        base = np.round(np.log2(1 / (typical * k ** 0.5)))
        comp["w_scale"] = np.exp2(base + gen.integers(-2, 3, (E,) + s.scale_shape(n, k))).astype(np.float32)
    if s.zeros:
        comp["w_zero"] = np.round(gen.uniform(0, (1 << s.bits) - 1, (E,) + s.scale_shape(n, k))).astype(np.float32)
    stored = torch.from_numpy(to_storage(values, s.codes))
    if s.codes == "f8e4m3":
        stored = stored.view(torch.float8_e4m3fn)
    return stored, values, comp


def _attrs(s: QuantScheme) -> dict:
    return {"quant": s.attrs(), **{f"has_{c}": True for c in s.companions()}}


def _specs(comp):
    return [(c, list(a.shape), "f32", "weight") for c, a in comp.items()]


def _bias(extra, n, gen):
    """([the bias input spec], {binding}, (array,)) of an expert bias [E, n] when extra asks for one."""
    if not extra.get("has_bias"):
        return [], ()
    b = rand((E, n), gen=gen, scale=0.5)
    return [("bias", [E, n], "bf16", "weight")], (b,)


def _upcast_input(upcast, n, k, extra):
    """([the w_upcast input spec], attrs) of a grouped launch given upcast = (rows, the bf16 stack)
    (compiler/passes/upcast_experts.py), else ([], extra)."""
    if upcast is None:
        return [], extra
    return [("w_upcast", [E, n, k], "bf16")], {**extra, "has_w_upcast": True, "upcast_rows": upcast[0]}


def gate_up_case(s, T, KT, template, tune, seed, extra=None, ep=False, upcast=None, out=None):
    """extra: attrs beyond the scheme's (has_bias: an [E, 2F] bias after counts; act, alpha, limit);
    ep: test_moe_kernels.routing's (slots of id -1, or "dup": expert 0 repeated in a token);
    upcast: (rows, bf16 [E, 2F, H]) the stack dequantized once, the last input; out: a dict that
    gets the launch's output ("y") and the dequantized stack's values ("w")."""
    extra = extra or {}
    u_in, extra = _upcast_input(upcast, 2 * F, H, extra)
    gen = np.random.default_rng(seed)
    ids, _ = routing(T, KT, E, gen, ep)
    x = rand((T, H), gen=gen, scale=1.5)
    w, values, comp = quantized_stack(s, 2 * F, H, gen)
    b_in, b = _bias(extra, 2 * F, gen)
    ins = [("x", ["T", H], "bf16"), ("ids", ["T", KT], "i32"), ("gate_up", [E, 2 * F, H], s.codes, "weight"),
           ("rows", [E, "T"], "i32"), ("counts", [E], "i32")] + b_in + _specs(comp) + u_in
    phase = "decode" if template == "moe_gate_up" else "prefill"
    attrs = {**_attrs(s), **extra}
    k = render(template, "moe_gate_up", ins, [("act", ["T", KT, F], "bf16")], attrs=attrs, phase=phase, tune=tune)
    rows, counts = grouping(ids, E, gen)
    act = poison((T, KT, F))
    bind = {"in:0": x, "in:1": ids, "in:2": w, "in:3": rows, "in:4": counts, "out:0": act}
    bind.update({f"in:{5 + i}": torch.as_tensor(a) for i, a in enumerate(b + tuple(comp.values()))})
    if upcast is not None:
        bind[f"in:{len(ins) - 1}"] = upcast[1]
    run(k, bind, {"T": T, "B": T if phase == "decode" else 1})
    want = REGISTRY["moe_gate_up"].reference(None, f32(x), ids.numpy(), values, None, None,
                                             *[f32(a) for a in b], *comp.values(), **attrs)
    assert rel_err(named(f32(act), ids), named(want, ids)) <= TOL
    if out is not None:
        out.update(y=named(f32(act), ids), w=(w, values, comp))
    return k


def down_case(s, T, KT, template, tune, seed, extra=None, ep=False, upcast=None, out=None):
    """extra: attrs beyond the scheme's (has_bias: an [E, H] bias after counts); ep, upcast, out:
    as gate_up_case's (the stack [E, H, F])."""
    extra = extra or {}
    u_in, extra = _upcast_input(upcast, H, F, extra)
    gen = np.random.default_rng(seed)
    ids, rw = routing(T, KT, E, gen, ep)
    act = rand((T, KT, F), gen=gen, scale=0.5)
    w, values, comp = quantized_stack(s, H, F, gen)
    b_in, b = _bias(extra, H, gen)
    ins = [("act", ["T", KT, F], "bf16"), ("weights", ["T", KT], "f32"), ("ids", ["T", KT], "i32"),
           ("down", [E, H, F], s.codes, "weight"), ("rows", [E, "T"], "i32"), ("counts", [E], "i32")] \
        + b_in + _specs(comp) + u_in
    phase = "decode" if template == "moe_down" else "prefill"
    attrs = {**_attrs(s), **extra}
    k = render(template, "moe_down", ins, [("y", ["T", H], "bf16")], attrs=attrs, phase=phase, tune=tune)
    rows, counts = grouping(ids, E, gen)
    y = poison((T, H))
    bind = {"in:0": act, "in:1": rw, "in:2": ids, "in:3": w, "in:4": rows, "in:5": counts, "out:0": y}
    bind.update({f"in:{6 + i}": torch.as_tensor(a) for i, a in enumerate(b + tuple(comp.values()))})
    if upcast is not None:
        bind[f"in:{len(ins) - 1}"] = upcast[1]
    zero_counters(run(k, bind, {"T": T, "B": T if phase == "decode" else 1}))
    want = REGISTRY["moe_down"].reference(None, f32(act), rw.numpy(), ids.numpy(), values, None, None,
                                          *[f32(a) for a in b], *comp.values(), **attrs)
    assert rel_err(f32(y), want) <= TOL
    if out is not None:
        out.update(y=f32(y), w=(w, values, comp))
    return k


# (template, T, KT, tune): decode at one token (CUDA cores) and at 7 tokens with FMA_T 0 (tensor
# cores), the grouped GEMMs at 37 tokens (several row blocks an expert; gate_up's PAIR and
# two-dot forms)
PATHS = {
    "decode-fma": (1, 8, {}),
    "decode-dot": (7, 2, {"FMA_T": 0, "BLOCK_K": 32, "TC": 16}),
    "grouped": (37, 8, {"BLOCK_M": 16, "BLOCK_F": 16, "BLOCK_H": 16, "BLOCK_K": 32}),
    "grouped-two-dots": (37, 2, {"BLOCK_M": 16, "BLOCK_F": 32, "BLOCK_H": 32, "BLOCK_K": 16, "PAIR": 0}),
}
TEMPLATES = {"gate_up": {"decode": "moe_gate_up", "grouped": "moe_gate_up_grouped"},
             "down": {"decode": "moe_down", "grouped": "moe_down_grouped"}}
CASE = {"gate_up": gate_up_case, "down": down_case}
# fast: each format on each launch, on one path each (the paths rotate over the formats)
FAST_ROWS = {(n, launch, list(PATHS)[(j + i) % len(PATHS)]) for j, n in enumerate(FAST)
             for i, launch in enumerate(CASE)} | {("fp8-channel-token", "gate_up", "grouped"),
                                                  ("fp8-channel-token", "down", "decode-fma")}


@pytest.mark.parametrize("scheme,launch,path", [
    pytest.param(*row, id="-".join(row), marks=() if row in FAST_ROWS else EXHAUSTIVE)
    for row in itertools.product(SCHEMES, CASE, PATHS)])
def test_quantized_experts(scheme, launch, path):
    T, KT, tune = PATHS[path]
    if launch == "gate_up":
        tune = {k: v for k, v in tune.items() if k != "BLOCK_H"}
    else:
        tune = {k: v for k, v in tune.items() if k not in ("BLOCK_F", "PAIR")}
    template = TEMPLATES[launch][path.split("-")[0]]
    k = CASE[launch](SCHEMES[scheme], T, KT, template, tune, zlib.crc32(f"{scheme}{launch}{path}".encode()))
    assert "_w_deq" in k.source and ("_a_quant" in k.source) == (SCHEMES[scheme].act != "none")
    # MXFP4 (e2m1, 32-column scales) on tl.dot_scaled in all four templates, no other format
    assert ("tl.dot_scaled(_w_raw(" in k.source) == (SCHEMES[scheme].codes == "e2m1")


# fast: one path each launch (tests/kernels/test_moe_gated_kernels.py runs the bf16 paths with
# biases; tests/test_gpt_oss_mxfp4.py the whole model through the kernels)
OSS_FAST = {("gate_up", "grouped"), ("down", "decode-fma")}


@pytest.mark.parametrize("launch,path", [
    pytest.param(launch, path, id=f"{launch}-{path}", marks=() if (launch, path) in OSS_FAST else EXHAUSTIVE)
    for launch in CASE for path in PATHS])
def test_mxfp4_experts_with_bias_and_clamped_swiglu(launch, path):
    """GPT-OSS's experts: MXFP4 codes with the expert biases (after counts, the scheme's
    companions after them) and, on gate_up, the clamped SwiGLU."""
    T, KT, tune = PATHS[path]
    extra = {"has_bias": True}
    if launch == "gate_up":
        tune = {k: v for k, v in tune.items() if k != "BLOCK_H"}
        extra.update(act="clamped_swiglu", alpha=1.702, limit=0.8)
    else:
        tune = {k: v for k, v in tune.items() if k not in ("BLOCK_F", "PAIR")}
    template = TEMPLATES[launch][path.split("-")[0]]
    CASE[launch](SCHEMES["e2m1-g32"], T, KT, template, tune, zlib.crc32(f"oss{launch}{path}".encode()), extra)


def test_quantized_expert_tiles_hold_whole_activation_groups():
    """fp8 at 128 x 128 with group-128 activations: every K tile of the four templates is raised
    to 128 (a tile quantizes whole groups); the bf16 defaults stay."""
    s = SCHEMES["fp8-128x128-group128"]
    for template, op, w, comp in [("moe_gate_up", "moe_gate_up", [E, 2 * F, H], [E, 1, 1]),
                                  ("moe_gate_up_grouped", "moe_gate_up", [E, 2 * F, H], [E, 1, 1]),
                                  ("moe_down", "moe_down", [E, H, F], [E, 1, 1]),
                                  ("moe_down_grouped", "moe_down", [E, H, F], [E, 1, 1])]:
        ins = [("x", ["T", H], "bf16"), ("ids", ["T", 2], "i32"), ("w", w, "f8e4m3", "weight"),
               ("rows", [E, "T"], "i32"), ("counts", [E], "i32"), ("w_scale", comp, "f32", "weight")]
        outs = [("act", ["T", 2, F], "bf16")]
        if op == "moe_down":
            ins = [("act", ["T", 2, F], "bf16"), ("weights", ["T", 2], "f32")] + ins[1:]
            outs = [("y", ["T", H], "bf16")]
        phase = "prefill" if template.endswith("grouped") else "decode"
        c = render(template, op, ins, outs, attrs=_attrs(s), phase=phase).meta["constexprs"]
        assert c["BLOCK_K"] == 128 and c.get("FMA_BLOCK_K", 128) % 128 == 0, template


def test_quantized_experts_refuse_what_they_do_not_compute():
    s = QuantScheme("f8e4m3", 1, None, act="static")
    ins = [("x", ["T", H], "bf16"), ("ids", ["T", 2], "i32"), ("w", [E, 2 * F, H], "f8e4m3", "weight"),
           ("rows", [E, "T"], "i32"), ("counts", [E], "i32"), ("w_scale", [E, 2 * F, 1], "f32", "weight")]
    with pytest.raises(TemplateError, match="quantized_experts_take_no_act_order_g_idx_nor_static_activations"):
        render("moe_gate_up", "moe_gate_up", ins, [("act", ["T", 2, F], "bf16")], attrs=_attrs(s))


# GPT-OSS's MXFP4 experts on the decode templates' dot_scaled path (FMA_T 0: every token count on the
# tensor cores): 1 token (one BLOCK_T tile, 15 rows masked), 3, and 17 (two BLOCK_T tiles: the second
# holds one token); K (H = 48 for gate_up, F = 40 for down) ragged against BLOCK_K 64 and the
# default 256, the tail group of down's 40 columns half past K; E = 10 with experts nobody chose
MX_DECODE = [("gate_up", 1, 8, {}), ("down", 3, 2, {}), ("gate_up", 17, 2, {"BLOCK_K": 64, "TC": 16}),
             ("down", 17, 4, {"BLOCK_K": 64}), ("gate_up", 3, 4, {"BLOCK_F": 16, "BLOCK_K": 32}),
             ("down", 1, 8, {"BLOCK_H": 16, "BLOCK_K": 32})]


@pytest.mark.parametrize("launch,T,KT,tune", [
    pytest.param(*row, id=f"{row[0]}-T{row[1]}-{'-'.join(f'{k}{v}' for k, v in row[3].items()) or 'default'}",
                 marks=() if i < 4 else EXHAUSTIVE) for i, row in enumerate(MX_DECODE)])
def test_mxfp4_decode_dots_codes_and_e8m0_scales(launch, T, KT, tune):
    # the tensor-core path at every count (FMA_T 0); the CUDA-core MX path: test_moe_mx_fma.py
    tune = {"FMA_T": 0, **tune}
    s = SCHEMES["e2m1-g32"]
    template = TEMPLATES[launch]["decode"]
    k = CASE[launch](s, T, KT, template, tune, zlib.crc32(f"mx{launch}{T}{KT}".encode()))
    c = k.meta["constexprs"]
    assert c["FMA_T"] == 0 and "tl.dot_scaled(_w_raw(" in k.source and "_w_e8m0(ws, " in k.source
    assert c["BLOCK_K"] == tune.get("BLOCK_K", 256)


def test_mxfp4_e8m0_bytes_of_the_stored_scales(tmp_path):
    """_w_e8m0 reads the float scale's exponent field: 2^(b - 127) -> b for every finite byte an
    e8m0 checkpoint holds (0's 2^-127 a subnormal), and 127 (1.0) past the row's groups."""
    import importlib.util
    ins = [("act", ["T", 2, F], "bf16"), ("weights", ["T", 2], "f32"), ("ids", ["T", 2], "i32"),
           ("down", [E, H, F], "e2m1", "weight"), ("rows", [E, "T"], "i32"), ("counts", [E], "i32"),
           ("w_scale", [E, H, 2], "f32", "weight")]
    src = render("moe_down", "moe_down", ins, [("y", ["T", H], "bf16")], attrs=_attrs(SCHEMES["e2m1-g32"]),
                 phase="decode").source
    # F = 40: two groups a row; the probe reads 4 (a 128-column tile), rows 0..127
    f = tmp_path / "mx_probe.py"
    f.write_text(src + """

@triton.jit
def probe(t_ptr, out_ptr):
    srow = tl.arange(0, 128)[:, None]
    tl.store(out_ptr + srow * 4 + tl.arange(0, 4)[None, :], _w_e8m0(t_ptr, srow, 0, 128))
""")
    spec = importlib.util.spec_from_file_location("mx_probe", f)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    b = np.concatenate([np.arange(255), [127]]).reshape(128, 2)      # bytes 0..254, one pad
    t = torch.from_numpy(np.ldexp(np.float32(1), b - 127).astype(np.float32))
    out = torch.zeros((128, 4), dtype=torch.uint8)
    mod.probe[(1,)](t, out)
    np.testing.assert_array_equal(out.numpy()[:, :2], b)
    assert (out.numpy()[:, 2:] == 127).all()
