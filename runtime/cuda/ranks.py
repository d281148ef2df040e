"""The ranks of a parallel artifact (compiler/parallel.py: plan.rank<r>.json, one kernels/ and
bin/) on the GPU.

DeviceCopyRanks: every rank on ONE GPU in one process (testing the partitioned kernels without
    several GPUs; the issue's item 5). One CudaRunner per rank, all on one Context (one stream),
    each with its own weights shard, arena, caches and step metadata; their collectives are a
    DeviceCopyGroup (runtime/cuda/collectives.py). A step runs in lockstep, as
    runtime/reference/ranks.py does in numpy: each rank's bound program is cut after every
    collective launch, and segment i runs rank 0, rank 1, ..., rank N-1, whose collective call
    completes the group's; the stream orders everything. Decode steps replay one CUDA Graph per
    batch bucket that holds every rank's launches and the collectives between them. Rank 0's
    logits are the step's (the same bits on every rank), rank 0 samples. It is an engine runner
    (execute, page_size, num_pages, num_slots).

nccl_runner: one rank of the artifact in this process (one process per GPU) over an NCCL
    communicator on the runner's stream; its own CUDA Graphs capture the collectives. Small
    all-reduces take the one-shot P2P path (runtime/cuda/p2p.py) where the GPUs can map each
    other's memory. The ranks size their KV caches alike (the smallest rank's page count:
    agreed_min). The runner keeps the communicator as `.comm`; closing the runner releases it
    (NcclCollectives.close: destroyed when the ranks close together, aborted after a failure).
"""
import json
from pathlib import Path

import numpy as np

from infc.compiler.contract.errors import ModelDirError

from infc.compiler.contract.bind import step_dims
from infc.compiler.contract.program import program_name, unrolled
from ..engine.runner import RowSampling, Sample, sample_row
from ..engine.step import StepMeta, common_phase
from .collectives import DeviceCopyGroup, agreed_min
from .p2p import p2p_collectives
from .runner import padding_step, step_shape


def load_rank_plans(artifact) -> list[dict]:
    """Every rank's plan: plan.rank0.json, plan.rank1.json, ... of a parallel build, or a
    one-rank artifact's plan.json; each checked to be rank r of the same world."""
    art = Path(artifact)
    paths = sorted(art.glob("plan.rank*.json"), key=lambda p: int(p.stem.split("rank")[1]))
    if not paths:
        if not (art / "plan.json").exists():
            raise ModelDirError(f"{art}: no plan.rank<r>.json nor plan.json (run `infc build "
                                f"--tensor-parallel-size N`)")
        paths = [art / "plan.json"]
    plans = [json.loads(p.read_text()) for p in paths]
    world = len(plans)
    for r, (p, path) in enumerate(zip(plans, paths)):
        par = p.get("parallel") or {"world": 1, "rank": 0}
        if (par["world"], par["rank"]) != (world, r):
            raise ModelDirError(f"{path}: rank {par['rank']} of {par['world']}, expected rank {r} of "
                                f"{world} (a partial or mixed parallel build)")
    return plans


def _collective_ops(plan: dict, phase: str) -> list[str]:
    return [l["op"] for l, _ in unrolled(plan["programs"][phase]) if l["backend"] == "nccl"]


def _segments(bound: list) -> list[list]:
    """A bound program cut after each collective entry (runner.bind: kernel None)."""
    out, cur = [], []
    for entry in bound:
        cur.append(entry)
        if entry[0] is None:
            out.append(cur)
            cur = []
    out.append(cur)
    return out


class DeviceCopyRanks:
    def __init__(self, artifact, model_dir, num_pages: int, max_num_batched_tokens: int = 2048,
                 max_num_seqs: int = 32, max_model_len: int | None = None, cuda_graphs: bool = True,
                 buckets: list[int] | None = None, load_format: str = "auto", ctx=None, **kw):
        """num_pages: per rank (each rank holds its share of every page; the same page ids).
        kw: more CudaRunner arguments (pdl, ...)."""
        from .driver import Context
        from .runner import CudaRunner
        if num_pages is None:
            raise ValueError("DeviceCopyRanks: give num_pages (every rank's caches share one GPU)")
        plans = load_rank_plans(artifact)
        self.world = len(plans)
        for phase in plans[0]["programs"]:
            ops = [_collective_ops(p, phase) for p in plans]
            if any(o != ops[0] for o in ops):
                raise ValueError(f"the ranks' {phase} programs run different collectives: {ops}")
        self.ctx = ctx if ctx is not None else Context()
        self.group = DeviceCopyGroup(self.ctx, self.world)
        self.runners = [CudaRunner(artifact, model_dir, max_num_batched_tokens=max_num_batched_tokens,
                                   max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                                   cuda_graphs=False, buckets=buckets,
                                   num_pages=num_pages, load_format=load_format, ctx=self.ctx,
                                   plan=p, collectives=self.group.member(r), **kw)
                        for r, p in enumerate(plans)]
        r0 = self.runners[0]
        self.plan, self.page_size, self.num_pages = r0.plan, r0.page_size, r0.num_pages
        self.vocab_size, self.num_slots, self.max_seqs = r0.vocab_size, r0.num_slots, r0.max_seqs
        self.buckets = r0.buckets
        self.segments: dict[str, list] = {}
        self.graphs: dict[int, tuple] = {}
        self.rank_logits: list[np.ndarray] = []
        if cuda_graphs:
            for b in self.buckets:
                self._capture(b)

    def close(self):
        """Give back the device memory of every rank (one Context)."""
        if self.ctx.stream is not None:
            self.ctx.close()
        for r in self.runners:
            r.graphs, r.programs = {}, {}
        self.graphs, self.segments = {}, {}

    def _segmented(self, phase: str) -> list[list]:
        """[rank][segment] -> bound entries; every rank has the same cut."""
        if phase not in self.segments:
            segs = [_segments(r.program(phase)) for r in self.runners]
            assert len({len(s) for s in segs}) == 1, "the ranks' programs cut differently"
            self.segments[phase] = segs
        return self.segments[phase]

    def _lockstep(self, phase: str, dims: list[dict]):
        """Every rank's program of `phase`, segment by segment; dims[r]: rank r's (data-parallel
        ranks: each its own B)."""
        segs = self._segmented(phase)
        for i in range(len(segs[0])):
            for r, runner in enumerate(self.runners):
                runner._launch_all(segs[r][i], dims[r])
        assert not self.group.waiting, "a collective was left half issued"

    def _capture(self, bucket: int):
        from .driver import Graph
        dims = step_dims(self.plan, bucket, bucket)
        for r in self.runners:
            r._upload(r._metadata(padding_step(), bucket, bucket), dims)
        program = program_name(self.plan, "decode", bucket)      # "wide" for a wide bucket
        self._lockstep(program, [dims] * self.world)
        self.ctx.sync()
        graph = Graph(self.ctx, lambda: self._lockstep(program, [dims] * self.world))
        self.graphs[bucket] = (graph, dims)

    def _run_step(self, meta: StepMeta):
        """Every rank runs meta (tensor / expert parallel: the same step on every rank)."""
        self._run_ranks([meta] * self.world)

    def _run_ranks(self, metas: list[StepMeta]):
        """Rank r runs metas[r] (the same T on every rank): the decode bucket's graph, or the
        phase's program in lockstep, each rank at its own dims."""
        self.ctx.ensure_current()
        shapes = [step_shape(m, self.buckets, self.graphs) for m in metas]
        dims = [step_dims(self.plan, T, B) for T, B in shapes]
        self._keep = [r._upload(r._metadata(m, T, B), d) for r, m, (T, B), d in zip(self.runners, metas, shapes, dims)]
        T = shapes[0][0]
        if metas[0].phase == "decode" and T in self.graphs:
            self.graphs[T][0].launch()
        else:
            self._lockstep(program_name(self.plan, metas[0].phase, T), dims)

    def _read_logits(self, metas: list[StepMeta]) -> list[np.ndarray]:
        """Every rank's logits of the step just run (f32 [B_r, V]), also kept in rank_logits."""
        self.rank_logits = []
        for r, m in zip(self.runners, metas):
            self.rank_logits.append(np.empty((m.B, self.vocab_size), np.float32))
            self.ctx.dtoh(self.rank_logits[-1], r.logits_device)
        self.ctx.sync()
        return self.rank_logits

    def logits_ranks(self, metas: list[StepMeta]) -> list[np.ndarray]:
        """A data-parallel step: rank r runs metas[r] (its own sequences and pages; the ranks'
        T already equal, runtime/engine/step.py pad_ranks); every rank's logits [B_r, V]."""
        if not (self.plan.get("parallel") or {}).get("dp"):
            raise ValueError("logits_ranks runs data-parallel plans; this one shares every step")
        metas = common_phase(metas)
        self._run_ranks(metas)
        return self._read_logits(metas)

    @property
    def dp_world(self) -> int:
        """N for a data-parallel plan's ranks (the engine then schedules each rank's sequences)."""
        return (self.plan.get("parallel") or {}).get("dp", 1)

    def execute_ranks(self, metas: list[StepMeta], sampling: list[list]) -> list[list]:
        """A data-parallel step (engine.Engine): each rank's rows sampled from its own logits."""
        logits = self.logits_ranks(metas)
        return [[None if s is None else sample_row(lg[b], s) for b, s in enumerate(rows)]
                for lg, rows in zip(logits, sampling)]

    def logits(self, meta: StepMeta) -> np.ndarray:
        """Run a step; every rank's logits in rank_logits, rank 0's returned (f32 [B, V])."""
        self._run_step(meta)
        return self._read_logits([meta] * self.world)[0]

    def execute(self, meta: StepMeta, sampling: list[RowSampling | None]) -> list[Sample | None]:
        r0 = self.runners[0]
        if r0.sampler is not None:
            self._run_step(meta)
            return r0.sampler.sample(r0.logits_device, list(sampling[: meta.B]))
        logits = self.logits(meta)
        return [None if s is None else sample_row(logits[b], s) for b, s in enumerate(sampling)]


def nccl_runner(artifact, model_dir, rank: int = 0, uid: bytes | None = None, **kw):
    """Rank `rank` of the artifact as a CudaRunner over NCCL (one process per GPU). uid: the
    communicator id rank 0 made (nccl.unique_id()) and sent to every rank; None at world 1.
    kw: CudaRunner arguments."""
    from . import nccl
    from .driver import Context
    from .runner import CudaRunner
    plans = load_rank_plans(artifact)
    world = len(plans)
    if uid is None:
        if world != 1:
            raise ValueError(f"a {world}-rank artifact needs the communicator id from rank 0")
        uid = nccl.unique_id()
    ctx = kw.pop("ctx", None) or Context()          # current before NCCL picks its device
    comm = nccl.Communicator(world, rank, uid)
    coll = None
    try:
        coll = p2p_collectives(comm, ctx)
        runner = CudaRunner(artifact, model_dir, ctx=ctx, plan=plans[rank], collectives=coll,
                            agree_num_pages=lambda n: agreed_min(comm, ctx, n), **kw)
    except BaseException:
        if coll is not None:
            coll.close(graceful=True)
        else:
            comm.destroy()
        raise
    runner.comm = comm
    return runner
