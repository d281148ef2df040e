"""A config key written `key?` in a spec (compiler/spec.py, Binding.null_is_value): a null in
config.json is the value none, where an absent key takes the spec's default. transformers' config
classes keep an explicit null (sliding_window: null is "no window" in every family that reads it),
so a spec that took its default there would compute another model: GPT-OSS's default window is
128, and a config whose sliding_window is null attends over the whole prefix in HF."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from families import plan_and_weights

from infc.compiler.spec import SpecError, load_spec
from infc.runtime.reference.executor import ReferenceExecutor, SeqChunk


def _gpt_oss(sliding_window, layer_types):
    from transformers import GptOssConfig, GptOssForCausalLM
    torch.manual_seed(5)
    hf = GptOssForCausalLM(GptOssConfig(
        vocab_size=211, max_position_embeddings=512, initializer_range=0.05, hidden_size=64,
        intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=sliding_window,
        layer_types=layer_types, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})).float().eval()
    hf.set_attn_implementation("eager")
    return hf


@pytest.mark.parametrize("window", [None, 9])
def test_a_null_window_is_no_window(window, tmp_path):
    """150 tokens, past GPT-OSS's default window of 128, a sliding layer then a full one: with
    sliding_window null the sliding layer attends over the whole prefix (vLLM's reading; HF's
    GPT-OSS forward refuses a null window, so its logits here are those of the same weights with
    a window longer than the prompt), not over the default 128; a number is still that window."""
    sliding = ["sliding_attention", "full_attention"]
    hf = _gpt_oss(window, sliding)
    hf.save_pretrained(tmp_path)
    if window is None:
        full = _gpt_oss(1 << 20, sliding)
        full.load_state_dict(hf.state_dict())
        hf = full
    assert json.loads((tmp_path / "config.json").read_text())["sliding_window"] == window
    plan, weights = plan_and_weights(tmp_path)
    ids = [int(t) for t in np.random.default_rng(0).integers(0, 211, 150)]
    with torch.no_grad():      # (HF's sliding-window cache takes no null window: none is kept)
        want = hf(input_ids=torch.tensor([ids]), use_cache=False).logits[0].numpy()
    ex = ReferenceExecutor(plan, weights)
    err = [float(np.abs(ex.step([SeqChunk(0, [t], p)])[0] - want[p]).max()) for p, t in enumerate(ids)]
    assert max(err) <= 1e-4, f"worst position {int(np.argmax(err))}, |diff| {max(err):.2e}"


def test_a_null_takes_the_default_without_the_mark(tmp_path):
    """The unmarked form (a null is absent: HF's "None: compute it", as head_dim) is unchanged, and
    `?` on its own is an error naming the symbol."""
    spec = tmp_path / "s.yaml"
    base = Path("specs/gpt_oss.yaml").read_text()
    spec.write_text(base.replace("swa: sliding_window? = 128", "swa: sliding_window = 128"))
    assert "sliding_window = 128" in spec.read_text()
    s = load_spec(spec)
    assert s.bindings["swa"].null_is_value == frozenset()
    assert load_spec("specs/gpt_oss.yaml").bindings["swa"].null_is_value == {"sliding_window"}
    spec.write_text(base.replace("swa: sliding_window? = 128", "swa: \"? = 128\""))
    with pytest.raises(SpecError, match="symbol 'swa'"):
        load_spec(spec)
