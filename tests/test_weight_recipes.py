"""runtime/weights/recipes.py: every recipe of plan contract 2 on a hand-written checkpoint.

The numpy loader (runtime/weights/load.py, float32) must build what the recipe says, and the device
loader (runtime/cuda/weights.py, on a fake device) must hold exactly those values rounded once to
bf16, byte for byte: through its pread fast path for plain bf16 runs (tensor, stack, axis-0
concat, row slices) and through the registry for the rest. Per-layer weights exist for their
`layers` only and are found by global layer index."""
import json
import struct

import numpy as np

import pytest

from infc.compiler.contract.errors import ModelDirError
from infc.runtime.cuda import weights as dw
from infc.compiler.contract.safetensors_io import Checkpoint, f32_to_bf16_bits
from infc.runtime.weights.recipes import RECIPES, build
from infc.runtime.weights.load import at, iter_weights, load_weights

from fake_cuda import FakeContext


def _bf16(x):
    return (f32_to_bf16_bits(x).astype(np.uint32) << 16).view(np.float32)


def write_checkpoint(d, tensors: dict):
    """tensors: name -> (float32 array, "BF16" | "F32"), split over two shards with an index."""
    names = sorted(tensors)
    shards = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    index = {}
    for fname, group in shards.items():
        header, blobs, pos = {}, [], 0
        for n in group:
            x, dt = tensors[n]
            raw = f32_to_bf16_bits(x).tobytes() if dt == "BF16" else np.ascontiguousarray(x, np.float32).tobytes()
            header[n] = {"dtype": dt, "shape": list(x.shape), "data_offsets": [pos, pos + len(raw)]}
            blobs.append(raw)
            pos += len(raw)
            index[n] = fname
        h = json.dumps(header).encode()
        (d / fname).write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))


@pytest.fixture
def ckpt_dir(tmp_path):
    rng = np.random.default_rng(3)
    t = {}
    for i in range(3):
        t[f"l.{i}.q"] = (_bf16(rng.standard_normal((6, 4))), "BF16")
        t[f"l.{i}.k"] = (_bf16(rng.standard_normal((2, 4))), "BF16")
        t[f"l.{i}.qkv"] = (_bf16(rng.standard_normal((10, 4))), "BF16")       # fused in the checkpoint
        t[f"l.{i}.norm"] = (_bf16(rng.standard_normal(4)), "BF16")
        t[f"l.{i}.f32"] = (rng.standard_normal((5, 3)).astype(np.float32), "F32")
        for e in range(3):
            t[f"l.{i}.e.{e}"] = (_bf16(rng.standard_normal((2, 4))), "BF16")
    t["embed"] = (_bf16(rng.standard_normal((7, 4))), "BF16")
    write_checkpoint(tmp_path, t)
    return tmp_path, {n: x for n, (x, _) in t.items()}


def W(shape, source, layers=(0, 1, 2), dtype="bf16"):
    return {"shape": list(shape), "dtype": dtype, "layers": None if layers is None else list(layers),
            "source": source}


T = {"tensor": "l.{i}.q"}
PLAN = {"weights": {
    "embed": W([7, 4], {"tensor": "embed"}, None),
    "lm_head": W([7, 4], {"tied": "embed"}, None),
    "wq": W([6, 4], T),
    "experts": W([3, 2, 4], {"stack": "l.{i}.e.{e}", "count": 3}),
    "wqk": W([8, 4], {"concat": [T, {"tensor": "l.{i}.k"}], "axis": 0}),
    "wqk_cols": W([6, 8], {"concat": [T, {"tensor": "l.{i}.q"}], "axis": 1}),
    "wk_rows": W([3, 4], {"slice": {"tensor": "l.{i}.qkv"}, "axis": 0, "start": 6, "stop": 9}),
    "wq_cols": W([10, 2], {"slice": {"tensor": "l.{i}.qkv"}, "axis": 1, "start": 1, "stop": 3}),
    "wqT": W([4, 6], {"transpose": T}),
    "wq_scaled": W([6, 4], {"scale": T, "by": 0.125}),
    "norm1p": W([4], {"offset": {"tensor": "l.{i}.norm"}, "by": 1.0}),
    "bias_qk": W([8], {"concat": [{"zeros": [6]}, {"slice": {"tensor": "l.{i}.norm"}, "axis": 0,
                                                  "start": 2, "stop": 4}], "axis": 0}),
    "f32_rows": W([2, 3], {"slice": {"tensor": "l.{i}.f32"}, "axis": 0, "start": 1, "stop": 3}),
    # Qwen3.5's: q_proj rows interleaved per head (rows 1:3 of each of 2 groups of 5), a conv
    # weight read in another shape, A = -exp(A_log)
    "qkv_grouped": W([4, 4], {"slice": {"tensor": "l.{i}.qkv"}, "axis": 0, "start": 1, "stop": 3,
                              "groups": 2}),
    "norm_2d": W([2, 2], {"reshape": {"tensor": "l.{i}.norm"}, "from": [4], "to": [2, 2]}),
    "neg_exp": W([4], {"scale": {"exp": {"tensor": "l.{i}.norm"}}, "by": -1.0}),
    # f32 weights (a spec's `dtype: f32`: Qwen3.5's A and dt_bias): exp and scale computed in
    # float32 and kept so on the device, a plain bf16 tensor widened to float32
    "neg_exp_f32": W([4], {"scale": {"exp": {"tensor": "l.{i}.norm"}}, "by": -1.0}, dtype="f32"),
    "norm_f32": W([4], {"tensor": "l.{i}.norm"}, dtype="f32"),
    "only_odd": W([6, 4], T, layers=[1]),                      # a weight of one layer kind
    "sparse": W([2, 4], {"tensor": "l.{i}.k"}, layers=[0, 2]),
    # written by the plan's load program (no checkpoint tensor): the numpy loader's zeros
    "derived": W([3, 2, 4], {"derived": {"by": "expert_upcast", "from": ["experts"], "shape": [3, 2, 4]}}),
}}


def expected(name, i, t):
    q, qkv, norm = t[f"l.{i}.q"], t[f"l.{i}.qkv"], t[f"l.{i}.norm"]
    return {
        "wq": q, "only_odd": q, "sparse": t[f"l.{i}.k"],
        "experts": np.stack([t[f"l.{i}.e.{e}"] for e in range(3)]),
        "wqk": np.concatenate([q, t[f"l.{i}.k"]]),
        "wqk_cols": np.concatenate([q, q], axis=1),
        "wk_rows": qkv[6:9], "wq_cols": qkv[:, 1:3], "wqT": q.T,
        "wq_scaled": q * np.float32(0.125), "norm1p": norm + np.float32(1.0),
        "bias_qk": np.concatenate([np.zeros(6, np.float32), norm[2:4]]),
        "f32_rows": t[f"l.{i}.f32"][1:3],
        "qkv_grouped": np.concatenate([qkv[1:3], qkv[6:8]]), "norm_2d": norm.reshape(2, 2),
        "neg_exp": -np.exp(norm), "neg_exp_f32": -np.exp(norm), "norm_f32": norm,
        "derived": np.zeros((3, 2, 4), np.float32),
    }[name]


def test_every_recipe_kind_is_covered():
    used = set()

    def walk(src):
        kind = next(k for k in src if k in RECIPES)
        used.add(kind)
        if kind == "derived":            # its payload names plan weights, not recipes
            return
        for v in src.values():
            for s in (v if isinstance(v, list) else [v]):
                if isinstance(s, dict):
                    walk(s)
    for w in PLAN["weights"].values():
        walk(w["source"])
    # the quantized formats' recipes (runtime/weights/quant_*.py) have their own tests (tests/test_quant_*.py)
    assert used == {k for k, fn in RECIPES.items() if not fn.__module__.rsplit(".", 1)[-1].startswith("quant_")}


def test_numpy_loader_builds_each_recipe(ckpt_dir):
    d, t = ckpt_dir
    w = load_weights(PLAN, Checkpoint(d))
    assert w["lm_head"] is w["embed"] and (w["embed"] == t["embed"]).all()
    for name, decl in PLAN["weights"].items():
        if decl["layers"] is None:
            continue
        assert isinstance(w[name], list) and len(w[name]) == len(decl["layers"])
        for i in decl["layers"]:
            got = at(PLAN, w, name, i)
            assert got.dtype == np.float32 and got.shape == tuple(decl["shape"])
            np.testing.assert_array_equal(got, expected(name, i, t), err_msg=f"{name} layer {i}")
    assert at(PLAN, w, "sparse", 2) is w["sparse"][1]
    with pytest.raises(KeyError, match="no copy for layer 1"):
        at(PLAN, w, "sparse", 1)


def test_device_loader_holds_the_same_values_in_bf16(ckpt_dir, monkeypatch):
    d, _ = ckpt_dir
    monkeypatch.setattr(dw, "STAGING", 512)                  # tensors split across staging buffers
    monkeypatch.setattr(dw, "PIECE", 100)
    ctx = FakeContext()
    dev = dw.DeviceWeights(ctx, PLAN, d, progress=False, threads=2)
    total = 0
    for name, layer, a in iter_weights(PLAN, Checkpoint(d)):
        if isinstance(a, str):
            assert dev.ptrs[name] == dev.ptrs[a]
            continue
        bits = a.astype(np.float32) if PLAN["weights"][name]["dtype"] == "f32" else f32_to_bf16_bits(a)
        if "derived" in PLAN["weights"][name]["source"]:
            # room only: the load program writes it (tests/test_device_weights.py: never built,
            # read or copied here)
            total += bits.nbytes
            continue
        assert ctx.read(dev.ptr(name, layer), bits.nbytes) == bits.tobytes(), (name, layer)
        total += bits.nbytes
    assert dev.bytes == total
    with pytest.raises(KeyError, match="no copy for layer 0"):
        dev.ptr("only_odd", 0)


def test_fast_path_covers_plain_bf16_runs_only(ckpt_dir):
    d, _ = ckpt_dir
    ck = Checkpoint(d)
    fast = {n for n, w in PLAN["weights"].items()
            if "tied" not in w["source"] and w["dtype"] == "bf16" and dw._runs(ck, w["source"], 1) is not None}
    assert fast == {"embed", "wq", "experts", "wqk", "wk_rows", "only_odd", "sparse"}


@pytest.mark.parametrize("src,match", [
    ({"slice": {"tensor": "l.{i}.q"}, "axis": 0, "start": 4, "stop": 9}, "cannot take"),
    ({"slice": {"tensor": "l.{i}.q"}, "axis": 2, "start": 0, "stop": 1}, "cannot take"),
    ({"transpose": {"stack": "l.{i}.e.{e}", "count": 2}}, "2-D only"),
    ({"slice": {"tensor": "l.{i}.qkv"}, "axis": 0, "start": 3, "stop": 6, "groups": 2}, "row groups"),
    ({"slice": {"tensor": "l.{i}.qkv"}, "axis": 0, "start": 0, "stop": 1, "groups": 3}, "row groups"),
    ({"reshape": {"tensor": "l.{i}.q"}, "from": [4, 6], "to": [24]}, "stored_shape"),
    ({"concat": [{"tensor": "l.{i}.q"}, {"tensor": "l.{i}.f32"}], "axis": 0}, "cannot concatenate"),
])
def test_bad_recipes_name_the_tensors(ckpt_dir, src, match):
    d, _ = ckpt_dir
    ck = Checkpoint(d)
    with pytest.raises(ModelDirError, match=match):
        build(src, 0, ck.float32, str(d))
    plan = {"weights": {"x": W([1], src)}}
    with pytest.raises(ModelDirError, match=match):
        dw.DeviceWeights(FakeContext(), plan, d, progress=False)


def test_unknown_recipes_and_shape_mismatches(ckpt_dir):
    d, _ = ckpt_dir
    with pytest.raises(ValueError, match="exactly one recipe"):
        build({"rotate": "x"}, 0, lambda n: None)
    with pytest.raises(ModelDirError, match=r"'l.0.q\[2:4\]' has shape \[2, 4\], the plan expects \[3, 4\]"):
        load_weights({"weights": {"x": W([3, 4], {"slice": T, "axis": 0, "start": 2, "stop": 4})}},
                     Checkpoint(d))


def test_f32_weights_keep_float32_exp_and_scale(ckpt_dir):
    """A weight the plan declares f32 is built in float32 (exp, then scale) and stored unrounded;
    the same recipe declared bf16 is rounded once."""
    d, t = ckpt_dir
    ctx = FakeContext()
    dev = dw.DeviceWeights(ctx, PLAN, d, progress=False, threads=2)
    for i in range(3):
        want = -np.exp(t[f"l.{i}.norm"].astype(np.float32))
        got = np.frombuffer(ctx.read(dev.ptr("neg_exp_f32", i), 16), np.float32)
        np.testing.assert_array_equal(got, want)
        rounded = np.frombuffer(ctx.read(dev.ptr("neg_exp", i), 8), np.uint16)
        np.testing.assert_array_equal(rounded, f32_to_bf16_bits(want))
        assert not np.array_equal(_bf16(want), want)        # the rounding is visible here
        np.testing.assert_array_equal(np.frombuffer(ctx.read(dev.ptr("norm_f32", i), 16), np.float32),
                                      t[f"l.{i}.norm"])
    bad = {"weights": {"x": W([4], {"tensor": "l.{i}.norm"}, dtype="f16")}}
    with pytest.raises(ModelDirError, match="weight .x.: the GPU stores bf16, f32, .* weights, not f16"):
        dw.DeviceWeights(FakeContext(), bad, d, progress=False)
