"""`infc tune`: candidate grids, the prepare manifest, the selection/merge rules, valid random
step metadata, and the whole `tune run` flow against a fake driver (no GPU here)."""
import json
import re

import numpy as np
import pytest

from infc.cli import main
from infc.compiler import build as build_mod
from infc.compiler import tuning_table
from infc.compiler.build import default_page_size
from infc.compiler.codegen.render import TEMPLATES, render_plan, tuning_key
from infc.compiler.tune import GRIDS, candidates, prepare
from infc.runtime.cuda import tune_run
from infc.runtime.cuda.tune_run import (agree, dump_table, merge_table, select_best,
                                        step_metadata)
from infc.compiler.contract.program import launches

MODEL = "qwen3-0.6b"


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    out = tmp_path_factory.mktemp("tune") / "prep"
    prepare(MODEL, "h200", out=out, compile=False, log=None)
    return out, json.loads((out / "manifest.json").read_text())


def _template_text(backend, template):
    ext = {"triton": ".py", "cuda": ".cu", "tilelang": ".py"}[backend]
    text, seen = (TEMPLATES / backend / f"{template}{ext}.j2").read_text(), set()
    while True:                                  # includes of includes too
        todo = set(re.findall(r'{%\s*include\s+"([^"]+)"', text)) - seen
        if not todo:
            return text
        for inc in sorted(todo):
            seen.add(inc)
            text += (TEMPLATES / inc).read_text()


@pytest.mark.parametrize("backend,template", sorted(GRIDS))
def test_grids_nonempty_default_first_and_read_by_the_template(backend, template):
    text = _template_text(backend, template)
    for rows in ([1], [8], [1, 8, 64], [128, 256]):
        cands = candidates(backend, template, rows)
        assert cands[0] == {} and len(cands) >= 4, (template, rows, cands)
        assert len(cands) <= 16
        assert len({json.dumps(c, sort_keys=True) for c in cands}) == len(cands)
        for c in cands:
            for key in c:
                assert f'tune.get("{key}"' in text, f"{template} never reads tune key {key}"


def test_prepare_manifest_candidates_and_shapes(prepared):
    out, m = prepared
    _, plan = build_mod.compile_model(MODEL)
    assert m["model"] == MODEL and m["gpu"] == "h200" and m["compiled"] is False
    assert m["dims"]["decode"] == [{"T": 1, "B": 1}] and m["dims"]["prefill"] == [{"T": 1024, "B": 1}]
    assert "symbolic" in m["note"]
    # every launch key of the plan's tunable templates, per phase, is in the manifest once
    want = set()

    for phase in ("decode", "prefill"):
        for l, _ in launches(plan["programs"][phase]):
            if l["kernel"] in {e["template"] for e in m["entries"]}:
                want.add((l["kernel"], tuning_key(plan, l, phase)))
    got = [(e["template"], e["shape_key"]) for e in m["entries"]]
    assert sorted(got) == sorted(want) and len(got) == len(set(got))
    assert {"gemv", "gemv_gated", "lm_head_last", "attention_decode", "gemm", "gemm_gated",
            "attention_prefill"} <= {t for t, _ in got}
    for e in m["entries"]:
        for t in e["inputs"] + e["outputs"]:
            if t["kind"] == "buffer":
                assert t["shape"] == plan["buffers"][t["name"]]["shape"] and t["dtype"] == plan["buffers"][t["name"]]["dtype"]
            elif t["kind"] == "weight":
                assert t["shape"] == plan["weights"][t["name"]]["shape"]
        c0 = e["candidates"][0]
        assert c0["tune"] == {} and c0["label"] == "default" and len(e["candidates"]) >= 4
        sources = [(out / c["source"]).read_text() for c in e["candidates"]]
        assert len(set(sources)) == len(sources), e["shape_key"]
        assert len({c["kernel"] for c in e["candidates"]}) == len(sources)
        for c, src in zip(e["candidates"], sources):
            assert c["meta"]["params"] and c["meta"]["grid"] and "META = {" in src


def test_attention_keys_name_the_kv_layout():
    """qwen3-4b (8 KV heads) and qwen3-30b-a3b (4) share their query heads (32 x 128): an attention
    entry tuned on one must not reach the other through the tuning key."""
    keys = {}
    for model in ("qwen3-4b", "qwen3-30b-a3b"):
        _, plan = build_mod.compile_model(model)
        layer = next(l for l in plan["programs"]["decode"] if "kinds" in l)["kinds"]
        att = next(l for body in layer.values() for l in body if l["kernel"] == "attention_decode")
        keys[model] = tuning_key(plan, att, "decode")
    assert keys == {"qwen3-4b": "decode|Tx32x128;8x128;Tx32x128",
                    "qwen3-30b-a3b": "decode|Tx32x128;4x128;Tx32x128"}


def test_select_best_rules():
    r = {"d": {"us": 10.0, "ok": True}, "fast_wrong": {"us": 5.0, "ok": False},
         "a": {"us": 9.0, "ok": True}, "b": {"us": 9.5, "ok": True}}
    assert select_best(r, "d") == "a"
    r["a"]["ok"] = False
    assert select_best(r, "d") == "b"                         # 5 % better
    r["b"]["us"] = 9.8
    assert select_best(r, "d") == "d"                         # 2 %: within noise, keep default
    r["b"]["us"] = 9.69
    assert select_best(r, "d") == "b"
    assert select_best({"d": {"us": None, "ok": False}, "a": {"us": 1.0, "ok": True}}, "d") is None
    assert select_best({"d": {"us": 10.0, "ok": True}}, "d") == "d"


def test_agree_bf16_tolerance():
    rng = np.random.default_rng(0)
    w = rng.standard_normal(4096).astype(np.float32)
    bf = tune_run.from_bf16(tune_run.to_bf16(w))
    assert agree(bf, w)[0]                                    # one bf16 rounding passes
    bad = w.copy()
    bad[7] += 3.0
    assert not agree(bad, w)[0]                               # one wrong element fails
    nan = w.copy()
    nan[0] = np.nan
    assert not agree(nan, w)[0]
    assert not agree(w[:10], w)[0]


def test_merge_writes_a_table_that_the_build_reads_and_renders(prepared, tmp_path, monkeypatch):
    _, m = prepared
    e = next(e for e in m["entries"] if e["template"] == "gemv" and e["phase"] == "decode")
    cand = e["candidates"][2]
    table = json.loads((build_mod.TUNING / "h200.json").read_text())
    t1 = merge_table(table, "gemv", e["shape_key"], cand["tune"], e["base_tune"])
    assert table.get("templates", {}).get("gemv") is None or e["shape_key"] not in table["templates"]["gemv"]
    monkeypatch.setattr(tuning_table, "TUNING", tmp_path)         # the tables' home
    (tmp_path / "h200.json").write_text(dump_table(t1))
    loaded = build_mod.load_tuning("h200")
    assert loaded["templates"]["gemv"][e["shape_key"]] == cand["tune"]
    _, plan = build_mod.compile_model(MODEL)
    ids = _kernel_ids(plan, render_plan(plan, loaded, 16), "decode", "gemv")
    assert cand["kernel"] in ids and e["candidates"][0]["kernel"] not in ids
    _, plan0 = build_mod.compile_model(MODEL)
    ids0 = _kernel_ids(plan0, render_plan(plan0, table, 16), "decode", "gemv")
    assert e["candidates"][0]["kernel"] in ids0 and cand["kernel"] not in ids0
    # the default winning removes the entry again (other shapes' entries stay); an empty
    # template disappears
    t2 = merge_table(t1, "gemv", e["shape_key"], {}, e["base_tune"])
    assert e["shape_key"] not in t2["templates"].get("gemv", {})
    assert t2["templates"].get("gemv", {}) == table.get("templates", {}).get("gemv", {})
    alone = merge_table({"gpu": "h200", "templates": {}}, "gemv", e["shape_key"], cand["tune"], e["base_tune"])
    assert "gemv" not in merge_table(alone, "gemv", e["shape_key"], {}, e["base_tune"])["templates"]
    with pytest.raises(ValueError, match="prepare"):
        merge_table({"templates": {"gemv": {"default": {"num_warps": 8}}}}, "gemv", "k", {"x": 1}, {})


def test_prepare_short_phase_times_the_gemvs_at_a_short_prompt(tmp_path):
    """The short phase: its linears are GEMV entries (no table entry yet: the defaults), timed at
    a 32-token prompt of one sequence."""
    out = prepare(MODEL, "h200", out=tmp_path / "s", phases=("short",), templates=("gemv", "gemv_gated"),
                  compile=False, log=None)
    m = json.loads((out / "manifest.json").read_text())
    assert m["dims"] == {"short": [{"T": 32, "B": 1}, {"T": 16, "B": 1}]}
    assert m["entries"] and {e["template"] for e in m["entries"]} == {"gemv", "gemv_gated"}
    for e in m["entries"]:
        assert e["phase"] == "short" and e["shape_key"].startswith("short|") and e["current_tune"] == {}


def _kernel_ids(plan, kernels, phase, template):
    return {l["kernel_id"] for l, _ in launches(plan["programs"][phase]) if l["kernel"] == template}


@pytest.mark.parametrize("phase,T,B,ctx", [("decode", 1, 1, 1024), ("decode", 8, 8, 37),
                                           ("decode", 3, 3, 1), ("prefill", 1024, 1, 0),
                                           ("prefill", 100, 3, 0), ("mixed", 40, 5, 50),
                                           ("short", 32, 1, 0)])
def test_step_metadata_is_valid(phase, T, B, ctx):
    PS = 16
    a, num_pages, width = step_metadata(phase, T, B, ctx, PS, seed=3)
    bt, ss, cl, pos = a["block_tables"], a["seq_starts"], a["context_lens"], a["positions"]
    assert bt.shape == (B, width) and a["positions"].shape == (T,) and a["slot_mapping"].shape == (T,)
    assert ss.shape == (B + 1,) and ss[0] == 0 and ss[-1] == T and (np.diff(ss) >= 1).all()
    assert (a["last_rows"] == ss[1:] - 1).all()
    assert bt.min() >= 0 and bt.max() <= num_pages            # num_pages is the spare page
    used = []
    for b in range(B):
        n = -(-int(cl[b]) // PS)
        assert n <= width - 1                                  # a surplus column, like the runner
        row = bt[b, :n]
        assert (row < num_pages).all() and (bt[b, n:] == num_pages).all()
        used += list(row)
        for t in range(ss[b], ss[b + 1]):
            p = int(pos[t])
            assert p < cl[b]
            assert a["slot_mapping"][t] == bt[b, p // PS] * PS + p % PS
        assert pos[ss[b + 1] - 1] == cl[b] - 1                 # the last new token is the last key
        if phase == "decode":
            assert ss[b + 1] - ss[b] == 1
    assert sorted(used) == list(range(num_pages))              # every page owned exactly once
    assert len(set(a["slot_mapping"].tolist())) == T
    assert (a["slot_mapping"] < (num_pages + 1) * PS).all()


# --- `tune run` against a fake driver (tests/fake_cuda.py) ------------------------------------

def _fake_kernel(launch):
    """A fake 'cubin' is JSON: the kernel's time, the value it writes to every output (1.0 is
    right, anything else wrong) and its output parameters (index, bytes, dtype)."""
    spec = json.loads(launch.fn.cubin)
    for index, nbytes, dtype in spec["outs"]:
        n = nbytes // (4 if dtype == "f32" else 2)
        vals = np.full(n, spec["value"], np.float32)
        out = launch.ctx.view(launch.values[index], n, np.float32 if dtype == "f32" else np.uint16)
        out[:] = vals if dtype == "f32" else tune_run.to_bf16(vals)
    return spec["us"]


def _fake_bins(out, m, speed):
    """Write a fake cubin + info per candidate; speed(entry, index, candidate) -> (us, value)."""
    (out / "bin").mkdir(exist_ok=True)
    for e in m["entries"]:
        for i, c in enumerate(e["candidates"]):
            us, value = speed(e, i, c)
            outs = []
            for j, (_, _, src) in enumerate(c["meta"]["params"]):
                if src.startswith("out:"):
                    t = e["outputs"][int(src[4:])]
                    d = m["dims"][e["phase"]][0]
                    n = int(np.prod([d[s] if isinstance(s, str) else s for s in t["shape"]]))
                    outs.append([j, n * (4 if t["dtype"] == "f32" else 2), t["dtype"]])
            (out / "bin" / f"{c['kernel']}.cubin").write_text(json.dumps({"us": us, "value": value, "outs": outs}))
            (out / "bin" / f"{c['kernel']}.json").write_text(json.dumps(
                {"name": c["meta"]["entry"], "num_warps": 4, "shared": 0, "hidden_args": 2}))
    m["compiled"] = True
    (out / "manifest.json").write_text(json.dumps(m))


def test_run_with_a_fake_driver_picks_the_fastest_correct_candidate(prepared, tmp_path, capsys, fake_driver):
    src, m = prepared
    import shutil
    out = tmp_path / "prep"
    shutil.copytree(src, out)
    m = json.loads(json.dumps(m))
    m["entries"] = [e for e in m["entries"] if e["template"] in ("gemv", "lm_head_last")
                    and e["phase"] == "decode"]
    gemv = [e for e in m["entries"] if e["template"] == "gemv"]
    tuned, flat = gemv[0]["shape_key"], gemv[1]["shape_key"]

    def speed(e, i, c):
        if e["shape_key"] == tuned:   # 1: fastest but wrong; 2: 10 % faster; others slower
            return {0: (10.0, 1.0), 1: (5.0, 2.0), 2: (9.0, 1.0)}.get(i, (11.0, 1.0))
        if e["shape_key"] == flat:    # best is 2 % faster: within noise, default kept
            return (10.0, 1.0) if i == 0 else (9.8, 1.0) if i == 3 else (12.0, 1.0)
        if e["template"] == "lm_head_last":
            return (20.0, 1.0) if i == 0 else (15.0, 1.0) if i == 1 else (30.0, 1.0)
        return (10.0, 1.0)

    _fake_bins(out, m, speed)
    table_path = tmp_path / "h200.json"
    table_path.write_text(json.dumps({"gpu": "h200", "templates": {"gemv": {flat: {"BLOCK_N": 16}}}}))
    drv = fake_driver
    drv.on_launch = _fake_kernel
    res = tune_run.run(out, write=table_path, reps=10, warmup=2, results_dir=tmp_path / "results",
                       driver=drv)
    printed = capsys.readouterr().out
    table = json.loads(table_path.read_text())
    by_key = {e["shape_key"]: e for e in res["entries"]}
    assert table["templates"]["gemv"] == {tuned: gemv[0]["candidates"][2]["tune"]}   # flat's old entry removed
    lm = next(e for e in m["entries"] if e["template"] == "lm_head_last")
    assert table["templates"]["lm_head_last"] == {lm["shape_key"]: lm["candidates"][1]["tune"]}
    assert by_key[tuned]["default_us"] == pytest.approx(10.0) and by_key[tuned]["best_us"] == pytest.approx(9.0)
    wrong = [c for c in by_key[tuned]["candidates"] if c["kernel"] == gemv[0]["candidates"][1]["kernel"]][0]
    assert not wrong["ok"] and "rel L2" in wrong["why"]
    assert by_key[flat]["stored"] is False and by_key[flat]["best_us"] == pytest.approx(9.8)
    assert "filled by `infc tune run` on NVIDIA H200 (fake)" in table["note"]
    results = json.loads(open(res["results_path"]).read())
    assert res["results_path"].endswith("tune-qwen3-0.6b-nvidia-h200-(fake).json")
    assert results["gpu"] == "NVIDIA H200 (fake)" and results["model"] == MODEL and results["date"]
    assert "commit" in results and "L2" in results["method"]
    assert re.search(r"gemv\s+" + re.escape(tuned) + r"\s+10\.00\s+9\.00", printed), printed
    # small weights rotate through copies (together >= 3x L2): one kernel, several argument sets
    sets = {}
    for launch in drv.launches:
        sets.setdefault(launch.fn.name, set()).add(launch.values)
    assert sets["gemv"] and max(len(v) for v in sets.values()) >= 3


def test_run_binds_the_launch_caches_one_layer_per_copy(prepared, tmp_path, fake_driver):
    src, m = prepared
    import shutil
    out = tmp_path / "prep"
    shutil.copytree(src, out)
    m = json.loads(json.dumps(m))
    m["entries"] = [e for e in m["entries"] if e["template"] == "attention_decode"]
    assert m["entries"] and all(e["caches"] == ["k", "v"] for e in m["entries"])
    # the manifest's page size is the H200 build's default (its table's 64-token pages)
    assert set(m["caches"]) == {"k", "v"} and m["page_size"] == default_page_size("h200") == 64
    _fake_bins(out, m, lambda e, i, c: (10.0 + i, 1.0))
    drv = fake_driver
    drv.on_launch = _fake_kernel
    res = tune_run.run(out, write=tmp_path / "h200.json", reps=5, warmup=1, results_dir=tmp_path / "r",
                       driver=drv, log=None)
    assert all(c["ok"] for e in res["entries"] for c in e["candidates"]), res["entries"]
    c0 = m["entries"][0]["candidates"][0]["meta"]
    at = {src: i for i, (_, _, src) in enumerate(c0["params"])}
    args = [launch.values for launch in drv.launches if launch.fn.name == c0["entry"]]
    ks, vs = {a[at["cache:k"]] for a in args}, {a[at["cache:v"]] for a in args}
    # k and v are distinct regions; the copies rotate, so the timed launches stream from HBM
    assert ks and vs and not ks & vs and len(ks) == len(vs) >= 2


def test_run_refuses_another_gpu_and_an_uncompiled_manifest(prepared, tmp_path, fake_driver):
    src, m = prepared
    with pytest.raises(ValueError, match="no-compile"):
        tune_run.run(src, driver=fake_driver)
    d = tmp_path / "x"
    d.mkdir()
    (d / "manifest.json").write_text(json.dumps(dict(m, compiled=True, gpu="h100")))
    with pytest.raises(ValueError, match="--any-gpu"):
        tune_run.run(d, driver=fake_driver)


def test_cli_tune(tmp_path, capsys):
    out = tmp_path / "p"
    assert main(["tune", "prepare", "--model", MODEL, "--gpu", "h100", "--out", str(out),
                 "--phases", "decode", "--templates", "gemv,attention_decode", "--decode-batches", "1,8",
                 "--no-compile"]) == 0
    m = json.loads((out / "manifest.json").read_text())
    assert {e["template"] for e in m["entries"]} == {"gemv", "attention_decode"}
    assert m["dims"]["decode"] == [{"T": 1, "B": 1}, {"T": 8, "B": 8}]
    # with 8 rows timed too, the gemv grid varies the tensor-core path's keys as well
    g = next(e for e in m["entries"] if e["template"] == "gemv")
    assert any("BLOCK_N_DOT" in c["tune"] for c in g["candidates"])
    assert main(["tune", "prepare", "--model", MODEL, "--templates", "embedding", "--no-compile",
                 "--out", str(out)]) == 2
    assert "no candidate grid" in capsys.readouterr().err
    assert main(["tune", "run", "--dir", str(tmp_path / "none")]) == 2
    assert "no manifest.json" in capsys.readouterr().err
    # the wide program's keys, timed at the wide batches given
    assert main(["tune", "prepare", "--model", MODEL, "--gpu", "h100", "--out", str(out), "--phases", "wide",
                 "--templates", "gemv_gated", "--wide-batches", "160,256", "--no-compile"]) == 0
    m = json.loads((out / "manifest.json").read_text())
    assert m["dims"]["wide"] == [{"T": 160, "B": 160}, {"T": 256, "B": 256}]
    assert [e["shape_key"].split("|")[0] for e in m["entries"]] == ["wide"]
    for flag, bad in (("--wide-batches", "0"), ("--wide-batches", "12x"), ("--decode-batches", "")):
        assert main(["tune", "prepare", "--model", MODEL, "--no-compile", "--out", str(out), flag, bad]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {flag}: ") and "Traceback" not in err


def test_prepare_narrow_phase_tunes_the_narrow_codes_path(tmp_path):
    """The narrow phase (a decode step of one token, its own table keys) of an fp8 checkpoint: each
    quantized GEMV entry times the narrow codes path's tunables (each a kernel of its own, each
    key read by the template) beside the CUDA-core path it replaced (NARROW_DOT 0)."""
    import sys
    from infc.compiler.tune import NARROW_QUANT
    sys.path.insert(0, str(TEMPLATES.parent / "tools"))
    from quantize_model import quantize_model
    from test_device_weights import model
    model(tmp_path / "bf16", "qwen3")       # fp8 blocks with 64-column activation groups: whole groups a tile
    quantize_model(tmp_path / "bf16", tmp_path / "fp8", "fp8-block", block=(32, 64))
    out = prepare(None, "h200", out=tmp_path / "n", model_dir=str(tmp_path / "fp8"), phases=("narrow",),
                  templates=("gemv", "gemv_gated"), compile=False, log=None)
    m = json.loads((out / "manifest.json").read_text())
    assert m["dims"] == {"narrow": [{"T": 1, "B": 1}]}
    assert {e["template"] for e in m["entries"]} == {"gemv", "gemv_gated"}
    for e in m["entries"]:
        assert e["shape_key"].startswith("narrow|")
        tunes = [c["tune"] for c in e["candidates"]]
        assert {"FP8_FORM": "dot", "NDOT_STAGES": 3} in tunes, e["shape_key"]
        assert len({c["kernel"] for c in e["candidates"]}) == len(tunes)
        # the default is the narrow codes path's fma form (the e4m3 products on CUDA cores; the
        # codes are the act_codes pass's, made once a step, so no scratch of its own), the dot form
        # (e4m3 x e4m3 dots) a candidate; NARROW_DOT 0 is the CUDA-core loop, which the gated launch
        # carrying down's codes as its epilogue (merge_epilogues) cannot take
        by_tune = {json.dumps(c["tune"], sort_keys=True): (out / c["source"]).read_text() for c in e["candidates"]}
        narrow_loop = "acc += tl.dot(raw, tl.trans(ac)) * (_w_group(w_scale_ptr, srow, k0"
        assert narrow_loop in by_tune['{"FP8_FORM": "dot"}'] and "_run_sums(" in by_tune["{}"]
        if e["template"] == "gemv_gated":
            assert {"NARROW_DOT": 0} not in tunes
            assert any(s["tune"] == {"NARROW_DOT": 0} and "refuses" in s["why"] for s in e["skipped"])
        else:
            assert narrow_loop not in by_tune['{"NARROW_DOT": 0}']
    for (backend, template), grid in NARROW_QUANT.items():
        text = _template_text(backend, template)
        assert all(f'tune.get("{k}"' in text for c in grid for k in c)


def test_prepare_verify_phase_times_the_verify_rows_on_their_own_keys(tmp_path, monkeypatch, capsys):
    """The verify phase (issue 43): a speculative build's verify program of --verify-rows rows, its
    GEMVs keyed per row count over the one-row narrow entry (render.verify_key), timed at one step of
    those rows, each candidate a kernel of its own whose tunables the template reads; a table
    entry under that key changes the verify kernel and no other program's."""
    from infc.compiler.tune import VERIFY_GRIDS
    out = prepare(MODEL, "h200", out=tmp_path / "v", phases=("verify",), compile=False, log=None,
                  templates=("gemv", "gemv_gated"), verify_rows=3)
    m = json.loads((out / "manifest.json").read_text())
    assert m["dims"] == {"verify": [{"T": 3, "B": 3}]}
    assert {e["template"] for e in m["entries"]} == {"gemv", "gemv_gated"}
    for e in m["entries"]:
        assert e["phase"] == "verify" and e["shape_key"].startswith("verify|") and e["shape_key"].endswith("|r3")
        assert [k.split("|")[0] for k in e["inherits"]] == ["decode", "narrow"]
        tunes = [c["tune"] for c in e["candidates"]]
        assert tunes[0] == {} and {"FMA_T": "rows"} in tunes and len({c["kernel"] for c in e["candidates"]}) == len(tunes)
        by_tune = {json.dumps(c["tune"], sort_keys=True): (out / c["source"]).read_text() for c in e["candidates"]}
        # the default: the tensor-core path (gemv.py.j2 VERIFY_DOT); "rows": the CUDA-core rows
        assert "tl.dot(" in by_tune["{}"] and "tl.dot(" not in by_tune['{"FMA_T": "rows"}']
    for (backend, template), grid in VERIFY_GRIDS.items():
        text = _template_text(backend, template)
        assert all(f'tune.get("{k}"' in text for c in grid for k in c)
    # a verify entry renders the verify kernel alone: the narrow launch of the same linear keeps its own
    from infc.compiler.codegen.render import launch_context, render_template
    _, plan = build_mod.compile_model(MODEL, narrow_tokens=3)
    e = next(e for e in m["entries"] if e["template"] == "gemv")
    table = {"templates": {"gemv": {e["shape_key"]: {"BLOCK_N": 8, "FMA_BLOCK_K": 512}}}}

    def source(phase, tbl):
        launch = next(l for l, _ in launches(plan["programs"][phase]) if tuning_key(plan, l, phase) ==
                      e["inherits"][0] and l["kernel"] == "gemv")
        return render_template("triton", "gemv", launch_context(plan, launch, phase, tbl, 16)).source
    assert source("verify", table) != source("verify", {}) and source("narrow", table) == source("narrow", {})
    # bad rows: a clear error naming the flag
    for bad in ("1", "9"):
        assert main(["tune", "prepare", "--model", MODEL, "--no-compile", "--out", str(tmp_path / "b"),
                     "--phases", "verify", "--verify-rows", bad]) == 2
        err = capsys.readouterr().err
        assert "--verify-rows" in err and "Traceback" not in err


def test_prepare_times_the_expert_upcast_of_an_upcast_build(tmp_path, monkeypatch):
    """expert_upcast has a candidate grid (a stream whose tile the tuner picks): an upcast build's
    prefill at rows past the launch's threshold gets one manifest entry a stack shape, every
    candidate rendered (or the same kernel as one that was)."""
    import infc.config
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 512,
        "hidden_size": 96, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "num_local_experts": 4, "num_experts_per_tok": 2,
        "rms_norm_eps": 1e-5, "sliding_window": 5, "swiglu_limit": 7.0, "max_position_embeddings": 4096,
        "layer_types": ["sliding_attention", "full_attention"], "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                            "original_max_position_embeddings": 4096},
        "quantization_config": {"quant_method": "mxfp4"}}))
    monkeypatch.setattr(infc.config, "UPCAST_EXPERTS", True)
    out = prepare(model_dir=str(d), out=tmp_path / "tune", phases=("prefill",), templates=["expert_upcast"],
                  prefill_tokens=256, compile=False, log=None)
    m = json.loads((out / "manifest.json").read_text())
    entries = [e for e in m["entries"] if e["template"] == "expert_upcast"]
    assert len(entries) == 2 and len({e["shape_key"] for e in entries}) == 2     # gate|up's stack, down's
    for e in entries:          # at these widths BLOCK_K past K renders the same kernel again
        assert len(e["candidates"]) + len(e["skipped"]) == len(candidates("triton", "expert_upcast"))
        assert len(e["candidates"]) >= 4 and all(s["why"].startswith("same kernel") for s in e["skipped"])
