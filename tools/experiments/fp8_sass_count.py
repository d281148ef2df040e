"""Issue 42 (CPU, no GPU): qwen3-4b-fp8's four batch-1 GEMVs (the narrow codes path, reading the
ready codes of the act_codes pass; gate|up with down's codes in its epilogue, as the build plans
them) compiled for sm_90 in each FP8_FORM, and their SASS read: registers, spills, the K loop's
instructions per weight (all threads) and its key opcodes, the programs of the launch and the W
bytes each K step reads.

    .venv/bin/python tools/experiments/fp8_sass_count.py [qkv o gate_up down] [--forms dot fma] [--tune '{}']
"""
import argparse
import json
import re

from infc.compiler.codegen.render import render_template
from infc.compiler.quant.scheme import QuantScheme

from w4_sass_count import loops, sass

S = QuantScheme("f8e4m3", 128, 128, act="dynamic_group", act_group=128)     # Qwen3-4B-FP8
# qwen3-4b's narrow linears: (template, op, W rows, K)
LAUNCHES = {"qkv": ("gemv", "linear", 6144, 2560), "o": ("gemv", "linear", 2560, 4096),
            "gate_up": ("gemv_gated", "linear_gated", 19456, 2560), "down": ("gemv", "linear", 2560, 9728)}
KEY = ("F2FP", "HADD2", "FFMA", "FMUL", "FADD", "HMMA", "LDG", "LDS", "STS", "BAR", "SHFL", "PRMT", "LOP3", "IMAD",
       "LDL", "STL")


def _t(s):
    return {"name": s[0], "shape": list(s[1]), "dtype": s[2], "kind": s[3] if len(s) > 3 else "buffer"}


def kernel(name, form, tune=None):
    tpl, op, n, k = LAUNCHES[name]
    gated = op == "linear_gated"
    attrs = {"has_bias": False, "quant": S.attrs(), "has_w_scale": True, "has_a_scale": True,
             **({"fn": "silu"} if gated else {})}
    ins = [("codes", ["T", k], "f8e4m3"), ("w", [n, k], "f8e4m3", "weight"),
           ("w_scale", list(S.scale_shape(n, k)), "f32", "weight"), ("a_scale", ["T", k // 128], "f32")]
    f = n // 2 if gated else n
    outs = [("y", ["T", f], "bf16")]
    epi = None
    if gated:       # down's codes in gate|up's epilogue (merge_epilogues)
        outs += [("act_codes", ["T", f], "f8e4m3"), ("act_scale", ["T", f // 128], "f32")]
        epi = {"op": "quantize_act", "output": 0, "value": "act", "shape": ["T", f], "writes": 2,
               "attrs": {"act_quant": S.attrs()}}
    ctx = {"op": op, "phase": "decode", "narrow": True, "inputs": [_t(s) for s in ins],
           "outputs": [_t(s) for s in outs], "attrs": attrs, "prologue": None, "epilogue": epi,
           "config": {}, "caches": {}, "page_size": 16, "tune": {"FP8_FORM": form, **(tune or {})}}
    return render_template("triton", tpl, ctx)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("launches", nargs="*", default=list(LAUNCHES))
    ap.add_argument("--forms", nargs="*", default=["dot", "fma"])
    ap.add_argument("--tune", default="{}")
    a = ap.parse_args()
    for name in a.launches:
        for form in a.forms:
            k = kernel(name, form, json.loads(a.tune))
            c = k.meta["constexprs"]
            text, res = sass(k)
            regs = re.search(r"REG:(\d+)", res)
            stack = re.search(r"STACK:(\d+)", res)
            threads = 32 * k.meta["num_warps"]
            # a K step's weights: the fma form's [BLOCK_N, FMA_BLOCK_K] tile, the dot form's [BLOCK_N, BLOCK_K]
            weights = c["BLOCK_N"] * c["FMA_BLOCK_K"]
            nb = -(-LAUNCHES[name][2] // c["BLOCK_N"])
            z = k.meta["grid"][2]
            splits = z if isinstance(z, int) else int(re.match(r"1 \+ (\d+)", z).group(1)) + 1
            print(f"{name:8s} {form}: BN {c['BLOCK_N']} BK {c['FMA_BLOCK_K']} warps {k.meta['num_warps']} regs "
                  f"{regs.group(1) if regs else '?'} stack {stack.group(1) if stack else '?'}; programs {nb} x {splits} "
                  f"= {nb * splits} ({nb * splits / 132:.1f} an SM); {weights // 1024} KB of codes a K step", flush=True)
            for n, ops in loops(text):
                print(f"    loop {n} SASS = {n * threads / weights:.2f} a weight; "
                      + ", ".join(f"{o} {ops[o] * threads / weights:.2f}" for o in KEY if ops[o]), flush=True)


if __name__ == "__main__":
    main()
