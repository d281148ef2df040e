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
