"""load_backend(artifact=...): a built artifact run as it is (bench throughput --artifact, for A/B
runs of two commits' plans). What it refuses, before any GPU is touched."""
import pytest

from infc.backend import load_backend


def test_artifact_is_for_one_gpu(tmp_path):
    with pytest.raises(ValueError, match="one GPU"):
        load_backend(tmp_path, device="cpu", artifact=tmp_path, log=None)
    with pytest.raises(ValueError, match="one GPU"):
        load_backend(tmp_path, device="cuda", artifact=tmp_path, log=None, tensor_parallel_size=2)


def test_artifact_without_a_plan_is_named(tmp_path):
    art = tmp_path / "not-built"
    art.mkdir()
    with pytest.raises(ValueError, match=r"not-built: no plan.json"):
        load_backend(tmp_path, device="cuda", artifact=art, log=None)


def test_bench_throughput_passes_its_artifact_through(tmp_path):
    from infc.bench.throughput import main
    art = tmp_path / "half-built"
    art.mkdir()
    with pytest.raises(ValueError, match=r"half-built: no plan.json"):
        main(["--model-path", str(tmp_path), "--artifact", str(art), "--concurrency", "1"])
