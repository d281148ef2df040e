"""Each pass alone, on a tiny spec: what it rewrites, and that it leaves everything else."""
import textwrap

import pytest

from infc.compiler.lower import lower
from infc.compiler.passes.eliminate_dead import eliminate_dead
from infc.compiler.passes.fuse_ops import (fuse_add_rms_norm, fuse_linear_prologue, fuse_lm_head,
                                           fuse_act_mul, fuse_qk_norm_rope_cache)
from infc.compiler.passes.fuse_weights import fuse_weights
from infc.compiler.passes.infer_types import infer_types
from infc.compiler.passes.plan_memory import plan_memory
from infc.compiler.passes.rotate_residual import rotate_residual
from infc.compiler.passes.select_kernels import select_kernels
from infc.compiler.passes.split_attention import split_attention
from infc.compiler.pipeline import compile_spec
from infc.compiler.spec import find_variant, load_spec
from infc.compiler.state import CompileState

TINY = textwrap.dedent("""\
    family: tiny
    config: {H: hidden_size, L: num_hidden_layers, Hq: heads, Hkv: kv_heads, D: head_dim,
             F: ffn, V: vocab, eps: eps}
    variants:
      tiny: {hidden_size: 32, num_hidden_layers: 2, heads: 4, kv_heads: 2, head_dim: 8,
             ffn: 48, vocab: 100, eps: 1.0e-6}
    weights:
      embed: {name: embed, shape: [V, H]}
      final_norm: {name: norm, shape: [H]}
      lm_head: {name: head, shape: [V, H]}
    layer:
      weights:
        n1: {name: "l.{i}.n1", shape: [H]}
        wq: {name: "l.{i}.q", shape: [Hq*D, H]}
        wk: {name: "l.{i}.k", shape: [Hkv*D, H]}
        wv: {name: "l.{i}.v", shape: [Hkv*D, H]}
        qn: {name: "l.{i}.qn", shape: [D]}
        kn: {name: "l.{i}.kn", shape: [D]}
        wo: {name: "l.{i}.o", shape: [H, Hq*D]}
        n2: {name: "l.{i}.n2", shape: [H]}
        wg: {name: "l.{i}.g", shape: [F, H]}
        wu: {name: "l.{i}.u", shape: [F, H]}
        wd: {name: "l.{i}.d", shape: [H, F]}
      graph:
        - h = rms_norm(x, n1, eps)
        - q = rms_norm(view(linear(h, wq), [T, Hq, D]), qn, eps)
        - k = rms_norm(view(linear(h, wk), [T, Hkv, D]), kn, eps)
        - v = view(linear(h, wv), [T, Hkv, D])
        - a = attention(rope(q, 10000.0), rope(k, 10000.0), v)
        - x = add(x, linear(view(a, [T, Hq*D]), wo))
        - h = rms_norm(x, n2, eps)
        - x = add(x, linear(mul(silu(linear(h, wg)), linear(h, wu)), wd))
    graph:
      - x = embedding(tokens, embed)
      - x = layers(x)
      - logits = linear(rms_norm(last(x), final_norm, eps), lm_head)
    """)


@pytest.fixture
def state(tmp_path):
    return _state(tmp_path, TINY)


def body(st):
    return next(n for n in st.graph.ordered() if n.op == "layers").bodies["layer"]


def ops(g):
    return [n.op for n in g.ordered()]


def test_infer_types(state):
    b = body(state)
    q = next(n for n in b.ordered() if n.op == "rope")
    assert b.values[q.outputs[0]].type.shape == ("T", 4, 8)
    out = state.graph.values[state.graph.outputs[0]].type
    assert out.shape == ("B", 100) and out.dtype == "f32"


def test_fuse_weights(state):
    fuse_weights(state)
    infer_types(state)
    b = body(state)
    assert ops(b).count("linear") == 4            # qkv, o, gate_up, down
    assert ops(b).count("split") == 2
    assert state.weights["wqkv"]["source"] == {"concat": [
        {"tensor": "l.{i}.q"}, {"tensor": "l.{i}.k"}, {"tensor": "l.{i}.v"}], "axis": 0}
    assert b.values["wqkv"].type.shape == (64, 32)
    assert b.values["wgu"].type.shape == (96, 32)
    assert "wq" not in state.weights and "wg" not in state.weights


def test_rotate_residual(state):
    rotate_residual(state)
    infer_types(state)
    b = body(state)
    assert b.inputs == ["x", "d"]
    first = b.ordered()[0]
    assert first.op == "add" and first.inputs == ["x", "d"]
    assert b.ordered()[-1].op == "linear"          # the trailing add moved out
    top = ops(state.graph)
    assert top[:3] == ["embedding", "fill_zero", "layers"] and top[3] == "add"


def test_fuse_add_rms_norm_after_rotation(state):
    rotate_residual(state)
    infer_types(state)
    fuse_add_rms_norm(state)
    infer_types(state)
    b = body(state)
    fused = [n for n in b.ordered() if n.op == "add_rms_norm"]
    assert len(fused) == 2 and "add" not in ops(b)
    # the sum is written in place over the residual stream
    assert b.values[fused[0].outputs[0]].alias_of == "x"


def test_fuse_qk_norm_rope_cache_needs_fused_qkv(state):
    fuse_qk_norm_rope_cache(state)                  # without weight fusion: nothing to match
    assert "qk_norm_rope_cache" not in ops(body(state))
    fuse_weights(state)
    infer_types(state)
    fuse_qk_norm_rope_cache(state)
    infer_types(state)
    b = body(state)
    n = next(n for n in b.ordered() if n.op == "qk_norm_rope_cache")
    assert n.attrs["q_heads"] == 4 and n.attrs["kv_heads"] == 2 and n.attrs["head_dim"] == 8
    assert n.attrs["q_norm"] and n.attrs["k_norm"]
    assert {"rope", "attention", "kv_write"}.isdisjoint(ops(b))
    assert ops(b).count("split") == 1              # only gate|up's split is left
    assert "attention_cached" in ops(b)


def _state(tmp_path, text):
    p = tmp_path / "variant.yaml"
    p.write_text(text)
    spec = load_spec(p)
    env = spec.bind(spec.variants["tiny"])
    g, weights = lower(spec, env)
    st = CompileState(spec, env, g, weights, "tiny")
    infer_types(st)
    split_attention(st)           # a required lowering: fusions see kv_write + attention_cached
    infer_types(st)
    return st


SWIGLU = "mul(silu(linear(h, wg)), linear(h, wu))"


def every_node(st):
    return [n for g in st.graph.walk() for n in g.ordered()]


@pytest.mark.parametrize("mlp,fn", [
    (SWIGLU, "silu"),
    ("mul(gelu_tanh(linear(h, wg)), linear(h, wu))", "gelu_tanh"),
    ("mul(relu2(linear(h, wg)), linear(h, wu))", "relu2"),
    ('mul(act(linear(h, wg), "gelu_pytorch_tanh"), linear(h, wu))', "gelu_tanh"),
])
def test_fuse_act_mul_then_prologue(tmp_path, mlp, fn):
    state = _state(tmp_path, TINY.replace(SWIGLU, mlp))
    fuse_weights(state)
    infer_types(state)
    fuse_act_mul(state)
    infer_types(state)
    n = next(n for n in every_node(state) if n.op == "act_mul")
    assert n.attrs == {"fn": fn} and "mul" not in [m.op for m in every_node(state)]
    fuse_linear_prologue(state)
    infer_types(state)
    n = next(n for n in every_node(state) if n.op == "linear_act_mul")
    assert n.attrs == {"fn": fn, "has_bias": False}
    assert "act_mul" not in [m.op for m in every_node(state)]


@pytest.mark.parametrize("mlp,fn", [(SWIGLU, "silu"), ("mul(gelu_tanh(linear(h, wg)), linear(h, wu))", "gelu_tanh")])
def test_fuse_linear_epilogue_takes_the_act_before_the_prologue(tmp_path, mlp, fn):
    """The whole pipeline: gate|up becomes linear_gated (act in its epilogue) and the down
    projection stays a plain linear; nothing is left for fuse_linear_prologue."""
    from infc.compiler.pipeline import compile_spec
    p = tmp_path / "variant.yaml"
    p.write_text(TINY.replace(SWIGLU, mlp))
    spec = load_spec(p)
    state = compile_spec(spec, spec.bind(spec.variants["tiny"]), "tiny")
    nodes = every_node(state)
    gated = [n for n in nodes if n.op == "linear_gated"]
    assert len(gated) == 1 and gated[0].attrs == {"fn": fn, "has_bias": False}
    assert gated[0].fused_from[-2:] == [fn, "mul"] and gated[0].made_by == "fuse_linear_epilogue"
    assert not {"act_mul", "linear_act_mul", "mul", fn} & {n.op for n in nodes}
    assert any(n.op == "linear" and gated[0].outputs[0] in n.inputs for n in nodes)   # the down projection


def test_fuse_linear_epilogue_leaves_fp32_partials_to_the_prologue(tmp_path):
    """A linear writing fp32 partial sums (row-parallel) must be all-reduced before its
    activation, so the epilogue pass leaves it and the prologue pass takes the act_mul."""
    from infc.compiler.passes.fuse_ops import fuse_linear_epilogue
    state = _state(tmp_path, TINY)
    fuse_weights(state)
    infer_types(state)
    fuse_act_mul(state)
    infer_types(state)
    act = next(n for n in every_node(state) if n.op == "act_mul")
    gate_up = next(n for n in every_node(state) if n.outputs[0] == act.inputs[0])
    gate_up.attrs["out_dtype"] = "f32"
    fuse_linear_epilogue(state)
    assert "linear_gated" not in [n.op for n in every_node(state)]
    gate_up.attrs.pop("out_dtype")
    fuse_linear_epilogue(state)
    infer_types(state)
    assert [n.op for n in every_node(state)].count("linear_gated") == 1


def test_fuse_act_mul_operand_order(tmp_path):
    """mul(u, act(g)) fuses too when g's projection comes first in the fused weight; when the
    activation is on the split's second half it does not (act_mul activates the first half)."""
    line = "    - x = add(x, linear(mul(silu(linear(h, wg)), linear(h, wu)), wd))\n"
    for graph, fused in [("    - g = gelu(linear(h, wg))\n    - x = add(x, linear(mul(linear(h, wu), g), wd))\n", True),
                         ("    - x = add(x, linear(mul(linear(h, wu), gelu(linear(h, wg))), wd))\n", False)]:
        assert line in TINY
        state = _state(tmp_path, TINY.replace(line, graph))
        fuse_weights(state)
        infer_types(state)
        fuse_act_mul(state)
        infer_types(state)
        got = [m for m in every_node(state) if m.op == "act_mul"]
        assert bool(got) == fused and all(m.attrs == {"fn": "gelu"} for m in got)


def test_fuse_lm_head(state):
    fuse_lm_head(state)
    infer_types(state)
    assert ops(state.graph)[-1] == "lm_head_last"
    assert "last" not in ops(state.graph)
    n = state.graph.ordered()[-1]
    assert n.attrs["residual"] is False          # no rotation ran: no pending add to absorb
    assert n.attrs["softcap"] is None and n.attrs["has_bias"] is False


def test_fuse_lm_head_with_bias_and_softcap(tmp_path):
    head = "  lm_head: {name: head, shape: [V, H]}\n"
    assert head in TINY
    text = TINY.replace(head, head + "  head_b: {name: head_b, shape: [V]}\n")
    text = text.replace("  - logits = linear(rms_norm(last(x), final_norm, eps), lm_head)",
                        "  - logits = softcap(linear(rms_norm(last(x), final_norm, eps), lm_head, head_b), 30.0)")
    state = _state(tmp_path, text)
    fuse_lm_head(state)
    infer_types(state)
    n = state.graph.ordered()[-1]
    assert n.op == "lm_head_last" and {"softcap", "linear", "last"}.isdisjoint(ops(state.graph))
    assert n.attrs["softcap"] == 30.0 and n.attrs["has_bias"] is True
    assert n.inputs[-2:] == ["lm_head", "head_b"]
    assert state.graph.outputs == n.outputs


def test_eliminate_dead(state, tmp_path):
    spec_text = TINY.replace("  - logits = linear(", "  - unused = embedding(tokens, embed)\n  - logits = linear(")
    p = tmp_path / "dead.yaml"
    p.write_text(spec_text)
    spec = load_spec(p)
    env = spec.bind(spec.variants["tiny"])
    g, w = lower(spec, env)
    st = CompileState(spec, env, g, w, "tiny")
    infer_types(st)
    assert ops(st.graph).count("embedding") == 2
    eliminate_dead(st)
    assert ops(st.graph).count("embedding") == 1


def _overlaps(a, b):
    return a[0] <= b[1] and b[0] <= a[1]


@pytest.mark.parametrize("model", ["qwen3-4b", "llama-3.2-1b", "qwen3-30b-a3b"])
@pytest.mark.parametrize("T,B", [(1, 1), (4096, 3), (7, 7)])
def test_plan_memory_never_overlaps_live_buffers(model, T, B):
    spec, cfg = find_variant(model)
    st = compile_spec(spec, spec.bind(cfg), model)
    mem = st.memory
    live = mem["live"]
    assert len(mem["slot_sizes"]) < len(live)     # some memory was reused

    def span(root):
        off = mem["slot_offsets"][mem["slot_of"][root]]
        size = [0, 0, 0]
        for k, v in mem["values"].items():
            if mem["root"][k] == root:
                from infc.compiler.passes.plan_memory import _size
                size = [max(a, b) for a, b in zip(size, _size(v.type))]
        start = off[0] * T + off[1] * B + off[2]
        return start, start + size[0] * T + size[1] * B + size[2] - 1

    roots = sorted(live)
    for i, a in enumerate(roots):
        for b in roots[i + 1:]:
            if _overlaps(live[a], live[b]):
                assert not _overlaps(span(a), span(b)), (a, b)


def test_select_kernels_per_phase(state):
    plan_memory(state)
    select_kernels(state)
    lin = next(n for n in body(state).ordered() if n.op == "linear")
    assert state.kernels["decode"][lin.id] == ("triton", "gemv")
    assert state.kernels["prefill"][lin.id] == ("triton", "gemm")


def test_a_gated_pair_fuses_apart_from_other_linears_on_its_input():
    """DeepSeek-V2's router, shared gate and shared up read one input: gate | up fuse alone, so
    the SwiGLU folds into the shared gate|up projection's epilogue (linear_gated) and the router
    stays its own linear, instead of one fused output whose strided slices took copies and two
    launches. Seen with fold_shared_experts skipped, as where it does not apply (an expert-parallel
    dispatch, a gated shared expert); with it, the shared experts are routed ones and only the
    dense layer's MLP is gated."""
    from infc.compiler.build import compile_model
    from infc.compiler.contract.program import unrolled
    for skip, gated in ((("fold_shared_experts",), 27), ((), 1)):   # dense MLP (+ 26 shared experts)
        _, plan = compile_model("deepseek-v2-lite", skip=skip)
        ops = [launch["op"] for launch, layer in unrolled(plan["programs"]["decode"])]
        assert ("ws_gate_up" in plan["weights"]) == bool(skip) and not any("router_ws" in w for w in plan["weights"])
        assert ops.count("linear_gated") == gated
        assert "linear_act_mul" not in ops and "act_mul" not in ops
        assert "mul" not in ops and "silu" not in ops


def test_fuse_latent_prologue_on_deepseek_v2():
    """MLA's two ropes, the latent norm and both concats become one latent_prologue a layer; with
    the fusions skipped (--no-fuse) the five ops stay."""
    from infc.compiler.build import compile_model
    from infc.compiler.pipeline import FUSIONS

    def layer_ops(plan):
        kinds = next(l for l in plan["programs"]["decode"] if "kinds" in l)["kinds"]
        return {k: [l["op"] for l in body] for k, body in kinds.items()}

    _, fused = compile_model("deepseek-v2-lite")
    _, plain = compile_model("deepseek-v2-lite", skip=FUSIONS)
    for kind, got in layer_ops(fused).items():
        assert got.count("latent_prologue") == 1, kind
        assert {"rope", "concat", "rms_norm"}.isdisjoint(got), (kind, got)
        assert got.index("latent_prologue") < got.index("latent_attention")
    for kind, got in layer_ops(plain).items():
        assert "latent_prologue" not in got and got.count("rope") == 2 and got.count("concat") == 2, kind
