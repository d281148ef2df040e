"""The engine's counters, gauges and histograms, named as vLLM exports them (server/metrics.py
renders them for Prometheus)."""
from dataclasses import dataclass, field


class Histogram:
    def __init__(self, buckets):
        self.buckets, self.counts, self.sum, self.count = list(buckets), [0] * len(buckets), 0.0, 0

    def observe(self, v: float):
        self.sum += v
        self.count += 1
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1             # per bucket; Prometheus export makes them cumulative
                break


_LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
            120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]


@dataclass
class Metrics:
    """Counters, gauges and histograms, named as vLLM exports them (without the `vllm:`)."""
    num_requests_running: int = 0
    num_requests_waiting: int = 0
    kv_cache_usage_perc: float = 0.0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    num_preemptions_total: int = 0
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
    request_success_total: dict = field(default_factory=dict)          # finished_reason -> count
    time_to_first_token_seconds: Histogram = field(default_factory=lambda: Histogram(
        [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
         10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]))
    inter_token_latency_seconds: Histogram = field(default_factory=lambda: Histogram(
        [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
         20.0, 40.0, 80.0]))
    e2e_request_latency_seconds: Histogram = field(default_factory=lambda: Histogram(_LATENCY))
    request_queue_time_seconds: Histogram = field(default_factory=lambda: Histogram(_LATENCY))
