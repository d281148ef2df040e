import pytest

import models


@pytest.fixture(scope="session")
def model_dir():
    return models.model_dir


@pytest.fixture(scope="session")
def artifact():
    return models.artifact
