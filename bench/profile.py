"""`infc bench profile`: where the time of one step goes (issue 10: "find the time first").

On the GPU, with the CUDA runner and its own bound programs, each of these steps is warmed up and
repeated (median of --reps):

    prefill_32      a 32-token prompt, one sequence (phase prefill): the TTFT of a short prompt
                    (steps of at most plan["short_tokens"] tokens run, and report, the program
                    "short": compiler/contract/program.py program_name)
    decode_b1       one decode token at batch 1 after it, eager (the bound decode program)
    decode_b1_graph the same step replayed from the CUDA Graph of bucket 1 (what serving runs)
    verify_b1       with --verify-drafts k (k > 0): one sequence's k + 1 rows at positions 32 ..
                    32 + k, eager: a speculative verify step at batch 1 (issue 43; the "verify"
                    program on a build with one), beside decode_b1's one row
    prefill_1024    a 1024-token prompt (the cold side of the prefix hit below)
    prefix_hit      a second sequence sharing the first 64 pages (1024 tokens) of that prompt,
                    with 16 new tokens (phase mixed: start > 0, more than one token)
    mixed_256       255 sequences decoding one token each at 1024 tokens of context, plus one
                    256-token prefill chunk (phase mixed, T = 511, B = 256)
    decode_wide     the same 255 decodes alone (phase decode, T = B = 255): a saturated
                    server's decode step
    decode_wide_mixed  the 255 decodes and a 2-token chunk (phase mixed, T = 257): the same
                    work through the prefill/mixed kernels (MoE: the grouped GEMMs), to compare

Per step, two passes:
  plain         host perf_counter around the step (build_step + the runner's padded metadata,
                upload, launches, sync) = wall; a CUDA event pair around upload + launches = gpu;
                host = wall - gpu. Also: meta (host numpy), issue (until the last launch call
                returns), sample (the GPU argmax after the step, its own wall time).
  instrumented  an event pair around every launch (the runner's `_launch_all` hook): per-launch
                GPU time, grouped by (layer-kind launch index, op, template) and summed over
                layers. Events cost host time per launch, so this pass's own GPU total is
                reported beside the plain one; the kernel sum is the sum of per-launch medians,
                and gaps = plain gpu - kernel sum is GPU time spent waiting on the host.
The floor of a launch is the bytes it must read (its weights in full, gathers excepted; for
attention, the step's context tokens of KV in its layer) over the copy bandwidth measured in the
same run. The KV of the 255 decoding sequences is the cache's zeros, not a prefill: no kernel's
time depends on the values (a dense model; MoE routing would).

Output: bench/results/profile-<model>-<gpu>.json (or --out) and the same tables as markdown
(.md beside it), printed: one summary table, then per step its top launches by time.
"""
import argparse
import time
from pathlib import Path

import numpy as np

from infc.compiler.contract import caches
from infc.compiler.contract.program import bodies, is_repeat, program_name
from infc.compiler.contract.schema import nbytes


GATHERS = ("embedding",)              # ops that read a few rows of their weight, not all of it
# MoE expert launches read only the chosen experts' weights: at most min(E, T * k) of the E
# stacked experts (exact at batch 1: k of them); the floor counts that fraction
EXPERTS = {"moe_gate_up": 1, "moe_down": 2}   # op -> index of its ids [T, k] input


# -- pure: launch sites, grouping, tables (tests/test_profile.py runs these on fake timings) ----
def launch_sites(plan: dict, phase: str) -> list[dict]:
    """One dict per launch of the phase, in execution order (the order of the runner's bound
    program, `runtime.program.unrolled`): its group key (layer kind and index in the kind's body,
    or "top" and the position in the program), op, template, kernel id, layer and the bytes its
    floor counts."""
    decl = caches.of_plan(plan)
    sites = []

    def site(launch, kind, index, layer):
        kid = launch["kernel_id"]
        weights = [n for n in launch["inputs"] if n in plan["weights"]]
        wbytes = 0
        if launch["op"] not in GATHERS:
            for n in weights:
                w = plan["weights"][n]
                wbytes += nbytes(w["dtype"], w["shape"])       # quantized codes as stored
        kv = 0
        if launch["op"].startswith("attention") and layer is not None:
            kv = sum(caches.unit_elems(c) * caches.DTYPE_BYTES[c["dtype"]] for c in decl.values()
                     if c["kind"] == "paged" and layer in c["layers"])
        experts = None
        if launch["op"] in EXPERTS and weights:
            ids = plan["buffers"][launch["inputs"][EXPERTS[launch["op"]]]]
            experts = (int(plan["weights"][weights[0]]["shape"][0]), int(ids["shape"][1]))
        return {"key": f"{kind}.{index}", "kind": kind, "index": index, "op": launch["op"],
                "template": plan["kernels"][kid]["template"], "kernel_id": kid, "layer": layer,
                "weights": weights, "weight_bytes": wbytes, "kv_token_bytes": kv, "experts": experts}

    for pos, entry in enumerate(plan["programs"][phase]):
        if not is_repeat(entry):
            sites.append(site(entry, "top", pos, None))
            continue
        kinds = bodies(entry)
        for layer, kind in enumerate(entry["schedule"]):
            for j, launch in enumerate(kinds[kind]):
                sites.append(site(launch, kind, j, layer))
    return sites


def group_launches(sites: list[dict], samples: list[list], context_tokens: int = 0,
                   bandwidth: float | None = None, tokens: int | None = None) -> list[dict]:
    """samples[rep][i]: launch i's GPU time in ms in that repetition (None: not launched, e.g. a
    zero grid). Per launch the median over reps, then summed per group key: one row per group, in
    program order, with runs (launches per step), us (per step), us_per_run and the floor."""
    groups: dict[str, dict] = {}
    for i, s in enumerate(sites):
        times = [rep[i] for rep in samples if rep[i] is not None]
        if not times:
            continue
        g = groups.get(s["key"])
        if g is None:
            g = groups[s["key"]] = {k: s[k] for k in ("key", "kind", "index", "op", "template", "kernel_id",
                                                     "weights")}
            g.update(runs=0, us=0.0, bytes=0)
        g["runs"] += 1
        g["us"] += float(np.median(times)) * 1e3
        wbytes = s["weight_bytes"]
        if s.get("experts") and tokens is not None:        # the chosen experts' share (EXPERTS)
            e, k = s["experts"]
            wbytes = wbytes * min(e, tokens * k) // e
        g["bytes"] += wbytes + s["kv_token_bytes"] * context_tokens
    rows = list(groups.values())
    total = sum(g["us"] for g in rows)
    for g in rows:
        g["us_per_run"] = g["us"] / g["runs"]
        g["share"] = g["us"] / total if total else 0.0
        g["floor_us"] = g["bytes"] / bandwidth * 1e6 if bandwidth else None
    return rows


def summarize(name: str, what: str, phase: str, mode: str, T: int, B: int, plain: dict,
              instrumented: dict | None, groups: list[dict] | None, launches_from: str | None = None) -> dict:
    """One step's record from its passes (plain/instrumented: lists of per-rep values by field)."""
    med = {k: float(np.median(v)) for k, v in plain.items() if v}
    step = {"name": name, "what": what, "phase": phase, "mode": mode, "T": T, "B": B,
            "reps": len(plain["wall"]), "wall_ms": med["wall"], "gpu_ms": med["gpu"],
            "host_ms": med["wall"] - med["gpu"], "meta_ms": med.get("meta"), "issue_ms": med.get("issue"),
            "sync_ms": med.get("sync"), "sample_ms": med.get("sample")}
    if instrumented is not None:
        step["instrumented_wall_ms"] = float(np.median(instrumented["wall"]))
        step["instrumented_gpu_ms"] = float(np.median(instrumented["gpu"]))
    if groups is not None:
        ksum = sum(g["us"] for g in groups) / 1e3
        for g in groups:
            g["share_of_gpu"] = g["us"] / 1e3 / med["gpu"] if med["gpu"] else 0.0
        floors = [g["floor_us"] for g in groups]
        step.update(kernel_sum_ms=ksum, gaps_ms=med["gpu"] - ksum, launches_per_step=sum(g["runs"] for g in groups),
                    floor_ms=sum(floors) / 1e3 if all(f is not None for f in floors) else None,
                    launches=groups)
    if launches_from:
        step["launches_from"] = launches_from
    return step


def _f(x, fmt="{:.2f}"):
    return "-" if x is None else fmt.format(x)


def summary_table(steps: list[dict]) -> str:
    lines = ["| step | phase | T | B | wall ms | GPU ms | host ms | kernels ms | gaps ms | instr. GPU ms "
             "| launches | issue µs/launch | floor ms | sample ms |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for s in steps:
        n = s.get("launches_per_step")
        per = s["issue_ms"] * 1e3 / n if n and s.get("issue_ms") is not None else None
        lines.append(f"| {s['name']} | {s['phase']}{' (graph)' if s['mode'] == 'graph' else ''} | {s['T']} | {s['B']} "
                     f"| {_f(s['wall_ms'])} | {_f(s['gpu_ms'])} | {_f(s['host_ms'])} | {_f(s.get('kernel_sum_ms'))} "
                     f"| {_f(s.get('gaps_ms'))} | {_f(s.get('instrumented_gpu_ms'))} | {_f(n, '{}')} "
                     f"| {_f(per, '{:.1f}')} | {_f(s.get('floor_ms'), '{:.3f}')} | {_f(s.get('sample_ms'), '{:.3f}')} |")
    return "\n".join(lines)


def step_table(step: dict, top: int = 12) -> str:
    """The step's top launch groups by GPU time, then the rest in one row and the total."""
    head = (f"### {step['name']}: {step['what']}\n\n"
            f"phase {step['phase']}, T={step['T']}, B={step['B']}, {step['mode']}, median of {step['reps']}: "
            f"wall {step['wall_ms']:.3f} ms = GPU {step['gpu_ms']:.3f} + host {step['host_ms']:.3f}")
    if "launches" not in step:
        src = step.get("launches_from")
        return head + (f"; per-launch times: see {src} (a graph replay has no per-launch events)" if src else "")
    head += (f"; kernels {step['kernel_sum_ms']:.3f} ms over {step['launches_per_step']} launches, "
             f"GPU gaps {step['gaps_ms']:.3f} ms; instrumented GPU {step['instrumented_gpu_ms']:.3f} ms")
    lines = [head, "", "| # | launch | op | template | weights | runs | µs/step | µs/run | share of kernels "
             "| share of GPU | floor µs |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    rows = sorted(step["launches"], key=lambda g: -g["us"])
    if step.get("isolated"):
        in_step = {g["key"]: g["us_per_run"] for g in step["launches"]}
        iso = ["", "Issued again alone after the step, on its data (the first layer's launch):", "",
               "| launch | op | template | µs/run in the step | µs alone | µs back to back |",
               "| --- | --- | --- | --- | --- | --- |"]
        iso += [f"| {x['key']} | {x['op']} | {x['template']} | {_f(in_step.get(x['key']))} | "
                f"{x['alone_us']:.2f} | {x['back_to_back_us']:.2f} |" for x in step["isolated"]]
    else:
        iso = []
    for i, g in enumerate(rows[:top], 1):
        lines.append(f"| {i} | {g['key']} | {g['op']} | {g['template']} | {','.join(g['weights']) or '-'} | {g['runs']} "
                     f"| {g['us']:.1f} | {g['us_per_run']:.2f} | {100 * g['share']:.1f} % "
                     f"| {100 * g['share_of_gpu']:.1f} % | {_f(g['floor_us'], '{:.1f}')} |")
    rest = rows[top:]
    if rest:
        us = sum(g["us"] for g in rest)
        fl = [g["floor_us"] for g in rest]
        lines.append(f"| | rest ({len(rest)} groups) | | | | {sum(g['runs'] for g in rest)} | {us:.1f} | "
                     f"| {100 * sum(g['share'] for g in rest):.1f} % | {100 * sum(g['share_of_gpu'] for g in rest):.1f} % "
                     f"| {_f(sum(fl) if all(f is not None for f in fl) else None, '{:.1f}')} |")
    lines.append(f"| | all launches | | | | {step['launches_per_step']} | {1e3 * step['kernel_sum_ms']:.1f} | "
                 f"| 100.0 % | {100 * step['kernel_sum_ms'] / step['gpu_ms']:.1f} % "
                 f"| {_f(None if step['floor_ms'] is None else 1e3 * step['floor_ms'], '{:.1f}')} |")
    return "\n".join(lines + iso)


def report(res: dict, top: int = 12) -> str:
    bw = res.get("copy_GBps")
    out = [f"## {res['model']} on {res['gpu']} ({res['commit']}, {res['date']})", "",
           f"copy bandwidth {_f(bw, '{:.0f}')} GB/s, weights {res['weight_bytes'] / 1e9:.2f} GB; "
           "host = wall - GPU; gaps = GPU - sum of per-launch kernel times", "", summary_table(res["steps"])]
    for s in res["steps"]:
        out += ["", step_table(s, top)]
    return "\n".join(out) + "\n"


# -- on the GPU ------------------------------------------------------------------------------
class PageTable:
    """Pages per sequence from a free list (prefix sharing: start a sequence on another's pages)."""

    def __init__(self, num_pages: int, page_size: int):
        self.free, self.page_size, self.of = list(range(num_pages))[::-1], page_size, {}

    def ensure(self, seq: int, tokens: int, shared: list[int] | None = None) -> list[int]:
        pages = self.of.setdefault(seq, list(shared or []))
        while len(pages) * self.page_size < tokens:
            pages.append(self.free.pop())
        return pages


class Profiler:
    def __init__(self, runner, reps: int, warmup: int, bandwidth: float | None, isolate=(), loras: int = 0):
        """isolate: ops whose first launch of each group an eager step re-times alone (`_isolate`);
        loras: a LoRA plan's sequences take adapter slots 1..loras in turn (0: none, slot 0)."""
        from infc.runtime.engine.runner import RowSampling
        from infc.runtime.engine.sampling import SamplingParams
        self.r, self.reps, self.warmup, self.bw = runner, reps, warmup, bandwidth
        self.isolate = set(isolate or ())
        self.loras = loras
        self.e0, self.e1 = runner.ctx.event(), runner.ctx.event()
        self.pairs: list = []                  # event pairs, one per launch, reused
        self.greedy = RowSampling(SamplingParams(temperature=0.0), 0, 0)
        self.sites: dict[str, list] = {}       # phase -> launch_sites
        self.floor_of: dict[str, float | None] = {}

    def _pairs(self, n: int) -> list:
        while len(self.pairs) < n:
            self.pairs.append((self.r.ctx.event(), self.r.ctx.event()))
        return self.pairs

    def _once(self, chunks, pages, mode: str, hook=None) -> dict:
        from infc.runtime.engine.step import build_step
        r = self.r
        t0 = time.perf_counter()
        meta = build_step(chunks, pages.of.__getitem__, r.page_size)
        if self.loras:
            meta.lora_slots = np.repeat([1 + c.seq_id % self.loras for c in chunks],
                                        [len(c.tokens) for c in chunks]).astype(np.int32)
        T, B = (1, 1) if mode == "graph" else (meta.T, meta.B)
        dims = {"T": T, "B": B}
        arrays = r._metadata(meta, T, B)
        t1 = time.perf_counter()
        self.e0.record()
        keep = r._upload(arrays, dims)
        if mode == "graph":
            r.graphs[T][0].launch()
        else:
            r._launch_all(r.program(program_name(r.plan, meta.phase, T)), dims, on_launch=hook)
        self.e1.record()
        t2 = time.perf_counter()
        r.ctx.sync()
        t3 = time.perf_counter()
        del keep
        out = {"wall": (t3 - t0) * 1e3, "gpu": self.e1.ms_since(self.e0), "meta": (t1 - t0) * 1e3,
               "issue": (t2 - t1) * 1e3, "sync": (t3 - t2) * 1e3, "meta_obj": meta}
        if hook is None and r.sampler is not None:
            t4 = time.perf_counter()
            r.sampler.sample(r.logits_device, [self.greedy] * meta.B)
            out["sample"] = (time.perf_counter() - t4) * 1e3
        return out

    def step(self, name: str, what: str, chunks: list, pages: PageTable, mode: str = "eager",
             launches_from: str | None = None) -> dict:
        r = self.r
        r.ctx.ensure_current()
        if mode == "graph" and (len(chunks) != 1 or 1 not in r.graphs):
            raise ValueError(f"{name}: a graph step here is one sequence on the bucket-1 graph")
        plain = {k: [] for k in ("wall", "gpu", "meta", "issue", "sync", "sample")}
        for i in range(self.warmup + self.reps):
            o = self._once(chunks, pages, mode)
            if i >= self.warmup:
                for k in plain:
                    if k in o:
                        plain[k].append(o[k])
        meta = o["meta_obj"]
        instrumented = groups = None
        if mode == "eager":
            phase = program_name(r.plan, meta.phase, meta.T)     # "short" for a short prefill/mixed
            if phase not in self.sites:
                self.sites[phase] = launch_sites(r.plan, phase)
            sites = self.sites[phase]
            n = len(r.program(phase))
            assert n == len(sites), (phase, n, len(sites))
            pairs = self._pairs(n)
            instrumented, samples = {"wall": [], "gpu": []}, []
            for i in range(self.warmup + self.reps):
                fired = []

                def hook(index, kernel, fire):
                    a, b = pairs[index]
                    a.record()
                    fire()
                    b.record()
                    fired.append(index)

                o = self._once(chunks, pages, mode, hook)
                if i < self.warmup:
                    continue
                times = [None] * n
                for j in fired:
                    times[j] = pairs[j][1].ms_since(pairs[j][0])
                samples.append(times)
                instrumented["wall"].append(o["wall"])
                instrumented["gpu"].append(o["gpu"])
            groups = group_launches(sites, samples, int(meta.context_lens.sum()), self.bw, tokens=meta.T)
        step = summarize(name, what, program_name(r.plan, meta.phase, meta.T), mode, meta.T, meta.B, plain, instrumented, groups, launches_from)
        if mode == "eager" and self.isolate:
            step["isolated"] = self._isolate(phase, {"T": meta.T, "B": meta.B}, sites)
        if launches_from:                          # a graph replay: the eager step's floor
            step["floor_ms"] = self.floor_of.get(launches_from)
        self.floor_of[name] = step.get("floor_ms")
        print(f"{name}: wall {step['wall_ms']:.3f} ms, GPU {step['gpu_ms']:.3f} ms, host {step['host_ms']:.3f} ms"
              + (f", kernels {step['kernel_sum_ms']:.3f} ms" if "kernel_sum_ms" in step else ""), flush=True)
        return step

    def _isolate(self, phase: str, dims: dict, sites: list) -> list[dict]:
        """Each launch group of an op in `isolate`, its first launch (the first layer's) issued
        again alone, right after the step, on the step's own buffers and metadata: `reps` times
        between an event pair each (alone_us, median) and `reps` times back to back between one
        pair (back_to_back_us, mean). Beside the in-step time (us_per_run) it tells a kernel slow
        on this step's data from one slowed by the launches around it. The launches re-run must be
        idempotent for their output (attention, GEMVs: they are; a residual add is not, which only
        changes the values the step already used)."""
        r = self.r
        out, seen = [], set()
        for index, entry in enumerate(r.program(phase)):
            site = sites[index]
            if entry[0] is None or site["op"] not in self.isolate or site["key"] in seen:
                continue
            seen.add(site["key"])

            def fire(one=(entry,)):                # the runner's own launch path, one launch
                r._launch_all(one, dims)
            for _ in range(self.warmup):
                fire()
            alone = []
            for _ in range(self.reps):
                self.e0.record()
                fire()
                self.e1.record()
                alone.append(self.e1.ms_since(self.e0))
            self.e0.record()
            for _ in range(self.reps):
                fire()
            self.e1.record()
            out.append({"key": site["key"], "op": site["op"], "template": site["template"],
                        "layer": site["layer"], "alone_us": float(np.median(alone)) * 1e3,
                        "back_to_back_us": self.e1.ms_since(self.e0) / self.reps * 1e3})
        return out


def put_random_adapters(runner, n: int, rng) -> dict:
    """Slots 1..n of a LoRA plan's tables hold random adapters of the build's max rank on every
    module it adapts (the kernels' cost does not depend on the values; slot 0 rows skip A)."""
    from infc.runtime.lora.adapter import Adapter, ModuleDelta
    from infc.runtime.lora.tables import module_map, write
    lora = runner.plan.get("lora")
    if lora is None:
        raise ValueError("--loras: the artifact was not built with --enable-lora")
    if not 1 <= n <= lora["max_loras"]:
        raise ValueError(f"--loras {n}: the build has {lora['max_loras']} adapter slots")
    R, put = lora["max_rank"], runner.lora_put()
    for slot in range(1, n + 1):
        a = Adapter(f"random-{slot}", "(random)")
        for m, (_, _, _, K, N) in module_map(runner.plan).items():
            a.modules[m] = ModuleDelta(rng.normal(0, 0.02, (R, K)).astype(np.float32),
                                       rng.normal(0, 0.02, (N, R)).astype(np.float32), 2.0)
        write(runner.plan, put, slot, a)
    return {"adapters": n, "rank": R, "modules": len(module_map(runner.plan))}


def pages_needed(page_size: int, short=32, prefix=1024, new=16, decodes=255, context=1024, chunk=256,
                 prompts=1, verify=0) -> int:
    """The short prompt (+1 decode token, or + k + 1 verify rows), the long prompt, the hit's own pages, the mixed step's
    decoders (context + 1 each) and its prefill chunk's prompts, and a margin."""
    need = lambda n: -(-n // page_size)  # noqa: E731
    return (need(short + 1 + verify) + need(prefix) + need(prefix + new) - prefix // page_size
            + decodes * need(context + 1) + prompts * need(-(-chunk // prompts)) + 16)


def run(artifact, model_dir, reps=20, warmup=3, short=32, prefix=1024, new=16, decodes=255,
        context=1024, chunk=256, steps=None, max_model_len=None, bandwidth=True, seed=0,
        load_format="auto", isolate=(), prompts=1, loras=0, verify=0) -> dict:
    from infc.runtime.cuda.artifact import load_plan
    from infc.runtime.cuda.runner import CudaRunner
    from infc.runtime.engine.step import Chunk
    from .common import copy_bandwidth, header
    page_size = load_plan(Path(artifact))["build"]["page_size"]
    if prefix % page_size:
        raise ValueError(f"--prefix-tokens {prefix} is not a whole number of {page_size}-token pages")
    if not 1 <= prompts <= chunk:
        raise ValueError(f"--mixed-prompts {prompts} must be between 1 and the chunk's {chunk} tokens")
    num_pages = pages_needed(page_size, short, prefix, new, decodes, context, chunk, prompts, verify)
    want = lambda name: steps is None or name in steps  # noqa: E731
    rng = np.random.default_rng(seed)
    r = CudaRunner(artifact, model_dir, max_num_batched_tokens=max(short, prefix, new, decodes + chunk),
                   max_num_seqs=max(decodes + prompts, verify + 1), max_model_len=max_model_len, buckets=[1], num_pages=num_pages,
                   load_format=load_format)
    try:
        res = header(r.ctx, r.plan["model"])
        bw = copy_bandwidth(r.ctx) if bandwidth else None
        res.update({"copy_GBps": bw / 1e9 if bw else None, "weight_bytes": r.weights.bytes,
                    "num_pages": num_pages, "page_size": page_size, "max_model_len": r.max_model_len,
                    "reps": reps, "warmup": warmup, "steps": []})
        print(f"{res['gpu']}, {res['commit']}: weights {r.weights.bytes / 1e9:.2f} GB, "
              f"copy {_f(res['copy_GBps'], '{:.0f}')} GB/s, {num_pages} pages of {page_size}", flush=True)
        if loras:
            res["lora_adapters"] = put_random_adapters(r, loras, rng)
            res["model"] += f"-lora{loras}"
        prof = Profiler(r, reps, warmup, bw, isolate, loras)
        pages = PageTable(r.num_pages, page_size)
        toks = lambda n: [int(t) for t in rng.integers(0, r.vocab_size, n)]  # noqa: E731
        out = res["steps"]

        # 1. a short prompt, then batch-1 decode after it (eager, and from the bucket-1 graph)
        pages.ensure(0, short + 1 + verify)
        if want("prefill_32"):
            out.append(prof.step("prefill_32", f"a {short}-token prompt, one sequence",
                                 [Chunk(0, toks(short), 0)], pages))
        dec = [Chunk(0, toks(1), short)]
        if want("decode_b1"):
            out.append(prof.step("decode_b1", f"batch-1 decode at {short + 1} tokens of context, eager",
                                 dec, pages))
        if want("decode_b1_graph"):
            out.append(prof.step("decode_b1_graph", f"batch-1 decode at {short + 1} tokens of context, "
                                 "CUDA Graph bucket 1", dec, pages, mode="graph",
                                 launches_from="decode_b1" if want("decode_b1") else None))
        if verify and want("verify_b1"):
            # the rows a verify step of k drafts writes: the sequence's next k + 1 positions
            out.append(prof.step("verify_b1", f"{verify} drafts verified at batch 1 ({verify + 1} rows at "
                                 f"{short + 1} tokens of context), eager",
                                 [Chunk(0, toks(1), short + j) for j in range(verify + 1)], pages))
        # 2. a long prompt, then a warm prefix hit on its first pages
        pages.ensure(1, prefix)
        if want("prefill_1024"):
            out.append(prof.step("prefill_1024", f"a {prefix}-token prompt, one sequence",
                                 [Chunk(1, toks(prefix), 0)], pages))
        shared = list(pages.of[1][: prefix // page_size])
        pages.ensure(2, prefix + new, shared=shared)
        if want("prefix_hit"):
            out.append(prof.step("prefix_hit", f"{new} new tokens after {prefix} cached ({len(shared)} shared "
                                 "pages)", [Chunk(2, toks(new), prefix)], pages))
        # 3. a mixed step: one-token decodes at `context` tokens each, then one prefill chunk
        decoding = []
        for s in range(10, 10 + decodes):
            pages.ensure(s, context + 1)
            decoding.append(Chunk(s, toks(1), context))
        if want("mixed_256"):
            # the chunk as `prompts` whole prompts (the last takes the remainder), as a saturated
            # server's step holds several new requests' prompts; their ids follow the decoders'
            sizes = [chunk // prompts] * prompts
            sizes[-1] += chunk - sum(sizes)
            fresh = []
            for i, n in enumerate(sizes):
                sid = 9 if i == 0 else 10 + decodes + i
                pages.ensure(sid, n)
                fresh.append(Chunk(sid, toks(n), 0))
            # decodes first, as the scheduler orders them
            what = f"one {chunk}-token prefill chunk" if prompts == 1 else \
                f"{prompts} prompts of {sizes[0]} tokens ({chunk} in all)"
            out.append(prof.step("mixed_256", f"{decodes} decodes at {context} tokens of context + {what}",
                                 decoding + fresh, pages))
        # 4. the same decodes alone: a saturated server's decode step (the decode program), and
        # with a 2-token chunk beside them, which makes it a mixed step of nearly the same T: the
        # prefill/mixed kernels (grouped MoE GEMMs) on a decode-sized batch, to compare
        if want("decode_wide"):
            out.append(prof.step("decode_wide", f"{decodes} decodes at {context} tokens of context "
                                 "(phase decode), eager", decoding, pages))
        if want("decode_wide_mixed"):
            pages.ensure(8, 2)
            out.append(prof.step("decode_wide_mixed", f"{decodes} decodes at {context} tokens of context "
                                 "+ a 2-token chunk (phase mixed), eager", decoding + [Chunk(8, toks(2), 0)],
                                 pages))
        return res
    finally:
        r.close()


def main(argv=None):
    ap = argparse.ArgumentParser(prog="infc bench profile")
    ap.add_argument("--artifact", required=True)
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--out", help="results folder (default bench/results)")
    ap.add_argument("--reps", type=int, default=20, help="timed repetitions per step and pass (median)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--top", type=int, default=12, help="launch groups shown per step")
    ap.add_argument("--steps", help="comma list of step names (default: all)")
    ap.add_argument("--short-prompt", type=int, default=32)
    ap.add_argument("--prefix-tokens", type=int, default=1024)
    ap.add_argument("--prefix-new", type=int, default=16)
    ap.add_argument("--mixed-decodes", type=int, default=255)
    ap.add_argument("--mixed-context", type=int, default=1024)
    ap.add_argument("--mixed-chunk", type=int, default=256)
    ap.add_argument("--mixed-prompts", type=int, default=1,
                    help="the mixed step's chunk as this many whole prompts (a saturated server's step)")
    ap.add_argument("--max-model-len", type=int, help="default: the plan's (block tables are this wide)")
    ap.add_argument("--no-bandwidth", action="store_true", help="skip the copy-bandwidth run (no floors)")
    ap.add_argument("--isolate", help="comma list of ops (e.g. attention_cached,linear): each eager step "
                    "re-times its first launch of each of their groups alone, after the step, on its data")
    ap.add_argument("--verify-drafts", type=int, default=0,
                    help="add verify_b1: a verify step of this many drafts at batch 1 (issue 43)")
    ap.add_argument("--loras", type=int, default=0,
                    help="a LoRA artifact: random adapters in slots 1..N, sequences take them in turn")
    from infc.server.args import add_load_format_arg
    add_load_format_arg(ap)
    a = ap.parse_args(argv)
    if a.reps < 1:
        ap.error("--reps must be at least 1")
    if a.verify_drafts < 0:
        ap.error("--verify-drafts must be 0 or more")
    from .common import save
    steps = set(a.steps.split(",")) if a.steps else None
    res = run(a.artifact, a.model_path, reps=a.reps, warmup=a.warmup, short=a.short_prompt, prefix=a.prefix_tokens,
              new=a.prefix_new, decodes=a.mixed_decodes, context=a.mixed_context, chunk=a.mixed_chunk, prompts=a.mixed_prompts,
              steps=steps, max_model_len=a.max_model_len, bandwidth=not a.no_bandwidth,
              load_format=a.load_format, isolate=a.isolate.split(",") if a.isolate else (), loras=a.loras,
              verify=a.verify_drafts)
    path = save("profile", res, a.out)
    text = report(res, a.top)
    path.with_suffix(".md").write_text(text)
    print()
    print(text)
    print(f"wrote {path} and {path.with_suffix('.md').name}")
    return res


if __name__ == "__main__":
    main()
