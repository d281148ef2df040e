"""A plan's step inputs and outputs besides the tokens and the logits, on the CUDA runner: what a
speculation proposer asks of a runner (issue 43). The target of an EAGLE-3 head (or an MTP layer)
gives its captured hidden states (compiler/passes/capture_hidden.py: output aux_hidden [T, W]);
the head takes them as a step input (specs/eagle3.yaml: inputs aux [T, 3*Ht], hidden [T, H]) and
gives its own (hidden_out [B, H]).

Inputs: StepMeta.inputs[name], [T, ...] float32 rows on the host, are converted to the buffer's
dtype and uploaded with the step's metadata, pad rows (a CUDA graph's bucket) zero. Outputs:
`StepOutputs`, a mapping read lazily: an output is copied back only when a proposer asks for it,
its rows the step's true ones (T- or B-leading: the plan's shape says which).

Every buffer sits at a fixed address (the arena is laid out for the maximum T and B), so a
captured decode graph reads the inputs and writes the outputs at the very addresses used here:
the buffers a graph uses are static by construction, nothing is re-captured for them. An
output reflects the last step run on the runner's stream; overlapped steps (engine.py) would read
the step launched last, which is why the engine runs speculating steps synchronously."""
from collections.abc import Mapping

import numpy as np

from infc.compiler.contract.schema import DTYPE_BYTES

HOST = {"f32": np.float32, "i32": np.int32}


def to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits (uint16), round to nearest even; NaN stays NaN."""
    x = np.ascontiguousarray(x, np.float32)
    u = x.view(np.uint32)
    out = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), out)


def from_bf16(u: np.ndarray) -> np.ndarray:
    return (np.asarray(u, np.uint16).astype(np.uint32) << 16).view(np.float32)


def step_inputs(plan: dict) -> dict:
    """name -> buffer declaration of the plan's per-token inputs besides the tokens."""
    return {n: plan["buffers"].get(n, d) for n, d in plan.get("inputs", {}).items() if n != "tokens"}


def row_bytes(decl: dict) -> int:
    n = 1
    for d in decl["shape"][1:]:
        n *= int(d)
    return n * DTYPE_BYTES[decl["dtype"]]


def input_arrays(plan: dict, given: dict | None, T: int, true_T: int) -> dict:
    """name -> host array of T rows in the buffer's dtype: the given [true_T, ...] rows, then zero
    rows for the padding (a step of padding rows only needs none). A missing or misshapen input
    is named (as the reference executor does)."""
    out = {}
    for name, decl in step_inputs(plan).items():
        cols = tuple(int(d) for d in decl["shape"][1:])
        x = (given or {}).get(name)
        if x is None and true_T == 0:                # a step of padding rows only (graph capture)
            x = np.zeros((0, *cols), np.float32)
        if x is None or tuple(np.shape(x)) != (true_T, *cols):
            raise ValueError(f"the plan's step input '{name}' needs {[true_T, *cols]} values "
                             f"(StepMeta.inputs), got {'none' if x is None else list(np.shape(x))}")
        x = np.asarray(x, np.float32)
        if T > true_T:
            x = np.concatenate([x, np.zeros((T - true_T, *cols), np.float32)])
        out[name] = to_bf16(x) if decl["dtype"] == "bf16" else np.ascontiguousarray(x, HOST[decl["dtype"]])
    return out


class StepOutputs(Mapping):
    """The last step's plan outputs besides the logits (name -> float32 host array), each read
    back on first access: `runner.outputs()["aux_hidden"]`."""

    def __init__(self, runner, rows: dict):
        """rows: {"T": the step's true tokens, "B": its true sequences}."""
        self.runner, self.rows, self.read = runner, rows, {}
        self.names = {n: b for n, b in runner.plan["outputs"].items() if n != "logits"}

    def __getitem__(self, name):
        if name not in self.read:
            buf = self.names[name]                    # KeyError: the plan has no such output
            decl = self.runner.plan["buffers"][buf]
            lead = decl["shape"][0]
            n = self.rows[lead] if lead in self.rows else int(lead)
            cols = tuple(int(d) for d in decl["shape"][1:])
            host = np.empty((n, *cols), np.uint16 if decl["dtype"] == "bf16" else HOST[decl["dtype"]])
            self.runner.ctx.dtoh(host, self.runner._buffer_ptr(buf))
            self.runner.ctx.sync()
            self.read[name] = from_bf16(host) if decl["dtype"] == "bf16" else host.astype(np.float32)
        return self.read[name]

    def __iter__(self):
        return iter(self.names)

    def __len__(self):
        return len(self.names)
