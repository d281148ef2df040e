"""The engine's counters, gauges and histograms, named as vLLM exports them (server/metrics.py
renders them for Prometheus), and the per-request and per-step events that feed them.

What one request adds is measured as vLLM measures it (its v1 IterationStats): on its first
token the prompt tokens, time to first token and queue time (arrival to first scheduled); on
its end the prompt and generation token counts, the end-to-end latency and the prefill (first
scheduled to first token), decode (first to last token) and inference (first scheduled to last
token) times, and its mean time per output token (decode time over the tokens after the first).
A step adds to the iteration-tokens histogram the prompt tokens of the requests that had their
first token in it and the tokens it generated. Requests the server makes for itself (forced-token
prompt scoring on a backend without row logits) are not counted: Engine.add_request(counted=False).
"""
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


def buckets_1_2_5(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(m * scale)
        scale *= 10


_LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
            120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
_PER_TOKEN = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
              10.0, 20.0, 40.0, 80.0]
_TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
         10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_ITERATION = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]


def _h(buckets):
    return field(default_factory=lambda: Histogram(buckets))


@dataclass
class Metrics:
    """Counters, gauges and histograms, named as vLLM exports them (without the `vllm:`)."""
    max_model_len: int = 1 << 16         # bounds the token-count histograms' buckets
    num_requests_running: int = 0
    num_requests_waiting: int = 0
    kv_cache_usage_perc: float = 0.0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    num_preemptions_total: int = 0
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
    # KV tiers (--kv-offloading-size): the prompt tokens the device's cache did not hold, of them
    # those restored from the host or the disk tier, as vLLM counts its KV connector's
    external_prefix_cache_queries_total: int = 0
    external_prefix_cache_hits_total: int = 0
    kv_offload: object = None                              # kv_tier.tiers.TierStats, or None
    kv_events: object = None                               # [kv_events.PublisherStats] a rank, or None
    request_success_total: dict = field(default_factory=dict)          # finished_reason -> count
    time_to_first_token_seconds: Histogram = _h(_TTFT)
    inter_token_latency_seconds: Histogram = _h(_PER_TOKEN)
    e2e_request_latency_seconds: Histogram = _h(_LATENCY)
    request_queue_time_seconds: Histogram = _h(_LATENCY)
    request_prefill_time_seconds: Histogram = _h(_LATENCY)
    request_decode_time_seconds: Histogram = _h(_LATENCY)
    request_inference_time_seconds: Histogram = _h(_LATENCY)
    request_time_per_output_token_seconds: Histogram = _h(_PER_TOKEN)
    iteration_tokens_total: Histogram = _h(_ITERATION)
    request_prompt_tokens: Histogram | None = None        # buckets_1_2_5(max_model_len)
    request_generation_tokens: Histogram | None = None
    cache_config_info: dict = field(default_factory=dict)  # label -> value (a gauge set to 1)
    # LoRA plans: vLLM's lora_requests_info labels (the adapters of running and of waiting
    # requests, comma-separated, and max_lora); empty without adapters
    lora_requests_info: dict = field(default_factory=dict)
    iteration_tokens: int = 0                              # of the step running now
    # speculative decoding (vLLM's spec_decode_* counters), exported when spec_decode_positions
    # (the drafts a step may verify, k) is set: drafts verified, their tokens, the accepted ones,
    # and per draft position j the drafts whose first j + 1 tokens were accepted
    spec_decode_positions: int = 0
    spec_decode_num_drafts_total: int = 0
    spec_decode_num_draft_tokens_total: int = 0
    spec_decode_num_accepted_tokens_total: int = 0
    spec_decode_num_accepted_tokens_per_pos_total: dict = field(default_factory=dict)  # position -> count

    def __post_init__(self):
        self.request_prompt_tokens = Histogram(buckets_1_2_5(self.max_model_len))
        self.request_generation_tokens = Histogram(buckets_1_2_5(self.max_model_len))

    # -- events ---------------------------------------------------------------------------------
    def first_token(self, num_prompt_tokens: int, arrival: float, scheduled: float, now: float):
        """A request's first token (of any of its n sequences)."""
        self.prompt_tokens_total += num_prompt_tokens
        self.iteration_tokens += num_prompt_tokens
        self.time_to_first_token_seconds.observe(now - arrival)
        self.request_queue_time_seconds.observe(scheduled - arrival)

    def token(self, since_last: float | None):
        """A generated token; since_last: seconds since the sequence's previous one (None: its first)."""
        self.generation_tokens_total += 1
        self.iteration_tokens += 1
        if since_last is not None:
            self.inter_token_latency_seconds.observe(since_last)

    def finished(self, reason: str):
        c = self.request_success_total
        c[reason] = c.get(reason, 0) + 1

    def completed(self, num_prompt_tokens: int, num_generation_tokens: int, arrival: float,
                  scheduled: float, first_token: float, now: float):
        """A request whose sequences all ended with their tokens (stop or length)."""
        decode = now - first_token
        self.e2e_request_latency_seconds.observe(now - arrival)
        self.request_prefill_time_seconds.observe(first_token - scheduled)
        self.request_decode_time_seconds.observe(decode)
        self.request_inference_time_seconds.observe(now - scheduled)
        self.request_time_per_output_token_seconds.observe(
            decode / (num_generation_tokens - 1) if num_generation_tokens > 1 else 0.0)
        self.request_prompt_tokens.observe(num_prompt_tokens)
        self.request_generation_tokens.observe(num_generation_tokens)

    def drafts_verified(self, num_draft_tokens: int, num_accepted: int):
        """A sequence's draft of num_draft_tokens tokens verified; its first num_accepted accepted."""
        self.spec_decode_num_drafts_total += 1
        self.spec_decode_num_draft_tokens_total += num_draft_tokens
        self.spec_decode_num_accepted_tokens_total += num_accepted
        per = self.spec_decode_num_accepted_tokens_per_pos_total
        for j in range(num_accepted):
            per[j] = per.get(j, 0) + 1

    def end_iteration(self):
        """A step ended: the tokens it counted (if any) go to the iteration histogram."""
        if self.iteration_tokens:
            self.iteration_tokens_total.observe(self.iteration_tokens)
            self.iteration_tokens = 0
