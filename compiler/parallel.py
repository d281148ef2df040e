"""Ranks at build time: `--tensor-parallel-size N [--enable-expert-parallel]` -> one plan per rank.

The settings follow vLLM: N ranks; attention and dense MLPs tensor-parallel over them; experts
tensor-parallel too (F/N of every expert), or with --enable-expert-parallel partitioned across
the same N ranks (E/N whole experts each). `expert_parallel_only` (Python API) keeps attention
and dense MLPs replicated and partitions only the experts, every rank computing every token.
`data_parallel_size` N with expert parallelism (vLLM's `--data-parallel-size N
--enable-expert-parallel`, SGLang's DP attention) gives each rank its own sequences instead:
attention and dense layers replicated and run on the rank's tokens only, the experts
partitioned and run on every rank's tokens (dp_dispatch gathers them, dp_combine sends the
partial sums back: compiler/ops/collectives.py). Its plans run on the reference executor's
simulated ranks and on one GPU's device-copy ranks (runtime/cuda/ranks.py logits_ranks); the
engine does not schedule data-parallel ranks yet (each rank's own sequences, pages and steps).

Each rank's plan is the single-GPU plan of its share: the pipeline's shard_ranks pass
(compiler/passes/shard_ranks.py) rewrites the graph with rank r's weight slices (`slice`
recipes of the checkpoint tensors, so a rank reads only its rows/columns) and the collectives
(compiler/ops/collectives.py). One plan per rank, rather than one plan with a ranks section:
every executor and loader runs a rank plan unchanged, and the ranks' launches are identical
(same shapes, same kernels), so they share one kernels/ directory. The plans carry
`parallel: {world, rank, tp, ep}`.

Layout of a parallel build: out/plan.rank<r>.json for each rank, out/kernels/, out/bin/
(compiler/build.py compile_ranks and build_ranks make them).
"""
from pathlib import Path

from .contract.errors import SpecError


def settings(tensor_parallel_size: int = 1, enable_expert_parallel: bool = False,
             expert_parallel_only: int = 0, data_parallel_size: int = 1) -> dict | None:
    """{"world", "tp", "ep"} (and "dp" for data-parallel attention), or None for the
    single-GPU plan."""
    if data_parallel_size not in (1, None):
        n = data_parallel_size
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise SpecError(f"--data-parallel-size must be a positive integer, got {n!r}", None)
        if not enable_expert_parallel:
            raise SpecError("--data-parallel-size without --enable-expert-parallel would be "
                            f"{n} independent replicas, which share nothing to compile: start {n} "
                            "servers instead", None)
        if tensor_parallel_size not in (1, None) or expert_parallel_only:
            raise SpecError("--data-parallel-size with --tensor-parallel-size (attention "
                            "data-parallel across tensor-parallel groups) is not built", None)
        return {"world": n, "tp": 1, "ep": n, "dp": n}
    if expert_parallel_only:
        n = expert_parallel_only
        if not isinstance(n, int) or n < 1:
            raise SpecError(f"expert parallel size must be a positive integer, got {n!r}", None)
        if tensor_parallel_size not in (1, None):
            raise SpecError("expert_parallel_only keeps attention replicated: do not also give "
                            "--tensor-parallel-size", None)
        return None if n == 1 else {"world": n, "tp": 1, "ep": n}
    n = tensor_parallel_size
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise SpecError(f"--tensor-parallel-size must be a positive integer, got {n!r}", None)
    if n == 1:
        if enable_expert_parallel:
            raise SpecError("--enable-expert-parallel partitions the experts across the "
                            "--tensor-parallel-size ranks: give --tensor-parallel-size N > 1", None)
        return None
    return {"world": n, "tp": n, "ep": n if enable_expert_parallel else 1}


def check_used(state, par):
    """Refuse settings that shard nothing they were asked to: EP on a model without experts."""
    if par["ep"] > 1 and not any(n.op in ("moe_experts", "moe_gate_up")
                                 for g in state.graph.walk() for n in g.ordered()):
        raise state.error("--enable-expert-parallel: this model has no experts (moe_experts) "
                          "to partition", None)


def rank_plan_path(out: Path, rank: int) -> Path:
    return Path(out) / f"plan.rank{rank}.json"
