"""Issue 10 fix 2, an experiment: why does gemm_act_mul (Qwen3-4B's down projection with SwiGLU in
its A-operand load, N=2560, K=9728) take the same ~216 us at T=32 and T=1024 on an H100?

Hypothesis: the prologue, not the tiles. Every one of the N / BLOCK_N = 10 column tiles recomputes
silu(g) * u for its rows, and silu as written, g / (1 + exp(-g)), is an IEEE fp32 division (a
multi-instruction sequence) plus an exp per element: ~10x T x K of special-function work. Timed
variants on the same shapes (kernel sources rendered from this commit's templates, k_*.py here):
  fused        the plan's gemm_act_mul as built
  fused_fdiv   the same with an approximate division (div.full.f32, 2 ulp; then rounded to bf16)
  fused_sigm   the same with g * sigmoid(g)
  split        silu + mul elementwise kernels (the unfused plan's), then the plain GEMM over [T, K]
  gemm_only    the plain GEMM alone: the floor of any split design
Run on the GPU: python3 bench/experiments/gemm_act_mul.py OUT_DIR (torch + triton there).
"""
import importlib.util
import json
import sys
from pathlib import Path

import torch
import triton

HERE = Path(__file__).resolve().parent
SILU = "(g / (1.0 + tl.exp(-g)))"


def module(name, text):
    path = Path("/tmp") / f"exp_{name}.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(f"exp_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def launcher(mod, tensors, T):
    meta = mod.META
    fn = getattr(mod, meta["entry"])
    args = []
    for _, _, src in meta["params"]:
        args.append(T if src.startswith("dim:") else tensors[src])
    env = {"cdiv": triton.cdiv, "max": max, "min": min, "T": T, "B": 1}
    grid = tuple(int(eval(str(g), env)) for g in meta["grid"])
    kw = dict(meta["constexprs"], num_warps=meta["num_warps"], num_stages=meta["num_stages"])
    return lambda: fn[grid](*args, **kw)


def main(out: Path):
    src = (HERE / "k_gemm_act_mul.py").read_text()
    assert SILU in src, "the rendered silu changed: update the experiment"
    fused = {"fused": module("fused", src),
             "fused_fdiv": module("fdiv", src.replace(SILU, "tl.fdiv(g, 1.0 + tl.exp(-g), ieee_rounding=False)")),
             "fused_sigm": module("sigm", src.replace(SILU, "(g * tl.sigmoid(g))"))}
    gemm = module("gemm", (HERE / "k_gemm_down.py").read_text())
    silu = module("silu", (HERE / "k_silu.py").read_text())
    mul = module("mul", (HERE / "k_mul.py").read_text())
    N, K = 2560, 9728
    res = {"gpu": torch.cuda.get_device_name(), "N": N, "K": K, "runs": {}}
    for T in (32, 1024, 8192):
        torch.manual_seed(0)
        gu = torch.randn(T, 2 * K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K ** -0.5
        y = {k: torch.empty(T, N, device="cuda", dtype=torch.bfloat16) for k in list(fused) + ["split"]}
        a = torch.empty(T, K, device="cuda", dtype=torch.bfloat16)
        s = torch.empty(T, K, device="cuda", dtype=torch.bfloat16)
        g, u = gu[:, :K].contiguous(), gu[:, K:].contiguous()
        fns = {k: launcher(m, {"in:0": gu, "in:1": w, "out:0": y[k]}, T) for k, m in fused.items()}
        l_silu = launcher(silu, {"in:0": g, "out:0": s}, T)
        l_mul = launcher(mul, {"in:0": s, "in:1": u, "out:0": a}, T)
        l_gemm = launcher(gemm, {"in:0": a, "in:1": w, "out:0": y["split"]}, T)
        fns["split"] = lambda: (l_silu(), l_mul(), l_gemm())
        fns["gemm_only"] = l_gemm
        row = {}
        for k, f in fns.items():
            f()
            torch.cuda.synchronize()
            row[k] = triton.testing.do_bench(f, warmup=25, rep=200, return_mode="median") * 1e3
        ref = y["fused"].float()
        err = {k: float((y[k].float() - ref).abs().max() / ref.abs().max()) for k in y}
        res["runs"][T] = {"us": row, "max_rel_diff_vs_fused": err,
                          "tflops": {k: 2 * T * N * K / (v * 1e-6) / 1e12 for k, v in row.items()}}
        print(f"T={T}: " + ", ".join(f"{k} {v:.1f} us" for k, v in row.items()), "| diff", err, flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "exp-gemm-act-mul.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp"))
