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
    config.addinivalue_line("markers", "mtp: MTP speculation on a DeepSeek-V3 cut (`-m mtp`, after "
                                       "tests/gpu/prepare.py mtp; test_spec_mtp_gpu.py)")


OPT_IN = ("quant", "mtp")       # markers whose tests run only when `-m` names them


def pytest_collection_modifyitems(config, items):
    """The quantized models run only when asked (`-m quant`, session.sh's quant stage): their
    artifacts come from prepare.py quant, not base, and the suite must not need them. Likewise
    MTP speculation on a DeepSeek-V3 cut (`-m mtp`: prepare.py mtp, test_spec_mtp_gpu.py)."""
    asked = config.getoption("-m") or ""
    drop = [i for i in items if any(i.get_closest_marker(k) is not None and k not in asked for k in OPT_IN)]
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = [i for i in items if i not in drop]
