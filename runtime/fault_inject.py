"""Test-only fault injection: make a step fail on purpose, on any device, so a test can check
that one failure ends only the requests it concerns and the engine serves on (issue 39).

    INFC_FAULT_INJECT=step:SEED      every step that holds a sequence of a request whose `seed`
                                     is SEED raises before the runner runs it: the step is lost
    INFC_FAULT_INJECT=request:SEED   reading back such a request's token raises: it alone fails

Never set it in production: a client that knows SEED can fail its own request (nobody else's).
Read once, by the Engine; unset (the default) it costs one attribute test per step.
"""
import os

ENV = "INFC_FAULT_INJECT"
KINDS = ("step", "request")


class InjectedFault(RuntimeError):
    """The failure INFC_FAULT_INJECT asked for."""


class FaultInjector:
    def __init__(self, kind: str, seed: int):
        self.kind, self.seed = kind, seed

    def _marked(self, seq) -> bool:
        return seq.params.seed == self.seed

    def on_step(self, batch):
        """Before the runner runs a batch of (sequence, tokens) pairs."""
        if self.kind == "step" and any(self._marked(s) for s, _ in batch):
            raise InjectedFault(f"{ENV}: a step holding a request with seed {self.seed}")

    def on_token(self, seq):
        """Before a sampled token of seq is appended and checked."""
        if self.kind == "request" and self._marked(seq):
            raise InjectedFault(f"{ENV}: request {seq.request_id!r} (seed {self.seed})")


def from_env(environ=os.environ) -> FaultInjector | None:
    spec = environ.get(ENV, "")
    if not spec:
        return None
    kind, _, seed = spec.partition(":")
    if kind not in KINDS or not seed.lstrip("-").isdigit():
        raise ValueError(f"{ENV}={spec!r}: expected step:SEED or request:SEED (an integer seed)")
    return FaultInjector(kind, int(seed))
