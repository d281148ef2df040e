"""`LLM`: the offline Python API. `LLM(model_dir, device="cuda").generate(prompts, params)`.

The engine is built exactly as `infc serve` builds it (infc/backend.py): on the CPU the
directory's spec compiles to a plan run by the numpy reference executor; on "cuda" the artifact
is built (or reused) and loaded by the CUDA runner. The engine (continuous batching, chunked
prefill, paged KV with a prefix cache) is stepped here until every request is done.
"""
from dataclasses import dataclass, field
from pathlib import Path

from infc.compiler.contract.errors import ModelDirError
from infc.config import (DEFAULT_GPU_MEMORY_UTILIZATION, DEVICES, OFFLINE_CPU_KV_TOKENS, OFFLINE_CPU_MAX_NUM_SEQS,
                         EngineConfig)
from infc.runtime.engine import best_of
from infc.runtime.engine.sampling import SamplingParams
from infc.runtime.tokenization.tokenizer import Tokenizer


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None        # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    logprobs: list | None = None


@dataclass
class RequestOutput:
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0               # prompt tokens served from the prefix cache
    metrics: dict | None = None
    prompt_logprobs: list | None = None      # SamplingParams.prompt_logprobs: None, then one entry a token

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


class LLM:
    """device: "cpu" (numpy reference, float32), "cuda", or None (cuda when a GPU is present).
    kv_cache_tokens sizes the paged KV cache (default: 4096 tokens on the CPU; on the GPU what
    gpu_memory_utilization leaves); a sequence never grows past min(the model's context length,
    the cache), in pages of page_size tokens (default: 16 on the CPU, on the GPU its build's: 64 on
    an H200, infc.backend.device_page_size). The defaults: infc/config.py. max_num_seqs and max_num_batched_tokens bound one
    step, as in vLLM.
    spec: a spec file; spec_dirs: directories of specs searched before specs/ (also
    $INFC_SPEC_PATH) for the one whose architectures match the model's config.json.
    load_format: "auto" (the directory's safetensors) or "dummy" (random weights of the right
    shapes, vLLM's spelling: a directory with config.json alone runs).
    tensor_parallel_size / enable_expert_parallel: one process per rank (runtime/distributed/rank_workers.py),
    as vLLM's flags; `close()` (or `with LLM(...) as llm:`) stops them.
    kv_cache_dtype: vLLM's "auto" (None: the model's dtype) or "fp8" / "fp8_e4m3" (infc/config.py).
    kv_offloading_size: GiB of host memory for prefix blocks evicted from the KV cache (vLLM's).
    speculative_config: vLLM's, a dict or its JSON ({"method": "ngram", "num_speculative_tokens":
    k, ...}, or {"method": "draft_model", "model": DIR, ...}; infc.config.speculative_config):
    outputs stay those of plain decoding.
    kv_events_config: vLLM's, a dict or its JSON ({"enable_kv_cache_events": True, "endpoint": ...};
    infc.config.kv_events_config): the prefix cache's KV events over ZeroMQ (docs/serving.md).
    enable_lora, max_loras, max_lora_rank, max_cpu_loras, lora_modules ({name: PEFT directory}):
    vLLM's LoRA settings (docs/serving.md); generate(..., lora_request=...) picks an adapter."""

    def __init__(self, model: str | Path, device: str | None = "cpu", spec: str | None = None, *,
                 kv_cache_tokens: int | None = None, page_size: int | None = None, max_num_seqs: int | None = None,
                 max_num_batched_tokens: int | None = None, max_model_len: int | None = None,
                 enable_prefix_caching: bool = True, gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
                 cuda_graphs: bool = True, log=None, spec_dirs=None, load_format: str = "auto",
                 tensor_parallel_size: int = 1, enable_expert_parallel: bool = False,
                 data_parallel_size: int = 1, kv_cache_dtype: str | None = None,
                 kv_offloading_size: float | None = None,
                 speculative_config=None, kv_events_config=None,
                 enable_lora: bool = False, max_loras: int | None = None, max_lora_rank: int | None = None,
                 max_cpu_loras: int | None = None, lora_modules: dict | None = None):
        from infc.backend import detect_device, load_backend
        device = device or detect_device()
        if device not in DEVICES:
            raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
        self.model_dir = Path(model)
        if not self.model_dir.is_dir():
            raise ModelDirError(f"{model}: not a directory")
        cpu = device == "cpu"
        config = EngineConfig.from_settings(
            spec=spec, spec_dirs=spec_dirs, load_format=load_format, max_model_len=max_model_len,
            device=device, cuda_graphs=cuda_graphs, page_size=page_size,
            kv_cache_tokens=kv_cache_tokens or (OFFLINE_CPU_KV_TOKENS if cpu else None),
            enable_prefix_caching=enable_prefix_caching, gpu_memory_utilization=gpu_memory_utilization,
            max_num_seqs=max_num_seqs or (OFFLINE_CPU_MAX_NUM_SEQS if cpu else None),
            max_num_batched_tokens=max_num_batched_tokens, asynchronous=False,
            tensor_parallel_size=tensor_parallel_size, enable_expert_parallel=enable_expert_parallel,
            data_parallel_size=data_parallel_size, kv_cache_dtype=kv_cache_dtype,
            kv_offloading_size=kv_offloading_size,
            speculative_config=speculative_config, kv_events_config=kv_events_config,
            enable_lora=enable_lora, max_loras=max_loras, max_lora_rank=max_lora_rank,
            max_cpu_loras=max_cpu_loras, lora_modules=lora_modules)
        self.backend = load_backend(self.model_dir, config, log=log)
        self.device = device
        self.engine = self.backend.engine
        self.runner = self.engine.runner
        self.plan = self.runner.plan
        self.eos = self.backend.eos_ids
        self.max_len = self.backend.max_model_len
        self._tokenizer = self.backend.tokenizer
        self._next_id = 0

    def _lora(self, request) -> str | None:
        if request is None or isinstance(request, str):
            return request
        name, path = getattr(request, "lora_name", None), getattr(request, "lora_path", None)
        if not isinstance(name, str) or not isinstance(path, (str, Path)):
            raise TypeError(f"lora_request: an adapter name or an object with lora_name and lora_path, "
                            f"got {request!r}")
        loras = self.engine.loras
        if loras is not None and name not in loras.ids:
            loras.register(name, path)
        return name

    def close(self):
        """Give back what the engine and the runners hold: the KV-event sockets, the device
        memory (the target's, and a draft model's), or the rank processes."""
        self.engine.close()
        spec = getattr(self.engine, "spec", None)
        draft = spec.draft.runner if spec is not None and spec.draft is not None else None
        for runner in (draft, self.runner):
            close = getattr(runner, "close", None)
            if close is not None:
                close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def tokenizer(self) -> Tokenizer:
        """Loaded on first use: a directory without tokenizer.json still runs token-id prompts."""
        if self._tokenizer is None:
            self._tokenizer = Tokenizer(self.model_dir)
        return self._tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | None = None,
                 lora_request=None) -> list[RequestOutput]:
        """prompts: a text, a list of token ids, vLLM's prompt dict ({"prompt": text} or
        {"prompt_token_ids": ids}, with an optional "cache_salt": only prompts of the same salt
        share cached KV), or a list of these. lora_request: a loaded adapter's name, or vLLM's
        LoRARequest (anything with lora_name and lora_path), loaded on first use."""
        lora = self._lora(lora_request)
        asked = sampling_params or SamplingParams()
        params = best_of.candidates(asked)
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        requests = {}
        try:
            for prompt in prompts:
                prompt, salt = _prompt_and_salt(prompt)
                ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
                rid = f"llm-{self._next_id}"
                self._next_id += 1
                self.engine.add_request(ids, params, rid, lora=lora, cache_salt=salt)
                requests[rid] = RequestOutput(prompt if isinstance(prompt, str) else None, ids,
                                              [CompletionOutput(i, "", []) for i in range(params.n)])
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.error is not None:    # the engine failed this request: say why
                        raise RuntimeError(f"request {out.request_id} failed: {out.error}") from out.error
                    req = requests[out.request_id]
                    c = req.outputs[out.index]
                    c.text += out.text
                    c.token_ids += out.token_ids
                    if out.logprobs is not None:
                        c.logprobs = (c.logprobs or []) + out.logprobs
                    c.finish_reason, c.stop_reason = out.finish_reason, out.stop_reason
                    req.num_cached_tokens = max(req.num_cached_tokens, out.num_cached_tokens)
                    if out.prompt_logprobs is not None:
                        req.prompt_logprobs = out.prompt_logprobs
                    if out.request_finished:
                        req.metrics = out.metrics
        finally:
            for rid in requests:                 # an error or interrupt leaves nothing running
                self.engine.abort(rid)
        if best_of.wants_best_of(asked):
            for req in requests.values():
                req.outputs = best_of.choose(req.outputs, asked.n, lambda c: c.logprobs)
                for i, c in enumerate(req.outputs):
                    c.index = i
                    if asked.logprobs is None:
                        c.logprobs = None
        return list(requests.values())


def _prompt_and_salt(prompt) -> tuple:
    """(text or ids, cache salt) of one prompt of LLM.generate: vLLM's prompt dicts too."""
    if not isinstance(prompt, dict):
        return prompt, None
    unknown = set(prompt) - {"prompt", "prompt_token_ids", "cache_salt"}
    if unknown or ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise ValueError("a prompt dict holds one of 'prompt' (text) and 'prompt_token_ids', and "
                         f"optionally 'cache_salt'; got keys {sorted(prompt)}")
    return prompt.get("prompt", prompt.get("prompt_token_ids")), prompt.get("cache_salt")
