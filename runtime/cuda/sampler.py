"""Sampling on the GPU: the plan's sampler kernels (plan["sampler"]) on the step's logits.

After a step the logits (f32 [B, V]) stay on the device; per row the host uploads the request's
parameters (temperature, top-k, top-p, min-p, seed, step: a few bytes) and gets back one token
id: the sampler kernels write it to device memory (the next step's tokens are copied from there)
and into mapped host memory, where the host reads it once the step's end event has passed. A copy
would queue on a copy engine, behind whatever the KV tier's saves have queued there (an artifact
rendered before the host output, or INFC_SAMPLED_TOKENS_COPY=1, copies). Only rows that asked
for logprobs copy a row back, of log-softmax values computed on the device. A row's logits
processing (penalties, logit_bias, banned ids, bitmasks: engine/logits_process.py) runs in place
after the log-softmax, so a logprob is always of the model's distribution, as on the CPU: the
logits_process kernel over the rows that have any, their sparse entries and bitmask rows uploaded
through this sampler's own page-locked staging (they grow with the prompts, unlike the runner's
fixed uploads).

All-greedy steps use the argmax kernel (one pass over V); any other row needs `sample`, which
takes temperature 0 as greedy (lowest index on ties, the same token argmax gives).
"""
from dataclasses import dataclass

import numpy as np

from infc import envs
from infc.compiler.contract.bind import Resolver, dim_slots, grid
from ..engine.runner import RowSampling, Sample
from .driver import PackedArgs, launch
from .logits_process_args import pack_rows
from .staging import Staging

NEG_INF_F32 = 0xFF800000
SEED_MASK = (1 << 63) - 1          # the kernel's seed is an i64; a Python seed may be any int
# the logits_process kernel's inputs after the logits, in order (its META, logits_process_args.py)
PROCESS_ARGS = ["rows", "rep", "freq", "pres", "start", "tok", "count", "flag", "bias", "mask_row", "masks"]


def outputs(meta: dict) -> list[str]:
    """A kernel's out:N parameters, by name (a sampler kernel rendered before the host output
    has one)."""
    return [name for name, _, source in meta["params"] if source.startswith("out:")]


@dataclass
class SamplerPending:
    """Sampling issued on the stream (GpuSampler.start), its tokens not read yet."""
    rows: list
    tokens: np.ndarray          # page-locked: where the sampled ids land (written or copied)
    lp_rows: dict               # row -> its page-locked log-softmax row (rows that asked)
    keep: list                  # host arrays the stream still reads


class GpuSampler:
    def __init__(self, ctx, kernels: dict, sampler_ids: dict, max_seqs: int, vocab: int, staging=None):
        """staging: the runner's page-locked upload buffers (staging.py) for the sampling
        parameters; None: copies from ordinary host memory (then sample() only)."""
        self.ctx, self.V, self.max_seqs, self.staging = ctx, vocab, max_seqs, staging
        self.k = {name: kernels[kid] for name, kid in sampler_ids.items()}
        n = max_seqs
        self.dev = {"temperature": ctx.alloc(4 * n), "top_k": ctx.alloc(4 * n), "top_p": ctx.alloc(4 * n),
                    "min_p": ctx.alloc(4 * n), "seed": ctx.alloc(8 * n), "step": ctx.alloc(4 * n),
                    "token": ctx.alloc(4 * n), "logprobs": ctx.alloc(4 * n * vocab)}
        # two: a step's tokens land in one while the other step's are still to be read. Mapped
        # where the kernels write them there (a second output), else the copies' destination
        mapped = all(len(outputs(self.k[name].meta)) == 2 for name in ("argmax", "sample") if name in self.k)
        self.token_writes = mapped and not envs.value("INFC_SAMPLED_TOKENS_COPY")
        pinned = [ctx.pinned(4 * n, mapped=mapped) for _ in range(2)]
        self.tokens_host = [p.view(np.int32) for p in pinned]
        self.tokens_dev = [ctx.device_ptr(p) for p in pinned] if mapped else [None, None]
        self._started = 0
        # per step parity, the page-locked rows the asked-for log-softmax rows are copied into,
        # packed: made on first use (most runs never ask) and grown to the most rows asked
        self.lp_host = [None, None]
        self._lp_pinned = [None, None]          # their allocations (to give back when grown)
        self._args = {}
        # the logits processing's uploads: device arrays and page-locked staging, made on first
        # use and grown (after a sync: a step in flight may read them) to the most a step needs
        self.proc_dev: dict[str, tuple[int, int]] = {}     # name -> (pointer, bytes) in proc_block
        self.proc_block: tuple[int, int] | None = None       # (pointer, bytes)
        self.proc_offs: dict[str, int] = {}
        self.proc_staging: Staging | None = None

    def _packed(self, name: str, logits_ptr: int, parity: int = 0) -> PackedArgs:
        """Arguments bound once per (kernel, logits buffer, step parity: the host buffer a token
        lands in); B is rewritten per call."""
        key = (name, logits_ptr, parity)
        if key not in self._args:
            k = self.k[name]
            ptrs = dict(self.dev, logits=logits_ptr, token_host=self.tokens_dev[parity],
                        **{n: p for n, (p, _) in self.proc_dev.items()})
            if name == "logits_process":
                ins, outs = ["logits", *PROCESS_ARGS], []
            else:
                ins = ["logits", "temperature", "top_k", "top_p", "min_p", "seed", "step"]
                outs = ["logprobs"] if name == "log_softmax" else ["token", "token_host"][: len(outputs(k.meta))]
            resolver = Resolver(tensor=lambda n, layer: ptrs[n], dim=lambda d: 0)
            values = resolver.values(k.meta, ins, outs, kernel=k.id)
            slot = next((i for i, d in dim_slots(k.meta) if d == "B"), None)
            self._args[key] = (k.pack(values), slot)
        return self._args[key]

    def _launch(self, name: str, logits_ptr: int, B: int, parity: int = 0):
        k = self.k[name]
        args, slot = self._packed(name, logits_ptr, parity)
        if slot is not None:                      # argmax and log_softmax take B from the grid only
            args.set(slot, B)
        launch(self.ctx, k.fn, grid(k.meta, {"B": B, "T": B}), k.block, k.shared, args)

    def packed_params(self, rows: list[RowSampling | None]) -> dict:
        """The rows' sampling parameters as the sample kernel reads them. top_k at or above the
        vocabulary is off (0), as in the kernel: so no request's top_k overflows its int32."""
        p = [s.params if s is not None else None for s in rows]
        return {
            "temperature": np.array([x.temperature if x and x.top_k != 1 else 0.0 for x in p], np.float32),
            "top_k": np.array([x.top_k if x and 0 < x.top_k < self.V else 0 for x in p], np.int32),
            "top_p": np.array([x.top_p if x else 1.0 for x in p], np.float32),
            "min_p": np.array([x.min_p if x else 0.0 for x in p], np.float32),
            "seed": np.array([(s.seed & SEED_MASK) if s else 0 for s in rows], np.int64),
            "step": np.array([s.step if s else 0 for s in rows], np.int32),
        }

    def sample(self, logits_ptr: int, rows: list[RowSampling | None]) -> list[Sample | None]:
        """Sample the rows and wait for the tokens."""
        pending = self.start(logits_ptr, rows)
        if pending is None:
            return [None] * len(rows)
        self.ctx.sync()
        return self.finish(pending)

    def start(self, logits_ptr: int, rows: list[RowSampling | None]) -> SamplerPending | None:
        """Issue the sampling of the rows and the copy of their tokens to the host; None if no
        row samples (prefill chunks that do not reach their prompt's end)."""
        B = len(rows)
        if all(s is None for s in rows):           # only prefill chunks that sample nothing yet
            return None
        ctx, keep = self.ctx, []
        want_lp = [b for b, s in enumerate(rows) if s is not None and s.params.logprobs is not None]
        if want_lp:
            self._launch("log_softmax", logits_ptr, B)
        keep += self._process(logits_ptr, rows)
        parity = self._started % 2
        self._started += 1
        greedy = all(s is None or s.params.temperature == 0 or s.params.top_k == 1 for s in rows)
        if greedy:
            self._launch("argmax", logits_ptr, B, parity)
        else:
            host = self.packed_params(rows)
            if self.staging is not None:
                host = {n: self.staging.put(a) for n, a in host.items()}
            keep += [ctx.htod(self.dev[n], a) for n, a in host.items()]
            if self.staging is not None:
                self.staging.done()
            self._launch("sample", logits_ptr, B, parity)
        tokens = self.tokens_host[parity][:B]
        if not self.token_writes:
            ctx.dtoh(tokens, self.dev["token"])
        lp_rows = {}
        if want_lp:
            host = self._lp_rows(parity, len(want_lp))
            for i, b in enumerate(want_lp):
                ctx.dtoh(host[i], self.dev["logprobs"] + 4 * b * self.V)
                lp_rows[b] = host[i]
        return SamplerPending(list(rows), tokens, lp_rows, keep)

    def _process(self, logits_ptr: int, rows: list) -> list:
        """Launch the logits processing of the rows that have any (nothing if none has); the
        host arrays the stream still reads. Its arrays live in one device block, in
        PROCESS_ARGS order (the masks last), uploaded by one copy of the block's used part: on
        the stream after the step's forward, each small copy would cost its own latency."""
        args = pack_rows(rows, self.V)
        if args is None:
            return []
        if "logits_process" not in self.k:
            return self._banned_only(logits_ptr, rows)
        host = args.arrays()
        self._fit(host)
        if self.proc_staging is None:
            keep = [self.ctx.htod(self.proc_dev[n][0], a) for n, a in host.items() if a.size]
        else:
            st = self.proc_staging
            st.begin()
            buf = st.buffers[st.step % 2]
            end = 0
            for n, a in host.items():
                at = self.proc_offs[n]
                buf[at:at + a.nbytes] = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
                end = max(end, at + a.nbytes)
            keep = [self.ctx.htod(self.proc_block[0], buf[:end])]
            st.done()
        self._launch("logits_process", logits_ptr, args.rows.size)
        return keep

    def _banned_only(self, logits_ptr: int, rows: list) -> list:
        """An artifact rendered before the logits_process kernel: banned ids only."""
        for b, s in enumerate(rows):
            if s is None:
                continue
            if s.penalties is not None or s.params.logit_bias or s.allowed is not None or s.bitmask is not None:
                raise ValueError("this model's compiled artifact has no logits_process kernel (built "
                                 "before penalties / logit_bias / bitmasks): rebuild it")
            for t in s.banned:
                if 0 <= t < self.V:
                    self.ctx.memset32(logits_ptr + 4 * (b * self.V + t), 1, NEG_INF_F32)
        return []

    def _fit(self, host: dict):
        """The device block (and its page-locked staging) large enough for this step's arrays:
        each array's region doubled when it no longer fits (a sync first: a step in flight may
        read the old block), the regions 64-byte aligned in PROCESS_ARGS order."""
        caps = {n: self.proc_dev[n][1] if n in self.proc_dev else 0 for n in PROCESS_ARGS}
        grow = [n for n in PROCESS_ARGS if caps[n] < host[n].nbytes]
        if not grow:
            return
        if self.proc_block is not None:
            self.ctx.sync()
            self.ctx.free(self.proc_block[0])
            if self.proc_staging is not None:
                for buf in self.proc_staging.buffers:
                    self.ctx.free_pinned(buf)
        for n in grow:
            caps[n] = max(host[n].nbytes, 2 * caps[n] if caps[n] else 4 * self.max_seqs, 64)
        offs, at = {}, 0
        for n in PROCESS_ARGS:
            offs[n] = at = -(-at // 64) * 64
            at += caps[n]
        block = self.ctx.alloc(at)
        self.proc_block, self.proc_offs = (block, at), offs
        self.proc_dev = {n: (block + offs[n], caps[n]) for n in PROCESS_ARGS}
        self.proc_staging = Staging(self.ctx, at) if self.staging is not None else None
        self._args = {k: v for k, v in self._args.items() if k[0] != "logits_process"}

    def _lp_rows(self, parity: int, n: int) -> np.ndarray:
        """At least n page-locked rows of V floats for this parity's step. The step two launches
        back, the last to use them, has been read (launch / collect keep two in flight)."""
        host = self.lp_host[parity]
        if host is None or host.shape[0] < n:
            if host is not None:
                self.ctx.free_pinned(self._lp_pinned[parity])
            rows = min(self.max_seqs, max(n, 2 * (0 if host is None else host.shape[0])))
            self._lp_pinned[parity] = self.ctx.pinned(4 * rows * self.V)
            host = self.lp_host[parity] = self._lp_pinned[parity].view(np.float32).reshape(rows, self.V)
        return host

    def finish(self, pending: SamplerPending) -> list[Sample | None]:
        """The samples of started sampling whose copies have completed (the caller waited)."""
        tokens, lp_rows = pending.tokens, pending.lp_rows
        out = []
        for b, s in enumerate(pending.rows):
            if s is None:
                out.append(None)
                continue
            tok = int(tokens[b])
            if s.params.logprobs is None:
                out.append(Sample(tok))
                continue
            lp = lp_rows[b]
            k = s.params.logprobs
            top = np.argpartition(-lp, k)[:k] if 0 < k < lp.size else np.arange(lp.size if k else 0)
            top = top[np.lexsort((top, -lp[top]))]           # by logprob, then lower id first
            out.append(Sample(tok, float(lp[tok]), [(int(t), float(lp[t])) for t in top]))
        return out
