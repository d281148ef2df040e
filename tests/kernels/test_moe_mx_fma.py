"""The MoE decode templates' CUDA-core path for MXFP4 experts (triton/_mx_fma.j2: int32 words of
e2m1 codes decoded by bit placement, a group's power-of-two scale once) under the interpreter,
against the ops' references on random codes and power-of-two scales (tests/kernels/
test_moe_quant_kernels.py's cases: H = 48 and F = 40, ragged against the 512-column K step and,
for down, against the groups of 32; E = 10 experts).

1 token (its own loop), 2 and 3 tokens over 8 of 10 experts (experts chosen by several tokens:
the FMA_T loop; and by one: the one-token loop, in the same launch), 6 tokens (some experts past
FMA_T = 4 on tl.dot_scaled beside the CUDA-core ones), biases on and off, GPT-OSS's clamped SwiGLU,
a token naming an expert in two slots and slots of id -1 (expert parallelism); and the decode of
all 16 codes against the format's table.
"""
import importlib.util
import zlib

import numpy as np
import pytest
import torch

from infc.runtime.weights.quant_pack import E2M1

from exhaustive import EXHAUSTIVE

from .harness import render
from .test_moe_kernels import E, F, H
from .test_moe_quant_kernels import SCHEMES, _attrs, down_case, gate_up_case

S = SCHEMES["e2m1-g32"]
OSS = {"act": "clamped_swiglu", "alpha": 1.702, "limit": 0.8}

# (launch, T, KT, bias, ep): ep "dup" repeats expert 0 in a token's slots (zero weights), True
# leaves slots of id -1 (other ranks' experts)
CASES = [("gate_up", 1, 8, True, False), ("down", 3, 8, False, "dup"), ("gate_up", 2, 8, False, True),
         ("down", 1, 8, True, False), ("gate_up", 6, 8, True, False), ("down", 2, 4, True, True),
         ("gate_up", 3, 8, True, "dup"), ("down", 6, 8, False, False)]


@pytest.mark.parametrize("launch,T,KT,bias,ep", [
    pytest.param(*c, id=f"{c[0]}-T{c[1]}-KT{c[2]}-{'bias' if c[3] else 'nobias'}{'-ep-' + str(c[4]) if c[4] else ''}",
                 marks=() if i < 4 else EXHAUSTIVE) for i, c in enumerate(CASES)])
def test_mxfp4_experts_on_cuda_cores(launch, T, KT, bias, ep):
    extra = {"has_bias": True} if bias else {}
    if launch == "gate_up" and bias:
        extra.update(OSS)
    case = gate_up_case if launch == "gate_up" else down_case
    k = case(S, T, KT, "moe_" + launch, {}, zlib.crc32(f"mxfma{launch}{T}{KT}{bias}".encode()), extra, ep)
    c = k.meta["constexprs"]
    assert c["FMA_T"] == 4 and c["FMA_BLOCK_K"] == 512 and "_e2m1_pair(c_" in k.source
    assert k.meta["maxnreg"] == 168      # three 4-warp programs an SM (compiler/codegen/aot.py)
    assert "if n == 1:" in k.source and "tl.dot_scaled(" in k.source     # both loops and the dot path


def test_mxfp4_cuda_core_path_needs_whole_words():
    """K % 8 != 0 (a row not whole int32 words): every token count takes tl.dot_scaled."""
    ins = [("act", ["T", 2, 36], "bf16"), ("weights", ["T", 2], "f32"), ("ids", ["T", 2], "i32"),
           ("down", [E, H, 36], "e2m1", "weight"), ("rows", [E, "T"], "i32"), ("counts", [E], "i32"),
           ("w_scale", [E, H, 2], "f32", "weight")]
    k = render("moe_down", "moe_down", ins, [("y", ["T", H], "bf16")], attrs=_attrs(S), phase="decode")
    assert k.meta["constexprs"]["FMA_T"] == 0 and "_e2m1_pair" not in k.source


def test_e2m1_decode_of_every_code(tmp_path):
    """_e2m1_pair(w, i) of words holding all 16 codes at every nibble position i and i + 4, times
    2^14, is the format's value of each code (runtime/weights/quant_pack.py's E2M1 table:
    (-1)^s * (e == 0 ? m / 2 : 2^(e - 1) * (1 + m / 2))), -0 included."""
    ins = [("act", ["T", 2, F], "bf16"), ("weights", ["T", 2], "f32"), ("ids", ["T", 2], "i32"),
           ("down", [E, H, F], "e2m1", "weight"), ("rows", [E, "T"], "i32"), ("counts", [E], "i32"),
           ("w_scale", [E, H, 2], "f32", "weight")]
    src = render("moe_down", "moe_down", ins, [("y", ["T", H], "bf16")], attrs=_attrs(S), phase="decode").source
    f = tmp_path / "e2m1_probe.py"
    f.write_text(src + """

@triton.jit
def probe(w_ptr, out_ptr):
    j = tl.arange(0, 16)
    w = tl.load(w_ptr + j)
    for i in tl.static_range(4):
        lo, hi = _e2m1_pair(w, i)
        tl.store(out_ptr + j * 8 + i, lo * 16384.0)
        tl.store(out_ptr + j * 8 + i + 4, hi * 16384.0)
""")
    spec = importlib.util.spec_from_file_location("e2m1_probe", f)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    # word j holds code (j + p) % 16 at nibble p: every code at every position
    codes = (np.arange(16)[:, None] + np.arange(8)[None, :]) % 16
    words = (codes << (4 * np.arange(8))[None, :]).sum(1).astype(np.uint32).view(np.int32)
    out = torch.zeros((16, 8), dtype=torch.float32)
    mod.probe[(1,)](torch.from_numpy(words.copy()), out)
    want = E2M1[codes]
    np.testing.assert_array_equal(out.numpy(), want)
    np.testing.assert_array_equal(np.signbit(out.numpy()), np.signbit(want))
