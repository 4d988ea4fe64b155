"""The session-wide tiny random-weight models and the character tokenizer, as fixtures.

tests/integration/conftest.py and tests/e2e/conftest.py import them; tests/unit does not, so the unit
layer never imports ``transformers``. Nothing is downloaded."""

from __future__ import annotations

import pytest

from otel_generate.bench.models import build_model
from tests.helpers import char_tokenizer


@pytest.fixture(scope="session")
def gpt2():
    return build_model("gpt2", seed=0)


@pytest.fixture(scope="session")
def llama():
    return build_model("llama", seed=0)


@pytest.fixture(scope="session")
def t5():
    return build_model("t5", seed=0)


@pytest.fixture(scope="session")
def tokenizer():
    return char_tokenizer()
