"""bench/profile.py without a GPU: launch sites follow the runner's bound order, per-launch times
group by (layer-kind launch index, op, template) and sum over layers, the tables add up, and the
whole step loop (the runner's real metadata, upload and `_launch_all` hook) runs on a fake driver
whose events read a virtual clock that each launch advances by a known time. `infc bench
profile` is registered."""
import importlib
import json
import re
from pathlib import Path

import numpy as np
import pytest

from infc.bench import profile as prof
from infc.compiler.contract.program import program_name, unrolled

PLAN = json.loads((Path(__file__).resolve().parent.parent / "generated" / "qwen3-4b" / "plan.json").read_text())
L = PLAN["config"]["L"]


def test_cli_registers_bench_profile(capsys):
    from infc.cli import parser
    a = parser().parse_args(["bench", "profile", "--artifact", "A", "--model-path", "M"])
    assert a.which == "profile" and a.rest == ["--artifact", "A", "--model-path", "M"]
    assert importlib.import_module(f"infc.bench.{a.which}").main is prof.main
    with pytest.raises(SystemExit) as e:
        prof.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in ("--artifact", "--model-path", "--out", "--reps", "--steps"):
        assert flag in out


@pytest.mark.parametrize("phase", ["prefill", "decode", "mixed", "short"])
def test_launch_sites_follow_the_runners_order(phase):
    sites = prof.launch_sites(PLAN, phase)
    order = list(unrolled(PLAN["programs"][phase]))         # what CudaRunner.bind walks
    assert len(sites) == len(order)
    for s, (launch, layer) in zip(sites, order):
        assert (s["op"], s["kernel_id"], s["layer"]) == (launch["op"], launch["kernel_id"], layer)
        assert s["template"] == PLAN["kernels"][launch["kernel_id"]]["template"]
    keys = {}
    for s in sites:
        keys[s["key"]] = keys.get(s["key"], 0) + 1
    layer_keys = [k for k in keys if k.startswith("layer.")]
    assert len(layer_keys) == 8 and all(keys[k] == L for k in layer_keys)          # 8 launches per layer
    assert all(n == 1 for k, n in keys.items() if k.startswith("top."))
    c = PLAN["config"]
    qkv = next(s for s in sites if s["weights"] == ["wqkv"])
    assert qkv["weight_bytes"] == (c["Hq"] + 2 * c["Hkv"]) * c["D"] * c["H"] * 2
    att = next(s for s in sites if s["op"] == "attention_cached")
    assert att["kv_token_bytes"] == 2 * c["Hkv"] * c["D"] * 2 and att["weight_bytes"] == 0
    emb = next(s for s in sites if s["op"] == "embedding")
    assert emb["weight_bytes"] == 0                                                  # a gather


def _fake_us(site) -> float:
    """A known per-launch time: 50 µs outside the layers, (index + 1) * 3 µs + layer / 10 inside."""
    if site["layer"] is None:
        return 50.0
    return (site["index"] + 1) * 3.0 + site["layer"] / 10


def test_grouping_sums_over_layers_and_the_tables_add_up():
    sites = prof.launch_sites(PLAN, "prefill")
    skipped = next(i for i, s in enumerate(sites) if s["op"] == "fill_zero")
    samples = []
    for rep in range(5):        # rep 2 is an outlier everywhere; the median drops it
        samples.append([None if i == skipped else _fake_us(s) / 1e3 * (10 if rep == 2 else 1)
                        for i, s in enumerate(sites)])
    bw = 4e12
    groups = prof.group_launches(sites, samples, context_tokens=32, bandwidth=bw)
    by_key = {g["key"]: g for g in groups}
    assert sites[skipped]["key"] not in by_key                       # never launched: no row
    assert [g["key"] for g in groups] == list(dict.fromkeys(s["key"] for i, s in enumerate(sites) if i != skipped))
    for j in range(8):
        g = by_key[f"layer.{j}"]
        assert g["runs"] == L
        assert g["us"] == pytest.approx(sum((j + 1) * 3.0 + layer / 10 for layer in range(L)))
        assert g["us_per_run"] == pytest.approx(g["us"] / L)
        want = sum(s["weight_bytes"] + 32 * s["kv_token_bytes"] for s in sites if s["key"] == f"layer.{j}")
        assert g["floor_us"] == pytest.approx(want / bw * 1e6)
    assert sum(g["share"] for g in groups) == pytest.approx(1.0)
    ksum = sum(_fake_us(s) for i, s in enumerate(sites) if i != skipped)

    plain = {"wall": [9.0, 10.0, 11.0], "gpu": [7.0, 8.0, 30.0], "meta": [0.1] * 3, "issue": [5.0] * 3,
             "sync": [3.0] * 3, "sample": []}
    step = prof.summarize("prefill_32", "a 32-token prompt", "prefill", "eager", 32, 1, plain,
                          {"wall": [20.0], "gpu": [19.0]}, groups)
    assert step["wall_ms"] == 10.0 and step["gpu_ms"] == 8.0 and step["host_ms"] == pytest.approx(2.0)
    assert step["sample_ms"] is None and step["instrumented_gpu_ms"] == 19.0
    assert step["kernel_sum_ms"] == pytest.approx(ksum / 1e3)
    assert step["gaps_ms"] == pytest.approx(8.0 - ksum / 1e3)
    assert step["launches_per_step"] == len(sites) - 1
    assert step["floor_ms"] == pytest.approx(sum(g["floor_us"] for g in groups) / 1e3)
    assert sum(g["share_of_gpu"] for g in groups) == pytest.approx(ksum / 1e3 / 8.0)

    for top in (3, 12, 100):
        text = prof.step_table(step, top=top)
        rows = [r for r in text.splitlines() if r.startswith("| ") and not r.startswith("| #") and "---" not in r]
        cells = [[c.strip() for c in r.strip("|").split("|")] for r in rows]
        body, total = cells[:-1], cells[-1]
        assert total[1] == "all launches" and float(total[6]) == pytest.approx(ksum, abs=0.05)
        assert sum(float(c[6]) for c in body) == pytest.approx(ksum, abs=0.05 * len(body))
        assert sum(int(c[5]) for c in body) == len(sites) - 1 == int(total[5])
        assert sum(float(c[8].rstrip(" %")) for c in body) == pytest.approx(100, abs=0.05 * len(body))
        assert (body[-1][1] == f"rest ({len(groups) - top} groups)") == (top < len(groups))
        ranked = [float(c[6]) for c in body if c[0]]
        assert ranked == sorted(ranked, reverse=True)
        assert body[0][1] == "layer.7" and float(body[0][7]) == pytest.approx(24 + 3.5 / 2, abs=0.01)  # 36 runs
    graph = prof.summarize("decode_b1_graph", "x", "decode", "graph", 1, 1, plain, None, None, "decode_b1")
    assert "see decode_b1" in prof.step_table(graph)
    res = {"model": "qwen3-4b", "gpu": "fake", "commit": "c", "date": "d", "copy_GBps": 4000.0,
           "weight_bytes": 8e9, "steps": [step, graph]}
    text = prof.report(res)
    summary = [r for r in text.splitlines() if r.startswith("| prefill_32 ")][0]
    assert f"| {len(sites) - 1} |" in summary and "| 8.00 | 2.00 |" in summary
    assert "| decode_b1_graph | decode (graph) |" in text


def test_pages_needed_and_page_table():
    n = prof.pages_needed(16)
    assert n == 3 + 64 + 1 + 255 * 65 + 16 + 16
    # a chunk of several prompts: each prompt's own pages (7 of 2401 tokens: 150 pages, not 1051 / 16)
    assert prof.pages_needed(16, decodes=0, chunk=16807, prompts=7) == 3 + 64 + 1 + 7 * 151 + 16
    # verify rows past the short prompt: 32 + 1 + 15 tokens still fit 3 pages, + 16 need a fourth
    assert prof.pages_needed(16, verify=15) == n and prof.pages_needed(16, verify=16) == n + 1
    pt = prof.PageTable(n, 16)
    a = pt.ensure(1, 1024)
    b = pt.ensure(2, 1040, shared=a[:64])
    assert b[:64] == a and len(b) == 65 and b[64] not in a


# -- the step loop on a fake driver (tests/fake_cuda.py) ----------------------------------------
class _Kernel:
    def __init__(self, site):
        self.fn, self.block, self.shared = site, (128, 1, 1), 0


def _fake_runner(drv):
    """A CudaRunner without __init__ on the fake driver: the plan's metadata/upload/launch code
    for real (metadata and arena in fake device memory), launches that advance the virtual clock
    by _fake_us of their site (a zero grid is skipped), and the bucket-1 decode graph captured by
    the runner's own _capture."""
    from infc.runtime.cuda import runner as runner_mod
    from infc.runtime.cuda.plan_io import step_inputs
    r = object.__new__(runner_mod.CudaRunner)
    r.ctx, r.plan, r.page_size, r.num_pages = drv.Context(), PLAN, 16, 64
    r.max_pages_per_seq, r.max_tokens, r.max_seqs = 8, 64, 8
    r.place, r.sampler = {"T": 64, "B": 8}, None
    r.inputs = step_inputs(PLAN)                      # the plan's step inputs (none here)
    a = PLAN["arena"]
    r.arena = r.ctx.alloc(a["bytes_per_token"] * 64 + a["bytes_per_seq"] * 8 + a["bytes"])
    r.meta = {n: r.ctx.alloc(r._meta_bytes(m)) for n, m in PLAN["step_metadata"].items()}
    r.staging = runner_mod.Staging(r.ctx, 1 << 16)
    drv.on_launch = lambda launch: _fake_us(launch.fn)
    r.programs = {}
    for phase in PLAN["programs"]:
        bound = []
        for s in prof.launch_sites(PLAN, phase):
            g = ["0"] if s["op"] == "fill_zero" else ["T", "B", 1]          # fill_zero: a zero grid
            bound.append((_Kernel(s), runner_mod.grid_code({"grid": g}), drv.PackedArgs([0, 0], ["i32", "i32"]),
                          [(0, "T"), (1, "B")], None))   # no dependent launch
        r.programs[phase] = bound
    r.graphs, r.buckets = {}, [1]
    r._capture(1)
    del drv.launches[:]                                  # the capture's warm-up launches
    return r


def test_profiler_steps_on_a_fake_driver(fake_driver, capsys):
    from infc.runtime.engine.step import Chunk
    r = _fake_runner(fake_driver)
    launched = fake_driver.launches
    p = prof.Profiler(r, reps=4, warmup=2, bandwidth=4e12)
    pages = prof.PageTable(r.num_pages, 16)
    pages.ensure(0, 33)
    # a 32-token prompt and an 8-token prefix hit are short steps: the short program runs
    assert PLAN["short_tokens"] >= 32
    sites = prof.launch_sites(PLAN, "short")
    want_ms = sum(_fake_us(s) for s in sites if s["op"] != "fill_zero") / 1e3

    s = p.step("prefill_32", "a 32-token prompt", [Chunk(0, list(range(32)), 0)], pages)
    assert (s["phase"], s["T"], s["B"], s["reps"]) == ("short", 32, 1, 4)
    assert s["gpu_ms"] == pytest.approx(want_ms) and s["instrumented_gpu_ms"] == pytest.approx(want_ms)
    assert s["kernel_sum_ms"] == pytest.approx(want_ms) and s["gaps_ms"] == pytest.approx(0, abs=1e-9)
    assert s["host_ms"] == pytest.approx(s["wall_ms"] - s["gpu_ms"])
    assert s["launches_per_step"] == len(sites) - 1
    # (2 + 4) plain + (2 + 4) instrumented steps, each launching all but the zero grid, at T=32, B=1
    assert len(launched) == 12 * (len(sites) - 1) and set(x.grid for x in launched) == {(32, 1, 1)}
    ab = [c.value for c in r.programs["short"][1][2].storage]
    assert ab == [32, 1]                                           # the dims were written before
    assert all(x.values == (32, 1) for x in launched)
    # the plain loop is the same launches, in the same order, as the hooked one
    keys = [x.fn["key"] for x in launched]
    assert keys[: len(sites) - 1] == keys[-(len(sites) - 1):]
    by_key = {g["key"]: g for g in s["launches"]}
    assert by_key["layer.7"]["us"] == pytest.approx(sum(24.0 + layer / 10 for layer in range(L)))
    # the step's metadata reached the fake device: the prompt's tokens and positions
    tokens = r.ctx.view(r._buffer_ptr("tokens"), 32, np.int32)
    assert tokens.tolist() == list(range(32))
    assert r.ctx.view(r.meta["positions"], 32, np.int32).tolist() == list(range(32))

    n_events = r.ctx.num_events
    pages.ensure(3, 40, shared=pages.of[0][:2])                     # a prefix hit on 2 pages
    d = p.step("prefix_like", "8 new tokens after 32", [Chunk(3, list(range(8)), 32)], pages)
    assert d["phase"] == "short" and d["T"] == 8
    assert r.ctx.num_events == n_events                            # event pairs are reused
    ctx_tokens = 40
    mixed = prof.launch_sites(PLAN, "short")
    assert d["floor_ms"] == pytest.approx(sum(x["weight_bytes"] + ctx_tokens * x["kv_token_bytes"]
                                              for x in mixed if x["op"] != "fill_zero") / 4e12 * 1e3)

    # the graph: the program of a decode step at T = B = 1 (the narrow one: its launches merged) as
    # the runner captured it, replayed
    assert program_name(PLAN, "decode", 1) == "narrow"
    decode_ms = sum(_fake_us(x) for x in prof.launch_sites(PLAN, "narrow") if x["op"] != "fill_zero") / 1e3
    assert [c.fn for c in r.graphs[1][0].calls] == [k.fn for k, *_ in r.programs["narrow"] if k.fn["op"] != "fill_zero"]
    e = p.step("decode_b1", "eager", [Chunk(0, [5], 32)], pages)
    n = len(launched)
    g = p.step("decode_b1_graph", "graph", [Chunk(0, [5], 32)], pages, mode="graph", launches_from="decode_b1")
    assert e["phase"] == g["phase"] == "narrow"
    assert e["gpu_ms"] == pytest.approx(decode_ms)
    assert g["gpu_ms"] == pytest.approx(decode_ms) and "launches" not in g and g["floor_ms"] == e["floor_ms"]
    assert all(x.replay for x in launched[n:]) and len(launched) - n == 6 * len(r.graphs[1][0].calls)
    out = capsys.readouterr().out
    assert re.search(r"decode_b1_graph: wall [\d.]+ ms, GPU " + re.escape(f"{decode_ms:.3f}") + " ms", out)


def test_isolated_launches_are_retimed_alone_and_back_to_back(fake_driver):
    """--isolate: after an eager step, the first launch of each group of the named ops is issued
    again on its own; on the fake clock its alone and back-to-back times are its site's, and only
    those launches run."""
    from infc.runtime.engine.step import Chunk
    r = _fake_runner(fake_driver)
    launched = fake_driver.launches
    p = prof.Profiler(r, reps=3, warmup=1, bandwidth=None, isolate=["attention_cached", "add_rms_norm"])
    pages = prof.PageTable(r.num_pages, 16)
    pages.ensure(0, 33)
    sites = prof.launch_sites(PLAN, "short")
    n_step = 2 * (1 + 3) * (len(sites) - 1)                  # plain and instrumented passes
    s = p.step("prefill_32", "a 32-token prompt", [Chunk(0, list(range(32)), 0)], pages)
    iso = s["isolated"]
    want = {}
    for x in sites:
        if x["op"] in ("attention_cached", "add_rms_norm") and x["key"] not in want:
            want[x["key"]] = x
    assert [x["key"] for x in iso] == list(want)             # program order, one per group
    for x in iso:
        site = want[x["key"]]
        assert x["layer"] == site["layer"] == 0 and x["op"] == site["op"]
        assert x["alone_us"] == pytest.approx(_fake_us(site))
        assert x["back_to_back_us"] == pytest.approx(_fake_us(site))
    extra = launched[n_step:]
    assert len(extra) == len(want) * (1 + 3 + 3)            # warm-up, alone, back to back
    assert {e.fn["key"] for e in extra} == set(want) and all(e.values == (32, 1) for e in extra)
    text = prof.step_table(s)
    assert "Issued again alone" in text and text.count("| attention_cached |") >= 2
    # a step without --isolate records nothing of the kind
    q = prof.Profiler(r, reps=1, warmup=0, bandwidth=None)
    assert "isolated" not in q.step("again", "the same", [Chunk(0, list(range(32)), 0)], pages)
