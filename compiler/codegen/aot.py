"""Ahead-of-time compilation of rendered kernels into cubins, with no GPU.

Each kernel is compiled once per (source, backend, options, target, compiler version): the
result lives in a content-addressed cache, so an unchanged rebuild compiles nothing and editing
one template recompiles only the kernels rendered from it. Compiles run in parallel worker
processes (spawned clean: TRITON_INTERPRET must not leak into them).
"""
import concurrent.futures as cf
import hashlib
import importlib.metadata
import json
import multiprocessing
import os
import re
import shutil
import sys
import time
from pathlib import Path

from infc import envs

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(envs.value("INFC_CACHE"))
# Bump when the way kernels are compiled changes (options, attributes): it is part of the key.
AOT_REVISION = "2-ptr-align16"


def _version(pkg: str) -> str:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def toolchain(backend: str) -> str:
    if backend == "triton":
        return "triton-" + _version("triton")
    if backend == "tilelang":
        return "tilelang-" + _version("tilelang") + "+nvcc"
    return "nvcc"


def cache_key(kernel, target: str) -> str:
    h = hashlib.sha256()
    for part in (AOT_REVISION, kernel.backend, toolchain(kernel.backend), target, kernel.source):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:24]


# The most shared memory one block may use, by architecture (the opt-in maximum): a kernel past
# it compiles but cannot launch (cuFuncSetAttribute fails on the GPU), so the build refuses it.
MAX_SHARED = {80: 166912, 86: 101376, 89: 101376, 90: 232448}


def check_shared(info: dict, target: str, what: str):
    limit = MAX_SHARED.get(_arch_number(target))
    need = int(info.get("dynamic_shared", info.get("shared", 0)))
    if limit is not None and need > limit:
        raise RuntimeError(f"{what}: needs {need} bytes of shared memory, past {target}'s {limit}: "
                           f"smaller tiles or fewer stages (its tune)")


def _arch_number(target: str) -> int:
    m = re.fullmatch(r"sm_(\d+)a?", target)
    if not m:
        raise ValueError(f"unknown target '{target}' (expected sm_XY, e.g. sm_90)")
    return int(m.group(1))


def _compile_triton(source: str, meta: dict, target: str, workdir: Path) -> tuple[bytes, dict]:
    import importlib.util

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    path = workdir / "kernel.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(f"infc_kernel_{workdir.name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    fn = getattr(mod, meta["entry"])
    sig = {name: ty for name, ty, _ in meta["params"]}
    sig.update({k: "constexpr" for k in meta["constexprs"]})
    # Every pointer the runtime passes is 16-byte aligned (cuMemAlloc'd, arena offsets are
    # multiples of 256): telling Triton so turns 2-byte loads into 16-byte ones and enables
    # cp.async pipelining.
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]]
             for name, ty, _ in meta["params"] if ty.startswith("*")}
    options = {"num_warps": meta.get("num_warps", 4), "num_stages": meta.get("num_stages", 2)}
    if meta.get("maxnreg"):
        # a register cap (PTX .maxnreg): a kernel whose rarely taken branch would otherwise set its
        # register count (and so how many programs an SM holds) for every branch
        options["maxnreg"] = meta["maxnreg"]
    compiled = triton.compile(ASTSource(fn, sig, constexprs=meta["constexprs"], attrs=attrs),
                              target=GPUTarget("cuda", _arch_number(target), 32), options=options)
    md = compiled.metadata
    ptx = compiled.asm["ptx"]
    entry = re.search(r"\.entry\s+(\w+)\s*\((.*?)\)", ptx, re.S)
    n_ptx_params = len(re.findall(r"\.param\s", entry.group(2))) if entry else len(meta["params"])
    info = {"name": compiled.name, "num_warps": md.num_warps, "shared": md.shared,
            "global_scratch_size": md.global_scratch_size, "global_scratch_align": md.global_scratch_align,
            "profile_scratch_size": getattr(md, "profile_scratch_size", 0),
            "hidden_args": n_ptx_params - len(meta["params"]),
            "block": [md.num_warps * 32, 1, 1], "toolchain": toolchain("triton"), "target": target}
    (workdir / "kernel.ptx").write_text(ptx)
    return compiled.asm["cubin"], info


def compile_one(backend: str, source: str, meta: dict, target: str, key: str) -> dict:
    """Worker: compile into CACHE/key/ (kernel.cubin + kernel.json); returns the json."""
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    out = CACHE / key
    done = out / "kernel.json"
    what = f"{meta.get('entry', 'kernel')} ({backend}, {key})"
    if done.exists():
        info = json.loads(done.read_text())
        check_shared(info, target, what)
        return info
    tmp = CACHE / f"{key}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    t0 = time.perf_counter()
    if backend == "triton":
        cubin, info = _compile_triton(source, meta, target, tmp)
    elif backend == "cuda":
        from .backend_cuda import compile_cuda
        cubin, info = compile_cuda(source, meta, target, tmp)
    elif backend == "tilelang":
        from .backend_tilelang import compile_tilelang
        cubin, info = compile_tilelang(source, meta, target, tmp)
    else:
        raise ValueError(f"unknown backend '{backend}'")
    check_shared(info, target, what)
    info["compile_s"] = round(time.perf_counter() - t0, 2)
    info["aot_revision"] = AOT_REVISION
    (tmp / "kernel.cubin").write_bytes(cubin)
    (tmp / "kernel.json").write_text(json.dumps(info, indent=1, sort_keys=True) + "\n")
    try:
        tmp.rename(out)
    except OSError:            # another process finished it first
        shutil.rmtree(tmp, ignore_errors=True)
    return json.loads(done.read_text())


def _bar(done: int, total: int, t0: float, name: str = ""):
    if not sys.stderr.isatty() and done not in (0, total) and done % 5:
        return
    width = 30
    fill = width * done // max(total, 1)
    sys.stderr.write(f"\r  compiling [{'#' * fill}{'.' * (width - fill)}] {done}/{total} "
                     f"{time.perf_counter() - t0:5.1f} s {name[:40]:<40}")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def _in_artifact(bin_dir: Path, kid: str, target: str) -> bool:
    try:
        info = json.loads((bin_dir / f"{kid}.json").read_text())
    except (FileNotFoundError, ValueError):
        return False
    return (info.get("target") == target and info.get("aot_revision") == AOT_REVISION
            and (bin_dir / f"{kid}.cubin").is_file())


def compile_kernels(kernels: dict, bin_dir: Path, target: str = "sm_90", jobs: int | None = None,
                    progress: bool = True) -> dict:
    """Compile every kernel (cached), copy cubin + json into bin_dir; returns id -> info."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    keys = {kid: cache_key(k, target) for kid, k in kernels.items()}
    # a kernel id is its source's hash: a cubin the artifact already holds for this target is that
    # source compiled (by the build machine's toolchain), so re-rendering an artifact for another
    # tuning table on the GPU machine, whose Triton differs, compiles nothing it already has
    kept = {kid for kid in kernels if _in_artifact(bin_dir, kid, target)}
    todo = {kid: k for kid, k in kernels.items()
            if kid not in kept and not (CACHE / keys[kid] / "kernel.json").exists()}
    t0 = time.perf_counter()
    if todo:
        jobs = jobs or min(len(todo), os.cpu_count() or 1)
        ctx = multiprocessing.get_context("spawn")
        done = 0
        if progress:
            _bar(0, len(todo), t0)
        with cf.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
            futs = {pool.submit(compile_one, k.backend, k.source, k.meta, target, keys[kid]): kid
                    for kid, k in sorted(todo.items())}
            for fut in cf.as_completed(futs):
                kid = futs[fut]
                try:
                    fut.result()
                except Exception as e:
                    for f in futs:
                        f.cancel()
                    raise RuntimeError(f"compiling kernel {kid} ({kernels[kid].backend}) failed: "
                                       f"{type(e).__name__}: {e}") from None
                done += 1
                if progress:
                    _bar(done, len(todo), t0, kid)
    infos = {}
    for kid in sorted(kernels):
        if kid in kept:
            infos[kid] = json.loads((bin_dir / f"{kid}.json").read_text())
            continue
        src = CACHE / keys[kid]
        shutil.copyfile(src / "kernel.cubin", bin_dir / f"{kid}.cubin")
        info = json.loads((src / "kernel.json").read_text())
        info["cache_key"] = keys[kid]
        info["aot_revision"] = AOT_REVISION     # the key holds it: entries older than the field too
        (bin_dir / f"{kid}.json").write_text(json.dumps(info, indent=1, sort_keys=True) + "\n")
        infos[kid] = info
    return {"kernels": infos, "compiled": sorted(todo), "seconds": time.perf_counter() - t0}
