"""`LLM`: the offline Python API. `LLM(model_dir, device="cpu").generate(prompts, params)`.

On the CPU it compiles the directory's spec to a plan and runs it with the numpy reference
executor; sequences are batched continuously (one prefill step for the new prompts, then
decode steps for everything still running).
"""
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from infc.compiler.build import compile_model
from infc.compiler.errors import ModelDirError
from infc.runtime.reference.executor import ReferenceExecutor, SeqChunk
from infc.runtime.safetensors_io import Checkpoint
from infc.runtime.sampling import SamplingParams, logprobs_of, sample
from infc.runtime.tokenizer import IncrementalDecoder, Tokenizer
from infc.runtime.weights import load_weights


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None        # "stop" | "length"
    logprobs: list | None = None


@dataclass
class RequestOutput:
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


def _eos_ids(model_dir: Path) -> set[int]:
    ids = set()
    for name in ("generation_config.json", "config.json"):
        p = model_dir / name
        if p.exists():
            e = json.loads(p.read_text()).get("eos_token_id")
            if e is not None:
                ids |= set(e if isinstance(e, list) else [e])
            if ids:
                break
    return ids


class _Seq:
    def __init__(self, sid, prompt_ids, params, tok):
        self.id, self.prompt_ids, self.params = sid, list(prompt_ids), params
        self.out: list[int] = []
        self.logprobs = [] if params.logprobs is not None else None
        self.decoder = IncrementalDecoder(tok, params.skip_special_tokens) if tok else None
        self.rng = np.random.default_rng(params.seed)
        self.finish: str | None = None
        self.text = ""


class LLM:
    def __init__(self, model: str | Path, device: str = "cpu", spec: str | None = None):
        if device != "cpu":
            raise ValueError(f"device '{device}' is not available in this build: the CPU reference "
                             f"backend is (device='cpu')")
        self.model_dir = Path(model)
        if not self.model_dir.is_dir():
            raise ModelDirError(f"{model}: not a directory")
        _, self.plan = compile_model(model_dir=str(self.model_dir), spec_path=spec)
        self._tokenizer = None
        self.weights = load_weights(self.plan, Checkpoint(self.model_dir))
        self.executor = ReferenceExecutor(self.plan, self.weights)
        self.eos = _eos_ids(self.model_dir)
        self.max_len = int(self.plan["config"].get("max_len") or 1 << 30)
        self._next_id = 0

    @property
    def tokenizer(self) -> Tokenizer:
        """Loaded on first use: a directory without tokenizer.json still runs token-id prompts."""
        if self._tokenizer is None:
            self._tokenizer = Tokenizer(self.model_dir)
        return self._tokenizer

    def _step(self, seqs: list[_Seq], chunks: list[SeqChunk]):
        logits = self.executor.step(chunks)
        for s, row in zip(seqs, logits):
            p = s.params
            if len(s.out) < p.min_tokens:     # too early to end: mask every ending token
                row = row.copy()
                for t in self.eos | set(p.stop_token_ids):
                    if 0 <= t < row.size:
                        row[t] = -np.inf
            tok = sample(row, p, s.rng)
            if s.logprobs is not None:
                lp = logprobs_of(row)
                top = np.argsort(-lp, kind="stable")[: max(p.logprobs, 1)]
                s.logprobs.append({"token": tok, "logprob": float(lp[tok]),
                                   "top": [(int(t), float(lp[t])) for t in top]})
            s.out.append(tok)
            if s.decoder is not None:
                s.text += s.decoder.push(tok)
            self._check_stop(s, tok)

    def _check_stop(self, s: _Seq, tok: int):
        p = s.params
        if len(s.out) >= p.min_tokens:
            if (tok in self.eos and not p.ignore_eos) or tok in p.stop_token_ids:
                s.finish = "stop"
                return
            for stop in p.stop:
                at = s.text.find(stop)
                if at >= 0:
                    s.text = s.text[:at]
                    s.finish = "stop"
                    return
        if (p.max_tokens is not None and len(s.out) >= p.max_tokens) or \
                len(s.prompt_ids) + len(s.out) >= self.max_len:
            s.finish = "length"

    def generate(self, prompts, sampling_params: SamplingParams | None = None) -> list[RequestOutput]:
        params = sampling_params or SamplingParams()
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        requests = []
        for prompt in prompts:
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            if not ids:
                raise ValueError("empty prompt")
            if len(ids) >= self.max_len:
                raise ValueError(f"prompt of {len(ids)} tokens: this model's maximum context "
                                 f"length is {self.max_len} tokens")
            req = RequestOutput(prompt if isinstance(prompt, str) else None, ids)
            seqs = []
            for i in range(params.n):
                p = params
                if params.seed is not None and i:
                    p = SamplingParams(**{**params.__dict__, "seed": params.seed + i})
                tok = self.tokenizer if (isinstance(prompt, str) or (self.model_dir / "tokenizer.json").exists()) else None
                seqs.append(_Seq(self._next_id, ids, p, tok))
                self._next_id += 1
            requests.append((req, seqs))
        running = [s for _, seqs in requests for s in seqs]
        try:
            self._step(running, [SeqChunk(s.id, s.prompt_ids, 0) for s in running])
            while True:
                running = [s for s in running if s.finish is None]
                if not running:
                    break
                self._step(running, [SeqChunk(s.id, [s.out[-1]], len(s.prompt_ids) + len(s.out) - 1)
                                     for s in running])
        finally:
            for _, seqs in requests:
                for s in seqs:
                    self.executor.free(s.id)
        for req, seqs in requests:
            req.outputs = [CompletionOutput(i, s.text, s.out, s.finish, s.logprobs)
                           for i, s in enumerate(seqs)]
        return [req for req, _ in requests]
