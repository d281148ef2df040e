"""Test-only fault injection: make a step fail on purpose, on any device, so a test can check
that one failure ends only the requests it concerns and the engine serves on (issue 39).

    INFC_FAULT_INJECT=step:SEED      every step that holds a sequence of a request whose `seed`
                                     is SEED raises before the runner runs it: the step is lost
    INFC_FAULT_INJECT=request:SEED   reading back such a request's token raises: it alone fails
    INFC_FAULT_INJECT=step:1,request:2   both

Never set it in production: a client that knows SEED can fail its own request (nobody else's).
Read once, by the Engine; unset (the default) it costs one attribute test per step.
"""
from infc import envs

ENV = "INFC_FAULT_INJECT"
KINDS = ("step", "request")


class InjectedFault(RuntimeError):
    """The failure INFC_FAULT_INJECT asked for."""


class FaultInjector:
    def __init__(self, seeds: dict[str, set[int]]):
        self.seeds = seeds                      # kind -> the seeds that mark its requests

    def _marked(self, kind: str, seq) -> bool:
        return seq.params.seed in self.seeds.get(kind, ())

    def on_step(self, batch):
        """Before the runner runs a batch of (sequence, tokens) pairs."""
        for seq, _ in batch:
            if self._marked("step", seq):
                raise InjectedFault(f"{ENV}: a step holding a request with seed {seq.params.seed}")

    def on_token(self, seq):
        """Before a sampled token of seq is appended and checked."""
        if self._marked("request", seq):
            raise InjectedFault(f"{ENV}: request {seq.request_id!r} (seed {seq.params.seed})")


def from_env(environ: dict | None = None) -> FaultInjector | None:
    """The injector INFC_FAULT_INJECT asks for (environ: a mapping to read instead, in tests)."""
    spec = (envs.value(ENV) or "") if environ is None else environ.get(ENV, "")
    if not spec:
        return None
    seeds: dict[str, set[int]] = {}
    for part in spec.split(","):
        kind, _, seed = part.strip().partition(":")
        if kind not in KINDS or not seed.lstrip("-").isdigit():
            raise ValueError(f"{ENV}={spec!r}: expected step:SEED or request:SEED (an integer seed), "
                             f"comma-separated")
        seeds.setdefault(kind, set()).add(int(seed))
    return FaultInjector(seeds)
