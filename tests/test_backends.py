"""CUDA and TileLang backends: render each template at real shapes, compile AOT for sm_90 (no GPU),
and check the cubin against its META: target, entry symbol, parameter list, launch shape, and the
instructions the design relies on (tensor-core MMA, 16-byte loads, no local memory).

Nothing runs here (no GPU): the numerics are checked on a GPU by running these cubins against torch
(see the report of the backend work). Compiles run in parallel worker processes and are cached
under .cache/backend_tests/ by the hash of source, target and backend code, so a rerun takes seconds.
Skips: the CUDA cases without nvcc, the TileLang cases without the tilelang package.
"""
import concurrent.futures as cf
import hashlib
import importlib.util
import json
import multiprocessing
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from exhaustive import EXHAUSTIVE

from infc.compiler.codegen import backend_cuda, backend_tilelang
from infc.compiler.codegen.backend_cuda import (CudaCompileError, check_params, cubin_info, gencode,
                                                 nvcc_cubin, param_bytes)
from infc.compiler.codegen.render import render_template
from infc.compiler.ops import REGISTRY
from infc.compiler.contract.bind import grid, split_source

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / ".cache" / "backend_tests"
ARCH = "sm_90"
HAVE_NVCC = Path(backend_cuda.NVCC).exists() or shutil.which("nvcc") is not None
HAVE_TILELANG = importlib.util.find_spec("tilelang") is not None


def _cuobjdump():
    spec = importlib.util.find_spec("triton")   # not imported: only its bundled CUDA tools are used
    if spec is None or not spec.origin:
        return shutil.which("cuobjdump")
    tool = Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(tool) if tool.exists() else shutil.which("cuobjdump")


CUOBJDUMP = _cuobjdump()


def t(name, shape, dtype="bf16", kind="buffer"):
    return {"name": name, "shape": list(shape), "dtype": dtype, "kind": kind}


def ctx(op, phase, inputs, outputs, attrs=None, caches=None, page_size=16, tune=None):
    return {"op": op, "phase": phase, "inputs": inputs, "outputs": outputs, "attrs": attrs or {},
            "config": {}, "caches": caches or {}, "page_size": page_size, "tune": tune or {}}


def linear(phase, N, K):
    return ctx("linear", phase, [t("x", ["T", K]), t("w", [N, K], kind="weight")], [t("y", ["T", N])])


def add_rms_norm(H, eps=1e-6):
    x = t("x", ["T", H])
    return ctx("add_rms_norm", "decode", [x, t("d", ["T", H]), t("w", [H], kind="weight")],
               [x, t("h", ["T", H])], {"eps": eps})


def attention(Hq, Hkv, D, page):
    cache = {"kind": "paged", "shape": [Hkv, D], "dtype": "bf16", "layers": list(range(36)),
             "page_size": page}
    return ctx("attention_cached", "decode", [t("q", ["T", Hq, D]), t("cache", [], dtype="", kind="cache")],
               [t("o", ["T", Hq, D])], {"kv_heads": Hkv, "scale": None, "window": None, "softcap": None},
               caches={"k": cache, "v": cache}, page_size=page)


# (case id, backend, template, launch context, SASS that must appear, SASS that must not).
# The second TileLang shapes are lowered and checked against META but not built by nvcc (the
# slow half of a TileLang compile): SASS None.
CASES = [
    # qwen3-4b decode GEMVs (qkv, o_proj, gate_up) and a ragged tiny shape (N % 16, K % 32 != 0).
    ("gemv-qkv", "cuda", "gemv", linear("decode", 6144, 2560), ["HMMA.16816.F32.BF16", "LDG.E.NA.LTC128B.128"], ["LDL", "STL"]),
    ("gemv-o", "cuda", "gemv", linear("decode", 2560, 4096), ["HMMA.16816.F32.BF16", "LDG.E.NA.LTC128B.128"], ["LDL", "STL"]),
    ("gemv-gate_up", "cuda", "gemv", linear("decode", 19456, 2560), ["HMMA.16816.F32.BF16", "LDG.E.NA.LTC128B.128"], ["LDL", "STL"]),
    ("gemv-ragged", "cuda", "gemv", linear("decode", 100, 72), ["HMMA.16816.F32.BF16"], ["LDL", "STL"]),
    ("add_rms_norm-2560", "cuda", "add_rms_norm", add_rms_norm(2560), ["LDG.E.128", "STG.E.128"], ["LDL", "STL"]),
    ("add_rms_norm-1000", "cuda", "add_rms_norm", add_rms_norm(1000, 1e-5), ["LDG.E.128"], ["LDL", "STL"]),
    # Prefill GEMM: qwen3-4b qkv, and the o_proj shape.
    ("gemm-qkv", "tilelang", "gemm", linear("prefill", 6144, 2560), [r"HGMMA\.64x\d+x16\.F32\.BF16"], ["LDL", "STL"]),
    ("gemm-o", "tilelang", "gemm", linear("mixed", 2560, 4096), None, None),
    # Decode attention: qwen3-4b (GQA 4), and a SmolLM2-like odd group (9 heads over 3) at D = 64.
    ("attention-qwen3-4b", "tilelang", "attention_decode", attention(32, 8, 128, 16), ["HMMA.16816.F32.BF16"], ["LDL", "STL"]),
    ("attention-g3-d64", "tilelang", "attention_decode", attention(9, 3, 64, 16), None, None),
]
IDS = [c[0] for c in CASES]
# The fast suite compiles a CUDA case of each template at a ragged shape and lowers each TileLang
# template (checked against META); the real-shape CUDA builds and TileLang's nvcc builds (with
# their SASS checks: ~1 CPU-minute each on a fresh clone) run with --exhaustive (make test-all).
FAST_CASES = {"gemv-ragged", "add_rms_norm-1000", "gemm-o", "attention-g3-d64"}
CUBIN_CASES = [pytest.param(c, id=c[0], marks=() if c[0] in FAST_CASES else EXHAUSTIVE) for c in CASES]


def _needs(backend):
    # the build machine and CI have both: their absence is a broken install, not a reason to skip
    assert HAVE_NVCC, "nvcc not found"
    if backend == "tilelang":
        assert HAVE_TILELANG, "tilelang is not installed (make test installs tilelang==0.1.15)"


def _key(backend, source):
    h = hashlib.sha256()
    for part in (backend, ARCH, source, Path(backend_cuda.__file__).read_text(),
                 Path(backend_tilelang.__file__).read_text()):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:20]


def _compile_job(backend, source, meta, workdir, lower_only=False):
    """Runs in a worker process (as the build loop does)."""
    from infc.compiler.codegen import backend_tilelang as tl
    from infc.compiler.codegen.backend_cuda import compile_cuda
    if lower_only:
        _, desc, tvm = tl.lower(source, meta, ARCH, Path(workdir))
        tl.check(meta, desc, tvm)
        return b"", {"name": desc["name"], "params": desc["params"], "block": desc["block"],
                     "dynamic_shared": desc["shared"], "lowered_only": True}
    fn = compile_cuda if backend == "cuda" else tl.compile_tilelang
    return fn(source, meta, ARCH, Path(workdir))


@pytest.fixture(scope="session")
def compiled(request):
    """case id -> (kernel, cubin bytes, metadata); compiles, in parallel, once, every missing case
    this session runs (test_cubin's selected cases, and gemv-qkv for the META check below)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    wanted = {item.callspec.id for item in request.session.items
              if item.originalname == "test_cubin" and hasattr(item, "callspec")} | {"gemv-ragged"}
    kernels = {cid: render_template(backend, tmpl, c) for cid, backend, tmpl, c, _, _ in CASES if cid in wanted}
    backends = {c[0]: c[1] for c in CASES}
    lower_only = {c[0]: c[4] is None for c in CASES}
    out, todo = {}, {}
    for cid, k in kernels.items():
        key = _key(backends[cid], k.source)
        cub, md = CACHE / f"{key}.cubin", CACHE / f"{key}.json"
        if md.exists() and (cub.exists() or lower_only[cid]):
            out[cid] = (k, cub.read_bytes() if cub.exists() else b"", json.loads(md.read_text()))
        elif HAVE_NVCC and (backends[cid] == "cuda" or HAVE_TILELANG):
            todo[cid] = key
    if todo:
        workers = min(len(todo), max(1, os.cpu_count() or 1))
        order = sorted(todo, key=lambda cid: backends[cid] != "tilelang")   # the slow ones first
        with cf.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            futs = {cid: pool.submit(_compile_job, backends[cid], kernels[cid].source, kernels[cid].meta,
                                     str(CACHE / "work" / todo[cid]), lower_only[cid]) for cid in order}
            for cid, fut in futs.items():
                try:
                    cubin, md = fut.result()
                except Exception as e:   # reported by the case's own test
                    out[cid] = (kernels[cid], None, {"error": f"{type(e).__name__}: {e}"})
                    continue
                if cubin:
                    (CACHE / f"{todo[cid]}.cubin").write_bytes(cubin)
                (CACHE / f"{todo[cid]}.json").write_text(json.dumps(md))
                out[cid] = (kernels[cid], cubin, md)
    return out


# ---- op homes and render-time checks (no compiler needed) --------------------------------------

def test_op_homes_route_to_the_backends():
    linear_op, norm, attn = REGISTRY["linear"], REGISTRY["add_rms_norm"], REGISTRY["attention_cached"]
    assert linear_op.template("cuda", "decode") == "gemv"
    assert linear_op.template("cuda", "prefill") is None      # falls back to the default backend
    assert linear_op.template("tilelang", "prefill") == "gemm"
    assert linear_op.template("tilelang", "mixed") == "gemm"
    assert linear_op.template("tilelang", "decode") is None
    assert norm.template("cuda", "decode") == "add_rms_norm" == norm.template("cuda", "prefill")
    assert attn.template("tilelang", "decode") == "attention_decode"


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_render_meta(case):
    cid, backend, tmpl, c, _, _ = case
    k = render_template(backend, tmpl, c)
    meta = k.meta
    assert set(meta) >= {"entry", "params", "constexprs", "grid", "block", "num_warps", "shared"}
    for name, ty, source in meta["params"]:
        split_source(source)
        param_bytes(ty)
    assert meta["block"][0] * meta["block"][1] * meta["block"][2] <= 1024
    assert meta["num_warps"] * 32 == meta["block"][0] * meta["block"][1] * meta["block"][2]
    sym = "B" if tmpl == "attention_decode" else "T"
    grids = {n: grid(meta, {"T": n, "B": n}) for n in (1, 7, 32, 256, 4096)}
    assert all(g[0] * g[1] * g[2] >= 1 for g in grids.values())
    assert grids[1] != grids[4096], f"{cid}: the grid must grow with {sym}"
    if backend == "cuda":
        assert any(l.startswith("// META ") for l in k.source.splitlines())
        assert f'extern "C" __global__' in k.source and f" {meta['entry']}(" in k.source
    # The kernel's math is written above it.
    assert re.search(r"^(//|#) " + re.escape(tmpl), k.source, re.M), "the math comment is missing"
    # Rendering is deterministic (kernel ids are content hashes).
    assert render_template(backend, tmpl, c).id == k.id


def test_second_shape_renders_differently():
    a = render_template("cuda", "gemv", linear("decode", 6144, 2560))
    b = render_template("cuda", "gemv", linear("decode", 2560, 4096))
    assert a.id != b.id and a.meta["constexprs"]["K"] == 2560 and b.meta["constexprs"]["K"] == 4096


def test_gencode_flags():
    assert gencode("sm_90") == ["-gencode=arch=compute_90a,code=sm_90a"]
    assert gencode("sm_90a") == ["-gencode=arch=compute_90a,code=sm_90a"]
    assert gencode("sm_80") == ["-gencode=arch=compute_80,code=sm_80"]
    with pytest.raises(CudaCompileError):
        gencode("hopper")


def test_tilelang_meta_check_names_both_sides():
    """The TileLang backend refuses a META that misdescribes the lowered kernel (no TileLang needed)."""
    desc = {"name": "gemm_kernel", "params": [["w", "*bf16"], ["x", "*bf16"], ["y", "*bf16"], ["T", "i32"]],
            "block": [256, 1, 1], "grid": [48, 1, 1], "shared": 98304}
    meta = {"entry": "gemm_kernel", "block": [256, 1, 1], "grid": [48, 1, 1], "shared": 98304,
            "params": [["x", "*bf16", "in:0"], ["w", "*bf16", "in:1"], ["y", "*bf16", "out:0"], ["T", "i32", "dim:T"]]}
    with pytest.raises(backend_tilelang.TileLangCompileError, match=r"params: META \[\['x'"):
        backend_tilelang.check(meta, desc, None)
    meta["params"][0], meta["params"][1] = meta["params"][1], meta["params"][0]
    backend_tilelang.check(meta, desc, None)
    meta["shared"] = 0
    with pytest.raises(backend_tilelang.TileLangCompileError, match="shared"):
        backend_tilelang.check(meta, desc, None)


# ---- compiled cubins ---------------------------------------------------------------------------

@pytest.mark.parametrize("case", CUBIN_CASES)
def test_cubin(case, compiled):
    cid, backend, tmpl, c, must, must_not = case
    _needs(backend)
    k, cubin, md = compiled[cid]
    assert "error" not in md, md.get("error")
    meta = k.meta
    if must is None:   # lowered and checked against META (params, block, grid, shared) only
        assert md["lowered_only"] and md["name"] == meta["entry"]
        assert [p[:2] for p in md["params"]] == [p[:2] for p in meta["params"]]
        assert list(md["block"]) == list(meta["block"]) and md["dynamic_shared"] == meta["shared"]
        return
    assert cubin
    info = cubin_info(cubin)
    assert info["arch"] == "sm_90a"
    assert meta["entry"] in info["kernels"], f"no kernel {meta['entry']} in {list(info['kernels'])}"
    assert info["kernels"][meta["entry"]] == [param_bytes(ty) for _, ty, _ in meta["params"]]
    assert md["name"] == meta["entry"] and md["hidden_args"] == 0 and md["arch"] == "sm_90a"
    assert list(md["block"]) == list(meta["block"])
    assert md["num_regs"] and 0 < md["num_regs"] <= 255
    assert md["dynamic_shared"] == meta["shared"]
    if backend == "tilelang":
        assert [p[:2] for p in md["params"]] == [p[:2] for p in meta["params"]]
    if CUOBJDUMP is None:
        return
    work = CACHE / "inspect"
    work.mkdir(parents=True, exist_ok=True)
    path = work / f"{k.id}.cubin"
    path.write_bytes(cubin)
    listed = subprocess.run([CUOBJDUMP, "--list-elf", str(path)], capture_output=True, text=True, check=True).stdout
    assert "sm_90a" in listed, listed
    symbols = subprocess.run([CUOBJDUMP, "-symbols", str(path)], capture_output=True, text=True, check=True).stdout
    assert re.search(rf"STT_FUNC\s+STB_GLOBAL.*\s{re.escape(meta['entry'])}\s*$", symbols, re.M), symbols
    sass = subprocess.run([CUOBJDUMP, "-sass", str(path)], capture_output=True, text=True, check=True).stdout
    for op in must:
        assert re.search(op if "\\" in op else re.escape(op), sass), f"{cid}: expected {op} in the SASS"
    for op in must_not:
        assert not re.search(rf"\b{op}\b", sass), f"{cid}: unexpected {op} (local memory) in the SASS"


def test_meta_param_mismatch_is_an_error(compiled):
    _needs("cuda")
    k, cubin, _ = compiled["gemv-ragged"]
    assert cubin
    sizes = cubin_info(cubin)["kernels"]["gemv"]
    bad = dict(k.meta, params=k.meta["params"][:-1])
    with pytest.raises(CudaCompileError, match="sizes"):
        check_params(bad, sizes, "gemv")


def test_cuda_rejects_unaligned_rows(tmp_path):
    _needs("cuda")
    k = render_template("cuda", "gemv", linear("decode", 64, 36))
    with pytest.raises(CudaCompileError, match="K % 8"):
        backend_cuda.compile_cuda(k.source, k.meta, ARCH, tmp_path)


def test_cubin_info_reads_other_targets(tmp_path):
    _needs("cuda")
    src = 'extern "C" __global__ void k(int* p, int n, double v) { p[0] = n + (int)v; }\n'
    cubin, _ = nvcc_cubin(src, "sm_80", tmp_path, "k")
    assert cubin_info(cubin) == {"arch": "sm_80", "e_flags": cubin_info(cubin)["e_flags"], "kernels": {"k": [8, 4, 8]}}
