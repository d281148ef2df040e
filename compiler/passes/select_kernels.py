"""Kernel selection: for each launch and phase, the backend and template that implement it.

Triton is the default and covers every op; `--features tilelang,cuda` lets another backend
take a launch wherever the op's home declares a template for that backend and phase.
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
                backend, tmpl = state.backend, None
                for b in list(state.features) + [state.backend]:
                    tmpl = op.template(b, phase)
                    if tmpl is not None:
                        backend = b
                        break
                # An op without a template (unfused attention, rope) still runs on the
                # reference executor; code generation refuses it with the op and line.
                table[n.id] = (backend, tmpl)
        state.kernels[phase] = table
    state.note("select_kernels", ", ".join(f"{p}: {len(t)} launches" for p, t in state.kernels.items()))
