"""Zero-code: `opentelemetry-instrument python examples/app.py` with the console exporter."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from otel_generate import attributes as A
from tests.helpers import console_spans

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_opentelemetry_instrument_prints_request_and_step_spans():
    instrument = pathlib.Path(sys.executable).with_name("opentelemetry-instrument")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(OTEL_SERVICE_NAME="auto-test", PYTHONUNBUFFERED="1")
    done = subprocess.run(
        [
            str(instrument),
            "--traces_exporter",
            "console",
            "--metrics_exporter",
            "none",
            "--logs_exporter",
            "none",
            sys.executable,
            str(ROOT / "examples" / "app.py"),
            "--new-tokens",
            "5",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=str(ROOT),
    )
    assert done.returncode == 0, done.stderr
    spans = console_spans(done.stdout)
    by_name = {}
    for span in spans:
        by_name.setdefault(span["name"], []).append(span)
    (app,) = by_name["handle_request"]
    (request,) = [s for s in spans if s["name"].startswith("text_completion ")]
    steps = by_name["prefill"] + by_name.get("decode", [])
    assert len(by_name["prefill"]) == 1 and len(by_name["decode"]) == 4
    assert request["parent_id"] == app["context"]["span_id"]
    assert {s["parent_id"] for s in steps} == {request["context"]["span_id"]}
    assert {s["context"]["trace_id"] for s in spans} == {app["context"]["trace_id"]}
    assert request["resource"]["attributes"]["service.name"] == "auto-test"
    attrs = request["attributes"]
    assert attrs[A.GEN_AI_USAGE_OUTPUT_TOKENS] == 5 and attrs[A.GENERATE_STEPS] == 5
    # the app's own printout agrees with the spans
    tokens_line = next(line for line in done.stdout.splitlines() if line.startswith("continuation tokens:"))
    assert len(json.loads(tokens_line.split(":", 1)[1])) == 5
    ttft_line = next(line for line in done.stdout.splitlines() if line.startswith("time to first token:"))
    assert float(ttft_line.split(":")[1].split()[0]) == pytest.approx(
        attrs[A.GENERATE_TIME_TO_FIRST_TOKEN] * 1e3, abs=6e-4
    )


def test_started_in_a_clones_parent_folder_the_hook_says_why_the_instrumentor_cannot_load(tmp_path):
    """opentelemetry-instrument puts the current folder first on PYTHONPATH; there a folder ``otel_generate``
    without ``__init__.py`` (a clone's root) becomes a namespace package ahead of an editable install. The
    ``opentelemetry_pre_instrument`` hook runs from the installed package all the same, and says so."""
    (tmp_path / "otel_generate").mkdir()
    instrument = pathlib.Path(sys.executable).with_name("opentelemetry-instrument")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_") and k != "PYTHONPATH"}
    env.update(OTEL_TRACES_EXPORTER="none", OTEL_METRICS_EXPORTER="none", OTEL_LOGS_EXPORTER="none")
    code = "import otel_generate; print('imported', otel_generate.__file__)"
    done = subprocess.run(
        [str(instrument), sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    hint = f"there `import otel_generate` finds {tmp_path / 'otel_generate'}, a folder without __init__.py"
    if done.stdout.strip() == "imported None":  # hidden: the editable install CI and the Quick start use
        assert "otel_generate: opentelemetry-instrument puts the current folder" in done.stderr
        assert hint in done.stderr
        assert "ImportError: cannot import name 'GenerateInstrumentor' from 'otel_generate' (unknown location)" in (
            done.stderr
        )
        assert done.stderr.index(hint) < done.stderr.index("Instrumenting of transformers_generate failed")
    else:  # a regular install is found on the path itself and is not hidden: nothing to say
        assert done.stdout.startswith("imported ") and hint not in done.stderr
