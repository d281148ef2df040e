"""Ahead-of-time compilation with no GPU: every kernel of qwen3-4b becomes an sm_90 cubin that
exports its entry; a cold build fits in 120 s on this 2-core machine, an unchanged rebuild
compiles nothing in under 5 s, and editing one template recompiles only its kernels."""
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import triton

from infc.compiler import build as build_mod
from infc.compiler.codegen import aot, render

CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def exported(cubin: Path) -> tuple[str, set[str]]:
    elf = subprocess.run([str(CUOBJDUMP), "--list-elf", str(cubin)], capture_output=True, text=True).stdout
    syms = subprocess.run([str(CUOBJDUMP), "-symbols", str(cubin)], capture_output=True, text=True).stdout
    entries = {l.split()[-1] for l in syms.splitlines() if "STO_ENTRY" in l}
    return elf, entries


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    cache = tmp_path / "kcache"
    monkeypatch.setattr(aot, "CACHE", cache)
    monkeypatch.setenv("INFC_CACHE", str(cache))      # the spawned workers read it
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-cache"))   # truly cold
    return cache


def test_cold_build_rebuild_and_template_edit(tmp_path, fresh_cache, monkeypatch):
    out = tmp_path / "qwen3-4b"
    t0 = time.perf_counter()
    build_mod.build(model="qwen3-4b", out=out, log=None)
    cold = time.perf_counter() - t0
    plan = json.loads((out / "plan.json").read_text())
    assert cold <= 120, cold
    for kid, k in plan["kernels"].items():
        cubin = out / "bin" / f"{kid}.cubin"
        info = json.loads((out / "bin" / f"{kid}.json").read_text())
        elf, entries = exported(cubin)
        assert "sm_90" in elf, elf
        assert info["name"] in entries and k["entry"] == info["name"]
    # nothing changed: nothing compiles
    t0 = time.perf_counter()
    res = aot.compile_kernels(build_mod.generate(plan, out), out / "bin", progress=False)
    assert res["compiled"] == [] and time.perf_counter() - t0 <= 5
    # on a machine without this cache (the GPU's, whose Triton differs), re-rendering the
    # artifact reuses the cubins it holds for the target, and only those
    monkeypatch.setattr(aot, "CACHE", tmp_path / "empty-cache")
    res = aot.compile_kernels(build_mod.generate(plan, out), out / "bin", progress=False)
    assert res["compiled"] == [] and not (tmp_path / "empty-cache").exists()
    stale = sorted(plan["kernels"])[0]
    info = json.loads((out / "bin" / f"{stale}.json").read_text())
    (out / "bin" / f"{stale}.json").write_text(json.dumps({**info, "aot_revision": "older"}))
    monkeypatch.setattr(aot, "CACHE", fresh_cache)
    res = aot.compile_kernels(build_mod.generate(plan, out), out / "bin", progress=False)
    assert res["compiled"] == [] and json.loads((out / "bin" / f"{stale}.json").read_text()) == info
    # edit one template (a copy): only the kernels rendered from it recompile
    templates = tmp_path / "templates"
    shutil.copytree(render.TEMPLATES, templates)
    path = templates / "triton" / "fill_zero.py.j2"
    path.write_text(path.read_text() + "# edited\n")
    monkeypatch.setattr(render, "TEMPLATES", templates)
    plan2 = json.loads((out / "plan.json").read_text())
    kernels = build_mod.generate(plan2, tmp_path / "edited")
    res = aot.compile_kernels(kernels, tmp_path / "edited" / "bin", progress=False)
    assert res["compiled"] and all(k.startswith("fill_zero_") for k in res["compiled"])


def test_a_kernel_past_the_shared_memory_limit_is_refused_at_build():
    """A kernel that compiles but needs more shared memory than one block may have would fail
    only on the GPU (cuFuncSetAttribute); the build names it instead."""
    aot.check_shared({"shared": 232448}, "sm_90", "fits")
    with pytest.raises(RuntimeError, match=r"gemm .*278552 bytes.*sm_90's 232448"):
        aot.check_shared({"shared": 278552}, "sm_90", "gemm (triton, k)")
    with pytest.raises(RuntimeError, match="166912"):
        aot.check_shared({"dynamic_shared": 200000, "shared": 0}, "sm_80", "a cuda kernel")


def test_fp32_output_gemms_take_one_program_per_tile():
    """A persistent GEMM cannot reuse its pipeline buffers for the epilogue: with an fp32 output
    tile (logits, row-parallel partials) that passed the limit (278 KB on an H100), so those
    launch one program per tile; bf16 outputs stay persistent."""
    from kernels.harness import render as render_kernel
    args = [("x", ["T", 2560], "bf16"), ("w", [151936, 2560], "bf16", "weight")]
    f32 = render_kernel("gemm", "linear", args, [("y", ["T", 151936], "f32")], phase="prefill")
    bf16 = render_kernel("gemm", "linear", args, [("y", ["T", 151936], "bf16")], phase="prefill")
    assert "make_tensor_descriptor" in f32.source and "flatten=True" not in f32.source
    assert "flatten=True" in bf16.source and f32.meta["grid"][0].startswith("cdiv(")


# compiles one small kernel with (argv[2]: JSON) or without a register cap into argv[1]
CAP_PROBE = r"""
import json, sys
from pathlib import Path
from infc.compiler.codegen import aot
src = "\n".join([
    "import triton", "import triton.language as tl", "", "",
    "@triton.jit",
    "def k(x_ptr, y_ptr):",
    "    i = tl.arange(0, 2048)",
    "    x = tl.load(x_ptr + i)",
    "    tl.store(y_ptr + i, tl.cumsum(x * x, 0) + tl.sum(x, 0))", ""])
d, cap = Path(sys.argv[1]), json.loads(sys.argv[2])
meta = {"entry": "k", "params": [["x_ptr", "*fp32", "in:0"], ["y_ptr", "*fp32", "out:0"]],
        "constexprs": {}, "num_warps": 4, **({"maxnreg": cap} if cap else {})}
(d / "k.cubin").write_bytes(aot._compile_triton(src, meta, "sm_90", d)[0])
"""


def test_a_register_cap_in_meta_reaches_ptxas(tmp_path):
    """META's maxnreg (the MXFP4 MoE decode kernels' cap, triton/moe_gate_up.py.j2) becomes the
    PTX .maxnreg directive and the cubin keeps under it; META without one compiles as before.
    (In a process of its own: compiling needs Triton without the interpreter, as aot's workers.)"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    for cap in (None, 40):
        d = tmp_path / str(cap)
        d.mkdir()
        subprocess.run([sys.executable, "-c", CAP_PROBE, str(d), json.dumps(cap)], env=env, check=True)
        ptx = (d / "kernel.ptx").read_text()
        usage = subprocess.run([str(CUOBJDUMP), "-res-usage", str(d / "k.cubin")], capture_output=True,
                               text=True).stdout
        regs = int(usage.split("REG:")[1].split()[0])
        if cap:
            assert f".maxnreg {cap}" in ptx and regs <= cap, regs
        else:
            assert ".maxnreg" not in ptx and regs > 40, regs      # (the cap binds on this kernel)
