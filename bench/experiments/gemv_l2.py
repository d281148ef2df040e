"""An experiment for issue 10's batch-1 decode: how much faster is a decode GEMV whose weights
are already in L2, and does a prefetch overlapping the HBM-idle attention kernels get them there?

At batch 1 (bench/NOTES.md, H100, f155b7c) qkv and o_proj stream at 55-70 % of the copy
bandwidth. Their weights (31 and 21 MB) fit the 50 MB L2. Between them run qk_norm_rope_cache and
attention_decode, ~11 us of a layer during which HBM sits idle. Per linear at T = 1, median over
REPS, each sequence timed by CUDA events after a 256 MB write has flushed L2:
  cold     the plan's GEMV (its committed kernel, generated/qwen3-4b)
  l2       a kernel reads W, then the GEMV alone is timed (W L2-resident, as far as it fits)
  busy     a compute-only kernel of ~BUSY_US (no HBM traffic, attention's stand-in), then the cold
           GEMV: the serial baseline
  overlap  the busy kernel on one stream and a W prefetch on another, joined, then the GEMV: what
           prefetching during attention would give (against busy)
Checks each GEMV's output against torch. Run on the GPU:
python3 bench/experiments/gemv_l2.py OUT_DIR  (torch + triton there).
"""
import json
import sys
from pathlib import Path

import torch
import triton
from plan_kernels import busy, plain_launch, plan_kernel, read_weights

SHAPES = {"qkv": ("wqkv", 2560, 6144), "o_proj": ("wo", 4096, 2560), "down": ("wd", 9728, 2560)}
REPS, BUSY_US = 200, 11.0




def plan_gemv(weight: str):
    """The committed qwen3-4b decode program's GEMV for this weight: (module, META)."""
    return plan_kernel(lambda l: l["op"] == "linear" and l["inputs"][1] == weight)


def launcher(mod, meta, x, w, y):
    return plain_launch(mod, meta, {"in:0": x, "in:1": w, "out:0": y})


def main(out: Path):
    dev = torch.cuda.get_device_properties(0)
    flush_buf = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    sink = torch.empty(4096, dtype=torch.float32, device="cuda")
    busy_out = torch.empty(64 * 128, dtype=torch.float32, device="cuda")
    side = torch.cuda.Stream()

    def timed(body, pre=None):
        ts = []
        for _ in range(REPS):
            flush_buf.zero_()
            if pre is not None:
                pre()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            body(a)
            b.record()
            torch.cuda.synchronize()
            ts.append(a.elapsed_time(b) * 1e3)
        return sorted(ts)[len(ts) // 2]

    # the busy kernel's iteration count for ~BUSY_US on 64 programs (attention_decode's scale)
    iters = 256
    for _ in range(12):
        us = timed(lambda a: busy[(64,)](busy_out, iters, BLOCK=128))
        if abs(us - BUSY_US) < 0.5:
            break
        iters = max(16, int(iters * BUSY_US / max(us, 0.1)))
    res = {"gpu": torch.cuda.get_device_name(), "triton": triton.__version__, "l2_bytes": dev.L2_cache_size,
           "busy": {"iters": iters, "us": us}, "runs": []}
    src, dst = torch.empty(1 << 28, dtype=torch.uint8, device="cuda"), torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    gbps = 2 * src.numel() / (timed(lambda a: dst.copy_(src)) * 1e-6) / 1e9     # read + write
    res["copy_GBps"] = gbps
    for name, (weight, K, N) in SHAPES.items():
        torch.manual_seed(0)
        x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K ** -0.5
        y = torch.empty(1, N, device="cuda", dtype=torch.bfloat16)
        mod, meta = plan_gemv(weight)
        assert (meta["constexprs"]["K"], meta["constexprs"]["N"]) == (K, N), meta["constexprs"]
        gemv = launcher(mod, meta, x, w, y)
        gemv()
        torch.cuda.synchronize()
        err = float((y.float() - x.float() @ w.float().T).abs().max())
        pf = lambda: read_weights[(264,)](w, sink, w.numel(), BLOCK=2048, EVICT="evict_last")   # noqa: E731
        bz = lambda: busy[(64,)](busy_out, iters, BLOCK=128)             # noqa: E731

        def overlap(a):
            side.wait_event(a)
            with torch.cuda.stream(side):
                pf()
            bz()
            torch.cuda.current_stream().wait_stream(side)
            gemv()
        row = {"linear": name, "K": K, "N": N, "w_MB": w.numel() * 2 / 1e6, "max_abs_err": err,
               "us": {"cold": timed(lambda a: gemv()), "l2": timed(lambda a: gemv(), pre=pf),
                      "busy_then_cold": timed(lambda a: (bz(), gemv())), "overlap": timed(overlap)}}
        row["cold_share_of_copy_bw"] = w.numel() * 2 / (row["us"]["cold"] * 1e-6) / 1e9 / gbps
        res["runs"].append(row)
        print(f"{name}: W {row['w_MB']:.1f} MB, cold {row['us']['cold']:.2f} us, L2 {row['us']['l2']:.2f}, "
              f"busy+cold {row['us']['busy_then_cold']:.2f}, overlapped {row['us']['overlap']:.2f} "
              f"(err {err:.3g})", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "exp-gemv-l2.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/exp-gemv-l2"))
