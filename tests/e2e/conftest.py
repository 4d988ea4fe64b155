"""End-to-end tests: subprocess runs, the built wheel, auto-instrumentation, worker exit, fork, tensor
parallel under torchrun, and the real backends (Phoenix, the Collector, Jaeger, Prometheus).

Every test here is marked ``slow`` (``python -m pytest -m "not slow"`` leaves them out). Those not
marked ``slow`` in their own file also get ``e2e_short``: they need no third-party backend and run in
seconds, and CI runs them on the oldest supported transformers too (``-m "not slow or e2e_short"``),
as it did before they moved here."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.model_fixtures import gpt2, llama, t5, tokenizer  # noqa: F401  (fixtures)

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE not in item.path.parents:
            continue  # the hook sees every collected test; only this folder's are end-to-end
        if item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.e2e_short)
        item.add_marker(pytest.mark.slow)
