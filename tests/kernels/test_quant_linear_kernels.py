"""The linear family's kernels on quantized weights (triton/_quant.j2 in gemv.py.j2 and gemm.py.j2)
under the interpreter, against the ops' references (compiler/ops/quant.py's definition).

Weights are random codes of every code dtype (valid e4m3, never NaN; u4 / e2m1 packed two a byte)
with random scales (no two equal), random zero points, a random act-order g_idx; activations
quantized per group, per token or by a static scale. K is ragged against the tiles and the groups
(136 = 2 x 64 + 8), N against the column blocks and the scale's row blocks (40 = 32 + 8). Every mode (plain,
act_mul, gated, the narrow add_rms_norm prologue), both GEMV paths (CUDA-core, tensor-core; each
with split-K) and the GEMM's two forms (W8A8 codes, dequantized bf16) run; the cross product is
covered in the fast suite (each scheme on each path, each mode on each path), whole with
--exhaustive.
"""
import itertools
import zlib

import numpy as np
import pytest
import torch

from infc.compiler.codegen.render import TemplateError
from infc.compiler.ops import REGISTRY
from infc.compiler.ops.quant import round_e4m3
from infc.compiler.quant.scheme import QuantScheme
from infc.runtime.weights.quant_pack import E2M1, to_storage

from exhaustive import EXHAUSTIVE

from .harness import bf16, poison, rand, rel_err, render, run
from .test_gemm_kernels import TOL, check_scratch_zero, f32
from .test_gemv_prologue import EPS, PROLOGUE

SCHEMES = {
    # Qwen's / DeepSeek's fp8 blocks at test scale: 32-row blocks (N = 100 is ragged against them)
    "fp8-32x64-group64": QuantScheme("f8e4m3", 32, 64, act="dynamic_group", act_group=64),
    "fp8-channel-token": QuantScheme("f8e4m3", 1, None, act="dynamic_token"),
    "fp8-tensor-static": QuantScheme("f8e4m3", 1, None, act="static"),
    "fp8-16x32-weights": QuantScheme("f8e4m3", 16, 32),
    "u4-g32-zero": QuantScheme("u4", 1, 32, zeros=True),
    "u4-g128-act-order": QuantScheme("u4", 1, 128, g_idx=True),
    "u8-g64": QuantScheme("u8", 1, 64),
    "e2m1-g32": QuantScheme("e2m1", 1, 32),
}


def _codes(s: QuantScheme, shape, gen) -> np.ndarray:
    """Random codes' values of the scheme's dtype."""
    if s.codes == "f8e4m3":
        return round_e4m3(gen.standard_normal(shape) * 60)          # up to the 448 saturation
    if s.codes == "e2m1":
        return E2M1[gen.integers(0, 16, shape)]
    return gen.integers(0, 1 << s.bits, shape).astype(np.float32)


def quantized_weight(s: QuantScheme, n: int, k: int, gen):
    """(storage tensor, values float32 [n, k], companions {name: float32 / int32 array}) of a random
    weight whose dequantized entries are ~1/sqrt(k)."""
    values = _codes(s, (n, k), gen)
    typical = {"f8e4m3": 60.0, "e2m1": 3.0, "u4": 4.0, "u8": 64.0}[s.codes]
    comp = {"w_scale": (gen.uniform(0.5, 1.5, s.scale_shape(n, k)) / (typical * k ** 0.5)).astype(np.float32)}
    if s.zeros:
        comp["w_zero"] = np.round(gen.uniform(0, (1 << s.bits) - 1, s.scale_shape(n, k))).astype(np.float32)
    if s.g_idx:
        comp["w_gidx"] = gen.permutation(np.arange(k) // s.block_k).astype(np.int32)
    if s.act == "static":
        comp["x_scale"] = np.array([2.5 / 448], np.float32)         # |x| past 2.5 saturates
    stored = torch.from_numpy(to_storage(values, s.codes))
    if s.codes == "f8e4m3":
        stored = stored.view(torch.float8_e4m3fn)
    return stored, values, comp


def _attrs(s: QuantScheme, **more):
    return {"has_bias": False, **more, "quant": s.attrs(), **{f"has_{c}": True for c in s.companions()}}


def _specs(comp):
    return [(c, list(a.shape), "i32" if c == "w_gidx" else "f32", "weight") for c, a in comp.items()]


def _tensors(comp):
    return [torch.from_numpy(a) for a in comp.values()]


# mode -> (template stem, op, A columns per K column, W rows per output column)
MODES = {"plain": ("", "linear", 1, 1), "act_mul": ("_act_mul", "linear_act_mul", 2, 1),
         "gated": ("_gated", "linear_gated", 1, 2), "prologue": ("", "linear", 1, 1)}

# GEMV paths: (rows T, tune). K tiles of 64 or 128 (the fp8 scheme's act_group is 64) over K = 136; 1 row
# takes the CUDA-core path, 3 rows with FMA_T 4 too (its row loop), 5 the tensor-core path.
GEMV_PATHS = {
    "fma": (1, {"BLOCK_N": 16, "FMA_BLOCK_K": 128}),   # two activation groups of 64 a tile
    "fma-split": (1, {"BLOCK_N": 32, "FMA_BLOCK_K": 64, "SPLIT_K": 2}),
    "fma-rows": (3, {"BLOCK_N": 16, "FMA_BLOCK_K": 128, "FMA_T": 4, "BLOCK_T": 16}),
    # three splits of one 64-column tile (the last 8 columns): split 0's second preloaded tile lies
    # past its range but inside K, where an integer format's zero codes are not zero weights
    "fma-split3": (1, {"BLOCK_N": 16, "FMA_BLOCK_K": 64, "SPLIT_K": 3}),
    "dot": (5, {"BLOCK_N_DOT": 32, "BLOCK_K": 64, "BLOCK_T": 16}),
    "dot-split": (17, {"BLOCK_N_DOT": 16, "BLOCK_K": 64, "BLOCK_T": 16, "SPLIT_K_DOT": 2}),
}
N, K = 40, 136


SCRATCH_SEEN: dict = {}       # the last _case's scratch (the narrow codes path's slots are checked)


def _case(template, s, mode, T, tune, phase, seed, narrow=False, out_dtype="bf16"):
    """Render, run and check one launch; returns the kernel."""
    gen = np.random.default_rng(seed)
    stem, op, a_mult, w_mult = MODES[mode]
    n_out = N // 2 if mode == "gated" else N
    w, values, comp = quantized_weight(s, n_out * w_mult, K, gen)
    attrs = _attrs(s, **({"fn": "silu"} if mode in ("act_mul", "gated") else {}))
    ins, arrays = [("x", ["T", K * a_mult], "bf16")], [rand((T, K * a_mult), gen=gen, scale=1.5)]
    outs = [("y", ["T", n_out], out_dtype)]
    pro = None
    if mode == "prologue":
        ins += [("d", ["T", K], "bf16"), ("norm", [K], "bf16", "weight")]
        arrays += [rand((T, K), gen=gen, scale=0.5), rand((K,), gen=gen, scale=0.3)]
        outs.insert(0, ("res", ["T", K], "bf16"))
        pro = PROLOGUE
    ins += [("w", [n_out * w_mult, K], s.codes, "weight")] + _specs(comp)
    arrays += [w] + _tensors(comp)
    k = render(template + stem, op, ins, outs, attrs=attrs, phase=phase, tune=tune, narrow=narrow, prologue=pro)
    ys = [poison((T, K)) if mode == "prologue" else None, poison((T, n_out), out_dtype)]
    out = {f"out:{i}": y for i, y in enumerate(y for y in ys if y is not None)}
    scratch = run(k, {f"in:{i}": a for i, a in enumerate(arrays)} | out, {"T": T, "B": 1})
    check_scratch_zero(scratch)
    SCRATCH_SEEN["last"] = scratch
    # the A operand as the kernels (and the unfused model) hold it, in bf16, before it is quantized:
    # a rounding after the activation quantizer's would move e4m3 codes by a whole step
    x = f32(arrays[0])
    if mode == "prologue":
        # add_rms_norm's roundings with a bf16 norm weight (triton/_norm.j2): s and s * rstd in bf16
        r = bf16(x + f32(arrays[1]))
        x = bf16(bf16(r / np.sqrt(np.mean(r * r, -1, keepdims=True) + EPS)) * f32(arrays[2]))
    if mode == "act_mul":
        x, op, attrs = bf16(REGISTRY["act_mul"].reference(None, x, "silu")), "linear", _attrs(s)
    want = REGISTRY[op].reference(None, x, values, *comp.values(), **attrs)
    got = f32(list(out.values())[-1])
    assert rel_err(got, want) <= TOL
    return k, got, want


def _matrix(fast: set, *axes) -> list:
    """The cross product of the axes (lists of names), rows in `fast` unmarked, the rest
    exhaustive (tests/exhaustive.py)."""
    return [pytest.param(*row, id="-".join(row), marks=() if row in fast else EXHAUSTIVE)
            for row in itertools.product(*axes)]


NAMES = list(SCHEMES)
GEMV_MODES = ["plain", "act_mul", "gated"]
FMA_PATHS = [p for p in GEMV_PATHS if p.startswith("fma")]
DOT_PATHS = [p for p in GEMV_PATHS if p.startswith("dot")]
# fast: every scheme once on the CUDA-core path and once on the tensor-core path (their tiles
# take the scales in different forms), every mode on both paths, both paths split
GEMV_FAST = {(n, GEMV_MODES[j % 3], FMA_PATHS[j % 3]) for j, n in enumerate(NAMES)} \
    | {(n, GEMV_MODES[(j + 1) % 3], DOT_PATHS[j % 2]) for j, n in enumerate(NAMES)} \
    | {("u4-g32-zero", "plain", "fma-split3"), ("u8-g64", "gated", "fma-split3")}


@pytest.mark.parametrize("scheme,mode,path", _matrix(GEMV_FAST, NAMES, GEMV_MODES, list(GEMV_PATHS)))
def test_quantized_gemv(scheme, mode, path):
    T, tune = GEMV_PATHS[path]
    _case("gemv", SCHEMES[scheme], mode, T, tune, "decode", zlib.crc32(f"{scheme}{mode}{path}".encode()))


# the narrow phase's merged add_rms_norm (the CUDA-core path alone): fast, the activation
# quantizers that read h (per group; per token, whose row pass rebuilds h) and a packed W with
# zero points, split so that a preloaded tile lies past its split's K range (it must read zeros)
PROLOGUE_FAST = {("fp8-32x64-group64", "fma"), ("fp8-channel-token", "fma-rows"), ("u4-g32-zero", "fma-split")}


@pytest.mark.parametrize("scheme,path", _matrix(PROLOGUE_FAST, NAMES, FMA_PATHS))
def test_quantized_gemv_with_add_rms_norm_prologue(scheme, path):
    _case("gemv", SCHEMES[scheme], "prologue", 1, GEMV_PATHS[path][1], "decode",
          zlib.crc32(f"{scheme}{path}".encode()), narrow=True)


# GEMM tilings: 64-deep K steps (the fp8 scheme's W8A8 codes form), then split-K
GEMM_TUNES = {"tiles": {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "GROUP_M": 2},
              "split": {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 64, "SPLIT_K": 3, "TARGET_CTAS": 1000}}
GEMM_FAST = {(n, GEMV_MODES[j % 3], list(GEMM_TUNES)[j % 2]) for j, n in enumerate(NAMES)}


@pytest.mark.parametrize("scheme,mode,tiling", _matrix(GEMM_FAST, NAMES, GEMV_MODES, list(GEMM_TUNES)))
def test_quantized_gemm(scheme, mode, tiling):
    s = SCHEMES[scheme]
    k, _, _ = _case("gemm", s, mode, 37, GEMM_TUNES[tiling], "prefill", zlib.crc32(f"{scheme}{mode}{tiling}".encode()))
    assert ("_a_codes" in k.source) == (s.codes == "f8e4m3" and s.act != "none")


def test_fp8_codes_dot_is_the_definition():
    """The W8A8 form (e4m3 x e4m3 dots, the interpreter runs them exactly through fp16, scaled per
    K step) with f32 outputs equals the definition to fp32 summation order: every activation code
    the kernel rounds is the oracle's (one code off by an e4m3 step moves the sums by ~1e-3)."""
    s = SCHEMES["fp8-32x64-group64"]
    for template, T, tune, phase in [("gemm", 37, GEMM_TUNES["tiles"], "prefill"),
                                     ("gemv", 5, GEMV_PATHS["dot"][1], "decode")]:
        k, got, want = _case(template, s, "plain", T, tune, phase, 7, out_dtype="f32")
        assert "tl.dot(raw" in k.source or "tl.dot(ac" in k.source
        assert rel_err(got, want) <= 2e-6


def test_quantized_tiles_hold_whole_activation_groups():
    s = QuantScheme("f8e4m3", 128, 128, act="dynamic_group", act_group=128)
    ins = [("x", ["T", 512], "bf16"), ("w", [256, 512], "f8e4m3", "weight"), ("w_scale", [2, 4], "f32", "weight")]
    outs = [("y", ["T", 256], "bf16")]
    k = render("gemv", "linear", ins, outs, attrs=_attrs(s))
    assert k.meta["constexprs"]["BLOCK_K"] == 128 and k.meta["constexprs"]["FMA_BLOCK_K"] % 128 == 0
    assert render("gemm", "linear", ins, outs, attrs=_attrs(s), phase="prefill").meta["constexprs"]["BLOCK_K"] == 128
    with pytest.raises(TemplateError, match="multiples_of_act_group"):
        render("gemv", "linear", ins, outs, attrs=_attrs(s), tune={"FMA_BLOCK_K": 64})
    with pytest.raises(TemplateError, match="multiple_of_act_group"):
        render("gemm", "linear", ins, outs, attrs=_attrs(s), phase="prefill", tune={"BLOCK_K": 64})


def test_bf16_dequantized_form_is_close_to_the_definition():
    """The bf16 operands of the dequantized form round W once (2^-9): well inside TOL."""
    s = SCHEMES["u4-g32-zero"]
    _, got, want = _case("gemm", s, "plain", 37, GEMM_TUNES["tiles"], "prefill", 3, out_dtype="f32")
    assert rel_err(got, want) <= 5e-3
    assert rel_err(bf16(got), want) <= TOL


def test_lm_head_last_refuses_a_quantized_weight():
    """fuse_lm_head leaves quantized linears alone; a launch that still got here fails by name."""
    s = SCHEMES["fp8-32x64-group64"]
    # said as words (compiler/codegen/render.py), the name kept for grep
    with pytest.raises(TemplateError, match="the kernel refuses this launch: lm head last takes no quantized "
                                            r"weight .*\(lm_head_last_takes_no_quantized_weight"):
        render("lm_head_last", "lm_head_last", [("x", ["T", 64], "bf16"), ("norm", [64], "bf16", "weight"),
                                                ("w", [100, 64], "f8e4m3", "weight"),
                                                ("w_scale", [4, 1], "f32", "weight")],
               [("logits", ["B", 100], "f32")], attrs=_attrs(s, eps=1e-6, residual=False))


@pytest.mark.parametrize("phase,rows", [("prefill", 4096), ("prefill", 1024), ("wide", 1024)])
def test_quantized_gemm_defaults_fit_sm90(phase, rows):
    """128-deep fp8 steps: the default pipeline keeps within 160 KB of stages (8 stages of the wide
    decode tiles would need 256 KB, past sm_90's 227 KB), and the prefill's W8A8 tile is 128 wide
    (its fp32 partial tile beside the accumulator spills at 256)."""
    s = QuantScheme("f8e4m3", 128, 128, act="dynamic_group", act_group=128)
    k = render("gemm", "linear", [("x", ["T", 2560], "bf16"), ("w", [rows, 2560], "f8e4m3", "weight"),
                                  ("w_scale", [rows // 128, 20], "f32", "weight")],
               [("y", ["T", rows], "bf16")], attrs=_attrs(s), phase=phase)
    c = k.meta["constexprs"]
    assert c["BLOCK_K"] == 128 and c["BLOCK_N"] == 128
    assert 2 <= k.meta["num_stages"] and (c["BLOCK_M"] * 128 * 2 + c["BLOCK_N"] * 128) * k.meta["num_stages"] <= 160 * 1024


# the narrow codes path (triton/_gemv_narrow_codes.j2): a narrow step's fp8 launch with quantized
# activations dots e4m3 codes on tensor cores after making A's codes once a program. Each
# activation quantizer, plain / gated / the merged add_rms_norm prologue, with and without split-K
# (a split's K range starts inside the row: its codes slot must hold that range's groups alone)
# the dot form of the narrow codes path (FP8_FORM "dot"; "fma", the default, has its own tests:
# tests/kernels/test_fp8_fma_form.py)
NARROW_CODES = {"one": {"BLOCK_N": 16, "FP8_FORM": "dot"}, "split": {"BLOCK_N": 32, "SPLIT_K": 2, "FP8_FORM": "dot"},
                "passes": {"BLOCK_N": 16, "CODE_GROUPS": 2, "FP8_FORM": "dot"}}      # 3 groups of 64 in two passes
NARROW_FAST = {("fp8-32x64-group64", "prologue", "split"), ("fp8-channel-token", "gated", "one"),
               ("fp8-32x64-group64", "plain", "passes"),
               ("fp8-tensor-static", "plain", "split"), ("fp8-32x64-group64", "gated", "one")}


@pytest.mark.parametrize("scheme,mode,tiling", _matrix(
    NARROW_FAST, ["fp8-32x64-group64", "fp8-channel-token", "fp8-tensor-static"],
    ["plain", "gated", "prologue"], list(NARROW_CODES)))
def test_narrow_codes_path(scheme, mode, tiling):
    k, got, want = _case("gemv", SCHEMES[scheme], mode, 1, NARROW_CODES[tiling], "decode",
                         zlib.crc32(f"narrow{scheme}{mode}{tiling}".encode()), narrow=True, out_dtype="f32")
    assert "scratch:actq" in [p[2] for p in k.meta["params"]] and "tl.dot(raw, tl.trans(ac))" in k.source
    # every code byte a W tile dots was written (zeros past K): the scratch starts as 0xFF, e4m3's
    # NaN, which the interpreter's dots read as a number but the GPU's as NaN (NaN x 0 is NaN)
    c = k.meta["constexprs"]
    slot_bytes = SCRATCH_SEEN["last"]["actq"].numpy().view(np.uint8)
    splits = NARROW_CODES[tiling].get("SPLIT_K", 1)
    chunk = -(-(-(-K // splits)) // c["BLOCK_K"]) * c["BLOCK_K"]
    slot = (4 * (chunk // c["BLOCK_K"]) + chunk + 15) // 16 * 16
    for p in range(-(-N // c["BLOCK_N"]) * splits):
        k_lo = (p % splits) * chunk
        used = -(-(min(K, k_lo + chunk) - k_lo) // c["BLOCK_K"]) * c["BLOCK_K"]
        codes = slot_bytes[p * slot + 4 * (chunk // c["BLOCK_K"]):][:used]
        assert not (codes == 0xFF).any(), f"program {p}: unwritten codes in its slot"
    # the codes are the oracle's: fp32 summation order alone (gated rounds act(g) and u to bf16)
    assert rel_err(got, want) <= (TOL if mode == "gated" else 2e-6)


def test_narrow_codes_path_is_the_fp8_codes_form_only():
    """Weight-only schemes, and NARROW_DOT = 0, keep the CUDA-core path in a narrow step."""
    for scheme, tune in [("fp8-16x32-weights", {}), ("u4-g32-zero", {}), ("fp8-32x64-group64", {"NARROW_DOT": 0})]:
        k, _, _ = _case("gemv", SCHEMES[scheme], "plain", 1, tune, "decode", 5, narrow=True)
        assert "scratch:actq" not in [p[2] for p in k.meta["params"]], scheme


# W4_FORM (triton/_gemv_w4.j2): the CUDA-core path's loops for u4 codes. groupsum is the default
# (the cases above run it wherever a u4 weight takes the CUDA-core path without g_idx); here each
# form once more on what the others leave out: the per-row scale of a tile inside one group
# (symmetric g64 over 64-column tiles), FMA_T rows, the dot form's padded A rows, its merged
# prologue and split, and the elementwise loop kept on request
W4_CASES = {
    "groupsum-g64-tile-in-group": ("groupsum", QuantScheme("u4", 1, 64), "plain", 1, {"BLOCK_N": 64, "FMA_BLOCK_K": 64}, False),
    "groupsum-rows-gated": ("groupsum", SCHEMES["u4-g32-zero"], "gated", 2,
                            {"BLOCK_N": 64, "FMA_BLOCK_K": 128, "FMA_T": 2, "BLOCK_T": 16}, False),
    "dot-zero-gated": ("dot", SCHEMES["u4-g32-zero"], "gated", 1, {"BLOCK_N": 16}, False),
    "dot-rows-act_mul": ("dot", QuantScheme("u4", 1, 64), "act_mul", 3, {"BLOCK_N": 16, "FMA_T": 4, "BLOCK_T": 16}, False),
    "dot-prologue-split": ("dot", QuantScheme("u4", 1, 64), "prologue", 1, {"BLOCK_N": 32, "SPLIT_K": 2}, True),
    # 128-column tiles: the dot form reads words, a dot a code phase (the tail tile ragged)
    "dot-words-zero-prologue": ("dot", QuantScheme("u4", 1, 128, zeros=True), "prologue", 1, {"BLOCK_N": 16}, True),
    "dot-words-rows-gated": ("dot", QuantScheme("u4", 1, None), "gated", 3, {"BLOCK_N": 32, "FMA_T": 4, "BLOCK_T": 16}, False),
    "elementwise-zero": ("elementwise", SCHEMES["u4-g32-zero"], "plain", 1, {"BLOCK_N": 16, "FMA_BLOCK_K": 64}, False),
}
W4_FAST = {"groupsum-g64-tile-in-group", "groupsum-rows-gated", "dot-zero-gated", "dot-words-zero-prologue"}
W4_SIGN = {"groupsum": "acc0 += t0 * s", "dot": "tl.trans(a_", "elementwise": "_w_deq_unmasked(_w_raw"}


@pytest.mark.parametrize("case", [pytest.param(c, marks=() if c in W4_FAST else EXHAUSTIVE) for c in W4_CASES])
def test_w4_forms(case):
    form, s, mode, T, tune, narrow = W4_CASES[case]
    k, got, want = _case("gemv", s, mode, T, {**tune, "W4_FORM": form}, "decode", zlib.crc32(case.encode()),
                         narrow=narrow, out_dtype="f32")
    assert all((sign in k.source) == (f == form) for f, sign in W4_SIGN.items()), case
    assert ("a_pad" in k.source) == (case.startswith("dot-words")), case
    # exact (c - z) and exact products: the definition to fp32 summation order (gated rounds
    # act(g) and u to bf16)
    assert rel_err(got, want) <= (TOL if mode == "gated" else 2e-6)


def test_w4_form_choice():
    """groupsum by default; act-order g_idx keeps the elementwise loop (a group a column: a word's
    eight codes may lie in eight groups); a dot tile that would straddle groups takes groupsum;
    an unknown form fails by name; fp8 renders as before."""
    def source(scheme, tune, k=256):
        s = SCHEMES[scheme] if isinstance(scheme, str) else scheme
        comp = quantized_weight(s, 64, k, np.random.default_rng(0))[2]
        ins = [("x", ["T", k], "bf16"), ("w", [64, k], s.codes, "weight")] + _specs(comp)
        return render("gemv", "linear", ins, [("y", ["T", 64], "bf16")], attrs=_attrs(s), tune=tune, narrow=True).source
    assert W4_SIGN["groupsum"] in source("u4-g32-zero", {})
    assert W4_SIGN["elementwise"] in source("u4-g128-act-order", {"W4_FORM": "dot"})
    assert W4_SIGN["groupsum"] in source("u4-g32-zero", {"W4_FORM": "dot", "FMA_BLOCK_K": 64})
    assert W4_SIGN["dot"] in source("u4-g32-zero", {"W4_FORM": "dot"})
    assert W4_SIGN["elementwise"] in source(QuantScheme("u4", 1, 4), {}, k=64)     # groups split a word
    with pytest.raises(TemplateError, match="W4_FORM"):
        source("u4-g32-zero", {"W4_FORM": "lut"})
    assert "_w_codes_f32" not in source("fp8-16x32-weights", {"W4_FORM": "groupsum"})
