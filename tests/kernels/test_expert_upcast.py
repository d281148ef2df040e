"""expert_upcast (compiler/passes/upcast_experts.py) under the interpreter: a quantized expert stack
dequantized to bf16 once, and the grouped GEMMs reading it in steps of at least upcast_rows rows.

The stack equals the format's definition (compiler/ops/quant.py dequantize) rounded to bf16, bit
for bit, for every scheme of test_moe_quant_kernels (ragged N = 80 / 48 and K = 48 / 40 against
the tiles and the groups of 32); the grouped GEMMs on it give the bits they give on the codes
(the tile they dequantize in registers is that bf16 value), and below their rows they read the
codes only (the stack poisoned with NaN).
"""
import zlib

import numpy as np
import pytest
import torch

from infc.compiler.contract.bind import grid

from exhaustive import EXHAUSTIVE

from .harness import bf16, poison, render, run
from .test_moe_kernels import E, F, H
from .test_moe_quant_kernels import CASE, FAST, PATHS, SCHEMES, TEMPLATES, _attrs, _specs, quantized_stack


def upcast(s, w, comp, n, k, T, rows=1, tune=None):
    """(kernel, the stack it wrote [E, n, k] bf16) at a step of T rows."""
    ins = [("codes", [E, n, k], s.codes, "weight")] + _specs(comp)
    kern = render("expert_upcast", "expert_upcast", ins, [("w", [E, n, k], "bf16")],
                  attrs={**_attrs(s), "rows": rows, "dim": "T"}, phase="prefill", tune=tune)
    out = poison((E, n, k))
    bind = {"in:0": w, "out:0": out, **{f"in:{1 + i}": torch.as_tensor(a) for i, a in enumerate(comp.values())}}
    run(kern, bind, {"T": T, "B": 1})
    return kern, out


# (N, K) of gate|up [2F, H] and down [H, F]; default tiles and small ragged ones
SHAPES = {"gate_up": (2 * F, H), "down": (H, F)}
TILES = {"default": None, "16x32": {"BLOCK_N": 16, "BLOCK_K": 32}}


@pytest.mark.parametrize("scheme", [pytest.param(n, marks=() if n in FAST else EXHAUSTIVE) for n in SCHEMES])
@pytest.mark.parametrize("stack", list(SHAPES))
@pytest.mark.parametrize("tiles", list(TILES))
def test_upcast_stack_is_the_definition_in_bf16(scheme, stack, tiles):
    s = SCHEMES[scheme]
    n, k = SHAPES[stack]
    gen = np.random.default_rng(zlib.crc32(f"{scheme}{stack}{tiles}".encode()))
    w, values, comp = quantized_stack(s, n, k, gen)
    kern, out = upcast(s, w, comp, n, k, T=5, rows=5, tune=TILES[tiles])
    from infc.compiler.ops.quant import dequantize
    want = bf16(dequantize(values, s, comp["w_scale"], comp.get("w_zero")))
    assert np.array_equal(out.float().numpy(), want), scheme
    assert "_w_deq(_w_raw(" in kern.source


def test_upcast_launch_is_empty_below_its_rows():
    s = SCHEMES["u4-g32-sym"]
    gen = np.random.default_rng(1)
    w, _, comp = quantized_stack(s, 2 * F, H, gen)
    kern, _ = upcast(s, w, comp, 2 * F, H, T=40, rows=40)
    full = E * -(-2 * F // 32) * 1             # E x row blocks of 32 x one K block of 64
    assert [grid(kern.meta, {"T": t, "B": 1})[0] for t in (1, 39, 40, 4096)] == [0, 0, full, full]


# gate_up's interleaved (PAIR) and two-dot forms; down's one form
GROUPED = [("gate_up", "grouped"), ("gate_up", "grouped-two-dots"), ("down", "grouped")]


@pytest.mark.parametrize("scheme", FAST)
@pytest.mark.parametrize("launch,path", GROUPED)
def test_grouped_gemms_on_the_upcast_stack_give_the_bits_of_the_codes(scheme, launch, path):
    """T = 37 rows: at upcast_rows 16 the launch runs its bf16 tile on the stack, at 38 its codes
    tile (the stack NaN: never read); both give the launch's bits without the stack."""
    s = SCHEMES[scheme]
    T, KT, tune = PATHS[path]
    drop = ("BLOCK_H",) if launch == "gate_up" else ("BLOCK_F", "PAIR")
    tune = {k: v for k, v in tune.items() if k not in drop}
    template = TEMPLATES[launch]["grouped"]
    seed = zlib.crc32(f"up{scheme}{launch}{path}".encode())
    plain = {}
    CASE[launch](s, T, KT, template, tune, seed, out=plain)
    w, values, comp = plain["w"]
    n, k = SHAPES[launch]
    _, stack = upcast(s, w, comp, n, k, T=T)
    on_stack, on_codes = {}, {}
    kern = CASE[launch](s, T, KT, template, tune, seed, upcast=(16, stack), out=on_stack)
    assert "_tile_bf16(" in kern.source and "if T >= 16:" in kern.source
    CASE[launch](s, T, KT, template, tune, seed, upcast=(T + 1, poison((E, n, k))), out=on_codes)
    assert np.array_equal(on_codes["y"], plain["y"], equal_nan=False)
    assert np.array_equal(on_stack["y"], plain["y"])
