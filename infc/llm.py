"""`LLM`: the offline Python API. `LLM(model_dir, device="cpu").generate(prompts, params)`.

On the CPU it compiles the directory's spec to a plan and runs it with the numpy reference
executor behind the CPU runner, driven by the engine (continuous batching, chunked prefill,
paged KV with a prefix cache) until every request is done.
"""
from dataclasses import dataclass, field
from pathlib import Path

from infc.compiler.build import compile_model
from infc.compiler.errors import ModelDirError
from infc.runtime.engine import Engine
from infc.runtime.runner import CPURunner
from infc.runtime.safetensors_io import Checkpoint
from infc.runtime.sampling import SamplingParams
from infc.runtime.tokenizer import Tokenizer, eos_ids
from infc.runtime.weights import load_weights


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
    """kv_cache_tokens sizes the paged KV cache (float32 on the CPU); a sequence never grows
    past min(the model's context length, the cache). max_num_seqs and max_num_batched_tokens
    bound one step, as in vLLM."""

    def __init__(self, model: str | Path, device: str = "cpu", spec: str | None = None, *,
                 kv_cache_tokens: int = 4096, page_size: int = 16, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 2048, max_model_len: int | None = None,
                 enable_prefix_caching: bool = True):
        if device != "cpu":
            raise ValueError(f"device '{device}' is not available in this build: the CPU reference "
                             f"backend is (device='cpu')")
        self.model_dir = Path(model)
        if not self.model_dir.is_dir():
            raise ModelDirError(f"{model}: not a directory")
        _, self.plan = compile_model(model_dir=str(self.model_dir), spec_path=spec)
        self._tokenizer = None
        self.weights = load_weights(self.plan, Checkpoint(self.model_dir))
        num_pages = -(-kv_cache_tokens // page_size)
        self.runner = CPURunner(self.plan, self.weights, num_pages, page_size)
        self.eos = eos_ids(self.model_dir)
        model_len = int(self.plan["config"].get("max_len") or 1 << 30)
        self.max_len = min(max_model_len or model_len, model_len, num_pages * page_size)
        tok = self.tokenizer if (self.model_dir / "tokenizer.json").exists() else None
        self.engine = Engine(self.runner, tok, self.eos, self.max_len, max_num_seqs=max_num_seqs,
                             max_num_batched_tokens=max_num_batched_tokens,
                             enable_prefix_caching=enable_prefix_caching)
        self._next_id = 0

    @property
    def tokenizer(self) -> Tokenizer:
        """Loaded on first use: a directory without tokenizer.json still runs token-id prompts."""
        if self._tokenizer is None:
            self._tokenizer = Tokenizer(self.model_dir)
        return self._tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | None = None) -> list[RequestOutput]:
        params = sampling_params or SamplingParams()
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        requests = {}
        try:
            for prompt in prompts:
                ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
                rid = f"llm-{self._next_id}"
                self._next_id += 1
                self.engine.add_request(ids, params, rid)
                requests[rid] = RequestOutput(prompt if isinstance(prompt, str) else None, ids,
                                              [CompletionOutput(i, "", []) for i in range(params.n)])
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    req = requests[out.request_id]
                    c = req.outputs[out.index]
                    c.text += out.text
                    c.token_ids += out.token_ids
                    if out.logprobs is not None:
                        c.logprobs = (c.logprobs or []) + out.logprobs
                    c.finish_reason, c.stop_reason = out.finish_reason, out.stop_reason
                    req.num_cached_tokens = max(req.num_cached_tokens, out.num_cached_tokens)
                    if out.request_finished:
                        req.metrics = out.metrics
        finally:
            for rid in requests:                 # an error or interrupt leaves nothing running
                self.engine.abort(rid)
        return list(requests.values())
