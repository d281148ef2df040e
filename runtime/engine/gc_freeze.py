"""Startup objects out of the cyclic garbage collector's way.

What a serving process makes while it starts (imported modules, the plan, bound launches, the
weights' and the tokenizer's records) lives until it exits, yet each full collection walks all
of it again, on the step loop's time: every step allocates outputs and metadata, which trigger
collections, and a full one over a few hundred thousand objects takes tens of milliseconds.
freeze_startup() collects once and moves every object still alive into the permanent
generation (gc.freeze), as vLLM does after loading, so later collections walk only what the
steps made. Measured on the build machine (2 cores), the engine and scheduler's host time over
the 289 steps of `bench throughput` 1024/128 at 256 sequences with a no-op runner: 0.59 s alone,
0.77-1.04 s with torch and transformers imported in the process, 0.57 s with them imported and
the startup frozen.

Called by the long-lived processes once they are ready: `infc serve`, `infc bench throughput`,
the rank workers. INFC_GC_FREEZE=0 leaves the collector as it is (A/B runs).
"""
import gc

from infc import envs


def freeze_startup() -> bool:
    """Collect, then freeze what is alive; False (nothing done) under INFC_GC_FREEZE=0."""
    if not envs.value("INFC_GC_FREEZE"):
        return False
    gc.collect()
    gc.freeze()
    return True
