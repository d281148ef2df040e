"""Run one rendered Triton kernel under TRITON_INTERPRET=1 with torch CPU tensors.

`bindings` maps parameter sources ("in:0", "out:1", "meta:positions", "cache:k", ...) to tensors
or ints; dims gives T and B; scratch is allocated from META: counters zeroed, the rest NaN.
Kernels using tl.dot take a DOT_F32 constexpr: the interpreter's bf16 dot is wrong, so it is set True here; and a PDL
constexpr (griddepcontrol, which the interpreter lacks) is set False (`interpreter_constexprs`).
"""
import importlib.util
import os
import sys
from pathlib import Path

import numpy as np
import torch

from infc.compiler.codegen.render import render_template
from infc.compiler.contract.bind import LORA_SETS, Resolver, grid, scratch_sizes

assert os.environ.get("TRITON_INTERPRET") == "1", "tests/conftest.py sets TRITON_INTERPRET=1"

SRC_CACHE = Path(__file__).resolve().parents[2] / ".cache" / "interp_kernels"


def _round_to_nearest_bf16():
    """Triton's interpreter converts fp32 -> bf16 by truncation (round toward zero); the GPU rounds
    to nearest even (cvt.rn). Kernels that round intermediates to bf16 (as the unfused model
    stores them) would show a biased, ~2x larger error here than on the GPU, so round as it does."""
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    truncate = builder.create_fp_trunc

    def fp_trunc(self, src, dst_type):
        if src.dtype.scalar != tl.float32 or dst_type.scalar != tl.bfloat16:
            return truncate(self, src, dst_type)
        bits = np.asarray(src.data, np.float32).view(np.uint32).astype(np.uint64)
        out = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        nan = np.isnan(np.asarray(src.data, np.float32))
        out[nan] = ((bits[nan] >> 16) | 0x40).astype(np.uint16)
        return interpreter.TensorHandle(out, tl.bfloat16)

    builder.create_fp_trunc = fp_trunc


_round_to_nearest_bf16()


def _round_to_nearest_e4m3():
    """The interpreter's fp32 -> fp8e4nv conversion truncates the mantissa and lets a carry spill
    into the exponent (1.94 -> 1.0, 127.0 -> 64.0); the GPU rounds to nearest even and saturates at
    +-448 (cvt.rn.satfinite.e4m3x2.f32). Activation quantization (compiler/ops/quant.py) and the FP8
    KV cache's writes cast to e4m3, so convert as the GPU does: torch's cast (ties to even) after
    the clamp."""
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    to_fp = builder.create_fp_to_fp

    def fp_to_fp(self, src, dst_type, rounding_mode):
        if src.dtype.scalar not in (tl.float32, tl.float16) or dst_type.scalar != tl.float8e4nv:
            return to_fp(self, src, dst_type, rounding_mode)
        v = torch.from_numpy(np.asarray(src.data).astype(np.float32))
        out = v.clamp(-448.0, 448.0).where(~v.isnan(), v).to(torch.float8_e4m3fn).view(torch.uint8)
        return interpreter.TensorHandle(out.numpy(), tl.float8e4nv)

    builder.create_fp_to_fp = fp_to_fp


_round_to_nearest_e4m3()


def _host_allocator():
    """Kernels that make TMA descriptors on the device (the GEMM's) keep them in Triton's global
    scratch; under the interpreter that is host memory from this allocator."""
    import triton
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8))


_host_allocator()

_modules = {}
TORCH = {"bf16": torch.bfloat16, "f32": torch.float32, "i32": torch.int32, "f16": torch.float16,
         "f8e4m3": torch.float8_e4m3fn, "u8": torch.uint8}


def load(kernel):
    if kernel.id not in _modules:
        SRC_CACHE.mkdir(parents=True, exist_ok=True)
        path = SRC_CACHE / f"{kernel.id}.py"
        # written whole, then renamed: parallel test workers (pytest -n) load the same kernels
        tmp = path.with_name(f".{kernel.id}.{os.getpid()}.tmp")
        tmp.write_text(kernel.source)
        os.replace(tmp, path)
        spec = importlib.util.spec_from_file_location(f"interp_{kernel.id}", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        _modules[kernel.id] = mod
    return _modules[kernel.id]


def _nan_bits(n, dtype):
    return torch.full((n,), -1, dtype=dtype)         # 0xFFFFFFFF: NaN as f32, NaN pairs as bf16


def run(kernel, bindings: dict, dims: dict, layer=None, scratch=None):
    """scratch: an earlier run's (this kernel's launches sharing it, as the runtime's do), else
    new: counters (and a LoRA site's sets of sync words) zero, the rest NaN bits."""
    meta = kernel.meta
    # counters start zero (the runtime zeroes them once; kernels leave them zero); any other
    # scratch (partial sums) holds what earlier launches left there: NaN bits here, so that a
    # kernel reading a partial it never wrote fails
    if scratch is None:
        scratch = {n: (torch.zeros if n.startswith(("counter", LORA_SETS)) else _nan_bits)(
                   max(b, 4) // 4 + 1, dtype=torch.int32) for n, b in scratch_sizes(meta, dims).items()}

    # the launch's inputs/outputs are named by their sources here: bindings["in:0"] is input 0
    n = len(meta["params"])
    resolver = Resolver(tensor=lambda name, layer: bindings[name], cache=lambda name, layer: bindings[f"cache:{name}"],
                        meta=lambda name: bindings[f"meta:{name}"], scratch=lambda k, name: scratch[name],
                        dim=dims.__getitem__, arg=lambda name: bindings[f"arg:{name}"],
                        scale=lambda name, layer: bindings[f"scale:{name}"])
    args = resolver.values(meta, [f"in:{i}" for i in range(n)], [f"out:{i}" for i in range(n)], layer=layer,
                           kernel=kernel.id)
    consts = interpreter_constexprs(meta)
    fn = getattr(load(kernel), meta["entry"])
    fn[grid(meta, dims)](*args, **consts)
    for n, s in scratch.items():
        assert int(s.abs().sum()) == 0 or not n.startswith("counter"), f"counter scratch '{n}' not reset"
    return scratch


def interpreter_constexprs(meta: dict) -> dict:
    """META's constexprs as the interpreter must run them: fp32 dots (its bf16 dot is wrong)
    and no programmatic dependent launch (it has no griddepcontrol)."""
    consts = dict(meta["constexprs"])
    if "DOT_F32" in consts:
        consts["DOT_F32"] = True
    if "PDL" in consts:
        consts["PDL"] = False
    return consts


def render(template, op, inputs, outputs, attrs=None, phase="decode", config=None, caches=None, page_size=16,
           tune=None, backend="triton", prologue=None, narrow=False, lora=None, epilogue=None, row_cap=0):
    """Render with a launch context built from (name, shape, dtype[, kind[, extra keys]]) tensor
    specs (extra keys: e.g. {"row_stride": n}); caches as the plan declares them (page_size is
    added to each entry, as launch_context does); prologue: a merged launch's launch["prologue"];
    narrow: a narrow step's launch (phase "decode", as launch_context renders it): True for the
    one-token narrow program, N for a speculative build's verify program of N rows
    (plan["verify_tokens"]); lora: a LoRA site's launch["lora"] (compiler/passes/merge_lora.py);
    epilogue: a launch["epilogue"] (compiler/passes/merge_epilogues.py); row_cap: the most rows a
    decode launch takes (render.row_cap)."""
    def t(spec):
        name, shape, dtype = spec[:3]
        kind = spec[3] if len(spec) > 3 else "buffer"
        return {"name": name, "shape": list(shape), "dtype": dtype, "kind": kind, **(spec[4] if len(spec) > 4 else {})}
    ctx = {"op": op, "phase": phase, "narrow": bool(narrow), "narrow_rows": int(narrow), "inputs": [t(s) for s in inputs], "outputs": [t(s) for s in outputs],
           "attrs": attrs or {}, "prologue": prologue, "lora": lora,
           "epilogue": epilogue, "config": config or {}, "row_cap": row_cap,
           "caches": {n: {**c, "page_size": page_size} for n, c in (caches or {}).items()},
           "page_size": page_size, "tune": tune or {}}
    return render_template(backend, template, ctx)


def rand(shape, dtype="bf16", scale=1.0, gen=None):
    gen = gen or np.random.default_rng(0)
    return torch.from_numpy((gen.standard_normal(shape) * scale).astype(np.float32)).to(TORCH[dtype])


def poison(shape, dtype="bf16"):
    """An output buffer full of NaN (or a sentinel for ints): unwritten elements show up."""
    if dtype == "i32":
        return torch.full(shape, -7777, dtype=torch.int32)
    return torch.full(shape, float("nan"), dtype=TORCH[dtype])


def bf16(a):
    """Round to bf16 (round to nearest even, as torch and the GPU do), back to float32 numpy."""
    return torch.as_tensor(np.asarray(a, np.float32)).to(torch.bfloat16).float().numpy()


def rel_err(got, want) -> float:
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    assert not np.isnan(got).any(), "NaN in output (unwritten or bad math)"
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))
