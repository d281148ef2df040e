"""An experiment: does Triton's warp specialization (WS) lift Qwen3-4B's prefill / mixed-step GEMMs
past the persistent TMA kernel that ships (bench/NOTES.md, "The prefill GEMMs on TMA with persistent
programs" and "qwen3-4b's mixed-step GEMM tiles")?

That kernel (gemm_tma.py's tma_pers: A and W through tl.make_tensor_descriptor, NUM_SMS persistent
programs over grouped tiles, the tile loop flatten=True; 128 x 256 x 64, 3 stages, 8 warps) runs these
bf16 GEMMs (fp32 accumulate) at 64-70 % of the 989 TFLOP/s dense bf16 peak; cuBLAS reaches ~70 %.
With WS a producer warp group issues the TMA loads while consumer warp groups run wgmma.

Shapes, each at T = 1024 and 8192 rows:
  gate_up  K 2560, W [gate | up] 9728 + 9728 rows, epilogue silu(g) * u as gemm_tma.py's
  down     K 9728, N 2560
  qkv      K 2560, N 6144
  o_proj   K 4096, N 2560

What Triton's Hopper WS is (checked on the build machine against Triton 3.6.0, the GPU machine's, and
3.9.0, the repo's; `--compile-only`): sm_90 goes through Meta's autoWS pass (add_hopper_warpspec).
It applies only with num_warps=4 and without flatten. The kernel then has 12 warps: one producer
group and two consumer groups, each computing a 64-row half of the tile (232 registers each).
With num_warps=8, or with flatten=True, the request is dropped without a word. The JSON's
ws_applied flag says which kernels really are specialized. In 3.6 (not 3.9) the pass fails on
gemm_tma.py's gated tile ([2, BN/2, BK] box, reshape, split): "UNREACHABLE ... WSDataPartition.cpp",
then PassManager::run failed. So the WS variants load gate and up as two [BN/2, BK] boxes with two
dots (SPLIT); base_split times that form without WS. ws_tile and ws_k give byte-identical PTX in
3.6 (the pass specializes the whole persistent loop either way). 128 x 256 with 4 stages needs
262 KB of shared memory, past the 227 KB limit, so it is not timed.

Variants (tile BM x BN x 64, s stages, w warps a group):
  base           128x256 s3 w8, flatten, no WS: the kernel that ships
  noflat         base without flatten (T=8192): the flatten effect alone, since WS has to drop it
  base_split     base with the two-dot gated tile (gate_up only)
  ws_tile        128x256 s3 w4, warp_specialize=True on the persistent tile loop (12 warps)
  ws_k           the same request on the K loop instead (T=8192; same PTX as ws_tile in 3.6)
  ws_tile_bn128  128x128 s4 w4, WS on the tile loop: twice the tiles, which matters at T=1024
  torch          torch.matmul (cuBLAS), the ceiling; for gate_up the matmul alone, no epilogue
42 timed variant x shape x T combinations.

Checks and timing. Every output is compared with torch's: max |y - ref| / max |ref|, with a bf16
tolerance of 2e-2. For gate_up, ref is torch's bf16 g and u put through the same epilogue. Timing
uses CUDA events: 3 warm-up launches, then the median of 20 launches. Before each launch a 256 MB
write evicts L2, so W (21-100 MB) comes from HBM as it does in a model step.

Failures. Each variant runs in a child process. A crash, a hang (30 s watchdog) or a sticky CUDA
error loses only the combination it happened in; a fresh child then runs the rest. A compile or
launch error is recorded as a string in the JSON, never raised.

Per kernel the JSON also records ws_applied, total warps, registers, spills and shared memory.

Prediction: against base, WS moves the 8192-row GEMMs by -5..+5 %, and no variant is clearly
faster than cuBLAS. gate_up gains least. The 1024-row down and o_proj stay bound by their tile
count (80 tiles of 128 x 256 on 132 SMs) in every variant. Reason: base is already within ~5 % of
cuBLAS. The 12-warp cooperative WS kernel changes neither the tile count nor the wgmma shape; it
only trades the flattened software pipeline for a producer group.

Run on the GPU (its own Triton JIT and torch; ~1.5-3 min on an H100):
  python3 bench/experiments/gemm_ws.py OUT_DIR                     -> OUT_DIR/gemm_ws.json + a table
  python3 bench/experiments/gemm_ws.py OUT_DIR --only base,ws_tile (a subset)
Here, without a GPU: .venv/bin/python bench/experiments/gemm_ws.py --compile-only
"""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
import child_runs  # noqa: E402
from gemm_tma import _tile_of  # noqa: E402  (the grouped tile order, as the plan's kernel has it)

PEAK = 989.0                 # H100 / H200 SXM dense bf16 TFLOP/s
TOL = 2e-2
REPS, WARMUP = 20, 3
HANG_S = 30                  # a first launch that has not finished after this long is a hang
CHILD_TIMEOUT_S = 240        # backstop for one child process
SHAPES = {"gate_up": (2560, 9728, True), "down": (9728, 2560, False), "qkv": (2560, 6144, False),
          "o_proj": (4096, 2560, False)}          # name: (K, N out, gated)
TS = (1024, 8192)
BK, GROUP_M = 64, 8
_ALL = dict(Ts=TS, shapes=tuple(SHAPES))
_BASE = dict(_ALL, BM=128, BN=256, stages=3, warps=8, FLATTEN=True, WS_TILE=False, WS_K=False, SPLIT=False)
_WS = dict(_BASE, warps=4, FLATTEN=False, SPLIT=True)     # Hopper WS: 4 warps a group, no flatten
VARIANTS = {
    "base": dict(_BASE),
    "noflat": dict(_BASE, FLATTEN=False, Ts=(8192,)),
    "base_split": dict(_BASE, SPLIT=True, shapes=("gate_up",)),
    "ws_tile": dict(_WS, WS_TILE=True),
    "ws_k": dict(_WS, WS_K=True, Ts=(8192,)),
    "ws_tile_bn128": dict(_WS, WS_TILE=True, BN=128, stages=4),
    "torch": dict(_ALL),
}
# Compiled by --compile-only, not timed: WS requests that the Hopper pass drops or that do not fit.
EXTRA_COMPILE = {
    "ws_tile_w8": dict(_BASE, FLATTEN=False, WS_TILE=True),                # 8 warps: WS silently dropped
    "ws_tile_flat": dict(_WS, FLATTEN=True, WS_TILE=True),                 # flatten: WS silently dropped
    "ws_tile_nosplit": dict(_WS, WS_TILE=True, SPLIT=False, shapes=("gate_up",)),  # 3.6: pass fails
    "ws_tile_s4": dict(_WS, WS_TILE=True, stages=4),                       # > 227 KB shared at 128x256
}


@triton.jit
def _one_tile(a_desc, w_desc, y_desc, pid_m, pid_n, N: tl.constexpr, K: tl.constexpr, BM: tl.constexpr,
              BN: tl.constexpr, BK: tl.constexpr, GATED: tl.constexpr, SPLIT: tl.constexpr, WS_K: tl.constexpr,
              DOT_F32: tl.constexpr):
    if GATED and SPLIT:   # gate and up as two [BN/2, BK] boxes of W [2F, K] and two dots: no reshape/split
        acc_g = tl.zeros([BM, BN // 2], tl.float32)
        acc_u = tl.zeros([BM, BN // 2], tl.float32)
        for k in tl.range(0, K, BK, warp_specialize=WS_K):
            a = a_desc.load([pid_m * BM, k])
            wg = w_desc.load([pid_n * (BN // 2), k])
            wu = w_desc.load([N + pid_n * (BN // 2), k])
            if DOT_F32:
                acc_g = tl.dot(a.to(tl.float32), wg.to(tl.float32).T, acc_g, input_precision="ieee")
                acc_u = tl.dot(a.to(tl.float32), wu.to(tl.float32).T, acc_u, input_precision="ieee")
            else:
                acc_g = tl.dot(a, wg.T, acc_g)
                acc_u = tl.dot(a, wu.T, acc_u)
        g = acc_g.to(tl.bfloat16).to(tl.float32)
        u = acc_u.to(tl.bfloat16).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(tl.bfloat16).to(tl.float32)
        y_desc.store([pid_m * BM, pid_n * (BN // 2)], (s * u).to(tl.bfloat16))
    else:
        acc = tl.zeros([BM, BN], tl.float32)
        for k in tl.range(0, K, BK, warp_specialize=WS_K):
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
def gemm_ws(a_ptr, w_ptr, y_ptr, T, N: tl.constexpr, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
            BK: tl.constexpr, GROUP_M: tl.constexpr, GATED: tl.constexpr, NUM_SMS: tl.constexpr,
            FLATTEN: tl.constexpr, WS_TILE: tl.constexpr, WS_K: tl.constexpr, SPLIT: tl.constexpr = False,
            DOT_F32: tl.constexpr = False):
    """gemm_tma.py's persistent TMA GEMM (PERSISTENT=True), the loop options as constexprs."""
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[T, K], strides=[K, 1], block_shape=[BM, BK])
    if GATED:
        if SPLIT:
            w_desc = tl.make_tensor_descriptor(w_ptr, shape=[2 * N, K], strides=[K, 1], block_shape=[BN // 2, BK])
        else:
            w_desc = tl.make_tensor_descriptor(w_ptr, shape=[2, N, K], strides=[N * K, K, 1],
                                               block_shape=[2, BN // 2, BK])
        y_desc = tl.make_tensor_descriptor(y_ptr, shape=[T, N], strides=[N, 1], block_shape=[BM, BN // 2])
        num_n = tl.cdiv(N, BN // 2)
    else:
        w_desc = tl.make_tensor_descriptor(w_ptr, shape=[N, K], strides=[K, 1], block_shape=[BN, BK])
        y_desc = tl.make_tensor_descriptor(y_ptr, shape=[T, N], strides=[N, 1], block_shape=[BM, BN])
        num_n = tl.cdiv(N, BN)
    num_m = tl.cdiv(T, BM)
    for t in tl.range(tl.program_id(0), num_m * num_n, NUM_SMS, flatten=FLATTEN, warp_specialize=WS_TILE):
        pid_m, pid_n = _tile_of(t, num_m, num_n, GROUP_M)
        _one_tile(a_desc, w_desc, y_desc, pid_m, pid_n, N, K, BM, BN, BK, GATED, SPLIT, WS_K, DOT_F32)


def constexprs(v, K, N, gated, sms):
    return dict(N=N, K=K, BM=v["BM"], BN=v["BN"], BK=BK, GROUP_M=GROUP_M, GATED=gated, NUM_SMS=sms,
                FLATTEN=v["FLATTEN"], WS_TILE=v["WS_TILE"], WS_K=v["WS_K"], SPLIT=v["SPLIT"], DOT_F32=False)


def kernel_info(k):
    """What the compiled kernel says about itself (any field may be missing in another Triton)."""
    info = {}
    try:
        ttgir = k.asm.get("ttgir", "")
        info["ws_applied"] = "ttg.warp_specialize" in ttgir
        md = k.metadata
        info["warps_total"] = getattr(md, "num_warps", None)
        info["shared"] = getattr(md, "shared", None)
        info["n_regs"] = getattr(k, "n_regs", None)
        info["n_spills"] = getattr(k, "n_spills", None)
    except Exception as e:            # metadata only; never fails the variant
        info["info_error"] = repr(e)[:200]
    return info


# ----------------------------------------------------------------------------------------- GPU run
def combos(v):
    return [(T, s) for T in v["Ts"] for s in v["shapes"]]


def run_child(name, todo, part: Path):
    """Child process: the combinations todo of one variant; rewrites part after each one."""
    import torch
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    v = VARIANTS[name]
    flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")
    rows = json.loads(part.read_text()) if part.exists() else []
    current = part.with_suffix(".current")
    for T, sname in todo:
        K, N, gated = SHAPES[sname]
        current.write_text(f"{T} {sname}")
        row = {"variant": name, "T": T, "linear": sname, "K": K, "N": N, "gated": gated, "us": None,
               "tflops": None, "pct_peak": None, "max_rel_err": None, "ok": None, "error": None}
        try:
            torch.manual_seed(0)
            x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
            w = torch.randn((2 * N if gated else N), K, device="cuda", dtype=torch.bfloat16) * K ** -0.5
            h = torch.matmul(x, w.T)
            if gated:
                g, u = h[:, :N].float(), h[:, N:].float()
                ref = ((g / (1.0 + torch.exp(-g))).to(torch.bfloat16).float() * u).to(torch.bfloat16)
            else:
                ref = h
            if name == "torch":
                y = torch.empty(T, 2 * N if gated else N, device="cuda", dtype=torch.bfloat16)
                fn = lambda: torch.matmul(x, w.T, out=y)         # noqa: E731
                if gated:
                    row["note"] = "matmul only, no epilogue"
            else:
                y = torch.empty(T, N, device="cuda", dtype=torch.bfloat16)
                tiles = triton.cdiv(T, v["BM"]) * triton.cdiv(N, v["BN"] // 2 if gated else v["BN"])
                grid = (min(sms, tiles),)
                kw = dict(constexprs(v, K, N, gated, sms), num_warps=v["warps"], num_stages=v["stages"])
                fn = lambda: gemm_ws[grid](x, w, y, T, **kw)     # noqa: E731
                row["tiles"], row["programs"] = tiles, grid[0]
            k = fn()                          # compiles (Triton) and launches once
            done = torch.cuda.Event()
            done.record()
            t0 = time.time()
            while not done.query():
                if time.time() - t0 > HANG_S:
                    row["error"] = f"hang: first launch not finished after {HANG_S} s"
                    part.write_text(json.dumps(rows + [row], indent=1))
                    print(f"  {name} T={T} {sname}: HANG", flush=True)
                    os._exit(4)
                time.sleep(0.01)
            if name != "torch":
                row["kernel"] = kernel_info(k)
            if not (name == "torch" and gated):
                err = float((y.float() - ref.float()).abs().max() / ref.float().abs().max())
                row["max_rel_err"], row["ok"] = err, err <= TOL
            for _ in range(WARMUP):
                fn()
            ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(REPS)]
            for s, e in ev:
                flush.zero_()            # evict L2: W comes from HBM, as in a model step
                s.record()
                fn()
                e.record()
            torch.cuda.synchronize()
            us = sorted(s.elapsed_time(e) for s, e in ev)[REPS // 2] * 1e3
            row["us"] = us
            row["tflops"] = 2 * T * K * (2 * N if gated else N) / us / 1e6
            row["pct_peak"] = 100 * row["tflops"] / PEAK
        except Exception as e:           # a compile or run failure of this variant: recorded, not raised
            child_runs.failure(e, row, rows, part)
        child_runs.keep(row, rows, part)
        r = row
        if r["us"] is not None:
            bad = "" if r["ok"] is not False else " MISMATCH"
            print(f"  {name:14s} T={T:5d} {sname:8s} {r['us']:8.1f} us {r['tflops']:6.1f} TFLOP/s "
                  f"{r['pct_peak']:5.1f} %  err {r['max_rel_err'] or 0:.1e}{bad}  {r.get('kernel', '')}", flush=True)
        else:
            print(f"  {name:14s} T={T:5d} {sname:8s} ERROR {r['error'][:200]}", flush=True)
    current.unlink(missing_ok=True)


def run_variant(name, out: Path):
    """Parent side: runs the variant's combinations in child processes, a fresh child after a crash."""
    def failed(c, why):
        K, N, gated = SHAPES[c[1]]
        return {"variant": name, "T": c[0], "linear": c[1], "K": K, "N": N, "gated": gated,
                "us": None, "tflops": None, "error": why}
    rows = child_runs.run(Path(__file__), out, out / "gemm_ws_parts" / f"{name}.json", name,
                          combos(VARIANTS[name]), lambda r: (r["T"], r["linear"]), failed, CHILD_TIMEOUT_S)
    have = {(r["T"], r["linear"]) for r in rows}
    return rows + [failed(c, "not run (child failures)") for c in combos(VARIANTS[name]) if c not in have]


def main(out: Path, only=None):
    out.mkdir(parents=True, exist_ok=True)
    (out / "gemm_ws_parts").mkdir(exist_ok=True)
    probe = subprocess.run([sys.executable, "-c", "import torch, triton; print(torch.cuda.get_device_name()); "
                            "print(triton.__version__); print(torch.__version__)"], capture_output=True, text=True)
    gpu, tver, torchver = (probe.stdout.split("\n") + ["?"] * 3)[:3]
    res = {"gpu": gpu, "triton": tver, "torch": torchver, "peak_tflops": PEAK, "tol": TOL, "reps": REPS,
           "variants": {}, "runs": []}
    names = [n for n in VARIANTS if not only or n in only]
    t0 = time.time()
    for name in names:
        res["variants"][name] = {k: list(val) if isinstance(val, tuple) else val for k, val in VARIANTS[name].items()}
        print(f"{name} (at {time.time() - t0:.0f} s)", flush=True)
        res["runs"] += run_variant(name, out)
        (out / "gemm_ws.json").write_text(json.dumps(res, indent=1))
    res["wall_s"] = time.time() - t0
    (out / "gemm_ws.json").write_text(json.dumps(res, indent=1))
    print(f"\n{gpu}, Triton {tver}, torch {torchver}: TFLOP/s (% of {PEAK:.0f}); ! mismatch, x error, "
          "* WS requested but not in the compiled kernel, blank: not in the grid")
    print(f"{'T':>5} {'linear':8s}" + "".join(f"{n:>15s}" for n in names))
    by = {(r["variant"], r["T"], r["linear"]): r for r in res["runs"]}
    for T in TS:
        for sname in SHAPES:
            cells = []
            for n in names:
                r = by.get((n, T, sname))
                if r is None:
                    c = ""
                elif r.get("us") is None:
                    c = "x"
                else:
                    ws_req = VARIANTS[n].get("WS_TILE") or VARIANTS[n].get("WS_K")
                    c = (f"{r['tflops']:.0f} ({r['pct_peak']:.0f}%)" + ("!" if r.get("ok") is False else "")
                         + ("*" if ws_req and not r.get("kernel", {}).get("ws_applied") else ""))
                cells.append(f"{c:>15s}")
            print(f"{T:>5} {sname:8s}" + "".join(cells))
    for r in res["runs"]:
        if r.get("error"):
            print(f"error {r['variant']} T={r['T']} {r['linear']}: {r['error'][:300]}")
    print(f"wrote {out / 'gemm_ws.json'} ({res['wall_s']:.0f} s)")


# ------------------------------------------------------------------------------ build machine check
def compile_only():
    """AOT-compile every Triton variant for sm_90 with this machine's Triton (no GPU needed)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    sig = {"a_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "T": "i32"}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(3)}
    print(f"Triton {triton.__version__}, sm_90; shared limit 232448 B (227 KB)")
    todo = {**{n: v for n, v in VARIANTS.items() if n != "torch"}, **EXTRA_COMPILE}
    for name, v in todo.items():
        for sname in v["shapes"]:
            K, N, gated = SHAPES[sname]
            ce = constexprs(v, K, N, gated, 132)
            try:
                k = triton.compile(ASTSource(gemm_ws, {**sig, **{c: "constexpr" for c in ce}}, constexprs=ce,
                                             attrs=attrs),
                                   target=GPUTarget("cuda", 90, 32),
                                   options={"num_warps": v["warps"], "num_stages": v["stages"]})
                i = kernel_info(k)
                fits = "" if i["shared"] <= 232448 else "  TOO MUCH SHARED MEMORY"
                print(f"OK    {name:16s} {sname:8s} ws_applied={i['ws_applied']!s:5s} warps={i['warps_total']:2d} "
                      f"shared={i['shared']}{fits}", flush=True)
            except Exception as e:
                print(f"FAIL  {name:16s} {sname:8s} {type(e).__name__}: {' '.join(str(e).split())[-200:]}",
                      flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    if "--compile-only" in args:
        compile_only()
    elif "--child" in args:
        child_runs.child_entry(args, run_child, "gemm_ws_parts")
    else:
        only = args[args.index("--only") + 1].split(",") if "--only" in args else None
        main(Path(args[0] if args and not args[0].startswith("--") else "/tmp/exp-gemm-ws"), only)
