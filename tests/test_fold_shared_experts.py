"""fold_shared_experts: DeepSeek's shared experts run as always-on routed experts.

The tiny DeepSeek-V2 checkpoints of test_deepseek_v2 (8 routed experts of 24, 2 shared, top 3):
the folded plan reads no shared-expert weight of its own and drops three launches a MoE layer;
its stacks hold the shared chunks after the routed experts; its logits equal those of the plan
built without the pass (same checkpoint, reference executor). Where the pattern is not plainly
the same function (another activation, a shared size no multiple of the experts') nothing moves.
"""
from pathlib import Path

import numpy as np
import pytest

from infc.compiler.build import compile_model
from infc.compiler.contract.program import launches, unrolled
from infc.runtime.reference.executor import ReferenceExecutor, SeqChunk
from infc.compiler.contract.safetensors_io import Checkpoint
from infc.runtime.weights.load import load_weights

from test_deepseek_v2 import BASE, PROMPT, models  # noqa: F401  (the module fixture)

SPEC = Path(__file__).resolve().parents[1] / "specs" / "deepseek_v2.yaml"
E, FE, H, N = BASE["n_routed_experts"], BASE["moe_intermediate_size"], BASE["hidden_size"], BASE["n_shared_experts"]


@pytest.mark.parametrize("kind", ["plain", "qlora"])
def test_plan_reads_the_shared_experts_through_the_stacks(models, kind):
    d, _ = models[kind]
    _, plan = compile_model(model_dir=str(d))
    _, unfolded = compile_model(model_dir=str(d), skip=("fold_shared_experts",))
    w = plan["weights"]
    assert not any(n.startswith("ws_") for n in w), sorted(w)
    assert w["wes_gate_up"]["shape"] == [E + N, 2 * FE, H] and w["wes_down"]["shape"] == [E + N, H, FE]
    routes = [l for l, _ in unrolled(plan["programs"]["decode"]) if l["op"].startswith("moe_route")]
    assert routes and all(r["attrs"]["shared"] == N and r["attrs"]["experts"] == E + N for r in routes)
    # the wide program still starts where each routed expert gets 8 tokens on average
    assert plan["wide_tokens"] == unfolded["wide_tokens"] == -(-8 * E // BASE["num_experts_per_tok"])
    assert len(routes) == BASE["num_hidden_layers"] - BASE["first_k_dense_replace"]
    # per MoE layer: the shared gate|up GEMV, the shared down GEMV and the add are gone
    for phase in ("decode", "prefill"):
        got, was = len(list(unrolled(plan["programs"][phase]))), len(list(unrolled(unfolded["programs"][phase])))
        assert was - got == 3 * len(routes), (phase, was, got)


@pytest.mark.parametrize("kind", ["plain", "qlora"])
def test_folded_logits_equal_the_unfolded_plans(models, kind):
    d, _ = models[kind]
    ck = Checkpoint(d)
    outs = []
    for skip in ((), ("fold_shared_experts",)):
        _, plan = compile_model(model_dir=str(d), skip=skip)
        ex = ReferenceExecutor(plan, load_weights(plan, ck))
        n = len(PROMPT)
        pre = ex.step([SeqChunk(0, PROMPT, 0)])
        dec = ex.step([SeqChunk(0, [PROMPT[-1]], n)])
        outs.append((pre, dec))
    (p1, d1), (p0, d0) = outs
    assert np.abs(p1).max() > 1.0
    np.testing.assert_allclose(p1, p0, rtol=0, atol=2e-5)
    np.testing.assert_allclose(d1, d0, rtol=0, atol=2e-5)


def test_folded_stack_holds_the_shared_chunks(models):
    """wes_gate_up[E + c] = [gate_s rows c*Fe..; up_s rows c*Fe..], wes_down[E + c] = down_s columns
    c*Fe.. : read from the checkpoint by the plan's recipes."""
    d, _ = models["plain"]
    _, plan = compile_model(model_dir=str(d))
    ck = Checkpoint(d)
    weights = load_weights(plan, ck)
    layers = plan["weights"]["wes_down"]["layers"]
    assert layers == list(range(BASE["first_k_dense_replace"], BASE["num_hidden_layers"]))
    i, layer = 1, layers[1]
    gu, dn = weights["wes_gate_up"][i], weights["wes_down"][i]
    read = lambda n: ck.float32(f"model.layers.{layer}.mlp.shared_experts.{n}.weight")  # noqa: E731
    g, u, dw = read("gate_proj"), read("up_proj"), read("down_proj")
    for c in range(N):
        np.testing.assert_array_equal(gu[E + c, :FE], g[c * FE:(c + 1) * FE])
        np.testing.assert_array_equal(gu[E + c, FE:], u[c * FE:(c + 1) * FE])
        np.testing.assert_array_equal(dn[E + c], dw[:, c * FE:(c + 1) * FE])


@pytest.mark.parametrize("edit", [("silu(linear(h, ws_gate))", "gelu(linear(h, ws_gate))"),
                                  ("Fs: = Fe * n_shared", "Fs: = Fe * n_shared + 8")])
def test_left_alone_where_not_the_same_function(tmp_path, edit):
    src = SPEC.read_text()
    assert edit[0] in src
    f = tmp_path / "deepseek_v2.yaml"
    f.write_text(src.replace(edit[0], edit[1]))
    state, plan = compile_model("deepseek-v2-lite", spec_path=str(f))
    assert "ws_down" in plan["weights"] and "wes_down" not in plan["weights"]
    assert all("shared" not in l.get("attrs", {}) for l, _ in launches(plan["programs"]["decode"]))


V4_SPEC = SPEC.with_name("deepseek_v4.yaml")
V4_CLAMPED = "silu(clamp(linear(h, ws_gate), max=limit))"


def _v4_plan(tmp_path, spec=None):
    """DeepSeek-V4-Flash's GPU cut (bf16, tests/gpu/gpu_families.py): hash-routed and scored layers."""
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
    import gpu_families
    d = gpu_families.write_config(gpu_families.DSV4_CUT, tmp_path / "cut")
    return compile_model(model_dir=str(d), spec_path=spec, check_checkpoint=False)[1]


def test_deepseek_v4s_clamped_shared_expert_folds_under_either_router(tmp_path):
    """DeepSeek-V4: the shared MLP silu(clamp(gate, max=L)) * clamp(up, -L, L) is the experts' own
    clamped_silu, so it folds under the hash router (moe_route_table, weighing by the router's
    logits) and the scored one alike: each routes k + 1 slots over E + 1 experts, and no launch
    reads a shared weight of its own."""
    plan = _v4_plan(tmp_path)
    assert not any(w.startswith("ws_") for w in plan["weights"])
    assert plan["weights"]["wes_down"]["shape"][0] == 17
    routes = [(l["op"], l["attrs"].get("shared")) for l, _ in unrolled(plan["programs"]["decode"])
              if l["op"].startswith("moe_route")]
    assert sorted(routes) == [("moe_route_align", 1), ("moe_route_table", 1), ("moe_route_table", 1)]


@pytest.mark.parametrize("edit", [(V4_CLAMPED, "silu(linear(h, ws_gate))"),
                                  (V4_CLAMPED, "silu(clamp(linear(h, ws_gate), max=2.0))")])
def test_deepseek_v4s_shared_expert_left_alone_where_its_clamp_differs(tmp_path, edit):
    src = V4_SPEC.read_text()
    assert edit[0] in src
    f = tmp_path / "deepseek_v4.yaml"
    f.write_text(src.replace(edit[0], edit[1]))
    plan = _v4_plan(tmp_path, str(f))
    assert "ws_down" in plan["weights"] and "wes_down" not in plan["weights"]
    assert all(not l.get("attrs", {}).get("shared") for l, _ in launches(plan["programs"]["decode"]))
