"""Simulated ranks: the N rank plans of a parallel build (compiler/parallel.py) run in one process.

Each rank has its own ReferenceExecutor state (its plan, its weight slices, its arena, its paged
caches: page ids are the same on every rank, as on the GPUs). A step runs launch by launch, and
each launch rank by rank; for a collective launch every rank's inputs are copied into the
`RankExchange` first, then each rank's reference reads them all through `ctx.exchange` (the
shared numpy state that stands in for NCCL) and writes its own output. The ranks must run the
same launches in the same order, as NCCL requires; a plan pair that does not is refused.

Data-parallel plans (compiler/parallel.py, `dp`): each rank runs its own sequences, so each has
its own step (`step_ranks`, `step_paged_ranks`). The ranks' steps are made alike first, as the
GPU runtime makes them (runtime/engine/step.py pad_ranks): padded to the longest rank's T with rows
whose outputs are dropped, and run under one program (the phase they share, else "mixed").
"""
import numpy as np

from infc.config import DEFAULT_MAX_NUM_SEQS, DEFAULT_PAGE_SIZE
from infc.compiler.ops import REGISTRY

from infc.compiler.contract import caches
from infc.compiler.contract.program import program_name, unrolled
from ..engine.step import Chunk, StepMeta, common_phase, pad_ranks
from .executor import ReferenceExecutor, StepContext, launch_results

PAD_SEQ = -1         # the oracle's pad page is this sequence's (runtime/engine/step.py pad_ranks)


class RankExchange:
    """The collective in flight: inputs(i) -> [rank 0's input i, rank 1's, ...]."""

    def __init__(self, world: int):
        self.world = world
        self.current: list | None = None

    def inputs(self, i: int) -> list:
        if self.current is None:
            raise RuntimeError("a collective's reference ran outside a collective launch")
        return [args[i] for args in self.current]


class RankExecutor:
    """step(chunks) -> rank 0's logits [B, V]; `logits` holds every rank's after a step."""

    def __init__(self, plans: list[dict], weights: list[dict], page_size: int = DEFAULT_PAGE_SIZE):
        world = len(plans)
        for r, p in enumerate(plans):
            par = p.get("parallel") or {"world": 1, "rank": 0}
            if par["world"] != world or par["rank"] != r:
                raise ValueError(f"plan {r} is rank {par['rank']} of {par['world']}, expected rank "
                                 f"{r} of {world}")
        self.ranks = [ReferenceExecutor(p, w, page_size) for p, w in zip(plans, weights)]
        self.world = world
        self.exchange = RankExchange(world)
        self.logits: list[np.ndarray] = []

    def free(self, seq_id: int):
        for ex in self.ranks:
            ex.free(seq_id)

    def step(self, chunks: list[Chunk]) -> np.ndarray:
        """The oracle API: each rank keeps its own pages per seq_id (the same ids everywhere)."""
        return self._execute([(ex.oracle.step(chunks), ex.oracle.storage) for ex in self.ranks])

    def allocate_pages(self, num_pages: int, page_size: int, num_slots: int = 0):
        for ex in self.ranks:
            ex.allocate_pages(num_pages, page_size, num_slots)

    def step_paged(self, meta) -> np.ndarray:
        """One engine step: rank 0's metadata, broadcast to every rank (page ids are shared)."""
        return self._execute([(meta, ex.paged) for ex in self.ranks])

    # -- data-parallel ranks: a step each ---------------------------------------------------------
    def step_ranks(self, chunks_per_rank: list[list[Chunk]]) -> list[np.ndarray]:
        """The oracle API for data-parallel plans: rank r runs chunks_per_rank[r] (an empty list:
        pad rows only) over its own pages; returns each rank's logits for its own chunks."""
        if len(chunks_per_rank) != self.world:
            raise ValueError(f"{len(chunks_per_rank)} ranks' chunks for {self.world} ranks")
        pad_pages = []
        for ex in self.ranks:                     # a page of the rank's own, for pad rows
            if PAD_SEQ not in ex.oracle.pages:
                ex.oracle.step([Chunk(PAD_SEQ, [0], 0)])
            pad_pages.append(ex.oracle.pages[PAD_SEQ][0])
        metas = pad_ranks([ex.oracle.step(list(cs)) for ex, cs in zip(self.ranks, chunks_per_rank)],
                          pad_pages, self.ranks[0].oracle.page_size)
        logits = self._execute([(m, ex.oracle.storage) for m, ex in zip(metas, self.ranks)], all_ranks=True)
        return [lg[:len(cs)] for lg, cs in zip(logits, chunks_per_rank)]

    def step_paged_ranks(self, metas: list[StepMeta]) -> list[np.ndarray]:
        """One engine step of data-parallel ranks: rank r's metadata over its own pages, the ranks'
        T already equal (padded by the runtime); each rank's logits."""
        return self._execute(self._alike([(m, ex.paged) for m, ex in zip(metas, self.ranks)]), all_ranks=True)

    def _alike(self, steps: list) -> list:
        """The ranks' steps under one program (runtime/engine/step.py common_phase)."""
        return list(zip(common_phase([m for m, _ in steps]), [s for _, s in steps]))

    def _execute(self, steps: list, all_ranks: bool = False):
        ctxs, views, programs = [], [], []
        for r, (ex, (meta, storage)) in enumerate(zip(self.ranks, steps)):
            ctx = StepContext(meta, storage)
            ctx.rank, ctx.world, ctx.exchange = r, self.world, self.exchange
            v = ex._arena(ctx)
            v["tokens"][...] = meta.tokens
            ctxs.append(ctx)
            views.append(v)
            ctx.program = program_name(ex.plan, meta.phase, meta.T)
            programs.append(unrolled(ex.plan["programs"][ctx.program]))
        for step in zip(*programs, strict=True):
            (launch, layer) = step[0]
            if any(l["op"] != launch["op"] or y != layer for l, y in step):
                raise ValueError(f"ranks diverge: {[l['op'] for l, _ in step]} at layer {layer}")
            op = REGISTRY[launch["op"]]
            args = []
            for r, (l, _) in enumerate(step):
                ctxs[r].layer = layer
                a = [self.ranks[r]._arg(n, views[r], layer) for n in l["inputs"]]
                args.append([None if x is None else np.array(x) for x in a] if op.collective else a)
            self.exchange.current = args if op.collective else None
            for r, (l, _) in enumerate(step):
                results = launch_results(ctxs[r], l, args[r])
                for name, out in zip(l["outputs"], results):
                    if out is None or name not in views[r]:
                        continue
                    np.copyto(views[r][name], np.asarray(out).reshape(views[r][name].shape),
                              casting="unsafe")
            self.exchange.current = None
        self.logits = [np.array(v[ex.plan["outputs"]["logits"]]) for v, ex in zip(views, self.ranks)]
        return self.logits if all_ranks else self.logits[0]



def rank_runner(plans: list[dict], weights: list[dict], num_pages: int, page_size: int = DEFAULT_PAGE_SIZE,
                max_num_seqs: int = DEFAULT_MAX_NUM_SEQS):
    """The engine's CPU runner (runtime/engine/runner.py) over simulated ranks; rank 0's logits are
    sampled, as rank 0 owns the sampler on the GPUs. max_num_seqs: state slots of a plan with slot
    caches (DeepSeek-V4's partial compression blocks, linear attention's state), as CPURunner's."""
    from ..engine.runner import CPURunner, feed_tokens, sample_row

    class RankRunner(CPURunner):
        def __init__(self):
            self.plan, self.page_size, self.num_pages = plans[0], page_size, num_pages
            self.vocab_size = plans[0]["config"]["V"]
            # a slot a running sequence: without them every sequence's state shares slot 0
            self.num_slots = max_num_seqs if caches.has_slots(caches.of_plan(plans[0])) else 0
            self.executor = RankExecutor(plans, weights, page_size)
            # one page past num_pages: data-parallel pad rows write it (runtime/engine/step.py pad_ranks)
            self.executor.allocate_pages(num_pages + 1, page_size, self.num_slots)
            self.dp_world = (plans[0].get("parallel") or {}).get("dp", 1)
            self._last_ranks = None

        def execute_ranks(self, metas, sampling):
            """A data-parallel step (engine.Engine): each rank's samples from its own logits."""
            logits = self.executor.step_paged_ranks(metas)
            return [[None if s is None else sample_row(lg[b], s) for b, s in enumerate(rows)]
                    for lg, rows in zip(logits, sampling)]

        def launch_ranks(self, metas, sampling, feeds):
            """execute_ranks computed at launch (ComputedAtLaunch's way, a rank at a time): each
            rank's fed rows take the tokens that rank sampled in the step launched before."""
            for r, (meta, feed) in enumerate(zip(metas, feeds)):
                feed_tokens(meta, feed, self._last_ranks[r] if feed else None)
            self._last_ranks = self.execute_ranks(metas, sampling)
            return self._last_ranks

        @staticmethod
        def collect_ranks(samples):
            return samples

    return RankRunner()
