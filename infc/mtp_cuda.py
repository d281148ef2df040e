"""MTP speculation on cuda (issue 43): the checkpoint's MTP layer as an artifact of its own beside
the target's served build, run by a CudaRunner in the target's process and context (infc/backend.py
_cuda_runners) on a KV cache of its own. The tensors the layer shares with the target (the same
checkpoint tensors at the same shapes: the embedding table, the final norm, lm_head) are the
target's device copies, by pointer: a DeepSeek-V3 lm_head alone is 1.8 GB of bf16."""
from pathlib import Path

from infc.config import EngineConfig

WHERE = "--speculative-config: method 'mtp'"
MTP_TAG = "-mtp"                    # .cache/artifacts/<the target's name>-mtp (tests/gpu/prepare.py's mtp)


def mtp_artifact_dir(name: str) -> Path:
    """Where the MTP layer of the target served under `name` is built (read at call time: tests
    move SERVED_ARTIFACTS)."""
    from infc import backend
    return backend.SERVED_ARTIFACTS / (name + MTP_TAG)


def cuda_mtp_artifact(st, c: EngineConfig, spec_dirs, model_dir: Path, target_artifact: Path) -> tuple[Path, Path]:
    """(artifact, model directory) of the MTP layer: the family spec's `mtp:` section over the
    target's config.json, built or reused like every served build, with the target's page size (the
    split gives both caches the same pages). The checkpoint is not checked against the plan here
    (the target's tensors are all unread by it, as on the cpu); its MTP tensors are read at load,
    and a missing one is named then. KV cache dtype: the model's (the cpu's MTP runner's too)."""
    import json
    from infc.backend import built_or_reused, gpu_tuning
    from infc.compiler.contract.errors import SpecError
    page_size = json.loads((Path(target_artifact) / "plan.json").read_text())["build"]["page_size"]
    out = mtp_artifact_dir(c.load.model or model_dir.name)
    try:
        art = built_or_reused(st, "MTP artifact", dict(
            model=c.load.model, spec_path=c.load.spec, model_dir=str(model_dir), spec_dirs=spec_dirs,
            out=str(out), page_size=page_size, gpu=gpu_tuning(), reuse_bins=True, check_checkpoint=False,
            section="mtp"))
    except SpecError as e:                      # str(e) names the spec's line
        raise ValueError(f"{WHERE}: {e}") from None
    return Path(art), model_dir


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
