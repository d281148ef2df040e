"""`a if cond else b` in a spec's graph (docs/spec-reference.md): cond is a config expression,
decided when the spec is lowered; only the chosen side is lowered, so its ops and weights are the
plan's and the other side may name what this config lacks. On the tiny Llama (HF float32): the
spec with a conditional statement whose condition holds gives the plain spec's plan and HF's
logits; the other side lowers another plan; a condition on a tensor or an unknown name fails
naming it."""
import numpy as np
import pytest

from infc.compiler.build import compile_model
from infc.compiler.contract.errors import SpecError
from infc.compiler.contract.safetensors_io import Checkpoint
from infc.runtime.reference.executor import ReferenceExecutor, SeqChunk
from infc.runtime.weights.load import load_weights

from families import hf_logits

PROMPT = [3, 17, 101, 5, 250, 9, 44]
PLAIN = "    - x = add(x, linear(mul(silu(linear(h, wg)), linear(h, wu)), wd))\n"


def _spec(tmp_path, statement, extra_config=""):
    src = open("specs/llama.yaml").read()
    assert PLAIN in src
    src = src.replace(PLAIN, statement)
    if extra_config:
        src = src.replace("  mlp_bias: mlp_bias = false\n", "  mlp_bias: mlp_bias = false\n" + extra_config)
    p = tmp_path / "llama.yaml"
    p.write_text(src)
    return str(p)


def _ops(plan):
    out = []

    def walk(x):
        if isinstance(x, dict):
            if "op" in x:
                out.append(x["op"])
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)
    walk(plan["programs"]["prefill"])
    return out


def test_the_chosen_side_is_the_plan(tiny_model, tmp_path):
    d, hf = tiny_model("llama")
    _, plain = compile_model(model_dir=str(d), fuse=False)
    swiglu = "mul(silu(linear(h, wg)), linear(h, wu))"
    gelu = "mul(gelu(linear(h, wg)), linear(h, wu))"
    stmt = f"    - x = add(x, linear({swiglu} if act == 'silu' else {gelu}, wd))\n"
    _, got = compile_model(spec_path=_spec(tmp_path, stmt), model_dir=str(d), fuse=False)
    assert _ops(got) == _ops(plain)
    logits = np.stack(ReferenceExecutor(got, load_weights(got, Checkpoint(d))).step([SeqChunk(0, PROMPT, 0)]))
    np.testing.assert_allclose(logits[-1], hf_logits(hf, PROMPT)[-1], atol=1e-4, rtol=0)
    # the statement as a whole, chosen the other way: the other side's ops
    stmt = (f"    - x = add(x, linear({swiglu}, wd)) if act != 'silu' else "
            f"add(x, linear({gelu}, wd))\n")
    _, other = compile_model(spec_path=_spec(tmp_path, stmt), model_dir=str(d), fuse=False)
    assert "gelu" in _ops(other) and "silu" not in _ops(other)


def test_a_side_may_name_what_the_config_lacks(tiny_model, tmp_path):
    """The side not taken is not lowered: here it names a weight no spec declares."""
    d, _ = tiny_model("llama")
    stmt = "    - x = add(x, linear(mul(silu(linear(h, wg)), linear(h, wu)), wd) if gated else linear(h, w_fc))\n"
    _, plan = compile_model(spec_path=_spec(tmp_path, stmt, "  gated: = true\n"), model_dir=str(d), fuse=False)
    assert "silu" in _ops(plan)


@pytest.mark.parametrize("cond,needle", [("h", "'h' is not a config symbol"),
                                         ("actt == 'silu'", "'actt' is not a config symbol")])
def test_a_condition_that_is_not_config_is_named(tiny_model, tmp_path, cond, needle):
    d, _ = tiny_model("llama")
    stmt = f"    - x = add(x, linear(mul(silu(linear(h, wg)), linear(h, wu)), wd) if {cond} else x)\n"
    with pytest.raises(SpecError, match=needle):
        compile_model(spec_path=_spec(tmp_path, stmt), model_dir=str(d), fuse=False)
