"""The rank runners MultiProcessRunner starts in each rank process (runtime/distributed/
rank_workers.py), named by "module:function" in its factory argument: the GPU's (a CudaRunner
over NCCL) and the CPU's (the numpy reference executor, its collectives over the rank link).
"""
import json

import numpy as np

from infc.config import DEFAULT_MAX_NUM_SEQS, DEFAULT_PAGE_SIZE
from .rank_workers import RankLink


# -- factories --------------------------------------------------------------------------------
def nccl_rank_runner(rank: int, world: int, config: dict, link: RankLink):
    """A CudaRunner of rank `rank` over NCCL (runtime/cuda/ranks.py: nccl_runner) on GPU
    devices[rank] (default: GPU `rank`); rank 0 makes the communicator id and shares it.
    config: artifact, model_dir, devices (optional), and CudaRunner arguments (give num_pages:
    every rank needs the same). Not yet run on several GPUs."""
    from ..cuda import nccl
    from ..cuda.driver import Context
    from ..cuda.ranks import nccl_runner
    kw = dict(config)
    artifact, model_dir = kw.pop("artifact"), kw.pop("model_dir")
    devices = kw.pop("devices", None) or list(range(world))      # rank r on GPU r by default
    ctx = Context(devices[rank])            # current before NCCL picks its device
    uid = link.share(nccl.unique_id() if rank == 0 else None)
    runner = nccl_runner(artifact, model_dir, rank=rank, uid=uid, ctx=ctx, **kw)
    runner.abort = runner.collectives.abort   # the watchdog's way out of a collective with a dead rank
    return runner


def reference_rank_runner(rank: int, world: int, config: dict, link: RankLink):
    """The numpy reference executor of rank `rank`'s plan (CPU, float32), its collectives over
    link.exchange(): N processes reproduce runtime/reference/ranks.py's simulated ranks.
    config: plans (rank plan JSON paths, or `artifact` with plan.rank<r>.json), model_dir,
    num_pages, page_size, max_num_seqs (defaults: infc/config.py). The caches hold one page more than num_pages:
    data-parallel ranks' pad rows write page num_pages (runtime/engine/step.py pad_ranks), which no
    sequence owns."""
    from infc.compiler.contract import caches
    from ..engine.runner import CPURunner
    from infc.compiler.contract.safetensors_io import Checkpoint
    from ..weights.load import load_weights
    if "plans" in config:
        plan = json.loads(open(config["plans"][rank]).read())
    else:
        from ..cuda.ranks import load_rank_plans     # needs cuda-bindings installed, not a GPU
        plan = load_rank_plans(config["artifact"])[rank]
    par = plan.get("parallel") or {"world": 1, "rank": 0}
    if (par["world"], par["rank"]) != (world, rank):
        raise ValueError(f"rank {rank} of {world} got the plan of rank {par['rank']} of {par['world']}")
    page_size = config.get("page_size", DEFAULT_PAGE_SIZE)
    runner = CPURunner.__new__(CPURunner)
    runner.plan, runner.page_size, runner.num_pages = plan, page_size, config["num_pages"]
    runner.vocab_size = plan["config"]["V"]
    runner.num_slots = config.get("max_num_seqs", DEFAULT_MAX_NUM_SEQS) if caches.has_slots(caches.of_plan(plan)) else 0
    runner.executor = RankReferenceExecutor(plan, load_weights(plan, Checkpoint(config["model_dir"])),
                                            page_size, rank, world, link.exchange())
    runner.executor.allocate_pages(runner.num_pages + 1, page_size, runner.num_slots)
    runner.logits = runner.executor.step_paged
    return runner


def _rank_executor_class():
    from infc.compiler.ops import REGISTRY

    from infc.compiler.contract.program import unrolled
    from ..reference.executor import CACHE_MARKER, ReferenceExecutor, launch_results

    class RankReferenceExecutor(ReferenceExecutor):
        """One rank's ReferenceExecutor whose collective launches exchange their inputs with the
        other ranks' processes (the same launches in the same order on every rank)."""

        def __init__(self, plan, weights, page_size, rank, world, exchange):
            super().__init__(plan, weights, page_size)
            self.rank, self.world, self.exchange = rank, world, exchange

        def _context(self, meta, storage):
            ctx = super()._context(meta, storage)
            ctx.rank, ctx.world, ctx.exchange = self.rank, self.world, self.exchange
            return ctx

        def _run(self, program, views, ctx):
            for launch, layer in unrolled(program):
                ctx.layer = layer
                op = REGISTRY[launch["op"]]
                args = [self._arg(n, views, layer) for n in launch["inputs"]]
                if op.collective:
                    args = [None if x is None else np.array(x) for x in args]
                    self.exchange.gather(args)
                try:
                    results = launch_results(ctx, launch, args)
                finally:
                    self.exchange.current = None
                for name, r in zip(launch["outputs"], results):
                    if name == CACHE_MARKER or r is None or name not in views:
                        continue
                    np.copyto(views[name], np.asarray(r).reshape(views[name].shape), casting="unsafe")

    return RankReferenceExecutor


_RankReferenceExecutor = None


def RankReferenceExecutor(*a, **kw):           # noqa: N802 (the class, built on first use)
    global _RankReferenceExecutor
    if _RankReferenceExecutor is None:
        _RankReferenceExecutor = _rank_executor_class()
    return _RankReferenceExecutor(*a, **kw)
