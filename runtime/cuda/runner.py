"""The CUDA runner: a compiled plan on the GPU behind the engine's runner interface.

Memory: weights, one activation arena sized for max_num_batched_tokens / max_num_seqs, the
step metadata buffers, per-kernel scratch, and the paged KV cache from what
gpu_memory_utilization leaves. Buffers sit at the plan's offsets evaluated at the maximum T and
B, so every pointer is fixed for the runner's life: each phase's launches are packed once and a
step only rewrites the T/B scalars and the grid. Decode steps replay a CUDA Graph captured per
batch bucket, padded with rows that write only a reserved page.
"""
from pathlib import Path

import numpy as np

from ..bind import launch_args, scratch_sizes
from ..runner import RowSampling, Sample, sample_row
from ..step import StepMeta
from .artifact import DTYPE_BYTES, load_kernels, load_plan
from .driver import Context, Graph, PackedArgs, launch
from .sampler import GpuSampler
from .weights import DeviceWeights

META_NAMES = ("positions", "seq_starts", "context_lens", "last_rows", "slot_mapping", "block_tables")


GRID_FUNCS = {"cdiv": lambda a, b: -(-a // b), "max": max, "min": min}


def grid_code(meta: dict) -> list:
    g = list(meta["grid"]) + [1] * (3 - len(meta["grid"]))
    return [compile(str(e), "<grid>", "eval") for e in g]


def default_buckets(max_seqs: int) -> list[int]:
    b = [1, 2, 4, 8] + list(range(16, 257, 8))
    return [x for x in b if x <= max_seqs] or [max_seqs]


class CudaRunner:
    def __init__(self, artifact: str | Path, model_dir: str | Path, max_num_batched_tokens: int = 8192,
                 max_num_seqs: int = 256, max_model_len: int | None = None,
                 gpu_memory_utilization: float = 0.9, cuda_graphs: bool = True,
                 buckets: list[int] | None = None, num_pages: int | None = None):
        self.ctx = Context()
        self.artifact = Path(artifact)
        self.plan = plan = load_plan(self.artifact)
        self.page_size = plan["build"]["page_size"]
        self.vocab_size = plan["config"]["V"]
        self.max_tokens = max(max_num_batched_tokens, max_num_seqs)
        self.max_seqs = max_num_seqs
        self.max_model_len = min(max_model_len or plan["config"]["max_len"], plan["config"]["max_len"])
        self.max_pages_per_seq = -(-self.max_model_len // self.page_size)
        self.kernels = load_kernels(self.artifact, plan)
        self.weights = DeviceWeights(self.ctx, plan, Path(model_dir))
        dims = {"T": self.max_tokens, "B": self.max_seqs}
        a = plan["arena"]
        self.arena_bytes = a["bytes_per_token"] * dims["T"] + a["bytes_per_seq"] * dims["B"] + a["bytes"]
        self.arena = self.ctx.alloc(self.arena_bytes)
        self.meta = {n: self.ctx.alloc(4 * self._meta_len(n)) for n in META_NAMES}
        self.scratch = {}
        for kid, k in self.kernels.items():
            for name, nbytes in scratch_sizes(k.meta, dims).items():
                ptr = self.ctx.alloc(nbytes)
                self.ctx.memset(ptr, nbytes)
                self.scratch[(kid, name)] = ptr
        self._alloc_kv(gpu_memory_utilization, num_pages)
        self._logits_host = None                    # pinned on first `logits()` (tests, tools)
        self.sampler = (GpuSampler(self.ctx, self.kernels, plan["sampler"], self.max_seqs, self.vocab_size)
                        if plan.get("sampler") else None)
        self.ctx.sync()
        self.place = dims                          # where buffers live: fixed for every step
        self.programs = {}                         # phase -> packed launches (bound once)
        self.graphs: dict[int, tuple] = {}
        self.buckets = sorted(buckets or default_buckets(self.max_seqs))
        if cuda_graphs:
            for b in self.buckets:
                self._capture(b)

    # -- memory ---------------------------------------------------------------------------
    def _meta_len(self, name: str) -> int:
        if name == "block_tables":
            return (self.max_seqs + 1) * (self.max_pages_per_seq + 1)
        return (self.max_seqs + 1) if name in ("seq_starts", "context_lens", "last_rows") else self.max_tokens

    def _alloc_kv(self, utilization: float, num_pages: int | None):
        kv = self.plan["kv_cache"]
        self.kv_layers = kv["layers"]
        page_bytes = self.page_size * kv["kv_heads"] * kv["head_dim"] * DTYPE_BYTES[kv["dtype"]]
        free, total = self.ctx.mem_info()
        if num_pages is None:
            budget = int(total * utilization) - (total - free)
            num_pages = budget // (2 * self.kv_layers * page_bytes) - 1
        if num_pages < 2:
            raise MemoryError(f"no room for the KV cache: {free / 2**30:.1f} GiB free of {total / 2**30:.1f}")
        self.num_pages = num_pages                 # usable pages; page num_pages is the padding page
        self.page_bytes = page_bytes
        self.kv_layer_bytes = (num_pages + 1) * page_bytes
        self.kv = self.ctx.alloc(2 * self.kv_layers * self.kv_layer_bytes)

    def kv_ptr(self, which: str, layer: int) -> int:
        return self.kv + (2 * layer + (0 if which == "k" else 1)) * self.kv_layer_bytes

    # -- binding --------------------------------------------------------------------------
    def _buffer_ptr(self, name: str, dims: dict | None = None) -> int:
        off = self.plan["buffers"][name]["offset"]
        return self.arena + off["T"] * self.place["T"] + off["B"] * self.place["B"] + off["bytes"]

    @property
    def logits_device(self) -> int:
        """The logits output (f32 [B, V]) on the device: fixed, like every buffer."""
        return self._buffer_ptr(self.plan["outputs"]["logits"])

    def program(self, phase: str) -> list:
        if phase not in self.programs:
            self.programs[phase] = self.bind(phase)
        return self.programs[phase]

    def bind(self, phase: str, dims: dict | None = None) -> list:
        """The phase's program as [(KernelFn, grid code, PackedArgs, dim slots)], layers unrolled."""
        out = []

        def visit(program, layer):
            for l in program:
                if "repeat" in l:
                    for i in range(l["count"]):
                        visit(l["body"], i)
                    continue
                k = self.kernels[l["kernel_id"]]

                def tensor(name):
                    if name in self.plan["buffers"]:
                        return self._buffer_ptr(name, dims)
                    p = self.weights.ptrs[name]
                    return p[layer] if isinstance(p, list) else p

                def resolve(kind, what, ty):
                    if kind in ("in", "out"):
                        names = l["inputs"] if kind == "in" else l["outputs"]
                        return tensor(names[int(what)])
                    if kind == "dim":
                        return 0                        # rewritten each step
                    if kind == "meta":
                        return self.max_pages_per_seq + 1 if what == "max_pages" else self.meta[what]
                    if kind == "kv":
                        return self.kv_ptr(what, layer)
                    if kind == "scratch":
                        return self.scratch[(k.id, what)]
                    raise ValueError(kind)

                values = launch_args(k.meta, resolve)
                types = [ty for _, ty, _ in k.meta["params"]]
                slots = [(i, src[4:]) for i, (_, _, src) in enumerate(k.meta["params"]) if src.startswith("dim:")]
                values += [0] * k.hidden_args          # Triton's global/profile scratch pointers
                types += ["*i8"] * k.hidden_args
                if k.global_scratch:
                    raise RuntimeError(f"kernel {k.id} needs Triton global scratch: not supported yet")
                out.append((k, grid_code(k.meta), PackedArgs(values, types), slots))

        visit(self.plan["programs"][phase], 0)
        return out

    def _launch_all(self, bound, dims: dict):
        env = {**GRID_FUNCS, **dims}
        for k, code, args, slots in bound:
            for i, d in slots:
                args.set(i, dims[d])
            g = [int(eval(c, env)) for c in code]       # META grid formulas of our own templates
            if g[0] * g[1] * g[2] == 0:
                continue
            launch(self.ctx, k.fn, g, k.block, k.shared, args)

    def _capture(self, bucket: int):
        """Warm the bucket's decode program up on padding rows, then capture it."""
        dims = {"T": bucket, "B": bucket}
        bound = self.program("decode")
        z = np.zeros(0, np.int32)
        empty = StepMeta(0, 0, "decode", z, z, np.zeros(1, np.int32), z, z, z,
                         np.zeros((0, 1), np.int32), 1)
        self._upload(self._metadata(empty, bucket, bucket), dims)
        self._launch_all(bound, dims)
        self.ctx.sync()
        # the graph keeps the argument values of capture time: the packed args can move on
        graph = Graph(self.ctx, lambda: self._launch_all(bound, dims))
        self.graphs[bucket] = (graph, dims)

    # -- a step ---------------------------------------------------------------------------
    def _upload(self, arrays: dict, dims: dict) -> list:
        arrays = dict(arrays)
        keep = [self.ctx.htod(self._buffer_ptr("tokens", dims), arrays.pop("tokens"))]
        keep += [self.ctx.htod(self.meta[n], a) for n, a in arrays.items()]
        return keep

    def _metadata(self, meta: StepMeta, T: int, B: int) -> dict:
        """Host arrays for a step padded to T tokens / B sequences (pad rows use the spare page)."""
        pad_t, pad_b = T - meta.T, B - meta.B
        assert pad_t == pad_b and pad_t >= 0
        spare = self.num_pages
        width = self.max_pages_per_seq + 1
        bt = np.full((B, width), spare, np.int32)
        bt[: meta.B, : meta.block_tables.shape[1]] = meta.block_tables
        arr = {
            "tokens": np.concatenate([meta.tokens, np.zeros(pad_t, np.int32)]),
            "positions": np.concatenate([meta.positions, np.zeros(pad_t, np.int32)]),
            "seq_starts": np.concatenate([meta.seq_starts, meta.T + np.arange(1, pad_b + 1, dtype=np.int32)]),
            "context_lens": np.concatenate([meta.context_lens, np.ones(pad_b, np.int32)]),
            "last_rows": np.concatenate([meta.last_rows, meta.T + np.arange(pad_b, dtype=np.int32)]),
            "slot_mapping": np.concatenate([meta.slot_mapping, np.full(pad_t, spare * self.page_size, np.int32)]),
            "block_tables": bt,
        }
        return {k: v.astype(np.int32) for k, v in arr.items()}

    def _run_step(self, meta: StepMeta) -> tuple[int, int]:
        self.ctx.ensure_current()
        if meta.phase == "decode" and self.graphs and meta.B <= self.buckets[-1]:
            bucket = next(b for b in self.buckets if b >= meta.B)
            T = B = bucket
        else:
            T, B = meta.T, meta.B
        dims = {"T": T, "B": B}
        keep = self._upload(self._metadata(meta, T, B), dims)
        if meta.phase == "decode" and T in self.graphs:
            self.graphs[T][0].launch()
        else:
            self._launch_all(self.program(meta.phase), dims)
        self._keep = keep
        return T, B

    def logits(self, meta: StepMeta) -> np.ndarray:
        """Run a step and copy its logits to the host (f32 [B, V])."""
        T, B = self._run_step(meta)
        if self._logits_host is None:
            self._logits_host = self.ctx.pinned(4 * self.max_seqs * self.vocab_size).view(np.float32)
        out = self._logits_host[: meta.B * self.vocab_size].reshape(meta.B, self.vocab_size)
        name = self.plan["outputs"]["logits"]
        self.ctx.dtoh(out, self._buffer_ptr(name, {"T": T, "B": B}))
        self.ctx.sync()
        return out

    def execute(self, meta: StepMeta, sampling: list[RowSampling | None]) -> list[Sample | None]:
        if self.sampler is not None:
            self._run_step(meta)
            return self.sampler.sample(self.logits_device, list(sampling[: meta.B]))
        logits = self.logits(meta)                  # an artifact built before the sampler kernels
        return [None if s is None else sample_row(logits[b], s) for b, s in enumerate(sampling)]
