"""Issue 43: how close to its bytes can a verify step's GEMV (2-8 rows) get on tensor cores?

The verify program's GEMVs at 5 rows cost 1.05-1.6x their one-row time on an H100 (bench/NOTES.md,
"the verify step's GEMVs on tensor cores"): gate|up 51 us against 39, q|k|v 26.5 against 16.6. This
probe times a bare skinny GEMM, out[t, n] = sum_k x[t, k] W[n, k] with W as the MMA's M operand
(acc[BN, BT] += W[BN, BK] @ x^T[BK, BT]) and the rows padded to BT = 16, at qwen3-4b's four linear
shapes, over a grid of W tiles, pipeline depths, K splits and W read by pointers or by a TMA
descriptor made in the kernel, or A's tile made in registers
(x * g * 1/rms, the verify program's merged prologue) before the dot; beside it the same kernel at one row and a copy's bandwidth (the floor). x is already
normalized (a separate norm's output): the question is the W stream alone. Not a kernel of infc's:
a measurement to decide whether the template's tensor-core path can reach the bound (1.15x a decode
step at verify(4)) by its tiles or needs another form.

The figures of bench/results/issue42-43-h100-2026-12-07 (call 1) came from its first form, three
kernels of the same lines, one a form (commit c1e54420 and the next).

    # GPU machine (torch + triton; JIT, ~1-2 min of compiles):
    python3 tools/experiments/skinny_gemm_probe.py OUT_DIR [--rows 5]
"""
import json
import sys
from pathlib import Path

SHAPES = {"gate|up": (19456, 2560), "q|k|v": (6144, 2560), "o": (2560, 4096), "down": (2560, 9728)}


def kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def skinny(w_ptr, x_ptr, out_ptr, N, K, T, K_PER, g_ptr, inv_ptr, FORM: tl.constexpr, BN: tl.constexpr,
               BK: tl.constexpr, BT: tl.constexpr, STAGES: tl.constexpr, ATOMIC: tl.constexpr):
        """FORM "ptr": W by pointers; "tma": W by a descriptor made in the kernel, as
        codegen_templates/triton/gemm.py.j2 makes its own; "norm": the verify program's merged
        prologue, A's tile made in registers (x * g * inv) before the dot (g_ptr / inv_ptr read only there)."""
        pid_n = tl.program_id(0)
        pid_s = tl.program_id(1)
        offs_n = pid_n * BN + tl.arange(0, BN)
        offs_t = tl.arange(0, BT)
        if FORM == "tma":
            w_desc = tl.make_tensor_descriptor(w_ptr, shape=[N, K], strides=[K, 1], block_shape=[BN, BK])
        if FORM == "norm":
            inv = tl.load(inv_ptr + offs_t, mask=offs_t < T, other=0.0)
        k_lo = pid_s * K_PER
        k_hi = tl.minimum(k_lo + K_PER, K)
        acc = tl.zeros([BN, BT], tl.float32)
        for k0 in tl.range(k_lo, k_hi, BK, num_stages=STAGES):
            k = k0 + tl.arange(0, BK)
            if FORM == "tma":
                w = w_desc.load([pid_n * BN, k0])      # out-of-range columns read as zero
            else:
                w = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * K + k[None, :], mask=k[None, :] < k_hi,
                            other=0.0)
            x = tl.load(x_ptr + offs_t[None, :] * K + k[:, None], mask=(offs_t[None, :] < T) & (k[:, None] < k_hi),
                        other=0.0)
            if FORM == "norm":
                g = tl.load(g_ptr + k, mask=k < k_hi, other=0.0)
                x = (x.to(tl.float32) * g.to(tl.float32)[:, None] * inv[None, :]).to(x_ptr.dtype.element_ty)
            acc = tl.dot(w, x, acc)
        o = out_ptr + offs_t[None, :] * N + offs_n[:, None]
        m = offs_t[None, :] < T
        if ATOMIC:
            tl.atomic_add(o, acc, mask=m, sem="relaxed")
        else:
            tl.store(o, acc, mask=m)

    return skinny


def main(out_dir: Path, rows: int):
    import torch
    import triton
    skinny = kernels()
    dev = torch.device("cuda")
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device=dev))
    props = torch.cuda.get_device_properties(dev)
    sms = props.multi_processor_count
    out_dir.mkdir(parents=True, exist_ok=True)
    # the floor: a 1 GiB device copy's read + write rate
    src = torch.empty(2**29, dtype=torch.bfloat16, device=dev).normal_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    for _ in range(10):
        dst.copy_(src)
    e1.record()
    torch.cuda.synchronize()
    bw = 2 * src.numel() * 2 * 10 / (e0.elapsed_time(e1) * 1e-3)
    del src, dst
    res = {"gpu": props.name, "copy_GBps": bw / 1e9, "rows": rows, "shapes": {}}
    print(f"{props.name}: copy {bw / 1e9:.0f} GB/s", flush=True)

    def timed(fn, copies, reps=20):
        """us a launch: a CUDA graph of reps launches over rotating weight copies (HBM, not L2)."""
        for i in range(len(copies)):
            fn(i)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            with torch.cuda.graph(g):
                for r in range(reps):
                    fn(r % len(copies))
        torch.cuda.synchronize()
        ts = []
        for _ in range(5):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            b.record()
            torch.cuda.synchronize()
            ts.append(a.elapsed_time(b) * 1e3 / reps)
        return sorted(ts)[len(ts) // 2]

    grid_cfg = [(bn, bk, st) for bn in (64, 128) for bk in (64, 128, 256) for st in (3, 4, 6)
                if bn * bk * 2 * st <= 160 * 1024]
    for name, (N, K) in SHAPES.items():
        ncopy = max(2, int(400e6 // (N * K * 2)) + 1)
        ws = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) for _ in range(ncopy)]
        x = torch.randn(16, K, device=dev, dtype=torch.bfloat16)
        g = torch.ones(K, device=dev, dtype=torch.bfloat16)       # the norm form's weight and 1/rms: ones,
        inv = torch.ones(16, device=dev, dtype=torch.float32)     # so every form has the same reference
        out = torch.zeros(16, N, device=dev, dtype=torch.float32)
        ref = (x[:rows].float() @ ws[0].float().t())
        floor_us = N * K * 2 / bw * 1e6
        rec = {"N": N, "K": K, "floor_us": floor_us, "runs": []}
        for form in ("ptr", "tma", "norm"):
            for bn, bk, st in grid_cfg:
                if form == "norm" and st != 4:
                    continue
                for split in (1, 2, 4, 8):
                    progs = (N // bn) * split
                    if progs < sms // 2 or progs > 8 * sms or (K // split) < bk:
                        continue
                    k_per = -(-K // split // bk) * bk
                    grid = (triton.cdiv(N, bn), split)
                    for t in (rows, 1):
                        def fn(i, t=t):     # split > 1 adds onto out: zeroed only for the check below
                            skinny[grid](ws[i], x, out, N, K, t, k_per, g, inv, FORM=form, BN=bn, BK=bk, BT=16,
                                         STAGES=st, ATOMIC=split > 1, num_warps=4)
                        try:
                            us = timed(fn, ws)
                        except Exception as e:    # a config the compiler refuses: say so, go on
                            print(f"{name} {form} {bn}x{bk} st{st} s{split}: {type(e).__name__}: {str(e)[:120]}")
                            break
                        if t == rows:
                            out.zero_()
                            fn(0)
                            torch.cuda.synchronize()
                            err = (out[:rows] - ref).abs().max().item() / ref.abs().max().item()
                        rec["runs"].append({"form": form, "BN": bn, "BK": bk, "stages": st, "split": split,
                                            "rows": t, "us": us, "rel_err": err if t == rows else None})
        runs = rec["runs"]
        for t in (rows, 1):
          for form in ("ptr", "tma", "norm"):
            best = min((r for r in runs if r["rows"] == t and r["form"] == form), key=lambda r: r["us"], default=None)
            if best:
                print(f"{name:8s} rows {t} {form:4s}: best {best['us']:.2f} us ({best['form']} {best['BN']}x{best['BK']} "
                      f"st{best['stages']} s{best['split']}, err {best['rel_err']}) floor {floor_us:.2f} "
                      f"({floor_us / best['us']:.0%})", flush=True)
        res["shapes"][name] = rec
        del ws
        torch.cuda.empty_cache()
        (out_dir / "skinny_gemm_probe.json").write_text(json.dumps(res, indent=1))   # each shape as it ends


if __name__ == "__main__":
    args = sys.argv[1:]
    n = int(args[args.index("--rows") + 1]) if "--rows" in args else 5
    main(Path(args[0]), n)
