"""``otel-generate doctor`` on the installed transformers, and the self-check's WARNING on a stand-in module.

The doctor runs as a user runs it, through the console script in a subprocess (it imports transformers,
about 8 s each); the stand-in (tests/helpers/standin.py) is a copy of a real transformers module without
one patch point, registered under the real name: no transformers file is changed.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import shutil
import socket
import subprocess
import sys

from otel_generate import GenerateInstrumentor
from tests.helpers import request_spans, step_spans
from tests.helpers.standin import WHISPER, whisper_without_need_fallback

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = shutil.which("otel-generate", path=str(pathlib.Path(sys.executable).parent))
MISSING_POINT = "`WhisperGenerationMixin._need_fallback` not found"
WHISPER_LOST = "Whisper's windows and fallbacks will not be traced"


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(extra)
    return env


def _closed_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # closed again when this returns: nothing listens there


def _doctor(*args, cwd=ROOT, env=None):
    assert SCRIPT is not None, "the otel-generate console script is not installed (pip install -e .)"
    return subprocess.run(
        [SCRIPT, "doctor", *args], capture_output=True, text=True, cwd=cwd, env=env or _env(), timeout=300
    )


def test_doctor_json_on_the_installed_transformers_exits_0_and_names_an_endpoint_down(tmp_path):
    (tmp_path / "otel_generate").mkdir()  # a clone's root seen from its parent folder: no __init__.py
    port = _closed_port()
    proc = _doctor("--json", cwd=tmp_path, env=_env(OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{port}"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    import transformers

    assert report["versions"]["transformers"] == transformers.__version__
    features = {f["name"]: f["status"] for f in report["features"]}
    assert set(features) == {
        "generate",
        "streaming",
        "assisted decoding",
        "continuous batching",
        "transformers serve",
        "Whisper",
        "pipelines",
    }
    assert set(features.values()) <= {"traced", "not in this transformers"} and features["generate"] == "traced"
    points = {p["point"]: p["status"] for p in report["patch_points"]}
    assert points["GenerationMixin.generate"] == "installed"
    # the endpoint down: said, with its address, and not a failure
    traces = [e for e in report["exporters"] if e["signal"] == "traces"]
    assert traces == [
        {
            "signal": "traces",
            "exporter": "otlp",
            "source": "default",
            "protocol": "grpc",
            "protocol_source": "default",
            "endpoint": f"http://127.0.0.1:{port}",
            "endpoint_source": "environment (OTEL_EXPORTER_OTLP_ENDPOINT)",
            "reachable": False,
            "address": f"127.0.0.1:{port}",
        }
    ]
    assert report["options"]["step_spans"] == {
        "value": "all",
        "variable": "OTEL_GENERATE_STEP_SPANS",
        "source": "default",
    }
    assert (
        "ImportError: cannot import name 'GenerateInstrumentor' from 'otel_generate' (unknown location)"
        in (report["hint"])
    )
    assert str(tmp_path / "otel_generate") in report["hint"]


def test_doctor_text_with_a_stand_in_missing_one_point_exits_1_and_names_the_feature():
    with socket.socket() as listener:  # an endpoint that accepts connections
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        code = (
            "import sys\n"
            "from tests.helpers.standin import whisper_without_need_fallback\n"
            "module = whisper_without_need_fallback()\n"
            "sys.modules[module.__name__] = module\n"
            "from otel_generate.cli import main\n"
            "sys.exit(main(['doctor']))\n"
        )
        env = _env(
            OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf",
            OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=f"http://127.0.0.1:{port}/v1/traces",
            OTEL_GENERATE_STEP_SPANS="slow",
            OTEL_GENERATE_SYNCHRONIZE="maybe",
        )
        proc = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300
        )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    out = proc.stdout
    assert "  Whisper              not traced" in out
    assert f"{WHISPER_LOST}: {MISSING_POINT}" in out
    assert out.rstrip().endswith("not traced: Whisper")
    assert "  generate             traced" in out
    assert f"reachable at 127.0.0.1:{port}" in out and "not reachable at 127.0.0.1" not in out.split("metrics")[0]
    assert "step_spans                   slow         environment (OTEL_GENERATE_STEP_SPANS)" in out
    assert "synchronize                  True         default (OTEL_GENERATE_SYNCHRONIZE='maybe' ignored)" in out
    warnings = [line for line in proc.stderr.splitlines() if MISSING_POINT in line]
    assert len(warnings) == 1 and "Traceback" not in proc.stderr, proc.stderr


def test_doctor_with_an_unknown_option_exits_2_with_its_usage():
    proc = _doctor("--frobnicate")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("usage: otel-generate doctor ")
    assert "unrecognized arguments: --frobnicate" in proc.stderr


def test_a_stand_in_missing_one_point_gives_one_warning_and_the_rest_is_traced(
    monkeypatch, caplog, gpt2, tracer_provider, meter_provider, span_exporter
):
    import importlib.metadata

    import torch

    monkeypatch.setitem(sys.modules, WHISPER, whisper_without_need_fallback())
    instrumentor = GenerateInstrumentor()
    with caplog.at_level(logging.WARNING, logger="otel_generate"):
        instrumentor.instrument(tracer_provider=tracer_provider, meter_provider=meter_provider)
        try:
            ids = torch.tensor([[1, 2, 3]])
            out = gpt2.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
        finally:
            instrumentor.uninstrument()
    version = importlib.metadata.version("transformers")
    assert [(r.getMessage(), r.exc_info) for r in caplog.records if r.levelno >= logging.WARNING] == [
        (f"otel_generate: transformers {version}: {WHISPER_LOST}: {MISSING_POINT}", None)
    ]
    (request,) = request_spans(span_exporter)  # generate() is traced as ever
    new_tokens = out.shape[1] - ids.shape[1]
    assert len(step_spans(span_exporter, request)) == new_tokens == request.attributes["gen_ai.usage.output_tokens"]
