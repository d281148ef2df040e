"""`infc serve --device cpu` with a KV cache of a few pages and --kv-offloading-size: a prompt whose
blocks other prompts pushed out of the cache is served from the host tier (the same greedy
answer as at first, its prefix counted as cached), and /metrics shows the tier's hits and bytes."""
import json

import numpy as np

from test_server_support import one_blas_thread, request, serve_process  # noqa: F401


def _metrics(port) -> dict:
    _, _, body = request(port, "GET", "/metrics")
    out = {}
    for line in body.decode().splitlines():
        if line and not line.startswith("#"):
            key, _, v = line.rpartition(" ")
            out[key] = float(v)
    return out


def test_serve_restores_an_evicted_prefix_from_the_host_tier():
    from smollm2_from_gguf import ensure_smollm2
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 40000, 90).tolist() for _ in range(5)]
    with serve_process(ensure_smollm2(), "--device", "cpu", "--max-model-len", "128",
                       "--kv-cache-memory-bytes", str(16 << 20), "--kv-offloading-size", "0.05",
                       "--enable-prompt-tokens-details", "--served-model-name", "tiny",
                       "--uvicorn-log-level", "warning") as (port, out):
        assert "KV offloading: host" in out, out

        def complete(p):
            s, _, body = request(port, "POST", "/v1/completions", {
                "model": "tiny", "prompt": p, "max_tokens": 4, "temperature": 0, "ignore_eos": True})
            assert s == 200, body
            r = json.loads(body)
            return r["choices"][0]["text"], r["usage"]["prompt_tokens_details"]["cached_tokens"]

        first, cached = complete(prompts[0])
        assert cached == 0
        for p in prompts[1:]:                  # 4 x 6 pages: more than the cache's free pages
            complete(p)
        again, cached = complete(prompts[0])
        assert again == first and cached == 80             # 5 full blocks of 16
        m = _metrics(port)
        lab = 'model_name="tiny"'
        assert m[f'infc:kv_offload_hit_tokens_total{{tier="host",{lab}}}'] == 80
        assert m[f'infc:kv_offload_bytes_total{{direction="host_to_device",{lab}}}'] > 0
        assert m[f'infc:kv_offload_bytes_total{{direction="device_to_host",{lab}}}'] > 0
        assert m[f"vllm:external_prefix_cache_hits_total{{{lab}}}"] == 80
        assert m[f"vllm:prefix_cache_hits_total{{{lab}}}"] == 0      # not from the device's cache
        assert m[f"infc:kv_offload_restore_seconds_count{{{lab}}}"] >= 1
        info = next(k for k in m if k.startswith("vllm:cache_config_info{"))
        assert 'kv_offloading_size="0.05"' in info and 'num_cpu_blocks="' in info
