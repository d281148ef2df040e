"""Issue 42 probe (GPU machine, JIT: torch + the device's Triton): what a batch-1 FP8 GEMV's inner
loop costs beside bf16's, on qwen3-4b's decode shapes, to choose the narrow kernel's design.

    python3 tools/experiments/fp8_gemv_probe.py [--out DIR]

y[n] = sum_k W[n, k] * a[k] over W [N, K] streamed from HBM (rotating copies past L2), one row of
activations, timed under a CUDA graph (triton.testing.do_bench_cudagraph), each variant's µs and
its fraction of the copy floor (W bytes / the device-to-device copy bandwidth measured here):
  bf16         W bf16, CUDA-core FMA (the shipped narrow path's loop)
  fp8_cvt      W e4m3 converted to f32 by the compiler's cvt, FMA (no scales)
  fp8_cvt_s    + a block scale [BN, 1] multiply per element (tile = one 128-column group)
  fp8_fold     + the block scale folded into a (a[k] * s[g]): one cvt + FMA an element
  fp8_f16bits  e4m3 -> f16 by integer ops (bits << 7; 2^8 folded into a), f16 -> f32, FMA
  fp8_dot_bf16 tensor cores: W -> bf16 (cvt) dotted with a padded to 16 rows
  fp8_dot      tensor cores: e4m3 x e4m3 (A quantized per 128-column group each tile), scales on
               the tile's sums (the codes form)
  fp8_dot_noq  the same dot with A's codes precomputed (no quantization in the loop)
and the SASS counts of conversion instructions (F2F, F2FP, HADD2, I2F) in each kernel.
Only a probe: the numbers go to bench/NOTES.md; the product's kernels are the templates.
"""
import argparse
import json
import re
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

SHAPES = {"qkv": (6144, 2560), "o": (2560, 4096), "gate_up": (19456, 2560), "down": (2560, 9728)}


@triton.jit
def _gemv_fma(w_ptr, a_ptr, s_ptr, y_ptr, N, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
              SPLIT: tl.constexpr, MODE: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    rows = pid_n * BN + tl.arange(0, BN)
    w_rows = w_ptr + tl.minimum(rows, N - 1).to(tl.int64)[:, None] * K
    acc = tl.zeros([BN, BK], tl.float32)
    kc = K // SPLIT
    for k0 in range(pid_s * kc, pid_s * kc + kc, BK):
        k = k0 + tl.arange(0, BK)
        a = tl.load(a_ptr + k).to(tl.float32)
        if MODE == 0:      # bf16
            w = tl.load(tl.multiple_of(w_rows + k[None, :], [1, 16]), eviction_policy="evict_first").to(tl.float32)
            acc += w * a[None, :]
        elif MODE == 1:    # fp8 cvt
            w = tl.load(tl.multiple_of(w_rows + k[None, :], [1, 16]), eviction_policy="evict_first").to(tl.float32)
            acc += w * a[None, :]
        elif MODE == 2:    # fp8 cvt + scale per row block
            s = tl.load(s_ptr + (tl.minimum(rows, N - 1) // 128)[:, None] * (K // 128) + k0 // 128)
            w = tl.load(tl.multiple_of(w_rows + k[None, :], [1, 16]), eviction_policy="evict_first").to(tl.float32)
            acc += w * s * a[None, :]
        elif MODE == 3:    # fp8 cvt, scale folded into a (rows of one block share it)
            s = tl.load(s_ptr + (pid_n * BN // 128) * (K // 128) + k0 // 128)
            w = tl.load(tl.multiple_of(w_rows + k[None, :], [1, 16]), eviction_policy="evict_first").to(tl.float32)
            acc += w * (a * s)[None, :]
        else:              # fp8 via f16 bits
            s = tl.load(s_ptr + (pid_n * BN // 128) * (K // 128) + k0 // 128)
            u = tl.load(tl.multiple_of(w_rows + k[None, :], [1, 16]), eviction_policy="evict_first")
            u = u.to(tl.uint8, bitcast=True).to(tl.int16)
            h = (((u & 0x80) << 8) | ((u & 0x7f) << 7)).to(tl.float16, bitcast=True)
            acc += h.to(tl.float32) * (a * (s * 256.0))[None, :]
    y = tl.sum(acc, axis=1)
    if SPLIT == 1:
        tl.store(y_ptr + rows, y, mask=rows < N)
    else:
        tl.atomic_add(y_ptr + rows, y, mask=rows < N, sem="relaxed")


@triton.jit
def _gemv_dot(w_ptr, a_ptr, s_ptr, y_ptr, N, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
              SPLIT: tl.constexpr, MODE: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    rows = pid_n * BN + tl.arange(0, BN)
    w_rows = w_ptr + tl.minimum(rows, N - 1).to(tl.int64)[:, None] * K
    t = tl.arange(0, 16)
    acc = tl.zeros([BN, 16], tl.float32)
    kc = K // SPLIT
    for k0 in tl.range(pid_s * kc, pid_s * kc + kc, BK, num_stages=4):
        k = k0 + tl.arange(0, BK)
        w = tl.load(tl.multiple_of(w_rows + k[None, :], [1, 16]), eviction_policy="evict_first")
        s = tl.load(s_ptr + (pid_n * BN // 128) * (K // 128) + k0 // 128)
        if MODE == 0:      # W -> bf16, A bf16
            a = tl.load(a_ptr + t[:, None] * 0 + k[None, :], mask=t[:, None] == 0, other=0.0).to(tl.bfloat16)
            acc += tl.dot(w.to(tl.bfloat16), tl.trans(a)) * s
        elif MODE == 1:    # codes form, A quantized in the loop
            a = tl.load(a_ptr + t[:, None] * 0 + k[None, :], mask=t[:, None] == 0, other=0.0).to(tl.float32)
            amax = tl.max(tl.abs(a), axis=1)
            sa = tl.where(amax > 0, tl.math.div_rn(amax, 448.0), 1.0)
            ac = tl.math.div_rn(a, sa[:, None]).to(tl.float8e4nv)
            acc += tl.dot(w, tl.trans(ac)) * (s * sa)[None, :]
        else:              # codes form, A's codes ready (a_ptr holds e4m3 codes, scale 1)
            ac = tl.load(a_ptr + t[:, None] * 0 + k[None, :], mask=t[:, None] == 0, other=0.0)
            acc += tl.dot(w, tl.trans(ac)) * s
    y = tl.sum(tl.where(t[None, :] == 0, acc, 0.0), axis=1)
    if SPLIT == 1:
        tl.store(y_ptr + rows, y, mask=rows < N)
    else:
        tl.atomic_add(y_ptr + rows, y, mask=rows < N, sem="relaxed")


VARIANTS = {  # name -> (kernel, MODE, weight dtype, a dtype)
    "bf16": (_gemv_fma, 0, torch.bfloat16, torch.bfloat16),
    "fp8_cvt": (_gemv_fma, 1, torch.float8_e4m3fn, torch.bfloat16),
    "fp8_cvt_s": (_gemv_fma, 2, torch.float8_e4m3fn, torch.bfloat16),
    "fp8_fold": (_gemv_fma, 3, torch.float8_e4m3fn, torch.bfloat16),
    "fp8_f16bits": (_gemv_fma, 4, torch.float8_e4m3fn, torch.bfloat16),
    "fp8_dot_bf16": (_gemv_dot, 0, torch.float8_e4m3fn, torch.bfloat16),
    "fp8_dot": (_gemv_dot, 1, torch.float8_e4m3fn, torch.bfloat16),
    "fp8_dot_noq": (_gemv_dot, 2, torch.float8_e4m3fn, torch.float8_e4m3fn),
}
CONFIGS_FMA = [(16, 128, 1), (32, 128, 1), (16, 256, 1), (16, 128, 2), (8, 512, 1)]
CONFIGS_DOT = [(64, 128, 1), (64, 128, 2), (128, 128, 1)]


def copy_bandwidth(nbytes=1 << 30) -> float:
    x = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = triton.testing.do_bench(lambda: y.copy_(x), warmup=5, rep=50)
    return 2 * nbytes / (ms * 1e-3)


def sass_counts(kernel) -> dict:
    try:
        sass = kernel.asm.get("sass") or ""
    except Exception:  # noqa: BLE001
        return {}
    out = {}
    for op in ("F2F", "F2FP", "HADD2", "I2F", "FFMA", "HMMA", "QGMMA", "HGMMA", "LDG", "BAR"):
        out[op] = len(re.findall(r"\b" + op + r"[\.\s]", sass))
    return out


def run_variant(name, N, K, bw, copies, cfgs, results):
    kern, mode, wdt, adt = VARIANTS[name]
    nbytes = N * K * (2 if wdt == torch.bfloat16 else 1)
    ncopy = max(2, (copies + nbytes - 1) // nbytes)
    ws = [(torch.randn(N, K, device="cuda") * 0.05).to(wdt) for _ in range(ncopy)]
    s = torch.rand(-(-N // 128), K // 128, device="cuda") + 0.5
    a = (torch.randn(K, device="cuda")).to(adt)
    y = torch.zeros(N, device="cuda", dtype=torch.float32)
    best = None
    for bn, bk, split in cfgs:
        if K % (bk * split) or (mode >= 3 and kern is _gemv_fma and 128 % bn):
            continue
        grid = (triton.cdiv(N, bn), split)
        state = {"i": 0}

        def fn():
            state["i"] = (state["i"] + 1) % ncopy
            state["k"] = kern[grid](ws[state["i"]], a, s, y, N, K, bn, bk, split, mode, num_warps=4)
        try:
            fn()
            torch.cuda.synchronize()
            us = triton.testing.do_bench_cudagraph(fn, rep=50) * 1e3
        except Exception as e:  # noqa: BLE001
            print(f"  {name} {N}x{K} BN={bn} BK={bk} split={split}: {type(e).__name__}: {str(e)[:120]}")
            continue
        floor = nbytes / bw * 1e6
        r = {"variant": name, "N": N, "K": K, "BN": bn, "BK": bk, "split": split, "us": round(us, 2),
             "floor_us": round(floor, 2), "of_floor": round(floor / us, 3)}
        results.append(r)
        if best is None or us < best["us"]:
            best, best_k = r, state.get("k")
    if best:
        best["sass"] = sass_counts(best_k) if best_k is not None else {}
        print(f"{name:13s} {N:6d}x{K:<5d} best {best['us']:8.2f} us ({best['of_floor']:.0%} of {best['floor_us']:.2f})"
              f"  BN={best['BN']} BK={best['BK']} split={best['split']}  {best['sass']}", flush=True)
    del ws
    torch.cuda.empty_cache()
    return best


def check(device):
    """Each variant against torch on small random shapes (TRITON_INTERPRET=1 on a CPU)."""
    N, K = 200, 512
    w32 = torch.randn(N, K) * 0.05
    s = torch.rand(-(-N // 128), K // 128) + 0.5
    a32 = torch.randn(K)
    for name, (kern, mode, wdt, adt) in VARIANTS.items():
        w = w32.to(wdt)
        sc = s if mode >= 2 or kern is _gemv_dot else torch.ones_like(s)
        wd = w.float() * sc.repeat_interleave(128, 0)[:N].repeat_interleave(128, 1)
        a = a32.to(adt)
        if kern is _gemv_dot and mode == 1:        # A quantized per 128 columns
            g = a.float().view(-1, 128)
            sa = g.abs().amax(1, keepdim=True) / 448
            af = ((g / sa).to(torch.float8_e4m3fn).float() * sa).view(-1)
        else:
            af = a.float()
        want = wd @ af
        y = torch.zeros(N)
        bn = 64 if kern is _gemv_dot else 16
        kern[(triton.cdiv(N, bn), 2)](w.to(device), a.to(device), sc.to(device), y.to(device), N, K, bn, 128, 2, mode)
        err = ((y - want).norm() / want.norm()).item()
        print(f"{name:13s} rel err {err:.2e}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--check", action="store_true", help="correctness on small shapes, then stop")
    a = ap.parse_args()
    if a.check:
        return check("cuda" if torch.cuda.is_available() else "cpu")
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e12:.3f} TB/s", flush=True)
    results = []
    for shape in a.shapes.split(","):
        N, K = SHAPES[shape]
        for v in a.variants.split(","):
            cfgs = CONFIGS_DOT if VARIANTS[v][0] is _gemv_dot else CONFIGS_FMA
            run_variant(v, N, K, bw, 256 << 20, cfgs, results)
    out = Path(a.out) / "fp8_gemv_probe.json"
    out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "copy_bw": bw, "results": results}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
