"""``otel-generate doctor`` on good and broken set-ups, and the self-check's WARNING on a stand-in module.

The doctor runs as a user runs it, in a subprocess (it imports transformers, about 8 s each), once per
set-up, each broken in one way only, so that each problem alone is shown to fail it:

* the endpoint: an OTLP endpoint on a closed local port (nothing listens there), against one where
  a socket of this test listens;
* an option: an environment variable with a value that cannot be parsed;
* a patch point: a stand-in (tests/helpers/standin.py), a copy of a real transformers module without
  one patch point, registered under the real name: no transformers file is changed;
* transformers missing, and transformers older than the supported floor: real environments, not a
  hidden import. Each is a scratch venv of this Python (``python -m venv --without-pip``, a second)
  whose site-packages holds a symbolic link to every entry of this venv's site-packages but the
  distributions left out: there ``import transformers`` fails and ``importlib.metadata`` finds no
  transformers, exactly as in an environment where it was never installed. For the old release,
  ``pip install --no-deps --target`` puts transformers 4.45.2 (the last release of the minor below
  the floor) with the tokenizers and huggingface-hub releases it requires (``import transformers``
  4.45.2 checks them) in a folder of their own, linked in instead of this venv's: a working
  transformers 4.45.2 as pip installs it, about 10 s to download and unpack (pip caches the wheels).
  Nothing is installed into, or removed from, this venv: pip never sees the scratch site-packages.
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
import sysconfig

import pytest

from otel_generate import GenerateInstrumentor
from otel_generate import options as _options
from tests.helpers import request_spans, step_spans
from tests.helpers.standin import WHISPER, whisper_without_need_fallback

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = shutil.which("otel-generate", path=str(pathlib.Path(sys.executable).parent))
MISSING_POINT = "`WhisperGenerationMixin._need_fallback` not found"
WHISPER_LOST = "Whisper's windows and fallbacks will not be traced"
FLOOR = "transformers >= 4.46.3"
#: A release below the floor, with the releases of the libraries it checks when imported.
OLD_TRANSFORMERS = ("transformers==4.45.2", "tokenizers==0.20.3", "huggingface-hub>=0.23.2,<1.0")


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env.update(extra)
    return env


def _closed_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # closed again when this returns: nothing listens there


@pytest.fixture
def collector():
    """An endpoint that accepts connections: ``OTEL_EXPORTER_OTLP_ENDPOINT`` (every signal) and its port."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        yield {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}"}, port


def _doctor(*args, cwd=ROOT, env=None, python=None):
    if python is None:
        assert SCRIPT is not None, "the otel-generate console script is not installed (pip install -e .)"
        command = [SCRIPT, "doctor", *args]
    else:
        command = [python, "-m", "otel_generate", "doctor", *args]
    return subprocess.run(command, capture_output=True, text=True, cwd=cwd, env=env or _env(), timeout=300)


def _last_line(proc):
    return proc.stdout.rstrip().splitlines()[-1]


def _problems(proc):
    """The text report's problem lines, without their indent."""
    lines = proc.stdout.splitlines()
    if "problems" not in lines:
        return []
    start = lines.index("problems") + 1
    return [line.strip() for line in lines[start : lines.index("", start)]]


def test_doctor_on_a_good_set_up_exits_0_lists_every_option_and_the_hint(tmp_path, collector):
    (tmp_path / "otel_generate").mkdir()  # a clone's root seen from its parent folder: no __init__.py
    endpoint, port = collector
    # as an editable install is found: this package loaded, and its folder not on sys.path (on it, a
    # regular package would be found before the clone's folder, and there would be nothing to hint)
    code = (
        f"import sys\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        f"from otel_generate.cli import main\n"
        f"sys.path.remove({str(ROOT)!r})\n"
        f"sys.exit(main(['doctor', '--json']))\n"
    )
    env = {k: v for k, v in _env(**endpoint).items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    import transformers

    assert report["versions"]["transformers"] == transformers.__version__
    assert report["problems"] == [] and report["exit_status"] == 0
    assert report["verdict"] == (
        f"OK: no problem (transformers {transformers.__version__} supported, every feature it has traced,"
        " 1 endpoint reachable, options valid)"
    )
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
    assert [(e["signal"], e["reachable"], e["address"]) for e in report["exporters"]] == [
        (signal, True, f"127.0.0.1:{port}") for signal in ("traces", "metrics", "logs")
    ]
    # every option: the three providers under "providers", every other one under "options"
    assert set(report["providers"]) == {"tracer", "meter", "logger"}
    assert set(report["options"]) | {"tracer_provider", "meter_provider", "logger_provider"} == set(_options.NAMES)
    assert report["options"]["measure_energy"] == {
        "value": True,
        "variable": "OTEL_GENERATE_MEASURE_ENERGY",
        "source": "default",
    }
    # the hint is for Python started in this folder; the doctor itself loaded the package: not a problem
    assert (
        "ImportError: cannot import name 'GenerateInstrumentor' from 'otel_generate' (unknown location)"
        in (report["hint"])
    )
    assert str(tmp_path / "otel_generate") in report["hint"]


def test_doctor_with_the_endpoint_unreachable_exits_1_and_names_it():
    port = _closed_port()
    proc = _doctor(env=_env(OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{port}"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert _problems(proc) == [
        f"endpoint: the traces, metrics and logs endpoint http://127.0.0.1:{port}"
        f" (environment (OTEL_EXPORTER_OTLP_ENDPOINT)) is not reachable:"
        f" no TCP connection to 127.0.0.1:{port} within 1 s"
    ]
    assert f"not reachable at 127.0.0.1:{port}" in proc.stdout
    assert _last_line(proc) == "FAIL: 1 problem (endpoint)"


def test_doctor_with_an_invalid_option_value_exits_1_and_names_it(collector):
    endpoint, _ = collector
    proc = _doctor("--json", env=_env(OTEL_GENERATE_MEASURE_ENERGY="maybe", **endpoint))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    problem = "OTEL_GENERATE_MEASURE_ENERGY='maybe' is not true or false; using the default true"
    assert report["problems"] == [{"kind": "option", "problem": problem}]
    assert report["options"]["measure_energy"] == {
        "value": True,
        "variable": "OTEL_GENERATE_MEASURE_ENERGY",
        "source": "default",
        "ignored": "maybe",
        "problem": problem,
    }
    assert report["verdict"] == "FAIL: 1 problem (option)" and report["exit_status"] == 1


def test_doctor_with_a_stand_in_missing_one_point_exits_1_and_names_the_feature(collector):
    endpoint, port = collector
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
        **endpoint,
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    out = proc.stdout
    assert "  Whisper              not traced" in out
    assert f"{WHISPER_LOST}: {MISSING_POINT}" in out
    assert "  generate             traced" in out
    assert _problems(proc) == [f"feature: Whisper not traced ({WHISPER_LOST}): {MISSING_POINT}"]
    assert _last_line(proc) == "FAIL: 1 problem (feature)"
    assert f"http/protobuf http://127.0.0.1:{port}/v1/traces (environment (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT))" in out
    assert f"http/protobuf http://127.0.0.1:{port}/v1/metrics (environment (OTEL_EXPORTER_OTLP_ENDPOINT))" in out
    assert "not reachable" not in out
    assert "step_spans                   slow         environment (OTEL_GENERATE_STEP_SPANS)" in out
    warnings = [line for line in proc.stderr.splitlines() if MISSING_POINT in line]
    assert len(warnings) == 1 and "Traceback" not in proc.stderr, proc.stderr


def _site_packages(python):
    out = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True,
        text=True,
        check=True,
    )
    return pathlib.Path(out.stdout.strip())


def _distribution_entries(folder, names):
    """The entries of ``folder`` that belong to the distributions ``names`` (import name, dist-info)."""
    found = set()
    for entry in folder.iterdir():
        stem = entry.name.split("-")[0].lower() if entry.name.endswith(".dist-info") else entry.name.lower()
        if stem in names:
            found.add(entry.name)
    return found


def _scratch_venv(where, leave_out, add_from=None):
    """A venv of this Python whose site-packages links every entry of this venv's but those of the
    distributions ``leave_out`` (import names), and every entry of ``add_from``; its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True, timeout=120)
    python = str(where / "bin" / "python")
    target = _site_packages(python)
    sources = {pathlib.Path(sysconfig.get_path(key)) for key in ("purelib", "platlib")}
    for source in sources:
        skip = _distribution_entries(source, leave_out)
        for entry in source.iterdir():
            if entry.name not in skip and not (target / entry.name).exists():
                (target / entry.name).symlink_to(entry)
    for entry in add_from.iterdir() if add_from else ():
        if entry.name != "bin":
            (target / entry.name).symlink_to(entry)
    return python


def test_doctor_without_transformers_exits_1_and_says_it_is_not_installed(tmp_path):
    python = _scratch_venv(tmp_path / "venv", leave_out={"transformers"})
    check = subprocess.run([python, "-c", "import transformers"], capture_output=True, text=True)
    assert "No module named 'transformers'" in check.stderr
    proc = _doctor(
        "--json",
        python=python,
        env=_env(OTEL_TRACES_EXPORTER="none", OTEL_METRICS_EXPORTER="none", OTEL_LOGS_EXPORTER="none"),
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report["versions"]["transformers"] is None and report["transformers"] is None
    assert report["problems"] == [
        {"kind": "dependency", "problem": f"transformers is not installed: this instrumentation needs {FLOOR}"}
    ]
    assert {f["status"] for f in report["features"]} == {"not in this transformers"}
    assert report["instrumentation"]["version_check"] == "refused"
    assert report["verdict"] == "FAIL: 1 problem (dependency)"


def test_doctor_with_transformers_older_than_the_floor_exits_1_and_names_the_range(tmp_path):
    old = tmp_path / "old"
    pip = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(old), *OLD_TRANSFORMERS],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert pip.returncode == 0, f"pip could not install {OLD_TRANSFORMERS}: {pip.stderr[-2000:]}"
    python = _scratch_venv(tmp_path / "venv", leave_out={"transformers", "tokenizers", "huggingface_hub"}, add_from=old)
    check = subprocess.run(
        [python, "-c", "import transformers.generation.utils, transformers; print(transformers.__version__)"],
        capture_output=True,
        text=True,
    )
    assert check.stdout.strip() == "4.45.2", check.stderr  # a working transformers 4.45.2
    proc = _doctor(
        python=python, env=_env(OTEL_TRACES_EXPORTER="console", OTEL_METRICS_EXPORTER="none", OTEL_LOGS_EXPORTER="none")
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "  transformers         4.45.2" in proc.stdout
    assert "version check: refused (see problems)" in proc.stdout
    assert _problems(proc) == [
        f"dependency: transformers 4.45.2 is outside the supported range ({FLOOR}): instrument() refuses to run"
        " and traces nothing (opentelemetry-instrument skips this instrumentation)"
    ]
    assert _last_line(proc) == "FAIL: 1 problem (dependency)"


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
