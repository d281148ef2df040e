"""`infc build`: every variant builds, output is byte-deterministic, generated/ is current,
and qwen3-4b's decode phase stays within 8 launches per layer."""
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from exhaustive import EXHAUSTIVE

from infc.compiler.build import GENERATED, build, compile_model
from infc.compiler.inspect import count_launches
from infc.compiler.plan import SCHEMA, dumps
from infc.compiler.spec import all_variants
from infc.compiler.contract.program import bodies, launches, repeats

VARIANTS = all_variants()


def _fast_variants() -> set:
    """The variants whose generated/ the fast suite checks: each spec's first, the served ones
    (qwen3-4b, llama-3.2-1b) and the YaRN-scaled qwen2.5 (its own RoPE); the others' plans differ
    only in sizes and tuning, and are checked with --exhaustive (make test-all, before any kernel
    change is resolved)."""
    from infc.compiler.spec import find_variant
    first = {}
    for v in VARIANTS:
        first.setdefault(str(find_variant(v)[0].path), v)
    return set(first.values()) | {"qwen3-4b", "llama-3.2-1b", "qwen2.5-7b-instruct-yarn"}


FAST_VARIANTS = _fast_variants()


def test_all_specs_have_their_variants():
    assert {"qwen3-0.6b", "qwen3-4b", "qwen3-8b", "smollm2-135m", "llama-3.2-1b", "llama-3.2-3b",
            "llama-3.1-8b", "qwen3-30b-a3b"} <= set(VARIANTS)


def _tree(d: Path) -> dict:
    """Every committed artifact file (plan + kernel sources; bin/ is a build cache)."""
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*"))
            if p.is_file() and "bin" not in p.relative_to(d).parts}


@pytest.mark.parametrize("variant", [pytest.param(v, marks=() if v in FAST_VARIANTS else EXHAUSTIVE)
                                     for v in VARIANTS])
def test_variant_builds_deterministically_and_matches_generated(variant, tmp_path):
    """generated/ was built by another process (another hash seed, another set iteration order),
    so matching it byte for byte is the determinism check."""
    fresh = _tree(build(model=variant, out=tmp_path / "a", log=None, compile=False))
    assert any(k.startswith("kernels/") for k in fresh)
    committed = GENERATED / variant
    assert committed.exists(), f"generated/{variant} is missing: run `make generated`"
    stale = sorted(set(fresh) ^ set(_tree(committed)) | {k for k in fresh if _tree(committed).get(k) != fresh[k]})
    assert not stale, f"generated/{variant} is stale ({stale[:5]}): run `make generated`"


def test_plan_schema_and_contents():
    _, plan = compile_model("qwen3-4b")
    assert plan["schema"] == SCHEMA
    assert plan["config"]["H"] == 2560 and plan["config"]["L"] == 36
    assert plan["weights"]["wqkv"]["shape"] == [6144, 2560]
    assert plan["weights"]["lm_head"]["source"] == {"tied": "embed"}     # Qwen3-4B ties
    kv = {"kind": "paged", "shape": [8, 128], "dtype": "bf16", "layers": list(range(36))}
    assert plan["caches"] == {"k": kv, "v": kv}
    assert plan["weights"]["wqkv"]["layers"] == list(range(36)) and plan["weights"]["embed"]["layers"] is None
    _, plan8 = compile_model("qwen3-8b")
    assert plan8["weights"]["lm_head"]["source"] == {"tensor": "lm_head.weight"}


def test_qwen3_4b_decode_launches_per_layer():
    _, plan = compile_model("qwen3-4b")
    total, per_layer = count_launches(plan["programs"]["decode"])
    assert per_layer <= 8
    assert total == 36 * per_layer + 3


# Decode launches per layer of the fused plans before the compiler went general (b7e8e1b): the
# generic lowering (split_attention, lower_experts) and the fusions together must give them back.
FUSED_PER_LAYER = {"qwen3-4b": 8, "qwen3-8b": 8, "qwen3-0.6b": 8, "llama-3.2-1b": 8,
                   "llama-3.1-8b": 8, "smollm2-135m": 8, "qwen3-30b-a3b": 10}


@pytest.mark.parametrize("model", sorted(FUSED_PER_LAYER))
def test_fused_launch_counts_kept(model):
    _, plan = compile_model(model)
    L = plan["config"]["L"]
    for phase in ("prefill", "decode", "mixed", "short"):
        total, per_layer = count_launches(plan["programs"][phase])
        assert (per_layer, total) == (FUSED_PER_LAYER[model], L * FUSED_PER_LAYER[model] + 3), phase


def test_short_program_is_mixed_with_gemv_linears():
    """The short phase: mixed's launches one for one, the linears on the decode GEMVs (the tuned
    prefill GEMMs are what short steps avoid), attention attention_mixed like mixed's (rendered
    with a wider split role: QMAX 16 new tokens, mixed's 1)."""
    _, plan = compile_model("qwen3-4b")
    assert plan["short_tokens"] == 64
    short, mixed = (list(launches(plan["programs"][p])) for p in ("short", "mixed"))
    assert len(short) == len(mixed) and count_launches(plan["programs"]["short"]) == \
        count_launches(plan["programs"]["mixed"])
    gemv = {"linear": "gemv", "linear_act_mul": "gemv_act_mul", "linear_gated": "gemv_gated"}
    for (s, ns), (m, nm) in zip(short, mixed):
        assert (s["op"], s["inputs"], s["outputs"], ns) == (m["op"], m["inputs"], m["outputs"], nm)
        assert s["kernel"] == gemv.get(s["op"], m["kernel"]), s["op"]
    assert {l["kernel"] for l, _ in short if l["op"] == "attention_cached"} == {"attention_mixed"}


def test_no_fuse_runs_every_op_on_its_generic_kernel():
    """--no-fuse: no fused op and no fusion pass in the plan; qwen3-4b's layer is 19 launches."""
    _, plan = compile_model("qwen3-4b", fuse=False)
    total, per_layer = count_launches(plan["programs"]["decode"])
    assert per_layer == 19
    ops = {l["op"] for l, _ in launches(plan["programs"]["decode"])}
    assert ops.isdisjoint({"add_rms_norm", "qk_norm_rope_cache", "act_mul", "linear_act_mul", "linear_gated",
                           "lm_head_last"})
    assert {"kv_write", "attention_cached", "rope", "rms_norm", "silu", "mul"} <= ops


def test_moe_plan_routes_and_stacks_experts():
    _, plan = compile_model("qwen3-30b-a3b")
    w = plan["weights"]["we_gate_up"]
    assert w["shape"] == [128, 1536, 2048]
    assert w["source"]["concat"][0] == {"stack": "model.layers.{i}.mlp.experts.{e}.gate_proj.weight",
                                        "count": 128}
    (body,) = bodies(repeats(plan["programs"]["decode"])[0]).values()
    assert [l["op"] for l in body].count("moe_route_align") == 1   # routing + grouping by expert
    assert "moe_route" not in [l["op"] for l in body] and "moe_align" not in [l["op"] for l in body]
    assert [l["op"] for l in body].count("moe_gate_up") == 1
    assert [l["op"] for l in body].count("moe_down") == 1


def test_cli_build_qwen3_4b_under_30_s(tmp_path):
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "infc.cli", "build", "--model", "qwen3-4b",
                        "--out", str(tmp_path), "--no-compile"], capture_output=True, text=True, timeout=60)
    elapsed = time.perf_counter() - t0
    assert r.returncode == 0, r.stderr
    assert elapsed <= 30
    assert (tmp_path / "plan.json").read_bytes() == (GENERATED / "qwen3-4b" / "plan.json").read_bytes()


def test_a_tuning_overlay_changes_only_its_kernels_and_is_recorded(tmp_path):
    """build(tuning_overlay=...) lays an experiment's tunables over the GPU's table: only the
    named template's kernels change, the plan records the overlay (rerender.py rebuilds from it),
    and a parallel build refuses one."""
    from infc.compiler.build import load_tuning
    from infc.compiler.contract.errors import SpecError
    overlay = {"attention_mixed": {"default": {"SPLIT_MIN_KEYS": 64, "SPLIT_MERGE_CHUNK": 1}}}
    table = load_tuning("h200", overlay)
    assert table["templates"]["attention_mixed"]["default"]["SPLIT_MIN_KEYS"] == 64
    assert "SPLIT_MIN_KEYS" not in load_tuning("h200")["templates"].get("attention_mixed", {}).get("default", {})
    a = json.loads((build(model="qwen3-4b", out=tmp_path / "a", log=None, compile=False, gpu="h200")
                    / "plan.json").read_text())
    b = json.loads((build(model="qwen3-4b", out=tmp_path / "b", log=None, compile=False, gpu="h200",
                          tuning_overlay=overlay) / "plan.json").read_text())
    assert b["build"]["tuning_overlay"] == overlay and "tuning_overlay" not in a["build"]
    changed = set(a["kernels"]) ^ set(b["kernels"])
    assert changed and {k.rsplit("_", 1)[0] for k in changed} == {"attention_mixed"}
    src = next((tmp_path / "b" / "kernels").glob("attention_mixed_*.py")).read_text()
    assert "CHUNK: tl.constexpr = 1" in src
    with pytest.raises(SpecError, match="one-GPU"):
        build(model="qwen3-30b-a3b", out=tmp_path / "c", log=None, compile=False,
              tensor_parallel_size=2, tuning_overlay=overlay)


def test_a_build_can_leave_out_one_fusion_and_records_it(tmp_path):
    """build(skip=...) (an in-model A/B of one fusion: tests/gpu/prepare.py records it for the
    GPU's re-render): the plan says which passes it left out and lacks their ops; a name that is
    not an optional pass, or a parallel build, is refused."""
    from infc.compiler.contract.errors import SpecError
    plan = json.loads((build(model="qwen3-4b", out=tmp_path / "a", log=None, compile=False, gpu="h200",
                             skip=("fuse_add_rms_norm",)) / "plan.json").read_text())
    assert plan["build"]["skip"] == ["fuse_add_rms_norm"]
    ops = {l["op"] for l, _ in launches(plan["programs"]["decode"])}
    assert "add_rms_norm" not in ops and "rms_norm" in ops
    with pytest.raises(SpecError, match="lower_experts is not an optional pass"):
        build(model="qwen3-4b", out=tmp_path / "b", log=None, compile=False, skip=("lower_experts",))
    with pytest.raises(SpecError, match="one-GPU"):
        build(model="qwen3-30b-a3b", out=tmp_path / "c", log=None, compile=False,
              tensor_parallel_size=2, skip=("act_codes",))


def test_the_page_size_defaults_to_the_gpu_tables_and_a_flag_overrides_it(tmp_path):
    """The H200 table names 64-token pages, where attention_mixed's flash tiles (128 x 64) lie in
    one page and take their K/V by TMA; the H100 table names none (16, vLLM's); --page-size wins.
    The runtime sizes its caches from plan["build"]["page_size"]."""
    from infc.compiler.build import default_page_size, load_tuning
    assert (default_page_size("h200"), default_page_size("h100")) == (64, 16)
    assert "page_size" not in load_tuning("h100")
    built = {}
    for name, kw in {"h200": {"gpu": "h200"}, "h100": {"gpu": "h100"},
                     "h200-16": {"gpu": "h200", "page_size": 16}}.items():
        out = build(model="qwen3-4b", out=tmp_path / name, log=None, compile=False, **kw)
        plan = json.loads((out / "plan.json").read_text())
        mixed = [(out / "kernels" / f"{k}.py").read_text() for k in plan["kernels"] if k.startswith("attention_mixed")]
        built[name] = (plan["build"]["page_size"], any("make_tensor_descriptor(k_cache" in s for s in mixed))
    assert built == {"h200": (64, True), "h100": (16, False), "h200-16": (16, False)}
