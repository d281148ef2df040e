"""An experiment for issue 10's batch-1 decode: how far are the plan's decode GEMVs from what the
GPU can do at their sizes, by two yardsticks?

  plan     the committed qwen3-4b decode program's GEMV for the weight (generated/qwen3-4b)
  cublas   torch.nn.functional.linear on the same [1, K] x [N, K]^T (cuBLAS picks its kernel)
  read     a Triton kernel that only reads W (a sum per program, one store): the read floor at
           this size, launch and ramp included

Per linear, 24 layers of their own W (more bytes than L2), in one CUDA Graph, median of REPS
replays, us a layer and GB/s of W. The decode step's linears at batch 1 take ~3.3 ms of its
~3.5 ms on an H100; o_proj streams at ~69 % of the copy bandwidth (bench/NOTES.md).
Prediction: cuBLAS within 10 % of the plan (both pay the same launch and ramp), the read
kernel ~1.5 us below the plan for o_proj: the floor at these sizes is the ramp, not the math.

    python3 bench/experiments/gemv_yardstick.py OUT_DIR    # on the GPU (torch + triton there)
"""
import json
from functools import partial
import sys
from pathlib import Path

import torch
import triton
from plan_kernels import graph_us as time_layers, plain_launch, plan_kernel, read_weights

LAYERS, REPS = 24, 30
graph_us = partial(time_layers, layers=LAYERS, reps=REPS)     # us a layer
# weight name in the plan -> (K, N); gate_up is the gated GEMV ([gate | up] rows, F outputs)
LINEARS = {"wqkv": "qkv", "wo": "o_proj", "wgu": "gate_up", "wd": "down"}


def main(out: Path):
    out.mkdir(parents=True, exist_ok=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    sink = torch.empty(64 * sms, dtype=torch.float32, device="cuda")
    res = {"gpu": torch.cuda.get_device_name(), "triton": triton.__version__, "torch": torch.__version__,
           "layers": LAYERS, "reps": REPS, "runs": []}
    for wname, name in LINEARS.items():
        mod, meta = plan_kernel(lambda l: l["inputs"][1] == wname and l["op"].startswith("linear"))
        c = meta["constexprs"]
        K, N = c["K"], c["N"]
        rows = 2 * N if wname == "wgu" and "gated" in meta["entry"] else N
        torch.manual_seed(0)
        a_dim = 2 * K if "_mul" in meta["entry"] else K        # act_mul reads [gate | up] rows
        x = torch.randn(1, a_dim, device="cuda", dtype=torch.bfloat16)
        ws = [torch.randn(rows, K, device="cuda", dtype=torch.bfloat16) * K ** -0.5 for _ in range(LAYERS)]
        y = torch.empty(1, N, device="cuda", dtype=torch.bfloat16)
        plan = [plain_launch(mod, meta, {"in:0": x, "in:1": w, "out:0": y}) for w in ws]
        xk = x[:, :K].contiguous()
        yk = torch.empty(1, rows, device="cuda", dtype=torch.bfloat16)
        nbytes = rows * K * 2
        row = {"linear": name, "entry": meta["entry"], "K": K, "N": N, "w_rows": rows, "w_MB": nbytes / 1e6,
               "us_per_layer": {}}
        row["us_per_layer"]["plan"] = graph_us(lambda: [p() for p in plan])
        row["us_per_layer"]["cublas"] = graph_us(lambda: [torch.nn.functional.linear(xk, w, out=yk) for w in ws])
        for progs in (sms, 2 * sms, 4 * sms, 8 * sms):
            n = rows * K
            row["us_per_layer"][f"read_{progs}"] = graph_us(
                lambda: [read_weights[(progs,)](w, sink, n, BLOCK=2048, EVICT="evict_first", num_warps=8)
                         for w in ws])
        u = row["us_per_layer"]
        row["read_best"] = min(v for k, v in u.items() if k.startswith("read_"))
        row["GBps"] = {k: nbytes / (v * 1e-6) / 1e9 for k, v in u.items()}
        res["runs"].append(row)
        print(f"{name} ({meta['entry']}, W {nbytes / 1e6:.1f} MB): " + ", ".join(f"{k} {v:.2f}" for k, v in u.items())
              + " us a layer", flush=True)
    (out / "exp-gemv-yardstick.json").write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "bench/results"))
