"""Quantized weights on the GPU without a GPU (tests/fake_cuda.py: device memory is host bytes).

Loading: the device bytes of every weight equal to_storage(the numpy loader's value) (codes
packed to their storage dtype, scales f32, group indices i32), whether the fp8 codes stream
straight from the file (the _runs fast path, NaN codes refused on the way) or are built on the
host (other recipes, other code dtypes).
--load-format dummy: every quantized weight is filled by its kind's kernel, run by the
interpreter, into valid codes (to_storage round-trips them: no e4m3 NaN), positive scales,
zero points inside the code range and k // block_k group indices; the CPU backend's dummy
weights are the same values.
"""
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from infc.compiler.build import compile_model
from infc.compiler.contract.errors import ModelDirError
from infc.compiler.contract.safetensors_io import Checkpoint, f32_to_bf16_bits
from infc.compiler.contract.schema import nbytes
from infc.compiler.contract.weight_roles import quant_roles
from infc.runtime.cuda import weights as dw
from infc.runtime.weights import dummy as dwv
from infc.runtime.weights.load import iter_weights
from infc.runtime.weights.quant_pack import E2M1, to_storage

from fake_cuda import FakeContext
from test_device_weights import model
from test_dummy_weights import fill_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
from quantize_model import quantize_model, write_safetensors  # noqa: E402

BLOCK = (16, 48)            # K = 64 and 96: groups that do not divide K


def storage(w: dict, a: np.ndarray) -> bytes:
    """The bytes a device weight of plan dtype w["dtype"] holds for the numpy loader's value."""
    if w["dtype"] == "bf16":
        return f32_to_bf16_bits(a).tobytes()
    if w["dtype"] == "f32":
        return np.asarray(a, np.float32).tobytes()
    if w["dtype"] == "i32":
        return np.asarray(a, np.int32).tobytes()
    return to_storage(a, w["dtype"]).tobytes()


def device_equals_numpy(ctx, w, plan, ckpt) -> int:
    seen = 0
    for name, layer, a in iter_weights(plan, ckpt):
        if isinstance(a, str):
            assert w.ptrs[name] == w.ptrs[a]
            continue
        want = storage(plan["weights"][name], a)
        ptr = w.ptr(name, layer)
        assert ptr % dw.ALIGN == 0
        assert ctx.read(ptr, len(want)) == want, (name, layer)
        seen += len(want)
    return seen


@pytest.fixture(scope="module")
def fp8_model(tmp_path_factory):
    src, out = tmp_path_factory.mktemp("bf16"), tmp_path_factory.mktemp("fp8")
    model(src, "qwen3")
    quantize_model(src, out, "fp8-block", block=BLOCK)
    _, plan = compile_model(model_dir=str(out))
    return out, plan


def test_fp8_checkpoint_streams_its_codes(fp8_model, monkeypatch):
    """A Qwen-style fp8 checkpoint: codes (fused q|k|v and gate|up included) stream from the file
    through tiny staging buffers, scales are built as f32; bytes equal the numpy loader's."""
    d, plan = fp8_model
    assert {w["dtype"] for w in plan["weights"].values()} == {"bf16", "f8e4m3", "f32"}
    monkeypatch.setattr(dw, "STAGING", 4096)
    monkeypatch.setattr(dw, "PIECE", 1000)
    built = []
    real = dw._built
    monkeypatch.setattr(dw, "_built", lambda w, a: built.append(w["dtype"]) or real(w, a))
    ctx = FakeContext()
    w = dw.DeviceWeights(ctx, plan, d, progress=False, threads=3)
    assert "f8e4m3" not in built and "f32" in built       # codes streamed, scales built
    seen = device_equals_numpy(ctx, w, plan, Checkpoint(d))
    assert seen == w.bytes == sum(nbytes(x["dtype"], x["shape"]) * len(x["layers"] or [0])
                                  for x in plan["weights"].values() if "tied" not in x["source"])
    assert ctx.pinned_live == []


def test_a_nan_code_in_the_file_is_refused(fp8_model, tmp_path):
    d, plan = fp8_model
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in d.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    ckpt = Checkpoint(bad)
    name = "model.layers.1.mlp.down_proj.weight"
    f, _, off, n = ckpt.locate(name)
    ckpt.close()
    with open(f.path, "r+b") as fh:
        fh.seek(off + n // 2)
        fh.write(b"\xff")
    with pytest.raises(ModelDirError, match=f"'{name}' holds NaN codes"):
        dw.DeviceWeights(FakeContext(), plan, bad, progress=False)


def test_every_code_dtype_built_on_the_host(tmp_path):
    """Recipes the loader cannot stream (fp8 concatenated along K; integer and fp4 codes, group
    indices, per-tensor scales repeated per row) are built in the canonical form and packed:
    u4 / e2m1 two codes a byte (odd rows, K = 10 and 6), the device bytes equal to_storage."""
    rng = np.random.default_rng(0)
    e4m3 = lambda shape: rng.integers(0, 0x7F, shape).astype(np.uint8) | (rng.integers(0, 2, shape) << 7).astype(np.uint8)
    t = {"a": ("F8_E4M3", e4m3((5, 4))), "b": ("F8_E4M3", e4m3((5, 6))),
         "c8": ("F32", rng.integers(0, 256, (3, 7)).astype(np.float32)),
         "c4": ("F32", rng.integers(0, 16, (5, 10)).astype(np.float32)),
         "cf4": ("F32", E2M1[rng.integers(0, 16, (3, 6))]),
         "g": ("I32", (np.arange(10) // 4).astype(np.int32)),
         "s": ("F32", np.array([0.25], np.float32))}
    write_safetensors(tmp_path / "model.safetensors", t)
    src = lambda name: {"tensor": name}
    plan = {"weights": {
        "f8cat": {"shape": [5, 10], "dtype": "f8e4m3", "layers": None,
                  "source": {"concat": [{"fp8": "a"}, {"fp8": "b"}], "axis": 1}},
        "f8": {"shape": [5, 4], "dtype": "f8e4m3", "layers": None, "source": {"fp8": "a"}},
        "c8": {"shape": [3, 7], "dtype": "u8", "layers": None, "source": src("c8")},
        "c4": {"shape": [5, 10], "dtype": "u4", "layers": None, "source": src("c4")},
        "cf4": {"shape": [3, 6], "dtype": "e2m1", "layers": None, "source": src("cf4")},
        "g": {"shape": [10], "dtype": "i32", "layers": None, "source": src("g")},
        "s": {"shape": [3, 1], "dtype": "f32", "layers": None, "source": {"rows": src("s"), "count": 3}}}}
    ctx = FakeContext()
    w = dw.DeviceWeights(ctx, plan, tmp_path, progress=False)
    assert device_equals_numpy(ctx, w, plan, Checkpoint(tmp_path)) == w.bytes == 50 + 20 + 21 + 25 + 9 + 40 + 12
    assert ctx.read(w.ptr("f8", None), 20) == t["a"][1].tobytes()      # e4m3 bytes as in the file
    assert ctx.read(w.ptr("c4", None), 1) == bytes([int(t["c4"][1][0, 0]) | int(t["c4"][1][0, 1]) << 4])
    bad = {"weights": {"c4": {**plan["weights"]["c4"], "source": src("c8")}}}   # 0..255 is no u4 code
    bad["weights"]["c4"]["shape"] = [3, 7]
    with pytest.raises(ModelDirError, match=r"weight 'c4' \(c8\) as u4: u4 codes must be integers in \[0, 15\]"):
        dw.DeviceWeights(FakeContext(), bad, tmp_path, progress=False)


def test_mxfp4_scales_must_be_powers_of_two():
    """The fp4 experts' decode kernels take a scale as its e8m0 exponent byte: every e8m0 value
    (2^-127 a subnormal) loads, a float scale between two powers is refused naming the weight;
    other formats' scales stay any float."""
    mx = ("w_scale", {"codes": "e2m1", "block_k": 32}, "we_down")
    dw._check_mx_scale(mx, np.ldexp(np.float32(1), np.arange(-127, 128)).astype(np.float32), "w")
    with pytest.raises(ModelDirError, match="weight 'we_down_qscale'.* not powers of two"):
        dw._check_mx_scale(mx, np.array([0.25, 0.75], np.float32), "weight 'we_down_qscale'")
    dw._check_mx_scale(("w_scale", {"codes": "u4", "block_k": 32}, "w"), np.array([0.75], np.float32), "w")
    dw._check_mx_scale(("codes", {"codes": "e2m1", "block_k": 32}, "w"), np.array([0.75], np.float32), "w")


# ---- --load-format dummy ----
SCHEMES = {   # a quantized linear's scheme per code dtype, as compiler/quant/scheme.py writes it
    "f8e4m3": dict(codes="f8e4m3", block_n=16, block_k=48, zeros=False, g_idx=False, act="static", act_group=None),
    "u4": dict(codes="u4", block_n=1, block_k=32, zeros=True, g_idx=True, act="none", act_group=None),
    "u8": dict(codes="u8", block_n=1, block_k=None, zeros=False, g_idx=False, act="none", act_group=None),
    "e2m1": dict(codes="e2m1", block_n=1, block_k=32, zeros=False, g_idx=False, act="none", act_group=None),
}


def quant_plan() -> dict:
    """A plan of one quantized linear per code dtype (N = 20, K = 70: neither a tile nor a group
    multiple), with the companions each scheme has, and one bf16 weight."""
    weights, launches = {"x": {"shape": [5, 70], "dtype": "bf16", "layers": None, "source": {"tensor": "x"}}}, []
    for codes, s in SCHEMES.items():
        w = f"w_{codes}"
        weights[w] = {"shape": [20, 70], "dtype": codes, "layers": [0, 1], "source": {"tensor": w}}
        comps = {"w_scale": ([-(-20 // s["block_n"]), 1 if s["block_k"] is None else -(-70 // s["block_k"])], "f32"),
                 "w_zero": None, "w_gidx": ([70], "i32"), "x_scale": ([1], "f32")}
        comps["w_zero"] = comps["w_scale"]
        names = [c for c, on in (("w_scale", True), ("w_zero", s["zeros"]), ("w_gidx", s["g_idx"]),
                                 ("x_scale", s["act"] == "static")) if on]
        for c in names:
            shape, dtype = comps[c]
            weights[f"{w}_{c}"] = {"shape": shape, "dtype": dtype, "layers": [0, 1], "source": {"tensor": c}}
        launches.append({"op": "linear", "inputs": ["h", w] + [f"{w}_{c}" for c in names], "outputs": ["y"],
                         "attrs": {"quant": s, "has_bias": False, **{f"has_{c}": True for c in names}}})
    return {"weights": weights, "programs": {"decode": launches}}


def test_dummy_fills_valid_quantized_weights(tmp_path, fake_driver):
    """Each kind's kernel runs under the interpreter on the fake device; the regions hold what the
    CPU backend loads (dummy_weights), as valid storage: to_storage of those values gives the
    device bytes back (an e4m3 NaN or an out-of-range code would not encode)."""
    from infc.compiler.codegen.render import render_weight_init
    from infc.compiler.contract.weight_roles import fill_kinds
    plan = quant_plan()
    kinds = fill_kinds(plan)
    assert kinds == ["bf16", "bytes", "f32", "f8e4m3", "index", "round"]
    for kind in kinds:
        render_weight_init(plan, kind=kind)
    assert len({plan[k] for k in plan if k.startswith("weight_init")}) == len(kinds)   # one kernel a kind
    ctx = fake_driver.Context()
    fills = {kind: fill_kernel(fake_driver, kind) for kind in kinds}
    w = dw.DeviceWeights(ctx, plan, tmp_path, progress=False, load_format="dummy", fill=fills)
    cpu = dwv.dummy_weights(plan)
    roles = quant_roles(plan)
    for name, spec in plan["weights"].items():
        for i, layer in enumerate(spec["layers"] or [None]):
            a = cpu[name] if spec["layers"] is None else cpu[name][i]
            want = storage(spec, a)
            assert ctx.read(w.ptr(name, layer), len(want)) == want, (name, layer)
            role = roles.get(name, ("plain",))[0]
            s = roles[name][1] if name in roles else None
            if role == "w_scale":          # positive, and W = code * scale has the bf16 rule's RMS
                assert (a > 0).all()
                if s["codes"] == "e2m1":       # MX scales are e8m0's: powers of two
                    assert (np.frexp(a)[0] == 0.5).all(), name
                codes = cpu[roles[name][2]][i]
                zero = 8.0 if s["codes"] == "u4" else 128.0 if s["codes"] == "u8" else 0.0
                rms = math.sqrt(np.mean(np.square(codes - zero))) * float(a.mean())
                assert 0.01 < rms < 0.04, (name, rms)
            elif role == "w_zero":
                assert a.min() >= 0 and a.max() <= 15 and (a == np.round(a)).all() and len(np.unique(a)) > 2
            elif role == "w_gidx":
                assert np.array_equal(a, np.arange(70) // s["block_k"])
            elif role == "x_scale":
                assert 0.015 < float(a[0]) < 0.025
            elif role == "codes":
                assert len(np.unique(a)) >= {"u4": 16, "e2m1": 15}.get(s["codes"], 100), name
    for kind in kinds:           # every region of a kind written by that kind's kernel
        assert any(launch.fn is fills[kind].fn for launch in fake_driver.launches), kind
    assert w.bytes == sum(nbytes(x["dtype"], x["shape"]) * len(x["layers"] or [0]) for x in plan["weights"].values())


def test_dummy_fp8_model_needs_its_fill_kernels(tmp_path):
    """A config-only Qwen3-FP8 directory: its plan asks for the e4m3 and f32 fills besides bf16;
    an artifact without them is refused naming the plan key."""
    d = tmp_path / "m"
    d.mkdir()
    from test_dummy_weights import TINY
    cfg = {**TINY, "architectures": ["Qwen3ForCausalLM"],
           "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                   "weight_block_size": list(BLOCK)}}
    (d / "config.json").write_text(json.dumps(cfg))
    _, plan = compile_model(model_dir=str(d), check_checkpoint=False)
    from infc.compiler.contract.weight_roles import fill_kinds
    assert fill_kinds(plan) == ["bf16", "f32", "f8e4m3"]
    with pytest.raises(ModelDirError, match=r"f8e4m3 weight fill kernel \(plan\['weight_init_f8e4m3'\]\)"):
        dw.DeviceWeights(FakeContext(), plan, d, load_format="dummy", fill={"bf16": object(), "f32": object()})


def test_dummy_quantized_model_keeps_activations_bounded(tmp_path):
    """The CPU backend on the dummy weights of a config-only fp8 directory: the same logit scale as
    the bf16 model's dummy weights (the w_scale rule gives W the bf16 rule's RMS), finite, and
    `LLM(load_format="dummy")` generates from it."""
    from infc import LLM, SamplingParams
    from infc.runtime.engine.step import Chunk
    from infc.runtime.reference.executor import ReferenceExecutor
    from test_dummy_weights import TINY, config_only
    q = {"quant_method": "fp8", "weight_block_size": list(BLOCK)}
    stds = []
    for name, over in (("bf16", {}), ("fp8", {"quantization_config": q})):
        d = config_only(tmp_path / name, num_hidden_layers=6, **over)
        _, plan = compile_model(model_dir=str(d), check_checkpoint=False)
        logits = ReferenceExecutor(plan, dwv.dummy_weights(plan)).step([Chunk(0, list(range(1, 40)), 0)])
        assert np.isfinite(logits).all()
        stds.append(float(logits.std()))
    assert 0.5 < stds[1] / stds[0] < 2, stds
    out = LLM(tmp_path / "fp8", device="cpu", load_format="dummy").generate(
        [[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].token_ids) == 4 and all(0 <= t < TINY["vocab_size"] for t in out[0].token_ids)
