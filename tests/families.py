"""Tiny random HF models, one builder per spec family, for the family tests.

Each builder returns an HF model built by transformers itself (so checkpoint names and
config.json are exactly what HF writes). The shapes are tiny but chosen so that every feature
of the family changes the logits measurably:
  - hidden 96 (not a multiple of the kernels' block sizes), head_dim 32 or 16 (power of two:
    the attention kernels' tile), 2-4 layers: enough for every layer kind to appear;
  - sliding windows of 5-6 tokens, shorter than the 16-token test prompt;
  - soft caps small enough to bite at these logit magnitudes;
  - Q width (Hq * D) different from H where the family allows it.
`make()` then randomizes every norm weight, every bias and every attention sink (HF inits norms to 1 or 0 and biases
to 0, which would hide a dropped or misplaced bias/norm) and saves the directory.
A few configs deliberately set hidden_act to another activation than the published one
(stablelm: gelu, granite: relu) so that every activation the spec language has is exercised
through a real architecture's act(x, hidden_act).
"""
import numpy as np
import torch

VOCAB = 320


def reference_greedy(plan, weights, prompt, n) -> list[int]:
    """n greedy tokens after `prompt` from the reference executor, one decode step each: what
    the tests compare with HF's generate()."""
    from infc.runtime.reference.executor import ReferenceExecutor, SeqChunk
    ex = ReferenceExecutor(plan, weights)
    logits, out = ex.step([SeqChunk(0, prompt, 0)])[0], []
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = ex.step([SeqChunk(0, [out[-1]], len(prompt) + len(out) - 1)])[0]
    return out
BASE = dict(vocab_size=VOCAB, max_position_embeddings=256, initializer_range=0.05)
_PLANS = {}


def hf_greedy(hf, prompt, n, pad) -> list[int]:
    """n greedy tokens after prompt from HF's generate() (min = max = n, so no early stop; an
    explicit all-ones mask, or generate would mask a prompt token equal to pad as padding)."""
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                          min_new_tokens=n, do_sample=False, pad_token_id=pad)
    return out[0, len(prompt):].tolist()


def tiny_hf(model_cls, config_cls, config: dict, d, seed: int, randomize=None):
    """transformers' own model of config: seeded, float32, eager attention (the reference's
    softcaps and windows), randomized where HF's init is trivial, saved into d as save_pretrained
    saves by default (the published names); returns it."""
    torch.manual_seed(seed)
    model = model_cls(config_cls(**config)).float().eval()
    model.set_attn_implementation("eager")
    if randomize is not None:
        randomize(model)
    model.save_pretrained(d)
    return model


def plan_and_weights(d, fuse=True):
    """(plan, float32 weights) of the tiny model saved in d, compiled once a session per (d, fuse)."""
    from infc.compiler.build import compile_model
    from infc.compiler.contract.safetensors_io import Checkpoint
    from infc.runtime.weights.load import load_weights
    key = (str(d), fuse)
    if key not in _PLANS:
        _, plan = compile_model(model_dir=str(d), fuse=fuse)
        _PLANS[key] = (plan, load_weights(plan, Checkpoint(d)))
    return _PLANS[key]


def hf_logits(model, ids) -> np.ndarray:
    """HF's float32 logits [len(ids), V] of one sequence."""
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].float().numpy()


def checkpoint_tensors(d) -> dict:
    """The tensors a tiny model saved into d/model.safetensors, by name."""
    from safetensors.numpy import load_file
    return load_file(str(d / "model.safetensors"))


def engine_greedy(runner, prompts: list, max_tokens: int) -> dict:
    """request id -> the greedy tokens the engine generates for each prompt over `runner`, all
    requests in flight together (r0, r1, ...)."""
    from infc.runtime.engine.sampling import SamplingParams
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return engine_tokens(runner, prompts, [params] * len(prompts), max_model_len=1024)


def engine_tokens(runner, prompts: list, params: list, **engine_kw) -> dict:
    """request id -> the tokens an Engine(runner, **engine_kw) generates for prompt i with
    params[i], all requests in flight together (r0, r1, ...); asserts engine_kw's overlap took."""
    from infc.runtime.engine.engine import Engine
    engine = Engine(runner, **engine_kw)
    if "overlap" in engine_kw:
        assert engine.overlap == engine_kw["overlap"]
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(p, sp, f"r{i}")
    toks: dict = {}
    while engine.has_unfinished():
        for o in engine.step():
            toks.setdefault(o.request_id, []).extend(o.token_ids)
    return toks


def _qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM
    # Qwen2.5 long-context recipe: YaRN, factor 4 over the original context (tiny here: 32 ->
    # 128); sliding-window attention from layer max_window_layers = 1 on (layer 0 full)
    return Qwen2ForCausalLM(Qwen2Config(
        **{**BASE, "max_position_embeddings": 128}, hidden_size=96, intermediate_size=160,
        num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=1, rms_norm_eps=1e-6,
        tie_word_embeddings=False, use_sliding_window=True, sliding_window=6, max_window_layers=1,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 32}))


def _gemma():
    from transformers import GemmaConfig, GemmaForCausalLM
    # Hq * D = 128 != H = 96, as gemma-7b (16 x 256 != 3072)
    return GemmaForCausalLM(GemmaConfig(
        **BASE, hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, rms_norm_eps=1e-6, hidden_act="gelu_pytorch_tanh",
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}))


def _gemma2():
    from transformers import Gemma2Config, Gemma2ForCausalLM
    # layers alternate sliding (even i) / full (odd i); scalar 24 != head_dim 32
    return Gemma2ForCausalLM(Gemma2Config(
        **BASE, hidden_size=96, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, query_pre_attn_scalar=24,
        sliding_window=5, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}))


def _gemma3():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    # every 3rd layer global (the published pattern is 6): layers s, s, f, s; linear RoPE
    # scaling on the global layers as gemma-3-4b; local theta 10k, global 1M.
    return Gemma3ForCausalLM(Gemma3TextConfig(
        **BASE, hidden_size=96, intermediate_size=160, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, query_pre_attn_scalar=24,
        sliding_window=5, sliding_window_pattern=3,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                            "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}))


def _phi3():
    from transformers import Phi3Config, Phi3ForCausalLM
    # fused qkv_proj (GQA 3:1) and gate_up_proj; a sliding window on every layer (Phi-3-mini-4k)
    return Phi3ForCausalLM(Phi3Config(
        **BASE, hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=3,
        num_key_value_heads=1, rms_norm_eps=1e-5, sliding_window=6, tie_word_embeddings=False,
        original_max_position_embeddings=256, pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}))


def _phi():
    from transformers import PhiConfig, PhiForCausalLM
    # phi-2: parallel attention + MLP off one LayerNorm, partial rotary, biases everywhere
    return PhiForCausalLM(PhiConfig(
        **BASE, hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=3,
        num_key_value_heads=3, layer_norm_eps=1e-5, hidden_act="gelu_new", tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}))


def _olmo2():
    from transformers import Olmo2Config, Olmo2ForCausalLM
    # q/k norms over the whole projected width: [Hq*D] = [96] and [Hkv*D] = [32] (2 heads of 16)
    return Olmo2ForCausalLM(Olmo2Config(
        **BASE, hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, rms_norm_eps=1e-6, tie_word_embeddings=False, pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0}))


def _granite():
    from transformers import GraniteConfig, GraniteForCausalLM
    # granite-3.0-2b's scalars; hidden_act set to relu (published: silu) so that the plain ReLU
    # runs through a real architecture's act()
    return GraniteForCausalLM(GraniteConfig(
        **BASE, hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=3,
        num_key_value_heads=1, rms_norm_eps=1e-5, tie_word_embeddings=True, hidden_act="relu",
        embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.015625,
        logits_scaling=8.0, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}))


def _nemotron():
    from transformers import NemotronConfig, NemotronForCausalLM
    return NemotronForCausalLM(NemotronConfig(
        **BASE, hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=3,
        num_key_value_heads=1, head_dim=32, norm_eps=1e-5, hidden_act="relu2",
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}))


def _starcoder2():
    from transformers import Starcoder2Config, Starcoder2ForCausalLM
    return Starcoder2ForCausalLM(Starcoder2Config(
        **BASE, hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=3,
        num_key_value_heads=1, norm_epsilon=1e-5, sliding_window=6, use_bias=True,
        hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 999999.4420358813}))


def _stablelm():
    from transformers import StableLmConfig, StableLmForCausalLM
    # stablelm-2-1_6b shape: qkv bias, rotary over 25 % of the head; hidden_act set to gelu
    # (erf) here so that the exact GELU runs through a real architecture's act(); weights twice
    # the other families' scale so that erf vs tanh GELU differ by > 1e-3 in the logits
    return StableLmForCausalLM(StableLmConfig(
        **{**BASE, "initializer_range": 0.1}, hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=3,
        num_key_value_heads=3, layer_norm_eps=1e-5, use_qkv_bias=True, hidden_act="gelu",
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}))


def _smollm3():
    from transformers import SmolLM3Config, SmolLM3ForCausalLM
    # a NoPE layer every 2nd layer here (published: every 4th): layers rope, nope, rope
    return SmolLM3ForCausalLM(SmolLM3Config(
        **BASE, hidden_size=96, intermediate_size=160, num_hidden_layers=3, num_attention_heads=3,
        num_key_value_heads=1, rms_norm_eps=1e-6, no_rope_layer_interval=2, pad_token_id=0,
        tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}))


def _falcon():
    from transformers import FalconConfig, FalconForCausalLM
    # falcon-7b: multi-query fused query_key_value [(Hq + 2) D, H], parallel attention + MLP
    # off one LayerNorm, exact GELU MLP, tied lm_head; larger weights as stablelm's
    return FalconForCausalLM(FalconConfig(
        vocab_size=VOCAB, initializer_range=0.1, hidden_size=96, num_hidden_layers=2,
        num_attention_heads=3, multi_query=True, new_decoder_architecture=False, parallel_attn=True,
        bias=False, alibi=False, layer_norm_epsilon=1e-5, max_position_embeddings=256,
        tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}))


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    # learned absolute positions (a 64-row wpe), Conv1D weights [in, out] with q|k|v fused in
    # c_attn's columns, LayerNorm with bias, gelu_new MLP (n_inner unset: 4 H, as published),
    # head_dim 24 (not a power of two), tied lm_head; larger weights as stablelm's, so that
    # gelu_new vs the erf GELU moves the logits by ~1e-3
    return GPT2LMHeadModel(GPT2Config(
        vocab_size=VOCAB, initializer_range=0.1, n_embd=96, n_head=4, n_layer=2, n_positions=64,
        layer_norm_epsilon=1e-5, activation_function="gelu_new", tie_word_embeddings=True))


def _cohere():
    from transformers import CohereConfig, CohereForCausalLM
    # Command-R: parallel attention + SwiGLU MLP off one bias-free LayerNorm, interleaved RoPE,
    # logits x logit_scale (0.5 here, published 0.0625: small enough to bite, large enough that
    # the 1e-4 logit check still sees the model), tied lm_head; attention_bias on (published
    # off) so the q/k/v/o biases are exercised; head_dim 32 so Hq * D = 128 != H = 96
    return CohereForCausalLM(CohereConfig(
        **BASE, hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, layer_norm_eps=1e-5, logit_scale=0.5,
        attention_bias=True, use_qk_norm=False, tie_word_embeddings=True, eos_token_id=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}))


def _qwen3_5():
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    # Qwen3.5's hybrid: Gated DeltaNet linear attention (2 q/k heads of 16, 4 v heads of 24: the
    # grouped value heads; a width-4 causal conv) and gated full attention (head_dim 32, RoPE on
    # 8 of its 32 dims) in layers lin, full, lin, full; x * (1 + w) norms (randomized as any norm)
    return Qwen3_5ForCausalLM(Qwen3_5TextConfig(
        **BASE, hidden_size=96, intermediate_size=160, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, tie_word_embeddings=False,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=24, linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [1, 1, 2], "mrope_interleaved": True}))


def _gpt_oss():
    from transformers import GptOssConfig, GptOssForCausalLM
    # layers sliding (window 5), full, sliding; 6 experts, top-2, F = 40 != H; YaRN over an
    # original context of 32 (factor 4, truncate false as published); the clamp limit (0.6) and
    # alpha (1.5, published 1.702) chosen so that the clamps bite at these activation sizes and a
    # dropped alpha shows
    return GptOssForCausalLM(GptOssConfig(
        **{**BASE, "max_position_embeddings": 128}, hidden_size=96, intermediate_size=40,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        num_local_experts=6, num_experts_per_tok=2, rms_norm_eps=1e-5, sliding_window=5,
        swiglu_limit=0.6, swiglu_alpha=1.5, tie_word_embeddings=False,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                         "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 32}))


def _mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM
    # 6 experts, top-2, F = 40 != H; a sliding window of 5 on every layer (Mixtral's config has
    # one window for all layers; null in Mixtral-8x7B-v0.1)
    return MixtralForCausalLM(MixtralConfig(
        **BASE, hidden_size=96, intermediate_size=40, num_hidden_layers=2, num_attention_heads=3,
        num_key_value_heads=1, num_local_experts=6, num_experts_per_tok=2, rms_norm_eps=1e-5,
        sliding_window=5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}))


def _qwen2_moe():
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM
    # layers sparse, dense (mlp_only_layers), sparse; 6 experts, top-2, renormalized (published:
    # not; the spec passes norm_topk_prob through); expert F 40, shared expert 56, dense MLP 72
    return Qwen2MoeForCausalLM(Qwen2MoeConfig(
        **BASE, hidden_size=96, intermediate_size=72, moe_intermediate_size=40,
        shared_expert_intermediate_size=56, num_hidden_layers=3, num_attention_heads=3,
        num_key_value_heads=1, num_experts=6, num_experts_per_tok=2, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[1], rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}))


def _olmoe():
    from transformers import OlmoeConfig, OlmoeForCausalLM
    # q/k norms over the whole projected width ([96] and [32]: 2 kv heads of 16); 6 experts,
    # top-2, not renormalized (as published); clip_qkv 0.5 (published: null) clamps many of the
    # normed q/k entries and v's; attention_bias on (published off) so the four biases run
    return OlmoeForCausalLM(OlmoeConfig(
        **BASE, hidden_size=96, intermediate_size=40, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, num_experts=6, num_experts_per_tok=2, norm_topk_prob=False,
        clip_qkv=0.5, attention_bias=True, rms_norm_eps=1e-5, tie_word_embeddings=False,
        pad_token_id=0, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}))


# Families whose config.json is rewritten into the published (transformers 4.x) form after
# saving: rope_theta / partial_rotary_factor / rope_scaling at the top level instead of
# transformers 5's rope_parameters, and (gemma3) no layer_types, rope_local_base_freq and
# sliding_window_pattern instead. The specs' fallback bindings and kind expressions are the
# ones every published variant goes through, so these tests must exercise them too.
LEGACY_CONFIG = {"phi", "nemotron", "stablelm", "gemma3", "cohere"}


def _legacy(cfg: dict) -> dict:
    cfg = dict(cfg)
    rp = cfg.pop("rope_parameters")
    if "full_attention" in rp:                 # gemma3: per layer type
        full, local = dict(rp["full_attention"]), rp["sliding_attention"]
        cfg["rope_theta"] = full.pop("rope_theta")
        cfg["rope_local_base_freq"] = local["rope_theta"]
        cfg["rope_scaling"] = full if full.get("rope_type", "default") != "default" else None
        cfg.pop("layer_types")
        cfg.pop("_sliding_window_pattern", None)
        return cfg
    rp = dict(rp)
    cfg["rope_theta"] = rp.pop("rope_theta")
    if "partial_rotary_factor" in rp:
        cfg["partial_rotary_factor"] = rp.pop("partial_rotary_factor")
    cfg["rope_scaling"] = rp if rp.get("rope_type", "default") != "default" else None
    return cfg


BUILDERS = {"qwen2": _qwen2, "gemma": _gemma, "gemma2": _gemma2, "gemma3": _gemma3,
            "phi3": _phi3, "phi": _phi, "olmo2": _olmo2, "granite": _granite,
            "nemotron": _nemotron, "starcoder2": _starcoder2, "stablelm": _stablelm,
            "smollm3": _smollm3, "falcon": _falcon, "gpt2": _gpt2, "cohere": _cohere,
            "qwen3_5": _qwen3_5, "gpt_oss": _gpt_oss, "mixtral": _mixtral,
            "qwen2_moe": _qwen2_moe, "olmoe": _olmoe}
FAMILIES = list(BUILDERS)

# Extra tensors written into a family's checkpoint that its spec must `ignore:` (checkpoints
# saved by transformers < 4.31 carry each layer's RoPE inverse-frequency buffer).
EXTRA_TENSORS = {"stablelm": lambda cfg: {
    f"model.layers.{i}.self_attn.rotary_emb.inv_freq":
        1.0 / (10000.0 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))
    for i in range(cfg.num_hidden_layers)},
    # GPT-2 checkpoints saved by older transformers (DialoGPT, mGPT) carry each layer's causal
    # mask (uint8 [1, 1, P, P]) and its masked_bias fill value
    "gpt2": lambda cfg: {
        name: t for i in range(cfg.n_layer) for name, t in (
            (f"transformer.h.{i}.attn.bias",
             torch.tril(torch.ones(cfg.n_positions, cfg.n_positions, dtype=torch.uint8))[None, None]),
            (f"transformer.h.{i}.attn.masked_bias", torch.tensor(-1e4)))}}


def _randomize(model):
    """Every norm weight, norm bias and linear bias random and non-zero. Norms stored as an
    offset from 1 (Gemma x*(1+w), Nemotron LayerNorm1p) get small weights; others ~1."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            is_norm = any(k in name for k in ("norm", "ln_", "layernorm"))
            if name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif name.endswith("sinks"):           # attention sinks: logits the size of the scores
                p.copy_(torch.randn_like(p))
            elif is_norm:
                offset_form = type(model).__name__.startswith(("Gemma", "Nemotron"))
                p.copy_((0.0 if offset_form else 1.0) + 0.2 * torch.randn_like(p))


def make(family: str, directory):
    """Build, randomize and save family's tiny model into directory; returns the HF model."""
    torch.manual_seed(1234)
    model = BUILDERS[family]()
    model = model.float().eval()
    model.set_attn_implementation("eager")     # the reference attention (softcaps, windows)
    _randomize(model)
    model.save_pretrained(directory)
    if family in LEGACY_CONFIG:
        import json
        path = f"{directory}/config.json"
        with open(path) as f:
            cfg = json.load(f)
        with open(path, "w") as f:
            json.dump(_legacy(cfg), f, indent=2, sort_keys=True)
    if family in EXTRA_TENSORS:
        from safetensors.torch import load_file, save_file
        path = f"{directory}/model.safetensors"
        tensors = load_file(path)
        tensors.update(EXTRA_TENSORS[family](model.config))
        save_file(tensors, path, metadata={"format": "pt"})
    return model
