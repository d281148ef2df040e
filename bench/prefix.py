"""`infc bench prefix`: time to first token with the prompt cold, and with its prefix cached.

    infc bench prefix --model-path DIR [--load-format dummy] [--path engine|serve|both|tokenizer]

For each input length L (default 1k, 4k, 16k, 32k; lengths that do not fit the model's context
are clipped to the longest whole-page length that does, with a note):
  cold  a fresh random prompt of L + --new-tokens tokens, never seen before (0 cached tokens);
  warm  one L-token random prefix is sent once (untimed, it fills the prefix cache with its full
        pages), then each repetition sends that prefix + --new-tokens fresh tokens: the engine
        finds L // page_size full pages cached and computes only the new tokens.
TTFT is the time to the first generated token (every request asks for exactly one, greedy).
Before the timed repetitions of each L, one cold and one warm request run untimed.

Two paths, each with its own p50 / p99 / mean / n per L and mode:
  engine  the engine `LLM` and `infc serve` build (infc.backend.load_backend), in this process:
          add_request, then step() until the request's token comes back;
  serve   `infc serve` spawned as users start it (or --base-url), streaming /v1/completions:
          from opening the connection to the first streamed choice, the tokenizer and HTTP
          included. The prompt goes as text when the directory has a tokenizer.json (words that
          are one token each, so the token count is exact and the prefix tokenizes the same
          alone and extended), else as token ids. With text, the server's tokenizer (the same
          class, timed in this process) per L, its share of the serve TTFTs:
            tokenize_ms        a warm request's prompt: its prefix was tokenized before (by the
                               request that filled the prefix cache), its new words are fresh, as
                               the server's Tokenizer sees it (fast_tokenize reuses the ids of
                               text it has seen, and encodes the rest split across threads);
            tokenize_cold_ms   a prompt never seen (a cold request): split across threads only;
            tokenize_plain_ms  the tokenizers library's one `encode` call for the same prompt
                               (what the server did before fast_tokenize);
            tokenize_{cold,plain}_cpu_ms  their CPU time, all threads: above the wall time
                               where the pieces were encoded in parallel.
  tokenizer  (--path tokenizer) only those three times per L, with no engine and no server:
          what the tokenizer costs on this host's CPU.
The prefix cache is checked, not assumed: per request the cached-token count (the engine's
StepOutput.num_cached_tokens; through the server, the change of /metrics'
vllm:prefix_cache_hits_total around the request) goes into the JSON, and a warm request that did
not find its whole prefix cached, or a cold one that found anything, stops the benchmark.

--tier host|disk (engine path): the warm hit comes from a KV tier (--kv-offloading-size, and for
disk a folder, a temporary one unless --kv-offloading-disk names one): before every request the
blocks cached in the device's pages are moved to the host pool (and from it to the disk), so a
warm request restores its whole prefix from that tier, which is checked per request (the tiers'
hit counters). Per L the warm requests' restore copies go into the JSON: restore_ms (the copy
alone: the copy stream's events on the GPU) and restore_GBps (the blocks' bytes over it), beside
the TTFTs they are part of. --tier hbm (the default) is the device's own prefix cache.

--alternate FLAG (engine path): an A/B of a flag the runtime reads at each step, inside one
process (the GPU host gives each process its own speed, NOTES): the timed requests alternate the
variable between 0 and 1, and each mode's statistics are also given per value (`by_variant`).

The serve path runs first: its server process owns the GPU until it exits, then the engine path
loads its own. On the GPU the engine path also measures the copy bandwidth, and records the floor
of a warm hit: (weight bytes + KV bytes of L + new tokens) / bandwidth.

Output: bench/results/prefix-<model>-<gpu>.json, saved after every length so a later failure
keeps what was measured, and a .png beside it where matplotlib is installed (TTFT p50 and p99
against L, log-log: cold and warm, engine and serve).
"""
import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import numpy as np

LENGTHS = "1024,4096,16384,32768"
LONG = 4096                     # above this, cold repetitions default to 3 (each is a long prefill)


# -- prompts ----------------------------------------------------------------------------------
class IdPrompts:
    """Random token ids above the low ids (where special tokens live), as bench/serve.py draws."""
    kind = "ids"

    def __init__(self, vocab: int, rng):
        self.lo, self.hi, self.rng = min(1000, vocab // 4), vocab, rng

    def make(self, n: int, start: bool = True) -> list[int]:
        return self.rng.integers(self.lo, self.hi, n).tolist()


class TextPrompts:
    """Random text whose tokenization is known: words that are one token each with their leading
    space (" river"), so n words are n tokens (+ the BOS the tokenizer adds at the start), and a
    prefix tokenizes the same alone and with more words after it (pre-tokenizers split at the
    space). Built from the tokenizer's own vocabulary and checked against it."""
    kind = "text"
    WORD = re.compile(r"^[a-z]{2,12}$")

    def __init__(self, tokenizer, rng, pool: int = 4096, scan: int = 40000):
        self.tok, self.rng = tokenizer, rng
        self.bos = 1 if (tokenizer.add_bos and tokenizer.bos_id is not None) else 0
        tk = tokenizer.tk
        n = tk.get_vocab_size(with_added_tokens=False)
        seen, pieces = set(), []
        for t in rng.permutation(n)[:scan].tolist():
            w = tk.decode([t]).strip()
            if self.WORD.match(w) and w not in seen:
                seen.add(w)
                pieces.append(" " + w)
        enc = tk.encode_batch(pieces, add_special_tokens=False) if pieces else []
        self.words = [p for p, e in zip(pieces, enc) if len(e.ids) == 1][:pool]
        if len(self.words) < 64:
            raise ValueError(f"the tokenizer has only {len(self.words)} one-token words")
        probe = self.make(512)                    # the property everything here relies on
        if len(tokenizer.encode(probe)) != 512:
            raise ValueError("random one-token words do not tokenize one token each")

    def make(self, n: int, start: bool = True) -> str:
        k = n - (self.bos if start else 0)
        return "".join(self.words[i] for i in self.rng.integers(0, len(self.words), k))

    def tokenize_times(self, prefix: str, new: int, reps: int = 5) -> dict:
        """Median ms of the server's tokenizer (the same class, here) on prefix + `new` fresh
        words: warm (the prefix was tokenized before, as the server did for the request that
        filled its prefix cache), cold (nothing seen before) and the library's plain call."""
        fast = getattr(self.tok, "fast", None)

        def timed(f, text, cpu=None):
            t0, c0 = time.perf_counter(), time.process_time()
            f(text)
            if cpu is not None:                 # all threads' CPU time: > wall when they ran in parallel
                cpu.append((time.process_time() - c0) * 1e3)
            return (time.perf_counter() - t0) * 1e3

        warm, cold, plain, cold_cpu, plain_cpu = [], [], [], [], []
        for _ in range(reps):
            if fast is not None:
                fast.clear_cache()
            cold.append(timed(self.tok.encode, prefix + self.make(new, start=False), cold_cpu))
            self.tok.encode(prefix)                                 # the request that filled the cache
            warm.append(timed(self.tok.encode, prefix + self.make(new, start=False)))
            plain.append(timed(lambda t: self.tok.tk.encode(t, add_special_tokens=False).ids,
                               prefix + self.make(new, start=False), plain_cpu))
        return {"tokenize_ms": float(np.median(warm)), "tokenize_cold_ms": float(np.median(cold)),
                "tokenize_plain_ms": float(np.median(plain)), "tokenize_cold_cpu_ms": float(np.median(cold_cpu)),
                "tokenize_plain_cpu_ms": float(np.median(plain_cpu)),
                "tokenize_fast_path": bool(fast is not None and fast.enabled)}

    def check_prefix(self, prefix: str, full: str, n_prefix: int, n_full: int):
        a, b = self.tok.encode(prefix), self.tok.encode(full)
        if len(a) != n_prefix or len(b) != n_full or b[:n_prefix] != a:
            raise RuntimeError(f"text prompts: the prefix tokenizes to {len(a)} tokens (want {n_prefix}), the "
                               f"prompt to {len(b)} (want {n_full}), prefix kept: {b[:n_prefix] == a}")


# -- the sweep, shared by both paths ----------------------------------------------------------
def clip_lengths(lengths: list[int], new: int, max_model_len: int, page_size: int) -> tuple[list[int], list[str]]:
    """Lengths L with L + new + 1 <= max_model_len (the prompt plus the one generated token);
    those that do not fit become the longest whole-page length that does, once."""
    top = (max_model_len - new - 1) // page_size * page_size
    keep, notes = [], []
    for L in lengths:
        if L < page_size:
            raise ValueError(f"input length {L} is shorter than one page ({page_size} tokens): nothing to cache")
        if L + new + 1 <= max_model_len:
            keep.append(L)
        else:
            notes.append(f"input length {L} + {new} new tokens does not fit max_model_len {max_model_len}: "
                         f"clipped to {top}")
            if top >= page_size:
                keep.append(top)
    return sorted(set(keep)), notes


def cold_reps_for(L: int, reps: int, cold_reps: int | None) -> int:
    return cold_reps if cold_reps is not None else (reps if L <= LONG else min(reps, 3))


def stats(ttfts: list[float]) -> dict:
    from .common import latency_stats
    return {"n": len(ttfts), **latency_stats(ttfts, (50, 90, 99))}


def sweep(submit, prompts, lengths, new, reps, cold_reps, page_size, label, on_length=None,
          settle_s: float = 0.0, alternate=None) -> dict:
    """submit(prompt, n_tokens) -> {"ttft": s, "cached": tokens}; returns per str(L) the cold and
    warm statistics, samples and cached-token counts. Raises on a warm miss or a cold hit.
    settle_s: a pause after the prefix is cached, before the warm requests (with a KV tier on,
    so that its saves of the requests before are done: the hits alone, not the hits beside them).
    alternate(v): set variant v (0 or 1) before a request: the timed requests take 0 and 1 in
    turn (the untimed warm-up hit takes 1, so what its first run sets up is not timed), and each
    mode's statistics are also given by variant (`by_variant`): an A/B inside one process."""
    out = {}

    def run(prompt, n, v=None):
        if alternate is None:
            return submit(prompt, n)
        alternate(v)
        return {**submit(prompt, n), "variant": v}

    for L in lengths:
        want = L // page_size * page_size
        n_cold = cold_reps_for(L, reps, cold_reps)
        run(prompts.make(L + new), L + new, 1)                          # untimed
        cold = [run(prompts.make(L + new), L + new, i % 2) for i in range(n_cold)]
        prefix = prompts.make(L)
        run(prefix, L, 0)                                               # fills the cache
        if settle_s:
            time.sleep(settle_s)
        tok_times = None
        if isinstance(prompts, TextPrompts):
            full = prefix + prompts.make(new, start=False)
            prompts.check_prefix(prefix, full, L, L + new)
            tok_times = prompts.tokenize_times(prefix, new)
        warm = [run(prefix + prompts.make(new, start=False), L + new, (i + 1) % 2) for i in range(reps + 1)][1:]
        for mode, rs, ok in (("cold", cold, lambda c: c == 0), ("warm", warm, lambda c: c == want)):
            bad = [r["cached"] for r in rs if not ok(r["cached"])]
            if bad:
                raise RuntimeError(f"{label}: {mode} requests at L={L} found {bad} cached tokens, expected "
                                   f"{0 if mode == 'cold' else want} ({len(bad)} of {len(rs)}): "
                                   f"{'the prefix cache was not hit' if mode == 'warm' else 'not cold'}")
        out[str(L)] = {"expected_cached_tokens": want, "prompt_tokens": L + new}
        if tok_times is not None:             # part of every serve TTFT with text prompts
            out[str(L)].update(tok_times)
        for mode, rs in (("cold", cold), ("warm", warm)):
            out[str(L)][mode] = {**stats([r["ttft"] for r in rs]),
                                 "samples_ms": [r["ttft"] * 1e3 for r in rs],
                                 "cached_tokens": [r["cached"] for r in rs]}
            if alternate is not None:
                out[str(L)][mode]["variants"] = [r["variant"] for r in rs]
                out[str(L)][mode]["by_variant"] = {str(v): stats([r["ttft"] for r in rs if r["variant"] == v])
                                                   for v in (0, 1) if any(r["variant"] == v for r in rs)}
        c, w = out[str(L)]["cold"], out[str(L)]["warm"]
        print(f"{label} L={L:6d}: cold p50 {c['p50_ms']:9.2f} p99 {c['p99_ms']:9.2f} ms (n={c['n']}), "
              f"warm +{new} p50 {w['p50_ms']:7.2f} p99 {w['p99_ms']:7.2f} ms (n={w['n']}, {want} cached)"
              + (f"; tokenizing the prompt alone: {tok_times['tokenize_ms']:.2f} ms warm, "
                 f"{tok_times['tokenize_cold_ms']:.2f} cold, {tok_times['tokenize_plain_ms']:.2f} plain"
                 if tok_times is not None else "")
              + ("; warm p50 by variant " + ", ".join(f"{v}: {st['p50_ms']:.2f}" for v, st in w["by_variant"].items())
                 if alternate is not None else ""),
              flush=True)
        if on_length:
            on_length(out)
    return out


# -- engine path ------------------------------------------------------------------------------
def run_engine(a, lengths, rec: dict, save_point):
    """Fills rec (the JSON's paths.engine) as it goes."""
    from infc.backend import load_backend
    from infc.compiler.contract import caches
    from infc.runtime.engine.sampling import SamplingParams
    from .common import copy_bandwidth
    kw = {} if a.max_num_batched_tokens is None else {"max_num_batched_tokens": a.max_num_batched_tokens}
    tier = getattr(a, "tier", "hbm")
    pool = tier_pool_gib(tier, getattr(a, "kv_offloading_size", None))
    if pool:        # --tier hbm with a pool: the tier is on (saving), the hit still from the device
        kw.update(kv_offloading_size=pool)
        if tier == "disk":
            kw.update(kv_offloading_disk=a.kv_offloading_disk or tempfile.mkdtemp(prefix="infc-kv-"),
                      kv_offloading_disk_size=a.kv_offloading_disk_size or 2 * pool)
    b = load_backend(a.model_path, model=a.model, device=a.device, max_num_seqs=a.max_num_seqs,
                     gpu_memory_utilization=a.gpu_memory_utilization, asynchronous=False,
                     load_format=a.load_format, enable_prefix_caching=True, block_size=a.page_size, **kw)
    engine, runner = b.engine, b.engine.runner
    from infc.runtime.engine.gc_freeze import freeze_startup
    # as `infc serve` does once it is loaded: a collection during a timed hit walks only what the
    # requests made, not the plan's and the weights' records (unfrozen, the hits' p50 moved by
    # milliseconds between processes, and more with the host tier's per-page objects: NOTES)
    rec["gc_frozen"] = freeze_startup()
    if not engine.bm.enable_prefix_caching:      # e.g. a model with per-sequence state (slot caches)
        raise ValueError(f"{a.model_path}: the engine runs this model without prefix caching: no warm hit to time")
    rec.update({"device": b.device, "plan_model": b.model_name, "max_model_len": b.max_model_len,
                "page_size": b.page_size, "kv_tokens": b.kv_tokens, "max_num_seqs": a.max_num_seqs,
                "max_num_batched_tokens": engine.scheduler.max_num_batched_tokens})
    ctx = getattr(runner, "ctx", None)
    bw = None
    if ctx is not None:
        rec["device_name"] = ctx.name
        try:
            bw = copy_bandwidth(ctx)
        except Exception as e:  # noqa: BLE001 - the KV cache may leave too little room: no floor then
            rec["copy_error"] = f"{type(e).__name__}: {e}"
        rec["copy_GBps"] = bw / 1e9 if bw else None
        rec["weight_bytes"] = runner.weights.bytes
    lengths, notes = clip_lengths(lengths, a.new_tokens, b.max_model_len, b.page_size)
    rec.update(lengths=lengths, notes=notes)
    for n in notes:
        print(f"engine: {n}")
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    count = iter(range(1 << 62))

    def submit(prompt, n):
        assert len(prompt) == n, (len(prompt), n)
        rid = f"prefix-{next(count)}"
        t0 = time.perf_counter()
        engine.add_request(prompt, params, rid)
        got = None
        while got is None:
            for o in engine.step():
                if o.request_id == rid:
                    got = (time.perf_counter() - t0, o.num_cached_tokens)
        while engine.has_unfinished():          # max_tokens=1: it finished with its token
            engine.step()
        return {"ttft": got[0], "cached": got[1]}

    prompts = IdPrompts(b.vocab_size, np.random.default_rng(a.seed))
    submit(prompts.make(32), 32)                # the engine's first step, untimed
    rec["results"] = {}
    rec["tier"] = tier
    rec["kv_offloading_size_gib"] = pool or 0.0
    restores: dict[int, list] = {}

    def on_length(res):
        rec["results"] = res
        if tier != "hbm":
            add_restores(res, restores, a.reps)
        if engine.tiers is not None:     # what the tier moved so far (an HBM run with it on: saves)
            st = engine.tiers.stats
            rec["tier_bytes"] = {"to_host": st.bytes_to_host, "to_device": st.bytes_to_device,
                                 "to_disk": st.bytes_to_disk, "from_disk": st.bytes_from_disk}
        save_point()

    timed = submit if tier == "hbm" else tier_submit(engine, tier, submit, restores, a.new_tokens)
    alternate = None
    if a.alternate:
        rec["alternate"] = a.alternate

        def alternate(v):      # read where the runtime next reads it (envs.value at its use)
            os.environ[a.alternate] = str(v)
    sweep(timed, prompts, lengths, a.new_tokens, a.reps, a.cold_reps, b.page_size, "engine", on_length,
          settle_s=a.settle_s, alternate=alternate)
    if bw:
        kv = caches.token_bytes(caches.of_plan(runner.plan))
        for L, r in rec["results"].items():
            r["warm_floor_ms"] = (runner.weights.bytes + kv * (int(L) + a.new_tokens)) / bw * 1e3
    close = getattr(runner, "close", None)
    if close:
        close()


TIER_POOL_GIB = 8.0      # --tier host|disk without --kv-offloading-size


def tier_pool_gib(tier: str, size: float | None) -> float | None:
    """The host pool a run's engine gets: --tier host|disk always one (default TIER_POOL_GIB);
    --tier hbm only the one asked for (None: no tier)."""
    if tier == "hbm":
        return size or None
    return size or TIER_POOL_GIB


def tier_submit(engine, tier: str, submit, restores: dict, new: int):
    """submit, each request's prefix hit forced to come from `tier` (host or disk) and checked to;
    a warm request's restore copy (ms, bytes) appended to restores[L]."""
    tiers = engine.tiers
    if tiers is None:
        raise ValueError(f"--tier {tier}: the engine runs this model without KV tiers")

    def run(prompt, n):
        tiers.demote(engine.bm, to_disk=tier == "disk")
        st = tiers.stats
        before = (st.host_hit_tokens, st.disk_hit_tokens, st.bytes_to_device)
        r = submit(prompt, n)
        host, disk = st.host_hit_tokens - before[0], st.disk_hit_tokens - before[1]
        if r["cached"] != (host if tier == "host" else disk):
            raise RuntimeError(f"engine: a request found {r['cached']} cached tokens, {host} of them in "
                               f"the host tier and {disk} on disk: not all from the {tier} tier")
        if r["cached"]:
            restores.setdefault(n - new, []).append((tiers.copies.last_ms(False), st.bytes_to_device - before[2]))
        return r
    return run


def add_restores(res: dict, restores: dict, reps: int):
    """The timed warm requests' restore copies (the last `reps` of each L) into res[L]["warm"]."""
    for L, r in res.items():
        got = restores.get(int(L), [])[-reps:]
        if not got or "warm" not in r:
            continue
        ms = [m for m, _ in got]
        r["warm"]["restore_ms"] = ms
        r["warm"]["restore_bytes"] = got[-1][1]
        r["warm"]["restore_GBps"] = got[-1][1] / (float(np.median(ms)) * 1e6) if np.median(ms) > 0 else None
        print(f"engine L={int(L):6d}: restore {got[-1][1] / 2**20:.1f} MiB in {np.median(ms):.2f} ms p50 "
              f"({r['warm']['restore_GBps'] or 0:.2f} GB/s); warm TTFT p50 {r['warm']['p50_ms']:.2f} ms", flush=True)


# -- serve path -------------------------------------------------------------------------------
def _get(url: str, timeout: float = 10) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read()


def prefix_cache_hits(base: str) -> float:
    """vllm:prefix_cache_hits_total (cached prompt tokens, all requests so far) from /metrics."""
    m = re.search(r"^vllm:prefix_cache_hits_total(?:\{[^}]*\})? (\S+)$", _get(f"{base}/metrics").decode(), re.M)
    if m is None:
        raise RuntimeError(f"{base}/metrics has no vllm:prefix_cache_hits_total")
    return float(m.group(1))


@contextmanager
def spawned_server(a, timeout_s: float):
    """`infc serve` in a fresh process on a free port; yields its base URL and command."""
    from .startup import free_port, healthy
    port = free_port()
    cmd = [sys.executable, "-m", "infc.cli", "serve", "--model-path", a.model_path, "--port", str(port),
           "--load-format", a.load_format, "--gpu-memory-utilization", str(a.gpu_memory_utilization),
           "--block-size", str(a.page_size),
           "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log"]
    cmd += ["--device", a.device] if a.device else []
    cmd += ["--model", a.model] if a.model else []
    if a.max_num_batched_tokens is not None:
        cmd += ["--max-num-batched-tokens", str(a.max_num_batched_tokens)]
    cmd += a.serve_args
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if getattr(a, "trace_file", None):          # --trace-server
        from .server_trace import server_env
        env = server_env(env, a.trace_file)
    log = tempfile.TemporaryFile("w+")        # a file, not a pipe: a full pipe would block the server
    # `timeout` (tests/gpu/session.sh) sends SIGTERM, which ends Python without `finally`: make it
    # an exception while the server runs, so the server never outlives us holding the GPU
    restore, p, ready = None, None, False

    def tail():
        log.seek(0)
        return log.read()[-3000:]

    try:
        if threading.current_thread() is threading.main_thread():
            restore = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True,
                             env=env)
        while not healthy(port):
            if p.poll() is not None:
                raise RuntimeError(f"infc serve exited with {p.returncode}:\n{tail()}")
            if time.perf_counter() - t0 > timeout_s:
                raise RuntimeError(f"infc serve not ready after {timeout_s} s:\n{tail()}")
            time.sleep(0.05)
        print(f"serve: infc serve ready in {time.perf_counter() - t0:.1f} s on port {port}", flush=True)
        ready = True
        yield f"http://127.0.0.1:{port}", cmd[3:]
    except BaseException:
        if ready:                               # what the server said, beside the client's error
            print(f"infc serve's log:\n{tail()}", file=sys.stderr)
        raise
    finally:
        if p is not None and p.poll() is None:
            p.terminate()
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
        log.close()
        if restore is not None:
            signal.signal(signal.SIGTERM, restore)


def _stream_ttft(url: str, body: dict, timeout: float, span: list | None = None) -> tuple[float, dict | None]:
    """The time to the first token's chunk, and the usage the stream ended with; span: a list that
    gets (send, first token) as perf_counter times (--trace-server lines the server's marks up
    with them)."""
    from .serve import post_stream

    async def go():
        t0 = time.perf_counter()
        first, usage = None, None
        async for t, data in post_stream(url, body, {}, timeout):
            if data == b"[DONE]":
                break
            ev = json.loads(data)
            if "error" in ev:
                raise RuntimeError(f"{url}: {ev['error'].get('message')}")
            if first is None and ev.get("choices"):
                first = t                       # the one token's chunk (sent even when its text is empty)
            if ev.get("usage"):
                usage = ev["usage"]
        if first is None:
            raise RuntimeError(f"{url}: the stream ended without a token")
        if span is not None:
            span.append((t0, first))
        return first - t0, usage

    return asyncio.run(go())


def _vocab(base: str, model_path: str) -> int:
    """Token ids below this are valid: the model's vocabulary (config.json), within the
    tokenizer's where the server has one."""
    sizes = []
    cfg = Path(model_path) / "config.json"
    if cfg.exists():
        c = json.loads(cfg.read_text())
        v = c.get("vocab_size") or (c.get("text_config") or {}).get("vocab_size")
        sizes += [int(v)] if v else []
    try:
        sizes.append(int(json.loads(_get(f"{base}/tokenizer_info"))["vocab_size"]))
    except Exception:  # noqa: BLE001 - no tokenizer: token ids only
        pass
    if not sizes:
        raise ValueError(f"no vocabulary size: {cfg} has none and the server has no tokenizer")
    return min(sizes)


def run_serve(a, lengths, rec: dict, save_point):
    """Fills rec (the JSON's paths.serve) as it goes."""
    from contextlib import nullcontext
    server = nullcontext((a.base_url.rstrip("/").removesuffix("/v1"), None)) if a.base_url \
        else spawned_server(a, a.timeout_s)
    with server as (base, cmd):
        card = json.loads(_get(f"{base}/v1/models"))["data"][0]
        max_model_len = int(card.get("max_model_len") or 1 << 30)
        rec.update({"base_url": base, "serve_args": cmd, "model_name": card["id"],
                    "max_model_len": max_model_len, "page_size": a.page_size})
        rng = np.random.default_rng(a.seed + 1)
        prompts, why = None, None
        if a.prompt_format in ("auto", "text"):
            from infc.compiler.contract.errors import ModelDirError
            from infc.runtime.tokenization.tokenizer import Tokenizer
            try:
                prompts = TextPrompts(Tokenizer(Path(a.model_path)), rng)
            except (ModelDirError, ValueError) as e:
                if a.prompt_format == "text":
                    raise ValueError(f"--prompt-format text: {e}") from None
                why = f"prompts as token ids: {e}"
        if prompts is None:
            prompts = IdPrompts(_vocab(base, a.model_path), rng)
        rec["prompt_format"] = prompts.kind
        lengths, notes = clip_lengths(lengths, a.new_tokens, max_model_len, a.page_size)
        notes = ([why] if why else []) + notes
        rec.update(lengths=lengths, notes=notes)
        for n in notes:
            print(f"serve: {n}")
        url = f"{base}/v1/completions"

        def submit(prompt, n):
            body = {"model": card["id"], "prompt": prompt, "max_tokens": 1, "temperature": 0.0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            before = prefix_cache_hits(base)
            span = [] if a.trace_file else None
            ttft, usage = _stream_ttft(url, body, a.timeout_s, span)
            spans.setdefault(n, []).extend(span or ())
            cached = prefix_cache_hits(base) - before
            got = (usage or {}).get("prompt_tokens")
            if got != n:
                raise RuntimeError(f"serve: a {prompts.kind} prompt meant as {n} tokens was {got} tokens to the server")
            return {"ttft": ttft, "cached": int(cached)}

        spans: dict[int, list] = {}             # prompt tokens -> (send, first token) of each request
        submit(prompts.make(32), 32)            # the server's first request, untimed
        rec["results"] = {}

        def on_length(res):
            rec["results"] = res
            if a.trace_file:                    # the warm requests' passage through the server
                from .server_trace import breakdown, describe, read_marks
                time.sleep(0.5)                 # its marks reach the file every 0.2 s
                marks = read_marks(a.trace_file)
                for L, r in res.items():
                    warm = spans.get(int(r["prompt_tokens"]), [])[-a.reps:]
                    r["server_trace_ms"] = b = breakdown(marks, warm)
                    print(f"serve L={int(L):6d}: warm requests in the server, median ms after the send: "
                          f"{describe(b)}", flush=True)
            save_point()

        sweep(submit, prompts, lengths, a.new_tokens, a.reps, a.cold_reps, a.page_size, "serve", on_length)


# -- tokenizer path ---------------------------------------------------------------------------
def run_tokenizer(a, lengths) -> dict:
    """--path tokenizer: the server's tokenizer alone on this host's CPU (no engine, no server):
    per L, the warm / cold / plain times of TextPrompts.tokenize_times, medians of --reps."""
    from infc.runtime.tokenization.tokenizer import Tokenizer
    tok = Tokenizer(Path(a.model_path))
    prompts = TextPrompts(tok, np.random.default_rng(a.seed + 1))
    rec = {"cpu_count": os.cpu_count(), "fast_path": tok.fast.rule, "fast_path_off_reason": tok.fast.reason,
           "chunk_chars": tok.fast.chunk_chars, "results": {}}
    print(f"tokenizer: {os.cpu_count()} CPUs, fast path {tok.fast.rule or 'off: ' + str(tok.fast.reason)}")
    for L in lengths:
        prefix = prompts.make(L)
        full = prefix + prompts.make(a.new_tokens, start=False)
        prompts.check_prefix(prefix, full, L, L + a.new_tokens)
        if tok.fast.encode(full) != tok.fast.plain(full):
            raise RuntimeError(f"tokenizer: the fast path differs from the plain call at L={L}")
        r = rec["results"][str(L)] = {"chars": len(full), **prompts.tokenize_times(prefix, a.new_tokens, a.reps)}
        print(f"tokenizer L={L:6d} ({len(full)} chars): warm {r['tokenize_ms']:8.2f} ms, cold "
              f"{r['tokenize_cold_ms']:8.2f} ms (CPU {r['tokenize_cold_cpu_ms']:.1f} ms), plain "
              f"{r['tokenize_plain_ms']:8.2f} ms (CPU {r['tokenize_plain_cpu_ms']:.1f} ms)", flush=True)
    return rec


# -- output -----------------------------------------------------------------------------------
def plot(res: dict, path: Path) -> bool:
    """False where matplotlib is not installed (as bench/serve.py: the JSON is the result)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    from .common import figure, finish
    fig, ax = figure()
    style = {"engine": "-", "serve": "--"}
    p99_shown = False
    for name, rec in res["paths"].items():
        rows = rec.get("results") or {}
        xs = [int(L) for L in rows]
        for mode, color in (("cold", "C0"), ("warm", "C1")):
            if not xs:
                continue
            ax.plot(xs, [rows[L][mode]["p50_ms"] for L in rows], style[name], marker="o", color=color,
                    label=f"{name} {mode}" + (f" (+{res['settings']['new_tokens']} new)" if mode == "warm" else "")
                    + " p50")
            ax.plot(xs, [rows[L][mode]["p99_ms"] for L in rows], "x", color=color, alpha=0.6,
                    label=None if p99_shown else "p99")
            p99_shown = True
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ticks = sorted({int(L) for rec in res["paths"].values() for L in rec.get("results") or {}})
    ax.set_xticks(ticks, [f"{L // 1024}k" if L % 1024 == 0 else str(L) for L in ticks])
    ax.set_xticks([], minor=True)
    ax.set_xlabel("input tokens (cached prefix when warm)")
    ax.set_ylabel("TTFT (ms)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    finish(fig, ax, path, f"{res['model']} on {res['gpu']}: TTFT, cold vs prefix cached", res)
    return True


def main(argv=None):
    ap = argparse.ArgumentParser(prog="infc bench prefix", allow_abbrev=False)
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--model", help="variant name (default: detected from config.json)")
    ap.add_argument("--path", choices=["engine", "serve", "both", "tokenizer"], default="both",
                    help="tokenizer: only the server's tokenizer on this CPU (no engine, no server)")
    ap.add_argument("--lengths", default=LENGTHS, help="input lengths L, comma-separated (clipped to the "
                    "model's max_model_len)")
    ap.add_argument("--new-tokens", type=int, default=16, help="fresh tokens after the cached prefix")
    ap.add_argument("--reps", type=int, default=10, help="timed warm repetitions per L")
    ap.add_argument("--cold-reps", type=int, help=f"timed cold repetitions per L (default: --reps up to {LONG} "
                    "tokens, 3 beyond)")
    ap.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when a GPU is present, else cpu")
    from infc.server.args import add_load_format_arg
    add_load_format_arg(ap)
    ap.add_argument("--max-num-seqs", type=int, default=8, help="engine path (the server keeps its default)")
    ap.add_argument("--max-num-batched-tokens", type=int, help="both paths (default: the device's)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--block-size", dest="page_size", type=int,
                    help="KV page size in tokens, both paths (default: the device's, infc.backend."
                         "device_page_size; with --base-url: the running server's)")
    ap.add_argument("--tier", choices=["hbm", "host", "disk"], default="hbm",
                    help="engine path: where the warm hit comes from (the device's pages, the host "
                         "pool, the disk folder)")
    ap.add_argument("--kv-offloading-size", type=float,
                    help=f"GiB of host pool (--tier host|disk: default {TIER_POOL_GIB:g}, enough for the "
                         "longest prefix; with --tier hbm the tier is on, saving, and the hit still "
                         "comes from the device: the tier's cost on an HBM hit)")
    ap.add_argument("--settle-s", type=float, default=0.0,
                    help="engine path: seconds of pause between caching the prefix and the warm "
                         "requests (with a KV tier: its saves of the requests before finish first)")
    ap.add_argument("--alternate", metavar="FLAG",
                    help="engine path: an A/B inside one process: the timed requests alternate the "
                         "flag FLAG between 0 and 1 (one the runtime reads at each step, e.g. "
                         "INFC_SHORT_GRAPHS), each value's statistics apart (by_variant)")
    ap.add_argument("--kv-offloading-disk", help="--tier disk: the folder (default: a temporary one)")
    ap.add_argument("--kv-offloading-disk-size", type=float, help="--tier disk: GiB (default: twice the host pool)")
    ap.add_argument("--prompt-format", choices=["auto", "text", "ids"], default="auto",
                    help="serve path: text needs the directory's tokenizer.json (auto: text if it has one)")
    ap.add_argument("--base-url", help="serve path: a running server instead of spawning `infc serve`")
    ap.add_argument("--trace-server", action="store_true",
                    help="serve path: where each warm request's time goes inside the spawned server "
                         "(bench/server_trace.py: connection, routing, parsing, engine, chunk), as medians")
    ap.add_argument("--timeout-s", type=float, default=600.0, help="server start, and each request")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gpu", help="the GPU's name for the record (default: nvidia-smi's on cuda, else cpu)")
    ap.add_argument("--out", help="results directory (default bench/results)")
    ap.add_argument("serve_args", nargs="*", help="extra `infc serve` flags (after --)")
    a = ap.parse_args(argv)
    lengths = [int(x) for x in a.lengths.split(",") if x.strip()]
    if not lengths or a.new_tokens < 1 or a.reps < 1 or (a.cold_reps is not None and a.cold_reps < 1):
        ap.error("--lengths, --new-tokens, --reps and --cold-reps must be positive")
    if a.base_url and a.serve_args:
        ap.error("extra `infc serve` flags need a spawned server, not --base-url")
    if a.trace_server and (a.base_url or a.path not in ("serve", "both")):
        ap.error("--trace-server traces a spawned server: the serve path without --base-url")
    a.trace_file = tempfile.mkstemp(prefix="infc-server-trace-", suffix=".txt")[1] if a.trace_server else None
    if a.alternate is not None:
        from infc import envs
        var = envs.REGISTRY.get(a.alternate)
        if var is None or var.kind != "flag":
            ap.error(f"--alternate {a.alternate}: not a registered INFC_ flag (infc/envs.py)")
        if a.path != "engine":
            ap.error("--alternate switches a variable in this process: add --path engine")
    if a.tier != "hbm" and a.path != "engine":
        ap.error(f"--tier {a.tier} times the engine path only: add --path engine")
    from .common import header, save
    if a.path == "tokenizer":
        res = header("cpu", a.model or Path(a.model_path).name)
        res.update({"settings": {"lengths": lengths, "new_tokens": a.new_tokens, "reps": a.reps, "seed": a.seed},
                    "paths": {"tokenizer": run_tokenizer(a, lengths)}})
        print(f"wrote {save('prefix-tokenizer', res, a.out)}")
        return res
    from infc.backend import detect_device, device_page_size
    from .serve import gpu_name
    a.device = a.device or detect_device()
    a.page_size = a.page_size or device_page_size(a.device)
    res = header(a.gpu or (gpu_name() if a.device == "cuda" else "cpu"), a.model or Path(a.model_path).name)
    pool = tier_pool_gib(a.tier, a.kv_offloading_size)
    res.update({"load_format": a.load_format, "device": a.device,
                "settings": {"lengths_requested": lengths, "new_tokens": a.new_tokens, "reps": a.reps,
                             "cold_reps": {str(L): cold_reps_for(L, a.reps, a.cold_reps) for L in lengths},
                             "max_new_tokens": 1, "seed": a.seed, "tier": a.tier,
                             "kv_offloading_size_gib": pool or 0.0,
                             "settle_s": a.settle_s},
                "paths": {}})
    out = {"path": None}

    # a tier's results apart, and an HBM hit's with the tier on apart from one without
    kind = ("prefix" + ("-tier-on" if pool else "")) if a.tier == "hbm" else f"prefix-{a.tier}"

    def save_point():
        out["path"] = save(kind, res, a.out)

    order = ["serve", "engine"] if a.path == "both" else [a.path]    # the server exits before the engine loads
    try:
        for name in order:
            rec = res["paths"][name] = {}
            (run_serve if name == "serve" else run_engine)(a, lengths, rec, save_point)
            if "copy_GBps" in rec:
                res["copy_GBps"] = rec["copy_GBps"]
            save_point()
    finally:
        if a.trace_file:
            Path(a.trace_file).unlink(missing_ok=True)
    res["paths"] = {k: res["paths"][k] for k in ("engine", "serve") if k in res["paths"]}
    path = save(kind, res, a.out)
    if plot(res, path.with_suffix(".png")):
        print(f"wrote {path} and {path.with_suffix('.png').name}")
    else:
        print(f"wrote {path} (no PNG: matplotlib is not installed)")
    return res


if __name__ == "__main__":
    main()
