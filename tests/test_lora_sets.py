"""compiler/codegen/lora_sets.py: a narrow LoRA site keeps its sync words in sets by layer
(gemv.py.j2 LORA_SETS) only where no launch of its kernel can run right after another at the same
set; where one could, the build renders that kernel's launches with the departures instead."""
from types import SimpleNamespace

import pytest

from infc.compiler.build import compile_model, generate
from infc.compiler.codegen import lora_sets
from infc.config import lora_build


def _repeat(layers: list[list[str]]) -> dict:
    """A layer repeat whose layer i runs the launches of kernel ids layers[i]."""
    kinds = {f"k{i}": [{"op": "linear", "kernel_id": kid} for kid in kids] for i, kids in enumerate(layers)}
    return {"repeat": "layers", "count": len(layers), "schedule": list(kinds), "kinds": kinds}


def _kernels(*ids):
    return {kid: SimpleNamespace(id=kid, meta={"scratch": {lora_sets.SCRATCH: "1024"}}) for kid in ids}


@pytest.mark.parametrize("programs,bad", [
    ({"narrow": [_repeat([["a"], ["a"], ["a"]])]}, set()),                     # a layer each: fine
    ({"narrow": [_repeat([["a"], ["b"], ["a"]])]}, {"b"}),                     # a: 1, 3, 1; b once a step
    ({"narrow": [_repeat([["a"], ["b"]])]}, {"a", "b"}),                       # one launch a step each
    ({"narrow": [_repeat([["a", "a"], ["a", "a"]])]}, {"a"}),                  # twice in a layer
    ({"narrow": [_repeat([["a"], ["a"]])], "verify": [_repeat([["b"], ["a"]])]}, {"a", "b"}),  # verify's a ends
    # where narrow's last is
    ({"narrow": [{"op": "x", "kernel_id": "a"}, _repeat([["a"], ["c"]])]}, set()),        # -1, then 0
    ({"narrow": [{"op": "x", "kernel_id": "a"}, _repeat([["a"], ["c"]]), {"op": "x", "kernel_id": "a"}]},
     {"a"}),                                                                    # -1 ... -1, then -1
])
def test_clashing_kernels(programs, bad):
    assert lora_sets.clashing({"programs": programs}, _kernels("a", "b")) == bad


def test_the_sets_wrap_at_their_count():
    """Layer 63 uses set 0, as the layers' -1 does: a kernel at both, back to back, clashes."""
    programs = {"narrow": [{"op": "x", "kernel_id": "a"}, _repeat([["c"]] * 63 + [["a"]])]}
    assert lora_sets.set_of(63) == lora_sets.set_of(None) == 0
    assert lora_sets.clashing({"programs": programs}, _kernels("a")) == {"a"}


def _sites(plan) -> list[dict]:
    return [l for e in plan["programs"]["narrow"] for body in e.get("kinds", {}).values() for l in body if "lora" in l]


@pytest.mark.parametrize("layers,sets", [(2, [True, False, True, False]), (1, [False] * 4)])
def test_a_build_keeps_sets_only_where_they_hold(tiny_model, tmp_path, layers, sets):
    """Two layers: q|k|v's and gate|up's kernels take their layer and a set a layer; o and down
    have one kernel (the tiny model's shapes), launched twice a layer: the departures. One layer:
    each kernel runs once a step, so the next step's launch would meet its own words: departures
    everywhere. Recorded in the launches' lora attrs."""
    d, _ = tiny_model("qwen3", num_hidden_layers=layers)
    _, plan = compile_model(model_dir=d, lora=lora_build(max_loras=2, max_lora_rank=8))
    generate(plan, tmp_path)
    sites = _sites(plan)
    assert [l["kernel"] for l in sites] == ["gemv", "gemv", "gemv_gated", "gemv"]
    assert sites[1]["kernel_id"] == sites[3]["kernel_id"]
    for launch, sets in zip(sites, sets):
        meta = plan["kernels"][launch["kernel_id"]]
        assert (lora_sets.SCRATCH in meta["scratch"]) is sets
        assert ("counters_lora" in meta["scratch"]) is not sets
        assert (["lset", "i32", "layer:"] in meta["params"]) is sets
        assert launch["lora"].get("sets", True) is sets
    assert not lora_sets.clashing(plan, {k: SimpleNamespace(id=k, meta=m) for k, m in plan["kernels"].items()})
