"""An experiment: why does the flash role of qwen3-4b's prefill / mixed-step attention run far below
the tensor cores, and which change to its K/V path or tile lifts it (issue 10's 256 bound)?

On an H200 (e5c7d52, bench profile, mixed step of 197 decodes + 16 prompts of 1024) attention_mixed
took 1,087 us a layer. The decode rows' KV costs ~200 of it (the step is 9.5 ms over the 16k-token
prefill step); the flash role's 137.6 GFLOP a layer (16 causal prompts, 32 q heads, D 128) in the
other ~880 us is ~156 TFLOP/s, a sixth of the dense bf16 peak. Its cubin: 246 registers a thread
at 8 warps and 161 KB of shared memory, so one program an SM and ~31 waves of ~4.5 key tiles each.

Kernels (all own code, the template's math: GQA rows packed as TOK tokens x G heads, online softmax
in exp2 units, causal mask on the diagonal tiles), timed on 16 prompts of 1024 tokens:
  gen         the artifact's generated attention_prefill, as shipped (paged, random page order)
  paged       this file's kernel, K/V gathered through a random block table (same form as gen)
  paged_id    the same, pages in order (what locality alone is worth)
  affine      K/V rows addressed as slot = sequence base + key (no block-table load)
  tma         K/V tiles through host tensor descriptors ([BLOCK_N, D] boxes of the cache's
              [slots, Hkv * D] view), pages in order
  *_nN_wW_sS  the same with BLOCK_N N, W warps, S stages; *_mM BLOCK_M M (TOK = M / G)
  (warp_specialize on the key loop aborts Triton 3.9's NVGPUWarpSpecialization pass with an
  assertion, which kills the process: not timed)
  sdpa_*      torch's scaled_dot_product_attention (flash / cuDNN / efficient backends), K and V
              repeated to 32 heads, [16, 32, 1024, 128]: what a library reaches on this shape

Prediction (before the run): the K/V pointer gather is not the cost (paged ~ affine within 10 %);
TMA gains 10-25 % by freeing registers and issue slots; a smaller key tile (BLOCK_N 64) with 2 programs
an SM gains more than any load path; cuDNN reaches 350-450 TFLOP/s. If one of our forms gets to
~300, the mixed step loses ~9 ms of its 222 (+2-3 % tok/s at 256).

Every output is checked against torch's SDPA (bf16 tolerance: max |o - ref| <= 2e-2 * max |ref|).
Timing: CUDA events, 3 warm-up launches, the median of 20.

Run on the GPU (torch + its Triton JIT): python3 bench/experiments/flash_prefill.py OUT_DIR [--only a,b]
"""
import json
import math
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

HQ, HKV, D, PS = 32, 8, 128, 16
G = HQ // HKV
PROMPTS, LEN = 16, 1024
SCALE_LOG2 = D ** -0.5 * 1.4426950408889634


@triton.jit
def _kv(k_cache, v_cache, k_desc, v_desc, bt, base, n0, kvh, HKV: tl.constexpr, D: tl.constexpr,
        PS: tl.constexpr, BLOCK_N: tl.constexpr, KV_MODE: tl.constexpr):
    # one [BLOCK_N, D] tile of keys and of values for kv head kvh, keys n0 .. n0 + BLOCK_N - 1
    if KV_MODE == 2:
        k = k_desc.load([base + n0, kvh * D])
        v = v_desc.load([base + n0, kvh * D])
    else:
        jj = n0 + tl.arange(0, BLOCK_N)
        if KV_MODE == 0:
            slot = tl.load(bt + jj // PS).to(tl.int64) * PS + jj % PS
        else:
            slot = (base + jj).to(tl.int64)
        kv_off = ((slot * HKV + kvh) * D)[:, None] + tl.arange(0, D)[None, :]
        k = tl.load(k_cache + kv_off)
        v = tl.load(v_cache + kv_off)
    return k, v


@triton.jit
def _tile(q, k, v, m_i, l_i, acc, n0, tok, QK_SCALE: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr):
    # s = q k^T scale (log2 units), causal mask on a diagonal tile; the online softmax update
    sc = tl.dot(q, tl.trans(k)) * QK_SCALE
    if MASK:
        jj = n0 + tl.arange(0, BLOCK_N)
        sc = tl.where(jj[None, :] <= tok[:, None], sc, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(sc, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(sc - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.jit
def flash(q_ptr, k_cache, v_cache, k_desc, v_desc, o_ptr, block_tables, seq_starts, max_pages,
          HQ: tl.constexpr, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, PS: tl.constexpr,
          BLOCK_M: tl.constexpr, TOK: tl.constexpr, BLOCK_N: tl.constexpr, QK_SCALE: tl.constexpr,
          KV_MODE: tl.constexpr):
    # o[t, h] = softmax_j(q[t, h] . K[j, h // G] * scale, j <= t) V: prompts with no cached prefix,
    # program (block, kv head) owns TOK tokens x G heads; blocks of all prompts numbered in order
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    blocks_per_seq = tl.cdiv(tl.load(seq_starts + 1) - tl.load(seq_starts), TOK)  # equal prompts
    seq = pid // blocks_per_seq
    t0 = (pid % blocks_per_seq) * TOK
    q_start = tl.load(seq_starts + seq)
    q_len = tl.load(seq_starts + seq + 1) - q_start
    r = tl.arange(0, BLOCK_M)
    tok = t0 + r // G
    head = kvh * G + r % G
    row_ok = tok < q_len
    d = tl.arange(0, D)
    o_off = ((q_start + tok).to(tl.int64) * HQ + head)[:, None] * D + d[None, :]
    q = tl.load(q_ptr + o_off, mask=row_ok[:, None], other=0.0)
    bt = block_tables + seq.to(tl.int64) * max_pages
    base = seq * max_pages * PS                                  # KV_MODE 1, 2: pages in order
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    kv_end = tl.minimum(t0 + TOK, q_len)
    full_end = ((t0 + 1) // BLOCK_N) * BLOCK_N                   # tiles every row sees whole
    for n0 in tl.range(0, full_end, BLOCK_N):
        k, v = _kv(k_cache, v_cache, k_desc, v_desc, bt, base, n0, kvh, HKV, D, PS, BLOCK_N, KV_MODE)
        m_i, l_i, acc = _tile(q, k, v, m_i, l_i, acc, n0, tok, QK_SCALE, BLOCK_N, False)
    for n0 in tl.range(full_end, kv_end, BLOCK_N):
        k, v = _kv(k_cache, v_cache, k_desc, v_desc, bt, base, n0, kvh, HKV, D, PS, BLOCK_N, KV_MODE)
        m_i, l_i, acc = _tile(q, k, v, m_i, l_i, acc, n0, tok, QK_SCALE, BLOCK_N, True)
    out = acc / l_i[:, None]
    tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])


def variants():
    """name -> (kind, params)"""
    v = {"gen": ("gen", {})}
    for mode, name in ((0, "paged"), (1, "affine"), (2, "tma")):
        for bm, bn, w, s in ((128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 4, 3), (128, 64, 8, 2),
                             (128, 128, 8, 2), (64, 64, 4, 3), (64, 128, 4, 3), (128, 64, 4, 4)):
            tag = "" if (bm, bn, w, s) == (128, 128, 8, 3) else f"_m{bm}_n{bn}_w{w}_s{s}"
            v[name + tag] = ("ours", dict(KV_MODE=mode, BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s))
    v["paged_id"] = ("ours", dict(KV_MODE=0, BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3, identity=True))
    for b in ("flash", "cudnn", "efficient"):
        v["sdpa_" + b] = ("sdpa", {"backend": b})
    return v


def inputs(identity: bool):
    g = torch.Generator(device="cuda").manual_seed(0)
    T = PROMPTS * LEN
    max_pages = LEN // PS
    q = torch.randn(T, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(PROMPTS, LEN, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(PROMPTS, LEN, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    npages = PROMPTS * max_pages
    order = torch.arange(npages, device="cuda") if identity else \
        torch.randperm(npages, device="cuda", generator=g)
    bt = order.view(PROMPTS, max_pages).to(torch.int32).contiguous()
    k_cache = torch.empty(npages * PS, HKV, D, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.empty_like(k_cache)
    slots = (bt.long()[:, :, None] * PS + torch.arange(PS, device="cuda")).view(PROMPTS, LEN)
    k_cache[slots.view(-1)] = k.view(-1, HKV, D)
    v_cache[slots.view(-1)] = v.view(-1, HKV, D)
    seq_starts = (torch.arange(PROMPTS + 1, device="cuda") * LEN).to(torch.int32)
    return dict(q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache, bt=bt, seq_starts=seq_starts,
                max_pages=max_pages, T=T)


def reference(x):
    q = x["q"].view(PROMPTS, LEN, HQ, D).transpose(1, 2)
    k = x["k"].transpose(1, 2).repeat_interleave(G, 1)
    v = x["v"].transpose(1, 2).repeat_interleave(G, 1)
    o = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    return o.transpose(1, 2).reshape(PROMPTS * LEN, HQ, D)


def timed(fn, reps=20, warm=3):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    return sorted(ts)[len(ts) // 2]


def launcher(kind, p, x, o, gen_mod):
    if kind == "gen":
        meta = gen_mod.META
        grid = (x["T"] // meta["constexprs"]["TOK"] + PROMPTS, HKV)
        ctx = torch.full((PROMPTS,), LEN, device="cuda", dtype=torch.int32)
        return lambda: gen_mod.attention_prefill[grid](
            x["q"], x["k_cache"], x["v_cache"], o, x["bt"], ctx, x["seq_starts"], x["max_pages"], x["T"], PROMPTS,
            **meta["constexprs"], num_warps=meta["num_warps"], num_stages=meta["num_stages"])
    if kind == "sdpa":
        from torch.nn.attention import SDPBackend, sdpa_kernel
        be = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
              "efficient": SDPBackend.EFFICIENT_ATTENTION}[p["backend"]]
        q = x["q"].view(PROMPTS, LEN, HQ, D).transpose(1, 2)
        k = x["k"].transpose(1, 2).repeat_interleave(G, 1)
        v = x["v"].transpose(1, 2).repeat_interleave(G, 1)

        def run():
            with sdpa_kernel([be]):
                r = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            o.copy_(r.transpose(1, 2).reshape(PROMPTS * LEN, HQ, D))
        return run
    from triton.tools.tensor_descriptor import TensorDescriptor
    bm, bn = p["BLOCK_M"], p["BLOCK_N"]
    kd = TensorDescriptor.from_tensor(x["k_cache"].view(-1, HKV * D), [bn, D])
    vd = TensorDescriptor.from_tensor(x["v_cache"].view(-1, HKV * D), [bn, D])
    grid = (PROMPTS * (LEN // (bm // G)), HKV)
    return lambda: flash[grid](
        x["q"], x["k_cache"], x["v_cache"], kd, vd, o, x["bt"], x["seq_starts"], x["max_pages"],
        HQ=HQ, HKV=HKV, G=G, D=D, PS=PS, BLOCK_M=bm, TOK=bm // G, BLOCK_N=bn, QK_SCALE=SCALE_LOG2,
        KV_MODE=p["KV_MODE"], num_warps=p["num_warps"], num_stages=p["num_stages"])


def main():
    out_dir = Path(sys.argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    only = None
    if "--only" in sys.argv:
        only = set(sys.argv[sys.argv.index("--only") + 1].split(","))
    gen_path = Path(".cache/artifacts/qwen3-4b/kernels")
    gen_mod = None
    cands = sorted(gen_path.glob("attention_prefill_*.py")) if gen_path.exists() else []
    if cands:
        import importlib.util
        spec = importlib.util.spec_from_file_location("gen_attention_prefill", cands[0])
        gen_mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(gen_mod)
    flops = PROMPTS * HQ * 4 * D * LEN * (LEN + 1) / 2
    data = {False: inputs(False), True: inputs(True)}
    ref = reference(data[False])
    scale = ref.abs().max().item()
    res = {"gpu": torch.cuda.get_device_name(), "triton": triton.__version__, "torch": torch.__version__,
           "prompts": PROMPTS, "len": LEN, "gflop": flops / 1e9, "variants": {}}
    print(f"{res['gpu']}, triton {triton.__version__}: {PROMPTS} prompts of {LEN}, {flops / 1e9:.1f} GFLOP")
    for name, (kind, p) in variants().items():
        if only and name not in only:
            continue
        if kind == "gen" and gen_mod is None:
            continue
        identity = kind == "ours" and (p.get("identity", False) or p["KV_MODE"] > 0)
        x = data[identity]
        o = torch.zeros_like(x["q"])
        row = {}
        try:
            t0 = time.time()
            fn = launcher(kind, p, x, o, gen_mod)
            fn()
            torch.cuda.synchronize()
            row["first_s"] = round(time.time() - t0, 2)
            err = (o.float() - ref).abs().max().item() / scale
            row["rel_err"] = err
            row["ok"] = err <= 2e-2
            us = timed(fn)
            row["us"] = us
            row["tflops"] = flops / us / 1e6
        except Exception as e:  # noqa: BLE001 - a variant that does not compile is a result
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        res["variants"][name] = row
        if "us" in row:
            print(f"{name:28s} {row['us']:9.1f} us {row['tflops']:6.1f} TFLOP/s err {row['rel_err']:.1e}"
                  f"{'' if row['ok'] else '  WRONG'}", flush=True)
        else:
            print(f"{name:28s} {row['error']}", flush=True)
    (out_dir / "flash_prefill.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
