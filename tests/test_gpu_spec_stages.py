"""The GPU speculation cases' parts that run here (tests/gpu/prepare.py mtp and eagle3, for
tests/gpu/test_spec_mtp_gpu.py and test_spec_gpu.py): the config-only directories, and the
artifacts prepare builds are the very ones infc/backend.py asks for on cuda (names and build
arguments), so the GPU machine reuses them rather than compiling."""
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "tests" / "gpu")]
import prepare  # noqa: E402


def test_prepare_mtp_builds_what_the_backend_asks_for(tmp_path, monkeypatch):
    from infc import backend
    from infc.config import EngineConfig
    from infc.backend import cuda_mtp_artifact
    prepared = {}

    def one_table(what, out, model_dir, **kw):       # its arguments, not a build: the names are the point
        prepared[Path(out)] = dict(kw, model_dir=model_dir)
        Path(out).mkdir(parents=True)
        (Path(out) / "plan.json").write_text(json.dumps({"build": {"page_size": 16}}))
    monkeypatch.setattr(prepare, "GPU_CACHE", tmp_path / "gpu")
    monkeypatch.setattr(backend, "SERVED_ARTIFACTS", tmp_path / "artifacts")
    monkeypatch.setattr(prepare, "_both_tunings", one_table)
    prepare.mtp()
    d = tmp_path / "gpu" / "configs" / prepare.MTP_CUT
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 1 and cfg["model_type"] == "deepseek_v3"

    asked = {}

    def record(st, what, kw, log=None, before_build=None):
        asked[Path(kw["out"])] = kw
        return Path(kw["out"])
    monkeypatch.setattr(backend, "built_or_reused", record)
    spec = {"method": "mtp", "num_speculative_tokens": prepare.MTP_K}
    st = backend._Stages(None)
    for s in (None, spec):                          # LLM(d, device="cuda", load_format="dummy"[, spec])
        c = backend.resolve(EngineConfig.from_settings(device="cuda", load_format="dummy", speculative_config=s))
        capture = backend.mtp_layers(c, d, None) if s else None
        art = backend.served_artifact(st, c, d, None, True, backend.DEFAULT_KV_CACHE_DTYPE, None, None, capture)
        if s:
            assert capture == [cfg["num_hidden_layers"]]
            cuda_mtp_artifact(st, c, None, d, art)
    assert set(asked) == set(prepared) and len(asked) == 3
    for out, kw in asked.items():                   # the build's own arguments: the same plan
        mine = prepared[out]
        assert [kw.get("capture"), kw.get("section"), kw.get("narrow_tokens") or 1] == \
            [mine.get("capture"), mine.get("section"), mine.get("narrow_tokens") or 1], out
        assert Path(kw["model_dir"]) == Path(mine["model_dir"])
    assert asked[tmp_path / "artifacts" / (prepare.MTP_CUT + "-mtp")]["section"] == "mtp"


def test_prepare_eagle3_builds_what_the_backend_asks_for(tmp_path, monkeypatch):
    """prepare.py eagle3: the target's hidden-state build and the head's are the names (and the
    narrow width) infc/backend.py asks for on cuda with k = 4 (prepare spelled the verify program's
    5 rows, which the backend builds only under INFC_VERIFY_PROGRAM=1)."""
    from infc import backend
    from infc.config import EngineConfig
    prepared = {}

    def one_table(what, out, model_dir, **kw):
        prepared[Path(out)] = dict(kw, model_dir=model_dir)
        Path(out).mkdir(parents=True)
        (Path(out) / "plan.json").write_text(json.dumps({"build": {"page_size": 16}}))
    monkeypatch.setattr(prepare, "GPU_CACHE", tmp_path / "gpu")
    monkeypatch.setattr(backend, "SERVED_ARTIFACTS", tmp_path / "artifacts")
    monkeypatch.setattr(prepare, "_both_tunings", one_table)
    monkeypatch.setattr("infc.compiler.build.REPO", tmp_path)
    prepare.eagle3()
    asked = {}

    def record(st, what, kw, log=None, before_build=None):
        asked[Path(kw["out"])] = kw
        Path(kw["out"]).mkdir(parents=True, exist_ok=True)
        (Path(kw["out"]) / "plan.json").write_text(json.dumps({"build": {"page_size": 16}}))
        return Path(kw["out"])
    monkeypatch.setattr(backend, "built_or_reused", record)
    head = tmp_path / "gpu" / "configs" / prepare.EAGLE3_HEAD
    target = prepare.served_config("qwen3-4b")
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 4}
    c = backend.resolve(EngineConfig.from_settings(device="cuda", load_format="dummy", speculative_config=spec))
    st = backend._Stages(None)
    capture = backend.eagle3_layers(c.speculative.speculative_config, target)
    art = backend.served_artifact(st, c, target, None, True, backend.DEFAULT_KV_CACHE_DTYPE, None, None, capture)
    backend._cuda_head_artifact(st, c, art)
    assert {p.name for p in asked} == {p.name for p in prepared}, (sorted(asked), sorted(prepared))
    for out, kw in asked.items():
        mine = next(v for p, v in prepared.items() if p.name == out.name)
        assert (kw.get("narrow_tokens") or 1) == (mine.get("narrow_tokens") or 1), out
