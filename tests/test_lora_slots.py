"""Adapters in device slots (runtime/lora/slots.py): registration checks everything first (a bad
adapter changes nothing and the others keep serving), LRU eviction among idle slots, a host cache
of --max-cpu-loras adapters, and the outputs of an adapter the same in whatever slot it lands."""
import json
import shutil

import numpy as np
import pytest

from infc.compiler.build import compile_model
from infc.compiler.contract.safetensors_io import Checkpoint
from infc.config import lora_build
from infc.runtime.lora import tables
from infc.runtime.lora.slots import LoraSlots
from infc.runtime.lora.tables import AdapterError
from infc.runtime.reference.executor import ReferenceExecutor, SeqChunk
from infc.runtime.weights.load import load_weights

from make_lora_adapter import make_adapter


@pytest.fixture(scope="module")
def served(tiny_model, tmp_path_factory):
    """(model dir, LoRA plan with 2 slots of rank 16, adapters dir with a..d)."""
    d, _ = tiny_model("qwen3")
    _, plan = compile_model(model_dir=d, lora=lora_build(2, 16))
    root = tmp_path_factory.mktemp("adapters")
    for i, name in enumerate("abcd"):
        make_adapter(d, root / name, rank=(8, 16, 4, 12)[i], alpha=16, seed=i,
                     targets=(["q_proj", "v_proj"] if name == "c" else
                              ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    return d, plan, root


def _slots(served, **kw):
    d, plan, root = served
    weights = load_weights(plan, Checkpoint(d))
    return LoraSlots(plan, tables.numpy_put(plan, weights), **kw), weights


def _tables(plan, weights) -> list:
    return [np.array(w) for name in sorted(weights) if "_lora_" in name for w in weights[name]]


PROMPT = [3, 99, 41, 7, 250, 18, 6, 77]


def _logits(plan, weights, slot):
    return ReferenceExecutor(plan, weights).step([SeqChunk(0, PROMPT, 0)], lora=[slot])[0]


def test_lru_eviction_among_idle_slots_and_the_same_outputs_in_any_slot(served):
    d, plan, root = served
    slots, weights = _slots(served, max_cpu_loras=3)
    ids = [slots.register(n, root / n) for n in "abcd"]
    assert len(set(ids)) == 4 and list(slots.host) == ids[1:]    # the host cache keeps the last 3
    assert slots.acquire("a") == 1 and slots.acquire("b") == 2
    alone = {"a": _logits(plan, weights, 1), "b": _logits(plan, weights, 2)}
    a, b, c, d = ids
    slots.release(a)
    assert slots.acquire("c") == 1                             # a was the idle one: evicted
    assert slots.acquire("d") is None                          # b and c are running: d waits
    slots.release(b)
    assert slots.acquire("d") == 2 and slots.loads == 4
    alone["d"] = _logits(plan, weights, 2)
    slots.release(c)
    slots.release(d)
    # b comes back into c's slot (the least recently used), a into d's, read again from disk
    # where the host cache dropped them: the same logits as before, in the other slots
    assert slots.acquire("b") == 1 and slots.acquire("a") == 2
    np.testing.assert_array_equal(_logits(plan, weights, 1), alone["b"])
    np.testing.assert_array_equal(_logits(plan, weights, 2), alone["a"])
    assert np.abs(alone["a"] - alone["b"]).max() > 1e-3
    slots.release(a)
    assert slots.acquire("d") == 2                             # a idle, d takes its slot
    np.testing.assert_array_equal(_logits(plan, weights, 2), alone["d"])


def test_unloading_a_running_adapter_clears_its_slot_when_its_last_request_ends(served):
    d, plan, root = served
    slots, weights = _slots(served)
    first = slots.register("a", root / "a")
    base = _logits(plan, weights, 0)
    assert slots.acquire("a") == 1 and slots.acquire("a") == 1
    slots.unregister("a")
    assert np.abs(_logits(plan, weights, 1) - base).max() > 1e-3    # still serving its requests
    slots.release(first)
    assert np.abs(_logits(plan, weights, 1) - base).max() > 1e-3
    slots.release(first)
    np.testing.assert_array_equal(_logits(plan, weights, 1), base)  # zeros: the base model
    assert slots.register("a", root / "b") != first                 # a new id: a new prefix cache key
    with pytest.raises(AdapterError, match="'zz' is not loaded"):
        slots.acquire("zz")


def _corrupt(root, tmp_path, how):
    """A copy of adapter a broken one way."""
    bad = tmp_path / "bad"
    shutil.copytree(root / "a", bad)
    cfg_path = bad / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    how(bad, cfg)
    if cfg_path.exists() and cfg is not None:
        cfg_path.write_text(json.dumps(cfg))
    return bad


def _retensor(bad, change):
    from safetensors.numpy import load_file, save_file
    t = load_file(bad / "adapter_model.safetensors")
    change(t)
    save_file(t, bad / "adapter_model.safetensors")


Q = "base_model.model.model.layers.1.self_attn.q_proj"
MALFORMED = {
    "missing directory": (lambda b, c: shutil.rmtree(b), r"no such directory"),
    "no config": (lambda b, c: (b / "adapter_config.json").unlink() or c.clear() or None,
                  r"no adapter_config.json"),
    "config not json": (None, r"adapter_config.json is not JSON"),         # written below
    "not lora": (lambda b, c: c.update(peft_type="IA3"), r"peft_type is 'IA3'"),
    "rank above max": (None, r"rank 32, above --max-lora-rank 16"),      # made at rank 32 below
    "unknown target": (lambda b, c: c.update(target_modules=["q_proj", "lm_head"]),
                       r"target_modules \['lm_head'\] are not modules this build adapts"),
    "unknown module tensor": (lambda b, c: _retensor(b, lambda t: t.update({
        "base_model.model.lm_head.lora_A.weight": np.ones((8, 64), np.float32),
        "base_model.model.lm_head.lora_B.weight": np.ones((320, 8), np.float32)})),
        r"module 'lm_head' is not one this build adapts"),
    "wrong K": (lambda b, c: _retensor(b, lambda t: t.update({
        Q + ".lora_A.weight": np.ones((8, 65), np.float32)})), r"'model.layers.1.self_attn.q_proj.lora_A.weight' is \[8, 65\]"),
    "wrong N": (lambda b, c: _retensor(b, lambda t: t.update({
        Q + ".lora_B.weight": np.ones((95, 8), np.float32)})), r"lora_B.weight' is \[95, 8\].*N = 96"),
    "missing B": (lambda b, c: _retensor(b, lambda t: t.pop(Q + ".lora_B.weight")),
                  r"module 'model.layers.1.self_attn.q_proj' has a lora_A weight but no lora_B"),
    "rank differs from config": (lambda b, c: c.update(r=4), r"lora_A.weight' is \[8, \d+\], adapter_config.json gives module '[\w.]+' rank 4"),
    "dora": (lambda b, c: c.update(use_dora=True), r"'use_dora': True is not supported"),
    "dora magnitudes": (lambda b, c: _retensor(b, lambda t: t.update({
        Q + ".lora_magnitude_vector": np.ones(96, np.float32)})), r"lora_magnitude_vector' is not a LoRA A or B weight"),
    "pickle only": (lambda b, c: (b / "adapter_model.safetensors").rename(b / "adapter_model.bin"),
                    r"no adapter_model.safetensors \(adapter_model.bin is a pickle"),
    "truncated weights": (lambda b, c: (b / "adapter_model.safetensors").write_bytes(b"\x10\x00"),
                          r"not a readable safetensors file"),
    "non-finite": (lambda b, c: _retensor(b, lambda t: t.update({
        Q + ".lora_B.weight": np.full((96, 8), np.nan, np.float32)})), r"non-finite"),
    "bad alpha": (lambda b, c: c.update(lora_alpha="16"), r"'lora_alpha' must be a positive number"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_adapter_is_refused_naming_what_and_nothing_changes(case, served, tmp_path):
    d, plan, root = served
    slots, weights = _slots(served)
    slots.register("good", root / "b")
    assert slots.acquire("good") == 1
    before = _tables(plan, weights)
    how, message = MALFORMED[case]
    if case == "rank above max":
        bad = tmp_path / "bad"
        make_adapter(d, bad, rank=32, alpha=16)
    elif case == "config not json":
        bad = _corrupt(root, tmp_path, lambda b, c: None)
        (bad / "adapter_config.json").write_text("{r: 8,")
    else:
        bad = _corrupt(root, tmp_path, how)
    with pytest.raises(AdapterError, match=message) as e:
        slots.register("bad", bad)
    assert "'bad'" in str(e.value) or "LoRA adapter" in str(e.value)
    assert slots.names() == ["good"] and "bad" not in slots.host
    for x, y in zip(before, _tables(plan, weights)):
        np.testing.assert_array_equal(x, y)
    assert slots.acquire("good") == 1                           # the others keep serving
