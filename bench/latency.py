"""`infc bench latency`: batch-1 decode TPOT and TTFT against the bandwidth floor, beside two
PyTorch peers on the same GPU and prompts, timed in the same run: HF transformers' fastest path
(generate() with a static cache, which compiles the decode step) and the gpt-fast recipe (a static
KV cache and a decode step under torch.compile(mode="reduce-overhead", fullgraph=True): CUDA
graphs; bench/torch_peer.py). Each row of the printed table is set against the same floor.

floor_ms = (weight bytes + cache bytes read per step) / copy bandwidth; floor_ratio = floor/TPOT.
The cache bytes of a batch-1 decode step: the paged KV of the context (read), and a hybrid plan's
slot caches (caches.slot_bytes: conv + recurrent state, read and written back every step, so
counted twice: the copy bandwidth counts bytes read + written).

--tensor-parallel-size N [--enable-expert-parallel]: --artifact is a parallel build (plan.rank<r>.json),
run one process per GPU over NCCL (runtime/distributed/rank_workers.py, rank r on GPU r), rank 0 sampling. The
floor is then rank 0's: its weight shard and its share of the KV over the copy bandwidth of its GPU
(the ranks read their shards at once; the collectives' time is what the ranks add above it).
"""
import argparse
import time
from pathlib import Path

import numpy as np


def open_runner(artifact, model_dir, par: dict | None = None, **kw):
    """A CudaRunner of the artifact, or with par ({"world", "tp", "ep"}: compiler.parallel.settings)
    its ranks, one process per GPU over NCCL (a MultiProcessRunner: rank 0's runner is `.runner`).
    kw: CudaRunner arguments (JSON-able for the ranks)."""
    if par is None:
        from infc.runtime.cuda.runner import CudaRunner
        return CudaRunner(artifact, model_dir, **kw)
    from infc.runtime.distributed.rank_workers import MultiProcessRunner
    return MultiProcessRunner("infc.runtime.distributed.rank_runners:nccl_rank_runner",
                              {"artifact": str(artifact), "model_dir": str(model_dir), **kw}, par["world"])


def parallel_tag(par: dict | None) -> str:
    """'' for one GPU, else '-tp2', '-tp2-ep2', ... (results of a parallel run are named apart)."""
    if par is None:
        return ""
    lead = f"-dp{par['dp']}" if par.get("dp") else f"-tp{par['tp']}"
    return lead + (f"-ep{par['ep']}" if par["ep"] > 1 else "")


def parallel_fields(par: dict | None, runner=None) -> dict:
    """What a parallel run's result records about its ranks ({} for one GPU): with rank 0's
    runner, which collectives it ran (P2PCollectives: small all-reduces one-shot over the mapped
    peers, runtime/cuda/p2p.py; NcclCollectives: NCCL only)."""
    if par is None:
        return {}
    out = {"tensor_parallel_size": par["tp"], "expert_parallel_size": par["ep"], "world": par["world"],
           "data_parallel_size": par.get("dp", 1),
           "floor_of": "rank 0 (its weight shard and KV share)"}
    coll = getattr(runner, "collectives", None)
    if coll is not None:
        out["collectives"] = type(coll).__name__
    return out


def _infc(artifact, model_dir, prompts, out_len, seed=0, load_format="auto", par=None, out=None):
    """(result, the path it was saved to): saved here, before the ranks are stopped."""
    max_t = max(prompts) + 16
    t0 = time.perf_counter()
    r = open_runner(artifact, model_dir, par, max_num_batched_tokens=max_t, max_num_seqs=8,
                    buckets=[1, 2, 4, 8], num_pages=(max(prompts) + out_len) // 16 * 2 + 64,
                    load_format=load_format)
    print(f"infc runner{parallel_tag(par)} ready in {time.perf_counter() - t0:.1f} s", flush=True)
    try:
        res = _timed(r, getattr(r, "runner", r), prompts, out_len, seed, load_format, par)
        from .common import save
        return res, save("latency", res, out)
    finally:
        if par is not None:
            r.close()


def _timed(r, r0, prompts, out_len, seed, load_format, par):
    """r: the runner the steps go to; r0: rank 0's CudaRunner (r itself on one GPU)."""
    from infc.compiler.contract import caches
    from infc.runtime.engine.engine import overlaps
    from infc.runtime.engine.runner import RowSampling
    from infc.runtime.engine.sampling import SamplingParams
    from .common import copy_bandwidth, header
    res = header(r0.ctx, r0.plan["model"] + parallel_tag(par))
    bw = copy_bandwidth(r0.ctx)
    decl = caches.of_plan(r0.plan)
    kv_per_token, state_per_seq = caches.token_bytes(decl), caches.slot_bytes(decl)
    rng = np.random.default_rng(seed)
    greedy = [RowSampling(SamplingParams(temperature=0.0), 0, 0)]
    res.update(parallel_fields(par, r0))
    res.update({"copy_GBps": bw / 1e9, "weight_bytes": r0.weights.bytes, "load_format": load_format,
                "kv_bytes_per_token": kv_per_token, "state_bytes_per_seq": state_per_seq,
                "ttft_ms": {}, "ttft_samples_ms": {}, "tpot_ms_by_prompt": {},
                "floor_ms_by_prompt": {}})
    # decode as the engine runs it: overlapped steps where the runner can (INFC_OVERLAP=0: not)
    overlap = overlaps(r)
    res["overlap"] = overlap
    for n in prompts:
        ttfts, tpots = _time_prompt(r, n, out_len, rng, overlap, greedy)
        avg_ctx = n + out_len / 2
        floor = (r0.weights.bytes + kv_per_token * avg_ctx + 2 * state_per_seq) / bw * 1e3
        res["ttft_ms"][str(n)] = float(np.median(ttfts))
        res["ttft_samples_ms"][str(n)] = [round(t, 3) for t in ttfts]
        res["tpot_ms_by_prompt"][str(n)] = float(np.median(tpots))
        res["floor_ms_by_prompt"][str(n)] = floor
        print(f"infc prompt {n}: TTFT {np.median(ttfts):.2f} ms, TPOT {np.median(tpots):.3f} ms, floor {floor:.3f} ms")
    first = str(prompts[0])
    res["tpot_ms"] = res["tpot_ms_by_prompt"][first]
    res["floor_ms"] = res["floor_ms_by_prompt"][first]
    res["floor_ratio"] = res["floor_ms"] / res["tpot_ms"]
    return _with_active_floor(r0.plan, res, out_len)


def _with_active_floor(plan: dict, res: dict, out_len: int) -> dict:
    """res plus the floor of the bytes a batch-1 step reads (bench/active_floor.py: one embedding
    row of an untied table, k of E experts), where the plan is the one that was timed; the stored
    bytes' floor stays beside it (an untied or MoE model's would overstate what it reaches)."""
    from .active_floor import floor
    try:
        return floor(plan, res, out_len)
    except ValueError as e:           # a rank's shard, or a plan bench/active_floor.py cannot read
        return dict(res, active_floor_error=str(e))


# TTFT is the median of TTFT_REPS prefills of fresh random prompts (the TPOT_REPS timed decodes
# start from the first of them), after one untimed prefill: with 3 samples, two slow prefills
# (a 32-token prefill takes ~5 ms; the cause of the slow ones was not found) moved the median to
# 7-33 ms in some H100 runs (2026-11-28).
TPOT_REPS = 3
TTFT_REPS = 11


def _time_prompt(r, n, out_len, rng, overlap, greedy, clock=time.perf_counter):
    """(TTFT samples, TPOT samples) in ms for n-token prompts on runner r: one untimed prefill,
    then TTFT_REPS timed prefills, the first TPOT_REPS of them followed by out_len timed decode
    steps (overlapped as the engine runs them when `overlap`)."""
    from infc.runtime.engine.step import Chunk, build_step
    ttfts, tpots = [], []
    for rep in range(-1, TTFT_REPS):
        free = list(range(r.num_pages))
        pages = {0: [free.pop() for _ in range(-(-(n + out_len) // r.page_size))]}
        prompt = [int(t) for t in rng.integers(0, r.vocab_size, n)]

        def step(tokens, start):
            return build_step([Chunk(0, tokens, start)], pages.__getitem__, r.page_size)
        # greedy on the GPU (the serving path): one token id comes back per step
        t0 = clock()
        tok = r.execute(step(prompt, 0), greedy)[0].token
        if rep < 0:
            continue
        ttfts.append((clock() - t0) * 1e3)
        if rep >= TPOT_REPS:
            continue
        t0 = clock()
        if overlap:
            # step i + 1 is issued before step i's token is read; its token is fed on the device
            last = r.launch(step([tok], n), greedy)
            for i in range(1, out_len):
                nxt = r.launch(step([0], n + i), greedy, feed=[(0, 0)])
                tok = r.collect(last)[0].token
                last = nxt
            tok = r.collect(last)[0].token
        else:
            for i in range(out_len):
                tok = r.execute(step([tok], n + i), greedy)[0].token
        tpots.append((clock() - t0) * 1e3 / out_len)
    return ttfts, tpots


def _hf_model(model_dir, load_format="auto"):
    """The HF model both peers run (bf16 on the GPU)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    if load_format == "dummy":     # no checkpoint: HF's own random init, made on the GPU (the
        with torch.device("cuda"):  # timing of a forward pass does not depend on the values)
            return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir),
                                                    dtype=torch.bfloat16).eval()
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()


def _hf(m, prompts, out_len, seed=0):
    import torch
    # HF's fastest path: a static cache, which makes generate() torch.compile the decode step
    # itself (with CUDA graphs); compile time is excluded by the warm-up runs below.
    m.generation_config.cache_implementation = "static"
    rng = np.random.default_rng(seed)
    out = {"hf_ttft_ms": {}, "hf_tpot_ms_by_prompt": {}}
    for n in prompts:
        ids = torch.from_numpy(rng.integers(0, m.config.vocab_size, (1, n))).cuda()
        kw = dict(do_sample=False, pad_token_id=0)
        for _ in range(2):                                # compile + warm up, excluded
            m.generate(ids, max_new_tokens=out_len, min_new_tokens=out_len, **kw)
        def timed(k):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            m.generate(ids, max_new_tokens=k, min_new_tokens=k, **kw)
            torch.cuda.synchronize()
            return (time.perf_counter() - t0) * 1e3
        t1 = float(np.median([timed(1) for _ in range(3)]))
        tn = float(np.median([timed(out_len) for _ in range(3)]))
        out["hf_ttft_ms"][str(n)] = t1
        out["hf_tpot_ms_by_prompt"][str(n)] = (tn - t1) / (out_len - 1)
        print(f"hf prompt {n}: TTFT {t1:.2f} ms, TPOT {(tn - t1) / (out_len - 1):.3f} ms")
    out["hf_tpot_ms"] = out["hf_tpot_ms_by_prompt"][str(prompts[0])]
    return out


PEERS = (("infc", ""), ("HF static + compile", "hf_"), ("torch.compile loop", "torch_compile_"))


def table(res: dict) -> list[str]:
    """The latency table: per prompt length, infc and each peer that ran, TPOT and TTFT with the
    floor over the TPOT (the share of the floor it reaches)."""
    lines = ["| prompt | engine | TPOT ms | floor ms | of the floor | TTFT ms |", "| --- | --- | --- | --- | --- | --- |"]
    floors = res.get("active_floor_ms_by_prompt") or res["floor_ms_by_prompt"]     # bytes read a step
    for n, floor in floors.items():
        for name, pre in PEERS:
            tpot = res.get(f"{pre}tpot_ms_by_prompt", {}).get(n)
            if tpot is None:
                continue
            ttft = res.get(f"{pre}ttft_ms", {}).get(n)
            lines.append(f"| {n} | {name} | {tpot:.3f} | {floor:.3f} | {100 * floor / tpot:.0f} % | "
                         f"{'' if ttft is None else f'{ttft:.2f}'} |")
    for pre, what in (("hf_", "HF"), ("torch_compile_", "torch.compile loop")):
        if res.get(f"{pre}error"):
            lines.append(f"{what}: no row ({res[pre + 'error']})")
    return lines


def plot(res: dict, path: Path):
    from .common import figure, finish
    ks = list(res["tpot_ms_by_prompt"])
    x = np.arange(len(ks))
    fig, ax = figure()
    bars = [("floor (bytes / copy BW)", res["floor_ms_by_prompt"])]
    bars += [(name, res[f"{pre}tpot_ms_by_prompt"]) for name, pre in PEERS if f"{pre}tpot_ms_by_prompt" in res]
    w = 0.8 / len(bars)
    for i, (name, by) in enumerate(bars):
        ax.bar(x + (i - (len(bars) - 1) / 2) * w, [by.get(k, 0) for k in ks], w, label=name)
    ax.set_xticks(x, [f"prompt {k}" for k in ks])
    ax.set_ylabel("ms per output token (batch 1)")
    ax.legend()
    finish(fig, ax, path, f"{res['model']} on {res['gpu']}", res)


def _error(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e)[:300]}"


def _peers(res, model_path, prompts, out_len, load_format, torch_compile=True):
    """Both peers on one HF model; a peer that fails records why (`hf_error`,
    `torch_compile_error`) rather than losing the run's other numbers."""
    try:
        m = _hf_model(model_path, load_format)
    except Exception as e:  # noqa: BLE001: no model, no peer: say why in the result
        res["hf_error"] = _error(e)
        if torch_compile:
            res["torch_compile_error"] = res["hf_error"]
        print("HF model failed:", res["hf_error"])
        return
    timings = [("hf_", "HF baseline", lambda: _hf(m, prompts, out_len))]
    if torch_compile:
        from .torch_peer import time_peer
        timings.append(("torch_compile_", "torch.compile loop", lambda: time_peer(m, prompts, out_len)))
    for pre, what, run in timings:
        try:
            res.update(run())
        except Exception as e:  # noqa: BLE001: a peer's failure is its row's note
            res[f"{pre}error"] = _error(e)
            print(f"{what} failed:", res[f"{pre}error"])


def main(argv=None):
    ap = argparse.ArgumentParser(prog="infc bench latency")
    ap.add_argument("--artifact", required=True)
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--prompts", default="32,1024,8192")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--no-hf", action="store_true", help="no PyTorch peers (neither HF nor the torch.compile loop)")
    ap.add_argument("--no-torch-compile", action="store_true", help="no torch.compile decode loop (HF still runs)")
    ap.add_argument("--out")
    from infc.server.args import add_load_format_arg, add_parallel_args
    add_load_format_arg(ap)
    add_parallel_args(ap)
    a = ap.parse_args(argv)
    from infc.compiler.parallel import settings
    from .common import save
    par = settings(a.tensor_parallel_size, a.enable_expert_parallel, data_parallel_size=a.data_parallel_size)
    if par and par.get("dp"):
        ap.error("--data-parallel-size: batch-1 latency runs one sequence on one rank; time "
                 "data-parallel ranks with `infc bench throughput`")
    prompts = [int(p) for p in a.prompts.split(",")]
    # infc's numbers are saved first: they survive an HF failure
    res, path = _infc(a.artifact, a.model_path, prompts, a.output_len, load_format=a.load_format,
                      par=par, out=a.out)
    if not a.no_hf:
        _peers(res, a.model_path, prompts, a.output_len, a.load_format, not a.no_torch_compile)
        path = save("latency", res, a.out)
    print("\n".join(table(res)))
    plot(res, path.with_suffix(".png"))
    print(f"wrote {path}")
    return res


if __name__ == "__main__":
    main()
