"""Issue 42 probe (GPU machine, JIT: torch + the device's Triton): a batch-1 W4A16 GEMV's loop,
to choose the narrow int4 kernel's design the way fp8_gemv_probe.py chose the fp8 one.

    python3 tools/experiments/w4_gemv_probe.py [--check] [--out DIR]

y[n] = sum_k (q[n, k] - 8) * s[n, k // 128] * a[k]: symmetric int4 codes two a byte (low nibble
first along K), one scale per row and 128-column group (compressed-tensors W4A16 g128), a bf16
row of activations, W streamed from HBM (rotating copies past L2), timed under a CUDA graph:
  bf16      the bf16 GEMV of the same shape (the shipped narrow loop's form), for the ratio
  deq_fma   the shipped u4 loop: unpack, 2^23 bits, subtract the zero, scale, FMA an element
            ([BN, BK] fp32 partials, reduced once at the end)
  group_sum one group a tile: FMA the unscaled codes into the tile's row sums (a reduction a
            tile), then scale and subtract zero * sum(a) once a row and group
  dot_f16   tensor cores: the codes minus 8 as exact f16 integers dotted with a (bf16 in f16:
            exact within its range) padded to 16 rows, the group's scale on the sums
  words     the shipped groupsum form (triton/_gemv_w4.j2): W as int32 words, code i masked in
            place and ORed into 2^23 (one LOP3 + one FADD), A's columns k0 + 8j + i scaled by
            16^-(i % 4), the scale once a word's partial sum (BK 1024 by default)
and each one's fraction of the floor (W's bytes over the copy bandwidth measured in the run), then
a step's sum over qwen3-4b's 36 layers against the int4 floor of those linears (codes + scales).
The shipped kernels themselves (all three W4_FORMs) are timed by `infc tune prepare --phases narrow`
on the artifact (bench/NOTES.md, issue 42).
Only a probe: the numbers go to bench/NOTES.md; the product's kernels are the templates.
"""
import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

SHAPES = {"qkv": (6144, 2560), "o": (2560, 4096), "gate_up": (19456, 2560), "down": (2560, 9728)}
G = 128


@triton.jit
def _nibbles(raw):
    """bytes [BN, BK / 2] -> codes int32 [BN, BK] in K order (low nibble first)."""
    return tl.reshape(tl.join(raw & 15, raw >> 4), [raw.shape[0], raw.shape[1] * 2]).to(tl.int32)


@triton.jit
def _w4(w_ptr, a_ptr, s_ptr, y_ptr, N, K: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
        SPLIT: tl.constexpr, MODE: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    rows = pid_n * BN + tl.arange(0, BN)
    rc = tl.minimum(rows, N - 1)
    w_rows = w_ptr + rc.to(tl.int64)[:, None] * (K // 2)
    kc = K // SPLIT
    if MODE == 0:      # the bf16 GEMV (w_ptr holds bf16 [N, K])
        wb = w_ptr.to(tl.pointer_type(tl.bfloat16), bitcast=True) + rc.to(tl.int64)[:, None] * K
        acc = tl.zeros([BN, BK], tl.float32)
        for k0 in range(pid_s * kc, pid_s * kc + kc, BK):
            k = k0 + tl.arange(0, BK)
            w = tl.load(tl.multiple_of(wb + k[None, :], [1, 16]), eviction_policy="evict_first").to(tl.float32)
            acc += w * tl.load(a_ptr + k).to(tl.float32)[None, :]
        y = tl.sum(acc, axis=1)
    elif MODE == 1:    # dequantize each element, FMA
        acc = tl.zeros([BN, BK], tl.float32)
        for k0 in range(pid_s * kc, pid_s * kc + kc, BK):
            j = k0 // 2 + tl.arange(0, BK // 2)
            raw = tl.load(tl.multiple_of(w_rows + j[None, :], [1, 16]), eviction_policy="evict_first")
            v = (_nibbles(raw) | 0x4B000000).to(tl.float32, bitcast=True)
            s = tl.load(s_ptr + rc[:, None] * (K // 128) + (k0 + tl.arange(0, BK)[None, :]) // 128)
            a = tl.load(a_ptr + k0 + tl.arange(0, BK)).to(tl.float32)
            acc += (v - 8388616.0) * s * a[None, :]
        y = tl.sum(acc, axis=1)
    elif MODE == 2:    # one group a tile (BK = 128): unscaled row sums, scaled once a group
        y = tl.zeros([BN], tl.float32)
        for k0 in range(pid_s * kc, pid_s * kc + kc, BK):
            j = k0 // 2 + tl.arange(0, BK // 2)
            raw = tl.load(tl.multiple_of(w_rows + j[None, :], [1, 16]), eviction_policy="evict_first")
            v = (_nibbles(raw) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
            a = tl.load(a_ptr + k0 + tl.arange(0, BK)).to(tl.float32)
            t = tl.sum(v * a[None, :], axis=1)
            s = tl.load(s_ptr + rc * (K // 128) + k0 // 128)
            y += s * (t - 8.0 * tl.sum(a, axis=0))
    elif MODE == 4:    # int32 words, codes masked in place (the groupsum form)
        w32 = w_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + rc.to(tl.int64)[:, None] * (K // 8)
        acc = tl.zeros([BN, BK // 8], tl.float32)
        j8 = 8 * tl.arange(0, BK // 8)
        for k0 in range(pid_s * kc, pid_s * kc + kc, BK):
            wt = tl.load(tl.multiple_of(w32 + (k0 // 8 + tl.arange(0, BK // 8))[None, :], [1, 16]),
                         eviction_policy="evict_first")
            t = tl.zeros([BN, BK // 8], tl.float32)
            for i in tl.static_range(8):
                if i == 4:
                    wt = wt >> 16
                m = i % 4
                v = ((wt & (15 << (4 * m))) | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + 8.0 * (1 << (4 * m)))
                a = tl.load(a_ptr + k0 + j8 + i).to(tl.float32) * (1.0 / (1 << (4 * m)))
                t += v * a[None, :]
            s = tl.load(s_ptr + rc[:, None] * (K // 128) + (k0 + j8[None, :]) // 128)
            acc += t * s
        y = tl.sum(acc, axis=1)
    else:              # tensor cores: exact bf16 integers, A padded to 16 rows
        r16 = tl.arange(0, 16)
        acc = tl.zeros([BN, 16], tl.float32)
        for k0 in tl.range(pid_s * kc, pid_s * kc + kc, BK, num_stages=4):
            j = k0 // 2 + tl.arange(0, BK // 2)
            raw = tl.load(tl.multiple_of(w_rows + j[None, :], [1, 16]), eviction_policy="evict_first")
            v = ((_nibbles(raw) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0).to(tl.float16)
            a = tl.load(a_ptr + k0 + tl.arange(0, BK)[None, :] + 0 * r16[:, None], mask=r16[:, None] == 0,
                        other=0.0).to(tl.float16)
            s = tl.load(s_ptr + rc * (K // 128) + k0 // 128)
            acc += tl.dot(v, tl.trans(a), out_dtype=tl.float32) * s[:, None]
        y = tl.sum(tl.where(r16[None, :] == 0, acc, 0.0), axis=1)
    if SPLIT == 1:
        tl.store(y_ptr + rows, y, mask=rows < N)
    else:
        tl.atomic_add(y_ptr + rows, y, mask=rows < N, sem="relaxed")


VARIANTS = {"bf16": 0, "deq_fma": 1, "group_sum": 2, "dot_f16": 3, "words": 4}
CONFIGS = {0: [(8, 512, 1), (16, 256, 1), (16, 128, 2)],
           1: [(32, 256, 1), (16, 256, 1), (8, 512, 1), (16, 128, 2), (32, 512, 1)],
           2: [(32, 128, 1), (16, 128, 1), (64, 128, 1), (16, 128, 2), (32, 128, 2)],
           3: [(64, 128, 1), (64, 128, 2), (128, 128, 1), (64, 256, 1)],
           4: [(32, 1024, 1), (32, 512, 1), (64, 512, 1), (32, 512, 2), (16, 1024, 1), (64, 256, 1)]}


def _weights(N, K, mode, device, gen=None):
    q = torch.randint(0, 16, (N, K), device=device, generator=gen, dtype=torch.int32)
    s = (torch.rand(N, K // G, device=device, generator=gen) + 0.5) / 64
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)
    w = ((q - 8).float() * s.repeat_interleave(G, 1))
    return (w.to(torch.bfloat16) if mode == 0 else packed), s, w


def check(device):
    N, K = 200, 512
    a = torch.randn(K, device=device).to(torch.bfloat16)
    for name, mode in VARIANTS.items():
        stored, s, w = _weights(N, K, mode, device)
        want = (w.to(torch.bfloat16).float() if mode == 0 else w) @ a.float()
        y = torch.zeros(N, device=device)
        bn = 64 if mode == 3 else 16
        bk = 256 if mode == 4 else 128
        _w4[(triton.cdiv(N, bn), 2)](stored, a, s, y, N, K, bn, bk, 2, mode)
        print(f"{name:10s} rel err {((y - want).norm() / want.norm()).item():.2e}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--check", action="store_true", help="correctness on small shapes, then stop")
    o = ap.parse_args()
    if o.check:
        return check("cuda" if torch.cuda.is_available() else "cpu")
    from fp8_gemv_probe import copy_bandwidth     # (this folder: the fp8 probe's, same measurement)
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e12:.3f} TB/s", flush=True)
    results = []
    for shape, (N, K) in SHAPES.items():
        for name, mode in VARIANTS.items():
            stored, s, _ = _weights(N, K, mode, "cuda")
            nbytes = stored.numel() * stored.element_size()
            copies = [stored] + [stored.clone() for _ in range(max(1, (256 << 20) // nbytes))]
            a = torch.randn(K, device="cuda").to(torch.bfloat16)
            y = torch.zeros(N, device="cuda")
            best = None
            for bn, bk, split in CONFIGS[mode]:
                st = {"i": 0}

                def fn():
                    st["i"] = (st["i"] + 1) % len(copies)
                    _w4[(triton.cdiv(N, bn), split)](copies[st["i"]], a, s, y, N, K, bn, bk, split, mode)
                try:
                    fn()
                    torch.cuda.synchronize()
                    us = triton.testing.do_bench_cudagraph(fn, rep=50) * 1e3
                except Exception as e:  # noqa: BLE001
                    print(f"  {name} {shape} {bn}/{bk}/{split}: {type(e).__name__}: {str(e)[:100]}")
                    continue
                r = {"variant": name, "shape": shape, "N": N, "K": K, "BN": bn, "BK": bk, "split": split,
                     "us": round(us, 2), "of_floor": round(nbytes / bw * 1e6 / us, 3)}
                results.append(r)
                best = r if best is None or us < best["us"] else best
            if best:
                print(f"{name:10s} {shape:8s} best {best['us']:7.2f} us ({best['of_floor']:.0%})  "
                      f"BN={best['BN']} BK={best['BK']} split={best['split']}", flush=True)
            del copies
            torch.cuda.empty_cache()
    # a step: 36 layers of the four launches; the int4 floor counts the codes and the fp32 scales
    per_step = {}
    for r in results:
        key = (r["variant"], r["shape"])
        per_step[key] = min(per_step.get(key, 1e30), r["us"])
    floor_us = 36 * sum(N * K // 2 + N * (K // G) * 4 for N, K in SHAPES.values()) / bw * 1e6
    print(f"int4 floor of qwen3-4b's linears a step: {floor_us:.0f} us ({bw / 1e12:.2f} TB/s copy)")
    for name in VARIANTS:
        if all((name, sh) in per_step for sh in SHAPES):
            t = 36 * sum(per_step[(name, sh)] for sh in SHAPES)
            print(f"  {name:10s} {t:7.0f} us a step ({floor_us / t:.0%} of the floor)")
    out = Path(o.out) / "w4_gemv_probe.json"
    out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "copy_bw": bw, "results": results}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
