"""`infc inspect` on a quantized checkpoint: which launches are quantized (their scheme), the
weight bytes each reads (codes and scales apart), and the model's total weight bytes, all equal
to the plan's shapes counted here; a bf16 build of the same model has no quantized launch. The
quantized launches' kernels refuse to render until the kernels land: inspect still shows the
plan and says so."""
import re

import pytest

from infc.compiler.build import compile_model
from infc.compiler.inspect import inspect






def test_inspect_shows_quantized_launches_and_their_bytes(fp8_pair):
    src, q = fp8_pair
    _, plan = compile_model(model_dir=str(q))
    w = plan["weights"]
    out = inspect(model_dir=str(q), phases=["decode"])
    notes = re.findall(r"\((\S+), (\w+), (\w+)\) -> \(\S+\)  cubin \S+  \[quant f8e4m3 \[16x48\], "
                       r"activations group 48: reads (\d+) B codes \+ (\d+) B scales\]", out)
    assert sorted(n[1] for n in notes) == ["wd", "wgu", "wo", "wqkv"]
    for _, codes, scale, cb, sb in notes:
        n, k = w[codes]["shape"]
        assert int(cb) == n * k and w[codes]["dtype"] == "f8e4m3"
        assert int(sb) == 4 * w[scale]["shape"][0] * w[scale]["shape"][1] == 4 * -(-n // 16) * -(-k // 48)
    total = sum((2 if x["dtype"] == "bf16" else 4 if x["dtype"] == "f32" else 1)
                * x["shape"][0] * (x["shape"][1] if len(x["shape"]) > 1 else 1) * len(x["layers"] or [0])
                for x in w.values() if "tied" not in x["source"])
    assert f"== weights: {total} B in all (" in out
    layers = 3
    codes = sum(int(n[3]) for n in notes) * layers
    scales = sum(int(n[4]) for n in notes) * layers
    assert f"decode: quantized launches read {codes} B codes + {scales} B scales a step" in out
    plain = inspect(model_dir=str(src), phases=["decode"])
    assert "[quant" not in plain and "quantized launches" not in plain and "== weights: " in plain


def test_bench_floors_count_quantized_bytes(fp8_pair):
    """bench/active_floor.py's weight and active bytes (the latency floors) count fp8 codes at a
    byte each and the f32 scales: the totals inspect prints."""
    from infc.bench import active_floor as af
    _, q = fp8_pair
    _, plan = compile_model(model_dir=str(q))
    w = plan["weights"]
    assert af.weight_bytes(plan) == sum(
        {"bf16": 2, "f32": 4, "f8e4m3": 1}[x["dtype"]] * x["shape"][0] * (x["shape"][1] if len(x["shape"]) > 1 else 1)
        * len(x["layers"] or [0]) for x in w.values() if "tied" not in x["source"])
    active = af.active_bytes(plan)
    n, k = w["wqkv"]["shape"]
    assert active["wqkv"] == 3 * n * k and active["wqkv_w_scale"] == 3 * 4 * -(-n // 16) * -(-k // 48)
