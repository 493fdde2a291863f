"""Fixtures the test modules share; shared helpers live in elastic_oneshot/testing (runs.py, tiny.py, ...)."""

import pytest

from elastic_oneshot.testing.tiny import make_model


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    return make_model(str(tmp_path_factory.mktemp("models") / "llama"), "llama")


