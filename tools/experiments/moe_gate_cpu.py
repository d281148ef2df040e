"""Does a MoE golden gate separate bf16 noise from bugs? (issue 45; a CPU experiment, not a test)

    .venv/bin/python tools/experiments/moe_gate_cpu.py [--family gpt-oss-20b-l4] [--layers N]
        [--vocab 4096] [--lens 64,140,160] [--old] [--defects all|none|NAME,...]

Builds a family's golden-gate cut (tests/gpu/gpu_families.py: gpt-oss-20b-l4, 32 experts top-4;
deepseek-v3-l5, 3 dense + 2 MoE layers, 32 experts, group-limited top-8; deepseek-v4-flash-l3, two
hash-routed layers and one scored, 16 experts top-6, no planted defects yet) at its real widths, the
vocabulary cut to --vocab for the CPU's memory, with the GPU fixture's weights (make_model's way:
drawn in bf16 by redraw; --old: the generic draws, before the decisive fixture), runs HF eager in
float32 (each decoder layer's weights upcast only while it runs, so the float32 model never exists
whole: DeepSeek-V3's cut is 5.1 B parameters) and then in bf16, and prints the golden gate's
statistics (tests/gpu/test_golden.py: regret / mean / p99 over the last 16 positions of each prompt)
of HF bf16 against float32, the routing agreement (the picked experts of every MoE layer at every
position: tests/gpu/route_agreement.routes) and the float32 choice margins per layer. Then each
planted defect (DEFECTS: the family's), monkeypatched into the bf16 model, is judged as the gate judges infc:
against the clean HF bf16 (limits), else against float32 within max(limits, HF bf16's own distance).
"""
import argparse
import sys
import types
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "gpu"))
# test_golden's metrics without its CUDA runner (this machine has no cuda-bindings)
sys.modules.setdefault("infc.runtime.cuda.runner", types.SimpleNamespace(CudaRunner=None))
import gpu_families  # noqa: E402
import route_agreement  # noqa: E402
from test_golden import DECODE, LIMITS, gate, within, worst_of  # noqa: E402

# family -> (default layers, config overrides for a layer count): the cut's own
CUTS = {"gpt-oss-20b-l4": (4, lambda n: {"layer_types": ["sliding_attention", "full_attention"] * (n // 2)}),
        "deepseek-v3-l5": (5, lambda n: {}),
        gpu_families.DSV4_CUT: (3, lambda n: {})}


def build(name, layers, vocab, old):
    from transformers import AutoModelForCausalLM
    family = gpu_families._spec_and_values(name)[0].family
    cfg = gpu_families.hf_config(name, vocab_size=vocab, num_hidden_layers=layers, pad_token_id=None,
                                 **CUTS[name][1](layers))
    cfg._attn_implementation = "eager"
    cfg._experts_implementation = "eager"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    if old:
        rule = gpu_families.REDRAW.pop(family)
        if family == "gpt_oss":
            gpu_families.REDRAW[family] = lambda n, p, g, c=None: (
                n.endswith("self_attn.sinks") and (p.normal_(0.0, 1.0, generator=g) is not None))
        elif family == "deepseek_v4":
            gpu_families.REDRAW[family] = lambda n, p, g, c=None: rule(n, p, g, None)   # the sinks alone
        fills = gpu_families._dsv3_decisive, gpu_families._dsv4_decisive
        gpu_families._dsv3_decisive = gpu_families._dsv4_decisive = lambda c: False
    gpu_families.redraw(model, 0, family=family)
    if old:
        gpu_families.REDRAW[family] = rule
        gpu_families._dsv3_decisive, gpu_families._dsv4_decisive = fills
    # what from_pretrained(dtype=bf16) keeps float32 (the saved values are bf16's)
    keep = tuple(model._keep_in_fp32_modules or ()) + tuple(model._keep_in_fp32_modules_strict or ())
    for mname, mod in model.named_modules():
        for pn, t in list(mod.named_parameters(recurse=False)) + list(mod.named_buffers(recurse=False)):
            if any(k in (mname.split(".")[-1], pn) for k in keep):
                t.data = t.data.float()
    return model


def _cast(module, dtype):
    """`dtype`, or None: back to each weight's own (bf16, or float32 where HF keeps it)."""
    for p in module.parameters():
        p.data = p.data.to(dtype or p._own_dtype)


def forward(model, seqs, suffix, f32):
    """Logits [T, V] per sequence and its routes (route_agreement.routes); `f32`: HF float32 of the
    bf16 weights (from_pretrained(dtype=float32)), one decoder layer upcast at a time."""
    layers = model.model.layers
    was = {n: p.dtype for n, p in model.named_parameters()}
    for p in model.parameters():
        p._own_dtype = p.dtype
    hooks = []
    if f32:
        for n, p in model.named_parameters():
            if not n.startswith("model.layers."):
                p.data = p.data.float()
        hooks += [layer.register_forward_pre_hook(lambda m, a: _cast(m, torch.float32)) for layer in layers]
        hooks += [layer.register_forward_hook(lambda m, a, o: _cast(m, None)) for layer in layers]
    logits = []
    try:
        routes = route_agreement.routes(model, seqs, suffix, device="cpu", logits=logits)
    finally:
        for h in hooks:
            h.remove()
        for n, p in model.named_parameters():
            p.data = p.data.to(was[n])
    return logits, routes


def tail(logits):
    return [lg[-DECODE:] for lg in logits]


def stats(cand, ref):
    return worst_of([gate(c, r) for c, r in zip(tail(cand), tail(ref))])


def verdict(cand, bf16, fp32):
    """test_golden.judge's rule, with HF bf16 as the reference and HF float32 as the fallback."""
    s = stats(cand, bf16)
    if within(s, LIMITS):
        return True, s, None
    ours, theirs = stats(cand, fp32), stats(bf16, fp32)
    bound = tuple(max(lim, t) for lim, t in zip(LIMITS, theirs))
    return within(ours, bound), s, ours


def fmt(s):
    return "regret %.3f mean %.4f p99 %.3f" % s


# Planted defects: each a context manager patching HF's GptOss classes (one bug an infc kernel could have)
def _defects():
    from transformers.models.gpt_oss import modeling_gpt_oss as m

    def patch(obj, attr, new):
        class P:
            def __enter__(self):
                self.old = getattr(obj, attr)
                setattr(obj, attr, new(self.old))

            def __exit__(self, *a):
                setattr(obj, attr, self.old)
        return P()

    def wrong_expert(old):          # expert 5's tokens computed with expert 6's weights
        def fwd(self, hidden, router_indices=None, routing_weights=None):
            idx = torch.where(router_indices == 5, torch.full_like(router_indices, 6),
                              torch.where(router_indices == 6, torch.full_like(router_indices, 5), router_indices))
            # the weights stay with the chosen slot: only the matrices are swapped
            return old(self, hidden, idx, routing_weights)
        return fwd

    def clamp_both(old):            # the gate clamped at [-limit, limit] (HF: max only)
        def f(self, gate_up):
            gate, up = gate_up[..., ::2], gate_up[..., 1::2]
            gate = gate.clamp(min=-self.limit, max=self.limit)
            up = up.clamp(min=-self.limit, max=self.limit)
            return (up + 1) * gate * torch.sigmoid(gate * self.alpha)
        return f

    def limit_off(old):             # the limit a little wrong: 8 instead of 7
        def f(self, gate_up):
            lim, self.limit = self.limit, self.limit + 1.0
            try:
                return old(self, gate_up)
            finally:
                self.limit = lim
        return f

    def no_clamp(old):              # the clamp left out
        def f(self, gate_up):
            lim, self.limit = self.limit, float("inf")
            try:
                return old(self, gate_up)
            finally:
                self.limit = lim
        return f

    def no_plus_one(old):           # (up) * glu instead of (up + 1) * glu
        def f(self, gate_up):
            gate, up = gate_up[..., ::2], gate_up[..., 1::2]
            gate = gate.clamp(max=self.limit)
            up = up.clamp(min=-self.limit, max=self.limit)
            return up * gate * torch.sigmoid(gate * self.alpha)
        return f

    def no_sink(old):               # the sinks dropped from the softmax
        def f(module, q, k, v, mask, scaling, dropout=0.0, **kw):
            s = module.sinks.data.clone()
            module.sinks.data.fill_(-1e4)
            try:
                return old(module, q, k, v, mask, scaling, dropout, **kw)
            finally:
                module.sinks.data.copy_(s)
        return f

    def sink_head_shift(old):       # each head reads its neighbour's sink
        def f(module, q, k, v, mask, scaling, dropout=0.0, **kw):
            s = module.sinks.data.clone()
            module.sinks.data.copy_(torch.roll(s, 1))
            try:
                return old(module, q, k, v, mask, scaling, dropout, **kw)
            finally:
                module.sinks.data.copy_(s)
        return f

    def bias_off(attr):             # one bias missing in every expert
        def make(old):
            def fwd(self, hidden, router_indices=None, routing_weights=None):
                b = getattr(self, attr).data.clone()
                getattr(self, attr).data.zero_()
                try:
                    return old(self, hidden, router_indices, routing_weights)
                finally:
                    getattr(self, attr).data.copy_(b)
            return fwd
        return make

    def router_bias_off(old):
        def fwd(self, hidden):
            return old_router(self, hidden, use_bias=False)
        return fwd

    def _router(self, hidden, use_bias=True, renorm=True):
        logits = torch.nn.functional.linear(hidden, self.weight, self.bias if use_bias else None)
        top, idx = torch.topk(logits, self.top_k, dim=-1)
        if renorm:
            scores = torch.softmax(top, dim=1, dtype=top.dtype)
        else:                       # softmax over all E, the top-k's probabilities not renormalized
            scores = torch.gather(torch.softmax(logits, -1, dtype=logits.dtype), 1, idx)
        return logits, scores, idx
    old_router = _router

    def no_renorm(old):
        return lambda self, hidden: _router(self, hidden, renorm=False)

    def o_bias_off(old):            # o_proj's bias dropped
        def fwd(self, *a, **kw):
            b = self.o_proj.bias.data.clone()
            self.o_proj.bias.data.zero_()
            try:
                return old(self, *a, **kw)
            finally:
                self.o_proj.bias.data.copy_(b)
        return fwd

    def window_off_by_one(old):     # the sliding window one key too wide
        def fwd(self, *a, **kw):
            w = self.sliding_window
            if w:
                self.sliding_window = w + 1
            try:
                return old(self, *a, **kw)
            finally:
                self.sliding_window = w
        return fwd

    return {
        "wrong-expert-5-6": patch(m.GptOssExperts, "forward", wrong_expert),
        "clamp-gate-both-sides": patch(m.GptOssExperts, "_apply_gate", clamp_both),
        "swiglu-limit-8": patch(m.GptOssExperts, "_apply_gate", limit_off),
        "swiglu-no-clamp": patch(m.GptOssExperts, "_apply_gate", no_clamp),
        "swiglu-no-plus-one": patch(m.GptOssExperts, "_apply_gate", no_plus_one),
        "no-sinks": patch(m, "eager_attention_forward", no_sink),
        "sinks-shifted-head": patch(m, "eager_attention_forward", sink_head_shift),
        "no-gate-up-bias": patch(m.GptOssExperts, "forward", bias_off("gate_up_proj_bias")),
        "no-down-bias": patch(m.GptOssExperts, "forward", bias_off("down_proj_bias")),
        "no-router-bias": patch(m.GptOssTopKRouter, "forward", router_bias_off),
        "router-not-renormalized": patch(m.GptOssTopKRouter, "forward", no_renorm),
        "no-o-bias": patch(m.GptOssAttention, "forward", o_bias_off),
        # the mask is built from config.sliding_window: patch the config, not the layer
        "window-129": None,
    }



def _dsv3_defects():
    """DeepSeek-V3's routing and MoE, each mechanism broken once (HF's DeepseekV3 classes patched)."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as m

    def router(self, hidden, bias_choice=True, bias_weights=False, groups=True, scale=True, renorm=True):
        h = hidden.view(-1, self.hidden_dim)
        logits = torch.nn.functional.linear(h.float(), self.weight.float())
        scores = logits.sigmoid()
        choice = scores + (self.e_score_correction_bias if bias_choice else 0)
        if groups:
            group = choice.view(-1, self.num_group, self.num_experts // self.num_group).topk(2, dim=-1)[0].sum(-1)
            keep = torch.zeros_like(group).scatter_(1, group.topk(self.topk_group, dim=-1)[1], 1)
            mask = keep.unsqueeze(-1).expand(-1, self.num_group, self.num_experts // self.num_group).reshape(-1, self.num_experts)
            choice = choice.masked_fill(~mask.bool(), float("-inf"))
        idx = choice.topk(self.top_k, dim=-1, sorted=False)[1]
        w = (scores + self.e_score_correction_bias if bias_weights else scores).gather(1, idx)
        if renorm:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return logits, w * (self.routed_scaling_factor if scale else 1.0), idx

    def patch_router(**kw):
        class P:
            def __enter__(self):
                self.old = m.DeepseekV3TopkRouter.forward
                m.DeepseekV3TopkRouter.forward = lambda r, h: router(r, h, **kw)

            def __exit__(self, *a):
                m.DeepseekV3TopkRouter.forward = self.old
        return P()

    class NoShared:
        def __enter__(self):
            self.old = m.DeepseekV3MoE.forward

            def fwd(moe, hidden):
                shape = hidden.shape
                _, w, idx = moe.gate(hidden)
                return moe.experts(hidden.view(-1, shape[-1]), idx, w).view(*shape)
            m.DeepseekV3MoE.forward = fwd

        def __exit__(self, *a):
            m.DeepseekV3MoE.forward = self.old

    return {"same-router-rewritten (control)": patch_router(),
            "bias-ignored-in-choice": patch_router(bias_choice=False),
            "bias-in-weights": patch_router(bias_weights=True),
            "no-group-limit": patch_router(groups=False),
            "no-routed-scaling": patch_router(scale=False),
            "not-renormalized": patch_router(renorm=False),
            "no-shared-expert": NoShared()}


DEFECTS = {"gpt-oss-20b-l4": _defects, "deepseek-v3-l5": _dsv3_defects}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--family", default="gpt-oss-20b-l4", choices=list(CUTS))
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--lens", default="64,140,160")
    ap.add_argument("--old", action="store_true")
    ap.add_argument("--defects", default="all")
    a = ap.parse_args()
    name = a.family
    layers = a.layers or CUTS[name][0]
    suffix = gpu_families.DECISIVE_ROUTING[name]
    rng = np.random.default_rng(0)
    seqs = [[int(t) for t in rng.integers(0, a.vocab, n + DECODE)] for n in map(int, a.lens.split(","))]
    model = build(name, layers, a.vocab, a.old)
    l32, r32 = forward(model, seqs, suffix, f32=True)
    l16, r16 = forward(model, seqs, suffix, f32=False)
    agree, flips, mmin = route_agreement.route_agreement(r32, r16)
    mmed = np.median(np.concatenate([m for _, m in r32], 1), 1)
    print(f"{name}: {'old' if a.old else 'decisive'} fixture, {layers} layers, prompts {a.lens}: HF bf16 vs "
          f"float32 {fmt(stats(l16, l32))} (limits {LIMITS}); routing agreement {agree:.4f} ({flips} flips of "
          f"{sum(p.shape[0] * p.shape[1] for p, _ in r32)} layer-positions); float32 choice margin per MoE "
          f"layer min {np.round(mmin, 3).tolist()} median {np.round(mmed, 3).tolist()}", flush=True)
    defects = DEFECTS.get(name, dict)()
    pick = list(defects) if a.defects == "all" else ([] if a.defects == "none" else a.defects.split(","))
    for name in pick:
        ctx = defects[name]
        if ctx is None:
            w = model.config.sliding_window
            model.config.sliding_window = w + 1
            lg, _ = forward(model, seqs, suffix, f32=False)
            model.config.sliding_window = w
        else:
            with ctx:
                lg, _ = forward(model, seqs, suffix, f32=False)
        ok, s, s32 = verdict(lg, l16, l32)
        print(f"  defect {name}: {'PASSES (not caught)' if ok else 'fails (caught)'}: vs HF bf16 {fmt(s)}"
              + (f"; vs float32 {fmt(s32)}" if s32 else ""), flush=True)


if __name__ == "__main__":
    main()
