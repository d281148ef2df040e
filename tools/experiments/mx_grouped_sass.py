"""Issue 45 (CPU, no GPU): GPT-OSS-20B's wide MXFP4 gate|up GEMM (moe_gate_up_grouped, the
wide program's tiles) compiled for sm_90 as the build does, and its K loop read in SASS, beside a
variant that dequantizes W in registers (triton/_quant.j2's _w_deq) and dots it as the MMA's A
operand instead of tl.dot_scaled: registers, stack, and the loop's instructions by kind
(HGMMA, the shared-memory round trips STS / LDS / LDSM, PRMT decode, the float work).

    .venv/bin/python tools/experiments/mx_grouped_sass.py ['{"BLOCK_M": 64, "num_warps": 4, "num_stages": 2}']
"""
import json
import re
import sys

from infc.compiler.codegen.render import render_template
from infc.compiler.quant.scheme import QuantScheme

from w4_sass_count import loops, sass

S = QuantScheme("e2m1", 1, 32)
H, F, E, KT = 2880, 2880, 32, 4           # GPT-OSS-20B
WIDE = {"BLOCK_M": 64, "num_warps": 4, "num_stages": 2}     # the H200 table's wide entry
KINDS = ("HGMMA", "LDGSTS", "LDG", "STS", "LDS", "LDSM", "PRMT", "LOP3", "FMUL", "FSEL", "F2FP", "BAR")
DOT_SCALED = '''            acc_t = tl.dot_scaled(_w_raw(w_rows, k0, H, BLOCK_K), _w_e8m0(ws, srow, k0, BLOCK_K), "e2m1",
                                  tl.trans(a), None, "bf16", acc_t)'''
IN_REGISTERS = '''            w = _w_deq(_w_raw(w_rows, k0, H, BLOCK_K), srow, ws, k0, H, BLOCK_K).to(tl.bfloat16)
            acc_t = tl.dot(w, tl.trans(a), acc_t)'''


def kernel(tune):
    def t(s):
        return {"name": s[0], "shape": list(s[1]), "dtype": s[2], "kind": s[3] if len(s) > 3 else "buffer"}
    attrs = {"has_bias": True, "quant": S.attrs(), "has_w_scale": True, "act": "clamped_swiglu", "alpha": 1.702,
             "limit": 7.0}
    ins = [("x", ["T", H], "bf16"), ("ids", ["T", KT], "i32"), ("w", [E, 2 * F, H], "e2m1", "weight"),
           ("rows", [E, "T"], "i32"), ("counts", [E], "i32"), ("b", [E, 2 * F], "bf16", "weight"),
           ("w_scale", [E, 2 * F, H // 32], "f32", "weight")]
    ctx = {"op": "moe_gate_up", "phase": "wide", "inputs": [t(s) for s in ins],
           "outputs": [t(("act", ["T", KT, F], "bf16"))], "attrs": attrs, "config": {}, "caches": {},
           "page_size": 16, "tune": tune}
    return render_template("triton", "moe_gate_up_grouped", ctx)


def main():
    tune = json.loads(sys.argv[1]) if len(sys.argv) > 1 else WIDE
    k = kernel(tune)
    assert DOT_SCALED in k.source, "the template's MX dot changed: update this probe"
    for name, src in (("dot_scaled", k.source), ("in registers", k.source.replace(DOT_SCALED, IN_REGISTERS))):
        k.source = src
        text, res = sass(k)
        got = {f: re.search(f"{f}:(\\d+)", res) for f in ("REG", "STACK", "SHARED")}
        print(f"{name}: " + ", ".join(f"{f.lower()} {m.group(1) if m else '?'}" for f, m in got.items()))
        for n, ops in loops(text, 150):
            print(f"    K loop {n} SASS: " + ", ".join(f"{o} {ops[o]}" for o in KINDS), flush=True)


if __name__ == "__main__":
    main()
