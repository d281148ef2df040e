"""The narrow phase (compiler/passes/merge_prologues.py): decode steps of one token (a
speculative build's verify steps of up to 8 rows run the same launches as its verify program:
tests/test_verify_program.py), where the
residual add + RMSNorm runs inside the GEMV after it. The plan's shape of it, the memory rule it
needs (no launch writes memory that one of its other inputs occupies), and where it is not made."""
import pytest

from infc.compiler.build import compile_model
from infc.compiler.build import compile_ranks
from infc.compiler.parallel import settings
from infc.compiler.contract.program import count_launches, launches, program_name
from infc.config import lora_build


def test_qwen3_4b_narrow_program_merges_the_norms_and_qk_rope():
    state, plan = compile_model("qwen3-4b")
    assert plan["narrow_tokens"] == 1                          # infc/config.py NARROW_TOKENS
    assert count_launches(plan["programs"]["narrow"]) == (36 * 5 + 3, 5)
    assert count_launches(plan["programs"]["decode"]) == (36 * 8 + 3, 8)      # decode keeps them
    merged = [l for l, _ in launches(plan["programs"]["narrow"]) if "prologue" in l]
    assert [(l["op"], l["kernel"], l["prologue"]["op"]) for l in merged] == [
        ("linear", "gemv", "add_rms_norm"), ("attention_cached", "attention_decode", "qk_norm_rope_cache"),
        ("linear_gated", "gemv_gated", "add_rms_norm")]
    attn = merged[1]
    assert attn["inputs"] == ["qkv.59", "q_norm", "k_norm", "cache"] and attn["outputs"] == ["cache", "attn.57"]
    qkv = merged[0]
    assert qkv["inputs"] == ["x", "d", "attn_norm", "wqkv"] and qkv["outputs"][1:] == ["qkv.59"]
    assert qkv["prologue"]["op"] == "add_rms_norm" and qkv["prologue"]["value"] == "h.78"
    assert qkv["pass"] == "merge_prologues" and qkv["fuses"][:2] == ["add", "rms_norm"]
    # the residual the merged launch writes is not x's memory: x is read by every program
    bufs = plan["buffers"]
    assert "shares" not in bufs[qkv["outputs"][0]]
    # steps pick it by their tokens
    assert program_name(plan, "decode", 1) == "narrow"
    assert program_name(plan, "decode", 2) == "decode"
    assert program_name(plan, "prefill", 1) == "short"          # a prompt of one token is no decode step
    # a speculative build (infc/backend.py: narrow_tokens_for) keeps it and adds the same
    # launches as a verify program of its verify step's rows
    _, wide = compile_model("qwen3-4b", narrow_tokens=8)
    assert wide["narrow_tokens"] == 1 and wide["verify_tokens"] == 8
    assert wide["programs"]["narrow"] == wide["programs"]["verify"] == plan["programs"]["narrow"]
    assert "verify" not in plan["programs"] and "verify_tokens" not in plan
    assert program_name(wide, "decode", 8) == "verify"          # a verify step of 7 drafts at batch 1
    assert program_name(wide, "decode", 9) == "decode"
    for bad in (0, 9, 2.0, True, "8"):
        with pytest.raises(ValueError, match="narrow_tokens must be an integer in 1..8"):
            compile_model("qwen3-4b", narrow_tokens=bad)


def test_a_one_token_narrow_program_leaves_the_tensor_core_path_out():
    """The narrow GEMVs of a one-token narrow program are the CUDA-core path alone: the tensor-core
    path that 2+ rows need, in the same kernel, slowed the one-token step 16 % on an H200. A
    speculative build's verify GEMVs (k + 1 <= 8 rows) take the tensor-core path by default
    (gemv.py.j2 VERIFY_DOT), or the CUDA-core path with every row through each W tile at once
    (tune FMA_T "rows"); its decode attention writes a verify step's other rows' keys."""
    from infc.compiler.codegen.render import render_plan
    lanes = {"templates": {t: {"default": {"FMA_T": "rows"}} for t in ("gemv", "gemv_gated", "lm_head_last")}}
    for n, program, verify, table in ((1, "narrow", False, {}), (8, "narrow", False, {}), (8, "verify", True, {}),
                                      (8, "verify", True, lanes)):
        _, plan = compile_model("qwen3-4b", narrow_tokens=n)
        kernels = render_plan(plan, table, 16)
        narrow = {l["op"]: kernels[l["kernel_id"]] for l, _ in launches(plan["programs"][program])}
        for op in ("linear", "linear_gated", "lm_head_last"):
            dot = verify and not table
            assert ("tensor-core path: rows" in narrow[op].source) == dot, (n, program, op)
            if op != "lm_head_last":        # gemv.py.j2's own line for its rows on CUDA cores
                assert ("T <= FMA_ROWS = 8: CUDA-core path" in narrow[op].source) == (verify and not dot), \
                    (n, program, op)
        assert ("a verify step: the K/V" in narrow["attention_cached"].source) == verify, (n, program)


def test_the_narrow_program_renders_the_decode_kernels_but_the_gemvs():
    """Templates see a narrow launch as a decode one (phase "decode", narrow = True): attention,
    qk-norm and the rest are the decode program's kernels, not kernels of their own."""
    from infc.compiler.codegen.render import render_plan
    for n, program, own in ((1, "narrow", {"lm_head_last"}), (8, "verify", set())):
        _, plan = compile_model("qwen3-4b", narrow_tokens=n)
        render_plan(plan, {}, 16)
        ids = {p: {(l["op"], l["kernel_id"]) for l, _ in launches(plan["programs"][p])} for p in ("decode", program)}
        only_narrow = {op for op, _ in ids[program] - ids["decode"]}
        # the merged launches; lm_head_last (no prologue) is its own CUDA-core kernel in a one-token
        # program, and the decode program's tensor-core kernel in a speculative build's verify program
        assert only_narrow == {"linear", "linear_gated", "attention_cached"} | own, n


def test_a_narrow_tuning_entry_reaches_the_narrow_launches_alone():
    """A "narrow|S" entry is laid over "decode|S" for the narrow program's launch of those shapes,
    and the decode program's launch of the same shapes keeps the decode entry."""
    from infc.compiler.codegen.render import render_plan, tuning_key
    _, plan = compile_model("qwen3-4b")
    gated = {p: next(l for l, _ in launches(plan["programs"][p]) if l["op"] == "linear_gated")
             for p in ("decode", "narrow")}
    key = tuning_key(plan, gated["decode"], "decode")
    assert tuning_key(plan, gated["narrow"], "narrow") == key
    table = {"templates": {"gemv_gated": {key: {"BLOCK_N": 16, "num_warps": 8},
                                          "narrow|" + key.split("|", 1)[1]: {"BLOCK_N": 8}}}}
    kernels = render_plan(plan, table, 16)
    meta = {p: kernels[gated[p]["kernel_id"]].meta for p in gated}
    assert meta["decode"]["constexprs"]["BLOCK_N"] == 16 and meta["decode"]["num_warps"] == 8
    assert meta["narrow"]["constexprs"]["BLOCK_N"] == 8 and meta["narrow"]["num_warps"] == 8


def test_no_fuse_and_data_parallel_plans_have_no_narrow_program(tiny_model):
    _, plan = compile_model("qwen3-4b", fuse=False)
    assert "narrow" not in plan["programs"] and "narrow_tokens" not in plan
    # a data-parallel rank's rows are every rank's (G): its steps are not one token
    d, _ = tiny_model("qwen3_moe")
    for _, plan in compile_ranks(settings(data_parallel_size=2, enable_expert_parallel=True), model_dir=str(d)):
        assert "narrow" not in plan["programs"]
    (_, whole), = compile_ranks({"world": 1, "rank": 0, "tp": 1, "ep": 1}, model_dir=str(d))
    assert "narrow" in whole["programs"]


def test_a_norm_read_twice_is_not_merged(tiny_model):
    """The MoE layer's second norm feeds the router and the experts, so it stays a launch. It adds
    the attention norm's residual in place, which would put the merged qkv launch's residual over
    the x every program of it reads: the second norm's residual takes a buffer of its own instead
    (merge_prologues' IN_PLACE_OPTIONAL), so the attention norm merges into the qkv GEMV; q/k
    RoPE into attention. No launch writes memory another of its inputs holds."""
    d, _ = tiny_model("qwen3_moe", hidden_size=96, head_dim=32, intermediate_size=160, num_hidden_layers=2)
    state, plan = compile_model(model_dir=str(d))
    merged = [l for l, _ in launches(plan["programs"]["narrow"]) if "prologue" in l]
    assert [(l["op"], l["prologue"]["op"]) for l in merged] == [("linear", "add_rms_norm"),
                                                                ("attention_cached", "qk_norm_rope_cache")]
    norms = [l for l, _ in launches(plan["programs"]["narrow"]) if l["op"] == "add_rms_norm"]
    assert len(norms) == 1                                   # a layer: the second norm
    residual, x = norms[0]["outputs"][0], norms[0]["inputs"][0]
    assert plan["buffers"][residual].get("shares") != x and plan["buffers"][x].get("shares") != residual
    _no_overlaps(plan)


def test_row_parallel_fp32_partials_are_not_merged(tiny_model):
    """TP=2: the column-parallel qkv and gate|up take their norms; a rank's row-parallel linears
    (fp32 partials, tensor-core path) are never a consumer here, and the plans stay consistent."""
    d, _ = tiny_model("qwen3", hidden_size=96, head_dim=32, intermediate_size=160, num_hidden_layers=2)
    for _, plan in compile_ranks(settings(tensor_parallel_size=2), model_dir=str(d)):
        merged = [l for l, _ in launches(plan["programs"]["narrow"]) if "prologue" in l]
        assert [l["op"] for l in merged] == ["linear", "attention_cached", "linear_gated"]
        assert all(l["attrs"].get("out_dtype") != "f32" for l in merged)


def _span(plan, name, T, B):
    b = plan["buffers"][name]
    o = b["offset"]
    start = o["T"] * T + o["B"] * B + o["bytes"]
    n = {"bf16": 2, "f16": 2, "f32": 4, "i32": 4}[b["dtype"]]
    rows = 1
    for d in b["shape"]:
        rows *= {"T": T, "B": B}.get(d, d) if isinstance(d, str) else d
    return start, start + rows * n, b.get("shares", name)


# gpt2 has LayerNorms and no RoPE, OLMo-2 its norms after the sublayers and q/k norms over the
# whole projection (no qk_norm_rope_cache): nothing merges; the rest merge at least their q/k RoPE
# into attention (starcoder2's LayerNorms stay launches)
NO_NARROW = ("gpt2", "olmo-2-1124-7b")
VARIANTS = ["qwen3-4b", "llama-3.2-1b", "gemma-2-2b-it", "gemma-3-1b-it", "qwen3-30b-a3b", "deepseek-v2-lite",
            "qwen3.5-4b", "phi-3-mini-4k-instruct", "olmo-2-1124-7b", "gpt2", "starcoder2-3b"]


@pytest.mark.parametrize("model", VARIANTS)
def test_no_launch_writes_memory_another_of_its_inputs_holds(model):
    """In every program: a launch's output may overlap an input only where it is that input
    (in place, or a view of it). A merged launch reads its producer's inputs where its consumer
    runs, so plan_memory keeps them live until then; without that, gate|up's output took the
    o_proj output's slot that every program of the merged launch still read."""
    _, plan = compile_model(model)
    assert ("narrow" in plan["programs"]) == (model not in NO_NARROW)
    _no_overlaps(plan)


def test_lora_sites_in_the_gemv_write_no_input_they_read():
    """--enable-lora's narrow program (compiler/passes/merge_lora.py): a site's launch writes the
    expand's output where the linear runs, so what it reads stays live until the expand's place."""
    _, plan = compile_model("qwen3-4b", lora=lora_build(8, 16))
    assert sum("lora" in l for l, _ in launches(plan["programs"]["narrow"])) == 4
    _no_overlaps(plan)


def _no_overlaps(plan):
    for phase, program in plan["programs"].items():
        for l, _ in launches(program):
            ins = [_span(plan, i, 5, 2) for i in l["inputs"] if i in plan["buffers"]]
            # a merged launch writes its producer's outputs while every program reads its inputs:
            # not even in place
            merged = l.get("prologue", {}).get("writes", 0)
            for k, o in enumerate(l["outputs"]):
                if o not in plan["buffers"]:
                    continue
                a0, a1, root = _span(plan, o, 5, 2)
                for b0, b1, other in ins:
                    assert (root == other and k >= merged) or a1 <= b0 or b1 <= a0, (phase, l["op"], o, other)


def test_a_merge_whose_residual_would_stay_in_place_frees_the_later_norm():
    """DeepSeek-V2-Lite's MoE layers: the attention norm's residual is read in place by the MoE
    norm, which is not merged (it feeds the router and the experts), and that one's output is the
    layer's carried residual: merged as it was, the residual would be written over x while the
    GEMV's other programs read it. The MoE norm's residual takes a buffer of its own, so the
    attention norm merges into the latent attention's first GEMV in the MoE layers as in the
    dense one; the MoE norm stays a launch; nothing a launch writes overlaps what it reads."""
    state, plan = compile_model("deepseek-v2-lite")
    notes = [m for p, m in state.log if p == "merge_prologues" and "into" in m and "add_rms_norm" in m]
    assert sorted(m.split(":")[0] for m in notes) == ["layer.dense", "layer.dense", "layer.moe"], notes
    norms = [l for l, _ in launches(plan["programs"]["narrow"]) if l["op"] == "add_rms_norm"]
    assert len(norms) == 1 and all(plan["buffers"][l["outputs"][0]].get("shares") != l["inputs"][0] for l in norms)
    _no_overlaps(plan)
