"""--load-format dummy without a GPU: the device loader fills every weight region exactly once
with the fill kernel (on tests/fake_cuda.py's fake driver, whose memory is host bytes) and loads
the numbers the CPU backend makes; a directory with only config.json runs `LLM`, `infc generate`
and `infc serve`, deterministically, with its checkpoint (even a broken one) neither read nor
checked; a derived weight (the load program's) is neither filled nor drawn."""
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from infc.compiler.build import compile_model
from infc.compiler.codegen.render import render_weight_init
from infc.compiler.contract.errors import ModelDirError
from infc.runtime.weights import dummy as dwv
from infc.runtime.cuda import weights as dw
from infc.compiler.contract.safetensors_io import f32_to_bf16_bits

from fake_cuda import FakeContext

ROOT = Path(__file__).resolve().parent.parent
TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=300, max_position_embeddings=256,
            rms_norm_eps=1e-6, rope_theta=10000.0, bos_token_id=1, eos_token_id=2)


def config_only(d: Path, arch="Qwen3ForCausalLM", **over) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({**TINY, "architectures": [arch], **over}))
    return d


def fill_kernel(drv, kind="bf16"):
    """The real rendered fill kernel loaded on the fake driver (tests/fake_cuda.py): its "cubin"
    is its Triton source, so a launch can also run it under the interpreter."""
    from infc.runtime.cuda.artifact import KernelFn
    k = render_weight_init({}, kind=kind)
    return KernelFn(k.id, k.meta, {"num_warps": 4}, drv.Module(k.source.encode()).function(k.meta["entry"]))


@pytest.mark.parametrize("family,chunk,run", [("Qwen3ForCausalLM", None, "mirror"),
                                              ("LlamaForCausalLM", 1000, "mirror"),
                                              ("Qwen3MoeForCausalLM", None, "mirror"),
                                              ("LlamaForCausalLM", 1000, "interpreted")])
def test_device_fill_covers_every_weight_once(tmp_path, monkeypatch, fake_driver, family, chunk, run):
    """Each fill launch writes its region with the kernel's numpy mirror, or ("interpreted") the
    rendered kernel itself runs under Triton's interpreter on the fake device."""
    over = {"tie_word_embeddings": family == "LlamaForCausalLM"}
    if family == "Qwen3MoeForCausalLM":
        over.update(moe_intermediate_size=32, num_experts=6, num_experts_per_tok=2, norm_topk_prob=True,
                    decoder_sparse_step=1, mlp_only_layers=[])
    d = config_only(tmp_path / "m", family, **over)
    (d / "model.safetensors").write_bytes(b"not a checkpoint")    # never opened
    _, plan = compile_model(model_dir=str(d), check_checkpoint=False)
    if chunk:
        monkeypatch.setattr(dwv, "CHUNK", chunk)   # weights split into several launches
    ctx, kernel = fake_driver.Context(), fill_kernel(fake_driver)
    if run == "mirror":

        def mirror(launch):
            ptr, n, seed, scale, offset = launch.values
            ctx.view(ptr, n, np.uint16)[:] = f32_to_bf16_bits(dwv.values(n, seed, scale, offset))

        fake_driver.on_launch = mirror
    # else no callback: the fake driver runs the kernel's Triton source under the interpreter
    w = dw.DeviceWeights(ctx, plan, d, progress=False, load_format="dummy", fill=kernel)
    launches = []
    for launch in fake_driver.launches:
        ptr, n, seed, scale, offset = launch.values                  # META's parameter order
        assert launch.ctx is ctx and launch.fn is kernel.fn and 0 < n <= dwv.CHUNK
        assert launch.grid == (math.ceil(n / 1024), 1, 1) and launch.block == kernel.block
        launches.append((ptr, n))
    cpu = dwv.dummy_weights(plan)                                   # what the CPU backend loads
    regions = []
    for name, spec in plan["weights"].items():
        if "tied" in spec["source"]:
            assert w.ptrs[name] == w.ptrs[spec["source"]["tied"]]
            continue
        for i, layer in enumerate([None] if spec["layers"] is None else spec["layers"]):
            ptr, n = w.ptr(name, layer), math.prod(spec["shape"])
            assert ptr % dw.ALIGN == 0
            regions.append((ptr, n))
            want = cpu[name] if spec["layers"] is None else cpu[name][i]
            got = ctx.view(ptr, n, np.uint16)
            assert np.array_equal(got, f32_to_bf16_bits(want).reshape(-1)), (name, layer)
    # every region filled by launches that tile it exactly, no launch outside a region
    covered = sorted(launches)
    assert sum(n for _, n in covered) == sum(n for _, n in regions) == w.bytes // 2
    assert len(set(p for p, _ in covered)) == len(covered)           # no region written twice
    for ptr, n in regions:
        mine = [(p, k) for p, k in covered if ptr <= p < ptr + 2 * n]
        assert mine[0][0] == ptr and sum(k for _, k in mine) == n
        assert all(p + 2 * k == q for (p, k), (q, _) in zip(mine, mine[1:]))
    if chunk:
        assert len(launches) > len(regions)


def test_f32_weights_fill_with_the_f32_kernel(tmp_path, fake_driver):
    """A plan's f32 weights (a spec's `dtype: f32`) are filled by plan["weight_init_f32"], 4 bytes an
    element, unrounded, as the CPU backend makes them; bf16 ones as before. Plans without f32
    weights carry no f32 fill kernel."""
    from infc.compiler.codegen.render import render_plan
    d = config_only(tmp_path / "m")
    _, plain = compile_model(model_dir=str(d), check_checkpoint=False)
    render_plan(plain, {}, 16)
    assert "weight_init" in plain and "weight_init_f32" not in plain
    plan = {"weights": {
        "w": {"shape": [5, 4], "dtype": "bf16", "layers": None, "source": {"tensor": "w"}},
        "A": {"shape": [6], "dtype": "f32", "layers": [0, 2],
              "source": {"scale": {"exp": {"tensor": "l.{i}.A_log"}}, "by": -1.0}},
        "b": {"shape": [3], "dtype": "f32", "layers": None, "source": {"tensor": "dt_bias"}}}}
    ctx = fake_driver.Context()
    kernels = {"bf16": fill_kernel(fake_driver), "f32": fill_kernel(fake_driver, "f32")}
    assert kernels["f32"].id != kernels["bf16"].id

    def fake_launch(launch):
        ptr, n, seed, scale, offset = launch.values
        v = dwv.values(n, seed, scale, offset)
        data = v if launch.fn is kernels["f32"].fn else f32_to_bf16_bits(v)
        ctx.view(ptr, n, data.dtype)[:] = data

    fake_driver.on_launch = fake_launch
    w = dw.DeviceWeights(ctx, plan, d, progress=False, load_format="dummy", fill=kernels)
    cpu = dwv.dummy_weights(plan)
    got = ctx.view(w.ptr("w", None), 20, np.uint16)
    assert np.array_equal(got, f32_to_bf16_bits(cpu["w"]).reshape(-1))
    for name, layers in (("A", [0, 2]), ("b", [None])):
        for i, layer in enumerate(layers):
            want = cpu[name][i] if layer is not None else cpu[name]
            n = want.size
            got = ctx.view(w.ptr(name, layer), n, np.float32)
            assert np.array_equal(got, want), (name, layer)
    a = cpu["A"][0]
    as_bf16 = dwv.weight_values("A", {**plan["weights"]["A"], "dtype": "bf16"}, 0)
    assert abs(a.mean() + 1) < 0.05 and not np.array_equal(a, as_bf16)
    assert w.bytes == 2 * 20 + 4 * (6 + 6 + 3)
    with pytest.raises(ModelDirError, match="f32 weight fill kernel"):
        dw.DeviceWeights(FakeContext(), plan, d, load_format="dummy", fill=kernels["bf16"])


def test_value_rules():
    norm = {"shape": [64], "source": {"offset": {"tensor": "model.norm.weight"}, "by": 1.0}}
    bias = {"shape": [64], "source": {"concat": [{"tensor": "q.bias"}, {"zeros": [8]}], "axis": 0}}
    mat = {"shape": [8, 64], "source": {"tensor": "w"}}
    assert dwv.rule(norm) == (0.02, 1.0) and dwv.rule(bias) == (0.02, 0.0) == dwv.rule(mat)
    a = dwv.weight_values("final_norm", norm, None)
    assert a.dtype == np.float32 and a.shape == (64,) and abs(a.mean() - 1) < 0.02
    assert np.array_equal(a, dwv.weight_values("final_norm", norm, None))
    assert not np.array_equal(a, dwv.weight_values("attn_norm", norm, None))


def test_inspect_lists_the_fill_kernel(tmp_path):
    from infc.compiler.inspect import inspect
    d = config_only(tmp_path / "m")
    out = inspect(model_dir=str(d))
    assert f"fill_random  {render_weight_init({}).id}" in out and "== weight init" in out


def test_dummy_needs_the_fill_kernel_and_a_known_format(tmp_path):
    d = config_only(tmp_path / "m")
    _, plan = compile_model(model_dir=str(d), check_checkpoint=False)
    with pytest.raises(ModelDirError, match="weight fill kernel"):
        dw.DeviceWeights(FakeContext(), plan, d, load_format="dummy")
    with pytest.raises(ValueError, match="--load-format must be one of auto, dummy"):
        dw.DeviceWeights(FakeContext(), plan, d, load_format="npz")


def test_llm_runs_a_config_only_directory(tmp_path):
    from infc import LLM, SamplingParams
    d = config_only(tmp_path / "m")
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outs = [LLM(d, device="cpu", load_format="dummy").generate([[5, 6, 7], [9]], params) for _ in range(2)]
    a, b = ([o.token_ids for o in out] for out in outs)
    assert a == b and all(len(t) == 6 and all(0 <= x < 300 for x in t) for t in a)
    (d / "model.safetensors").write_bytes(b"broken")                # auto reads it and fails loudly
    assert LLM(d, device="cpu", load_format="dummy").generate([5, 6, 7], params)[0].token_ids == a[0]
    with pytest.raises(Exception):
        LLM(d, device="cpu")
    with pytest.raises(ValueError, match="--load-format"):
        LLM(d, device="cpu", load_format="pt")


def text_model(tmp_path) -> Path:
    """SmolLM2's tokenizer beside a tiny Llama config.json: text in and out, no checkpoint."""
    from smollm2_from_gguf import ensure_smollm2
    src = ensure_smollm2()
    d = config_only(tmp_path / "text", "LlamaForCausalLM", vocab_size=49152, tie_word_embeddings=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / f, d / f)
    return d


def test_generate_serve_and_bench_commands(tmp_path, capsys):
    from infc.cli import parser
    from infc.server.args import backend_kwargs
    a = parser().parse_args(["serve", "--model-path", "/m", "--load-format", "dummy"])
    assert backend_kwargs(a)["load_format"] == "dummy"
    assert backend_kwargs(parser().parse_args(["serve", "--model-path", "/m"]))["load_format"] == "auto"
    from infc.server.args import LOAD_FORMATS
    assert LOAD_FORMATS == dwv.LOAD_FORMATS          # the flag's choices, what the loaders accept
    for argv in (["serve", "--model-path", "/m"], ["generate", "--model-path", "/m", "--prompt", "x"]):
        with pytest.raises(SystemExit) as e:
            parser().parse_args([*argv, "--load-format", "pt"])
        assert e.value.code == 2
    from infc.bench import latency, startup, throughput
    for bench, argv in ((latency, ["--artifact", "/a"]), (throughput, []), (startup, [])):
        with pytest.raises(SystemExit) as e:            # parsed before anything touches a GPU
            bench.main(["--model-path", "/m", *argv, "--load-format", "pt"])
        assert e.value.code == 2 and "--load-format: invalid choice" in capsys.readouterr().err
    d = text_model(tmp_path)
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    gen = [sys.executable, "-m", "infc.cli", "generate", "--model-path", str(d), "--prompt", "Hello",
           "--max-tokens", "3", "--device", "cpu", "--load-format", "dummy"]
    runs = [subprocess.run(gen, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT) for _ in range(2)]
    assert runs[0].returncode == 0 and runs[0].stdout.startswith("Hello"), runs[0].stderr[-800:]
    assert runs[0].stdout == runs[1].stdout
    bad = subprocess.run(gen[:-1] + ["safetensors"], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert bad.returncode == 2 and "--load-format" in bad.stderr and "Traceback" not in bad.stderr

    from test_server_support import request, serve_process
    with serve_process(d, "--device", "cpu", "--load-format", "dummy", "--max-model-len", "64",
                       "--kv-cache-memory-bytes", str(8 << 20), "--uvicorn-log-level", "warning") as (port, out):
        assert "load format dummy" in out and "make random weights" in out, out
        s, _, body = request(port, "POST", "/v1/completions", {"model": str(d), "prompt": "Hi", "max_tokens": 2})
        assert s == 200 and json.loads(body)["usage"]["completion_tokens"] == 2, body


def test_derived_weights_are_left_to_the_load_program(tmp_path, fake_driver):
    """A derived weight (source {"derived": ...}: the plan's load program writes it) gets no fill
    launch on the device and zeros on the CPU: neither backend spends random numbers on it."""
    from fake_cuda import POISON
    d = config_only(tmp_path / "m", "Qwen3MoeForCausalLM", moe_intermediate_size=32, num_experts=6,
                    num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    _, plan = compile_model(model_dir=str(d), check_checkpoint=False)
    stack = next(n for n, w in plan["weights"].items() if len(w["shape"]) == 3 and w["layers"])
    w = plan["weights"][stack]
    plan["weights"]["wd_bf16"] = {"shape": w["shape"], "dtype": "bf16", "layers": w["layers"],
                                  "source": {"derived": {"by": "expert_upcast", "from": [stack], "shape": w["shape"]}}}
    ctx, kernel = fake_driver.Context(), fill_kernel(fake_driver)
    fake_driver.on_launch = lambda launch: None
    got = dw.DeviceWeights(ctx, plan, d, progress=False, load_format="dummy", fill=kernel)
    size = 2 * math.prod(w["shape"])
    starts = [launch.values[0] for launch in fake_driver.launches]
    for layer in w["layers"]:
        ptr = got.ptr("wd_bf16", layer)
        assert not any(ptr <= p < ptr + size for p in starts)
        assert ctx.read(ptr, size) == bytes([POISON]) * size
    assert all(not a.any() and a.shape == tuple(w["shape"]) for a in dwv.dummy_weights(plan)["wd_bf16"])
