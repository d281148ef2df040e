"""The GPU suite's Qwen3.5 fixtures (tests/gpu/gpu_families.py, issue 12), checked on the CPU so a
broken fixture fails here rather than in a GPU session.

- qwen3.5-4b-l8 (the golden gate's family): the real 4B shapes cut to 8 layers, hybrid pattern kept
  (layers 3 and 7 full attention); its config.json binds specs/qwen3_5.yaml to those shapes and the
  plan declares the slot caches (conv, recurrent) on the six linear-attention layers, the paged k/v
  on the two full-attention ones, and `state_slots` step metadata.
- qwen3.5-4b (the latency benchmark's full 32-layer config): 24 linear + 8 full layers; the state
  bytes per sequence the latency floor counts.
- The fixture's model at tiny widths, made by the same code as on the GPU (make_model, bf16,
  save_pretrained): every norm, dt_bias, A_log and conv weight random as gpu_families says (the
  gated norm around 1, the (1 + w) norms around 0, A log-uniform in HF's [0.01, 16]), and the
  reference executor matches transformers (float32) on it at every position.
- A transformers without the family's class gives one clear line.
- The driver loop (tests/gpu/driver_loop.py) gives batched sequences distinct state slots.
"""
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
import gpu_families  # noqa: E402

from infc.compiler.build import compile_model  # noqa: E402
from infc.compiler.contract import caches  # noqa: E402

FAMILY = "qwen3.5-4b-l8"
LIN, FULL = "linear_attention", "full_attention"
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, vocab_size=512, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=24)


def _plan(d):
    return compile_model(model_dir=str(d))[1]


def _schedule(plan):
    return next(e for e in plan["programs"]["decode"] if "repeat" in e)["schedule"]


def test_family_binds_real_shapes_and_declares_slot_caches(tmp_path):
    assert FAMILY in gpu_families.FAMILIES and FAMILY not in gpu_families.DEFAULT
    plan = _plan(gpu_families.write_config(FAMILY, tmp_path))
    c = plan["config"]
    real = gpu_families._spec_and_values("qwen3.5-4b")[1]       # the 4B's text config, uncut
    assert (c["H"], c["F"], c["Hq"], c["Hkv"], c["D"], c["V"]) == (
        real["hidden_size"], real["intermediate_size"], real["num_attention_heads"],
        real["num_key_value_heads"], real["head_dim"], real["vocab_size"]) == (2560, 9216, 16, 4, 256, 248320)
    assert (c["Hk"], c["Hv"], c["Dk"], c["Dv"], c["Kc"], c["R"], c["L"]) == (16, 32, 128, 128, 4, 64, 8)
    assert _schedule(plan) == [LIN] * 3 + [FULL] + [LIN] * 3 + [FULL]
    assert plan["weights"]["embed"]["source"] == {"tensor": "model.embed_tokens.weight"}
    assert "tied" in plan["weights"]["lm_head"]["source"]
    decl = caches.of_plan(plan)
    assert {n: (d["kind"], d["layers"]) for n, d in decl.items()} == {
        "conv": ("slot", [0, 1, 2, 4, 5, 6]), "recurrent": ("slot", [0, 1, 2, 4, 5, 6]),
        "k": ("paged", [3, 7]), "v": ("paged", [3, 7])}
    assert decl["recurrent"]["shape"] == [32, 128, 128] and decl["recurrent"]["dtype"] == "f32"
    assert decl["conv"]["shape"] == [3, 2 * 2048 + 4096]
    assert "state_slots" in plan["step_metadata"]
    templates, rules = set(), []
    for phase in ("prefill", "decode", "mixed"):
        for e in plan["programs"][phase]:
            for body in e.get("kinds", {}).values():
                templates |= {launch["kernel"] for launch in body}
                rules += [launch["attrs"] for launch in body if launch["op"] == "gated_delta_rule"]
    assert {"causal_conv1d", "gated_delta_rule_chunk", "gated_delta_rule_decode", "gated_rms_norm"} <= templates
    # q / k's l2 norms and the gates in the delta rule's launch (compiler/passes/fuse_delta_rule.py)
    assert rules and all(a.get("qk_norm") == 1e-6 and a.get("gates") == "bf16" for a in rules)
    assert "l2_norm" not in templates


def test_latency_config_is_the_full_model(tmp_path):
    plan = _plan(gpu_families.write_config("qwen3.5-4b", tmp_path))
    assert plan["config"]["L"] == 32
    assert _schedule(plan) == ([LIN] * 3 + [FULL]) * 8
    decl = caches.of_plan(plan)
    # per sequence: 24 layers x (recurrent 32 x 128 x 128 f32 + conv 3 x 8192 bf16)
    assert caches.slot_bytes(decl) == 24 * (32 * 128 * 128 * 4 + 3 * 8192 * 2)
    assert caches.token_bytes(decl) == 8 * 2 * 4 * 256 * 2          # k and v of 8 layers, bf16


def test_latency_floor_counts_state_read_and_written():
    src = (Path(__file__).resolve().parent.parent / "bench" / "latency.py").read_text()
    assert "caches.slot_bytes(decl)" in src and "2 * state_per_seq" in src


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = gpu_families.make_model(FAMILY, tmp_path_factory.mktemp("q35") / FAMILY, device="cpu", **TINY)
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    return d, hf


def test_tiny_fixture_redraw(tiny):
    d, hf = tiny
    assert type(hf).__name__ == "Qwen3_5ForCausalLM"
    assert list(hf.config.layer_types) == [LIN] * 3 + [FULL]      # the cut keeps the pattern
    p = {k: v.detach() for k, v in hf.named_parameters()}
    gated = [v for k, v in p.items() if k.endswith("linear_attn.norm.weight")]
    ones = [v for k, v in p.items() if k.endswith("norm.weight") and not k.endswith("linear_attn.norm.weight")]
    assert len(gated) == 3 and len(ones) == 3 * 2 + 2 + 1 + 2     # 3 lin x 2, full x 2, q/k, final
    for w in gated:
        assert abs(float(w.mean()) - 1) < 0.1 and 0.05 < float(w.std()) < 0.2
    for w in ones:
        assert abs(float(w.mean())) < 0.1 and 0.05 < float(w.std()) < 0.2
    a_log = torch.cat([v for k, v in p.items() if k.endswith("A_log")])
    assert float(a_log.min()) >= math.log(0.01) - 1e-2 and float(a_log.max()) <= math.log(16) + 1e-2
    assert float(a_log.std()) > 0.5
    dt = torch.cat([v for k, v in p.items() if k.endswith("dt_bias")])
    assert abs(float(dt.mean()) - 1) < 0.1 and float(dt.std()) > 0.02
    conv = torch.cat([v.flatten() for k, v in p.items() if k.endswith("conv1d.weight")])
    assert 0.2 < float(conv.std()) < 0.4


def test_tiny_fixture_reference_matches_hf(tiny):
    from infc.runtime.reference.executor import ReferenceExecutor, SeqChunk
    from infc.compiler.contract.safetensors_io import Checkpoint
    from infc.runtime.weights.load import load_weights
    d, hf = tiny
    prompt = [int(t) for t in np.random.default_rng(3).integers(0, 512, 24)]
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([prompt])).logits[0].float().numpy()
    plan = _plan(d)
    weights = load_weights(plan, Checkpoint(d))
    ex = ReferenceExecutor(plan, weights)
    got = ex.step([SeqChunk(0, prompt[:16], 0)])            # prefill, then decode through the slot
    err = [float(np.abs(got[0] - want[15]).max())]
    for p in range(16, 24):
        err.append(float(np.abs(ex.step([SeqChunk(0, [prompt[p]], p)])[0] - want[p]).max()))
    assert max(err) <= 1e-3, err
    assert np.abs(want[1:] - want[:-1]).max() > 0.1                 # not a near-constant model


def test_missing_transformers_class_is_one_clear_line(monkeypatch):
    spec, values = gpu_families._spec_and_values(FAMILY)

    class Fake:
        architectures = ["NoSuchModelForCausalLM"]
        family = spec.family
    monkeypatch.setattr(gpu_families, "_spec_and_values", lambda name: (Fake, values))
    msg = gpu_families.hf_missing(FAMILY)
    assert msg and "\n" not in msg and "NoSuchModelForCausalLM" in msg and "qwen3_5" in msg
    with pytest.raises(RuntimeError, match="NoSuchModelForCausalLM"):
        gpu_families.hf_config(FAMILY)
    monkeypatch.undo()
    assert gpu_families.hf_missing(FAMILY) is None


def test_driver_loop_gives_batched_sequences_distinct_slots():
    from driver_loop import Pages, step
    from infc.runtime.engine.step import Chunk

    class Runner:
        num_slots = 4
        seen = []

        def logits(self, meta):
            self.seen.append(meta.state_slots.tolist())
            return np.zeros((meta.B, 1), np.float32)
    r, pages = Runner(), Pages(64, 16)
    step(r, pages, [Chunk(i, [1, 2, 3], 0) for i in (7, 3, 9)])
    step(r, pages, [Chunk(i, [4], 3) for i in (7, 3, 9)])
    assert r.seen == [[0, 1, 2], [0, 1, 2]]
    pages.release(3)
    step(r, pages, [Chunk(5, [1], 0), Chunk(9, [5], 4)])
    assert r.seen[-1] == [1, 2]                       # the freed slot is reused, 9 keeps its own
    step(r, pages, [Chunk(6, [1], 0)])
    with pytest.raises(RuntimeError, match="state slots"):
        step(r, pages, [Chunk(8, [1], 0)])
