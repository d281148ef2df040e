"""--enable-lora as a plan transform (compiler/passes/add_lora.py): the tables and launches it
adds, and the reference executor serving a batch that mixes adapters and the base model, checked
against the base plan over each adapter's merged weights (W + scale * B A)."""
import json

import numpy as np
import pytest

from infc.compiler.build import compile_model
from infc.config import lora_build
from infc.runtime.lora import tables
from infc.runtime.reference.executor import ReferenceExecutor, SeqChunk
from infc.compiler.contract.safetensors_io import Checkpoint
from infc.runtime.weights.load import load_weights

from lora_fixtures import merged_state_dict, random_adapter

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _plans(tiny_model, family="qwen3", fuse=True, **kw):
    d, hf = tiny_model(family)
    _, base = compile_model(model_dir=d, fuse=fuse)
    _, lora = compile_model(model_dir=d, fuse=fuse, lora=lora_build(**kw))
    return d, hf, base, lora


def _layer(plan, prog="narrow") -> list[dict]:
    """The launches of a program's layer kind(s)."""
    return [l for launch in plan["programs"][prog] for body in launch.get("kinds", {}).values() for l in body]


def _ops(plan, prologues=False) -> list[str]:
    """The launches' ops; prologues: a merged launch's producer too (merge_prologues)."""
    out = []
    for prog in plan["programs"].values():
        for launch in prog:
            for body in launch.get("kinds", {}).values():
                out += [p for l in body for p in ([l["prologue"]["op"]] if prologues and "prologue" in l else [])
                        + [l["op"]]]
            if "op" in launch:
                out.append(launch["op"])
    return out


def test_without_lora_the_plan_has_no_tables_and_no_slots(tiny_model):
    d, hf = tiny_model("qwen3")
    _, plan = compile_model(model_dir=d)
    assert "lora" not in plan and "lora_slots" not in plan["step_metadata"]
    assert not [o for o in _ops(plan) if o.startswith("lora")]
    assert not [w for w in plan["weights"] if "lora" in w]


def test_fused_linears_take_their_pieces_side_by_side(tiny_model):
    _, hf, base, plan = _plans(tiny_model, max_loras=3, max_lora_rank=8)
    lora = plan["lora"]
    assert {k: v for k, v in plan["step_metadata"]["lora_slots"].items() if k != "doc"} == \
        {"shape": ["T"], "dtype": "i32"}
    # the rows grouped by slot (runtime/lora/groups.py): S + 1 = max_loras + 2 segment starts
    assert [plan["step_metadata"][n]["shape"] for n in ("lora_rows", "lora_segs")] == [["T"], [5]]
    by_modules = {tuple(p["module"].rsplit(".", 1)[-1] for p in t["pieces"]): (a, t)
                  for a, t in lora["linears"].items()}
    assert set(by_modules) == {("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"),
                               ("down_proj",)}
    a, t = by_modules[("q_proj", "k_proj", "v_proj")]
    cfg = hf.config
    assert [p["n"] for p in t["pieces"]] == [cfg.num_attention_heads * cfg.head_dim,
                                             cfg.num_key_value_heads * cfg.head_dim,
                                             cfg.num_key_value_heads * cfg.head_dim]
    assert plan["weights"][a]["shape"] == [4, 3 * 8, cfg.hidden_size]
    assert plan["weights"][t["b"]]["shape"] == [4, sum(p["n"] for p in t["pieces"]), 8]
    assert plan["weights"][t["scale"]] == {"shape": [4, 3], "dtype": "f32", "layers": t["layers"],
                                           "source": {"zeros": [4, 3]}}
    ops = _ops(plan, prologues=True)
    # one shrink and one expand a target linear, in every program but the narrow one (below);
    # gate|up's expand takes the activation (passes/fuse_lora_act.py)
    assert ops.count("lora_shrink") == ops.count("lora_expand") + ops.count("lora_expand_act") \
        == 4 * (len(plan["programs"]) - 1)
    # a narrow step runs each site inside its linear's GEMV (merge_lora): the tables A, B, scale
    # after the GEMV's inputs, the expand's output its own; the residual add + RMSNorm merged in
    # front of q|k|v and gate|up as in the base plan, so the layer is as many launches as the base's
    narrow = _layer(plan)
    sites = [l for l in narrow if "lora" in l]
    assert not [l for l in narrow if l["op"].startswith("lora")] and len(sites) == 4
    assert [l["kernel"] for l in sites] == ["gemv", "gemv", "gemv_gated", "gemv"]
    assert all(l["inputs"][-3:] == [a, t["b"], t["scale"]] for l in sites for a, t in lora["linears"].items()
               if l["inputs"][-4] == a[:-len("_lora_a")])
    assert [l.get("prologue", {}).get("op") for l in sites] == ["add_rms_norm", None, "add_rms_norm", None]
    assert len(narrow) == len(_layer(base))
    assert ops.count("lora_shrink") - _ops(plan).count("lora_shrink") == 0
    assert ops.count("lora_expand_act") == len(plan["programs"]) - 1 and "act_mul" not in ops   # narrow: in the gated GEMV
    # a decode step's sites are separate launches (infc/config.py LORA_DECODE_SITES: in the GEMVs,
    # test_decode_sites_switch_on_into_the_gemvs), 8 a layer more than the base's
    decode = _layer(plan, "decode")
    assert not [l for l in decode if "lora" in l]
    assert len(decode) == len(_layer(base, "decode")) + 8
    # weights other than the tables are the base plan's
    assert {w: m for w, m in plan["weights"].items() if "_lora_" not in w} == base["weights"]


def test_targets_choose_the_linears(tiny_model):
    _, _, _, plan = _plans(tiny_model, target_modules=["v_proj", "down_proj"])
    pieces = [[p["module"] and p["module"].rsplit(".", 1)[-1] for p in t["pieces"]]
              for t in plan["lora"]["linears"].values()]
    assert sorted(pieces, key=str) == [["down_proj"], [None, None, "v_proj"]]
    with pytest.raises(Exception, match="no linear of the model reads a checkpoint module named"):
        _plans(tiny_model, target_modules=["nope_proj"])


def _oracle_logits(d, hf, base, adapter, prompt, fuse):
    """The base plan over the checkpoint with the adapter merged in."""
    from safetensors.numpy import save_file
    import shutil
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(d / "config.json", tmp)
        save_file(merged_state_dict(hf, adapter), f"{tmp}/model.safetensors", metadata={"format": "pt"})
        ex = ReferenceExecutor(base, load_weights(base, Checkpoint(tmp)))
        first = ex.step([SeqChunk(0, prompt[:-2], 0)])[0]
        return first, ex.step([SeqChunk(0, prompt[-2:], len(prompt) - 2)])[0]


@pytest.mark.parametrize("fuse", [True, False])
def test_a_batch_mixing_adapters_equals_each_merged_model(tiny_model, fuse):
    d, hf, base, plan = _plans(tiny_model, fuse=fuse, max_loras=4, max_lora_rank=16)
    adapters = [random_adapter(hf, "all16", 16, ALL, 1),
                random_adapter(hf, "qv8", 8, ("q_proj", "v_proj"), 2),
                random_adapter(hf, "mlp", 4, ("gate_proj", "up_proj", "down_proj"), 3, ranks={"down_proj": 12}),
                random_adapter(hf, "ko", 16, ("k_proj", "o_proj"), 4)]
    weights = load_weights(plan, Checkpoint(d))
    put = tables.numpy_put(plan, weights)
    for slot, a in enumerate(adapters, 1):
        tables.check(plan, a)
        tables.write(plan, put, slot, a)
    gen = np.random.default_rng(0)
    prompts = [list(gen.integers(1, 300, n)) for n in (9, 5, 12, 7, 6)]
    slots = [2, 0, 4, 1, 3]                        # the base model among them, in no order
    ex = ReferenceExecutor(plan, weights)
    first = ex.step([SeqChunk(i, p[:-2], 0) for i, p in enumerate(prompts)], lora=slots)
    second = ex.step([SeqChunk(i, p[-2:], len(p) - 2) for i, p in enumerate(prompts)], lora=slots)
    for i, (p, s) in enumerate(zip(prompts, slots)):
        want = _oracle_logits(d, hf, base, adapters[s - 1] if s else None, p, fuse)
        for got, w in zip((first[i], second[i]), want):
            err = np.abs(got - w).max() / np.abs(w).max()
            assert err < 1e-5, (i, s, err)
    # the adapters change the logits (a LoRA that added nothing would pass the above for slot 0)
    assert min(np.abs(second[i] - second[1]).max() for i in (0, 2, 3, 4)) > 1e-2


def test_a_rewritten_slot_serves_the_new_adapter_and_zeros_serve_the_base(tiny_model):
    d, hf, base, plan = _plans(tiny_model, max_loras=1, max_lora_rank=8)
    weights = load_weights(plan, Checkpoint(d))
    put = tables.numpy_put(plan, weights)
    prompt = [5, 9, 11, 200, 3, 7]
    base_logits = ReferenceExecutor(base, load_weights(base, Checkpoint(d))).step([SeqChunk(0, prompt, 0)])
    tables.write(plan, put, 1, random_adapter(hf, "a", 8, ALL, 7))
    tables.write(plan, put, 1, None)
    got = ReferenceExecutor(plan, weights).step([SeqChunk(0, prompt, 0)], lora=[1])
    np.testing.assert_allclose(got, base_logits, rtol=0, atol=1e-5 * np.abs(base_logits).max())


def test_inspect_shows_the_lora_launches_and_their_kernels(tiny_model, monkeypatch):
    import infc.config
    from infc.compiler.inspect import inspect
    d, _ = tiny_model("qwen3")
    text = inspect(model_dir=d, lora=lora_build(2, 8), phases=["wide"])
    assert "not rendered" not in text
    launches = [line for line in text.splitlines() if line.strip().startswith(("lora_shrink ", "lora_expand ", "lora_expand_act "))]
    assert len(launches) == 8 and all("lora_shrink_" in line or "lora_expand_" in line for line in launches)
    assert "add_lora" in text and "model.layers.{i}.self_attn.q_proj" in text
    # with LORA_DECODE_SITES a decode step's sites run in their GEMVs (merge_lora): the tables
    # among the GEMV's inputs
    monkeypatch.setattr(infc.config, "LORA_DECODE_SITES", True)
    text = inspect(model_dir=d, lora=lora_build(2, 8), phases=["decode"])
    launch = [line for line in text.splitlines() if line.strip().startswith("linear ") and "(" in line]
    assert not [line for line in text.splitlines() if line.strip().startswith(("lora_shrink ", "lora_expand"))]
    assert len(launch) == 4 and all("_lora_a, " in line and " gemv" in line for line in launch)


def test_what_lora_does_not_serve_yet_is_refused_at_build(tiny_model, fp8_pair):
    d, _ = tiny_model("qwen3")
    with pytest.raises(Exception, match="--enable-lora with --tensor-parallel-size"):
        compile_model(model_dir=d, lora=lora_build(), parallel={"world": 2, "rank": 0, "tp": 2, "ep": 1})
    _, quantized = fp8_pair
    with pytest.raises(Exception, match="--enable-lora with a quantized checkpoint: not supported yet"):
        compile_model(model_dir=quantized, lora=lora_build())
    with pytest.raises(ValueError, match=r"--max-lora-rank must be in \[1, 256\], got 512"):
        lora_build(max_lora_rank=512)


def test_layer_kinds_share_their_tables(family_model):
    """gemma3: sliding and global layers are two bodies reading the same weights, and so the
    same adapter tables."""
    d, hf = family_model("gemma3")
    _, base = compile_model(model_dir=d)
    _, plan = compile_model(model_dir=d, lora=lora_build(1, 8))
    body_kinds = [l for l in plan["programs"]["prefill"] if "kinds" in l][0]["kinds"]
    assert len(body_kinds) == 2 and all("lora_expand" in [x["op"] for x in b] for b in body_kinds.values())
    adapter = random_adapter(hf, "a", 8, ALL, 3)
    weights = load_weights(plan, Checkpoint(d))
    tables.write(plan, tables.numpy_put(plan, weights), 1, adapter)
    prompt = [5, 9, 11, 200, 3, 7, 40, 41, 8]
    ex = ReferenceExecutor(plan, weights)
    first = ex.step([SeqChunk(0, prompt[:-2], 0)], lora=[1])[0]
    second = ex.step([SeqChunk(0, prompt[-2:], len(prompt) - 2)], lora=[1])[0]
    for got, want in zip((first, second), _oracle_logits(d, hf, base, adapter, prompt, True)):
        assert np.abs(got - want).max() / np.abs(want).max() < 1e-5


def test_decode_sites_switch_on_into_the_gemvs(tiny_model, monkeypatch):
    """infc/config.py LORA_DECODE_SITES True (the A/B side of tests/gpu/prepare.py's lora-rows): a
    decode step's sites run in their GEMVs (their rows as a block: triton/_lora_rows.j2), with no
    prologue (the decode program merges none); the narrow step is the same either way."""
    import infc.config
    _, _, base, off = _plans(tiny_model, max_loras=2, max_lora_rank=8)
    monkeypatch.setattr(infc.config, "LORA_DECODE_SITES", True)
    _, _, _, on = _plans(tiny_model, max_loras=2, max_lora_rank=8)
    ops = lambda p, prog: [l["op"] for l in _layer(p, prog)]  # noqa: E731
    split = [o for o in ops(off, "decode") if o.startswith("lora")]
    assert sorted(split) == ["lora_expand"] * 3 + ["lora_expand_act"] + ["lora_shrink"] * 4, split
    decode = _layer(on, "decode")
    sites = [l for l in decode if "lora" in l]
    assert not [l for l in decode if l["op"].startswith("lora")] and len(sites) == 4
    assert [l["kernel"] for l in sites] == ["gemv", "gemv", "gemv_gated", "gemv"]
    assert not [l for l in sites if "prologue" in l] and len(decode) == len(_layer(base, "decode"))
    assert ops(off, "narrow") == ops(on, "narrow")


def test_decode_expands_switch_on_into_the_gemvs_with_their_shrinks_apart(tiny_model, monkeypatch):
    """infc/config.py LORA_DECODE_EXPAND: a decode step's expands run in their GEMVs (gemv.py.j2
    LAPART), each site's shrink a launch of its own right before its GEMV, which reads the
    shrink's output where the in-launch form reads A; the narrow step is the same either way."""
    import infc.config
    _, _, _, off = _plans(tiny_model, max_loras=2, max_lora_rank=8)
    monkeypatch.setattr(infc.config, "LORA_DECODE_EXPAND", True)
    _, _, _, on = _plans(tiny_model, max_loras=2, max_lora_rank=8)
    decode = _layer(on, "decode")
    ops = [l["op"] for l in decode]
    assert "lora_expand" not in ops and "lora_expand_act" not in ops and ops.count("lora_shrink") == 4
    sites = [i for i, l in enumerate(decode) if "lora" in l]
    assert len(sites) == 4 and [decode[i]["kernel"] for i in sites] == ["gemv", "gemv", "gemv_gated", "gemv"]
    for i in sites:
        shrink, site = decode[i - 1], decode[i]
        assert shrink["op"] == "lora_shrink" and site["lora"]["shrink"] == "apart"
        assert site["inputs"][-3] == shrink["outputs"][0] and site["inputs"][0] == shrink["inputs"][0]
    assert len(decode) == len(_layer(off, "decode")) - 4
    assert [l["op"] for l in _layer(off, "narrow")] == [l["op"] for l in _layer(on, "narrow")]


def test_wide_off_refuses_a_decode_program_with_lora_sites(tiny_model, monkeypatch, fake_driver):
    """INFC_WIDE=0 (A/B timing) would run steps of any width on the decode program, past the rows
    its LoRA sites' scratch holds: refused naming why; a plan with the sites split runs it."""
    import infc.config
    from infc.runtime.cuda import runner as runner_mod
    _, _, _, off = _plans(tiny_model, max_loras=2, max_lora_rank=8)
    monkeypatch.setattr(infc.config, "LORA_DECODE_SITES", True)
    _, _, _, on = _plans(tiny_model, max_loras=2, max_lora_rank=8)
    monkeypatch.setenv("INFC_WIDE", "0")
    with pytest.raises(ValueError, match="LoRA sites take at most 127 rows"):
        runner_mod.ab_programs(on)
    assert "wide" not in runner_mod.ab_programs(off)["programs"]
    # the expands alone in the GEMVs (LORA_DECODE_EXPAND) keep no rows in scratch: any width runs
    monkeypatch.setattr(infc.config, "LORA_DECODE_SITES", False)
    monkeypatch.setattr(infc.config, "LORA_DECODE_EXPAND", True)
    _, _, _, apart = _plans(tiny_model, max_loras=2, max_lora_rank=8)
    assert "wide" not in runner_mod.ab_programs(apart)["programs"]
