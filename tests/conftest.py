"""Shared fixtures: tiny random HF models written by transformers itself, so the checkpoint
names and config.json are exactly what HF produces; norms are randomized (HF inits them to 1,
which would hide a missing or misplaced norm weight)."""
import os
import sys
from pathlib import Path

# Bytecode: where PYTHONDONTWRITEBYTECODE is set (this machine sets it, and `make` installs with
# --no-compile), every process of the suite -- both xdist workers, each `infc serve`, rank and
# compile worker -- compiled torch, transformers, numpy and infc from source at each import (~5
# CPU-s in a process that imports torch, ~1 s in a server's). The suite keeps their bytecode
# under .cache/pycache (ignored; nothing written beside any source), for this process and its
# children (the xdist workers start after this file is read).
if sys.dont_write_bytecode:
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    os.environ.setdefault("PYTHONPYCACHEPREFIX",
                          str(Path(__file__).resolve().parent.parent / ".cache" / "pycache"))
    sys.dont_write_bytecode = False
    sys.pycache_prefix = os.environ["PYTHONPYCACHEPREFIX"]

# Kernels run under Triton's interpreter in this process; AOT compiles happen in subprocesses
# that clear this variable before importing triton.
# Under xdist every core runs a worker: one BLAS / OpenMP thread each, or their spinning threads
# fight over the cores (15 % of the CPU time of an interpreted model run, measured).
if os.environ.get("PYTEST_XDIST_WORKER"):
    for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(_var, "1")
os.environ["TRITON_INTERPRET"] = "1"
# A tokenizer's load keeps its derived facts (runtime/tokenization/facts.py) keyed by its files'
# paths: the suite's tokenizers live in temporary folders, so their facts go to one of the run's
# own (its xdist workers and servers inherit it) instead of piling up under .cache.
if "INFC_TOKENIZER_CACHE" not in os.environ:
    import tempfile
    os.environ["INFC_TOKENIZER_CACHE"] = tempfile.mkdtemp(prefix="infc-tokenizer-facts-")
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import interp_speed  # noqa: E402  (tests/ is on sys.path: rootdir conftest)

interp_speed.install()


def _tiny(family: str, **over):
    import torch
    from transformers import (LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM,
                              Qwen3MoeConfig, Qwen3MoeForCausalLM)
    common = dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  vocab_size=320, max_position_embeddings=1024, rms_norm_eps=1e-6)
    common.update({k: v for k, v in over.items() if k in common})
    if family == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(**common, head_dim=over.get("head_dim", 24),
                                            intermediate_size=over.get("intermediate_size", 96),
                                            tie_word_embeddings=True, rope_theta=10000.0))
    if family == "llama":
        return LlamaForCausalLM(LlamaConfig(
            **common, intermediate_size=112, tie_word_embeddings=False, rope_theta=500000.0,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}))
    if family == "qwen3_moe":
        return Qwen3MoeForCausalLM(Qwen3MoeConfig(**common, head_dim=16, intermediate_size=96,
                                                  moe_intermediate_size=over.get("moe_intermediate_size", 40), num_experts=8,
                                                  num_experts_per_tok=3, norm_topk_prob=True,
                                                  tie_word_embeddings=False, rope_theta=10000.0,
                                                  mlp_only_layers=over.get("mlp_only_layers", []),
                                                  decoder_sparse_step=over.get("decoder_sparse_step", 1)))
    raise ValueError(family)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """family -> (model directory, HF float32 model)."""
    import torch
    cache = {}

    def get(family: str, **over):
        key = (family, repr(sorted(over.items())))
        if key not in cache:
            torch.manual_seed(1234)
            m = _tiny(family, **over).float().eval()
            with torch.no_grad():
                for name, p in m.named_parameters():
                    if "norm" in name:
                        p.copy_(1 + 0.2 * torch.randn_like(p))
            d = tmp_path_factory.mktemp(f"tiny-{family}")
            m.save_pretrained(d)
            cache[key] = (d, m)
        return cache[key]

    return get


@pytest.fixture(scope="session")
def fp8_pair(tmp_path_factory):
    """(a tiny random qwen3 directory (tests/test_device_weights.py's), the same quantized as fp8
    blocks of 16 x 48 by tools/quantize_model.py)."""
    from quantize_model import quantize_model
    from test_device_weights import model
    src, out = tmp_path_factory.mktemp("bf16"), tmp_path_factory.mktemp("fp8")
    model(src, "qwen3")
    quantize_model(src, out, "fp8-block", block=(16, 48))
    return src, out


@pytest.fixture(scope="session")
def family_model(tmp_path_factory):
    """family -> (model directory, HF float32 model): tests/families.py's tiny random models of
    the spec families, norms and biases randomized."""
    from families import make
    cache = {}

    def get(family: str):
        if family not in cache:
            d = tmp_path_factory.mktemp(f"family-{family}")
            cache[family] = (d, make(family, d))
        return cache[family]

    return get


@pytest.fixture
def rng():
    return np.random.default_rng(0)


@pytest.fixture
def fake_driver(monkeypatch):
    """tests/fake_cuda.py's FakeDriver installed as infc.runtime.cuda.driver for one test (no GPU,
    no cuda-python needed); import infc.runtime.cuda.runner & co. inside the test."""
    import fake_cuda
    with fake_cuda.cuda_modules():
        yield fake_cuda.install(monkeypatch)


def pytest_addoption(parser):
    parser.addoption("--exhaustive", action="store_true",
                     help="also run the cases marked exhaustive (tests/exhaustive.py): `make test-all`")


WORKER_GROUPS = (("test_server", "server"), ("test_backends", "backend_compiles"))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Without --exhaustive, the cases marked exhaustive are deselected (and counted as such), and
    so are the server tests on a model other than the default that are not backend_specific
    (tests/test_server_support.per_model_srv). Under `pytest -n` (--dist loadgroup, pyproject's
    addopts) a group's tests share one worker: the server modules (one loaded backend per model
    and process) and test_backends (one compile of its cubins into .cache/backend_tests/)."""
    for item in items:
        group = next((g for prefix, g in WORKER_GROUPS if item.path.name.startswith(prefix)), None)
        if group:
            item.add_marker(pytest.mark.xdist_group(group))
    if config.getoption("--exhaustive"):
        return
    keep, drop = [], []
    for item in items:
        (drop if _exhaustive(item) else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def _exhaustive(item) -> bool:
    if item.get_closest_marker("exhaustive"):
        return True
    return bool(item.get_closest_marker("other_server_model")) and not item.get_closest_marker("backend_specific")
