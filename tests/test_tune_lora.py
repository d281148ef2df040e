"""`infc tune` on a LoRA build (issue 46): a narrow step's LoRA site in the GEMV's launch has its own
table key (render.lora_key) over its GEMV's, the narrow grid times the shrink's schedule (LORA_KS,
LORA_PROGRAMS, LORA_EARLY), an entry there changes the LoRA kernels and never the base model's, and
`tune run`'s steps give every row an adapter."""
import json
from types import SimpleNamespace

import pytest

from infc.compiler import build as build_mod
from infc.compiler import tuning_table
from infc.compiler.codegen.render import launch_context, render_template, tuning_keys
from infc.compiler.contract.errors import SpecError
from infc.compiler.contract.program import launches
from infc.compiler.tune import DECODE_LORA, NARROW_LORA, prepare
from infc.config import lora_build
from infc.runtime.cuda.tune_run import dump_table, merge_table, step_metadata

from test_tune import _template_text

MODEL = "qwen3-0.6b"
LORA = lora_build(2, 8)


def _narrow_ids(plan, table, template="gemv"):
    """The kernel ids the build renders for the narrow program's launches of a template."""
    return {render_template("triton", template, launch_context(plan, l, "narrow", table, 16)).id
            for l, _ in launches(plan["programs"]["narrow"]) if l["kernel"] == template}


def test_lora_sites_have_their_own_key_and_grid(tmp_path, monkeypatch):
    out = prepare(MODEL, "h200", out=tmp_path / "l", phases=("narrow",), templates=("gemv", "gemv_gated"),
                  compile=False, log=None, lora=LORA)
    m = json.loads((out / "manifest.json").read_text())
    _, plan = build_mod.compile_model(MODEL, lora=LORA)
    sites = [l for l, _ in launches(plan["programs"]["narrow"]) if l.get("lora")]
    assert len(sites) == 4                                     # q|k|v, o, gate|up, down
    by_key = {e["shape_key"]: e for e in m["entries"]}
    for l in sites:
        # the key the build lays last (a prologue's inputs out of it, as the build reads it) is
        # the entry's, and the keys before it are what its candidates overlay
        keys = tuning_keys(plan, l, "narrow")
        assert keys[-1] == f"{keys[-2]}|lora{len(l['lora']['pieces'])}x8" and keys[-2].startswith("narrow|")
        e = by_key[keys[-1]]
        assert e["inherits"] == list(keys[:-1])
        tunes = [c["tune"] for c in e["candidates"]]
        assert tunes[0] == {} and {"LORA_EARLY": 1} in tunes
        assert any(t.get("LORA_PROGRAMS") == 32 for t in tunes)
        assert len({c["kernel"] for c in e["candidates"]}) == len(tunes)
        grid = {json.dumps(c["tune"], sort_keys=True): c["meta"]["grid"][1] for c in e["candidates"]}
        # LORA_PROGRAMS: the shrink's own programs past the GEMV's blocks (by default a range each, up to 24)
        K = next(t["shape"][1] for t in e["inputs"] if t["kind"] == "weight" and len(t["shape"]) == 2)
        assert grid['{"LORA_KS": 128, "LORA_PROGRAMS": 32}'] - grid['{"LORA_KS": 128}'] == 32 - min(-(-K // 128), 24)
    for (backend, template), grid in NARROW_LORA.items():
        text = _template_text(backend, template)
        assert all(f'tune.get("{k}"' in text for c in grid for k in c)

    # an entry under a site's key renders the LoRA build's kernel anew and leaves the base model's
    e = by_key[tuning_keys(plan, sites[1], "narrow")[-1]]
    table = json.loads((build_mod.TUNING / "h200.json").read_text())
    tuned = merge_table(table, e["template"], e["shape_key"], {"LORA_KS": 64, "LORA_PROGRAMS": 5}, e["base_tune"])
    monkeypatch.setattr(tuning_table, "TUNING", tmp_path)
    (tmp_path / "h200.json").write_text(dump_table(tuned))
    loaded = build_mod.load_tuning("h200")
    _, base = build_mod.compile_model(MODEL)
    assert _narrow_ids(base, loaded) == _narrow_ids(base, table)
    assert _narrow_ids(plan, loaded) != _narrow_ids(plan, table)
    assert e["candidates"][0]["kernel"] in _narrow_ids(plan, table)
    assert e["candidates"][0]["kernel"] not in _narrow_ids(plan, loaded)


def test_a_decode_steps_sites_take_the_decode_grid(tmp_path, monkeypatch):
    """A decode step's sites in its GEMVs (infc/config.py LORA_DECODE_SITES, triton/_lora_rows.j2)
    are timed over their own schedule's grid (DECODE_LORA: no LORA_EARLY, which has no decode
    form), each candidate its own kernel."""
    import infc.config
    monkeypatch.setattr(infc.config, "LORA_DECODE_SITES", True)
    out = prepare(MODEL, "h200", out=tmp_path / "d", phases=("decode",), templates=("gemv", "gemv_gated"),
                  compile=False, log=None, lora=LORA)
    m = json.loads((out / "manifest.json").read_text())
    sites = [e for e in m["entries"] if "|lora" in e["shape_key"]]
    assert len(sites) == 4 and all(e["shape_key"].startswith("decode|") for e in sites)
    for e in sites:
        tunes = [c["tune"] for c in e["candidates"]]
        assert {"LORA_STAGES": 1} in tunes and {"LORA_STEP": 32} in tunes
        assert not any("LORA_EARLY" in t for t in tunes)
        assert len({c["kernel"] for c in e["candidates"]}) == len(tunes)
    for (backend, template), grid in DECODE_LORA.items():
        text = _template_text(backend, template)
        assert all(f'tune.get("{k}"' in text for c in grid for k in c)
    # a step wider than the sites' scratch holds is the wide program's: refused
    with pytest.raises(SpecError, match="take at most 127 rows"):
        prepare(MODEL, "h200", out=tmp_path / "w", phases=("decode",), templates=("gemv",), compile=False,
                log=None, lora=LORA, decode_batches=(128,))


def test_tune_steps_give_every_row_an_adapter():
    # the narrow phase's entries (the LoRA sites') are timed at a one-token decode step
    a, _, _ = step_metadata("narrow", 1, 1, 40, 16)
    d, _, _ = step_metadata("decode", 1, 1, 40, 16)
    assert all((a[k] == d[k]).all() for k in d)
    a, _, _ = step_metadata("decode", 3, 3, 40, 16)
    assert a["lora_slots"].tolist() == [1, 1, 1] and a["lora_slots"].dtype.name == "int32"


def test_run_times_the_lora_sites_and_stores_their_own_keys(tmp_path, fake_driver):
    """`tune run` over a LoRA build's narrow entries (the fake driver of tests/fake_cuda.py): the
    one-token steps bind lora_slots, the sites' scratch and sync words; a faster candidate is
    stored under the site's lora key, the GEMV's narrow key untouched."""
    from infc.runtime.cuda import tune_run

    from test_tune import _fake_bins, _fake_kernel
    out = prepare(MODEL, "h200", out=tmp_path / "l", phases=("narrow",), templates=("gemv",),
                  compile=False, log=None, lora=LORA)
    m = json.loads((out / "manifest.json").read_text())
    _fake_bins(out, m, lambda e, i, c: (10.0 if i == 0 else 8.0 if i == 1 else 12.0, 1.0))
    fake_driver.on_launch = _fake_kernel
    table_path = tmp_path / "h200.json"
    table_path.write_text(json.dumps({"gpu": "h200", "templates": {}}))
    res = tune_run.run(out, write=table_path, reps=5, warmup=1, results_dir=tmp_path / "r", driver=fake_driver)
    stored = json.loads(table_path.read_text())["templates"]["gemv"]
    assert sorted(stored) == sorted(e["shape_key"] for e in m["entries"]) and all("|lora" in k for k in stored)
    for e in m["entries"]:
        assert stored[e["shape_key"]] == e["candidates"][1]["tune"]
    assert all(r["stored"] for r in res["entries"])


def test_a_sites_sets_of_sync_words_may_keep_the_last_launchs_only():
    """tune run's check after timing (tune_run._Cand.counters_clear): counters zero, and of a LoRA
    site's sets of sync words (gemv.py.j2 LORA_SETS) only the last launch's set non-zero."""
    import numpy as np

    from infc.runtime.cuda.tune_run import LORA_SETS, _Cand
    words = {LORA_SETS: np.zeros(64 * 4, np.int32), "counters": np.zeros(8, np.int32)}

    class Ctx:
        def dtoh(self, raw, name):
            raw[:] = words[name].view(np.uint8)

        def sync(self):
            pass

    cand = SimpleNamespace(scratch={n: n for n in words}, scratch_bytes={n: w.nbytes for n, w in words.items()},
                           case=SimpleNamespace(ctx=Ctx()))
    assert _Cand.counters_clear(cand)
    words[LORA_SETS][4 * 5 + 1] = 3                   # the last launch's set
    assert _Cand.counters_clear(cand)
    words[LORA_SETS][4 * 9] = 1                       # and another
    assert not _Cand.counters_clear(cand)
    words[LORA_SETS][4 * 9] = 0
    words["counters"][2] = 1
    assert not _Cand.counters_clear(cand)


def test_a_candidates_launches_never_take_one_argument_set_twice_in_a_row():
    """tune run's launches of a candidate (the check launch, the warm-up, the timed graph replayed
    after itself) walk its argument sets in turn, the graph a whole number of rounds: a LoRA site's
    launches back to back are at different layers, as a program's are (gemv.py.j2 LORA_SETS)."""
    from infc.runtime.cuda.tune_run import _Cand
    order = []

    class Graph:
        def __init__(self, ctx, fn):
            start = len(order)
            fn()                                   # capture: the launches it records
            self.body = order[start:]
            del order[start:]

        def launch(self):
            order.extend(self.body)

    class Event:
        def record(self):
            pass

        def ms_since(self, other):
            return 1.0

    drv = SimpleNamespace(launch=lambda ctx, fn, grid, block, shared, args: order.append(args), Graph=Graph)
    for n_args, inner in ((2, 5), (3, 7), (2, 4)):
        cand = SimpleNamespace(drv=drv, case=SimpleNamespace(ctx=SimpleNamespace(sync=lambda: None)), fn=None,
                               grid=None, block=None, shared=0, args=list(range(n_args)), issued=0,
                               e0=Event(), e1=Event(), samples=[])
        for name in ("launch", "graph_launches", "warm", "capture", "sample"):
            setattr(cand, name, getattr(_Cand, name).__get__(cand))
        order.clear()
        cand.launch(0)
        cand.warm(3)
        cand.capture(cand.graph_launches(inner))
        cand.sample(3)
        assert len(order) == 1 + 3 + 4 * cand.graph_launches(inner)
        assert all(a != b for a, b in zip(order, order[1:])), (n_args, inner, order)
