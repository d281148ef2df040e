"""Issue 45 (CPU, no GPU): GPT-OSS-20B's decode MoE launches (moe_gate_up, moe_down with MXFP4
experts) compiled for sm_90 as the build does, and their SASS read: registers, spills, the K
loop's instructions per weight (all threads), and the ops the MX paths should not have
(shuffles, shared-memory round trips of a layout conversion).

    .venv/bin/python tools/experiments/mx_sass_count.py [gate_up down] [--tune '{"FMA_T": 2}']
"""
import argparse
import json
import re

from infc.compiler.codegen.render import render_template
from infc.compiler.quant.scheme import QuantScheme

from collections import Counter

from w4_sass_count import loops, sass

S = QuantScheme("e2m1", 1, 32)
H, F, E, KT = 2880, 2880, 32, 4           # GPT-OSS-20B


def _t(s):
    return {"name": s[0], "shape": list(s[1]), "dtype": s[2], "kind": s[3] if len(s) > 3 else "buffer"}


def kernel(launch, tune):
    attrs = {"has_bias": True, "quant": S.attrs(), "has_w_scale": True}
    if launch == "gate_up":
        attrs.update(act="clamped_swiglu", alpha=1.702, limit=7.0)
        ins = [("x", ["T", H], "bf16"), ("ids", ["T", KT], "i32"), ("w", [E, 2 * F, H], "e2m1", "weight"),
               ("rows", [E, "T"], "i32"), ("counts", [E], "i32"), ("b", [E, 2 * F], "bf16", "weight"),
               ("w_scale", [E, 2 * F, H // 32], "f32", "weight")]
        outs = [("act", ["T", KT, F], "bf16")]
    else:
        ins = [("act", ["T", KT, F], "bf16"), ("rw", ["T", KT], "f32"), ("ids", ["T", KT], "i32"),
               ("w", [E, H, F], "e2m1", "weight"), ("rows", [E, "T"], "i32"), ("counts", [E], "i32"),
               ("b", [E, H], "bf16", "weight"), ("w_scale", [E, H, F // 32], "f32", "weight")]
        outs = [("y", ["T", H], "bf16")]
    ctx = {"op": "moe_" + launch, "phase": "decode", "inputs": [_t(s) for s in ins], "outputs": [_t(s) for s in outs],
           "attrs": attrs, "config": {}, "caches": {}, "page_size": 16, "tune": tune}
    return render_template("triton", "moe_" + launch, ctx)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("launches", nargs="*", default=["gate_up", "down"])
    ap.add_argument("--tune", default="{}")
    a = ap.parse_args()
    for launch in a.launches:
        k = kernel(launch, json.loads(a.tune))
        c = k.meta["constexprs"]
        text, res = sass(k)
        regs = re.search(r"REG:(\d+)", res)
        stack = re.search(r"STACK:(\d+)", res)
        rows = c.get("BLOCK_F", c.get("BLOCK_H")) * (2 if launch == "gate_up" else 1)
        weights = rows * c["FMA_BLOCK_K"]
        threads = 32 * k.meta["num_warps"]
        whole = Counter_all(text)
        print(f"{launch:8s} FMA_T={c['FMA_T']} rows={rows} BK={c['FMA_BLOCK_K']} warps={k.meta['num_warps']} "
              f"regs {regs.group(1) if regs else '?'} stack {stack.group(1) if stack else '?'}; whole kernel: "
              f"SHFL {whole['SHFL']}, STS {whole['STS']}, LDS {whole['LDS']}")
        for n, ops in loops(text, 64):
            if n < 300:
                continue        # the id scans and the combine
            kind = "tensor cores" if ops["HMMA"] else "CUDA cores"
            print(f"    loop ({kind}) {n} SASS = {n * threads / weights:.2f} a weight of the CUDA-core tile; "
                  + ", ".join(f"{o} {ops[o]}" for o in ("FFMA", "HADD2", "LOP3", "PRMT", "LDG", "BAR", "STS", "LDS",
                                                        "SHFL", "LDL", "STL")), flush=True)


def Counter_all(text):
    return Counter(m.group(1).split(".")[0] for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9]+)", text))


if __name__ == "__main__":
    main()
