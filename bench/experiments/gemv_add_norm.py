"""An experiment for issues 10 and 11's batch-1 decode: what would folding the residual add and
the RMSNorm after a GEMV into that GEMV's last program save?

A decode layer is 8 launches (qwen3-4b); two are add_rms_norm, 4.2-4.7 us each at batch 1 on an
H100 (bench/NOTES.md): ~0.3 ms of qwen3-4b's 3.46 ms step and ~0.45 ms of qwen3-30b-a3b's 3.5 ms.
The fold: the GEMV's epilogue writes s = bf16(x + bf16(y)) over the residual x (each program owns
its columns), then counts itself in; the last program of the row reads the row's s back (L2) and
writes h = bf16(bf16(s * rstd) * w), HF's RMSNorm (Llama's order). The norm then costs the tail of
one program instead of a launch.

Timed per layer, over LAYERS layers with their own W (more bytes than L2), in one CUDA Graph,
median of REPS replays, for o_proj (K 4096) and down (K 9728) of qwen3-4b (N 2560):
  plan        the plan's GEMV, then the plan's add_rms_norm (generated/qwen3-4b)
  plan_gemv   the plan's GEMV alone
  exp_gemv    this file's GEMV (CUDA-core rows, split-K, counter merge), y out
  exp_fused   the same with the add + norm folded in
saving ~= (plan - plan_gemv) - (exp_fused - exp_gemv). Launches are plain (no programmatic
dependent launch: the runtime's PDL hides part of a launch boundary, so this overstates the saving
by up to ~1 us a launch). Outputs are checked against torch.

    python3 bench/experiments/gemv_add_norm.py OUT_DIR     # on the GPU (torch + triton there)
    TRITON_INTERPRET=1 python3 bench/experiments/gemv_add_norm.py --check   # the kernel, on a CPU
"""
import json
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from plan_kernels import graph_us, plain_launch, plan_kernel

SHAPES = {"o_proj": ("wo", 4096, 2560), "down": ("wd", 9728, 2560)}
LAYERS, REPS, EPS = 24, 50, 1e-6


@triton.jit
def gemv_add_norm(a_ptr, w_ptr, y_ptr, x_ptr, nw_ptr, h_ptr, part_ptr, cnt_ptr, row_cnt_ptr,
                  N: tl.constexpr, K: tl.constexpr, KR: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, HB: tl.constexpr, EPS: tl.constexpr,
                  FUSE: tl.constexpr):
    # y[n] = sum_k a[k] w[n, k] (one row, fp32), split-K over SPLIT programs merged by the last;
    # FUSE: s = bf16(x + bf16(y)) over x, then the last column block's program of the row
    #   h = bf16(bf16(s * rsqrt(mean(s^2) + eps)) * nw)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nm = n < N
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(pid_k * KR, (pid_k + 1) * KR, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        km = k < K
        a = tl.load(a_ptr + k, mask=km, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + n.to(tl.int64)[:, None] * K + k[None, :], mask=nm[:, None] & km[None, :],
                    other=0.0, eviction_policy="evict_first").to(tl.float32)
        acc += w * a[None, :]
    total = tl.sum(acc, 1)
    last = True
    if SPLIT > 1:
        tl.store(part_ptr + pid_k * N + n, total, mask=nm)
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        last = done == SPLIT - 1
        if last:
            total = tl.zeros([BLOCK_N], tl.float32)
            for z in range(SPLIT):                  # in split order: deterministic
                total += tl.load(part_ptr + z * N + n, mask=nm, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed", scope="gpu")
    if last:
        y = total.to(y_ptr.dtype.element_ty)
        if FUSE:
            x = tl.load(x_ptr + n, mask=nm, other=0.0).to(tl.float32)
            s = (x + y.to(tl.float32)).to(x_ptr.dtype.element_ty)
            tl.store(x_ptr + n, s, mask=nm)
            tl.debug_barrier()
            seen = tl.atomic_add(row_cnt_ptr, 1, sem="acq_rel", scope="gpu")
            if seen == tl.num_programs(0) - 1:
                cols = tl.arange(0, HB)
                cm = cols < N
                row = tl.load(x_ptr + cols, mask=cm, other=0.0, cache_modifier=".cg").to(tl.float32)
                rstd = tl.math.rsqrt(tl.sum(row * row, 0) / N + EPS)
                nw = tl.load(nw_ptr + cols, mask=cm, other=0.0).to(tl.float32)
                h = ((row * rstd).to(h_ptr.dtype.element_ty).to(tl.float32) * nw).to(h_ptr.dtype.element_ty)
                tl.store(h_ptr + cols, h, mask=cm)
                tl.atomic_xchg(row_cnt_ptr, 0, sem="relaxed", scope="gpu")
        else:
            tl.store(y_ptr + n, y, mask=nm)


class Exp:
    """This file's kernel for one (K, N): buffers and a launch."""

    def __init__(self, K, N, fuse, device, BLOCK_N=32, BLOCK_K=256, SPLIT=4):
        self.K, self.N, self.fuse = K, N, fuse
        self.BLOCK_N, self.BLOCK_K, self.SPLIT = BLOCK_N, BLOCK_K, SPLIT
        self.KR = triton.cdiv(triton.cdiv(K, SPLIT), BLOCK_K) * BLOCK_K
        self.part = torch.zeros(SPLIT * N, dtype=torch.float32, device=device)
        self.cnt = torch.zeros(triton.cdiv(N, BLOCK_N), dtype=torch.int32, device=device)
        self.row_cnt = torch.zeros(1, dtype=torch.int32, device=device)

    def __call__(self, a, w, y, x, nw, h):
        grid = (triton.cdiv(self.N, self.BLOCK_N), self.SPLIT)
        gemv_add_norm[grid](a, w, y, x, nw, h, self.part, self.cnt, self.row_cnt, N=self.N, K=self.K,
                            KR=self.KR, BLOCK_N=self.BLOCK_N, BLOCK_K=self.BLOCK_K, SPLIT=self.SPLIT,
                            HB=triton.next_power_of_2(self.N), EPS=EPS, FUSE=self.fuse, num_warps=4)


def reference(a, w, x, nw):
    """torch, HF's roundings: (s, h)."""
    y = (a.float() @ w.float().T).to(torch.bfloat16)
    s = (x.float() + y.float()).to(torch.bfloat16)
    rstd = torch.rsqrt(s.float().pow(2).mean(-1, keepdim=True) + EPS)
    h = ((s.float() * rstd).to(torch.bfloat16).float() * nw.float()).to(torch.bfloat16)
    return s, h


def check(device="cpu"):
    """The fused kernel against torch on shapes its blocks do not divide (the interpreter on a CPU)."""
    for K, N, split in ((300, 70, 3), (256, 100, 1), (1000, 96, 4)):
        g = torch.Generator().manual_seed(K + N)
        a = torch.randn(1, K, generator=g).to(torch.bfloat16).to(device)
        w = (torch.randn(N, K, generator=g) * K ** -0.5).to(torch.bfloat16).to(device)
        x = torch.randn(1, N, generator=g).to(torch.bfloat16).to(device)
        nw = (torch.rand(N, generator=g) + 0.5).to(torch.bfloat16).to(device)
        s_ref, h_ref = reference(a, w, x, nw)
        for rep in range(2):                         # the counters are left zero for the next launch
            xs, h, y = x.clone(), torch.full_like(x, float("nan")), torch.empty_like(x)
            e = Exp(K, N, True, device, BLOCK_N=32, BLOCK_K=64, SPLIT=split)
            e(a, w, y, xs, nw, h)
            for _ in range(rep):
                xs.copy_(x)
                e(a, w, y, xs, nw, h)
            assert int(e.cnt.abs().sum()) == 0 and int(e.row_cnt.abs().sum()) == 0
            # s: within two bf16 roundings of the operands (y's fp32 sum order differs from torch's,
            # and x + y may cancel); h: the norm of the kernel's own s, within two roundings
            y_ref = (a.float() @ w.float().T).abs()
            ds = ((xs.float() - s_ref.float()).abs() / (x.float().abs() + y_ref + 1e-3)).max().item()
            h_own = reference(torch.zeros_like(a), w, xs, nw)[1]
            dh = ((h.float() - h_own.float()).abs() / (h_own.float().abs() + 1e-3)).max().item()
            assert ds <= 2 ** -6 and dh <= 2 ** -6, (K, N, split, ds, dh)    # two bf16 roundings
    print("gemv_add_norm: the fused kernel matches torch (interpreter)")


def main(out: Path):
    out.mkdir(parents=True, exist_ok=True)
    norm_mod, norm_meta = plan_kernel(lambda l: l["op"] == "add_rms_norm")
    res = {"gpu": torch.cuda.get_device_name(), "triton": triton.__version__, "layers": LAYERS,
           "reps": REPS, "runs": []}
    for name, (weight, K, N) in SHAPES.items():
        gmod, gmeta = plan_kernel(lambda l: l["op"] == "linear" and l["inputs"][1] == weight)
        torch.manual_seed(0)
        a = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
        ws = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K ** -0.5 for _ in range(LAYERS)]
        x0 = torch.randn(1, N, device="cuda", dtype=torch.bfloat16)
        nw = (torch.rand(N, device="cuda") + 0.5).to(torch.bfloat16)
        x, y, h = x0.clone(), torch.empty(1, N, device="cuda", dtype=torch.bfloat16), torch.empty_like(x0)
        plan_g = [plain_launch(gmod, gmeta, {"in:0": a, "in:1": w, "out:0": y}) for w in ws]
        plan_n = plain_launch(norm_mod, norm_meta, {"in:0": x, "in:1": y, "in:2": nw, "out:0": x, "out:1": h})
        e_plain, e_fused = Exp(K, N, False, "cuda"), Exp(K, N, True, "cuda")
        bodies = {
            "plan": lambda: [(g(), plan_n()) for g in plan_g],
            "plan_gemv": lambda: [g() for g in plan_g],
            "exp_gemv": lambda: [e_plain(a, w, y, x, nw, h) for w in ws],
            "exp_fused": lambda: [e_fused(a, w, y, x, nw, h) for w in ws],
        }
        row = {"linear": name, "K": K, "N": N, "us_per_layer": {}}
        # correctness of one layer of each, from the same x
        x.copy_(x0)
        s_ref, h_ref = reference(a, ws[0], x0, nw)
        plan_g[0]()
        plan_n()
        torch.cuda.synchronize()
        row["plan_err"] = [float((x.float() - s_ref.float()).abs().max()), float((h.float() - h_ref.float()).abs().max())]
        x.copy_(x0)
        e_fused(a, ws[0], y, x, nw, h)
        torch.cuda.synchronize()
        row["fused_err"] = [float((x.float() - s_ref.float()).abs().max()), float((h.float() - h_ref.float()).abs().max())]
        for what, body in bodies.items():          # x reset before each replay: the residual stays finite
            row["us_per_layer"][what] = graph_us(body, LAYERS, REPS, before=lambda: x.copy_(x0))
        u = row["us_per_layer"]
        row["norm_launch_us"] = u["plan"] - u["plan_gemv"]
        row["fold_cost_us"] = u["exp_fused"] - u["exp_gemv"]
        row["saving_us_per_fold"] = row["norm_launch_us"] - row["fold_cost_us"]
        res["runs"].append(row)
        print(f"{name}: plan {u['plan']:.2f} us a layer (gemv {u['plan_gemv']:.2f}); this file's gemv "
              f"{u['exp_gemv']:.2f}, fused {u['exp_fused']:.2f}: a fold saves ~{row['saving_us_per_fold']:.2f} us "
              f"(errors plan {row['plan_err']}, fused {row['fused_err']})", flush=True)
    (out / "exp-gemv-add-norm.json").write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    if "--check" in sys.argv:
        assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
        check()
    else:
        main(Path(sys.argv[1] if len(sys.argv) > 1 else "bench/results"))
