"""An experiment for issue 10's long prefills: how much do Qwen3-4B's prefill GEMMs gain from
TMA loads and a persistent tile loop, against the plan's pointer-load kernels (cp.async)?

At 8,192 tokens (bench/NOTES.md, f155b7c, H100) the plan's GEMMs run at 55-62 % of the bf16 peak.
Variants, each on the plan's shapes (gate|up with the gated epilogue, down, qkv, o_proj):
  plan        the kernel the plan renders (generated/qwen3-4b, the h200 table: 128 x 256 / 128 x 128)
  tma         the same tiles, A and W through device-side TMA descriptors (tl.make_tensor_descriptor)
  tma_pers    tma with one program per SM looping over the tiles (grouped order)
  torch       cuBLAS (torch.matmul) for the plain ones: a ceiling, not a candidate
The gated variants load the gate and up rows of a tile as one [2, BN/2, BK] box of W seen as
[2, F, K], so one dot covers both (cols 0..BN/2-1 gate, BN/2.. up); the epilogue is the plan's.
Checks every variant against the plan's output (max relative difference).
Run on the GPU: python3 bench/experiments/gemm_tma.py OUT_DIR (torch + triton there).
"""
import importlib.util
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

REPO = Path(__file__).resolve().parents[2]
SHAPES = {"gate_up": (2560, 9728, True), "down": (9728, 2560, False), "qkv": (2560, 6144, False),
          "o_proj": (4096, 2560, False)}          # name: (K, N out, gated)


@triton.jit
def _tile_of(t, num_m, num_n, GROUP_M: tl.constexpr):
    group = t // (GROUP_M * num_n)
    first_m = group * GROUP_M
    size = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (t % (GROUP_M * num_n)) % size, (t % (GROUP_M * num_n)) // size


@triton.jit
def _one_tile(a_desc, w_desc, y_desc, pid_m, pid_n, N: tl.constexpr, K: tl.constexpr, BM: tl.constexpr,
              BN: tl.constexpr, BK: tl.constexpr, GATED: tl.constexpr, DOT_F32: tl.constexpr):
    acc = tl.zeros([BM, BN], tl.float32)
    for k in tl.range(0, K, BK):
        a = a_desc.load([pid_m * BM, k])
        if GATED:
            w = tl.reshape(w_desc.load([0, pid_n * (BN // 2), k]), [BN, BK])
        else:
            w = w_desc.load([pid_n * BN, k])
        if DOT_F32:       # the interpreter (a CPU check of this file) runs bf16 dots wrong
            acc = tl.dot(a.to(tl.float32), w.to(tl.float32).T, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w.T, acc)
    if GATED:
        g, u = tl.split(tl.permute(tl.reshape(acc, [BM, 2, BN // 2]), (0, 2, 1)))
        g = g.to(tl.bfloat16).to(tl.float32)
        u = u.to(tl.bfloat16).to(tl.float32)
        a = (g / (1.0 + tl.exp(-g))).to(tl.bfloat16).to(tl.float32)
        y_desc.store([pid_m * BM, pid_n * (BN // 2)], (a * u).to(tl.bfloat16))
    else:
        y_desc.store([pid_m * BM, pid_n * BN], acc.to(tl.bfloat16))


@triton.jit
def gemm_tma(a_ptr, w_ptr, y_ptr, T, N: tl.constexpr, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
             BK: tl.constexpr, GROUP_M: tl.constexpr, GATED: tl.constexpr, PERSISTENT: tl.constexpr,
             NUM_SMS: tl.constexpr, DOT_F32: tl.constexpr = False):
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[T, K], strides=[K, 1], block_shape=[BM, BK])
    if GATED:
        w_desc = tl.make_tensor_descriptor(w_ptr, shape=[2, N, K], strides=[N * K, K, 1],
                                           block_shape=[2, BN // 2, BK])
        y_desc = tl.make_tensor_descriptor(y_ptr, shape=[T, N], strides=[N, 1], block_shape=[BM, BN // 2])
        num_n = tl.cdiv(N, BN // 2)
    else:
        w_desc = tl.make_tensor_descriptor(w_ptr, shape=[N, K], strides=[K, 1], block_shape=[BN, BK])
        y_desc = tl.make_tensor_descriptor(y_ptr, shape=[T, N], strides=[N, 1], block_shape=[BM, BN])
        num_n = tl.cdiv(N, BN)
    num_m = tl.cdiv(T, BM)
    if PERSISTENT:
        for t in tl.range(tl.program_id(0), num_m * num_n, NUM_SMS, flatten=True):
            pid_m, pid_n = _tile_of(t, num_m, num_n, GROUP_M)
            _one_tile(a_desc, w_desc, y_desc, pid_m, pid_n, N, K, BM, BN, BK, GATED, DOT_F32)
    else:
        pid_m, pid_n = _tile_of(tl.program_id(0), num_m, num_n, GROUP_M)
        _one_tile(a_desc, w_desc, y_desc, pid_m, pid_n, N, K, BM, BN, BK, GATED, DOT_F32)


def plan_kernel(K, N, gated):
    """The generated qwen3-4b kernel for this linear (the committed h200-table rendering)."""
    want = f'"N": {N}, "K": {K},'
    for f in sorted((REPO / "generated/qwen3-4b/kernels").glob("gemm_gated_*.py" if gated else "gemm_[0-9a-f]*.py")):
        text = f.read_text()
        if want in text:
            spec = importlib.util.spec_from_file_location(f"plan_{f.stem}", f)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            return mod
    raise SystemExit(f"no generated kernel for K={K} N={N}")


def plan_launcher(mod, tensors, T):
    meta = mod.META
    fn = getattr(mod, meta["entry"])
    args = [T if src.startswith("dim:") else tensors[src] for _, _, src in meta["params"]]
    env = {"cdiv": triton.cdiv, "max": max, "min": min, "T": T, "B": 1}
    grid = tuple(int(eval(str(g), env)) for g in meta["grid"])
    kw = dict(meta["constexprs"], num_warps=meta["num_warps"], num_stages=meta["num_stages"])
    return lambda: fn[grid](*args, **kw), meta


def main(out: Path):
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    res = {"gpu": torch.cuda.get_device_name(), "triton": triton.__version__, "runs": []}
    for T in (1024, 8192):
        for name, (K, N, gated) in SHAPES.items():
            torch.manual_seed(0)
            x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
            w = torch.randn((2 * N if gated else N), K, device="cuda", dtype=torch.bfloat16) * K ** -0.5
            ys = {}
            fns = {}
            ys["plan"] = torch.empty(T, N, device="cuda", dtype=torch.bfloat16)
            fns["plan"], meta = plan_launcher(plan_kernel(K, N, gated), {"in:0": x, "in:1": w, "out:0": ys["plan"]}, T)
            c = meta["constexprs"]
            for variant, pers in (("tma", False), ("tma_pers", True)):
                for stages in (3, 4):
                    for bn in ((256, 128) if not gated else (256,)):
                        key = f"{variant}_{c['BLOCK_M']}x{bn}_s{stages}"
                        ys[key] = torch.empty(T, N, device="cuda", dtype=torch.bfloat16)
                        tiles = triton.cdiv(T, c["BLOCK_M"]) * triton.cdiv(N, bn // 2 if gated else bn)
                        grid = (min(sms, tiles),) if pers else (tiles,)
                        kw = dict(N=N, K=K, BM=c["BLOCK_M"], BN=bn, BK=64, GROUP_M=8, GATED=gated,
                                  PERSISTENT=pers, NUM_SMS=sms, num_warps=8, num_stages=stages)
                        fns[key] = (lambda g=grid, y=ys[key], kw=kw: gemm_tma[g](x, w, y, T, **kw))
            if not gated:
                ys["torch"] = torch.empty(T, N, device="cuda", dtype=torch.bfloat16)
                fns["torch"] = lambda: torch.matmul(x, w.T, out=ys["torch"])
            flops = 2 * T * K * (2 * N if gated else N)
            row = {"T": T, "linear": name, "K": K, "N": N, "gated": gated, "us": {}, "tflops": {},
                   "max_rel_diff_vs_plan": {}, "plan_tiles": [c["BLOCK_M"], c["BLOCK_N"], meta["num_stages"]]}
            for k, f in fns.items():
                try:
                    f()
                    torch.cuda.synchronize()
                    us = triton.testing.do_bench(f, warmup=25, rep=200, return_mode="median") * 1e3
                except Exception as e:          # a variant that does not compile here is reported
                    row["us"][k] = repr(e)[:200]
                    continue
                row["us"][k] = us
                row["tflops"][k] = flops / us / 1e6
            ref = ys["plan"].float()
            for k, y in ys.items():
                if isinstance(row["us"].get(k), float):
                    row["max_rel_diff_vs_plan"][k] = float((y.float() - ref).abs().max() / ref.abs().max())
            res["runs"].append(row)
            best = max(row["tflops"], key=row["tflops"].get)
            print(f"T={T} {name}: plan {row['tflops'].get('plan', 0):.0f} TFLOP/s; best {best} "
                  f"{row['tflops'][best]:.0f}; " + ", ".join(f"{k} {v:.0f}" for k, v in row["tflops"].items()),
                  flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "exp-gemm-tma.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/exp-gemm-tma"))
