"""The new model families' golden-gate fixtures, in one place for both machines.

A family's config is a published checkpoint's config.json values (its spec's `variant:`),
turned into the HF config object by transformers itself:
  - prepare.py (build machine, no GPU) writes that config's config.json to
    .cache/gpu/configs/<name>/ and builds the artifact from it: .cache/gpu/<name>-art;
  - models.py (GPU machine) builds the HF model from the same config on the GPU with random
    weights, save_pretrained's it, and checks that the config.json HF wrote binds the spec's
    symbols exactly as the carried one did (else the artifact's plan is another model's).

Weights (redraw): every matrix and embedding normal * 0.02, every bias 0.02 * normal, every
norm weight random around what HF initializes it to: 1 + 0.1 * normal where the norm computes
x * w (HF inits w to 1: Llama-style RMSNorm, LayerNorm), 0.1 * normal where it computes
x * (1 + w) (HF inits w to 0: Gemma's RMSNorm). Nemotron's LayerNorm1P computes x * (1 + w) but
HF inits w to 1, so it gets 1 + 0.1 * normal: an effective scale of ~2, still random and non-zero.
No norm stays constant, so a missing, misplaced or mis-offset norm weight fails the gate.
A family whose spec has 1-D weights that are not norms or biases (Qwen3.5's linear attention:
A_log, dt_bias) or whose HF init would leave a weight degenerate gets explicit rules by name
(REDRAW, keyed by the spec's family), applied before the generic ones and independent of how this
machine's transformers happens to initialize them. GPT-OSS's and DeepSeek-V3's rules also shape the
routing so that it is decisive (DECISIVE_ROUTING; the comments above _gpt_oss_rule and
_deepseek_v2_rule say why and how).

A variant written as a multimodal checkpoint's config.json (Qwen3.5: the text model's values under
text_config) is made as the spec's first architecture (the text-only Qwen3_5ForCausalLM) from the
text config's values, so the directory holds only the language model (weights under model.).

INFC_GPU_FAMILIES selects the families (comma list, "all" or "none"; default DEFAULT) on both machines.
"""
import json
import os
import shutil
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GPU_CACHE = REPO / ".cache" / "gpu"

DSV4_CUT = "deepseek-v4-flash-l3"      # session.sh's `dsv4` stage: golden gate and latency
# test name: (spec variant, config.json overrides). Each is the real checkpoint's exact shapes
# (widths, heads, head_dim, vocab, windows); a layer cut is said in its comment.
FAMILIES = {
    # qwen2: q/k/v biases, tied embeddings, GQA 14:2, head_dim 64, no sliding window in use
    "qwen2.5-0.5b": ("qwen2.5-0.5b-instruct", {}),
    # gemma3: (1 + w) norms, per-head q/k norms, sqrt(H) embedding scale, 5 local layers
    # (window 512, RoPE 10k) per global layer (RoPE 1M), MQA, head_dim 256, vocab 262144
    "gemma-3-1b": ("gemma-3-1b-it", {}),
    # gemma2: attention logit soft cap 50 and final soft cap 30, alternating window 4096
    "gemma-2-2b": ("gemma-2-2b-it", {}),
    # granite: embedding / residual / attention / logits multipliers, tied, 40 layers
    "granite-3-2b": ("granite-3.0-2b-instruct", {}),
    # phi3: fused qkv_proj and gate_up_proj (row slices at load time), window 2047
    "phi-3-mini": ("phi-3-mini-4k-instruct", {}),
    # starcoder2: LayerNorm with bias, bias on every projection, plain GELU-tanh MLP, window 4096
    "starcoder2-3b": ("starcoder2-3b", {}),
    # olmo2: post-sublayer norms, q/k RMSNorm over all heads together. Layer cut: 8 of the 7B's
    # 32 layers (widths, heads and vocab are the 7B's), so it is made and loaded in seconds.
    "olmo-2-7b-l8": ("olmo-2-1124-7b", {"num_hidden_layers": 8}),
    # stablelm: LayerNorm with bias, 25 % partial rotary, q/k/v biases
    "stablelm-2-1.6b": ("stablelm-2-1_6b", {}),
    # phi (phi-2): parallel attention + MLP, LayerNorm, 40 % partial rotary, gelu_new, lm_head bias
    "phi-2": ("phi-2", {}),
    # nemotron: LayerNorm1P (x * (1 + w) + b), squared-ReLU MLP, 50 % partial rotary. Layer cut:
    # 16 of 32 layers.
    "minitron-4b-l16": ("minitron-4b-base", {"num_hidden_layers": 16}),
    # gemma: (1 + w) norms, MQA, head_dim 256, vocab 256000, GELU (tanh). The published config says
    # hidden_act "gelu", which transformers 5.23 (here) rewrites to "gelu_pytorch_tanh" and 5.17
    # (the GPU machine) writes back as "gelu", so the two config.json bound `act` differently and
    # check_config refused the directory; hidden_activation, which both write and the spec reads
    # first, settles it
    "gemma-2b": ("gemma-2b", {"hidden_activation": "gelu_pytorch_tanh"}),
    # qwen3_5 (issue 12): hybrid Gated DeltaNet linear attention (conv + recurrent state slots) and
    # gated full attention (partial RoPE 64 of 256, output gate interleaved in q_proj), (1 + w)
    # norms but a plain-w gated norm, tied embeddings, vocab 248320. Layer cut: 8 of the 4B's 32
    # layers, the 3 linear : 1 full pattern kept (layers 3 and 7 full attention). Made as the
    # text-only Qwen3_5ForCausalLM. Not in DEFAULT (its prompts go to 4k: LONG_PROMPTS).
    "qwen3.5-4b-l8": ("qwen3.5-4b", {"num_hidden_layers": 8, "full_attention_interval": 4,
                                     "layer_types": ["linear_attention"] * 3 + ["full_attention"]
                                     + ["linear_attention"] * 3 + ["full_attention"]}),
    # deepseek_v2 (issue 13): multi-head latent attention (the paged cache holds only the latent
    # c_kv, kv_lora_rank 512, and the shared rope key, 64, a token: 576 values; decode in the
    # absorbed form), YaRN (factor 40, mscale = mscale_all_dim = 0.707: the softmax scale carries
    # mscale ** 2), DeepSeekMoE (64 routed experts, softmax greedy top-6, routed_scaling_factor 1,
    # 2 shared experts always on, layer 0 dense with intermediate 10944), no q_lora, vocab 102400.
    # Layer cut: 8 of V2-Lite's 27 layers (1 dense + 7 MoE). Not in DEFAULT (prompts to 2k:
    # LONG_PROMPTS). Every value is specs/deepseek_v2.yaml's variant `deepseek-v2-lite`, which
    # issue 13 gives as the published config.json; where each was checked (DeepseekV2Config's own
    # defaults, a transformers 5.7 dump of DeepSeek-V2-Lite-Chat's config.json with its 15,706,484,224
    # parameters, tests/test_deepseek_v2.py's expectations) is tests/test_deepseek_v2_gpu_fixture.py.
    "deepseek-v2-lite-l8": ("deepseek-v2-lite", {"num_hidden_layers": 8}),
    # qwen3_moe (issue 11): qwen3-30b-a3b cut to 4 of its 48 layers at its real shapes (128 experts,
    # top-8 normalized, 768-wide experts, GQA 32:4, head_dim 128, 151,936 ids). Not in DEFAULT: its
    # random HF directory is ~5 GB (the whole model's golden gate is this cut's). Its config and
    # artifact directories are the ones tests/gpu/prepare_moe.py writes for the same cut.
    "qwen3-30b-a3b-l4": ("qwen3-30b-a3b", {"num_hidden_layers": 4}),
    # gpt_oss (issue 45): gpt-oss-20b cut to 4 of its 24 layers (sliding 128, full, sliding, full)
    # at its real shapes (32 experts, top-4, biases, clamped SwiGLU, sinks, YaRN, 201,088 ids), its
    # experts bf16 (the published MXFP4 quantization_config dropped: the gate is against HF bf16).
    # Not in DEFAULT: its random HF directory is ~5 GB.
    # deepseek_v3 (issue 45; specs/deepseek_v2.yaml's variant deepseek-v3): MLA with q_lora
    # (1536), YaRN (factor 40), 3 dense layers (intermediate 18432) then MoE with sigmoid scores,
    # the correction bias choosing (noaux_tc) and group-limited top-8 (8 groups, 4 kept),
    # routed_scaling_factor 2.5, one shared expert; vocab 129,280. Layer cut: its first 5 layers
    # (3 dense + 2 MoE) at the published widths, 32 of the 256 routed experts (4 a group, so the
    # group limit still chooses 16 of 32) so that HF's bf16 model is ~14 GB and its float32
    # second check ~28 GB; the router and the correction bias drawn so that it routes decisively
    # (_deepseek_v2_rule, DECISIVE_ROUTING). bf16 (the published FP8
    # quantization_config dropped: the gate is against HF bf16). Not in DEFAULT (its size).
    "deepseek-v3-l5": ("deepseek-v3", {"num_hidden_layers": 5, "n_routed_experts": 32,
                                       "quantization_config": None}),
    "gpt-oss-20b-l4": ("gpt-oss-20b", {"num_hidden_layers": 4, "quantization_config": None,
                                       "layer_types": ["sliding_attention", "full_attention"] * 2}),
    # deepseek_v4 (issue 47): deepseek-v4-flash cut to 3 layers, its layers 1-3 (sliding window
    # alone + hash MoE, compressed sparse + hash MoE, heavily compressed + score-routed MoE): each
    # attention type and each MLP type once, mHC on (4 streams, 20 Sinkhorn iterations). Real
    # widths: hidden 4096, 64 heads of 512 (rope 64), q rank 1024, 8 output groups of rank 1024,
    # the indexer's 64 heads of 128 keeping 512, window 128, compression 4 and 128, expert width
    # 2048, 129,280 ids. Cut: the routed experts, 16 of 256 (top-6 kept; the hash table draws its 6
    # of the 16), so the HF bf16 model is ~5 GB (256 experts: ~40 GB, and its float32 second
    # verdict ~80 GB) and is made and saved in seconds; a token still reads 6 routed experts and the
    # shared one. The published compress_ratios / num_hash_layers (43 layers') are dropped: the
    # cut's layer_types / mlp_layer_types say the same for its 3 layers; the rotary width as HF's
    # own field (partial_rotary_factor 64 / 512, which it writes back as qk_rope_head_dim 64), so a
    # test's narrower heads keep 1 / 8 of them rotary. Not in DEFAULT
    # (transformers >= 5.23: tools/gpu_wheels.sh carries it; session.sh's `dsv4` stage runs it).
    DSV4_CUT: ("deepseek-v4-flash", {"num_hidden_layers": 3, "n_routed_experts": 16,
                                     "qk_rope_head_dim": None, "partial_rotary_factor": 64 / 512,
                                     "compress_ratios": None, "num_hash_layers": None,
                                     "layer_types": ["sliding_attention", "compressed_sparse_attention",
                                                     "heavily_compressed_attention"],
                                     "mlp_layer_types": ["hash_moe", "hash_moe", "moe"],
                                     # bf16 (the gate is against HF bf16): the published FP8 / FP4
                                     # quantization the variant binds dropped
                                     "quantization_config": None, "expert_dtype": None}),
}
# Families whose fixture makes the routing decisive (GPT-OSS's and DeepSeek-V3's rules below): name
# -> the suffix of the router modules' names, whose picks test_golden.test_routing_is_decisive compares.
DECISIVE_ROUTING = {"gpt-oss-20b-l4": "mlp.router", "deepseek-v3-l5": "mlp.gate", DSV4_CUT: "mlp.gate"}
# Longer prompts for a family (test_golden.py adds them after its common lengths): the hybrid
# model's recurrent state and chunked delta rule over 2k-4k tokens (chunk edges at 64, pages at 16).
# DeepSeek-V2-Lite's 8-layer cut: prompts to 2k, the latent cache over up to 129 pages of 16.
LONG_PROMPTS = {"qwen3.5-4b-l8": [2049, 3000, 4096], "deepseek-v2-lite-l8": [1537, 2048]}
# Full-depth configs for the latency benchmark only (dummy weights, no golden gate): prepare.py
# writes config_dir(name) and builds artifact_dir(name); made exactly as the families are.
# deepseek-v2-lite: all 27 layers (session.sh's `deepseek` stage: TPOT against the active-bytes
# floor, bench/active_floor.py).
# gpt-oss-20b: all 24 layers, its experts MXFP4 as published (issue 45: TPOT against the active floor).
LATENCY = {"qwen3.5-4b": ("qwen3.5-4b", {}), "deepseek-v2-lite": ("deepseek-v2-lite", {}),
           "gpt-oss-20b": ("gpt-oss-20b", {})}
# The openai SDK suite over the new families (issues 12 and 13: `infc serve` answers it; session
# stage `server-families`), at the golden gate's cuts. The suite sends text, so the directories get
# the Qwen tokenizer, and each cut's vocabulary is set to the tokenizer's 151,936 ids
# (DeepSeek-V2-Lite's 102,400 widened; Qwen3.5's 248,320 narrowed: ids past the tokenizer's decode
# to '', and two of them among the top logprobs collide in the OpenAI format's text-keyed dicts,
# bench/results/issues43-46-h200-0c7f20a-2026-12-02); every other value is the cut's.
# name -> config.json overrides; the directory (and its artifact, prepare.py part `server`) is
# server_dir_name(name).
SERVER = {"qwen3.5-4b-l8": {"vocab_size": 151936}, "deepseek-v2-lite-l8": {"vocab_size": 151936}}


def server_dir_name(name: str) -> str:
    return f"{name}-server"


# What the suite runs by default: seven families, one of each new mechanism (biases, soft caps,
# windows below and above the 1024-token prompts, multipliers, load-time slices, LayerNorm,
# post-norms), about 17 B parameters in all.
DEFAULT = ["qwen2.5-0.5b", "gemma-3-1b", "gemma-2-2b", "granite-3-2b", "phi-3-mini",
           "starcoder2-3b", "olmo-2-7b-l8"]


def selected() -> list[str]:
    pick = os.environ.get("INFC_GPU_FAMILIES", "").strip()
    if not pick:
        return list(DEFAULT)
    if pick == "all":
        return list(FAMILIES)
    if pick == "none":                  # the base models alone
        return []
    names = [n.strip() for n in pick.split(",") if n.strip()]
    for n in names:
        if n not in FAMILIES:
            raise ValueError(f"INFC_GPU_FAMILIES: unknown family '{n}' (known: {', '.join(FAMILIES)})")
    return names


def config_dir(name: str) -> Path:
    return GPU_CACHE / "configs" / name


def artifact_dir(name: str) -> Path:
    return GPU_CACHE / f"{name}-art"


def _spec_and_values(name: str):
    from infc.compiler.spec import find_variant
    variant, overrides = {**FAMILIES, **LATENCY}[name]
    spec, values = find_variant(variant)
    if isinstance(values.get("text_config"), dict):       # a multimodal config.json: its text model
        values = {**{k: v for k, v in values.items() if k != "text_config"}, **values["text_config"]}
    # an override of None drops the key (a published quantization_config the gate does not use)
    values = {k: v for k, v in {**values, **overrides}.items() if not (k in overrides and v is None)}
    # the published dtype (gemma-2-2b-it: float32, phi-2: float16) is not the one we make
    for k in ("torch_dtype", "dtype", "architectures", "model_type", "transformers_version"):
        values.pop(k, None)
    return spec, values


# spec family -> {config key: the key whose value it takes}, applied after `extra`: a structural
# equality the spec requires, kept when a test shrinks the family. MLA has no grouped K/V
# (specs/deepseek_v2.yaml requires num_key_value_heads == num_attention_heads; the published
# configs have both 16), so a shrink to 4 heads with 2 K/V heads (tests/test_gpu_families.py's
# TINY) makes 4 and 4. At a family's own values this changes nothing.
FOLLOW = {"deepseek_v2": {"num_key_value_heads": "num_attention_heads"}}
# spec family -> {config key: the value the spec requires}, applied likewise: DeepSeek-V4's one
# shared K/V head (specs/deepseek_v4.yaml requires Hkv == 1), which a shrink to 2 K/V heads breaks
FIXED = {"deepseek_v4": {"num_key_value_heads": 1}}


def _arch(name: str) -> str:
    """The HF class a family's model is made as: the variant's published causal-LM class where the
    spec lists it (DeepSeek-V3 is a variant of deepseek_v2's spec, made as DeepseekV3ForCausalLM),
    else the spec's first (a multimodal variant's text model, e.g. Qwen3_5ForCausalLM)."""
    from infc.compiler.spec import find_variant
    spec, _ = _spec_and_values(name)
    published = (find_variant({**FAMILIES, **LATENCY}[name][0])[1].get("architectures") or [None])[0]
    if published in spec.architectures and published.endswith("ForCausalLM"):
        return published
    return spec.architectures[0]


def hf_config(name: str, **extra):
    """The family's HF config object (bf16, `architectures` set). `extra` overrides values
    (tests/test_gpu_families.py shrinks a family with it; the GPU suite never passes any)."""
    import transformers
    spec, values = _spec_and_values(name)
    arch = _arch(name)
    missing = hf_missing(name)
    if missing:
        raise RuntimeError(missing)
    if "num_hidden_layers" in extra and "layer_types" in values and "layer_types" not in extra:
        # a layer cut of a hybrid family: HF's own rule (every interval-th layer full attention)
        values = {k: v for k, v in values.items() if k != "layer_types"}
    values = {**values, **extra}
    for key, leader in FOLLOW.get(spec.family, {}).items():
        values[key] = values[leader]
    values.update(FIXED.get(spec.family, {}))
    cfg = getattr(transformers, arch).config_class(**values)
    cfg.architectures = [arch]
    cfg.dtype = "bfloat16"
    return cfg


def write_config(name: str, out: Path | None = None, **extra) -> Path:
    """config.json exactly as HF's save_pretrained writes it for this config (build machine);
    `extra` as hf_config's (SERVER's overrides)."""
    out = Path(out or config_dir(name))
    out.mkdir(parents=True, exist_ok=True)
    hf_config(name, **extra).save_pretrained(out)
    return out


def hf_missing(name: str) -> str | None:
    """Why this machine's transformers cannot make family `name` (one line), or None."""
    import transformers
    spec, _ = _spec_and_values(name)
    arch = _arch(name)
    try:
        getattr(transformers, arch)
    except (AttributeError, ImportError) as e:
        return (f"{name}: transformers {transformers.__version__} has no {arch} ({type(e).__name__}: "
                f"{str(e).splitlines()[0][:200] if str(e) else ''}); this family needs a transformers "
                f"with {spec.family} (transformers.models.{spec.family})")
    return None


def _qwen3_5_rule(pname, p, g, config=None) -> bool:
    """Qwen3.5 (transformers' modeling_qwen3_5.py): the linear attention's gated norm computes
    w * norm(x) * silu(z) (init 1); every other RMSNorm x * (1 + w) (init 0). A = exp(A_log) is drawn
    log-uniform over HF's own range [0.01, 16] (HF: uniform), so half the heads have A < 0.4 and a
    decay exp(-A * softplus(a + dt_bias)) that keeps the state over many tokens (a state dropped or
    read from the wrong slot moves the logits), the rest forget within a few tokens. dt_bias is
    1 + noise (init 1). The depthwise conv1d weight [C, 1, 4] gets std 0.3 (about PyTorch's own
    Conv1d init for fan-in 4) rather than the matrices' 0.02: the conv then mixes its 4 taps at a
    real scale and its SiLU works outside its linear range."""
    import math
    if pname.endswith("linear_attn.norm.weight"):
        p.normal_(1.0, 0.1, generator=g)
    elif pname.endswith("norm.weight") or pname.endswith("layernorm.weight"):
        p.normal_(0.0, 0.1, generator=g)
    elif pname.endswith("linear_attn.dt_bias"):
        p.normal_(1.0, 0.1, generator=g)
    elif pname.endswith("linear_attn.A_log"):
        p.uniform_(math.log(0.01), math.log(16.0), generator=g)
    elif pname.endswith("linear_attn.conv1d.weight"):
        p.normal_(0.0, 0.3, generator=g)
    else:
        return False
    return True


# GPT-OSS's fixture (issue 45: bench/NOTES.md). With every matrix drawn 0.02 the cut is chaotic in
# bf16: top-4 of 32 router logits near-tie somewhere in every prompt, HF's own bf16 run flips an
# expert there, and from that position on it is another model (regret 3.4 nat from its float32 run).
# So the routing is made decisive and every other term made large enough that a bug in it shows:
#   - tokens fall in ROUTE_GROUPS = E // K groups (id % groups); each group owns K experts (e % groups)
#     and the embedding carries its group's direction (orthonormal directions, EMBED_GROUP each
#     element's scale, beside EMBED_NOISE of the token's own). A router row is its group's unit
#     direction times ROUTER_GAIN plus ROUTER_NOISE noise: projected on a fixed direction the group's
#     component gains sqrt(H), the rest of the residual stream does not, so a token's K experts
#     lead the other E - K by several nats in every layer, far above bf16's error, while the weights
#     among the K (noise and ROUTER_BIAS) stay O(1). The price: the other E - K hold ~e^-5 of the
#     softmax, so a router that skips the renormalization over the K passes (bench/NOTES.md);
#   - the experts' gate pre-activations have std ~5 (EXPERT_GATE), so the clamp at 7 binds on a
#     tenth of them, and the ups std ~1.6 (EXPERT_UP), so the `+ 1` of `(up + 1)` weighs (one std for
#     both: at ~3 a missing clamp passed the gate, at ~5 a missing + 1 did); down_proj is drawn
#     small (EXPERT_OUT) so a layer adds about as much to the residual stream as the embedding holds;
#   - every bias is a fraction of its projection's output (BIAS), not 0.02 of it: a dropped bias
#     moves the logits; the sinks are one logit per head the size of the scores (normal * 1).
ROUTE_SEED = 4545
EMBED_NOISE, EMBED_GROUP = 0.5, 0.5
ROUTER_GAIN, ROUTER_NOISE, ROUTER_BIAS = 0.3, 0.01, 0.3
EXPERT_GATE, EXPERT_UP, EXPERT_OUT = 0.1, 0.03, 0.0016
BIAS = {"self_attn.q_proj.bias": 0.5, "self_attn.k_proj.bias": 0.5, "self_attn.v_proj.bias": 0.5,
        "self_attn.o_proj.bias": 0.3, "experts.gate_up_proj_bias": 1.0, "experts.down_proj_bias": 0.3}


def route_groups(num_experts: int, top_k: int) -> int:
    return max(1, num_experts // top_k)


def group_directions(groups: int, hidden: int, device):
    """`groups` orthonormal rows [groups, hidden], the same on every call (embedding and routers)."""
    import torch
    g = torch.Generator(device="cpu")
    g.manual_seed(ROUTE_SEED)
    q, _ = torch.linalg.qr(torch.randn(hidden, groups, generator=g, dtype=torch.float64))
    return q.T.to(device=device, dtype=torch.float32)


def _class_embedding(p, g, classes: int, noise: float, scale: float):
    """The embedding [V, H] drawn in place: each token's own `noise` plus its class's (id % classes)
    direction, `scale` an element (the decisive fixtures' classes)."""
    import torch
    V, H = p.shape
    d = group_directions(classes, H, p.device) * H ** 0.5          # elements ~1
    p.normal_(0.0, noise, generator=g)
    p += (scale * d[torch.arange(V, device=p.device) % classes]).to(p.dtype)


def _class_router(p, g, signs, logit: float, share: float, noise: float):
    """A router [E, H] drawn in place so that a class's tokens get logits about +-`logit` by `signs`
    [classes, E], where the class's direction holds `share` of the normalized router input."""
    E, H = p.shape
    d = group_directions(signs.shape[0], H, p.device)
    gain = logit / (share * H ** 0.5)                             # the class's projection: share * sqrt(H)
    p.normal_(0.0, noise, generator=g)
    p += (gain * signs.to(p.device).T @ d).to(p.dtype)


def _class_rule(pname, p, g, classes: int, embed: tuple, router: tuple, signs) -> bool:
    """DeepSeek-V3's and V4's decisive fixtures: the embedding (embed: noise, scale) and a scored
    router (router: logit, share, noise; signs: () -> [classes, E], None where the router is not
    drawn so, e.g. V4's hash-routed layers). True where it drew the parameter."""
    if pname == "model.embed_tokens.weight":
        _class_embedding(p, g, classes, *embed)
        return True
    if pname.endswith("mlp.gate.weight") and signs is not None:
        _class_router(p, g, signs(), *router)
        return True
    return False


def _gpt_oss_rule(pname, p, g, config=None) -> bool:
    """GPT-OSS's decisive-routing fixture (the comment above)."""
    import torch
    if pname.endswith("self_attn.sinks"):
        p.normal_(0.0, 1.0, generator=g)
        return True
    for key, std in BIAS.items():
        if pname.endswith(key):
            p.normal_(0.0, std, generator=g)
            return True
    if config is None:
        return False
    groups = route_groups(config.num_local_experts, config.num_experts_per_tok)
    if pname == "model.embed_tokens.weight":
        _class_embedding(p, g, groups, EMBED_NOISE, EMBED_GROUP)
        return True
    if pname.endswith("mlp.router.weight"):
        E, H = p.shape
        d = group_directions(groups, H, p.device)
        # each layer adds to the residual stream, so the group's share of the normalized router
        # input shrinks with depth (float32 margins 4.6, 2.5, 1.6, 1.1 nat at one gain): the gain
        # grows with the layer's index to hold them
        layer = int(pname.split(".")[2])
        p.normal_(0.0, ROUTER_NOISE, generator=g)
        p += (ROUTER_GAIN * (1 + layer) * d[torch.arange(E, device=p.device) % groups]).to(p.dtype)
        return True
    if pname.endswith("mlp.router.bias"):
        p.normal_(0.0, ROUTER_BIAS, generator=g)
        return True
    if pname.endswith("experts.gate_up_proj"):          # [E, H, 2F]: gate the even columns
        p.normal_(0.0, EXPERT_UP, generator=g)
        p[..., ::2].normal_(0.0, EXPERT_GATE, generator=g)
        return True
    if pname.endswith("experts.down_proj"):
        p.normal_(0.0, EXPERT_OUT, generator=g)
        return True
    return False


# DeepSeek-V3's fixture (issue 45, bench/NOTES.md). Its router is group-limited: sigmoid scores plus
# the correction bias rank the experts, a group scores the sum of its top-2, the top-4 of 8 groups
# are kept and the top-8 experts among their 16 are picked; the weights are the picked experts'
# sigmoid scores (no bias) normalized, times routed_scaling_factor. With every matrix 0.02 and the
# bias 0.1 * normal, many positions near-tie at one of those two cuts and HF's own bf16 run is another
# model there (its gate: bf16 vs float32 regret 0.572). So the choice is made decisive at both cuts:
#   - tokens fall in DSV3_CLASSES classes (id % classes); the embedding carries the class's direction
#     (group_directions, DSV3_EMBED_CLASS an element beside DSV3_EMBED_NOISE of the token's own), and
#     a router row is the sum over classes of +-1 times the class direction, scaled so that each logit
#     is about +-DSV3_LOGIT: a sigmoid score of ~0.99 ("high") or ~0.01 ("low"), saturated, so what
#     else the residual stream holds moves it little. The three dense layers add ~8 times the
#     embedding's scale to the stream: at 1.0 an element the class held 12 % of the MoE layers' input
#     and the other classes' directions, at +-1 in every row, put the smallest margin at 0.02; at 2.5
#     it holds DSV3_CLASS_SHARE (measured at the real width, bench/NOTES.md) and the margins 0.25;
#   - the correction bias gives each expert a role within its group (rotated by the group's index,
#     so the classes together reach most experts): +DSV3_BIAS, 0, -DSV3_BIAS, 0. Score plus bias then
#     lands on a grid ~0.3 apart (1.29, 0.99, 0.69, 0.31, 0.01, -0.29), and DSV3_PLAN sets each class's
#     high experts so that both cuts fall between grid levels, ~0.3 apart, far above bf16's error;
#   - the bias decides, where a defect ignoring it would pick otherwise: class 0 and 3 have 12 high
#     experts in their 4 groups and the -0.3 role drops 4 of them (unbiased: a 12-way tie); class 1's
#     groups beat its decoy groups only by the +0.3 role (unbiased both sum 1.0) and pick that role's
#     low expert too (weight ~0.01: a weight that wrongly includes the bias makes it ~0.3); class 2
#     routes as it would unbiased.
# The price: the weights among a token's 8 are near-equal (the scores saturate), so their relative
# sizes carry little, and a bias-picked low expert weighs ~1 %: a bug confined to it would pass
# (bench/NOTES.md: the defects that are caught).
DSV3_CLASSES = 4
DSV3_EMBED_NOISE, DSV3_EMBED_CLASS = 0.5, 2.5
DSV3_LOGIT, DSV3_CLASS_SHARE, DSV3_ROUTER_NOISE = 4.5, 0.27, 0.002
DSV3_BIAS, DSV3_BIAS_NOISE = 0.3, 0.005
# class -> (its 4 groups, the roles that score high there, the roles that score high in the others)
DSV3_PLAN = {0: ((0, 1, 2, 3), (1, 2, 3), (0,)),        # high roles 1, 3 kept, role 2 dropped by the bias
             1: ((4, 5, 6, 7), (1,), (2,)),             # the groups and their role-0 expert by the bias
             2: ((0, 2, 4, 6), (0, 2), ()),
             3: ((1, 3, 5, 7), (1, 2, 3), (2,))}
DSV3_ROLE_BIAS = (1.0, 0.0, -1.0, 0.0)                 # times DSV3_BIAS, role = (position + group) % 4


def _dsv3_decisive(config) -> bool:
    """The plan's shape: 8 groups of 4 experts, 4 groups kept, 8 experts picked (DeepSeek-V3's cut)."""
    return (getattr(config, "model_type", None) == "deepseek_v3" and config.n_group == 8
            and config.n_routed_experts == 32 and config.topk_group == 4 and config.num_experts_per_tok == 8)


def dsv3_signs(config):
    """[classes, experts]: +1 where the class's router logit is high, -1 where low (DSV3_PLAN)."""
    import torch
    per = config.n_routed_experts // config.n_group
    s = -torch.ones(DSV3_CLASSES, config.n_routed_experts)
    for c, (groups, high, decoy) in DSV3_PLAN.items():
        for gi in range(config.n_group):
            for pos in range(per):
                if (pos + gi) % per in (high if gi in groups else decoy):
                    s[c, gi * per + pos] = 1.0
    return s


def dsv3_role_bias(config):
    import torch
    per = config.n_routed_experts // config.n_group
    e = torch.arange(config.n_routed_experts)
    return DSV3_BIAS * torch.tensor(DSV3_ROLE_BIAS)[(e % per + e // per) % per]


def _deepseek_v2_rule(pname, p, g, config=None) -> bool:
    """DeepSeek-V3's decisive-routing fixture (the comment above); DeepSeek-V2 keeps the generic draws."""
    if config is None or not _dsv3_decisive(config):
        return False
    return _class_rule(pname, p, g, DSV3_CLASSES, (DSV3_EMBED_NOISE, DSV3_EMBED_CLASS),
                       (DSV3_LOGIT, DSV3_CLASS_SHARE, DSV3_ROUTER_NOISE), lambda: dsv3_signs(config))


# DeepSeek-V4's fixture (issue 47, bench/NOTES.md). Its cut's third layer routes by score: sqrtsoftplus
# of the router logits plus the correction bias picks the top-6 of 16, the picked experts weigh their
# scores (no bias) normalized, times routed_scaling_factor. With every matrix 0.02 and the bias
# 0.1 * normal, positions near-tie at the 6th pick and HF's own bf16 run is another model there (its
# gate: bf16 vs float32 regret 0.270, p99 0.417; infc's 0.352 / 0.487 against float32). So the pick
# is made decisive, as DeepSeek-V3's (above):
#   - tokens fall in DSV4_CLASSES classes (id % classes); the embedding carries the class's direction
#     (group_directions, DSV4_EMBED_CLASS an element beside DSV4_EMBED_NOISE of the token's own), and
#     a scored router's row is the sum over classes of +-1 times the class direction, scaled so that
#     each logit is about +-DSV4_LOGIT: sqrtsoftplus ~2.1 ("high") or ~0.1 ("low");
#   - each class scores K + 1 experts high (dsv4_signs): K of the E - classes "normal" experts and
#     its own "drop" expert, whose correction bias is -DSV4_DROP_BIAS (the others' ~0): the bias takes
#     the drop expert out, where a defect ignoring it picks among K + 1 near-equal scores;
#   - the hash routers' picks are the table's (decisive already); their rows keep the 0.02 draws.
# The price, as V3's: the weights among a token's K are near-equal (the scores saturate less than a
# sigmoid's, sqrt(softplus) grows with the logit, so they still differ by the logits' noise).
DSV4_CLASSES = 4
DSV4_EMBED_NOISE, DSV4_EMBED_CLASS = 0.5, 2.5
DSV4_LOGIT, DSV4_CLASS_SHARE, DSV4_ROUTER_NOISE = 4.5, 0.27, 0.002
DSV4_DROP_BIAS, DSV4_BIAS_NOISE = 1.0, 0.005


def _dsv4_decisive(config) -> bool:
    """The plan's shape: a scored router with K + 1 of its experts per class to spare."""
    return (getattr(config, "model_type", None) == "deepseek_v4"
            and config.n_routed_experts - DSV4_CLASSES >= config.num_experts_per_tok)


def dsv4_signs(config):
    """[classes, experts]: +1 where the class's router logit is high, -1 where low. Experts 0 ..
    classes - 1 are the drop experts (class c's is c); class c's K normal experts run on from
    c * K / 2 around the rest, so every normal expert is some class's."""
    import torch
    E, K, C = config.n_routed_experts, config.num_experts_per_tok, DSV4_CLASSES
    s = -torch.ones(C, E)
    for c in range(C):
        s[c, c] = 1.0
        for j in range(K):
            s[c, C + (c * K // 2 + j) % (E - C)] = 1.0
    return s


def dsv4_role_bias(config):
    import torch
    b = torch.zeros(config.n_routed_experts)
    b[:DSV4_CLASSES] = -DSV4_DROP_BIAS
    return b


def _deepseek_v4_rule(pname, p, g, config=None) -> bool:
    """DeepSeek-V4's attention sinks as GPT-OSS's (one logit a head the size of the scores), and its
    decisive-routing fixture (the comment above)."""
    if pname.endswith("self_attn.sinks"):
        p.normal_(0.0, 1.0, generator=g)
        return True
    if config is None or not _dsv4_decisive(config):
        return False
    scored = pname.endswith("mlp.gate.weight") and config.mlp_layer_types[int(pname.split(".")[2])] != "hash_moe"
    return _class_rule(pname, p, g, DSV4_CLASSES, (DSV4_EMBED_NOISE, DSV4_EMBED_CLASS),
                       (DSV4_LOGIT, DSV4_CLASS_SHARE, DSV4_ROUTER_NOISE), (lambda: dsv4_signs(config)) if scored else None)


def _routing_buffers(model, g):
    """DeepSeek-V3's and V4's routing state is buffers HF initializes to zeros (the checkpoint
    brings the values): every token hashed to expert 0 and no correction bias would leave the table
    and the bias untested. Each hash table row (V4) gets K distinct experts drawn from the E, each
    correction bias (V3's noaux_tc, V4) 0.1 * normal (the sigmoid / sqrtsoftplus scores differ by
    about that: it moves the top-k); DeepSeek-V3's golden cut's, its roles (_deepseek_v2_rule's
    comment). DeepSeek-V2 models (greedy top-k) have neither."""
    import torch
    for name, b in model.named_buffers():
        if name.endswith("gate.tid2eid"):
            V, K = b.shape
            E = model.config.n_routed_experts
            rows = torch.rand(V, E, generator=g, device=b.device).argsort(dim=-1)[:, :K]
            b.copy_(rows.to(b.dtype))
        elif name.endswith("gate.e_score_correction_bias"):
            if _dsv3_decisive(model.config):            # the decisive fixture's roles (_deepseek_v2_rule)
                noise = DSV3_BIAS_NOISE * torch.randn(b.shape, generator=g, device=b.device)
                b.copy_(dsv3_role_bias(model.config).to(b.device) + noise)
            elif _dsv4_decisive(model.config):          # the drop experts (_deepseek_v4_rule)
                noise = DSV4_BIAS_NOISE * torch.randn(b.shape, generator=g, device=b.device)
                b.copy_(dsv4_role_bias(model.config).to(b.device) + noise)
            else:
                b.copy_(0.1 * torch.randn(b.shape, generator=g, device=b.device))


# spec family -> rule(parameter name, parameter, generator) -> True where it drew the parameter
REDRAW = {"qwen3_5": _qwen3_5_rule, "gpt_oss": _gpt_oss_rule, "deepseek_v4": _deepseek_v4_rule,
          "deepseek_v2": _deepseek_v2_rule}
# spec family -> fill(model, generator): buffers that hold weights (saved with the checkpoint)
REDRAW_BUFFERS = {"deepseek_v4": _routing_buffers, "deepseek_v2": _routing_buffers}


def redraw(model, seed: int = 0, family: str | None = None):
    """Re-draw every parameter in place (see the module docstring): random, non-zero norms and
    biases; `family` (the spec's) picks explicit rules by name first (REDRAW) and fills the buffers
    that hold weights (REDRAW_BUFFERS). Raises on a 1-D
    weight HF initialized to neither all ones nor all zeros that no rule covers."""
    import torch
    dev = next(model.parameters()).device
    g = torch.Generator(device=dev)
    g.manual_seed(seed)
    rule = REDRAW.get(family)
    with torch.no_grad():
        for pname, p in model.named_parameters():          # tied weights appear once
            if rule is not None and rule(pname, p, g, model.config):
                continue
            if p.dim() >= 2:
                p.normal_(0.0, 0.02, generator=g)
            elif pname.endswith("bias"):
                p.normal_(0.0, 0.02, generator=g)
            elif bool((p == 1).all()):
                p.normal_(1.0, 0.1, generator=g)
            elif bool((p == 0).all()):
                p.normal_(0.0, 0.1, generator=g)
            else:
                raise ValueError(f"{pname}: a 1-D weight that HF initializes to neither 1 nor 0; "
                                 f"say in tests/gpu/gpu_families.py how to randomize it")
        if family in REDRAW_BUFFERS:
            REDRAW_BUFFERS[family](model, g)


def make_model(name: str, out: Path, device: str = "cuda", seed: int = 0, **extra) -> Path:
    """Random-weight HF directory for family `name`, made with transformers on `device` in bf16
    and saved with save_pretrained (safetensors). Checks the written config.json against the
    carried one (prepare.py's), through the spec's bindings."""
    import torch
    from transformers import AutoModelForCausalLM
    t0 = time.time()
    out = Path(out)
    tmp = out.with_name(out.name + ".partial")       # a killed run leaves no half directory
    shutil.rmtree(tmp, ignore_errors=True)
    cfg = hf_config(name, **extra)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    redraw(model, seed, family=_spec_and_values(name)[0].family)
    model.save_pretrained(tmp)
    n = sum(p.numel() for p in model.parameters())
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    if not extra:
        check_config(name, tmp)
    elif extra == SERVER.get(name):               # the SDK suite's build of the family
        check_config(name, tmp, config_dir(server_dir_name(name)))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    print(f"[families] {name}: {n / 1e9:.2f} B params made and saved in {time.time() - t0:.1f} s")
    return out


def _bound(value):
    """A bound value as the ops read it: rope parameters of the "default" type are no scaling
    (compiler/ops/rope.py), which transformers 5.17 writes as rope_parameters where a config
    written elsewhere has rope_scaling null."""
    if isinstance(value, dict) and value.get("rope_type", value.get("type")) == "default":
        return None
    return value


def check_config(name: str, model_dir: Path, carried_dir: Path | None = None):
    """The plan was built from config_dir(name)/config.json (prepare.py; carried_dir for another
    build of the family, as SERVER's); the model directory's config.json is what this machine's
    transformers wrote. They must bind the spec identically."""
    carried = Path(carried_dir or config_dir(name)) / "config.json"
    if not carried.exists():
        return                 # no artifact either: models.artifact() says to run prepare.py
    spec, _ = _spec_and_values(name)
    ours = json.loads((Path(model_dir) / "config.json").read_text())
    theirs = json.loads(carried.read_text())
    a, b = spec.bind(ours), spec.bind(theirs)
    diff = {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if _bound(a.get(k)) != _bound(b.get(k))}
    if diff:
        raise RuntimeError(f"{name}: {model_dir}/config.json binds {spec.path} differently from the "
                           f"config the artifact was built from ({carried}): {diff}")
