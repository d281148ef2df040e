"""Each pass alone, on a tiny spec: what it rewrites, and that it leaves everything else."""
import textwrap

import pytest

from infc.compiler.lower import lower
from infc.compiler.passes.eliminate_dead import eliminate_dead
from infc.compiler.passes.fuse_ops import (fuse_add_rms_norm, fuse_linear_prologue, fuse_lm_head,
                                           fuse_qk_norm_rope_cache, fuse_silu_mul)
from infc.compiler.passes.fuse_weights import fuse_weights
from infc.compiler.passes.infer_types import infer_types
from infc.compiler.passes.plan_memory import plan_memory
from infc.compiler.passes.rotate_residual import rotate_residual
from infc.compiler.passes.select_kernels import select_kernels
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
    p = tmp_path / "tiny.yaml"
    p.write_text(TINY)
    spec = load_spec(p)
    env = spec.bind(spec.variants["tiny"])
    g, weights = lower(spec, env)
    st = CompileState(spec, env, g, weights, "tiny")
    infer_types(st)
    return st


def body(st):
    return next(n for n in st.graph.ordered() if n.op == "layers").body


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
    assert {"rope", "attention"}.isdisjoint(ops(b))
    assert ops(b).count("split") == 1              # only gate|up's split is left
    assert "attention_cached" in ops(b)


def test_fuse_silu_mul_then_prologue(state):
    fuse_weights(state)
    infer_types(state)
    fuse_silu_mul(state)
    infer_types(state)
    assert "silu_mul" in ops(body(state)) and "silu" not in ops(body(state))
    fuse_linear_prologue(state)
    infer_types(state)
    assert "linear_silu_mul" in ops(body(state)) and "silu_mul" not in ops(body(state))


def test_fuse_lm_head(state):
    fuse_lm_head(state)
    infer_types(state)
    assert ops(state.graph)[-1] == "lm_head_last"
    assert "last" not in ops(state.graph)
    n = state.graph.ordered()[-1]
    assert n.attrs["residual"] is False          # no rotation ran: no pending add to absorb


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
