"""An experiment for issue 11's batch-1 decode: what would one launch for the MoE router (its GEMV)
and the routing (softmax, top-k) save against the plan's two?

qwen3-30b-a3b's decode layer is ten launches; two of them, the router GEMV (128 x 2048, 0.5 MB)
and moe_route (one program: softmax over 128 experts, top-8), read almost nothing and take ~15 us
a layer in the event clock of an H200 profile (bench/NOTES.md, 2026-11-27 night). Here the router
rows are split over the programs; each writes its bf16-rounded logits, counts itself in, and the
last program to arrive routes, so the routing costs the tail of one program instead of a launch.

Timed per layer over LAYERS layers with their own router W (more bytes than L2, as in the model,
where ~113 MB of other weights pass between two routers), in one CUDA Graph, median of REPS:
  plan       generated/qwen3-30b-a3b's router GEMV, then its decode moe_route
  fused_R_W  this file's kernel, R router rows a program, W warps
Launches are plain (no programmatic dependent launch; the runtime's PDL hides part of a boundary,
so the plan's two launches are timed at their worst). Each variant's ids and weights are checked
against the plan's on every layer's input.

    python3 bench/experiments/router_route.py OUT_DIR      # on the GPU (torch + triton there)
    TRITON_INTERPRET=1 python3 bench/experiments/router_route.py --check   # the kernel, on a CPU
"""
import json
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

E, K_IN, TOPK = 128, 2048, 8            # qwen3-30b-a3b: 128 experts, hidden 2048, top-8, normalized
LAYERS, REPS = 200, 50


@triton.jit
def router_route(h_ptr, w_ptr, logit_ptr, cnt_ptr, topw_ptr, topi_ptr,
                 E: tl.constexpr, K: tl.constexpr, R: tl.constexpr, BLOCK_K: tl.constexpr,
                 TOPK: tl.constexpr, BLOCK_TOPK: tl.constexpr, NORMALIZE: tl.constexpr):
    # one token (batch-1 decode):
    #   logits[e] = bf16(sum_k h[k] * w[e, k])       program p: rows e = p * R .. p * R + R - 1
    #   p = softmax(logits) (fp32); ids = the TOPK largest p (ties: lower id); topw = p[ids]
    #   (/ sum when NORMALIZE): moe_route.py.j2's routing, run by the last program to arrive
    pid = tl.program_id(0)
    e = pid * R + tl.arange(0, R)
    acc = tl.zeros([R, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(h_ptr + k).to(tl.float32)
        w = tl.load(w_ptr + e.to(tl.int64)[:, None] * K + k[None, :], eviction_policy="evict_first")
        acc += w.to(tl.float32) * a[None, :]
    lg = tl.sum(acc, 1).to(tl.bfloat16).to(tl.float32)
    # the logits travel through L2 atomics, ordered by the counter's acq_rel (as gemv.py.j2's
    # split-K partials); the interpreter has no f32 xchg, hence the int32 bits
    bits = logit_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    tl.atomic_xchg(bits + e, lg.to(tl.int32, bitcast=True), sem="relaxed")
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt_ptr, 1, sem="acq_rel")
    if arrived == tl.num_programs(0) - 1:
        tl.debug_barrier()
        ee = tl.arange(0, E)
        l = tl.load(bits + ee, cache_modifier=".cg").to(tl.float32, bitcast=True)
        ex = tl.exp(l - tl.max(l, axis=0))
        p = ex / tl.sum(ex, axis=0)
        cand = p
        kk = tl.arange(0, BLOCK_TOPK)
        topw = tl.zeros([BLOCK_TOPK], dtype=tl.float32)
        ids = tl.zeros([BLOCK_TOPK], dtype=tl.int32)
        for j in tl.static_range(TOPK):
            best = tl.max(cand, axis=0)
            idx = tl.min(tl.where(cand == best, ee, E), axis=0)
            topw = tl.where(kk == j, best, topw)
            ids = tl.where(kk == j, idx, ids)
            cand = tl.where(ee == idx, -1.0, cand)
        if NORMALIZE:
            topw = topw / tl.sum(topw, axis=0)
        tl.store(topw_ptr + kk, topw, mask=kk < TOPK)
        tl.store(topi_ptr + kk, ids, mask=kk < TOPK)
        tl.store(cnt_ptr, 0)


def fused_launch(h, w, logits, cnt, topw, topi, R: int, warps: int, block_k: int = 256):
    return lambda: router_route[(E // R,)](h, w, logits, cnt, topw, topi, E=E, K=K_IN, R=R,
                                            BLOCK_K=block_k, TOPK=TOPK, BLOCK_TOPK=8, NORMALIZE=True,
                                            num_warps=warps)


def route_reference(lg: torch.Tensor):
    """torch, from the logits: fp32 softmax, top-k (stable by id), normalized weights."""
    p = torch.softmax(lg.float(), 0)
    ids = sorted(range(E), key=lambda i: (-p[i].item(), i))[:TOPK]
    tw = p[ids]
    return tw / tw.sum(), ids


def check() -> int:
    """The kernel against torch on random inputs (the interpreter on a CPU, or a GPU)."""
    dev = "cuda" if torch.cuda.is_available() and not os.environ.get("TRITON_INTERPRET") else "cpu"
    g = torch.Generator().manual_seed(0)
    bad = 0
    for trial in range(3):
        h = (torch.randn(K_IN, generator=g)).to(torch.bfloat16).to(dev)
        w = (torch.randn(E, K_IN, generator=g) * 0.02).to(torch.bfloat16).to(dev)
        logits = torch.zeros(E, dtype=torch.float32, device=dev)
        cnt = torch.zeros(1, dtype=torch.int32, device=dev)
        topw = torch.zeros(TOPK, dtype=torch.float32, device=dev)
        topi = torch.zeros(TOPK, dtype=torch.int32, device=dev)
        for R, warps in ((8, 4), (16, 2)):
            fused_launch(h, w, logits, cnt, topw, topi, R, warps)()
            # the logits the kernel left in its scratch against fp32 torch (bf16 rounding apart:
            # the interpreter truncates), then the routing of exactly those logits
            lg = logits.cpu()
            close = torch.allclose(lg, w.cpu().float() @ h.cpu().float(), rtol=1e-2, atol=1e-2)
            want_w, want_i = route_reference(lg)
            ok = close and topi.cpu().tolist() == want_i and int(cnt.item()) == 0 \
                and torch.allclose(topw.cpu(), want_w, rtol=1e-5, atol=1e-6)
            print(f"trial {trial} R={R} warps={warps}: {'ok' if ok else 'DIFFERS'} {topi.cpu().tolist()} vs {want_i}")
            bad += not ok
    return 1 if bad else 0


def run(out: Path) -> int:
    sys.path.insert(0, str(Path(__file__).parent))
    from plan_kernels import graph_us, plain_launch, plan_kernel
    gemv, gmeta = plan_kernel(lambda l: l["op"] == "linear" and l["inputs"][1] == "router", "qwen3-30b-a3b")
    route, rmeta = plan_kernel(lambda l: l["op"] == "moe_route_align", "qwen3-30b-a3b")
    g = torch.Generator(device="cuda").manual_seed(0)
    hs = [torch.randn(1, K_IN, device="cuda", generator=g).to(torch.bfloat16) for _ in range(LAYERS)]
    ws = [(torch.randn(E, K_IN, device="cuda", generator=g) * 0.02).to(torch.bfloat16) for _ in range(LAYERS)]
    logits = [torch.zeros(1, E, dtype=torch.bfloat16, device="cuda") for _ in range(LAYERS)]
    tw = [torch.zeros(1, TOPK, dtype=torch.float32, device="cuda") for _ in range(LAYERS)]
    ti = [torch.zeros(1, TOPK, dtype=torch.int32, device="cuda") for _ in range(LAYERS)]
    plan_calls = []
    for i in range(LAYERS):
        plan_calls.append(plain_launch(gemv, gmeta, {"in:0": hs[i], "in:1": ws[i], "out:0": logits[i]}))
        plan_calls.append(plain_launch(route, rmeta, {"in:0": logits[i], "out:0": tw[i], "out:1": ti[i]}))
    res = {"gpu": torch.cuda.get_device_name(), "triton": triton.__version__, "layers": LAYERS,
           "plan_kernels": [gmeta["entry"], rmeta["entry"]], "us_per_layer": {}, "mismatch": {}}
    res["us_per_layer"]["plan"] = graph_us(lambda: [c() for c in plan_calls], LAYERS, REPS)
    want = [(tw[i].clone(), ti[i].clone()) for i in range(LAYERS)]
    for R in (4, 8, 16):
        for warps in (1, 2, 4):
            scratch = [torch.zeros(E, dtype=torch.float32, device="cuda") for _ in range(LAYERS)]
            cnt = [torch.zeros(1, dtype=torch.int32, device="cuda") for _ in range(LAYERS)]
            fw = [torch.zeros(TOPK, dtype=torch.float32, device="cuda") for _ in range(LAYERS)]
            fi = [torch.zeros(TOPK, dtype=torch.int32, device="cuda") for _ in range(LAYERS)]
            calls = [fused_launch(hs[i][0], ws[i], scratch[i], cnt[i], fw[i], fi[i], R, warps)
                     for i in range(LAYERS)]
            name = f"fused_{R}_{warps}"
            res["us_per_layer"][name] = graph_us(lambda: [c() for c in calls], LAYERS, REPS)
            res["mismatch"][name] = sum(fi[i].tolist() != want[i][1][0].tolist()
                                        or not torch.allclose(fw[i], want[i][0][0], rtol=1e-3)
                                        for i in range(LAYERS))
    for k, v in res["us_per_layer"].items():
        print(f"{k:12s} {v:7.2f} us a layer" + (f"  ({res['mismatch'][k]} layers differ from the plan)"
                                                 if k in res["mismatch"] else ""))
    out.mkdir(parents=True, exist_ok=True)
    (out / "exp-router-route.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    if "--check" in sys.argv:
        sys.exit(check())
    sys.exit(run(Path(sys.argv[1])))
