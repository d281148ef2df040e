"""The head proposer of an engine (EAGLE-3's head, or the checkpoint's MTP layer: both read the
target's hidden states), checked against its target: the head's runner (its plan built from
specs/eagle3.yaml, or from the family spec's `mtp:` section; `d2t` set by infc/backend.py) and a
target runner whose plan outputs the hidden states the head reads."""
from .eagle import EagleProposer


def eagle_proposer(head_runner, target_runner, max_num_batched_tokens: int, max_model_len: int,
                   method: str = "eagle3"):
    where = f"speculative method {method!r}"
    plan = getattr(target_runner, "plan", None) or {}
    if "aux_hidden" not in plan.get("outputs", {}) or not callable(getattr(target_runner, "outputs", None)):
        raise ValueError(f"{where}: the target's plan has no aux_hidden output "
                         "(build it with the head's layers: compiler/passes/capture_hidden.py), or "
                         "its runner cannot hand plan outputs back (the CPU and CUDA runners can: `outputs()`)")
    vh, vt = head_runner.plan["config"]["V"], getattr(target_runner, "vocab_size", None)
    if vh != vt:
        raise ValueError(f"{where}: the head's vocabulary has {vh} tokens and the "
                         f"target's {vt}: the head must be trained for this target")
    width = plan["buffers"][plan["outputs"]["aux_hidden"]]["shape"][1]
    reads = head_runner.plan["inputs"]["aux"]["shape"][1]
    if width != reads:
        raise ValueError(f"{where}: the head reads [T, {reads}] target hidden "
                         f"states and the target gives [T, {width}]: a head for a target of "
                         f"another width")
    d2t = getattr(head_runner, "d2t", None)
    if d2t is None:
        raise ValueError(f"{where}: the head's runner carries no d2t map")
    return EagleProposer(head_runner, d2t, max_num_batched_tokens, max_model_len)
