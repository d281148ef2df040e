"""HF's model of a quantized checkpoint computing the format's definition, for the golden gate
of the quantized models (session.sh `quant`) and its CPU check (tests/test_gpu_quant_stage.py).

transformers' own FP8 path on the GPU runs a Triton kernel it fetches with the `kernels` package
(0.16.x) from the Hub: the GPU machine has neither. Its `dequantize=True` path is plain torch
(W = code * weight_scale_inv per block), but then runs the linears without the format's
activation quantization (and in bf16 whatever the dtype). So: load dequantized, set each
quantized linear's weight to code * scale (float32, then the model's dtype), and quantize its input as
`quant_method: fp8` with `weight_block_size` defines it (compiler/quant/scheme.py,
dynamic_group): per token, in groups of block_k columns, s = amax / 448, x' = e4m3(x / s) * s
(torch's float8_e4m3fn cast, to nearest even, as compiler/ops/quant.py's round_e4m3).
MoE experts (Qwen3-30B-A3B-FP8 stores each expert's projections as fp8 modules; transformers
fuses them into one module, Qwen3MoeExperts' gate_up_proj [E, 2F, H] and down_proj [E, H, F]):
the fused stacks get the experts' dequantized weights and a forward that quantizes the input of
each projection, HF's own expert loop otherwise (set_experts).
"""
import json
import re
import sys
import types
from pathlib import Path

import torch

_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate|up|down)_proj$")

FP8_MAX = 448.0


def quantize_groups(x: torch.Tensor, group: int) -> torch.Tensor:
    """x with its last axis quantized per `group` columns (a ragged last group included), in
    float32, returned in x's dtype."""
    k = x.shape[-1]
    pad = -k % group
    xf = torch.nn.functional.pad(x.float(), (0, pad)) if pad else x.float()
    xg = xf.reshape(*x.shape[:-1], -1, group)
    amax = xg.abs().amax(-1, keepdim=True)
    s = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    out = (xg / s).to(torch.float8_e4m3fn).float() * s
    return out.reshape(*x.shape[:-1], -1)[..., :k].to(x.dtype)


def dequantized(model_dir, block) -> dict:
    """module -> its weight as the format defines it, W = code * scale per block (float32), for
    each module the checkpoint stores as fp8 (those with a weight_scale_inv)."""
    import numpy as np
    from infc.compiler.contract.safetensors_io import Checkpoint
    bn, bk = block
    ckpt = Checkpoint(model_dir)
    out = {}
    try:
        for name in ckpt.where:
            if name.endswith(".weight_scale_inv"):
                module = name[:-len(".weight_scale_inv")]
                codes, scale = ckpt.float32(module + ".weight"), ckpt.float32(name)
                n, k = codes.shape
                out[module] = codes * np.repeat(np.repeat(scale, bn, 0), bk, 1)[:n, :k]
    finally:
        ckpt.close()
    return out


def _experts_forward(quantize):
    """HF's Qwen3MoeExperts.forward (per chosen expert: gate|up, act, down, weighted index_add),
    with `quantize` applied to the input of each projection."""
    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        mask = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
        for e in torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()[:, 0].tolist():
            if e == self.num_experts:
                continue
            slot, tok = torch.where(mask[e])
            gate, up = torch.nn.functional.linear(quantize(hidden_states[tok]), self.gate_up_proj[e]).chunk(2, dim=-1)
            h = torch.nn.functional.linear(quantize(self.act_fn(gate) * up), self.down_proj[e])
            out.index_add_(0, tok, (h * top_k_weights[tok, slot, None]).to(out.dtype))
        return out
    return forward


def set_experts(model, weights: dict, quantize, dtype) -> set:
    """The per-expert modules of `weights` (name -> float32 [N, K], numpy or torch, e.g.
    model.layers.0.mlp.experts.3.gate_proj) written into the model's fused expert stacks, whose
    forward then quantizes each projection's input; returns the names set."""
    done, stacks = set(), {}
    for name, w in weights.items():
        m = _EXPERT.match(name)
        if m is None:
            continue
        experts = model.get_submodule(m.group(1))
        e, part = int(m.group(2)), m.group(3)
        f = experts.gate_up_proj.shape[1] // 2
        with torch.no_grad():
            t = (torch.from_numpy(w) if not isinstance(w, torch.Tensor) else w).to(experts.gate_up_proj.device, dtype)
            if part == "down":
                experts.down_proj[e] = t
            else:
                experts.gate_up_proj[e, (0 if part == "gate" else f):][:f] = t
        stacks[m.group(1)] = experts
        done.add(name)
    for experts in stacks.values():
        experts.forward = types.MethodType(_experts_forward(quantize), experts)
    return done


def load_by_definition(model_dir, q: dict, dtype):
    """HF's model of any other format (compressed-tensors, AWQ, GPTQ, fp8 per tensor, MXFP4 linears):
    built from config.json without its quantization_config (transformers would need each format's
    package), the unquantized tensors loaded by name, each quantized linear's weight set to its
    definition from the stored tensors (tests/quant_definitions.py, computed in float32, then the
    model's dtype) and its input quantized where the format says."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))        # tests/: the definitions
    from quant_definitions import WEIGHT, _acts, stored_quantized, writer_of
    writer, options = writer_of(q)
    config = AutoConfig.from_pretrained(model_dir)
    del config.quantization_config
    model = AutoModelForCausalLM.from_pretrained(model_dir, config=config, dtype=dtype)
    tensors = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    modules = stored_quantized(tensors, writer)
    if not modules:
        raise ValueError(f"{model_dir}: no tensor stored as {writer} ({q.get('quant_method')})")
    # transformers fuses a layer's experts into one module: their definitions go into its stacks
    experts = [m for m in modules if _EXPERT.match(m)]
    if experts:
        if any(f"{m}.input_scale" in tensors for m in experts):
            raise ValueError(f"{model_dir}: static activation scales per expert are not modelled here")
        act = _acts(writer, options, q, tensors, experts[0])    # dynamic or none: every expert's
        set_experts(model, {m: WEIGHT[writer](tensors, m, q).float() for m in experts},
                    (lambda x: act(x.float()).to(x.dtype)) if act is not None else (lambda x: x), dtype)
    for m in (m for m in modules if not _EXPERT.match(m)):
        linear = model.get_submodule(m)
        with torch.no_grad():
            linear.weight.data = WEIGHT[writer](tensors, m, q).to(linear.weight.device, dtype).contiguous()
        act = _acts(writer, options, q, tensors, m)
        if act is not None:
            linear.register_forward_pre_hook(lambda mod, args, act=act: (act(args[0].float()).to(args[0].dtype), *args[1:]))
    return model


def load(model_dir, dtype=torch.bfloat16):
    """AutoModelForCausalLM of model_dir; for an fp8 (block) checkpoint, dequantized with the
    activation quantization hooked in front of every quantized linear; any other format by its
    definition (load_by_definition)."""
    from transformers import AutoModelForCausalLM
    q = json.loads((Path(model_dir) / "config.json").read_text()).get("quantization_config")
    if not q:
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    if q.get("quant_method") != "fp8" or not q.get("weight_block_size") or q.get("activation_scheme", "dynamic") != "dynamic":
        return load_by_definition(model_dir, q, dtype)
    from transformers import FineGrainedFP8Config
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, quantization_config=FineGrainedFP8Config(
            weight_block_size=tuple(q["weight_block_size"]), dequantize=True,
            modules_to_not_convert=q.get("modules_to_not_convert")))
    model = model.to(dtype)                       # the quantizer loads the rest in bf16 too
    weights = dequantized(model_dir, q["weight_block_size"])
    group = q["weight_block_size"][1]
    hooked = set_experts(model, weights, lambda x: quantize_groups(x, group), dtype)
    for name, module in model.named_modules():
        if name in weights:
            module.weight.data = torch.from_numpy(weights[name]).to(module.weight.device, dtype)
            module.register_forward_pre_hook(lambda mod, args: (quantize_groups(args[0], group), *args[1:]))
            hooked.add(name)
    if hooked != set(weights):
        raise ValueError(f"{model_dir}: quantized modules without a linear in the HF model: "
                         f"{sorted(set(weights) - hooked)[:3]}")
    return model
