"""The GPU session's DeepSeek-V2-Lite fixtures (issue 13), checked on the CPU so a broken fixture
fails here rather than on a GPU:

- deepseek-v2-lite-l8 (tests/gpu/gpu_families.py, the golden gate's family) and deepseek-v2-lite
  (gpu_families.LATENCY, session.sh's `deepseek` stage): the published config values, where each
  was checked: PUBLISHED below is DeepSeek-V2-Lite's config.json as a transformers 5.7
  DeepseekV2Config dump of DeepSeek-V2-Lite-Chat shows it (same architecture; a public model report
  whose weight table sums to 15,706,484,224 parameters), and the spec's variant must equal it;
  the values DeepseekV2Config defaults to (its docstring names deepseek-ai/DeepSeek-V2-Lite, but
  its widths are the larger model's) agree where they should; tests/test_deepseek_v2.py's YaRN
  (factor 40, mscale = mscale_all_dim = 0.707, beta 32 / 1) is the published one; the config.json
  transformers writes binds the spec to the real shapes, and the full model has the published
  parameter count (HF on the meta device, and the plan's own weights).
- bench/active_floor.py: the bytes a batch-1 decode step reads, by hand on a tiny config and at
  the real shapes (2.45 B of the 15.7 B parameters), the floor arithmetic on a latency result made
  with bench/latency.py's own terms, and the latent KV bytes per token against a non-latent layout.
- tests/gpu/prepare.py's `deepseek` part builds both artifacts with cubins for both tuning tables,
  small enough to carry, and session.sh's `deepseek` stage names those same directories.
"""
import json
import math
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "gpu"))
import gpu_families  # noqa: E402

from infc.bench import active_floor as af  # noqa: E402
from infc.compiler.build import compile_model  # noqa: E402
from infc.compiler.contract import caches  # noqa: E402

FAMILY, FULL = "deepseek-v2-lite-l8", "deepseek-v2-lite"
# DeepSeek-V2-Lite's config.json (the architecture's keys; auto_map, aux_loss_alpha, seq_aux,
# scoring_func, moe_layer_freq and the token ids are not bound by the spec).
PUBLISHED = {"hidden_size": 2048, "num_hidden_layers": 27, "num_attention_heads": 16,
             "num_key_value_heads": 16, "q_lora_rank": None, "kv_lora_rank": 512,
             "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
             "intermediate_size": 10944, "moe_intermediate_size": 1408, "first_k_dense_replace": 1,
             "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6,
             "topk_method": "greedy", "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
             "norm_topk_prob": False, "vocab_size": 102400, "max_position_embeddings": 163840,
             "rms_norm_eps": 1e-6, "rope_theta": 10000, "tie_word_embeddings": False,
             "hidden_act": "silu", "attention_bias": False,
             "rope_scaling": {"type": "yarn", "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                              "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1}}
PARAMS = 15_706_484_224            # the published checkpoint's parameter count


def _plan(d):
    return compile_model(model_dir=str(d))[1]


def test_variant_is_the_published_config():
    _, values = gpu_families._spec_and_values(FULL)
    assert {k: values.get(k) for k in PUBLISHED} == PUBLISHED
    assert gpu_families.FAMILIES[FAMILY] == (FULL, {"num_hidden_layers": 8})
    assert gpu_families.LATENCY[FULL] == (FULL, {})
    assert FAMILY not in gpu_families.DEFAULT
    assert max(gpu_families.LONG_PROMPTS[FAMILY]) == 2048


def test_published_values_against_transformers_and_the_cpu_tests():
    from transformers import DeepseekV2Config
    from test_deepseek_v2 import YARN
    d = DeepseekV2Config()                 # defaults: the shared values are the Lite's
    for k in ("vocab_size", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
              "n_routed_experts", "n_shared_experts", "routed_scaling_factor", "topk_method",
              "norm_topk_prob", "rms_norm_eps"):
        assert getattr(d, k) == PUBLISHED[k], k
    # the Lite's own (DeepseekV2Config's defaults are another model's widths)
    assert (d.hidden_size, d.q_lora_rank, d.moe_intermediate_size) == (4096, 1536, 1407)
    yarn = {k: v for k, v in YARN.items() if k not in ("rope_type", "rope_theta", "original_max_position_embeddings")}
    assert yarn == {k: v for k, v in PUBLISHED["rope_scaling"].items()
                    if k not in ("type", "original_max_position_embeddings")}
    cfg = gpu_families.hf_config(FAMILY)
    assert type(cfg) is DeepseekV2Config and cfg.architectures == ["DeepseekV2ForCausalLM"]
    assert cfg.num_hidden_layers == 8 and cfg.qk_head_dim == 192 and cfg.num_key_value_heads == 16
    rp = cfg.rope_parameters
    assert (rp["rope_type"], rp["factor"], rp["mscale"], rp["mscale_all_dim"], rp["beta_fast"],
            rp["beta_slow"], rp["original_max_position_embeddings"], rp["rope_theta"]) == (
        "yarn", 40, 0.707, 0.707, 32, 1, 4096, 10000)


def test_a_shrink_keeps_kv_heads_equal_to_heads():
    """gpu_families.FOLLOW: MLA has no grouped K/V (the spec requires Hkv == Hq), so the tiny
    shrink of tests/test_gpu_families.py (4 heads, 2 K/V heads) makes 4 and 4."""
    cfg = gpu_families.hf_config(FAMILY, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 4)
    assert gpu_families.hf_config(FAMILY).num_key_value_heads == 16


def test_cut_binds_the_real_shapes(tmp_path):
    plan = _plan(gpu_families.write_config(FAMILY, tmp_path))
    c = plan["config"]
    assert (c["H"], c["L"], c["Hq"], c["Hkv"], c["Ql"], c["Dc"], c["Dn"], c["Dr"], c["Dv"], c["F"],
            c["Fe"], c["E"], c["K"], c["n_shared"], c["first_dense"], c["V"], c["method"], c["rsf"]) == (
        2048, 8, 16, 16, None, 512, 128, 64, 128, 10944, 1408, 64, 6, 2, 1, 102400, "greedy", 1.0)
    assert next(e for e in plan["programs"]["decode"] if "repeat" in e)["schedule"] == ["dense"] + ["moe"] * 7
    decl = caches.of_plan(plan)
    assert list(decl) == ["latent"] and caches.unit_elems(decl["latent"]) == 576
    m = 0.1 * 0.707 * math.log(40) + 1.0                  # YaRN's mscale on the softmax scale, squared
    assert c["sm_scale"] == pytest.approx(192 ** -0.5 * m * m, rel=1e-12)


def test_full_model_has_the_published_parameter_count(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM
    d = gpu_families.write_config(FULL, tmp_path)
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(gpu_families.hf_config(FULL))
    assert sum(p.numel() for p in hf.parameters()) == PARAMS
    plan = _plan(d)
    assert af.weight_bytes(plan) == 2 * PARAMS                    # bf16, nothing tied
    # active at batch 1: an embedding row; per layer attention (q_proj, kv_a, kv_b as W_uk + W_uv,
    # o_proj) and norms; layer 0's dense MLP; 26 x (router + 2 shared + 6 of 64 routed experts);
    # the final norm and lm_head
    H, Hq, Dc, V = 2048, 16, 512, 102400
    attn = Hq * 192 * H + (Dc + 64) * H + Hq * 256 * Dc + H * Hq * 128 + 2 * H + Dc
    active = H + 27 * attn + 3 * 10944 * H + 26 * (64 * H + 3 * 2816 * H + 6 * 3 * 1408 * H) + H + V * H
    assert sum(af.active_bytes(plan).values()) == 2 * active == 2 * 2_451_437_056


BASE = dict(vocab_size=320, hidden_size=64, intermediate_size=96, moe_intermediate_size=24,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, first_k_dense_replace=1,
            n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=3, q_lora_rank=None,
            max_position_embeddings=256, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def tiny_plan(tmp_path_factory):
    from transformers import DeepseekV2Config
    d = tmp_path_factory.mktemp("ds-tiny")
    cfg = DeepseekV2Config(**BASE)
    cfg.architectures = ["DeepseekV2ForCausalLM"]
    cfg.save_pretrained(d)                   # a config-only directory, as the latency stage's
    return _plan(d)


def test_active_bytes_by_hand(tiny_plan):
    H, Hq, Dn, Dr, Dv, Dc, F, Fe, E, K, S, V = 64, 4, 16, 8, 12, 32, 96, 24, 8, 3, 2, 320
    attn = Hq * (Dn + Dr) * H + (Dc + Dr) * H + Hq * (Dn + Dv) * Dc + H * Hq * Dv + 2 * H + Dc
    dense, moe = 3 * F * H, E * H + 3 * S * Fe * H + K * 3 * Fe * H
    want = 2 * (H + 3 * attn + dense + 2 * moe + H + V * H)
    got = af.active_bytes(tiny_plan)
    assert sum(got.values()) == want
    assert got["embed"] == 2 * H                                      # one row
    # 2 MoE layers, k of E routed experts and the S shared ones folded into the stack (S of its E + S)
    assert got["wes_gate_up"] == 2 * 2 * (K + S) * 2 * Fe * H and not any(w.startswith("ws_") for w in got)
    assert got["lm_head"] == 2 * V * H
    stored = 2 * (V * H + 3 * attn + dense + 2 * (E * H + 3 * S * Fe * H + E * 3 * Fe * H) + H + V * H)
    assert af.weight_bytes(tiny_plan) == stored


def test_tied_lm_head_reads_the_whole_table(tiny_plan):
    plan = json.loads(json.dumps(tiny_plan))
    plan["weights"]["lm_head"]["source"] = {"tied": "embed"}
    got = af.active_bytes(plan)
    assert "lm_head" not in got and got["embed"] == 2 * 320 * 64
    assert af.weight_bytes(plan) == af.weight_bytes(tiny_plan) - 2 * 320 * 64


def _latency_result(plan, bw=2.0e12, out_len=128, prompts=(32, 1024)):
    """What bench/latency.py writes for `plan` (its own floor terms), with made-up times."""
    decl = caches.of_plan(plan)
    kv_per_token, state_per_seq = caches.token_bytes(decl), caches.slot_bytes(decl)
    wb = af.weight_bytes(plan)
    res = {"gpu": "Fake GPU", "commit": "x", "date": "d", "model": plan["model"], "copy_GBps": bw / 1e9,
           "weight_bytes": wb, "kv_bytes_per_token": kv_per_token, "state_bytes_per_seq": state_per_seq,
           "ttft_ms": {}, "tpot_ms_by_prompt": {}, "floor_ms_by_prompt": {}}
    for i, n in enumerate(prompts):
        avg_ctx = n + out_len / 2
        res["floor_ms_by_prompt"][str(n)] = (wb + kv_per_token * avg_ctx + 2 * state_per_seq) / bw * 1e3
        res["tpot_ms_by_prompt"][str(n)] = 0.01 * (i + 1)
        res["ttft_ms"][str(n)] = 1.0 + i
    return res


def test_bench_latency_still_has_those_terms():
    src = (REPO / "bench" / "latency.py").read_text()
    assert "avg_ctx = n + out_len / 2" in src
    assert "floor = (r0.weights.bytes + kv_per_token * avg_ctx + 2 * state_per_seq) / bw * 1e3" in src
    assert '"copy_GBps": bw / 1e9' in src and '"weight_bytes": r0.weights.bytes' in src


def test_floor_arithmetic(tiny_plan, tmp_path):
    res = _latency_result(tiny_plan)
    out = af.floor(tiny_plan, res, 128)
    act = sum(af.active_bytes(tiny_plan).values())
    per_token = caches.token_bytes(caches.of_plan(tiny_plan))
    assert per_token == 3 * (32 + 8) * 2
    for n, tpot in (("32", 0.01), ("1024", 0.02)):
        f = (act + per_token * (int(n) + 64)) / 2.0e12 * 1e3
        assert out["active_floor_ms_by_prompt"][n] == pytest.approx(f, rel=1e-12)
        assert out["active_floor_ratio_by_prompt"][n] == pytest.approx(f / tpot, rel=1e-12)
        assert out["active_floor_ms_by_prompt"][n] < out["floor_ms_by_prompt"][n]
    assert out["active_floor_ratio"] == out["active_floor_ratio_by_prompt"]["32"]
    assert out["active_weight_bytes"] == act and out["output_len"] == 128
    kv = out["mla_kv_comparison"]
    assert kv["latent_bytes_per_token"] == per_token
    assert kv["non_latent_bytes_per_token"] == 3 * 4 * (16 + 8 + 12) * 2
    with pytest.raises(ValueError, match="output-len 64"):
        af.floor(tiny_plan, res, 64)                         # not the run's output length
    with pytest.raises(ValueError, match="not the artifact"):
        af.floor(tiny_plan, dict(res, weight_bytes=res["weight_bytes"] + 2), 128)
    art = tmp_path / "art"
    art.mkdir()
    (art / "plan.json").write_text(json.dumps(tiny_plan))
    lat = tmp_path / "latency.json"
    lat.write_text(json.dumps(res))
    af.main(["--artifact", str(art), "--latency", str(lat)])
    written = json.loads((tmp_path / f"latency-active-{tiny_plan['model']}-fake-gpu.json").read_text())
    assert written["active_floor_ms"] == pytest.approx(out["active_floor_ms"])
    assert "active floor" in af.report(out) and "non-latent" in af.report(out)


def test_kv_bytes_per_token_latent_vs_non_latent(tmp_path):
    kv = af.mla_kv_comparison(_plan(gpu_families.write_config(FULL, tmp_path)))
    # per layer 576 values (bf16) against 16 heads x (192 + 128); 27 layers
    assert kv == {"latent_bytes_per_token": 27 * 576 * 2, "non_latent_bytes_per_token": 27 * 16 * 320 * 2,
                  "latent_values_per_token_layer": 576, "non_latent_values_per_token_layer": 5120,
                  "non_latent_over_latent": pytest.approx(320 * 16 / 576)}


def test_session_stage_names_the_prepared_directories():
    src = (REPO / "tests" / "gpu" / "session.sh").read_text()
    stage = src[src.index("    deepseek|moe)"):]           # one stage, two models (moe: issue 11's)
    stage = stage[: stage.index(";;")]
    art, cfg = (p.relative_to(REPO).as_posix() for p in (gpu_families.artifact_dir(FULL), gpu_families.config_dir(FULL)))
    assert f"art={art} cfg={cfg}" in stage
    assert "--load-format dummy" in stage and "--prompts 32,1024" in stage
    assert stage.count("--output-len 128") == 2                 # bench latency and active_floor agree
    assert "infc.bench.active_floor" in stage
    assert "-e 's/ deepseek / /g'" in src and '-e "s/ moe / /g"' in src   # no served models made for them
    assert "art=.cache/artifacts/qwen3-30b-a3b cfg=.cache/gpu/configs/qwen3-30b-a3b" in stage


def test_prepare_part_builds_both_artifacts_with_cubins(tmp_path, monkeypatch):
    """prepare.py deepseek into a scratch .cache/gpu: config.json as transformers writes it and the
    artifact (H100 then H200 table, cubins of every kernel the plan names) for the cut and the
    full model. Compiles only what the kernel cache lacks (about a minute on 2 cores, cold)."""
    import prepare
    monkeypatch.setattr(gpu_families, "GPU_CACHE", tmp_path)
    prepare.main(["deepseek"])
    for name, layers in ((FAMILY, 8), (FULL, 27)):
        cfg = json.loads((tmp_path / "configs" / name / "config.json").read_text())
        assert cfg["num_hidden_layers"] == layers and cfg["architectures"] == ["DeepseekV2ForCausalLM"]
        art = tmp_path / f"{name}-art"
        plan = json.loads((art / "plan.json").read_text())
        assert plan["build"]["gpu"] == "h200" and plan["config"]["L"] == layers
        for kid in plan["kernels"]:
            assert (art / "bin" / f"{kid}.cubin").stat().st_size > 0, kid
        size = sum(f.stat().st_size for f in art.rglob("*") if f.is_file())
        assert size < 8 << 20, f"{name}: {size / 2**20:.1f} MiB to carry"


def test_bench_latency_reports_the_bytes_read_floor(tiny_plan):
    """bench latency's own result carries the active floor (an untied table and k of E experts
    are not read whole), and its table sets the TPOT against that floor, not the stored bytes'."""
    from infc.bench import latency
    res = _latency_result(tiny_plan)
    out = latency._with_active_floor(tiny_plan, res, 128)
    assert out["active_floor_ms_by_prompt"] == af.floor(tiny_plan, res, 128)["active_floor_ms_by_prompt"]
    row = latency.table(out)[2]
    f = out["active_floor_ms_by_prompt"]["32"]
    assert row == f"| 32 | infc | 0.010 | {f:.3f} | {100 * f / 0.01:.0f} % | 1.00 |"
    # a result from another plan (a rank's shard): no active floor, the reason kept, the stored floor shown
    other = dict(res, weight_bytes=res["weight_bytes"] + 1)
    kept = latency._with_active_floor(tiny_plan, other, 128)
    assert "active_floor_ms_by_prompt" not in kept and "not the artifact" in kept["active_floor_error"]
    assert f"{res['floor_ms_by_prompt']['32']:.3f}" in latency.table(kept)[2]


def test_experts_stored_stacked_read_k_of_e(tiny_plan):
    """An experts weight the checkpoint stores stacked [E, ...] (GPT-OSS's MXFP4 blocks: no
    stack recipe) reads k of its E slices as a stacked one does; the router ([E, H], read by the
    routing launch) stays whole."""
    plan = json.loads(json.dumps(tiny_plan))
    want = af.active_bytes(plan)
    plan["weights"]["wes_gate_up"]["source"] = {"mxfp4": "model.layers.{i}.mlp.experts.gate_up_proj_blocks"}
    got = af.active_bytes(plan)
    assert got["wes_gate_up"] == want["wes_gate_up"] and got == want
