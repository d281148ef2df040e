"""bench/torch_peer.py, the torch.compile peer of `infc bench latency`: on the CPU, at tiny sizes,
its decoder over an HF model's layers gives HF's logits and HF's greedy tokens, its decode step
traces as one graph (fullgraph: what mode="reduce-overhead" captures as a CUDA graph on the GPU),
and a model it does not reproduce is refused with the reason."""
import pytest
import torch

from infc.bench.torch_peer import Peer, PeerUnsupported, check_supported

PROMPT = [5, 17, 99, 3, 250, 41, 7]
NEW = 12


def _hf_greedy(hf, ids):
    out = hf.generate(ids, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_logits_and_greedy_tokens_match_hf(tiny_model, family):
    _, hf = tiny_model(family)
    ids = torch.tensor([PROMPT])
    peer = Peer(hf, len(PROMPT) + NEW + 1, compile=False)
    with torch.inference_mode():
        want = hf(ids).logits[:, -1, :]
        got = peer.model(ids, torch.arange(len(PROMPT)))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # a fresh peer: its cache holds only what its own prefill wrote
    peer = Peer(hf, len(PROMPT) + NEW + 1, compile=False)
    assert peer.generate(ids, NEW) == _hf_greedy(hf, ids)


def test_decode_step_traces_as_one_graph(tiny_model):
    _, hf = tiny_model("qwen3")
    torch._dynamo.reset()
    peer = Peer(hf, len(PROMPT) + NEW + 1, compiler=lambda f: torch.compile(f, backend="eager", fullgraph=True))
    assert peer.generate(torch.tensor([PROMPT]), NEW) == _hf_greedy(hf, torch.tensor([PROMPT]))


def test_unsupported_models_are_refused(tiny_model):
    _, moe = tiny_model("qwen3_moe")
    with pytest.raises(PeerUnsupported, match="model_type 'qwen3_moe'"):
        Peer(moe, 32, compile=False)
    from transformers import MistralConfig
    with pytest.raises(PeerUnsupported, match="sliding window"):
        check_supported(MistralConfig(sliding_window=4096))
    check_supported(MistralConfig(sliding_window=None))
    from transformers import LlamaConfig
    with pytest.raises(PeerUnsupported, match="rope_type 'dynamic'"):
        check_supported(LlamaConfig(rope_scaling={"rope_type": "dynamic", "factor": 2.0}))
