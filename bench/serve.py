"""`infc bench serve`: Poisson arrivals at given request rates against any OpenAI-compatible server.

    infc bench serve --base-url http://127.0.0.1:8000 --rates 1,2,4,8,16,32

For each rate, --num-prompts requests arrive with exponential gaps (a Poisson process), each a
random token-id prompt of --input-len tokens asking for exactly --output-len tokens (greedy,
ignore_eos, streamed). Per request it records the time to first token (TTFT), the gaps between
streamed tokens (ITL) and the time per output token after the first (TPOT = (e2e - TTFT) /
(out - 1)); per rate, their mean and percentiles, and request/token throughput. Results go to
bench/results/serve-<model>-<gpu>.json (+ a PNG when matplotlib is installed).

The client is a small asyncio HTTP/1.1 reader (no dependency), one connection per request, so it
measures the server and not a client library's pool.
"""
import argparse
import asyncio
import json
import math
import re
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np

from .common import PERCENTILES, latency_stats


# -- a minimal streaming HTTP client --------------------------------------------------------------
async def _read_chunked(reader):
    while True:
        line = await reader.readline()
        if not line:
            return
        size = int(line.split(b";")[0].strip() or b"0", 16)
        if size == 0:
            await reader.readline()
            return
        data = await reader.readexactly(size)
        await reader.readexactly(2)
        yield data


async def post_stream(url: str, body: dict, headers: dict, timeout: float):
    """Yields (arrival time, event payload) for each SSE `data:` line."""
    u = urlsplit(url)
    if u.scheme != "http":
        raise ValueError(f"only http:// URLs are supported, got {url}")
    reader, writer = await asyncio.wait_for(asyncio.open_connection(u.hostname, u.port or 80), timeout)
    try:
        payload = json.dumps(body).encode()
        head = [f"POST {u.path or '/'} HTTP/1.1", f"Host: {u.netloc}", "Content-Type: application/json",
                f"Content-Length: {len(payload)}", "Accept: text/event-stream", "Connection: close"]
        head += [f"{k}: {v}" for k, v in headers.items()]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + payload)
        await writer.drain()
        status = await asyncio.wait_for(reader.readline(), timeout)
        code = int(status.split()[1])
        hdrs = {}
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            k, _, v = line.decode("latin-1").partition(":")
            hdrs[k.strip().lower()] = v.strip()
        if hdrs.get("transfer-encoding", "").lower() == "chunked":
            chunks = _read_chunked(reader)
        else:
            async def until_eof():
                while data := await reader.read(65536):
                    yield data
            chunks = until_eof()
        buf = b""
        async for data in chunks:
            now = time.perf_counter()
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                line = line.strip()
                if code != 200:
                    continue
                if line.startswith(b"data:"):
                    yield now, line[5:].strip()
        if code != 200:
            raise RuntimeError(f"HTTP {code}: {buf[:300]!r}")
    finally:
        writer.close()


# -- one request ----------------------------------------------------------------------------------
async def one_request(url, body, headers, timeout) -> dict:
    t0 = time.perf_counter()
    times, out_tokens, error = [], None, None
    try:
        async for t, data in post_stream(url, body, headers, timeout):
            if data == b"[DONE]":
                break
            ev = json.loads(data)
            if "error" in ev:
                raise RuntimeError(ev["error"].get("message"))
            if ev.get("usage"):
                out_tokens = ev["usage"].get("completion_tokens")
            for c in ev.get("choices", []):
                piece = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
                if piece:
                    times.append(t)
    except Exception as e:  # noqa: BLE001 - recorded per request
        error = f"{type(e).__name__}: {e}"
    end = time.perf_counter()
    res = {"ok": error is None and bool(times), "error": error, "e2e": end - t0}
    if times:
        res["ttft"] = times[0] - t0
        res["itl"] = list(np.diff(times))
        n = out_tokens if out_tokens is not None else len(times)
        res["output_tokens"] = n
        res["tpot"] = (end - times[0]) / (n - 1) if n > 1 else None
    return res


def _stats(xs) -> dict:
    return latency_stats(xs, PERCENTILES)


async def run_rate(url, make_body, headers, rate, num, input_len, timeout, seed, max_concurrency=None) -> dict:
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, num) if math.isfinite(rate) else np.zeros(num)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def launch(i):
        if sem is None:
            return await one_request(url, make_body(i), headers, timeout)
        async with sem:
            return await one_request(url, make_body(i), headers, timeout)

    t0 = time.perf_counter()
    tasks = []
    for i in range(num):
        tasks.append(asyncio.create_task(launch(i)))
        if i + 1 < num and gaps[i] > 0:
            await asyncio.sleep(gaps[i])
    results = await asyncio.gather(*tasks)
    dur = time.perf_counter() - t0
    ok = [r for r in results if r["ok"]]
    out_tok = sum(r["output_tokens"] for r in ok)
    return {"request_rate": rate if math.isfinite(rate) else "inf", "num_requests": num, "completed": len(ok),
            "failed": num - len(ok), "errors": sorted({r["error"] for r in results if r["error"]})[:5],
            "duration_s": dur, "request_throughput": len(ok) / dur, "output_throughput": out_tok / dur,
            "total_token_throughput": (out_tok + input_len * len(ok)) / dur,
            "ttft": _stats([r["ttft"] for r in ok]), "tpot": _stats([r["tpot"] for r in ok]),
            "itl": _stats([x for r in ok for x in r["itl"]]), "e2e": _stats([r["e2e"] for r in ok])}


def _get_json(url, headers, timeout=10):
    req = urllib.request.Request(url, headers=headers)
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def gpu_name() -> str:
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=10).stdout.strip()
            if out:
                return out.splitlines()[0]
        except (OSError, subprocess.SubprocessError):
            pass
    return "cpu"


def save(res: dict, out: Path | None = None) -> Path:
    """bench/results/serve-<model>-<gpu>.json (names made file-safe: a model may be a path)."""
    from .common import RESULTS
    safe = lambda s: re.sub(r"[^A-Za-z0-9._-]+", "-", str(s)).strip("-").lower() or "x"  # noqa: E731
    out = Path(out or RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"serve-{safe(res['model'])}-{safe(res['gpu'])}.json"
    path.write_text(json.dumps(res, indent=1) + "\n")
    return path


def plot(res: dict, path: Path) -> bool:
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = res["results"]
    x = [r["request_rate"] if r["request_rate"] != "inf" else max(
        [q["request_rate"] for q in rows if q["request_rate"] != "inf"] or [1]) * 2 for r in rows]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, key, title in ((axes[0, 0], "ttft", "TTFT"), (axes[0, 1], "tpot", "TPOT"), (axes[1, 0], "itl", "ITL")):
        for p in (50, 99):
            ax.plot(x, [r[key].get(f"p{p}_ms", float("nan")) for r in rows], marker="o", label=f"p{p}")
        ax.set_title(f"{title} (ms)")
        ax.set_xlabel("request rate (req/s)")
        ax.legend()
    ax = axes[1, 1]
    ax.plot(x, [r["output_throughput"] for r in rows], marker="o", label="output tok/s")
    ax.set_title("throughput")
    ax.set_xlabel("request rate (req/s)")
    ax.legend()
    fig.suptitle(f"{res['model']} on {res['gpu']}: {res['input_len']} in / {res['output_len']} out "
                 f"({res['commit']}, {res['date']})")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def main(argv=None):
    ap = argparse.ArgumentParser(prog="infc bench serve", allow_abbrev=False)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", help="default: the first of the server's /v1/models")
    ap.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    ap.add_argument("--rates", default="1,2,4,8,16,32", help="request rates (req/s), comma-separated; inf allowed")
    ap.add_argument("--num-prompts", type=int, default=100, help="requests per rate")
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--vocab-size", type=int, help="token ids are drawn below this (default: from "
                    "/tokenizer_info, else 32000)")
    ap.add_argument("--max-concurrency", type=int)
    ap.add_argument("--api-key")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--gpu", help="the GPU's name for the record (default: nvidia-smi, else cpu)")
    ap.add_argument("--out", help="results directory (default bench/results)")
    a = ap.parse_args(argv)
    rates = [float(r) for r in a.rates.split(",")]
    if any(r <= 0 for r in rates) or a.num_prompts < 1 or a.input_len < 1 or a.output_len < 1:
        raise ValueError("rates, --num-prompts, --input-len and --output-len must be positive")
    base = a.base_url.rstrip("/")
    if base.endswith("/v1"):
        base = base[:-3]
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    model = a.model or _get_json(f"{base}/v1/models", headers)["data"][0]["id"]
    vocab = a.vocab_size
    if vocab is None:
        try:
            vocab = int(_get_json(f"{base}/tokenizer_info", headers)["vocab_size"])
        except Exception:  # noqa: BLE001 - not every server has it
            vocab = 32000
    rng = np.random.default_rng(a.seed)
    lo = min(1000, vocab // 4)                     # skip the low ids, where special tokens live
    prompts = [rng.integers(lo, vocab, a.input_len).tolist() for _ in range(a.num_prompts)]
    words = ["alpha", "river", "stone", "light", "seven", "cloud", "green", "paper", "music", "north"]

    def make_body(i):
        common = {"model": model, "max_tokens": a.output_len, "temperature": 0.0, "ignore_eos": True,
                  "stream": True, "stream_options": {"include_usage": True}}
        if a.endpoint == "chat":
            text = " ".join(words[t % len(words)] for t in prompts[i])
            return dict(common, messages=[{"role": "user", "content": text}])
        return dict(common, prompt=prompts[i])

    url = f"{base}/v1/completions" if a.endpoint == "completions" else f"{base}/v1/chat/completions"
    from .common import commit
    import datetime
    res = {"model": model, "gpu": a.gpu or gpu_name(), "commit": commit(),
           "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
           "base_url": base, "endpoint": a.endpoint, "input_len": a.input_len, "output_len": a.output_len,
           "num_prompts": a.num_prompts, "results": []}
    for k, rate in enumerate(rates):
        r = asyncio.run(run_rate(url, make_body, headers, rate, a.num_prompts, a.input_len, a.timeout,
                                 a.seed + k, a.max_concurrency))
        res["results"].append(r)
        t, p = r["ttft"], r["tpot"]
        print(f"rate {r['request_rate']:>5}: {r['completed']}/{r['num_requests']} ok, "
              f"{r['request_throughput']:.2f} req/s, {r['output_throughput']:.1f} out tok/s, "
              f"TTFT p50 {t.get('p50_ms', float('nan')):.1f} p99 {t.get('p99_ms', float('nan')):.1f} ms, "
              f"TPOT p50 {p.get('p50_ms', float('nan')):.2f} ms", flush=True)
    path = save(res, Path(a.out) if a.out else None)
    if plot(res, path.with_suffix(".png")):
        print(f"wrote {path} and {path.with_suffix('.png').name}")
    else:
        print(f"wrote {path} (no PNG: matplotlib is not installed)")
    return res


if __name__ == "__main__":
    main()
