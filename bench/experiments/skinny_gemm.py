"""An experiment for issue 10's wide decode steps (bench/NOTES.md, "Issue 10: the 63-row decode
GEMVs"): at 64 concurrent requests qwen3-4b's decode steps of ~63 rows take 8.0 ms on an H100
against a ~6.1 ms floor, and the decode GEMVs' tensor-core path is ~1.6x its weight-read floor
there. Question: can a skinny GEMM that streams W exactly once from HBM (every program owns a
[BLOCK_N W rows x all M rows] tile, K split across programs) get these linears near the floor at
16-128 rows, where the plan's GEMV re-reads W per BLOCK_T=32 rows and tile tweaks did not help?

Linears (qwen3-4b decode): qkv K 2560 -> N 6144; o_proj K 4096 -> 2560; gate_up K 2560 ->
[gate | up] 2 x 9728 with y = bf16(bf16(silu(bf16 g)) * bf16 u) as the plan's gemv_silu_gated;
down K 9728 -> 2560. Rows M = 16, 32, 63, 64, 128.

Variants:
  plan     the committed plan's decode GEMV for the weight (generated/qwen3-4b, plan_kernels.py's
           plan_kernel / plain_launch at T = B = M; no PDL)
  cublas   torch.matmul(x, W^T) (for gate_up the matmul alone, no epilogue): a ceiling
  skinny   `skinny` below: swap-AB acc[BLOCK_N, BLOCK_M] += W_tile[BLOCK_N, 64] @ X_tile[BLOCK_M, 64]^T
           on tensor cores, BLOCK_M = next power of two >= M (>= 16), 4 warps, 4 stages; grid
           (W row blocks, SPLIT_K). Names: skinny_bn{64,128}_s{S}_{tma,ptr}_{red,atom}:
             tma   W and X tiles through device-side TMA descriptors (tl.make_tensor_descriptor);
             ptr   plain pointer loads (16-byte vectors, W with evict_first)
             S = 1 one launch, the (gated) epilogue in the kernel (gate_up: a tile is BLOCK_N/2 gate
                   rows then the same BLOCK_N/2 up rows, one [2, BLOCK_N/2, 64] TMA box, one dot)
             red   S > 1, deterministic: per-split fp32 partials [S, M, W rows], then `reduce`
                   (sums the splits in order, applies the gated epilogue, writes bf16): two launches,
                   timed together
             atom  S > 1, fp32 atomic adds into an [M, W rows] workspace, then `reduce` (S = 1)
                   which also re-zeroes it: two launches, not deterministic
           SPLIT_K auto: the power of two in 1..16 whose programs (row blocks x S) come closest to
           3 x the SM count, with >= 4 K steps of 64 a split. Grid (65 skinny timings):
           every (linear, M): bn64 at auto S, tma, red, and bn128 too at M >= 63 (32); at M = 64
           also S in {1, 2, 4, 8} not auto for both BLOCK_N, and bn64 at auto S with ptr and with
           atom (33). Plus plan and cublas at every (linear, M) (40).
  floor    W bytes / the copy bandwidth (a device-to-device torch copy of a 1 GiB buffer, read +
           written bytes per second, as bench/common.py counts it), measured in the same run.

Timing (gemv_yardstick.py's method): per linear, COPIES = 8 copies of W (21-100 MB each, 168 MB to
0.8 GB in all, against 50 MB of L2), one launch (or launch pair) per copy in one CUDA Graph, the
median of REPS = 30 replays divided by COPIES: us per linear, every W from HBM because seven other
copies pass through L2 between two reads of one. If a variant's graph capture fails it is timed
eagerly (same loop, CUDA events, "eager" in the JSON). Each output (copy 0) is checked against torch
in fp32 (x.float() @ W.float().T, and for gate_up the plan's roundings): max |y - ref| / max |ref|
<= 2e-2, else marked "!" (mismatch). Each linear runs in a child process, each variant in a
try/except; a child that dies loses only the variant it was in (a fresh child runs the rest).

Prediction: skinny's best config lands at ~1.2-1.35x the floor at 63-64 rows on all four linears
(plan ~1.5-1.7x, cuBLAS ~1.2-1.5x), gaining most on o_proj and down (split-K) and least on gate_up;
at 16 rows all three sit nearer their ramp than the floor, and at 128 rows the X tiles re-read
from L2 per W tile start to cost. Reason: BLOCK_T 64 did not help the plan, so its loss is not the
second pass over W but its pointer-load pipeline on small 64-row tiles and the split's per-tile
counters; W once through TMA in >= 3 x SMs programs leaves only the ramp and tail of one launch
(~3-5 us against 7-33 us floors) and the split partials (<= 10 % of W's bytes, mostly in L2).

Run on the GPU (its own Triton JIT and torch; ~1.5-2.5 min on an H100):
  python3 bench/experiments/skinny_gemm.py OUT_DIR         -> OUT_DIR/skinny_gemm.json + a table
Here, without a GPU:
  .venv/bin/python bench/experiments/skinny_gemm.py --compile-only    (AOT, sm_90, this Triton)
  .venv/bin/python bench/experiments/skinny_gemm.py --check           (TRITON_INTERPRET=1, CPU)
"""
import json
import math
import os
import sys
import time
from pathlib import Path

if "--check" in sys.argv:                     # before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import child_runs  # noqa: E402

LINEARS = {"qkv": ("wqkv", 2560, 6144, False), "o_proj": ("wo", 4096, 2560, False),
           "gate_up": ("wgu", 2560, 9728, True), "down": ("wd", 9728, 2560, False)}  # plan weight, K, N, gated
MS = (16, 32, 63, 64, 128)
SWEEP_M = 64
BK = 64
NUM_WARPS, NUM_STAGES = 4, int(os.environ.get("SKINNY_STAGES", 4))   # SKINNY_STAGES: deeper pipelines
COPIES, REPS = 8, 30
TOL = 2e-2
RED_BLOCK = 1024
CHILD_TIMEOUT_S = 150


# ------------------------------------------------------------------------------------------ kernels
@triton.jit
def skinny(x_ptr, w_ptr, y_ptr, part_ptr, M, N, K, KCHUNK,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BK: tl.constexpr, GATED: tl.constexpr,
           MODE: tl.constexpr, TMA: tl.constexpr, DOT_F32: tl.constexpr, TWO: tl.constexpr):
    """y[M, N] = x[M, K] @ W^T, W [NW, K] (NW = 2N gate rows then up rows when GATED, else N).
    Program (pid_n, pid_k): a tile of BLOCK_N W rows over K range [pid_k * KCHUNK, + KCHUNK), all
    M rows (masked past M / zero-filled by TMA): acc[BLOCK_N, BLOCK_M] += W_tile @ X_tile^T.
    MODE 0: whole K (one split); writes y. TWO (GATED, MODE 0): the tile is gate rows f0 .. f0 + H
            then up rows N + f0 .. (H = BLOCK_N / 2; TMA: one [2, H, BK] box of W seen as [2, N, K]),
            one dot, the plan's epilogue on the two halves. MODE 1: fp32 partials part[pid_k, m, n]
            (n < NW). MODE 2: fp32 atomic adds into part[m, n]."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    NW = 2 * N if GATED else N
    H: tl.constexpr = BLOCK_N // 2
    n0 = pid_n * (H if TWO else BLOCK_N)
    k_lo = pid_k * KCHUNK
    k_hi = tl.minimum(K, k_lo + KCHUNK)
    offs_m = tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BK)
    if TMA:
        x_desc = tl.make_tensor_descriptor(x_ptr, shape=[M, K], strides=[K, 1], block_shape=[BLOCK_M, BK])
        if TWO:
            w_desc = tl.make_tensor_descriptor(w_ptr, shape=[2, N, K], strides=[N * K, K, 1], block_shape=[2, H, BK])
        else:
            w_desc = tl.make_tensor_descriptor(w_ptr, shape=[NW, K], strides=[K, 1], block_shape=[BLOCK_N, BK])
    else:
        x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * K
        m_ok = offs_m[:, None] < M
        if TWO:   # gate rows, then up rows; out-of-range f re-read row N-1 (results dropped)
            f = tl.minimum(n0 + offs_r % H, N - 1)
            w_rows = w_ptr + (f + (offs_r // H) * N).to(tl.int64)[:, None] * K
        else:
            w_rows = w_ptr + tl.minimum(n0 + offs_r, NW - 1).to(tl.int64)[:, None] * K
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k in tl.range(k_lo, k_hi, BK):
        if TMA:
            xt = x_desc.load([0, k])
            if TWO:
                wt = tl.reshape(w_desc.load([0, n0, k]), [BLOCK_N, BK])
            else:
                wt = w_desc.load([n0, k])
        else:
            kk = k + offs_k[None, :]
            xt = tl.load(tl.multiple_of(x_rows + kk, [1, 16]), mask=m_ok & (kk < K), other=0.0)
            wt = tl.load(tl.multiple_of(w_rows + kk, [1, 16]), mask=kk < K, other=0.0,
                         eviction_policy="evict_first")
        if DOT_F32:       # the interpreter (a CPU check of this file) runs bf16 dots wrong
            acc = tl.dot(wt.to(tl.float32), tl.trans(xt.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(wt, tl.trans(xt), acc)
    m_mask = offs_m[None, :] < M
    if TWO:
        g, u = tl.split(tl.permute(tl.reshape(acc, [2, H, BLOCK_M]), (1, 2, 0)))
        g = g.to(tl.bfloat16).to(tl.float32)
        u = u.to(tl.bfloat16).to(tl.float32)
        a = (g / (1.0 + tl.exp(-g))).to(tl.bfloat16).to(tl.float32)
        offs_f = n0 + tl.arange(0, H)
        offs = offs_m.to(tl.int64)[None, :] * N + offs_f[:, None]
        tl.store(y_ptr + offs, (a * u).to(tl.bfloat16), mask=m_mask & (offs_f[:, None] < N))
    else:
        offs_n = n0 + offs_r
        if MODE == 0:
            offs = offs_m.to(tl.int64)[None, :] * N + offs_n[:, None]
            tl.store(y_ptr + offs, acc.to(tl.bfloat16), mask=m_mask & (offs_n[:, None] < N))
        elif MODE == 1:
            offs = (pid_k * M + offs_m.to(tl.int64))[None, :] * NW + offs_n[:, None]
            tl.store(part_ptr + offs, acc, mask=m_mask & (offs_n[:, None] < NW))
        else:
            offs = offs_m.to(tl.int64)[None, :] * NW + offs_n[:, None]
            tl.atomic_add(part_ptr + offs, acc, mask=m_mask & (offs_n[:, None] < NW), sem="relaxed")


@triton.jit
def reduce(part_ptr, y_ptr, M, N, S, GATED: tl.constexpr, ZERO: tl.constexpr, BLOCK: tl.constexpr):
    """y[m, f] from part [S, M, NW] fp32: the splits summed in order s = 0 .. S-1 (deterministic),
    then (GATED) the plan's epilogue on g = sum[m, f], u = sum[m, N + f]; bf16 out. ZERO: write zeros
    back (the atomic variant's workspace, S = 1, ready for the next launch)."""
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < M * N
    m = (idx // N).to(tl.int64)
    f = idx % N
    NW = 2 * N if GATED else N
    g = tl.zeros([BLOCK], tl.float32)
    u = tl.zeros([BLOCK], tl.float32)
    for s in range(S):
        base = (s * M + m) * NW + f
        g += tl.load(part_ptr + base, mask=mask, other=0.0)
        if GATED:
            u += tl.load(part_ptr + base + N, mask=mask, other=0.0)
    if GATED:
        g = g.to(tl.bfloat16).to(tl.float32)
        u = u.to(tl.bfloat16).to(tl.float32)
        a = (g / (1.0 + tl.exp(-g))).to(tl.bfloat16).to(tl.float32)
        v = a * u
    else:
        v = g
    tl.store(y_ptr + m * N + f, v.to(tl.bfloat16), mask=mask)
    if ZERO:
        tl.store(part_ptr + m * NW + f, tl.zeros([BLOCK], tl.float32), mask=mask)
        if GATED:
            tl.store(part_ptr + m * NW + f + N, tl.zeros([BLOCK], tl.float32), mask=mask)


# ------------------------------------------------------------------------------------ configuration
def block_m(M):
    return max(16, triton.next_power_of_2(M))


def auto_split(K, NW, bn, sms):
    nb = triton.cdiv(NW, bn)
    best = 1
    for s in (1, 2, 4, 8, 16):
        if K // (BK * s) < 4:
            break
        if abs(math.log(nb * s / (3 * sms))) < abs(math.log(nb * best / (3 * sms))):
            best = s
    return best


def split_of(K, S):
    """(K range of a split, splits that get a non-empty range)."""
    chunk = triton.cdiv(triton.cdiv(K, S), BK) * BK
    return chunk, triton.cdiv(K, chunk)


def skinny_variants(lin, M, sms):
    """[(name, cfg)] timed for this linear at M rows."""
    _, K, N, gated = LINEARS[lin]
    NW = 2 * N if gated else N
    out = {}

    def add(bn, s, tma, red):
        s_eff = split_of(K, s)[1]
        red = red if s_eff > 1 else "one"
        name = f"skinny_bn{bn}_s{s_eff}_{'tma' if tma else 'ptr'}_{red}"
        out[name] = dict(BN=bn, S=s_eff, TMA=tma, RED=red)
    for bn in ((64, 128) if M > 32 else (64,)):       # 128-row W tiles only from 63 rows up
        add(bn, auto_split(K, NW, bn, sms), True, "red")
    if M == SWEEP_M:
        for bn in (64, 128):
            for s in (1, 2, 4, 8):
                add(bn, s, True, "red")
        s = auto_split(K, NW, 64, sms)
        add(64, s, False, "red")
        add(64, s, True, "atom")
    return list(out.items())


def skinny_launch(cfg, x, w, y, part, M, K, N, gated):
    """-> a no-argument call: the skinny kernel (and its reduce pass) on these buffers."""
    bn, S, tma, red = cfg["BN"], cfg["S"], cfg["TMA"], cfg["RED"]
    NW = 2 * N if gated else N
    chunk, S = split_of(K, S)
    mode = {"one": 0, "red": 1, "atom": 2}[red]
    nb = triton.cdiv(N, bn // 2) if (gated and mode == 0) else triton.cdiv(NW, bn)
    kw = dict(BLOCK_M=block_m(M), BLOCK_N=bn, BK=BK, GATED=gated, MODE=mode, TMA=tma, DOT_F32=cfg.get("F32", False),
              TWO=gated and mode == 0,
              num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    rgrid = (triton.cdiv(M * N, RED_BLOCK),)

    def fn():
        skinny[(nb, S)](x, w, y, part, M, N, K, chunk, **kw)
        if mode:
            reduce[rgrid](part, y, M, N, S if mode == 1 else 1, GATED=gated, ZERO=mode == 2, BLOCK=RED_BLOCK,
                          num_warps=4)
    return fn


def reference(x, w, N, gated):
    h = x.float() @ w.float().T
    if not gated:
        return h
    g, u = h[:, :N].to(torch.bfloat16).float(), h[:, N:].to(torch.bfloat16).float()
    return ((g / (1.0 + torch.exp(-g))).to(torch.bfloat16).float() * u).to(torch.bfloat16).float()


def rel_err(y, ref):
    return float((y.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


# ------------------------------------------------------------------------------------------ GPU run
def time_fns(fns):
    """fns: one call per W copy. -> (us per copy, 'graph' | 'eager')."""
    from plan_kernels import graph_us
    try:
        return graph_us(lambda: [f() for f in fns], layers=len(fns), reps=REPS), "graph"
    except Exception:
        torch.cuda.synchronize()
        ts = []
        for _ in range(REPS):
            t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0.record()
            for f in fns:
                f()
            t1.record()
            torch.cuda.synchronize()
            ts.append(t0.elapsed_time(t1) * 1e3 / len(fns))
        return sorted(ts)[len(ts) // 2], "eager"


def new_row(lin, M, v, K, N, gated):
    """One (linear, rows, variant) result row, before it is run."""
    return {"linear": lin, "M": M, "variant": v, "K": K, "N": N, "gated": gated,
            "w_MB": (2 * N if gated else N) * K * 2 / 1e6,
            "us": None, "timing": None, "max_rel_err": None, "ok": None, "error": None}


def measure(row, fns, y, want, want_after):
    """Copy 0 once, checked against want (None: nothing comparable, cuBLAS's gated matmul); every
    copy timed; then the output checked again against want_after() (None: skip): still right
    after the timed replays (the last copy's output, counters back at zero)."""
    fns[0]()
    torch.cuda.synchronize()
    if want is not None:
        err = rel_err(y, want)
        row["max_rel_err"], row["ok"] = err, err <= TOL
    row["us"], row["timing"] = time_fns(fns)
    if want_after is not None:
        err2 = rel_err(y, want_after())
        row["max_rel_err_after"] = err2
        row["ok"] = row["ok"] and err2 <= TOL


def report(row, width):
    lin, M, v = row["linear"], row["M"], row["variant"]
    if row["us"] is not None:
        bad = "" if row["ok"] is not False else " MISMATCH"
        print(f"  {lin:8s} M={M:4d} {v:{width}s} {row['us']:8.2f} us ({row['timing']}) "
              f"err {row['max_rel_err'] or 0:.1e}{bad}", flush=True)
    else:
        print(f"  {lin:8s} M={M:4d} {v:{width}s} ERROR {row['error'][:300]}", flush=True)


def variants_of(lin, sms):
    """[(M, variant name)] of one linear, in run order."""
    return [(M, v) for M in MS for v in ["plan", "cublas"] + [n for n, _ in skinny_variants(lin, M, sms)]]


def run_child(lin, todo, part: Path):
    """Child process: the (M, variant) combinations todo of one linear; rewrites part after each."""
    from plan_kernels import plain_launch, plan_kernel
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    wname, K, N, gated = LINEARS[lin]
    NW = 2 * N if gated else N
    rows = json.loads(part.read_text()) if part.exists() else []
    current = part.with_suffix(".current")
    torch.manual_seed(0)
    ws = [torch.randn(NW, K, device="cuda", dtype=torch.bfloat16) * K ** -0.5 for _ in range(COPIES)]
    mod, meta = plan_kernel(lambda l: l["inputs"][1] == wname and l["op"].startswith("linear"))
    cfgs = {M: dict(skinny_variants(lin, M, sms)) for M in MS}
    xs, refs = {}, {}
    for M, v in todo:
        current.write_text(f"{M} {v}")
        row = new_row(lin, M, v, K, N, gated)
        try:
            if M not in xs:
                xs[M] = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
                refs[M] = reference(xs[M], ws[0], N, gated)
            x = xs[M]
            if v == "cublas":
                y = torch.empty(M, NW, device="cuda", dtype=torch.bfloat16)
                fns = [lambda w=w: torch.matmul(x, w.T, out=y) for w in ws]
                if gated:
                    row["note"] = "matmul only, no epilogue"
            elif v == "plan":
                y = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
                fns = [plain_launch(mod, meta, {"in:0": x, "in:1": w, "out:0": y}, T=M, B=M) for w in ws]
                row["plan"] = {"entry": meta["entry"], **{k: meta["constexprs"][k] for k in
                               ("BLOCK_N_DOT", "BLOCK_T", "BLOCK_K", "ZMAX")}, "num_warps": meta["num_warps"],
                               "num_stages": meta["num_stages"]}
            else:
                cfg = cfgs[M][v]
                y = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
                S = cfg["S"]
                part_el = (S * M * NW) if cfg["RED"] == "red" else (M * NW) if cfg["RED"] == "atom" else 1
                scratch = torch.zeros(part_el, device="cuda", dtype=torch.float32)
                fns = [skinny_launch(cfg, x, w, y, scratch, M, K, N, gated) for w in ws]
                row["config"] = dict(cfg, BLOCK_M=block_m(M), BK=BK, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
                                     programs=triton.cdiv(NW, cfg["BN"]) * S)
            measure(row, fns, y, None if (v == "cublas" and gated) else refs[M],
                    None if v == "cublas" else lambda: reference(x, ws[-1], N, gated))
        except Exception as e:           # a compile or run failure of this variant: recorded, not raised
            child_runs.failure(e, row, rows, part)
        child_runs.keep(row, rows, part)
        report(row, 30)
    current.unlink(missing_ok=True)


def run_linear(lin, out: Path, sms):
    return child_runs.run_linear_rows(Path(__file__), out, "skinny_gemm_parts", lin, variants_of(lin, sms), CHILD_TIMEOUT_S)


def copy_bandwidth(nbytes=1 << 30, reps=10):
    """Device-to-device torch copy of a 1 GiB buffer: bytes read + written per second (median)."""
    a = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ts = []
    for _ in range(reps + 2):
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        b.copy_(a)
        t1.record()
        torch.cuda.synchronize()
        ts.append(t0.elapsed_time(t1) * 1e-3)
    del a, b
    torch.cuda.empty_cache()
    return 2 * nbytes / sorted(ts[2:])[reps // 2]


def main(out: Path):
    out.mkdir(parents=True, exist_ok=True)
    (out / "skinny_gemm_parts").mkdir(exist_ok=True)
    t0 = time.time()
    bw = copy_bandwidth()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    res = {"gpu": torch.cuda.get_device_name(), "sms": sms, "triton": triton.__version__, "torch": torch.__version__,
           "copy_bw_Bps": bw, "copies": COPIES, "reps": REPS, "tol": TOL, "bk": BK, "num_warps": NUM_WARPS,
           "num_stages": NUM_STAGES, "runs": []}
    print(f"{res['gpu']}, {sms} SMs, Triton {triton.__version__}, torch {torch.__version__}; "
          f"copy bandwidth {bw / 1e12:.2f} TB/s (read + write)", flush=True)
    for lin in LINEARS:
        print(f"{lin} (at {time.time() - t0:.0f} s)", flush=True)
        res["runs"] += run_linear(lin, out, sms)
        (out / "skinny_gemm.json").write_text(json.dumps(res, indent=1))
    for r in res["runs"]:
        _, K, N, gated = LINEARS[r["linear"]]
        r["floor_us"] = (2 * N if gated else N) * K * 2 / bw * 1e6
        if r.get("us"):
            r["x_floor"] = r["us"] / r["floor_us"]
    res["wall_s"] = time.time() - t0
    (out / "skinny_gemm.json").write_text(json.dumps(res, indent=1))

    print(f"\nus per linear (x the floor); ! mismatch, x error. floor = W bytes / {bw / 1e12:.2f} TB/s")
    print(f"{'linear':8s} {'M':>4s} {'floor':>7s} {'plan':>14s} {'best skinny':>14s}  {'config':30s} {'cublas':>14s}")
    cell = lambda r: ("x" if not r or r.get("us") is None else     # noqa: E731
                      f"{r['us']:.1f} ({r['x_floor']:.2f})" + ("!" if r.get("ok") is False else ""))
    for lin in LINEARS:
        for M in MS:
            rs = [r for r in res["runs"] if r["linear"] == lin and r["M"] == M]
            by = {r["variant"]: r for r in rs}
            sk = [r for r in rs if r["variant"].startswith("skinny") and r.get("us") and r.get("ok") is not False]
            best = min(sk, key=lambda r: r["us"]) if sk else None
            floor = rs[0]["floor_us"] if rs else 0
            print(f"{lin:8s} {M:4d} {floor:7.1f} {cell(by.get('plan')):>14s} {cell(best):>14s}  "
                  f"{best['variant'] if best else '-':30s} {cell(by.get('cublas')):>14s}")
    print(f"\nskinny at M = {SWEEP_M}, every config:")
    for lin in LINEARS:
        rs = [r for r in res["runs"] if r["linear"] == lin and r["M"] == SWEEP_M and r["variant"].startswith("skinny")]
        print(f"  {lin:8s} " + ", ".join(f"{r['variant'][7:]} {cell(r)}" for r in rs))
    for r in res["runs"]:
        if r.get("error"):
            print(f"error {r['linear']} M={r['M']} {r['variant']}: {r['error'][:300]}")
    print(f"wrote {out / 'skinny_gemm.json'} ({res['wall_s']:.0f} s)")


# ------------------------------------------------------------------------------ build machine checks
def all_configs(sms=132):
    """Every distinct (constexprs, gated) the GPU run compiles: {key: (cfg, M, K, N, gated)}."""
    seen = {}
    for lin, (_, K, N, gated) in LINEARS.items():
        for M in MS:
            for name, cfg in skinny_variants(lin, M, sms):
                mode = {"one": 0, "red": 1, "atom": 2}[cfg["RED"]]
                key = (block_m(M), cfg["BN"], gated, mode, cfg["TMA"])
                seen.setdefault(key, (cfg, M, K, N, gated, f"{lin} M={M} {name}"))
    return seen


def compile_only():
    """AOT-compile every skinny / reduce kernel of the GPU run for sm_90 with this machine's Triton."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    print(f"Triton {triton.__version__}, sm_90; shared limit 232448 B (227 KB)")
    target = GPUTarget("cuda", 90, 32)
    ok = fail = 0
    for (bm, bn, gated, mode, tma), (cfg, M, K, N, _, where) in sorted(all_configs().items()):
        sig = {"x_ptr": "*bf16", "w_ptr": "*bf16", "y_ptr": "*bf16", "part_ptr": "*fp32",
               "M": "i32", "N": "i32", "K": "i32", "KCHUNK": "i32"}
        ce = dict(BLOCK_M=bm, BLOCK_N=bn, BK=BK, GATED=gated, MODE=mode, TMA=tma, DOT_F32=False,
                  TWO=gated and mode == 0)
        attrs = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 5, 6, 7)}   # M may be 63
        try:
            k = triton.compile(ASTSource(skinny, {**sig, **{c: "constexpr" for c in ce}}, constexprs=ce, attrs=attrs),
                               target=target, options={"num_warps": NUM_WARPS, "num_stages": NUM_STAGES})
            md = k.metadata
            ptx = k.asm.get("ptx", "")
            fits = "" if md.shared <= 232448 else "  TOO MUCH SHARED MEMORY"
            print(f"OK    skinny BM={bm:3d} BN={bn:3d} gated={gated!s:5s} mode={mode} {'tma' if tma else 'ptr'} "
                  f"shared={md.shared:6d} wgmma={'wgmma' in ptx} tma={'cp.async.bulk.tensor' in ptx}{fits}   ({where})",
                  flush=True)
            ok += 1
        except Exception as e:
            print(f"FAIL  skinny BM={bm} BN={bn} gated={gated} mode={mode} tma={tma}: {type(e).__name__}: "
                  f"{' '.join(str(e).split())[-300:]}", flush=True)
            fail += 1
    for gated in (False, True):
        for zero in (False, True):
            sig = {"part_ptr": "*fp32", "y_ptr": "*bf16", "M": "i32", "N": "i32", "S": "i32"}
            ce = dict(GATED=gated, ZERO=zero, BLOCK=RED_BLOCK)
            try:
                k = triton.compile(ASTSource(reduce, {**sig, **{c: "constexpr" for c in ce}}, constexprs=ce,
                                             attrs={(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]}),
                                   target=target, options={"num_warps": 4})
                print(f"OK    reduce gated={gated} zero={zero}", flush=True)
                ok += 1
            except Exception as e:
                print(f"FAIL  reduce gated={gated} zero={zero}: {type(e).__name__}: {' '.join(str(e).split())[-300:]}")
                fail += 1
    print(f"{ok} compiled, {fail} failed")
    return fail == 0


def check():
    """The kernels' numerics under the Triton interpreter: small shapes, fp32 dots, every mode and loader."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8))
    torch.manual_seed(0)
    bad = 0
    for gated in (False, True):
        K, N = 320, 96 if gated else 160           # N not a multiple of BLOCK_N: the masks and TMA's OOB fill
        NW = 2 * N if gated else N
        w = (torch.randn(NW, K) * K ** -0.5).to(torch.bfloat16)
        for M in (5, 16, 33):
            x = torch.randn(M, K).to(torch.bfloat16)
            ref = reference(x, w, N, gated)
            for bn in (32, 64):
                for S in (1, 2, 5):
                    for tma in (True, False):
                        for red in (("red", "atom") if split_of(K, S)[1] > 1 else ("one",)):
                            cfg = dict(BN=bn, S=S, TMA=tma, RED=red, F32=True)
                            s_eff = split_of(K, S)[1]
                            part = torch.zeros(s_eff * M * NW if red == "red" else M * NW, dtype=torch.float32)
                            y = torch.full((M, N), float("nan")).to(torch.bfloat16)
                            fn = skinny_launch(cfg, x, w, y, part, M, K, N, gated)
                            try:
                                fn()
                                if red == "atom":      # twice: the reduce pass left the workspace zeroed
                                    assert float(part.abs().max()) == 0.0, "workspace not re-zeroed"
                                    fn()
                                err = rel_err(y, ref)
                                okk = err <= TOL and not torch.isnan(y.float()).any()
                                msg = f"max rel err {err:.1e}"
                            except Exception as e:
                                okk, msg = False, f"{type(e).__name__}: {' '.join(str(e).split())[-200:]}"
                            bad += not okk
                            print(f"{'ok ' if okk else 'BAD'} gated={gated!s:5s} M={M:2d} K={K} N={N} bn={bn} "
                                  f"S={S}->{s_eff} {'tma' if tma else 'ptr'} {red:4s} {msg}", flush=True)
    print(f"{bad} bad")
    return bad == 0


if __name__ == "__main__":
    child_runs.cli(sys.argv[1:], main, run_child, "skinny_gemm_parts", "/tmp/exp-skinny-gemm", check=check, compile_only=compile_only)
