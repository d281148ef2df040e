"""TileLang kernels: rendered Python module -> TileLang program -> CUDA C++ -> cubin, no GPU needed.

A TileLang template renders a module that defines
  program()      -> the @T.prim_func (one T.Kernel: one CUDA kernel),
  PASS_CONFIGS   -> TileLang pass configs (optional),
  META           -> the launch contract (docs/kernels.md), literal.
`compile_tilelang` executes the module from a file (TileLang parses the prim_func's own source
through `inspect`, so exec() of a string does not work), lowers it offline for the target (the
recipe in docs/architecture.md, "Toolchain facts": a dict target inside a TVM target context, which needs no GPU), takes the
generated CUDA source, builds it with nvcc, and checks that the kernel TileLang produced is
exactly the one META describes: entry symbol, parameters in order (names and types), block,
dynamic shared memory and grid (evaluated at several T/B). Any difference is an error naming both
sides, so a cubin never exists with a META that misdescribes it.

TileLang (and through it torch, z3, tvm-ffi) is needed at build time only; the runtime loads the
cubin like any other. Imports are deferred so that importing this module costs nothing.
"""
import importlib.util
import sys
from pathlib import Path

from .backend_cuda import CudaCompileError, check_params, cubin_info, nvcc_cubin, parse_ptxas


class TileLangCompileError(Exception):
    pass


# The TIR dtype of a kernel parameter -> META's type spelling (render.PTR for pointers).
_ELEM = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "int32": "i32", "int64": "i64",
         "uint8": "u8", "int8": "i8"}
_SCALAR = {"int32": "i32", "int64": "i64", "float32": "f32"}
_SAMPLES = (1, 3, 64, 129, 1000, 4097)


def tl_target(arch: str) -> dict:
    """sm_90 -> sm_90a (wgmma needs it; an sm_90a cubin runs on every H100/H200)."""
    if arch in ("sm_90", "sm_90a"):
        return {"kind": "cuda", "arch": "sm_90a"}
    return {"kind": "cuda", "arch": arch}


def load_program(source: str, workdir: Path, name: str):
    """Import the rendered module from a file so that TileLang can read the prim_func's source."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / f"{name}_program.py"
    path.write_text(source)
    modname = f"infc_tilelang_{name}_{abs(hash(source)) & 0xFFFFFFFF:08x}"
    spec = importlib.util.spec_from_file_location(modname, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[modname] = mod
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.modules.pop(modname, None)
    if not hasattr(mod, "program"):
        raise TileLangCompileError(f"{path}: a TileLang template must define program()")
    return mod


def _param_type(var) -> str:
    ann = var.type_annotation
    if var.dtype == "handle":
        elem = getattr(ann, "element_type", None)
        dt = str(getattr(elem, "dtype", elem))
        if "grid_constant" in str(getattr(ann, "storage_scope", "")) or dt == "uint8x128":
            return "tensormap"   # a CUtensorMap passed by value (TMA)
        if dt not in _ELEM:
            raise TileLangCompileError(f"kernel parameter {var.name}: unsupported pointer type {ann}")
        return "*" + _ELEM[dt]
    if str(var.dtype) not in _SCALAR:
        raise TileLangCompileError(f"kernel parameter {var.name}: unsupported scalar type {var.dtype}")
    return _SCALAR[str(var.dtype)]


def _meta_type(ty: str) -> str:
    """META spellings that mean the same parameter type ("*f32" and "*fp32", "*f16" and "*fp16")."""
    return {"*f32": "*fp32", "*f16": "*fp16"}.get(ty, ty)


def _eval(expr, values: dict, tvm) -> int:
    if isinstance(expr, int):
        return expr
    from tvm import tirx
    free = {}

    def visit(n):
        if isinstance(n, tirx.Var):
            free[n.name] = n

    tirx.stmt_functor.post_order_visit(expr, visit)
    missing = sorted(set(free) - set(values))
    if missing:
        raise TileLangCompileError(f"launch extent {expr} depends on {missing}; grids may depend "
                                   f"only on T and B")
    sub = {v: tirx.IntImm(v.dtype, values[n]) for n, v in free.items()}
    out = tvm.arith.Analyzer().simplify(tirx.stmt_functor.substitute(expr, sub))
    return int(out)


def lower(source: str, meta: dict, arch: str, workdir: Path):
    """Run TileLang: returns (CUDA source, kernel description from the lowered device function)."""
    import tilelang
    from tilelang import tvm
    from tvm.target import Target

    mod = load_program(source, workdir, meta["entry"])
    func = mod.program()
    target = Target(tl_target(arch))
    with tvm.transform.PassContext(opt_level=3, config=dict(getattr(mod, "PASS_CONFIGS", {}))), target:
        art = tilelang.lower(func, target=target)
    kernels = list(art.device_mod.functions.items())
    if len(kernels) != 1:
        names = [gv.name_hint for gv, _ in kernels]
        raise TileLangCompileError(f"TileLang produced {len(kernels)} kernels {names}; a template must "
                                   f"make exactly one (one T.Kernel)")
    _, fn = kernels[0]
    ext = fn.attrs["thread_extent"]
    desc = {
        "name": str(fn.attrs["global_symbol"]),
        "params": [[p.name, _param_type(p)] for p in fn.params],
        "block": [int(ext[k]) if k in ext else 1 for k in ("threadIdx.x", "threadIdx.y", "threadIdx.z")],
        "grid": [ext[k] if k in ext else 1 for k in ("blockIdx.x", "blockIdx.y", "blockIdx.z")],
        "shared": int(fn.attrs["dyn_shared_memory_buf"]) if "dyn_shared_memory_buf" in fn.attrs else 0,
        "has_tma": "CUtensorMap" in art.kernel_source,
    }
    return art.kernel_source, desc, tvm


def check(meta: dict, desc: dict, tvm):
    """META must describe the lowered kernel exactly."""
    from infc.compiler.contract.bind import grid as meta_grid
    entry = meta["entry"]
    problems = []
    if desc["name"] != entry:
        problems.append(f"entry: META says '{entry}', TileLang named the kernel '{desc['name']}'")
    got = [[n, t] for n, t in desc["params"]]
    want = [[n, _meta_type(t)] for n, t, _ in meta["params"]]
    if got != want:
        problems.append(f"params: META {want}, kernel {got}")
    if list(meta.get("block", [])) + [1] * (3 - len(meta.get("block", []))) != desc["block"]:
        problems.append(f"block: META {meta.get('block')}, kernel {desc['block']}")
    if meta.get("shared", 0) != desc["shared"]:
        problems.append(f"shared (dynamic smem bytes): META {meta.get('shared', 0)}, kernel {desc['shared']}")
    for v in _SAMPLES:
        dims = {"T": v, "B": v}
        g = [_eval(e, dims, tvm) for e in desc["grid"]]
        if list(meta_grid(meta, dims)) != g:
            problems.append(f"grid at T=B={v}: META {list(meta_grid(meta, dims))}, kernel {g} "
                            f"({[str(e) for e in desc['grid']]})")
            break
    if problems:
        raise TileLangCompileError(f"{entry}: META does not describe the lowered kernel:\n  "
                                   + "\n  ".join(problems))


def compile_tilelang(source: str, meta: dict, arch: str, workdir: Path) -> tuple[bytes, dict]:
    """Lower a rendered TileLang template and build its CUDA source into a cubin. Returns
    (cubin, {"name", "shared": static smem bytes, "dynamic_shared", "num_regs", "hidden_args": 0,
    "block", "grid" (META's, checked against the kernel's), "params": [[name, type]] in the kernel's
    order, "arch"})."""
    from tilelang.env import CUTLASS_INCLUDE_DIR, TILELANG_TEMPLATE_PATH

    workdir = Path(workdir)
    cuda_source, desc, tvm = lower(source, meta, arch, workdir)
    check(meta, desc, tvm)
    entry = desc["name"]
    # TileLang's own nvcc line (jit/adapter/libgen.py): C++20 for its reduce.h, cutlass and tl_templates.
    try:
        cubin, report = nvcc_cubin(cuda_source, arch, workdir, entry, std="c++20",
                                   extra=["-w", "-Xcudafe", "--diag_suppress=177",
                                          "-I", CUTLASS_INCLUDE_DIR, "-I", TILELANG_TEMPLATE_PATH])
    except CudaCompileError as e:
        raise TileLangCompileError(str(e)) from None
    info = cubin_info(cubin)
    if entry not in info["kernels"]:
        raise TileLangCompileError(f"cubin has no kernel '{entry}' (has {sorted(info['kernels'])})")
    try:
        check_params(meta, info["kernels"][entry], entry)
    except CudaCompileError as e:
        raise TileLangCompileError(str(e)) from None
    ptx = parse_ptxas(report, entry)
    return cubin, {"name": entry, "shared": ptx.get("shared", 0), "dynamic_shared": desc["shared"],
                   "num_regs": ptx.get("num_regs"), "hidden_args": 0, "block": desc["block"],
                   "grid": list(meta["grid"]), "params": desc["params"],
                   "arch": info["arch"]}
