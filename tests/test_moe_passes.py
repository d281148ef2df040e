"""The MoE lowering and its fusion: lower_experts puts moe_align before the expert launches;
fuse_route_align folds it into the router launch where the ids are the router's own (not across
ep_dispatch); the decode program reads no grouping and the prefill kernels do."""
from infc.compiler.build import compile_model
from infc.compiler.build import compile_ranks
from infc.compiler.parallel import settings
from infc.compiler.contract.program import launches


def _moe(plan, phase):
    return [(l["op"], l["kernel"], l["inputs"], l["outputs"]) for l, _ in launches(plan["programs"][phase])
            if l["op"].startswith("moe")]


def test_router_launch_groups_the_tokens():
    _, plan = compile_model("qwen3-30b-a3b")
    dec, pre = _moe(plan, "decode"), _moe(plan, "prefill")
    assert [(o, k) for o, k, _, _ in dec] == [("moe_route_align", "moe_route"), ("moe_gate_up", "moe_gate_up"),
                                              ("moe_down", "moe_down")]
    assert [(o, k) for o, k, _, _ in pre] == [("moe_route_align", "moe_route"),
                                              ("moe_gate_up", "moe_gate_up_grouped"),
                                              ("moe_down", "moe_down_grouped")]
    (_, _, _, (w, ids, rows, counts)), (_, _, gu_in, act), (_, _, dn_in, _) = pre
    assert gu_in[1] == ids and gu_in[3:] == [rows, counts] and dn_in[1:3] == [w, ids] and dn_in[4:] == [rows, counts]
    assert plan["buffers"][rows]["shape"] == [128, "T"] and plan["buffers"][counts]["shape"] == [128]


def test_wide_decode_runs_the_grouped_experts(tiny_model):
    """A decode step of at least wide_tokens (8 tokens per expert: 8 * 128 / 8) runs the wide
    program: the decode program with the experts' grouped GEMMs fed by the router's token lists,
    and the plain linears on the GEMM's decode tiles; every other launch is the decode program's.
    An EP rank counts the whole model's experts."""
    from infc.compiler.contract.program import program_name
    _, plan = compile_model("qwen3-30b-a3b")
    assert plan["wide_tokens"] == 128
    assert [program_name(plan, "decode", T) for T in (1, 2, 9, 127, 128, 256)] == \
        ["narrow", "decode", "decode", "decode", "wide", "wide"]
    assert program_name(plan, "mixed", 256) == "mixed"
    wide = _moe(plan, "wide")
    assert [(o, k) for o, k, _, _ in wide] == [("moe_route_align", "moe_route"), ("moe_gate_up", "moe_gate_up_grouped"),
                                               ("moe_down", "moe_down_grouped")]
    other = lambda phase: [(l["op"], l["kernel"]) for l, _ in launches(plan["programs"][phase])  # noqa: E731
                           if not l["op"].startswith("moe")]
    wide_other, decode_other = other("wide"), other("decode")
    assert [o for o, _ in wide_other] == [o for o, _ in decode_other]
    assert {k for o, k in wide_other if o == "linear"} == {"gemm"}
    assert {k for o, k in decode_other if o == "linear"} == {"gemv"}
    assert [x for x in wide_other if x[0] != "linear"] == [x for x in decode_other if x[0] != "linear"]
    d, _ = tiny_model("qwen3_moe")
    _, whole = compile_model(model_dir=str(d))
    for _, rank in compile_ranks(settings(expert_parallel_only=2), model_dir=str(d)):
        assert rank["wide_tokens"] == whole["wide_tokens"]


def test_no_fuse_and_expert_parallel_keep_the_generic_align(tiny_model):
    _, plan = compile_model("qwen3-30b-a3b", fuse=False)
    assert [o for o, *_ in _moe(plan, "decode")] == ["moe_route", "moe_align", "moe_gate_up", "moe_down"]
    d, _ = tiny_model("qwen3_moe")
    for _, rank in compile_ranks(settings(expert_parallel_only=2), model_dir=str(d)):
        ops = [o for o, *_ in _moe(rank, "prefill")]
        # ep_dispatch rewrites the ids between the router and the experts: no fusion across it
        assert ops == ["moe_route", "moe_align", "moe_gate_up", "moe_down"], ops


def test_profile_floor_counts_the_chosen_experts():
    """bench/profile.py: an expert launch's floor is its chosen experts' bytes (k of E at batch 1)."""
    import json
    from pathlib import Path
    from infc.bench import profile as prof
    plan = json.loads((Path(__file__).resolve().parent.parent / "generated" / "qwen3-30b-a3b" / "plan.json").read_text())
    sites = [s for s in prof.launch_sites(plan, "decode") if s["op"] in ("moe_gate_up", "moe_down")]
    assert sites and all(s["experts"] == (128, 8) for s in sites)
    one = [[1e-3] * len(sites)]
    full = {g["key"]: g["bytes"] for g in prof.group_launches(sites, one, bandwidth=4e12)}
    b1 = {g["key"]: g["bytes"] for g in prof.group_launches(sites, one, bandwidth=4e12, tokens=1)}
    b64 = {g["key"]: g["bytes"] for g in prof.group_launches(sites, one, bandwidth=4e12, tokens=64)}
    for key in full:
        assert b1[key] * 16 == full[key] and b64[key] == full[key]
    L = plan["config"]["L"]
    assert sum(b1.values()) == L * 8 * 3 * 2048 * 768 * 2          # 8 experts' gate, up, down
