"""Kernel selection: for each launch and phase, the backend and template that implement it.

Triton is the default and covers every op; `--features` moves ops to another backend where
the op's home declares a template for it (and fails loudly where it does not).
"""
from ..ops import REGISTRY

PHASES = ("prefill", "decode", "mixed")


def select_kernels(state):
    for phase in PHASES:
        table = {}
        for g in state.graph.walk():
            for n in g.ordered():
                if n.op == "layers" or REGISTRY[n.op].view:
                    continue
                op = REGISTRY[n.op]
                backend = state.features.get(n.op, state.backend)
                tmpl = op.template(backend, phase)
                if tmpl is None and backend != state.backend:
                    backend, tmpl = state.backend, op.template(state.backend, phase)
                # An op without a template (unfused attention, rope) still runs on the
                # reference executor; code generation refuses it with the op and line.
                table[n.id] = (backend, tmpl)
        state.kernels[phase] = table
    state.note("select_kernels", ", ".join(f"{p}: {len(t)} launches" for p, t in state.kernels.items()))
