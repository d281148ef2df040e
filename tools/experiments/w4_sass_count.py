"""Issue 42 (CPU, no GPU): the narrow W4A16 GEMVs of qwen3-4b, per W4_FORM, compiled for sm_90 as
the build does (compiler/codegen/aot.py), and their SASS read: registers, spills, and the
instructions of the K loop's body per weight it consumes (the issue-bound estimate behind the
forms' prediction in bench/NOTES.md).

    .venv/bin/python tools/experiments/w4_sass_count.py [qkv o gate_up down]
"""
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import triton

from infc.compiler.codegen import aot
from infc.compiler.codegen.render import render_template
from infc.compiler.quant.scheme import QuantScheme

S = QuantScheme("u4", 1, 128)             # compressed-tensors W4A16, group 128, symmetric
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
# qwen3-4b's narrow linears: (template, op, N rows of W, K, the merged add_rms_norm prologue)
LAUNCHES = {"qkv": ("gemv", "linear", 6144, 2560, True), "o": ("gemv", "linear", 2560, 4096, False),
            "gate_up": ("gemv_gated", "linear_gated", 19456, 2560, True), "down": ("gemv", "linear", 2560, 9728, False)}


PROLOGUE = {"op": "add_rms_norm", "inputs": 3, "output": 1, "value": "h", "writes": 1, "attrs": {"eps": 1e-6}}


def render(tpl, op, ins, outs, attrs, tune, narrow, prologue):
    """A narrow decode step's launch context (as tests/kernels/harness.py's render builds it)."""
    t = lambda s: {"name": s[0], "shape": list(s[1]), "dtype": s[2], "kind": s[3] if len(s) > 3 else "buffer"}  # noqa: E731
    ctx = {"op": op, "phase": "decode", "narrow": narrow, "inputs": [t(s) for s in ins],
           "outputs": [t(s) for s in outs], "attrs": attrs, "prologue": prologue, "config": {},
           "caches": {}, "page_size": 16, "tune": tune}
    return render_template("triton", tpl, ctx)


def kernel(name, form, tune=None):
    tpl, op, n, k, pro = LAUNCHES[name]
    attrs = {"has_bias": False, "quant": S.attrs(), **{f"has_{c}": True for c in S.companions()}}
    if op == "linear_gated":
        attrs["fn"] = "silu"
    ins = [("x", ["T", k], "bf16")]
    outs = [("y", ["T", n // 2 if op == "linear_gated" else n], "bf16")]
    if pro:
        ins += [("d", ["T", k], "bf16"), ("norm", [k], "bf16", "weight")]
        outs.insert(0, ("res", ["T", k], "bf16"))
    ins += [("w", [n, k], "u4", "weight"), ("w_scale", list(S.scale_shape(n, k)), "f32", "weight")]
    return render(tpl, op, ins, outs, attrs=attrs, tune={"W4_FORM": form, **(tune or {})}, narrow=True,
                  prologue=PROLOGUE if pro else None)


def sass(k):
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")     # as compile_one
    with tempfile.TemporaryDirectory() as d:
        cubin, info = aot._compile_triton(k.source, k.meta, "sm_90", Path(d))
        (Path(d) / "k.cubin").write_bytes(cubin)
        text = subprocess.run([str(BIN / "cuobjdump"), "-sass", str(Path(d) / "k.cubin")],
                              capture_output=True, text=True).stdout
        res = subprocess.run([str(BIN / "cuobjdump"), "-res-usage", str(Path(d) / "k.cubin")],
                             capture_output=True, text=True).stdout
    return text, res


def usage(k):
    """k compiled for sm_90: its SASS, registers and stack bytes (as strings, "?" where unread)."""
    text, res = sass(k)
    regs, stack = re.search(r"REG:(\d+)", res), re.search(r"STACK:(\d+)", res)
    return text, regs.group(1) if regs else "?", stack.group(1) if stack else "?"


def loop_body(text):
    """The largest backward branch's body (the K loop): (instruction count, opcode counts)."""
    ins = []
    for line in text.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2)))
    best = (0, Counter())
    for addr, op in ins:
        m = re.search(r"BRA\s+0x([0-9a-f]+)", op)
        if m and int(m.group(1), 16) < addr:
            body = [o for a, o in ins if int(m.group(1), 16) <= a <= addr]
            if len(body) > best[0]:
                ops = Counter(opcode(o) for o in body)
                best = (len(body), ops)
    return best


def opcode(op):
    """An instruction's opcode without its predicate and modifiers (LDG.E.128 -> LDG)."""
    return re.sub(r"^@!?U?P\w+\s+", "", op).split()[0].split(".")[0]


def loops(text, min_len=32, key=opcode):
    """Every backward branch's body of min_len+ instructions: (instructions, counts of key(each
    instruction), by default its opcode) (mx_sass_count.py, fp8_sass_count.py and
    ldg_width_audit.py read their loops with it)."""
    ins = []
    for line in text.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2)))
    out = []
    for addr, op in ins:
        m = re.search(r"BRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)", op) or re.search(r"BRA\s+0x([0-9a-f]+)", op)
        if m and int(m.group(1), 16) < addr:
            body = [o for a, o in ins if int(m.group(1), 16) <= a <= addr]
            if len(body) >= min_len:
                out.append((len(body), Counter(key(o) for o in body)))
    return out


def main():
    for name in (sys.argv[1:] or LAUNCHES):
        for form in ("elementwise", "groupsum", "dot"):
            k = kernel(name, form)
            c = k.meta["constexprs"]
            text, regs, spill = usage(k)
            n, ops = loop_body(text)
            per = n / (c["BLOCK_N"] * c["FMA_BLOCK_K"])
            top = ", ".join(f"{o} {m}" for o, m in ops.most_common(8))
            print(f"{name:8s} {form:12s} BN={c['BLOCK_N']:3d} BK={c['FMA_BLOCK_K']:4d} regs {regs:>4s} "
                  f"stack {spill:>3s}  loop {n:5d} SASS / {c['BLOCK_N'] * c['FMA_BLOCK_K']} weights "
                  f"= {per * 128:.2f} a warp-weight x128 threads  [{top}]", flush=True)


if __name__ == "__main__":
    main()
