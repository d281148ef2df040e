"""`infc bench throughput`: offline throughput, 1024 tokens in / 128 out, at several concurrencies.

One engine (the one `LLM` and `infc serve` build) serves every point; a point keeps exactly
`concurrency` requests in flight (a finished one is replaced at once) until 2 x concurrency (at
least 4) requests have finished. Per point: output tokens per second over the wall time of the
point, mean TPOT per request ((finish - first token) / (tokens - 1)), TTFT, and the decode floor
at that batch: (weight bytes + KV bytes read by one step) / copy bandwidth measured in this run.

--tensor-parallel-size N [--enable-expert-parallel]: the engine over N rank processes, one GPU each
(NCCL), as `infc serve` runs them; the floor is rank 0's (its weight shard and its share of the KV).
"""
import argparse
import time
from pathlib import Path

import numpy as np

from .common import TimedCalls


class StepClock:
    """Times every engine step while it is installed, by phase: where a point's wall time goes,
    besides the host's work that the GPU waits for (wall - execute).

    Synchronous steps (runner.execute): a step's execute is its wall time in execute (upload,
    launches, sync, sampling). Overlapped steps (runner.launch / collect, engine.Engine): the
    engine prepares the next step while the GPU runs this one, so a step's execute is its time on
    the stream, read from the events around it when it is collected. Over ranks, rank 0's
    execute includes waiting for the other ranks at each collective. Data-parallel ranks run
    every rank's step in one execute_ranks / launch_ranks + collect_ranks: rank 0's is timed
    (the ranks' T and phase are the same)."""

    def __init__(self, engine, marks: bool = False):
        """marks: a CUDA runner records events inside each step, and the series carries the
        step's parts (runtime/cuda/runner.py InFlight.parts_ms)."""
        self.runner = engine.runner
        ranks = "_ranks" if engine.dp > 1 else ""
        self.name = ("collect" if engine.overlap else "execute") + ranks
        self.inner = getattr(self.runner, self.name)
        self.own = self.name in vars(self.runner)   # an instance attribute to put back
        self.steps: dict[str, list] = {}        # phase -> [(T, B, seconds)]
        # every step in order: (phase, T, ms, the host tier's bytes saved and steps made to wait
        # so far, the engine thread's ms in the tier's flushes so far, ms since the clock started
        # when the step was read back, with marks the step's parts in ms or None), the per-step
        # view of a tier's cost (`--step-series`)
        self.series: list[tuple] = []
        self.marks = marks and hasattr(self.runner, "step_marks")
        self.tiers = getattr(engine, "tiers", None)
        self.flushes = None                     # the engine thread's time in the tier's flushes
        # INFC_COLLECTIVE_CLOCK=1 on ranks: rank 0's time in its collectives (eager steps)
        self.collectives = getattr(getattr(self.runner, "runner", self.runner), "collective_clock", None)

    def _add(self, meta, seconds, parts=None):
        self.steps.setdefault(meta.phase, []).append((meta.T, meta.B, seconds))
        st = self.tiers.stats if self.tiers is not None else None
        self.series.append((meta.phase, meta.T, round(seconds * 1e3, 3),
                            st.bytes_to_host if st else 0, st.step_waits if st else 0,
                            round(self.flushes.seconds * 1e3 if self.flushes else 0.0, 3),
                            round((time.perf_counter() - self.t0) * 1e3, 3),
                            {k: round(v, 3) for k, v in parts.items()} if parts else None))

    def __enter__(self):
        def executed(meta, rows):
            t0 = time.perf_counter()
            out = self.inner(meta, rows)
            self._add(meta[0] if isinstance(meta, list) else meta, time.perf_counter() - t0)
            return out

        def collected(step):
            out = self.inner(step)
            mine = getattr(step, "mine", step)       # data-parallel: rank 0's launched step
            parts = mine.parts_ms() if self.marks and getattr(mine, "marks", None) else None
            self._add(mine.meta, mine.gpu_ms() / 1e3, parts)
            return out
        setattr(self.runner, self.name, collected if self.name.startswith("collect") else executed)
        if self.marks:
            self.runner.step_marks = True
        if self.tiers is not None:                # the engine thread's time issuing the tier's copies
            self.flushes = TimedCalls(self.tiers, ("flush",))
        self.t0 = time.perf_counter()
        self.waits0 = self.tiers.stats.step_waits if self.tiers is not None else 0
        if self.collectives is not None:
            self.collectives.report()            # from this point's first step on
        return self

    def __exit__(self, *exc):
        if self.marks:
            self.runner.step_marks = False
        if self.flushes is not None:
            self.flushes.restore()
        if self.own:
            setattr(self.runner, self.name, self.inner)
        else:
            delattr(self.runner, self.name)          # the class's method again

    def summary(self, wall: float) -> dict:
        phases = {ph: {"steps": len(v), "tokens": sum(t for t, _, _ in v),
                       "mean_seqs": float(np.mean([b for _, b, _ in v])),
                       "execute_s": sum(s for _, _, s in v),
                       "us_per_token": 1e6 * sum(s for _, _, s in v) / max(1, sum(t for t, _, _ in v))}
                  for ph, v in sorted(self.steps.items())}
        execute = sum(p["execute_s"] for p in phases.values())
        out = {"execute_s": execute, "host_s": wall - execute, "phases": phases}
        if self.tiers is not None:                # this point's: the count since __enter__
            out["tier_step_waits"] = self.tiers.stats.step_waits - self.waits0
        if self.collectives is not None:
            out["collectives"] = self.collectives.report()
        return out


def run_point(engine, vocab: int, concurrency: int, in_len: int, out_len: int, rng, total: int | None = None,
              params=None, loras: tuple = (), series: bool = False):
    """params: every request's SamplingParams (default: greedy, out_len tokens, EOS ignored).
    loras: adapter names the requests take in turn (request i the (i mod n)-th; none: the base).
    series: the point keeps every step's (phase, T, ms, tier bytes saved, tier waits, tier flush ms,
    ms since the point's steps began, its parts on a CUDA runner: upload / forward / host_wait /
    sample ms, else None) in order."""
    from infc.runtime.engine.sampling import SamplingParams
    params = params or SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True)
    total = total or max(4, 2 * concurrency)
    started, first, done, ntok = {}, {}, {}, {}
    next_id = 0

    def add():
        nonlocal next_id
        rid = f"t{concurrency}-{next_id}"
        lora = loras[next_id % len(loras)] if loras else None
        next_id += 1
        engine.add_request(rng.integers(0, vocab, in_len).tolist(), params, rid, lora=lora)
        started[rid] = time.perf_counter()

    t0 = time.perf_counter()
    for _ in range(min(concurrency, total)):
        add()
    with StepClock(engine, marks=series) as clock:
        while engine.has_unfinished():
            outs = engine.step()
            now = time.perf_counter()
            for o in outs:
                first.setdefault(o.request_id, now)
                ntok[o.request_id] = ntok.get(o.request_id, 0) + len(o.token_ids)
                if o.request_finished:
                    done[o.request_id] = now
                    if next_id < total:
                        add()
    wall = time.perf_counter() - t0
    tpot = [(done[r] - first[r]) / (ntok[r] - 1) * 1e3 for r in done if ntok[r] > 1]
    ttft = [(first[r] - started[r]) * 1e3 for r in done]
    return {"concurrency": concurrency, "requests": len(done), "wall_s": wall,
            "output_tok_s": sum(ntok.values()) / wall, "mean_tpot_ms": float(np.mean(tpot)),
            "median_ttft_ms": float(np.median(ttft)), "p99_ttft_ms": float(np.percentile(ttft, 99)),
            "steps": clock.summary(wall), **({"step_series": clock.series} if series else {})}


def plot(res: dict, path: Path):
    from .common import figure, finish
    pts = res["points"]
    c = [p["concurrency"] for p in pts]
    fig, ax = figure()
    ax.plot(c, [p["output_tok_s"] for p in pts], "o-", label="output tok/s")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency")
    ax.set_ylabel("output tokens / s")
    ax2 = ax.twinx()
    ax2.plot(c, [p["mean_tpot_ms"] for p in pts], "s--", color="C1", label="mean TPOT (ms)")
    ax2.plot(c, [p["floor_tpot_ms"] for p in pts], ":", color="C2", label="TPOT floor (ms)")
    ax2.set_ylabel("ms per output token")
    lines = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    ax.legend(lines, [h.get_label() for h in lines], loc="upper left")
    finish(fig, ax, path, f"{res['model']} {res['input_len']} in / {res['output_len']} out on {res['gpu']}", res)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="infc bench throughput")
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--model", help="variant name (default: detected from config.json)")
    ap.add_argument("--concurrency", default="1,8,32,64,128,256")
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int,
                    help="tokens per step (default: the offline engine's, infc.config.BATCHED_TOKENS)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--out")
    ap.add_argument("--artifact", help="a built artifact to run as it is (one GPU; default: build or "
                                       "reuse .cache/artifacts/<model dir name>): A/B runs of two commits' plans")
    ap.add_argument("--step-series", action="store_true",
                    help="keep every step's phase, tokens, time and the host KV tier's bytes saved and "
                         "waits so far in the result (where a tier's cost lands, step by step)")
    from infc.server.args import add_kv_offloading_args, add_load_format_arg, add_lora_serve_args, add_parallel_args
    add_load_format_arg(ap)
    add_parallel_args(ap)
    add_kv_offloading_args(ap)       # the KV tiers on: their copies must stay off the critical path
    add_lora_serve_args(ap)          # with --lora-modules the requests take the adapters in turn
    a = ap.parse_args(argv)
    from infc.backend import load_backend
    from infc.compiler.parallel import settings
    from .latency import parallel_tag
    conc = [int(c) for c in a.concurrency.split(",")]
    par = settings(a.tensor_parallel_size, a.enable_expert_parallel, data_parallel_size=a.data_parallel_size)
    b = load_backend(a.model_path, model=a.model, device="cuda", max_num_seqs=max(conc),
                     max_num_batched_tokens=a.max_num_batched_tokens,
                     max_model_len=a.input_len + a.output_len + 16,
                     gpu_memory_utilization=a.gpu_memory_utilization, asynchronous=False,
                     load_format=a.load_format, tensor_parallel_size=a.tensor_parallel_size,
                     enable_expert_parallel=a.enable_expert_parallel, data_parallel_size=a.data_parallel_size,
                     artifact=a.artifact, enable_lora=a.enable_lora, max_loras=a.max_loras,
                     max_lora_rank=a.max_lora_rank, lora_target_modules=a.lora_target_modules,
                     lora_modules=tuple(a.lora_modules or ()), max_cpu_loras=a.max_cpu_loras,
                     kv_offloading_size=a.kv_offloading_size, kv_offloading_disk=a.kv_offloading_disk,
                     kv_offloading_disk_size=a.kv_offloading_disk_size)
    from infc.runtime.engine.gc_freeze import freeze_startup
    frozen = freeze_startup()                       # as `infc serve` does once it is loaded
    try:
        return _sweep(a, b, conc, par, parallel_tag(par), frozen)
    finally:
        close = getattr(b.engine.runner, "close", None)
        if par is not None and close is not None:
            close()                                 # stop the rank processes


def _sweep(a, b, conc, par, tag, gc_frozen: bool = False):
    from infc.compiler.contract import caches
    from .common import copy_bandwidth, header, save
    from .latency import parallel_fields
    engine = b.engine
    runner = getattr(engine.runner, "runner", engine.runner)   # rank 0's CudaRunner under ranks
    loras = tuple(n for n, _ in a.lora_modules or ())
    tier = f"-offload{a.kv_offloading_size:g}g" if a.kv_offloading_size else ""
    res = header(runner.ctx, runner.plan["model"] + tag + (f"-lora{len(loras)}" if loras else "") + tier)
    bw = copy_bandwidth(runner.ctx)
    decl = caches.of_plan(runner.plan)
    kv_per_token, state_per_seq = caches.token_bytes(decl), caches.slot_bytes(decl)
    res.update(parallel_fields(par, runner))
    res.update({"input_len": a.input_len, "output_len": a.output_len, "copy_GBps": bw / 1e9,
                "load_format": a.load_format, "max_num_batched_tokens": engine.schedulers[0].max_num_batched_tokens,
                "weight_bytes": runner.weights.bytes, "kv_tokens": b.kv_tokens, "gc_frozen": gc_frozen,
                "overlap": engine.overlap, **({"artifact": str(a.artifact)} if a.artifact else {}),
                "kv_offloading_size_gib": a.kv_offloading_size or 0.0, "points": []})
    rng = np.random.default_rng(0)
    if loras:
        res["lora_adapters"] = list(loras)
    tiers = getattr(engine, "tiers", None)
    if tiers is not None:          # how the tier's copies ran (kv_copies.py: one kernel a batch, or 2D copies)
        res["kv_copies"] = getattr(tiers.copies, "mode", type(tiers.copies).__name__)
    run_point(engine, b.vocab_size, 2, 64, 8, rng, total=2, loras=loras)      # warm-up, not recorded
    for c in conc:
        p = run_point(engine, b.vocab_size, c, a.input_len, a.output_len, rng, loras=loras, series=a.step_series)
        ctx_avg = a.input_len + a.output_len / 2
        p["floor_tpot_ms"] = (runner.weights.bytes + c * (kv_per_token * ctx_avg + state_per_seq)) / bw * 1e3
        p["preemptions_total"] = engine.metrics.num_preemptions_total
        res["points"].append(p)
        print(f"concurrency {c:4d}: {p['output_tok_s']:9.1f} output tok/s, mean TPOT {p['mean_tpot_ms']:7.2f} ms "
              f"(floor {p['floor_tpot_ms']:.2f}), median TTFT {p['median_ttft_ms']:8.1f} ms, {p['wall_s']:.1f} s",
              flush=True)
        st = p["steps"]
        print(f"  execute {st['execute_s']:.2f} s, host {st['host_s']:.2f} s"
              f"{' (GPU idle; steps overlapped)' if engine.overlap else ''}; " + "; ".join(
            f"{ph}: {v['steps']} steps, {v['tokens']} tokens, {v['us_per_token']:.1f} us/token"
            for ph, v in st["phases"].items()), flush=True)
        if "tier_step_waits" in st:
            print(f"  host KV tier: {st['tier_step_waits']} steps waited on the device for its copies", flush=True)
        for program, ops in st.get("collectives", {}).items():
            print(f"  collectives in {program} steps (rank 0's stream): " + ", ".join(
                f"{op} {v['ms'] / 1e3:.2f} s over {v['launches']}" for op, v in ops.items()), flush=True)
        save("throughput", res, a.out)                    # every finished point survives a later failure
    path = save("throughput", res, a.out)
    plot(res, path.with_suffix(".png"))
    print(f"wrote {path}")
    return res


if __name__ == "__main__":
    main()
