"""The wide program of a dense plan: decode steps of many sequences keep the decode launches, but
the gated GEMVs and lm_head tile their rows for many sequences (one pass over W per BLOCK_T rows),
from the template's wide defaults and the tuning table's "wide|..." entries, and the plain linears
run on the GEMM's decode tiles."""
from infc.compiler.build import compile_model, load_tuning
from infc.compiler.codegen.render import launch_context, render_template
from infc.compiler.passes.select_kernels import ROW_TILED, WIDE_DENSE_TOKENS
from infc.compiler.contract.program import launches, program_name


def _row_tiles(plan, phase, table):
    """(template, BLOCK_T) of each GEMV-family launch of a phase, rendered with this table."""
    out = []
    for launch, _ in launches(plan["programs"][phase]):
        if launch["kernel"] in ROW_TILED:
            ctx = launch_context(plan, launch, phase, table, page_size=16)
            k = render_template(launch["backend"], launch["kernel"], ctx)
            out.append((launch["kernel"], k.meta["constexprs"]["BLOCK_T"]))
    return out


def test_dense_decode_of_many_sequences_runs_the_wide_program():
    _, plan = compile_model("qwen3-4b")
    assert plan["wide_tokens"] == WIDE_DENSE_TOKENS
    T = WIDE_DENSE_TOKENS
    assert [program_name(plan, "decode", t) for t in (1, 2, 9, T - 1, T, 256)] == \
        ["narrow", "decode", "decode", "decode", "wide", "wide"]
    assert program_name(plan, "mixed", 256) == "mixed"
    same = lambda p: [(l["op"], l["kernel"]) for l, _ in launches(plan["programs"][p])]  # noqa: E731
    wide_launches, decode_launches = same("wide"), same("decode")
    assert [o for o, _ in wide_launches] == [o for o, _ in decode_launches]
    assert {k for o, k in wide_launches if o == "linear"} == {"gemm"}
    assert {k for o, k in decode_launches if o == "linear"} == {"gemv"}
    assert [x for x in wide_launches if x[0] != "linear"] == [x for x in decode_launches if x[0] != "linear"]
    empty = {"templates": {}}
    decode, wide = _row_tiles(plan, "decode", empty), _row_tiles(plan, "wide", empty)
    assert [t for t, _ in wide] == [t for t, _ in decode if t != "gemv"]
    assert {t for t, _ in wide} == {"gemv_gated", "lm_head_last"}
    assert {b for _, b in decode} == {32} and {b for _, b in wide} == {64}


def test_the_tuning_table_reaches_the_wide_launches_only():
    """A "wide|..." entry changes the wide launch of its shape and leaves the decode one alone."""
    _, plan = compile_model("qwen3-4b")
    table = load_tuning("h100")
    gated = [k for k in table["templates"]["gemv_gated"] if k.startswith("wide|")]
    assert gated, "the h100 table has a wide gate|up entry"
    want = table["templates"]["gemv_gated"][gated[0]]["BLOCK_T"]
    assert ("gemv_gated", want) in _row_tiles(plan, "wide", table)
    assert ("gemv_gated", 32) in _row_tiles(plan, "decode", table)
