"""DeepSeek-V4-Flash's GPU cut (tests/gpu/gpu_families.py DSV4_CUT, session.sh's `dsv4` stage),
checked on the CPU:
- the config.json transformers writes for it binds specs/deepseek_v4.yaml at the published widths
  (hidden 4096, 64 heads of 512 with 64 rotary, q / o ranks 1024, 8 output groups, the indexer's
  64 x 128 keeping 512, window 128, compression 4 and 128, expert width 2048, 129,280 ids) with
  one layer of each attention type and both MLP types, 16 routed experts of which 6 a token;
- bench/cache_bytes.py: the caches' bytes per token against an uncompressed layout and the bytes a
  decode step reads, by hand from the cache declarations (the sliding branch's rows bounded by the
  window, the compressed sparse entries by the indexer's top-k);
- bench/active_floor.py on the cut: the experts read k of E and the shared one folded in after them (hash-routed layers too, whose
  routing launch carries no k: the table's width), one row of the hash table, and the floor's cache
  term the bytes read (cache_bytes.read_bytes), on a latency result made with bench latency's terms;
- `infc build --no-compile` of the cut (EXHAUSTIVE: it renders 88 kernels, ~8 s).
"""
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "gpu"))
import gpu_families  # noqa: E402

from infc.bench import active_floor as af  # noqa: E402
from infc.bench import cache_bytes as cb  # noqa: E402
from infc.compiler.build import compile_model  # noqa: E402

from exhaustive import EXHAUSTIVE  # noqa: E402

CUT = gpu_families.DSV4_CUT
ROW = 512 * 2                    # one shared K = V row: D bf16


@pytest.fixture(scope="module")
def cut(tmp_path_factory):
    d = gpu_families.write_config(CUT, tmp_path_factory.mktemp("dsv4cut"))
    return d, compile_model(model_dir=str(d))[1]


def test_cut_is_the_published_widths_with_every_layer_type(cut):
    _, plan = cut
    c = plan["config"]
    assert {k: c[k] for k in ("H", "Hq", "D", "Rd", "Ql", "G", "Og", "Hi", "Di", "topk", "W", "Mc", "Mh",
                              "Fe", "V", "K", "E", "N", "sinkhorn", "L")} == dict(
        H=4096, Hq=64, D=512, Rd=64, Ql=1024, G=8, Og=1024, Hi=64, Di=128, topk=512, W=128, Mc=4, Mh=128,
        Fe=2048, V=129280, K=6, E=16, N=4, sinkhorn=20, L=3)
    kinds = [k for p in plan["programs"]["prefill"] if "repeat" in p for k in p["kinds"]]
    assert sorted(kinds) == ["csa_hash", "hca_moe", "sliding_hash"]
    assert c["crope"]["rope_type"] == "yarn" and c["crope"]["factor"] == 16


def test_cache_bytes_against_an_uncompressed_layout(cut):
    _, plan = cut
    s = cb.summary(plan)
    # sliding layer: k and v; CSA layer: swa + csa (1 / 4) + ikv (128 values, 1 / 4); HCA: swa + hca (1 / 128)
    assert s["stored_bytes_per_token"] == 2 * ROW + 2 * ROW + ROW // 4 + 256 // 4 + ROW // 128 == 4424
    assert s["uncompressed_bytes_per_token"] == 3 * ROW
    assert s["compressed_entries_bytes_per_token"] == ROW / 4 + 256 / 4 + ROW / 128
    n = 32768
    want = (2 * 128 * ROW                 # k, v through the window
            + 2 * 128 * ROW               # swa of both compressed layers, through the window
            + 512 * ROW                   # csa: the indexer's top-k of n / 4
            + n // 4 * 256                # ikv: every entry scored
            + n // 128 * ROW)             # hca: every entry
    assert cb.read_bytes(plan, n) == want
    assert cb.read_bytes(plan, 100) == 2 * 100 * ROW + 2 * 100 * ROW + 25 * ROW + 25 * 256 + 100 / 128 * ROW
    assert "uncompressed" in cb.report(s) and "| csa | 4 | 1 |" in cb.report(s)


def test_active_floor_reads_k_of_e_experts_and_the_window(cut):
    _, plan = cut
    by = af.active_bytes(plan)
    H, Fe, E, K = 4096, 2048, 16, 6
    # every layer, hash-routed or not, reads k routed experts and the shared one folded in after
    # them (compiler/passes/fold_shared_experts.py)
    assert by["wes_gate_up"] == 3 * (K + 1) * (2 * Fe * H * 2)
    assert by["wes_down"] == 3 * (K + 1) * (H * Fe * 2)
    assert not any(n.startswith("ws_") for n in by)
    assert by["table"] == 2 * K * 4                              # one token's row, two hash layers
    assert by["embed"] == H * 2 and by["lm_head"] == 129280 * H * 2
    total = af.weight_bytes(plan)
    res = {"model": plan["model"], "gpu": "fake-gpu", "copy_GBps": 4000.0, "weight_bytes": total,
           "tpot_ms_by_prompt": {"1024": 1.0, "32768": 1.2}, "ttft_ms": {"1024": 30.0, "32768": 900.0},
           "floor_ms_by_prompt": {}}
    from infc.compiler.contract import caches
    decl = caches.of_plan(plan)
    for n in res["tpot_ms_by_prompt"]:          # bench/latency.py's stored-bytes floor
        res["floor_ms_by_prompt"][n] = (total + caches.token_bytes(decl) * (int(n) + 64)
                                        + 2 * caches.slot_bytes(decl)) / 4e12 * 1e3
    out = af.floor(plan, res, 128)
    act = sum(by.values())
    for n in res["tpot_ms_by_prompt"]:
        f = (act + cb.read_bytes(plan, int(n) + 64) + 2 * caches.slot_bytes(decl)) / 4e12 * 1e3
        assert out["active_floor_ms_by_prompt"][n] == pytest.approx(f, rel=1e-12)
        assert out["active_floor_ms_by_prompt"][n] < out["floor_ms_by_prompt"][n]


@EXHAUSTIVE
def test_infc_build_no_compile_of_the_cut(cut, tmp_path, capsys):
    from infc.cli import main
    d, _ = cut
    rc = main(["build", "--model-path", str(d), "--no-compile", "--out", str(tmp_path / "art")])
    assert rc in (0, None), capsys.readouterr().err
    plan = json.loads((tmp_path / "art" / "plan.json").read_text())
    assert {"csa", "ikv", "hca", "swa", "k", "v"} <= set(plan["caches"])
    assert any((tmp_path / "art" / "kernels").iterdir())
