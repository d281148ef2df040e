"""The numpy reference executor: runs a plan's launches in float32, one op reference each.

It is the oracle for kernels and passes and the CPU backend. It deliberately executes the plan
as the GPU runtime will: every buffer is a view into one arena at the plan's offsets, so a
wrong liveness plan corrupts logits here first, and its caches are paged like the GPU's
(compiler/contract/caches.py lays them out, float32 here), addressed through the same step metadata (slot
mapping, block tables). `step_paged` takes the engine's metadata (its pages; prefix pages shared
on the CPU as on the GPU); `step(chunks)`, the oracle API of the tests, keeps its own pages per
seq_id (`SeqPages`) so a caller only names sequences and how many tokens they have cached.
"""
import numpy as np

from infc.config import DEFAULT_PAGE_SIZE
from infc.compiler.ops import REGISTRY

from infc.compiler.contract import caches as cache_layout
from infc.compiler.contract.bind import CACHE_MARKER
from infc.compiler.contract.program import program_name, unrolled
from infc.compiler.contract.schema import DTYPE_BYTES
from ..engine.step import Chunk, StepMeta, build_step
from ..weights.load import at

# The arena is laid out in the plan's dtypes (bf16 = 2 bytes); float32 here needs twice that, and
# four times a plan's one-byte buffers (fp8 activation codes: compiler/passes/act_codes.py).
SCALE = 2
SeqChunk = Chunk          # the oracle's chunk: (seq_id, new tokens, tokens already cached)
METADATA = ("positions", "seq_starts", "context_lens", "last_rows", "slot_mapping", "block_tables",
            "state_slots", "lora_slots")
# state slots the oracle (SeqPages) gives sequences of plans with slot caches: one per seq_id
# until it is freed
ORACLE_SLOTS = 64
# rows of row logits computed at once: a block's float32 [ROW_BLOCK, V] logits are in memory,
# not a 2048-token prefill's (400 MB at V = 49152)
ROW_BLOCK = 128


class Metadata(dict):
    """The step's metadata arrays, by key or attribute: ctx.meta["slot_mapping"] or
    ctx.meta.slot_mapping."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def launch_results(ctx, launch: dict, args: list) -> tuple:
    """A launch's outputs by its op's reference, in launch["outputs"] order. A merged launch
    (compiler/passes/merge_prologues.py) runs its producer's reference first: the consumer reads
    the producer's output number launch["prologue"]["output"] as its input number
    launch["prologue"].get("feeds", 0), and the producer's other outputs come first. A LoRA site in
    the linear's launch (launch["lora"]) takes the tables A, B, scale last and runs the shrink and
    expand references after the linear's. A merged epilogue (launch["epilogue"]) runs its consumer's
    reference on the launch's output number epilogue["output"], its outputs last. An op whose
    outputs only kernels read (OpDef.unread) writes nothing: None for each."""
    if REGISTRY[launch["op"]].unread:
        return (None,) * len(launch["outputs"])
    pro = launch.get("prologue")
    lora = launch.get("lora")
    attrs = launch["attrs"]
    if lora is not None:        # a LoRA site in the linear's launch (compiler/passes/merge_lora.py)
        args, tables = list(args[:-lora["inputs"]]), args[-lora["inputs"]:]
        attrs = {k: v for k, v in attrs.items() if k != "fn" or lora["ops"][1] != "lora_expand_act"}
    epi = launch.get("epilogue")
    reads = ()
    if epi is not None and epi.get("reads"):   # the consumer's other inputs (a conv's weight) last
        args, reads = list(args[:-epi["reads"]]), args[-epi["reads"]:]
    written = ()
    if pro is not None:
        produced = REGISTRY[pro["op"]].reference(ctx, *args[:pro["inputs"]], **pro["attrs"])
        produced = produced if isinstance(produced, tuple) else (produced,)
        feed = pro["output"]
        written = tuple(r for k, r in enumerate(produced) if k != feed)
        args = list(args[pro["inputs"]:])
        args.insert(pro.get("feeds", 0), produced[feed])        # the consumer's input it was
    result = REGISTRY[launch["op"]].reference(ctx, *args, **attrs)
    if epi is not None:         # a consumer in the producer's launch (compiler/passes/merge_epilogues.py)
        result = result if isinstance(result, tuple) else (result,)
        x = (written + result)[epi["output"]]
        shape = [ctx.dim(d) for d in epi["shape"]]
        if "column" in epi:     # the columns of the producer's output the consumer reads (a split's part)
            x = x[..., epi["column"]:epi["column"] + shape[-1]]
        tail = REGISTRY[epi["op"]].reference(ctx, x.reshape(shape), *reads, **epi["attrs"])
        result = result + (tail if isinstance(tail, tuple) else (tail,))
    if lora is not None:        # the linear's output, then the shrink of its input and the expand
        (shrink, s_attrs), (expand, e_attrs) = zip(lora["ops"], lora["attrs"])
        # (a shrink launched apart, before: its output is the table's place)
        xa = tables[0] if lora.get("shrink") == "apart" else REGISTRY[shrink].reference(ctx, args[0], tables[0], **s_attrs)
        result = REGISTRY[expand].reference(ctx, result, xa, *tables[1:], **e_attrs)
    return written + (result if isinstance(result, tuple) else (result,))


class StepContext:
    """What op references receive as `ctx` (see the session contract):
    T, B, positions [T], last_rows [B], seqs = [(b, first row, new tokens, cached before)],
    layer (global index), meta (seq_starts, context_lens, slot_mapping, block_tables, ...),
    cache(name) -> this layer's float32 storage of cache `name`, page_size, dim(d),
    rank, world, exchange (compiler/ops/collectives.py)."""

    def __init__(self, meta: StepMeta, storage: cache_layout.HostCaches):
        arrays = {n: getattr(meta, n) for n in METADATA}
        if arrays["state_slots"] is None:          # a StepMeta built without slots: row b, slot 0
            arrays["state_slots"] = np.zeros(meta.B, np.int32)
        if arrays["lora_slots"] is None:           # no adapter on any row
            arrays["lora_slots"] = np.zeros(meta.T, np.int32)
        self.meta = Metadata({n: np.asarray(a) for n, a in arrays.items()}, max_pages=meta.max_pages)
        self.storage = storage
        self.page_size = storage.page_size
        starts = self.meta.seq_starts
        self.seqs = [(b, int(starts[b]), int(starts[b + 1] - starts[b]),
                      int(meta.context_lens[b] - (starts[b + 1] - starts[b]))) for b in range(meta.B)]
        self.positions = np.asarray(meta.positions, np.int64)
        self.last_rows = np.asarray(meta.last_rows, np.int64)
        self.T, self.B = meta.T, meta.B
        self.layer = None
        # ranks (runtime/reference/ranks.py sets them): a collective's reference reads every
        # rank's inputs through `exchange`; alone, a plan is rank 0 of 1 and collectives are identity
        self.rank, self.world, self.exchange = 0, 1, None
        # the program the step runs (program_name): what a kernel of some programs only reads
        # (compiler/ops/expert_upcast.py stack_written); None outside a plan's step
        self.program = None

    def dim(self, d):
        # G: a data-parallel plan's rows of every rank (world * T, the ranks' T being equal)
        return {"T": self.T, "B": self.B, "G": self.world * self.T}.get(d, d) if isinstance(d, str) else d

    def cache(self, name: str) -> np.ndarray:
        return self.storage.get(name, self.layer)

    def cache_decl(self, name: str) -> dict:
        """The plan's declaration of cache `name` (its dtype and, for FP8, scales)."""
        return self.storage.caches[name]


class SeqPages:
    """The oracle's page allocator: pages per seq_id, storage grown on demand; for a plan with
    slot caches, a state slot per seq_id from its first step until `free` (num_slots of them)."""

    def __init__(self, decl: dict, page_size: int = DEFAULT_PAGE_SIZE, num_pages: int = 64, num_slots: int = ORACLE_SLOTS):
        self.has_slots = cache_layout.has_slots(decl)
        num_slots = num_slots if self.has_slots else 0
        self.storage = cache_layout.HostCaches(decl, page_size, num_pages, num_slots)
        self.page_size = page_size
        self.pages: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}
        self.free_pages = list(range(num_pages))
        self.slots: dict[int, int] = {}
        self.free_slots = list(range(num_slots))

    def step(self, chunks: list[Chunk]) -> StepMeta:
        for c in chunks:
            have = self.lens.get(c.seq_id, 0)
            if c.start > have:         # fewer is fine: the chunk rewrites from there
                raise ValueError(f"sequence {c.seq_id} has {have} tokens cached, the chunk says {c.start}")
            if self.has_slots and 0 < c.start < have:   # its state slot holds all `have` tokens
                raise ValueError(f"sequence {c.seq_id}: a plan with state slots cannot rewind from "
                                 f"{have} cached tokens to {c.start} (only to 0)")
            pages = self.pages.setdefault(c.seq_id, [])
            while len(pages) * self.page_size < c.start + len(c.tokens):
                if not self.free_pages:
                    n = self.storage.num_pages
                    self.storage.grow(2 * n)
                    self.free_pages = list(range(n, 2 * n))
                pages.append(self.free_pages.pop(0))
            if self.has_slots and c.seq_id not in self.slots:
                if not self.free_slots:
                    raise ValueError(f"the oracle's {self.storage.num_slots} state slots are all held: "
                                     f"free() finished sequences")
                self.slots[c.seq_id] = self.free_slots.pop(0)
        meta = build_step(chunks, self.pages.__getitem__, self.page_size,
                          slot_of=self.slots.__getitem__ if self.has_slots else None)
        for c in chunks:
            self.lens[c.seq_id] = c.start + len(c.tokens)
        return meta

    def context(self, chunks: list[Chunk], layer: int = 0) -> StepContext:
        """A step's ctx over these pages (for op and kernel tests), at `layer`."""
        ctx = StepContext(self.step(chunks), self.storage)
        ctx.layer = layer
        return ctx

    def free(self, seq_id: int):
        self.free_pages += self.pages.pop(seq_id, [])
        self.lens.pop(seq_id, None)
        if seq_id in self.slots:
            self.free_slots.append(self.slots.pop(seq_id))

    def cached_len(self, seq_id: int) -> int:
        return self.lens.get(seq_id, 0)


class ReferenceExecutor:
    def __init__(self, plan: dict, weights: dict, page_size: int = DEFAULT_PAGE_SIZE):
        self.plan = plan
        self.weights = weights
        self.decl = cache_layout.of_plan(plan)
        self.oracle = SeqPages(self.decl, page_size)
        self.paged = None                       # storage for step_paged (allocate_pages)
        self.outputs = {}                       # the last step's outputs besides the logits
        self._load()

    def _load(self):
        """Run the plan's load program once (its launches write the derived weights in place, as
        the GPU runner's do before its first step). Its references get no step context (None:
        outside a step), and read and write weights only."""
        for launch, layer in unrolled(self.plan["programs"].get("load", [])):
            args = [at(self.plan, self.weights, n, layer) for n in launch["inputs"]]
            for name, r in zip(launch["outputs"], launch_results(None, launch, args)):
                if r is not None:
                    dst = at(self.plan, self.weights, name, layer)
                    np.copyto(dst, np.asarray(r).reshape(dst.shape), casting="unsafe")

    def free(self, seq_id: int):
        self.oracle.free(seq_id)

    def cached_len(self, seq_id: int) -> int:
        return self.oracle.cached_len(seq_id)

    # -- buffers --------------------------------------------------------------------------
    def _arena(self, ctx):
        a = self.plan["arena"]
        scale = 4 if any(b["dtype"] in ("f8e4m3", "u8") for b in self.plan["buffers"].values()) else SCALE
        nbytes = (a["bytes_per_token"] * ctx.T + a["bytes_per_seq"] * ctx.B + a["bytes"]) * scale
        # poison: a read of memory no launch wrote shows up as NaN in the logits
        arena = np.full(nbytes // 4, np.nan, dtype=np.float32).view(np.uint8)
        views = {}
        bufs = self.plan["buffers"]

        def at(b):
            off = b["offset"]
            return off["T"] * ctx.T + off["B"] * ctx.B + off["bytes"]
        for name, b in bufs.items():
            start = at(b) * scale
            if b.get("shares") in bufs and b["dtype"] in DTYPE_BYTES:
                # a view inside another buffer: its place there counts the plan's elements, each
                # 4 bytes here (a uniform byte scale of 4 would move a bf16 column slice twice
                # as far as it is: fp8 plans, whose scale is 4)
                base = bufs[b["shares"]]
                start = at(base) * scale + (at(b) - at(base)) // DTYPE_BYTES[b["dtype"]] * 4
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
        if name == CACHE_MARKER:
            return None
        if name in views:
            return views[name]
        return at(self.plan, self.weights, name, layer)

    def _run(self, program, views, ctx):
        for launch, layer in unrolled(program):
            ctx.layer = layer
            args = [self._arg(n, views, layer) for n in launch["inputs"]]
            results = launch_results(ctx, launch, args)
            for name, r in zip(launch["outputs"], results):
                if name == CACHE_MARKER or r is None:
                    continue
                np.copyto(views[name], np.asarray(r).reshape(views[name].shape), casting="unsafe")

    def _context(self, meta: StepMeta, storage) -> StepContext:
        """The step's ctx (a rank's executor names its rank, world and exchange here, before the
        arena is laid out: a data-parallel plan's buffers span world * T rows)."""
        return StepContext(meta, storage)

    def _execute(self, meta: StepMeta, storage, rows=None):
        """The step's logits [B, V]; with rows (step rows, in order), also a generator of
        (first index into rows, float32 logits of the next ROW_BLOCK of them), computed while
        it is read (the arena stays alive until then)."""
        ctx = self._context(meta, storage)
        views = self._arena(ctx)
        views["tokens"][...] = meta.tokens
        for name in self.plan["inputs"]:
            if name == "tokens":
                continue
            given = (meta.inputs or {}).get(name)
            if given is None or np.shape(given) != views[name].shape:
                raise ValueError(f"the plan's step input '{name}' needs {list(views[name].shape)} values "
                                 f"(StepMeta.inputs), got "
                                 f"{'none' if given is None else list(np.shape(given))}")
            views[name][...] = given
        # the short program where the GPU runs it: the same ops, so the same references
        ctx.program = program_name(self.plan, meta.phase, meta.T)
        program = self.plan["programs"][ctx.program]
        self._run(program, views, ctx)
        # the plan's outputs besides the logits (an EAGLE-3 target's captured hidden states, a
        # head's own), read by whoever asks for them after the step
        self.outputs = {name: np.array(views[buf]) for name, buf in self.plan["outputs"].items()
                        if name != "logits"}
        logits = np.array(views[self.plan["outputs"]["logits"]])
        if rows is None:
            return logits
        return logits, self._row_logits(program, views, ctx, np.asarray(rows, np.int64))

    def _row_logits(self, program, views, ctx, rows):
        """The plan's logits tail (plan["row_logits"], compiler/passes/row_logits.py) re-run with
        `rows` as the gathered rows, ROW_BLOCK at a time (a block's [R, V] logits, not all)."""
        spec = self.plan.get("row_logits")
        if spec is None:
            raise ValueError("this plan has no row logits (rebuild it: compiler/passes/row_logits.py)")
        order = {name: k for k, name in enumerate(spec["tail"])}
        tail = sorted((l for l, layer in unrolled(program) if layer is None and l["outputs"]
                       and l["outputs"][0] in order), key=lambda l: order[l["outputs"][0]])
        if len(tail) != len(order) or any("prologue" in l for l in tail):
            raise ValueError(f"the row-logits tail {spec['tail']} is not among this step's program's "
                             f"own launches")
        return self._tail_blocks(tail, views, ctx, rows)

    def _tail_blocks(self, tail, views, ctx, rows):
        for at in range(0, len(rows), ROW_BLOCK):
            block = rows[at:at + ROW_BLOCK]
            ctx.last_rows, ctx.B = block, len(block)
            local = dict(views)
            for l in tail:                     # [B, ...] outputs: sized for this block's rows
                for name in l["outputs"]:
                    b = self.plan["buffers"][name]
                    local[name] = np.empty([ctx.dim(d) for d in b["shape"]],
                                           np.int32 if b["dtype"] == "i32" else np.float32)
            for l in tail:
                args = [self._arg(n, local, None) for n in l["inputs"]]
                for name, r in zip(l["outputs"], launch_results(ctx, l, args)):
                    np.copyto(local[name], np.asarray(r).reshape(local[name].shape), casting="unsafe")
            yield at, local[self.plan["outputs"]["logits"]]

    def allocate_pages(self, num_pages: int, page_size: int, num_slots: int = 0):
        self.paged = cache_layout.HostCaches(self.decl, page_size, num_pages, num_slots)

    def step_paged(self, meta: StepMeta, rows=None):
        """One step over a runtime.step.StepMeta, caches paged by the engine (allocate_pages
        first): its logits, and with rows also those rows' (see _execute)."""
        return self._execute(meta, self.paged, rows)

    def step(self, chunks: list[Chunk], lora=None) -> np.ndarray:
        """Run one step over the chunks; returns float32 logits [B, V] (one row per chunk).
        lora: each chunk's adapter slot (a LoRA plan's; None: no adapter)."""
        meta = self.oracle.step(chunks)
        if lora is not None:
            meta.lora_slots = np.repeat(np.asarray(lora, np.int32), [len(c.tokens) for c in chunks])
        return self._execute(meta, self.oracle.storage)
