"""o_proj's activation codes in decode attention's epilogue (compiler/passes/merge_epilogues.py; the
narrow and decode programs), under the interpreter: the launch with the quantize_act epilogue writes the same o, bit for bit,
as the launch without it, and codes / scales equal to compiler/ops/quant.py's act_codes of that
bf16 o (what the quantize_act launch it replaces makes), through both stores: a split that writes
its row alone (a context of one key block) and the split merge (several blocks). With and without
the merged qk_norm_rope_cache prologue (the narrow plan has both); head dims 32 / 64 / 128, GQA
groups 2 / 4 / 8, sinks."""
import dataclasses

import numpy as np
import pytest
import torch

from infc.compiler.codegen.render import TemplateError
from infc.compiler.ops.quant import act_codes

from exhaustive import EXHAUSTIVE

from .harness import poison, rand, render, run
from .test_act_codes_kernels import _same_codes
from .test_attention_kernels import PS, Paged, kv_caches
from .test_quant_linear_kernels import SCHEMES

# prologue? (a narrow step's launch; else the decode program's), hq, hkv, d, context lens (the new
# token each one's last key), tune, sinks?
CASES = [
    (True, 4, 2, 32, [9, 70], {"NUM_SPLITS": 4, "BLOCK_N": 16}, False),
    (False, 8, 1, 64, [5, 300], {"NUM_SPLITS": 8, "BLOCK_N": 32}, False),
    pytest.param(True, 8, 2, 128, [12, 40], {"NUM_SPLITS": 2, "BLOCK_N": 16}, True, marks=EXHAUSTIVE),
]


def _scheme(d):
    """fp8 blocks with dynamic activation groups of one head (d columns)."""
    return dataclasses.replace(SCHEMES["fp8-32x64-group64"], act_group=d)


def _epilogue(d, output):
    return {"op": "quantize_act", "output": output, "value": "o_flat", "shape": ["T", None],
            "writes": 2, "attrs": {"act_quant": _scheme(d).attrs()}}


@pytest.mark.parametrize("pro,hq,hkv,d,lens,tune,sinks", CASES)
def test_attention_decode_writes_o_projs_codes(pro, hq, hkv, d, lens, tune, sinks):
    gen = np.random.default_rng(hq * 13 + d + len(lens))
    B = len(lens)
    attrs = {"kv_heads": hkv, "scale": None, "window": None, "softcap": None}
    sink_in, sink_t = [], None
    if sinks:
        attrs["has_sinks"] = True
        sink_in = [("sinks", [hq], "f32", "weight")]
        sink_t = torch.from_numpy(gen.standard_normal(hq).astype(np.float32) * 3)
    page = Paged(gen, [(L - 1, 1) for L in lens], hkv, d)
    dims = {"T": B, "B": B}
    o_spec = ("o", ["T", hq, d], "bf16")
    code_specs = [("codes", ["T", hq * d], "f8e4m3"), ("a_scale", ["T", hq], "f32")]
    if pro:
        # the narrow plan's form: inputs [qkv, cache], outputs [cache, o, codes, a_scale]
        slots = [page.pages[b][(L - 1) // PS] * PS + (L - 1) % PS for b, L in enumerate(lens)]
        qk_attrs = {"q_heads": hq, "kv_heads": hkv, "head_dim": d, "eps": 1e-6, "theta": 1000000,
                    "scaling": None, "rotary_dim": None, "q_norm": False, "k_norm": False}
        ins = [("qkv", ["T", (hq + 2 * hkv) * d], "bf16"), ("cache", [], "", "cache")] + sink_in
        outs = [("cache", [], "", "cache"), o_spec]
        prologue = {"op": "qk_norm_rope_cache", "inputs": 1, "output": 0, "value": "q", "writes": 1,
                    "attrs": qk_attrs}
        x = rand((B, (hq + 2 * hkv) * d), gen=gen, scale=3.0)
        binds = {"in:0": x, "meta:positions": torch.tensor([L - 1 for L in lens], dtype=torch.int32),
                 "meta:slot_mapping": torch.tensor(slots, dtype=torch.int32),
                 **({"in:2": sink_t} if sinks else {})}
    else:
        ins = [("q", ["T", hq, d], "bf16"), ("cache", [], "", "cache")] + sink_in
        outs, prologue = [o_spec], None
        binds = {"in:0": rand((B, hq, d), gen=gen, scale=2.0), **({"in:2": sink_t} if sinks else {})}
    o_at = len(outs) - 1

    def launch(epilogue):
        """(o, codes, scales) of one launch on a copy of the caches."""
        caches = {"cache:k": page.k_cache.clone(), "cache:v": page.v_cache.clone()}
        k = render("attention_decode", "attention_cached", ins, outs + (code_specs if epilogue else []), attrs=attrs,
                   caches=kv_caches(hkv, d), tune=tune, prologue=prologue, narrow=pro,
                   epilogue=_epilogue(d, o_at) if epilogue else None)
        o = poison((B, hq, d))
        codes = torch.full((B, hq * d), 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn)   # NaN: unwritten shows
        scales = poison((B, hq), "f32")
        run(k, {**binds, **page.bindings(), **caches, f"out:{o_at}": o, f"out:{o_at + 1}": codes,
                f"out:{o_at + 2}": scales}, dims)
        return o, codes, scales

    o_plain, _, _ = launch(False)
    o, codes, scales = launch(True)
    assert not torch.isnan(o.float()).any()
    assert torch.equal(o, o_plain)                      # the epilogue leaves o as it was
    want_codes, want_scales = act_codes(o.float().numpy().reshape(B, hq * d), _scheme(d))
    _same_codes(codes, want_codes)
    assert np.array_equal(scales.numpy(), want_scales)


def test_the_epilogue_needs_head_dim_groups():
    with pytest.raises(TemplateError, match="head_dim_groups"):
        render("attention_decode", "attention_cached", [("q", ["T", 4, 64], "bf16"), ("cache", [], "", "cache")],
               [("o", ["T", 4, 64], "bf16"), ("codes", ["T", 256], "f8e4m3"), ("a_scale", ["T", 8], "f32")],
               attrs={"kv_heads": 2, "scale": None, "window": None, "softcap": None}, caches=kv_caches(2, 64),
               epilogue=_epilogue(32, 0))
