"""The unit layer runs no model: it fails the run if anything imported ``transformers``."""

from __future__ import annotations

import sys

import pytest


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    """Fail the session when a unit test (or what it imported) loaded ``transformers``; not when the
    run also collected other layers, which load it on purpose."""
    if "transformers" not in sys.modules:
        return
    here = str(session.config.rootpath / "tests" / "unit")
    if all(str(item.path).startswith(here) for item in session.items):
        sys.stderr.write("\ntests/unit imported transformers: the unit layer must run without a model\n")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
