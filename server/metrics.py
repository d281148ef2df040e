"""/metrics: the engine's counters, gauges and histograms as Prometheus text, under vLLM's names
(vllm:num_requests_running, vllm:time_to_first_token_seconds, ...) with a model_name label, so
dashboards, routers and benchmark tools built for vLLM read them unchanged; vllm:cache_config_info
(a gauge at 1 whose labels are the KV cache's settings); with KV tiers (--kv-offloading-size),
vLLM's external_prefix_cache_* counters and infc's own per-tier ones (infc:kv_offload_*); with
--kv-events-config, the KV-event batches published and dropped a rank (infc:kv_events_*); vllm:lora_requests_info (LoRA plans: the
adapters of running and of waiting requests as labels); and, as vLLM's prometheus_client registry
shows them, the process and Python collectors (process_resident_memory_bytes, python_gc_*, ...).
The engine measures (runtime/engine/metrics.py); this renders."""
import time

from prometheus_client import GC_COLLECTOR, PLATFORM_COLLECTOR, PROCESS_COLLECTOR
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import CollectorRegistry

GAUGES = {
    "num_requests_running": "Number of requests in model execution batches.",
    "num_requests_waiting": "Number of requests waiting to be processed.",
    "kv_cache_usage_perc": "KV-cache usage. 1 means 100 percent usage.",
}
COUNTERS = {
    "prompt_tokens": "Number of prefill tokens processed.",
    "generation_tokens": "Number of generation tokens processed.",
    "num_preemptions": "Cumulative number of preemptions from the engine.",
    "prefix_cache_queries": "Prefix cache queries, in terms of number of queried tokens.",
    "prefix_cache_hits": "Prefix cache hits, in terms of number of cached tokens.",
}
# with KV tiers only, as vLLM shows these with a KV connector only
EXTERNAL = {
    "external_prefix_cache_queries": "External prefix cache queries from the KV tiers (host, disk), "
                                     "in terms of number of queried tokens.",
    "external_prefix_cache_hits": "External prefix cache hits from the KV tiers (host, disk), in "
                                  "terms of number of cached tokens.",
}
SPEC_COUNTERS = {       # shown when the engine speculates (vLLM shows them only then)
    "spec_decode_num_drafts": "Number of spec decoding drafts.",
    "spec_decode_num_draft_tokens": "Number of draft tokens.",
    "spec_decode_num_accepted_tokens": "Number of accepted tokens.",
}
HISTOGRAMS = {
    "time_to_first_token_seconds": "Histogram of time to first token in seconds.",
    "inter_token_latency_seconds": "Histogram of inter-token latency in seconds.",
    "e2e_request_latency_seconds": "Histogram of e2e request latency in seconds.",
    "request_queue_time_seconds": "Histogram of time spent in WAITING phase for request.",
    "request_prefill_time_seconds": "Histogram of time spent in PREFILL phase for request.",
    "request_decode_time_seconds": "Histogram of time spent in DECODE phase for request.",
    "request_inference_time_seconds": "Histogram of time spent in RUNNING phase for request.",
    "request_time_per_output_token_seconds": "Histogram of time_per_output_token_seconds per request.",
    "request_prompt_tokens": "Number of prefill tokens processed.",
    "request_generation_tokens": "Number of generation tokens processed.",
    "iteration_tokens_total": "Histogram of number of tokens per engine_step.",
}


def _label(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(v) -> str:
    return repr(float(v))


def _process() -> bytes:
    """The process, platform and GC collectors, as prometheus_client's default registry has them."""
    reg = CollectorRegistry(auto_describe=False)
    for c in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
        reg.register(c)
    return generate_latest(reg)


def _histogram(out: list, name: str, doc: str, h, m: str):
    out += [f"# HELP {name} {doc}", f"# TYPE {name} histogram"]
    buckets, counts = (list(h.buckets), list(h.counts)) if h is not None else ([], [])
    total, s = (h.count, h.sum) if h is not None else (0, 0.0)
    acc = 0
    for b, c in zip(buckets, counts):
        acc += c                                # the engine keeps per-bucket counts
        out.append(f'{name}_bucket{{le="{_num(b)}",{m}}} {_num(acc)}')
    out.append(f'{name}_bucket{{le="+Inf",{m}}} {_num(total)}')
    out.append(f"{name}_sum{{{m}}} {_num(s)}")
    out.append(f"{name}_count{{{m}}} {_num(total)}")


def _tiers(out: list, stats: dict, m: str):
    """The KV tiers' counters (runtime/engine/kv_tier/tiers.py TierStats), if the engine has them."""
    t = stats.get("kv_offload")
    if t is None:
        return
    for name, doc in EXTERNAL.items():
        out += [f"# HELP vllm:{name} {doc}", f"# TYPE vllm:{name} counter",
                f"vllm:{name}_total{{{m}}} {_num(stats.get(name + '_total', 0))}"]
    out += ["# HELP infc:kv_offload_hit_tokens Prompt tokens restored from a KV tier instead of computed.",
            "# TYPE infc:kv_offload_hit_tokens counter"]
    for tier, v in (("host", t.host_hit_tokens), ("disk", t.disk_hit_tokens)):
        out.append(f'infc:kv_offload_hit_tokens_total{{tier="{tier}",{m}}} {_num(v)}')
    out += ["# HELP infc:kv_offload_bytes Bytes of KV blocks copied between the tiers.",
            "# TYPE infc:kv_offload_bytes counter"]
    for d, v in (("device_to_host", t.bytes_to_host), ("host_to_device", t.bytes_to_device),
                 ("host_to_disk", t.bytes_to_disk), ("disk_to_host", t.bytes_from_disk)):
        out.append(f'infc:kv_offload_bytes_total{{direction="{d}",{m}}} {_num(v)}')
    _histogram(out, "infc:kv_offload_restore_seconds", "Host time to stage a step's restores from "
               "the KV tiers (disk reads, copies issued; on the CPU the copies themselves).",
               t.restore_seconds, m)


def _kv_events(out: list, stats: dict, m: str):
    """The KV-event publishers' counters (runtime/engine/kv_events.py), one a data-parallel rank."""
    pubs = stats.get("kv_events")
    if not pubs:
        return
    for name, attr, doc in (
            ("published", "published_batches", "Batches of KV events sent to subscribers."),
            ("dropped", "dropped_batches", "Batches of KV events dropped: the publisher's queue was "
                                           "full (the engine never waits for it).")):
        out += [f"# HELP infc:kv_events_{name} {doc}", f"# TYPE infc:kv_events_{name} counter"]
        for p in pubs:
            out.append(f'infc:kv_events_{name}_total{{rank="{p.rank}",{m}}} {_num(getattr(p, attr))}')


def render(stats: dict, model_name: str) -> str:
    m = f'model_name="{_label(model_name)}"'
    out = []
    for name, doc in GAUGES.items():
        out += [f"# HELP vllm:{name} {doc}", f"# TYPE vllm:{name} gauge",
                f"vllm:{name}{{{m}}} {_num(stats.get(name, 0))}"]
    for name, doc in COUNTERS.items():
        out += [f"# HELP vllm:{name} {doc}", f"# TYPE vllm:{name} counter",
                f"vllm:{name}_total{{{m}}} {_num(stats.get(name + '_total', 0))}"]
    out += ["# HELP vllm:request_success Count of successfully processed requests.",
            "# TYPE vllm:request_success counter"]
    success = dict(stats.get("request_success_total") or {})
    for reason in ("stop", "length", "abort"):
        success.setdefault(reason, 0)
    for reason, count in sorted(success.items()):
        out.append(f'vllm:request_success_total{{finished_reason="{_label(str(reason))}",{m}}} {_num(count)}')
    for name, doc in HISTOGRAMS.items():
        _histogram(out, f"vllm:{name}", doc, stats.get(name), m)
    _tiers(out, stats, m)
    _kv_events(out, stats, m)
    if stats.get("spec_decode_positions"):
        for name, doc in SPEC_COUNTERS.items():
            out += [f"# HELP vllm:{name} {doc}", f"# TYPE vllm:{name} counter",
                    f"vllm:{name}_total{{{m}}} {_num(stats.get(name + '_total', 0))}"]
        name = "spec_decode_num_accepted_tokens_per_pos"
        per = stats.get(name + "_total") or {}
        out += [f"# HELP vllm:{name} Accepted tokens per draft position.", f"# TYPE vllm:{name} counter"]
        out += [f'vllm:{name}_total{{{m},position="{j}"}} {_num(per.get(j, 0))}'
                for j in range(stats["spec_decode_positions"])]
    info = stats.get("cache_config_info")
    if info:
        labels = ",".join(f'{k}="{_label(str(v))}"' for k, v in sorted(info.items()))
        out += ["# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
                "# TYPE vllm:cache_config_info gauge", f"vllm:cache_config_info{{{labels}}} 1.0"]
    lora = stats.get("lora_requests_info")
    if lora:                                 # vLLM's: the value is when the labels were taken
        labels = ",".join(f'{k}="{_label(str(v))}"' for k, v in sorted(lora.items()))
        out += ["# HELP vllm:lora_requests_info Running stats on lora requests.",
                "# TYPE vllm:lora_requests_info gauge", f"vllm:lora_requests_info{{{labels}}} {_num(time.time())}"]
    return "\n".join(out) + "\n" + _process().decode()
