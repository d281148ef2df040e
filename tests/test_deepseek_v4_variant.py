"""The deepseek-v4-flash variant: its config.json values in the reference code's keys
(compress_ratios, num_hash_layers, rope_scaling) agree with the same values in transformers' keys
(layer_types, mlp_layer_types, compress_rates, rope_parameters.compress) that the spec reads, and
its committed plan (kept fresh by tests/test_build.py) lays the attention types and their caches out
over the 43 layers as the published ratios say."""
import json

from infc.compiler.build import GENERATED
from infc.compiler.spec import find_variant

TYPES = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}


def test_flash_variant_binds_both_spellings_alike():
    _, cfg = find_variant("deepseek-v4-flash")
    L = cfg["num_hidden_layers"]
    ratios = cfg["compress_ratios"]
    assert len(ratios) == L + cfg["num_nextn_predict_layers"]      # the last one is the MTP layer's
    assert cfg["layer_types"] == [TYPES[r] for r in ratios[:L]]
    assert cfg["compress_rates"] == {TYPES[r]: r for r in ratios if r}
    assert cfg["mlp_layer_types"] == ["hash_moe" if i < cfg["num_hash_layers"] else "moe" for i in range(L)]
    compress, scaling = cfg["rope_parameters"]["compress"], cfg["rope_scaling"]
    assert compress["rope_theta"] == cfg["compress_rope_theta"] and compress["attention_factor"] == 1.0
    assert {k: compress[k] for k in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow")} \
        == {k: scaling[k] for k in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow")}
    assert compress["rope_type"] == scaling["type"] == "yarn"


def test_flash_variant_converts_as_transformers_does():
    """transformers' DeepseekV4Config, given only the reference keys, derives the keys the spec
    reads with the variant's values."""
    from transformers import DeepseekV4Config
    _, cfg = find_variant("deepseek-v4-flash")
    derived = ("layer_types", "mlp_layer_types", "compress_rates", "rope_parameters")
    hf = DeepseekV4Config(**{k: v for k, v in cfg.items() if k not in derived})
    assert hf.layer_types == cfg["layer_types"] and hf.mlp_layer_types == cfg["mlp_layer_types"]
    assert hf.compress_rates == cfg["compress_rates"]
    assert {k: hf.rope_parameters["compress"][k] for k in cfg["rope_parameters"]["compress"]} \
        == cfg["rope_parameters"]["compress"]


def test_flash_plan_lays_out_the_attention_types():
    plan = json.loads((GENERATED / "deepseek-v4-flash" / "plan.json").read_text())
    assert plan["config"]["L"] == 43 and plan["config"]["E"] == 256 and plan["config"]["K"] == 6
    caches = plan["caches"]
    assert caches["k"]["layers"] == [0, 1]                            # sliding window alone
    assert caches["csa"]["layers"] == caches["ikv"]["layers"] == list(range(2, 43, 2))
    assert caches["hca"]["layers"] == list(range(3, 42, 2))
    assert (caches["csa"]["every"], caches["hca"]["every"]) == (4, 128)
    assert plan["weights"]["table"]["layers"] == [0, 1, 2]            # hash-routed
    assert plan["weights"]["router_bias"]["layers"] == list(range(3, 43))
