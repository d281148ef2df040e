"""A plan from an untrusted place is data: launch grids, scratch and metadata sizes go through
compiler/contract/safe_eval.py's integer formulas (no builtins, no attributes, no calls but cdiv/max/min),
never Python's eval. A tampered plan.json is refused when the CUDA runner opens it, before
anything runs; every committed plan's formulas give the numbers eval gave."""
import glob
import json
import shutil
import sys
from pathlib import Path

import pytest
from test_cuda_ranks import FakeCtx, FakeGraph, cuda_mods, fake_device, fake_launch  # noqa: F401

from infc.compiler.build import build
from infc.compiler.contract.errors import ModelDirError
from infc.compiler.contract.safe_eval import ExprLimit, compile_int
from infc.compiler.contract.bind import eval_int

ROOT = Path(__file__).resolve().parent.parent
PLANS = sorted(glob.glob(str(ROOT / "generated" / "*" / "plan*.json")))

PAYLOADS = [
    "__import__('os').system('touch /tmp/pwned')",
    "open('/etc/passwd')",
    "T.__class__",
    "().__class__.__bases__[0].__subclasses__()",
    "(lambda: 1)()",
    "[T][0]",
    "T if B else 1",
    "T ** 99999",
    "10 ** 10 ** 10",
    "cdiv(T, b=2)",
    "max(*[T, B])",
    "__builtins__",
    "T < B",
    "1.5",
    "'T'",
    "cdiv(T, 1" + ")" * 2,
    "x" * 5000,
]


@pytest.mark.parametrize("text", PAYLOADS)
def test_anything_but_integer_arithmetic_is_refused(text):
    with pytest.raises(ExprLimit, match="formula|characters"):
        compile_int(text)({"T": 4, "B": 2})


def test_a_formula_sees_only_the_dims_it_is_given():
    with pytest.raises(ExprLimit, match="'cdiv' is not a dim|'os' is not among the dims"):
        compile_int("os")({"T": 1})
    with pytest.raises(ValueError, match="'G' is not among the dims"):
        eval_int("G * 2", {"T": 1, "B": 1})
    with pytest.raises(ExprLimit, match="formula 'cdiv.T, B - 1.' at .*division"):
        compile_int("cdiv(T, B - 1)")({"T": 4, "B": 1})


def _formulas(plan: dict):
    for kid, m in plan["kernels"].items():
        yield from (list(m["grid"]) + list(m.get("scratch", {}).values()))
    for m in plan.get("step_metadata", {}).values():
        yield from m["shape"]


def test_committed_plans_give_the_numbers_eval_gave():
    """Every grid, scratch and metadata formula of generated/*/plan*.json, at a range of T and B:
    compile_int against Python's eval of the same text (the runner's evaluator before)."""
    funcs = {"cdiv": lambda a, b: -(-a // b), "max": max, "min": min}
    texts = {str(e) for p in PLANS for e in _formulas(json.loads(Path(p).read_text()))}
    assert len(PLANS) > 10 and len(texts) > 100
    checked = 0
    for T, B in [(1, 1), (2, 1), (7, 3), (16, 16), (255, 17), (256, 256), (511, 256), (4096, 64), (8192, 512)]:
        dims = {"T": T, "B": B, "G": 2 * T, "N": 3 * T + 5, "max_pages": B + 9}
        for text in texts:
            want = int(eval(text, {**funcs}, dict(dims)))          # noqa: S307 - the reference
            assert compile_int(text)(dims) == want == eval_int(text, dims), text
            checked += 1
    assert checked == 9 * len(texts)


@pytest.fixture(scope="module")
def artifact(tiny_model, tmp_path_factory):
    d, _ = tiny_model("qwen3")
    out = tmp_path_factory.mktemp("plan-is-data")
    build(model_dir=str(d), out=out, compile=False, log=None)
    return d, out


def test_tampered_plan_is_refused_and_runs_nothing(fake_device, artifact, monkeypatch, tmp_path):
    d, art = artifact
    bad = tmp_path / "art"
    shutil.copytree(art, bad)
    plan = json.loads((bad / "plan.json").read_text())
    marker = tmp_path / "pwned"
    payload = f"__import__('os').system('touch {marker}')"
    victim = sorted(plan["kernels"])[0]
    for m in plan["kernels"].values():               # whichever kernel launches first
        m["grid"] = [payload, *m["grid"][1:]]
    (bad / "plan.json").write_text(json.dumps(plan))
    monkeypatch.setattr(fake_device.runner, "Graph", FakeGraph)
    monkeypatch.setattr(sys.modules["infc.runtime.cuda.sampler"], "launch", fake_launch)
    with pytest.raises(ModelDirError) as e:
        r = fake_device.runner.CudaRunner(bad, d, max_num_batched_tokens=24, max_num_seqs=4,
                                          num_pages=24, buckets=[1, 2, 4], ctx=FakeCtx(40 << 20))
        r.close()
    assert not marker.exists()
    msg = str(e.value)
    assert msg.startswith(f"{bad / 'plan.json'}: kernel {victim}: launch grid ") and "refused" in msg, msg
