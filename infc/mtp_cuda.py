"""MTP speculation on cuda (issue 43): the checkpoint's MTP layer as an artifact of its own beside
the target's served build (infc/backend.py cuda_mtp_artifact, built like every served build), run by
a CudaRunner in the target's process and context (infc/backend.py _cuda_runners) on a KV cache of
its own. The tensors the layer shares with the target (the same checkpoint tensors at the same
shapes: the embedding table, the final norm, lm_head) are the target's device copies, by pointer:
a DeepSeek-V3 lm_head alone is 1.8 GB of bf16."""
from pathlib import Path

from infc.config import EngineConfig

MTP_TAG = "-mtp"                    # .cache/artifacts/<the target's name>-mtp (tests/gpu/prepare.py's mtp)


def cuda_mtp_weights(c: EngineConfig, target, mtp_artifact: Path) -> tuple[dict, object]:
    """(shared_weights, d2t) of the MTP layer's CudaRunner beside `target`'s: every model-level
    weight its plan declares as the target's plan does (the same source, shape and dtype) is the
    target's device pointer; d2t zeros (its vocabulary is the target's)."""
    import json
    import numpy as np
    plan = json.loads((Path(mtp_artifact) / "plan.json").read_text())
    theirs = target.plan["weights"]
    shared = {}
    for name, w in plan["weights"].items():
        t = theirs.get(name)
        if (t is not None and w["layers"] is None and t["layers"] is None and t["source"] == w["source"]
                and list(t["shape"]) == list(w["shape"]) and t["dtype"] == w["dtype"]):
            shared[name] = target.weights.ptr(name, None)
    return shared, np.zeros(plan["config"]["V"], np.int64)
