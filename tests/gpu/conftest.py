import pytest

import models


@pytest.fixture(scope="session")
def model_dir():
    return models.model_dir


@pytest.fixture(scope="session")
def artifact():
    return models.artifact


def pytest_configure(config):
    config.addinivalue_line("markers", "families: the new model families' golden gate (gpu_families.py)")
    config.addinivalue_line("markers", "quant: the quantized checkpoints' golden gate (session.sh quant, "
                                       "`-m quant`; models.QUANTIZED)")


def pytest_collection_modifyitems(config, items):
    """The quantized models run only when asked (`-m quant`, session.sh's quant stage): their
    artifacts come from prepare.py quant, not base, and the suite must not need them."""
    if "quant" in (config.getoption("-m") or ""):
        return
    keep = [i for i in items if i.get_closest_marker("quant") is None]
    if len(keep) < len(items):
        config.hook.pytest_deselected(items=[i for i in items if i.get_closest_marker("quant")])
        items[:] = keep
