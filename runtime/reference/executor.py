"""The numpy reference executor: runs a plan's launches in float32, one op reference each.

It is the oracle for kernels and passes and the CPU backend. It deliberately executes the plan
as the GPU runtime will: every buffer is a view into one arena at the plan's offsets, so a
wrong liveness plan corrupts logits here first. Its KV cache is either contiguous per
sequence (`step`, the oracle) or paged like the GPU's (`step_paged`, driven by the same step
metadata: slot mapping and block tables), which lets the engine share prefix pages on the CPU.
"""
from dataclasses import dataclass

import numpy as np

from infc.compiler.ops import REGISTRY

KV = "kv_cache"
# The arena is laid out in the plan's dtypes (bf16 = 2 bytes); float32 here needs twice that.
SCALE = 2


@dataclass
class SeqChunk:
    seq_id: int
    tokens: list[int]      # new tokens this step
    start: int             # tokens already in the cache


class StepContext:
    def __init__(self, chunks: list[SeqChunk], kv: dict):
        self.seqs, self.positions, rows, last = [], [], 0, []
        for c in chunks:
            self.seqs.append((c.seq_id, rows, len(c.tokens), c.start))
            self.positions += range(c.start, c.start + len(c.tokens))
            rows += len(c.tokens)
            last.append(rows - 1)
        self.positions = np.asarray(self.positions, dtype=np.int64)
        self.last_rows = np.asarray(last, dtype=np.int64)
        self.T, self.B = rows, len(chunks)
        self.kv = kv
        self.layer = 0

    def dim(self, d):
        return {"T": self.T, "B": self.B}.get(d, d) if isinstance(d, str) else d

    def kv_append(self, seq_id, k, v):
        key = (self.layer, seq_id)
        K, V = self.kv.get(key, (np.zeros((0,) + k.shape[1:], np.float32),) * 2)
        self.kv[key] = (np.concatenate([K, k]), np.concatenate([V, v]))

    def kv_get(self, seq_id):
        return self.kv[(self.layer, seq_id)]


class PagedStepContext(StepContext):
    """The step's sequences are the batch rows b; KV lives in pages [P, page_size, Hkv, D]."""

    def __init__(self, meta, k_pages, v_pages):
        self.meta, self.k_pages, self.v_pages = meta, k_pages, v_pages
        starts = meta.seq_starts
        self.seqs = [(b, int(starts[b]), int(starts[b + 1] - starts[b]),
                      int(meta.context_lens[b] - (starts[b + 1] - starts[b]))) for b in range(meta.B)]
        self.positions = meta.positions.astype(np.int64)
        self.last_rows = meta.last_rows.astype(np.int64)
        self.T, self.B = meta.T, meta.B
        self.layer = 0
        self.page = k_pages[0].shape[1]

    def kv_append(self, b, k, v):
        start = int(self.meta.seq_starts[b])
        slots = self.meta.slot_mapping[start:start + k.shape[0]]
        kp, vp = self.k_pages[self.layer], self.v_pages[self.layer]
        kp.reshape(-1, *kp.shape[2:])[slots] = k
        vp.reshape(-1, *vp.shape[2:])[slots] = v

    def kv_get(self, b):
        n = int(self.meta.context_lens[b])
        pages = self.meta.block_tables[b, : -(-n // self.page)]
        kp, vp = self.k_pages[self.layer], self.v_pages[self.layer]
        return (kp[pages].reshape(-1, *kp.shape[2:])[:n], vp[pages].reshape(-1, *vp.shape[2:])[:n])


class ReferenceExecutor:
    def __init__(self, plan: dict, weights: dict):
        self.plan = plan
        self.weights = weights
        self.kv: dict = {}

    def free(self, seq_id: int):
        for key in [k for k in self.kv if k[1] == seq_id]:
            del self.kv[key]

    def cached_len(self, seq_id: int) -> int:
        got = self.kv.get((0, seq_id))
        return 0 if got is None else got[0].shape[0]

    # -- buffers --------------------------------------------------------------------------
    def _arena(self, ctx):
        a = self.plan["arena"]
        nbytes = (a["bytes_per_token"] * ctx.T + a["bytes_per_seq"] * ctx.B + a["bytes"]) * SCALE
        # poison: a read of memory no launch wrote shows up as NaN in the logits
        arena = np.full(nbytes // 4, np.nan, dtype=np.float32).view(np.uint8)
        views = {}
        for name, b in self.plan["buffers"].items():
            off = b["offset"]
            start = (off["T"] * ctx.T + off["B"] * ctx.B + off["bytes"]) * SCALE
            shape = [ctx.dim(d) for d in b["shape"]]
            dtype = np.int32 if b["dtype"] == "i32" else np.float32
            if "row_stride" in b:
                # a column slice of a wider buffer: address rows by the stride
                itemsize = np.dtype(dtype).itemsize
                width = int(np.prod(shape[1:]))
                base = np.ndarray((shape[0], width), dtype, arena, start,
                                  (b["row_stride"] * itemsize, itemsize))
                views[name] = base.reshape(shape)   # splitting the last axis stays a view
            else:
                views[name] = np.ndarray(shape, dtype, arena, start)
        return views

    def _arg(self, name, views, layer):
        if name == KV:
            return None
        if name in views:
            return views[name]
        w = self.weights[name]
        return w[layer] if isinstance(w, list) else w

    def _run(self, launches, views, ctx):
        for launch in launches:
            if "repeat" in launch:
                for i in range(launch["count"]):
                    ctx.layer = i
                    self._run(launch["body"], views, ctx)
                continue
            op = REGISTRY[launch["op"]]
            args = [self._arg(n, views, ctx.layer) for n in launch["inputs"]]
            result = op.reference(ctx, *args, **launch["attrs"])
            results = result if isinstance(result, tuple) else (result,)
            for name, r in zip(launch["outputs"], results):
                if name == KV or r is None:
                    continue
                np.copyto(views[name], np.asarray(r).reshape(views[name].shape), casting="unsafe")

    def allocate_pages(self, num_pages: int, page_size: int):
        kv = self.plan["kv_cache"]
        shape = (num_pages, page_size, kv["kv_heads"], kv["head_dim"])
        self.k_pages = [np.zeros(shape, np.float32) for _ in range(kv["layers"])]
        self.v_pages = [np.zeros(shape, np.float32) for _ in range(kv["layers"])]

    def step_paged(self, meta) -> np.ndarray:
        """One step over a runtime.step.StepMeta, KV in the paged cache (allocate_pages first)."""
        ctx = PagedStepContext(meta, self.k_pages, self.v_pages)
        views = self._arena(ctx)
        views["tokens"][...] = meta.tokens
        self._run(self.plan["programs"][meta.phase], views, ctx)
        return np.array(views[self.plan["outputs"]["logits"]])

    def step(self, chunks: list[SeqChunk]) -> np.ndarray:
        """Run one step over the chunks; returns float32 logits [B, V] (one row per chunk)."""
        ctx = StepContext(chunks, self.kv)
        views = self._arena(ctx)
        views["tokens"][...] = np.concatenate([np.asarray(c.tokens, np.int32) for c in chunks])
        if all(c.start == 0 for c in chunks):
            phase = "prefill"
        elif all(len(c.tokens) == 1 for c in chunks):
            phase = "decode"
        else:
            phase = "mixed"
        self._run(self.plan["programs"][phase], views, ctx)
        return np.array(views[self.plan["outputs"]["logits"]])
