"""The numpy reference executor: runs a plan's launches in float32, one op reference each.

It is the oracle for kernels and passes and the CPU backend. It deliberately executes the plan
as the GPU runtime will: every buffer is a view into one arena at the plan's offsets, so a
wrong liveness plan corrupts logits here first. The KV cache is contiguous per sequence.
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


class ReferenceExecutor:
    def __init__(self, plan: dict, weights: dict):
        self.plan = plan
        self.weights = weights
        self.kv: dict = {}
        self.ops = {}

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

    def _arg(self, name, views, layer, per_layer):
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
            args = [self._arg(n, views, ctx.layer, True) for n in launch["inputs"]]
            result = op.reference(ctx, *args, **launch["attrs"])
            results = result if isinstance(result, tuple) else (result,)
            for name, r in zip(launch["outputs"], results):
                if name == KV or r is None:
                    continue
                np.copyto(views[name], np.asarray(r).reshape(views[name].shape), casting="unsafe")

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
