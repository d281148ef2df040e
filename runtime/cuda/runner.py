"""The CUDA runner: a compiled plan on the GPU behind the engine's runner interface.

Memory: weights, one activation arena sized for max_num_batched_tokens / max_num_seqs, the
step metadata buffers (plan["step_metadata"]), per-kernel scratch, and the plan's caches
(compiler/contract/caches.py lays them out) from what gpu_memory_utilization leaves. Buffers sit at the plan's offsets evaluated at the maximum T and
B, so every pointer is fixed for the runner's life: each phase's launches are packed once and a
step only rewrites the T/B scalars and the grid. Decode steps replay a CUDA Graph captured per
batch bucket, padded with rows that write only a reserved page. A plan's load program
(plan["programs"]["load"]: its derived weights) runs once before the first step: before the
graphs are captured, or after under INFC_LOAD_OVERLAP (the checkpoint streams in meanwhile:
the graphs keep the weights' addresses, not their values).
"""
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from infc import envs
from infc.compiler.contract import caches
from infc.compiler.contract.bind import Resolver, dim_slots, eval_int, scratch_sizes, step_dims
from infc.compiler.contract.program import launches, program_name, unrolled
from infc.compiler.contract.schema import plan_max_len
from ..engine.prompt_logprobs import rows_to_score, score_block
from ..engine.runner import RowSampling, Sample, sample_row
from ..engine.step import StepMeta
from ..lora.groups import lora_groups, num_slots as lora_num_slots
from infc.compiler.contract.errors import ModelDirError
from infc.compiler.contract.safe_eval import ExprLimit, compile_int
from infc.compiler.contract.schema import DTYPE_BYTES
from infc.compiler.contract.weight_roles import FILL_KINDS, fill_key
from .artifact import load_kernels, load_plan
from .block_copy_args import pair_runs
from .collective_clock import CollectiveClock, enabled as collective_clock_enabled
from .collectives import bind_collective
from .driver import Context, DependentLaunch, Graph, launch
from .plan_io import StepOutputs, input_arrays, row_bytes, step_inputs
from .sampler import GpuSampler, SamplerPending
from .staging import Staging
from .weights import DeviceWeights

# the step metadata this runner builds from a StepMeta (`_metadata`); the plan's step_metadata
# must be among them
# (state_slots only for a plan with slot caches, lora_slots / lora_rows / lora_segs for a LoRA
# plan: its step_metadata names them)
PRODUCED = ("positions", "seq_starts", "context_lens", "last_rows", "slot_mapping", "block_tables",
            "state_slots", "lora_slots", "lora_rows", "lora_segs")


def grid_code(meta: dict) -> list:
    """The launch grid as three compiled formulas, each fn(dims) -> int: integer arithmetic over
    the step's dims only (compiler/contract/safe_eval.py), so a tampered plan.json cannot run code. Raises
    ExprLimit (a ValueError) for anything else."""
    g = list(meta["grid"]) + [1] * (3 - len(meta["grid"]))
    return [compile_int(e) for e in g]


def grid_codes(plan: dict, artifact) -> dict:
    """kernel id -> grid_code, every grid of the plan checked before anything is loaded."""
    out = {}
    for kid, meta in plan["kernels"].items():
        try:
            out[kid] = grid_code(meta)
        except (ExprLimit, KeyError, TypeError) as e:
            raise ModelDirError(f"{Path(artifact) / 'plan.json'}: kernel {kid}: launch grid "
                                f"{meta.get('grid')!r} refused: {e}") from None
    return out


def padding_step() -> StepMeta:
    """A decode step with no sequences: the metadata a graph is warmed up and captured on (every
    row a padding row, writing only the spare page)."""
    z = np.zeros(0, np.int32)
    return StepMeta(0, 0, "decode", z, z, np.zeros(1, np.int32), z, z, z, np.zeros((0, 1), np.int32), 1)


def step_shape(meta: StepMeta, buckets: list[int], graphs: dict) -> tuple[int, int]:
    """(T, B) a step runs at: a decode step that a captured bucket holds is padded to it."""
    if meta.phase == "decode" and graphs and meta.B <= buckets[-1]:
        bucket = next(b for b in buckets if b >= meta.B)
        return bucket, bucket
    return meta.T, meta.B


# the events CudaRunner.step_marks records inside a step, and the parts of the step between them
MARKS = ("uploaded", "forward", "sampling")
PARTS = ("upload", "forward", "host_wait", "sample")


@dataclass
class InFlight:
    """A step issued by CudaRunner.launch whose samples have not been read back yet."""
    meta: StepMeta
    sampled: SamplerPending | None      # None: no row of the step samples
    start: object                       # events around the step on the stream
    end: object
    T: int = 0                          # the step's token bucket (its programs' T)
    marks: dict | None = None           # CudaRunner.step_marks: events inside the step (MARKS)

    def gpu_ms(self) -> float:
        """The step's time on the stream, from its first upload to its sampled tokens' arrival."""
        return self.end.ms_since(self.start)

    def parts_ms(self) -> dict | None:
        """With marks: the step's time on the stream by part (they add up to gpu_ms): its uploads
        and fed tokens, its program, the stream's wait for the host to issue the sampling (an
        overlapped step's deferred sampling), and the sampling with what it sends the host."""
        if self.marks is None:
            return None
        at = [self.start] + [self.marks[m] for m in MARKS] + [self.end]
        return {part: b.ms_since(a) for part, a, b in zip(PARTS, at, at[1:])}


def ab_programs(plan: dict) -> dict:
    """The plan less the programs INFC_WIDE=0 / INFC_NARROW=0 turn off (A/B timing: their steps
    on the decode program). The verify program is the narrow launches k + 1 rows wide: it goes
    with them."""
    for name, drop in (("wide", {"wide"}), ("narrow", {"narrow", "verify"})):
        if not envs.value(f"INFC_{name.upper()}") and drop & set(plan["programs"]):
            if name == "wide" and any(l.get("lora") and l["lora"].get("shrink") != "apart"
                                      for l, _ in launches(plan["programs"].get("decode", []))):
                # its LoRA sites' scratch holds the rows below the wide program's (render.row_cap)
                raise ValueError("INFC_WIDE=0 runs every decode step on the decode program, whose LoRA "
                                 f"sites take at most {plan['wide_tokens'] - 1} rows: rebuild with "
                                 "infc/config.py LORA_DECODE_SITES = False (the default) to time it")
            plan = dict(plan, programs={p: v for p, v in plan["programs"].items() if p not in drop})
    return plan


def default_buckets(max_seqs: int, plan: dict | None = None) -> list[int]:
    """The decode steps' graph buckets. A speculative plan's verify program (verify(k) at batch 1:
    k + 1 rows, compiler/contract/program.py program_name) gets a bucket of its width, where the
    next power of two (8 for k = 4) would pad the step past it onto the decode program."""
    b = [1, 2, 4, 8] + list(range(16, 257, 8))
    if plan is not None and "verify" in plan["programs"]:
        b = sorted(set(b) | {plan["verify_tokens"]})
    return [x for x in b if x <= max_seqs] or [max_seqs]


class CudaRunner:
    def __init__(self, artifact: str | Path, model_dir: str | Path, max_num_batched_tokens: int = 8192,
                 max_num_seqs: int = 256, max_model_len: int | None = None,
                 gpu_memory_utilization: float = 0.9, cuda_graphs: bool = True,
                 buckets: list[int] | None = None, num_pages: int | None = None,
                 load_format: str = "auto", pdl: bool | None = None, ctx: Context | None = None,
                 plan: dict | None = None, collectives=None, agree_num_pages=None,
                 num_state_snapshots: int | None = None, defer_cache: bool = False,
                 shared_weights: dict | None = None):
        """load_format: "auto" reads model_dir's safetensors; "dummy" fills random weights on the
        device (runtime/weights/dummy.py), so model_dir needs only config.json.
        pdl: launch the kernels whose META allows it as programmatic dependents of the kernel
        before them (driver.DependentLaunch); default on, INFC_PDL=0 turns it off (A/B timing).
        INFC_WIDE=0 / INFC_NARROW=0 run wide / narrow (and verify) decode steps on the decode
        program (A/B timing: the narrow program's merged launches against the decode program's).
        A rank of a parallel artifact (runtime/cuda/ranks.py): `plan` (its plan.rank<r>.json),
        `collectives` (runtime/cuda/collectives.py: NCCL, or device copies between the runners
        of one process, which then share `ctx`). agree_num_pages(n) -> the page count every rank
        uses: one process per GPU sizes its cache from its own free memory, which differs by a few
        MB between GPUs, while every rank must hold the same page ids (nccl_runner: the minimum).
        num_state_snapshots: a plan with slot caches keeps a pool of that many state snapshots
        for prefix caching (state_copies.py; None: max_num_seqs; 0: none), taken from the KV
        cache's memory.
        defer_cache: load the weights, arena and scratch only; `start_cache(num_pages)` then
        allocates the caches, the sampler and captures the graphs. Two runners of one process
        (a draft model beside its target, infc/backend.py) load both first, then split what
        `cache_budget()` says is left between their caches.
        shared_weights: weight name -> a device pointer of another runner of this process, used
        instead of a copy of its own (an EAGLE-3 head's embedding table is its target's).
        Plan step inputs besides the tokens (StepMeta.inputs) are uploaded with each step, and
        the plan's outputs besides the logits are read back on request (`outputs()`, plan_io.py)."""
        self._snapshots_asked = num_state_snapshots
        self.pdl = envs.value("INFC_PDL") if pdl is None else pdl
        self.ctx = ctx if ctx is not None else Context()
        self.artifact = Path(artifact)
        plan = plan if plan is not None else load_plan(self.artifact)
        self.plan = plan = ab_programs(plan)
        self.collectives = collectives
        # INFC_COLLECTIVE_CLOCK=1: each collective's time on this rank's stream (collective_clock.py)
        self.collective_clock = (CollectiveClock(self.ctx) if collectives is not None
                                 and collective_clock_enabled() else None)
        self.page_size = plan["build"]["page_size"]
        self.vocab_size = plan["config"]["V"]
        self.max_tokens = max(max_num_batched_tokens, max_num_seqs)
        self.max_seqs = max_num_seqs
        longest = plan_max_len(plan)
        self.max_model_len = min(max_model_len or longest, longest)
        self.max_pages_per_seq = -(-self.max_model_len // self.page_size)
        self.grids = grid_codes(plan, self.artifact)
        self.kernels = load_kernels(self.artifact, plan)
        # the fill kernel of each kind the plan has (none in older artifacts)
        fill = {kind: self.kernels.get(plan.get(fill_key(kind))) for kind in FILL_KINDS}
        dims = step_dims(plan, self.max_tokens, self.max_seqs)
        a = plan["arena"]
        self.arena_bytes = a["bytes_per_token"] * dims["T"] + a["bytes_per_seq"] * dims["B"] + a["bytes"]
        self.arena = self.ctx.alloc(self.arena_bytes)
        unknown = sorted(set(plan["step_metadata"]) - set(PRODUCED))
        if unknown:
            raise ValueError(f"the plan's step metadata {unknown} is not built by this runner")
        self.meta = {n: self.ctx.alloc(self._meta_bytes(m)) for n, m in plan["step_metadata"].items()}
        # a step's uploads: tokens, the metadata, the plan's step inputs, the sampler's
        # parameters (and alignment)
        self.inputs = step_inputs(plan)
        self.staging = Staging(self.ctx, 4 * self.max_tokens + sum(map(self._meta_bytes, plan["step_metadata"].values()))
                               + sum(row_bytes(d) * self.max_tokens for d in self.inputs.values())
                               + 32 * (self.max_seqs + 1) + 64 * (24 + len(self.inputs)))
        self._outputs = None                       # the last step's StepOutputs
        self.scratch = {}
        self.global_scratch = {}                   # kernel id -> Triton's global scratch
        for kid, k in self.kernels.items():
            for name, nbytes in scratch_sizes(k.meta, dims).items():
                ptr = self.ctx.alloc(nbytes)
                self.ctx.memset(ptr, nbytes)
                self.scratch[(kid, name)] = ptr
            if k.global_scratch:
                self.global_scratch[kid] = self.ctx.alloc(k.global_scratch_bytes(dims))
        decl = caches.of_plan(plan)
        # one state slot per running sequence (max_num_seqs; the engine hands them out), and slot
        # num_slots the spare that CUDA-graph pad rows write
        self.num_slots = self.max_seqs if caches.has_slots(decl) else 0
        asked = self._snapshots_asked
        self.num_snapshots = (self.max_seqs if asked is None else asked) if self.num_slots else 0
        self._utilization, self._agree = gpu_memory_utilization, agree_num_pages
        self._cuda_graphs, self._bucket_list, self._dims = cuda_graphs, buckets, dims
        # last, so nothing here fails while a background load runs (INFC_LOAD_OVERLAP: the
        # checkpoint streams in while start_cache allocates the caches and captures the graphs,
        # which need the weights' addresses, not their values)
        self.weights = DeviceWeights(self.ctx, plan, Path(model_dir), load_format=load_format, fill=fill,
                                     shared=shared_weights, background=envs.value("INFC_LOAD_OVERLAP"))
        self.num_pages = None                      # start_cache sets it
        if not defer_cache:
            try:
                self.start_cache(num_pages)
            except BaseException:
                self.weights.cancel()
                raise

    def cache_budget(self) -> int:
        """The bytes gpu_memory_utilization leaves for caches now: its share of the card less
        what is in use (by this process's runners and any other)."""
        free, total = self.ctx.mem_info()
        return int(total * self._utilization) - (total - free)

    @property
    def cache_slots(self) -> int:
        """Slots the caches' storage holds besides the pages (pages_for_budget's num_slots): the
        sequences' state slots and the snapshot pool (its own allocation; one more for alignment)."""
        return self.num_slots + (self.num_snapshots + 1 if self.num_snapshots else 0)

    def start_cache(self, num_pages: int | None = None):
        """The caches (num_pages, else what cache_budget holds), the sampler, the graphs: the
        rest of the constructor (defer_cache)."""
        if self.num_pages is not None:
            raise RuntimeError("CudaRunner.start_cache: the caches are already allocated")
        self._alloc_kv(num_pages, self._agree)
        plan, dims = self.plan, self._dims
        self._logits_host = None                    # pinned on first `logits()` (tests, tools)
        self._row_tail, self._row_host = None, None  # prompt logprobs' launches and host rows (first use)
        self.sampler = (GpuSampler(self.ctx, self.kernels, plan["sampler"], self.max_seqs, self.vocab_size,
                                   self.staging) if plan.get("sampler") else None)
        self._events = [self.ctx.event() for _ in range(4)]      # start / end of two steps in flight
        # bench throughput --step-series: events inside each step (InFlight.parts_ms), made on
        # first use
        self.step_marks = False
        self._marks: list[dict] | None = None
        self._launched = 0
        self.place = dims                          # where buffers live: fixed for every step
        self.programs = {}                         # phase -> packed launches (bound once)
        background = self.weights.loading
        if not background:
            self._derive_weights(dims)
        self.graphs: dict[int, tuple] = {}
        self.short_graphs: dict[tuple, object] = {}     # (T, B) -> Graph (_short_graph_key)
        self.buckets = sorted(self._bucket_list or default_buckets(self.max_seqs, plan))
        if self._cuda_graphs:
            for b in self.buckets:
                self._capture(b)
        if background:                           # the graphs kept addresses; now the values
            self.weights.wait()
            self._derive_weights(dims)

    def _derive_weights(self, dims: dict):
        """The derived weights (runtime/cuda/weights.py leaves them unwritten), once the others
        are on the device, before any step; never captured, and not kept bound."""
        if "load" in self.plan["programs"]:
            self._launch_all(self.bind("load"), dims)
        self.ctx.sync()

    def close(self, graceful: bool = True):
        """Give back the device memory (weights, arena, caches, scratch, sampler, graphs): a
        process that makes several runners (tests, tools) must not keep them all. Then its
        collectives' own resources (an NCCL communicator; graceful=False: the other ranks are
        gone or failed, so it is aborted rather than destroyed together with theirs). The graphs
        go first: a graph that captured NCCL calls holds a reference on the communicator, which
        NCCL's teardown can wait for. (The first two-GPU runs released the communicator first and
        no close finished within 10 s; in this order every close of the two-GPU tests and
        benchmarks finished, on 2 x H100 and 2 x H200.)"""
        weights = getattr(self, "weights", None)
        if weights is not None:
            weights.cancel()                     # a background load still writing them
        if self.ctx.stream is not None:
            self.ctx.close()
        self.graphs, self.programs, self.short_graphs = {}, {}, {}
        close = getattr(self.collectives, "close", None)
        if close is not None:
            close(graceful)

    # -- memory ---------------------------------------------------------------------------
    def _meta_bytes(self, m: dict) -> int:
        # B + 1 rows: a bucket's pad rows never outnumber max_seqs, but keep one spare
        dims = {"T": self.max_tokens, "B": self.max_seqs + 1, "max_pages": self.max_pages_per_seq + 1}
        n = 1
        for d in m["shape"]:
            n *= eval_int(d, dims)
        return n * DTYPE_BYTES[m["dtype"]]

    def _alloc_kv(self, num_pages: int | None, agree=None):
        decl = caches.of_plan(self.plan)
        free, total = self.ctx.mem_info()
        if num_pages is None:
            num_pages = caches.pages_for_budget(decl, self.page_size, self.cache_budget(), self.cache_slots)
        if agree is not None:
            num_pages = agree(num_pages)
        if num_pages < 2:
            raise MemoryError(f"no room for the KV cache: {free / 2**30:.1f} GiB free of {total / 2**30:.1f}")
        self.num_pages = num_pages                 # usable pages; page num_pages is the padding page
        self.caches = caches.DeviceCaches(self.ctx, decl, self.page_size, num_pages, self.num_slots)
        self._state_copies = None
        if self.num_snapshots:
            from .state_copies import DeviceStateCopies
            self._state_copies = DeviceStateCopies(self.ctx, self.caches, self.num_snapshots,
                                                   self.block_copy_kernel)

    def state_copies(self):
        """The state snapshot pool and its device copies (plans with slot caches; None without)."""
        return self._state_copies

    @property
    def block_copy_kernel(self):
        """The tiers' copy kernel (plan["block_copy"]: a build for the host tier), or None."""
        return self.kernels.get(self.plan.get("block_copy"))

    def kv_copies(self):
        """Pages to and from pinned host blocks on a copy stream, for the KV tiers (kv_copies.py)."""
        from .kv_copies import DeviceCopies
        return DeviceCopies(self.ctx, self.caches, self.block_copy_kernel)

    # -- binding --------------------------------------------------------------------------
    def _buffer_ptr(self, name: str, dims: dict | None = None) -> int:
        # dims is unused: buffers sit at their offsets for the maximum T and B (self.place)
        off = self.plan["buffers"][name]["offset"]
        return self.arena + off["T"] * self.place["T"] + off["B"] * self.place["B"] + off["bytes"]

    @property
    def logits_device(self) -> int:
        """The logits output (f32 [B, V]) on the device: fixed, like every buffer."""
        return self._buffer_ptr(self.plan["outputs"]["logits"])

    def program(self, phase: str) -> list:
        """The bound launches of plan["programs"][phase] ("short" included: program_name picks it)."""
        if phase not in self.programs:
            self.programs[phase] = self.bind(phase)
        return self.programs[phase]

    def bind(self, phase: str) -> list:
        """The phase's program as [(KernelFn, grid code, PackedArgs, dim slots, DependentLaunch or
        None)], layers unrolled; a collective launch is (None, fire(dims), None, (), None)."""
        def tensor(name, layer):
            if name in self.plan["buffers"]:
                return self._buffer_ptr(name)
            return self.weights.ptr(name, layer)

        resolver = Resolver(
            tensor=tensor, cache=self.caches.ptr,
            scale=lambda n, layer: caches.scale(self.caches.layout.caches[n], layer),
            meta=lambda n: self.max_pages_per_seq + 1 if n == "max_pages" else self.meta[n],
            scratch=lambda kid, n: self.scratch[(kid, n)],
            dim=lambda d: 0,                        # rewritten each step
            meta_names=self.plan["step_metadata"])
        out = []
        for launch, layer in unrolled(self.plan["programs"][phase]):
            if launch["backend"] == "nccl":     # between ranks: runtime/cuda/collectives.py issues it
                fire = bind_collective(self, launch, layer)
                if self.collective_clock is not None:
                    fire = self.collective_clock.wrap(launch["op"], fire)
                out.append((None, fire, None, (), None))
                continue
            k = self.kernels[launch["kernel_id"]]
            values = resolver.values(k.meta, launch["inputs"], launch["outputs"], layer, k.id)
            dep = DependentLaunch(self.ctx, k.block, k.shared) if self.pdl and k.meta.get("pdl") else None
            out.append((k, self.grids[k.id], k.pack(values, self.global_scratch.get(k.id, 0)),
                        dim_slots(k.meta), dep))
        return out

    def _launch_all(self, bound, dims: dict, on_launch=None):
        """Launch a bound program at dims. on_launch(index, kernel, fire): a profiler's hook
        around each launch that is not skipped (index into `bound`; the hook must call fire()
        once, e.g. between two event records). None, as everywhere but bench/profile.py: the
        plain loop below, untouched."""
        after_kernel = False     # a dependent launch only behind a kernel, never behind a copy
        for index, k, g, args, dep in self._issued(bound, dims):
            if k is None:                       # a collective: copies or NCCL on the stream
                args(dims)
                after_kernel = False
            elif on_launch is not None:         # plain: the hook's events would cut any overlap
                on_launch(index, k, lambda k=k, g=g, args=args: launch(self.ctx, k.fn, g, k.block, k.shared, args))
            elif dep is not None and after_kernel:
                dep(k.fn, g, args)
                after_kernel = True
            else:
                launch(self.ctx, k.fn, g, k.block, k.shared, args)
                after_kernel = True

    @staticmethod
    def _issued(bound, dims: dict):
        """(index, kernel, grid, args, dependent launch) of each launch to issue at dims, its T/B
        scalars set; launches with an empty grid skipped; a collective as (index, None, None,
        fire, None)."""
        for index, (k, code, args, slots, dep) in enumerate(bound):
            if k is None:
                yield index, None, None, code, None
                continue
            for i, d in slots:
                args.set(i, dims[d])
            g = [f(dims) for f in code]
            if g[0] * g[1] * g[2] != 0:
                yield index, k, g, args, dep

    def _capture(self, bucket: int):
        """Warm the bucket's decode program (the wide one for a wide bucket) up on padding rows,
        then capture it."""
        dims = step_dims(self.plan, bucket, bucket)
        bound = self.program(program_name(self.plan, "decode", bucket))
        self._upload(self._metadata(padding_step(), bucket, bucket), dims)
        self._launch_all(bound, dims)
        self.ctx.sync()
        # the graph keeps the argument values of capture time: the packed args can move on
        graph = Graph(self.ctx, lambda: self._launch_all(bound, dims))
        self.graphs[bucket] = (graph, dims)

    # -- a step ---------------------------------------------------------------------------
    def _upload(self, arrays: dict, dims: dict) -> list:
        """A step's host arrays to their buffers, through page-locked staging (staging.py)."""
        self.staging.begin()
        arrays = {n: self.staging.put(a) for n, a in arrays.items()}
        keep = [self.ctx.htod(self._buffer_ptr("tokens", dims), arrays.pop("tokens"))]
        for name in self.inputs:                   # the plan's step inputs (plan_io.py)
            keep.append(self.ctx.htod(self._buffer_ptr(name, dims), arrays.pop(name)))
        if "block_tables" in arrays:
            # only the columns the step's longest sequence needs: the kernels' row stride stays
            # max_pages (fixed in every bound program and graph), and no kernel reads a page past
            # its sequence's context
            keep.append(self.ctx.htod_rows(self.meta["block_tables"], 4 * (self.max_pages_per_seq + 1),
                                           arrays.pop("block_tables")))
        keep += [self.ctx.htod(self.meta[n], a) for n, a in arrays.items()]
        self.staging.done()
        return keep

    def _metadata(self, meta: StepMeta, T: int, B: int) -> dict:
        """Host arrays for a step padded to T tokens / B sequences (pad rows use the spare page).
        block_tables is [B, the step's widest table]: _upload writes those columns only."""
        pad_t, pad_b = T - meta.T, B - meta.B
        assert pad_t == pad_b and pad_t >= 0
        spare = self.num_pages
        width = max(1, meta.block_tables.shape[1])
        if width > self.max_pages_per_seq + 1:
            raise ValueError(f"a block table of {width} pages is wider than max_model_len allows "
                             f"({self.max_pages_per_seq} pages)")
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
        if "state_slots" in self.meta:              # pad rows use the spare slot
            slots = meta.state_slots if meta.state_slots is not None else np.zeros(meta.B, np.int32)
            arr["state_slots"] = np.concatenate([slots, np.full(pad_b, self.num_slots, np.int32)])
        if "lora_slots" in self.meta:               # pad rows: no adapter
            lora = meta.lora_slots if meta.lora_slots is not None else np.zeros(meta.T, np.int32)
            arr["lora_slots"] = np.concatenate([lora, np.zeros(pad_t, np.int32)])
            arr["lora_rows"], arr["lora_segs"] = lora_groups(arr["lora_slots"], lora_num_slots(self.plan))
        arr = {k: v if v.dtype == np.int32 else v.astype(np.int32) for k, v in arr.items()}
        if self.inputs:                             # the plan's step inputs, padding rows zero
            arr.update(input_arrays(self.plan, meta.inputs, T, meta.T))
        return arr

    def _run_step(self, meta: StepMeta, feed=(), marks: dict | None = None) -> tuple[int, int]:
        """feed: (row, prev_row) pairs, see launch; marks: InFlight.marks to record."""
        self.ctx.ensure_current()
        T, B = step_shape(meta, self.buckets, self.graphs)
        dims = step_dims(self.plan, T, B)
        keep = self._upload(self._metadata(meta, T, B), dims)
        if feed:
            tokens, sampled = self._buffer_ptr("tokens", dims), self.sampler.dev["token"]
            for row, prev, n in pair_runs(sorted(feed)):     # after the upload, in stream order
                self.ctx.dtod(tokens + 4 * row, sampled + 4 * prev, 4 * n)
        if marks is not None:
            marks["uploaded"].record()
        if meta.phase == "decode" and T in self.graphs:
            self.graphs[T][0].launch()
        else:
            name = program_name(self.plan, meta.phase, T)
            key = self._short_graph_key(name, T, B, meta)
            if key in self.short_graphs:
                self.short_graphs[key].launch()
            else:
                if self.collective_clock is not None:
                    self.collective_clock.phase = name
                self._launch_all(self.program(name), dims)
                if self.collective_clock is not None:
                    self.collective_clock.phase = None
                if key is not None:              # every kernel of it launched once: capture it
                    self.short_graphs[key] = Graph(self.ctx, lambda: self._launch_all(self.program(name), dims))
        if marks is not None:
            marks["forward"].record()
        self._keep = keep
        self._outputs = StepOutputs(self, {"T": meta.T, "B": meta.B})
        return T, B

    def _short_graph_key(self, name: str, T: int, B: int, meta: StepMeta):
        """(T, B) when a step of the short program is replayed from a CUDA Graph (INFC_SHORT_GRAPHS:
        one sequence's few new tokens, a prefix hit's step: its ~300 launches cost ~2 ms of host
        Python eagerly, shared with the server's event loop), captured the first time it runs
        eagerly; None otherwise. Its grids and scalars depend on T and B only, every other input
        is in the fixed metadata buffers. Not with collectives (the ranks would have to capture
        together) or LoRA (its tables' segments vary by step). INFC_SHORT_GRAPHS_BY_CONTEXT adds
        the context's power of two to the key: a graph a context range (an H100 replayed 16k hits
        ~1 ms slower from a graph captured during 1k hits than from one captured at 16k, cause
        not found: the A/B that says whether the capture's context is it)."""
        if (name != "short" or B != 1 or not self._cuda_graphs or self.collectives is not None
                or "lora_slots" in self.meta or not envs.value("INFC_SHORT_GRAPHS")):
            return None
        if envs.value("INFC_SHORT_GRAPHS_BY_CONTEXT"):
            return T, B, int(max(meta.context_lens[: meta.B])).bit_length()
        return T, B

    def logits(self, meta: StepMeta) -> np.ndarray:
        """Run a step and copy its logits to the host (f32 [B, V])."""
        T, B = self._run_step(meta)
        name = self.plan["outputs"]["logits"]
        width = int(self.plan["buffers"][name]["shape"][1])     # V; a head's draft vocabulary
        if self._logits_host is None:
            self._logits_host = self.ctx.pinned(4 * self.max_seqs * width).view(np.float32)
        out = self._logits_host[: meta.B * width].reshape(meta.B, width)
        self.ctx.dtoh(out, self._buffer_ptr(name, step_dims(self.plan, T, B)))
        self.ctx.sync()
        return out

    def execute(self, meta: StepMeta, sampling: list[RowSampling | None]) -> list[Sample | None]:
        if self.sampler is not None:
            T, _ = self._run_step(meta)
            samples = self.sampler.sample(self.logits_device, list(sampling[: meta.B]))
        else:
            logits = self.logits(meta)              # an artifact built before the sampler kernels
            T = step_shape(meta, self.buckets, self.graphs)[0]
            samples = [None if s is None else sample_row(logits[b], s) for b, s in enumerate(sampling)]
        self._score_rows(meta, T)
        return samples

    def outputs(self) -> StepOutputs:
        """The last step's plan outputs besides the logits, name -> float32 rows, each copied back
        when first asked for (plan_io.py): a speculation head's hidden states."""
        if self._outputs is None:
            raise RuntimeError("CudaRunner.outputs: no step has run yet")
        return self._outputs

    def lora_put(self):
        """The writer of the plan's LoRA tables (runtime/lora/tables.py) on the device."""
        from .lora_tables import device_put
        return device_put(self.ctx, self.plan, self.weights)

    # -- prompt logprobs: the plan's logits tail re-run at the prompt rows -----------------------
    @property
    def row_logits(self) -> bool:
        """Whether steps can score prompt rows (meta.scores): the plan names its logits tail
        (compiler/passes/row_logits.py). One process's runner only (ranks: not yet)."""
        return "row_logits" in self.plan and self.collectives is None

    def _score_rows(self, meta: StepMeta, T: int):
        """Fill meta.scores' entries (engine/prompt_logprobs.py): after the step (its logits
        sampled or read, in stream order), the tail launches again with last_rows = the rows to
        score, at most max_seqs at a time (the logits buffer's rows), each block read back and
        scored on the host. The tail's per-token inputs are live to the end of every program."""
        if not (meta.scores and any(meta.scores)):
            return
        rows, owners = rows_to_score(meta.scores, meta.seq_starts)
        if self._row_tail is None:
            names = set(self.plan["row_logits"]["tail"])
            bound = self.program("prefill")
            self._row_tail = [bound[i] for i, (launch, layer) in enumerate(unrolled(self.plan["programs"]["prefill"]))
                              if layer is None and launch["outputs"][0] in names]
            self._row_host = self.ctx.pinned(4 * self.max_seqs * self.vocab_size).view(np.float32)
        for at in range(0, len(rows), self.max_seqs):
            block = np.asarray(rows[at:at + self.max_seqs], np.int32)
            keep = self.ctx.htod(self.meta["last_rows"], block)
            self._launch_all(self._row_tail, step_dims(self.plan, T, len(block)))
            out = self._row_host[: len(block) * self.vocab_size].reshape(len(block), self.vocab_size)
            self.ctx.dtoh(out, self.logits_device)
            self.ctx.sync()
            del keep
            score_block(out, owners[at:at + len(block)])

    # -- overlapped steps (engine.Engine with overlap): issue now, read the samples later ---------
    @property
    def can_overlap(self) -> bool:
        """One GPU with the sampler kernels. (Ranks run each step in lockstep: rank 0 broadcasts it
        and waits; an artifact without sampler kernels samples on the host.)"""
        return self.sampler is not None and self.collectives is None

    def launch(self, meta: StepMeta, sampling: list[RowSampling | None], feed=()) -> InFlight:
        """Issue a step and its sampling without waiting for either. feed: (row, prev_row) pairs,
        token `row` of this step being the token that the step launched before this one samples
        in its row `prev_row` (the engine schedules a sequence's next token before it has read
        the last one back): copied on the device, after this step's upload. At most two steps are
        in flight: collect the one before the last before launching (staging and the sampled
        tokens' host buffer alternate between two)."""
        step = self.launch_forward(meta, feed)
        self.launch_sampling(step, sampling)
        return step

    @property
    def can_defer_sampling(self) -> bool:
        return self.sampler is not None

    def launch_forward(self, meta: StepMeta, feed=()) -> InFlight:
        """Issue a step (as launch) without its sampling: the logits wait on the device until
        launch_sampling issues it, with rows' masks computed meanwhile (grammars: the masks need
        the tokens of the step launched before, read back after this launch)."""
        parity = self._launched % 2
        start, end = self._events[2 * parity: 2 * parity + 2]
        self._launched += 1
        marks = None
        if self.step_marks:
            if self._marks is None:
                self._marks = [{m: self.ctx.event() for m in MARKS} for _ in range(2)]
            marks = self._marks[parity]
        start.record()
        T, _ = self._run_step(meta, feed, marks)
        return InFlight(meta, None, start, end, T, marks)

    def launch_sampling(self, step: InFlight, sampling: list[RowSampling | None]):
        """Issue the sampling of a step from launch_forward (its rows' bitmasks set), then the
        scoring of its prompt rows (after the sampler's reads of the logits, in stream order)."""
        if step.marks is not None:
            step.marks["sampling"].record()
        step.sampled = self.sampler.start(self.logits_device, list(sampling[: step.meta.B]))
        self._score_rows(step.meta, step.T)
        step.end.record()

    def collect(self, step: InFlight) -> list[Sample | None]:
        """The samples of a launched step, once it has finished (waits for it, not for later ones)."""
        step.end.wait()
        if step.sampled is None:
            return [None] * step.meta.B
        return self.sampler.finish(step.sampled)
