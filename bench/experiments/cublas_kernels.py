"""Which kernels cuBLAS runs for qwen3-4b's decode linears at 64 and 236 rows, and how they are
shaped: the yardstick `mid_gemm.py` and `skinny_gemm.py` measured (cuBLAS 1.2-1.6x the weight
floor where the Triton forms sit at 1.3-3x) is a kernel design to learn from. torch.profiler's
trace gives each kernel's name (cuBLAS names carry tile size, cluster, split-K / stream-K), grid,
block, registers and shared memory, and its time.

    python3 bench/experiments/cublas_kernels.py OUT_DIR    # on the GPU (torch there)
"""
import json
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

LINEARS = {"qkv": (2560, 6144), "o_proj": (4096, 2560), "gate_up": (2560, 19456), "down": (9728, 2560)}
MS = (16, 64, 128, 236, 256)


def main(out: Path):
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for lin, (K, NW) in LINEARS.items():
        w = torch.randn(NW, K, device="cuda", dtype=torch.bfloat16)
        for M in MS:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            y = torch.empty(M, NW, device="cuda", dtype=torch.bfloat16)
            for _ in range(3):
                torch.matmul(x, w.T, out=y)
            torch.cuda.synchronize()
            trace = out / f"trace-{lin}-{M}.json"
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    torch.matmul(x, w.T, out=y)
                torch.cuda.synchronize()
            prof.export_chrome_trace(str(trace))
            ev = json.loads(trace.read_text())["traceEvents"]
            ks = [e for e in ev if e.get("cat") == "kernel"]
            trace.unlink()
            seen = {}
            for e in ks:
                a = e.get("args", {})
                key = e["name"]
                s = seen.setdefault(key, {"linear": lin, "M": M, "K": K, "N": NW, "kernel": key, "us": [],
                                          "grid": a.get("grid"), "block": a.get("block"),
                                          "registers": a.get("registers per thread"),
                                          "shared": a.get("shared memory"),
                                          "blocks_per_sm": a.get("blocks per SM"),
                                          "warps_per_sm": a.get("warps per SM")})
                s["us"].append(e.get("dur"))
            for s in seen.values():
                s["us_median"] = sorted(s["us"])[len(s["us"]) // 2]
                rows.append(s)
                print(f"{lin:8s} M={M:4d} {s['us_median']:7.1f} us grid={s['grid']} block={s['block']} "
                      f"regs={s['registers']} smem={s['shared']}  {s['kernel'][:150]}", flush=True)
    (out / "cublas_kernels.json").write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/cublas-kernels"))
