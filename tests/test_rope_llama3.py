"""Llama 3.1-style RoPE scaling (compiler/ops/rope.py's `llama3`) against transformers' own
frequencies, including Llama-4 Scout's low_freq_factor == high_freq_factor (no blend band: the
blend's division by zero must neither warn nor leak a NaN)."""
import warnings

import numpy as np
import pytest

from infc.compiler.ops.rope import rope_parameters


@pytest.mark.parametrize("low,high", [(1.0, 4.0), (1.0, 1.0)], ids=["llama-3.1", "llama-4-scout"])
def test_llama3_frequencies_match_transformers(low, high):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    scaling = {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": low, "high_freq_factor": high,
               "original_max_position_embeddings": 8192}
    cfg = LlamaConfig(hidden_size=128 * 4, num_attention_heads=4, head_dim=128,
                      rope_parameters={**scaling, "rope_theta": 500000.0})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")         # transformers' own division by zero (low == high)
        want, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")          # ours: no warning
        freq, attention = rope_parameters(128, 500000.0, scaling)
    assert np.isfinite(freq).all() and attention == 1.0
    np.testing.assert_allclose(freq, want.double().numpy(), rtol=1e-6)
