"""Issue 49, item 3 (CPU, no GPU): Qwen3.5-4B's chunked gated delta rule (codegen_templates/triton/
gated_delta_rule_chunk.py.j2; Hk 16, Hv 32, Dk = Dv = 128, f32 q / k as its spec makes them)
compiled for sm_90 as the build does, per chunk length BT, v block BV and warps: registers, spills
(stack bytes), and its two largest loops' instructions by opcode: a chunk's body, and the
row-by-row forward substitution inside it (BT - 1 steps a chunk, the serial part).

    .venv/bin/python tools/experiments/gdn_sass_count.py     (run from tools/experiments)
"""

from infc.compiler.codegen.render import render_template
from w4_sass_count import loops, usage


def kernel(tune: dict):
    t = lambda n, s, d: {"name": n, "shape": s, "dtype": d, "kind": "buffer"}  # noqa: E731
    ctx = {"op": "gated_delta_rule", "phase": "prefill", "inputs": [
        t("q", ["T", 16, 128], "f32"), t("k", ["T", 16, 128], "f32"), t("v", ["T", 32, 128], "bf16"),
        t("g", ["T", 32], "f32"), t("beta", ["T", 32], "f32")], "outputs": [t("o", ["T", 32, 128], "bf16")],
        "attrs": {}, "prologue": None, "config": {}, "page_size": 64, "tune": tune,
        "caches": {"recurrent": {"kind": "slot", "shape": [32, 128, 128], "dtype": "f32", "layers": [0]}}}
    return render_template("triton", "gated_delta_rule_chunk", ctx)


def main():
    for tune in ({}, {"BT": 32}, {"BT": 16}, {"BT": 32, "num_warps": 4}, {"BT": 16, "num_warps": 4},
                 {"BT": 32, "BV": 128}, {"BV": 32}):
        k = kernel(tune)
        text, regs, stack = usage(k)
        print(f"{str(tune):40s} warps {k.meta['num_warps']} regs {regs:>4s} stack {stack:>4s} "
              f"instructions {text.count(';'):6d}", flush=True)
        for n, ops in sorted(loops(text), key=lambda b: -b[0])[:3]:
            print(f"    loop {n:5d} [{', '.join(f'{o} {m}' for o, m in ops.most_common(10))}]")


if __name__ == "__main__":
    main()
