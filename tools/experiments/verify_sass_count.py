"""Issue 43 (CPU, no GPU): qwen3-4b's verify-program GEMVs (bf16, R rows on the CUDA cores,
codegen_templates/triton/gemv.py.j2 VERIFY_ROWS) compiled for sm_90 as the build does, per
ROW_SUMS form, with the one-row narrow kernel beside them: registers, spills, and the K loop's
instructions by opcode (the shuffles a row's sums cost inside the loop).

    .venv/bin/python tools/experiments/verify_sass_count.py [R] [qkv o gate_up down]
"""
import sys

from infc.compiler.codegen.render import render_template
from w4_sass_count import PROLOGUE, loops, usage


def render(tpl, op, ins, outs, attrs, tune, rows, prologue):
    """A narrow decode step's launch of `rows` rows (as tests/kernels/harness.py's render builds it)."""
    t = lambda s: {"name": s[0], "shape": list(s[1]), "dtype": s[2], "kind": s[3] if len(s) > 3 else "buffer"}  # noqa: E731
    ctx = {"op": op, "phase": "decode", "narrow": True, "narrow_rows": rows, "inputs": [t(s) for s in ins],
           "outputs": [t(s) for s in outs], "attrs": attrs, "prologue": prologue, "config": {},
           "caches": {}, "page_size": 16, "tune": tune}
    return render_template("triton", tpl, ctx)

# qwen3-4b's narrow linears on the H200 table's one-row tiles: (template, op, N, K, prologue,
# BLOCK_N, FMA_BLOCK_K of the one-row entry)
LAUNCHES = {"qkv": ("gemv", "linear", 6144, 2560, True, 16, 512),
            "o": ("gemv", "linear", 2560, 4096, False, 4, 1024),
            "gate_up": ("gemv_gated", "linear_gated", 19456, 2560, True, 32, 128),
            "down": ("gemv", "linear", 2560, 9728, False, 4, 1024)}


def kernel(name, rows, tune):
    tpl, op, n, k, pro, bn, bk = LAUNCHES[name]
    attrs = {"has_bias": False, **({"fn": "silu"} if op == "linear_gated" else {})}
    ins = [("x", ["T", k], "bf16")]
    outs = [("y", ["T", n // 2 if op == "linear_gated" else n], "bf16")]
    if pro:
        ins += [("d", ["T", k], "bf16"), ("norm", [k], "bf16", "weight")]
        outs.insert(0, ("res", ["T", k], "bf16"))
    ins += [("w", [n, k], "bf16", "weight")]
    return render(tpl, op, ins, outs, attrs, {"BLOCK_N": bn, "FMA_BLOCK_K": bk, **tune}, rows,
                  PROLOGUE if pro else None)


def main():
    args = sys.argv[1:]
    R = int(args.pop(0)) if args and args[0].isdigit() else 5
    for name in (args or LAUNCHES):
        for label, rows, tune in (("one row", 1, {}), ("tile", R, {"ROW_SUMS": "tile"}),
                                  ("lanes", R, {"ROW_SUMS": "lanes"}), ("chain", R, {"ROW_SUMS": "chain"})):
            k = kernel(name, rows, tune)
            c = k.meta["constexprs"]
            text, regs, stack = usage(k)
            n, ops = max(loops(text), default=(0, {}), key=lambda b: b[0])     # the K loop
            print(f"{name:8s} {label:8s} R={c['FMA_T']} BN={c['BLOCK_N']:3d} BK={c['FMA_BLOCK_K']:5d} regs {regs:>4s} "
                  f"stack {stack:>3s} SHFL in kernel {text.count('SHFL'):4d}  loop {n:5d} "
                  f"[{', '.join(f'{o} {m}' for o, m in ops.most_common(9))}]", flush=True)


if __name__ == "__main__":
    main()
