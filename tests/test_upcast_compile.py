"""The grouped expert GEMMs that hold both tiles (compiler/passes/upcast_experts.py: the codes tile
and the bf16 tile of the upcast stack) compiled for sm_90 as `infc build` compiles them, within
the shared memory one block may use: the interpreter cannot see that limit, and qwen3-30b-a3b's
FP8 blocks once made the build fail there (246,784 B of 232,448: the pass now upcasts weight-only
4-bit codes alone, which this checks by the scheme). The fast suite compiles MXFP4 gate|up at its
prefill defaults (the widest pair of tiles); --exhaustive the rest of the 4-bit schemes' launches.
"""
import tempfile
from pathlib import Path

import pytest

from infc.compiler.codegen import aot
from infc.compiler.codegen.render import render_template
from infc.compiler.passes.upcast_experts import upcasts
from infc.compiler.quant.scheme import QuantScheme

from exhaustive import EXHAUSTIVE

H, F, E, KT = 2880, 2880, 32, 4           # GPT-OSS-20B's experts
SCHEMES = {"e2m1-g32": QuantScheme("e2m1", 1, 32), "u4-g32": QuantScheme("u4", 1, 32),
           "u4-g128-zero": QuantScheme("u4", 1, 128, zeros=True)}


def _t(name, shape, dtype, kind="buffer"):
    return {"name": name, "shape": list(shape), "dtype": dtype, "kind": kind}


def _kernel(launch: str, s: QuantScheme):
    comp = [_t(c, [E, (2 * F if launch == "gate_up" else H), s.groups(H if launch == "gate_up" else F)], "f32", "weight")
            for c in s.companions()]
    attrs = {"quant": s.attrs(), **{f"has_{c}": True for c in s.companions()}, "has_w_upcast": True,
             "upcast_rows": 512}
    if launch == "gate_up":
        ins = [_t("x", ["T", H], "bf16"), _t("ids", ["T", KT], "i32"), _t("w", [E, 2 * F, H], s.codes, "weight"),
               _t("rows", [E, "T"], "i32"), _t("counts", [E], "i32")] + comp + [_t("wu", [E, 2 * F, H], "bf16")]
        outs = [_t("act", ["T", KT, F], "bf16")]
    else:
        ins = [_t("act", ["T", KT, F], "bf16"), _t("rw", ["T", KT], "f32"), _t("ids", ["T", KT], "i32"),
               _t("w", [E, H, F], s.codes, "weight"), _t("rows", [E, "T"], "i32"), _t("counts", [E], "i32")] \
            + comp + [_t("wu", [E, H, F], "bf16")]
        outs = [_t("y", ["T", H], "bf16")]
    ctx = {"op": "moe_" + launch, "phase": "prefill", "inputs": ins, "outputs": outs, "attrs": attrs,
           "config": {}, "caches": {}, "page_size": 16, "tune": {}}
    return render_template("triton", f"moe_{launch}_grouped", ctx)


@pytest.mark.parametrize("scheme,launch", [
    pytest.param(s, la, marks=() if (s, la) == ("e2m1-g32", "gate_up") else EXHAUSTIVE)
    for s in SCHEMES for la in ("gate_up", "down")])
def test_both_tiles_fit_sm90_shared_memory(scheme, launch):
    s = SCHEMES[scheme]
    assert upcasts(s)
    k = _kernel(launch, s)
    assert "_tile_bf16(" in k.source and "if T >= 512:" in k.source
    with tempfile.TemporaryDirectory() as d:          # (a worker process: the suite interprets Triton)
        info = aot.compile_kernels({k.id: k}, Path(d) / "bin", "sm_90", jobs=1, progress=False)["kernels"][k.id]
    assert 0 < info["shared"] <= aot.MAX_SHARED[90]     # compile_kernels refuses one past it


def test_eight_bit_codes_are_not_upcast():
    """fp8 blocks with quantized activations (Qwen3-30B-A3B-FP8's experts) and int8 per channel
    keep their codes path: their tiles with a bf16 twin are past the limit or not worth it."""
    assert not upcasts(QuantScheme("f8e4m3", 128, 128, act="dynamic_group", act_group=128))
    assert not upcasts(QuantScheme("u8", 1, None))
    assert not upcasts(QuantScheme("u4", 1, 128, act="dynamic_token"))
