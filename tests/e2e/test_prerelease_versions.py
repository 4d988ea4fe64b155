"""Version ranges admit pre-releases of supported versions, whatever ``packaging`` is installed.

``packaging`` < 25 refuses ``5.25.0.dev0`` for ``>= 4.46``; OpenTelemetry's two checks then turned
the instrumentation off (``otel_generate/_versions.py`` says where they are). Here, in subprocesses
with ``packaging==24.2`` first on the path (installed with ``pip install --target``) and
transformers' and torch's installed versions faked as pre-releases (a ``dist-info`` directory
ahead of site-packages, which is what ``importlib.metadata.version()`` reads; ``transformers.__version__``
is set too):

* ``GenerateInstrumentor().instrument()`` instruments: a request span is emitted (and OpenTelemetry's
  own check, run in the same process, is shown to refuse, so the environment reproduces the bug);
* ``opentelemetry-instrument``'s loader path instruments too (its own check refuses; the
  ``opentelemetry_pre_instrument`` hook instruments) and logs no false "nothing can be instrumented";
  ``OTEL_PYTHON_DISABLED_INSTRUMENTATIONS`` still turns it off;
* a version really out of range is still refused.

The requirements pip reads (``pip install otel-generate[instruments]``) name no pre-release, so pip
keeps choosing final releases.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from tests.helpers import console_spans
from tests.unit.test_versions import TORCH_DEV

ROOT = pathlib.Path(__file__).resolve().parents[2]
INSTRUMENT = pathlib.Path(sys.executable).with_name("opentelemetry-instrument")
OLD_PACKAGING = "24.2"
TRANSFORMERS_DEV = "5.25.0.dev0"
SUBPROCESS_TIMEOUT_S = 300


# --- the rule, with whatever packaging this interpreter has -----------------------------------------


# --- packaging 24 in a subprocess ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def old_packaging(tmp_path_factory):
    target = tmp_path_factory.mktemp("packaging-24")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "--no-deps",
            "--target",
            str(target),
            f"packaging=={OLD_PACKAGING}",
        ],
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
    )
    if done.returncode != 0:
        pytest.skip(f"could not install packaging=={OLD_PACKAGING} from the package index: {done.stderr[-500:]}")
    return target


def _fake_versions(root, transformers, torch):
    """dist-info directories that make importlib.metadata report these versions (ahead of site-packages)."""
    root.mkdir(parents=True, exist_ok=True)
    for name, version in (("transformers", transformers), ("torch", torch)):
        info = root / f"{name}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n", encoding="utf-8")
    return root


def _env(*paths, **extra):
    env = {key: value for key, value in os.environ.items() if not key.startswith("OTEL_")}
    env.pop("PYTHONPATH", None)
    env.update(PYTHONPATH=os.pathsep.join(str(p) for p in paths), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **extra)
    return env


PROBE = r"""
import importlib.metadata, json, sys
import packaging
import transformers
transformers.__version__ = sys.argv[1]  # what the issue fakes; OpenTelemetry reads importlib.metadata
from opentelemetry.instrumentation.dependencies import get_dependency_conflicts
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from otel_generate import GenerateInstrumentor
from otel_generate.bench.models import build_model
from otel_generate.package import _instruments
import torch

exporter = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(exporter))
instrumentor = GenerateInstrumentor()
instrumentor.instrument(tracer_provider=provider)
ids = torch.randint(1, 126, (1, 4), generator=torch.Generator().manual_seed(0))
output = build_model("gpt2", seed=0).generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3,
                                              eos_token_id=None)
provider.force_flush()  # the spans are built on the background emitter
requests = [s for s in exporter.get_finished_spans() if s.name.startswith("text_completion ")]
print("PROBE " + json.dumps({
    "packaging": packaging.__version__,
    "transformers": importlib.metadata.version("transformers"),
    "torch": importlib.metadata.version("torch"),
    "opentelemetry_check": str(get_dependency_conflicts(list(_instruments)) or ""),
    "instrumented": instrumentor.is_instrumented_by_opentelemetry,
    "output_tokens": [s.attributes["gen_ai.usage.output_tokens"] for s in requests],
    "generated": output.shape[-1] - ids.shape[-1],
}))
"""


def _probe(tmp_path, old_packaging, transformers, torch):
    fake = _fake_versions(tmp_path / "fake", transformers, torch)
    done = subprocess.run(
        [sys.executable, "-c", PROBE, transformers],
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
        env=_env(old_packaging, fake),
        cwd=str(tmp_path),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("PROBE "))
    return json.loads(line[len("PROBE ") :]), done.stderr


def test_instrument_accepts_pre_releases_under_packaging_24(tmp_path, old_packaging):
    found, stderr = _probe(tmp_path, old_packaging, TRANSFORMERS_DEV, TORCH_DEV)
    assert (found["packaging"], found["transformers"], found["torch"]) == (OLD_PACKAGING, TRANSFORMERS_DEV, TORCH_DEV)
    # OpenTelemetry's own check refuses here: the environment reproduces the bug ...
    assert f"transformers {TRANSFORMERS_DEV}" in found["opentelemetry_check"]
    # ... and instrument() instruments anyway
    assert found["instrumented"] is True
    assert found["output_tokens"] == [found["generated"]] == [3]
    assert "nothing can be instrumented" not in stderr


def test_instrument_still_refuses_a_version_out_of_range_under_packaging_24(tmp_path, old_packaging):
    found, stderr = _probe(tmp_path, old_packaging, "4.45.2", TORCH_DEV)
    assert found["transformers"] == "4.45.2"
    assert found["instrumented"] is False and found["output_tokens"] == []
    # (the loader's words differ between releases: "only instruments ..." or "DependencyConflict: requested ...")
    assert '"transformers >= 4.46.3"' in stderr and "transformers 4.45.2" in stderr


APP = r"""
import importlib.metadata, sys
import packaging
import torch
from opentelemetry.instrumentation.dependencies import get_dist_dependency_conflicts
from otel_generate.bench.models import build_model

conflict = get_dist_dependency_conflicts(importlib.metadata.distribution("otel-generate"))
print("LOADER packaging=%s transformers=%s conflict=%s" % (
    packaging.__version__, importlib.metadata.version("transformers"), conflict))
ids = torch.randint(1, 126, (1, 4), generator=torch.Generator().manual_seed(0))
build_model("gpt2", seed=0).generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, eos_token_id=None)
"""


@pytest.mark.parametrize("disabled", [False, True], ids=["enabled", "disabled"])
def test_opentelemetry_instrument_loader_accepts_pre_releases_under_packaging_24(tmp_path, old_packaging, disabled):
    if not INSTRUMENT.exists():
        pytest.skip("opentelemetry-instrument is not installed (opentelemetry-instrumentation)")
    fake = _fake_versions(tmp_path / "fake", TRANSFORMERS_DEV, TORCH_DEV)
    app = tmp_path / "app.py"
    app.write_text(APP, encoding="utf-8")
    extra = {"OTEL_PYTHON_DISABLED_INSTRUMENTATIONS": "transformers_generate"} if disabled else {}
    env = _env(
        old_packaging,
        fake,
        OTEL_TRACES_EXPORTER="console",
        OTEL_METRICS_EXPORTER="none",
        OTEL_LOGS_EXPORTER="none",
        OTEL_SERVICE_NAME="prerelease",
        **extra,
    )
    done = subprocess.run(
        [str(INSTRUMENT), sys.executable, str(app)],
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
        env=env,
        cwd=str(tmp_path),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    loader = next(line for line in done.stdout.splitlines() if line.startswith("LOADER "))
    assert f"packaging={OLD_PACKAGING} transformers={TRANSFORMERS_DEV}" in loader
    assert f"transformers {TRANSFORMERS_DEV}" in loader  # the loader's own check refuses this environment
    requests = [s for s in console_spans(done.stdout) if s["name"].startswith("text_completion ")]
    if disabled:
        assert requests == []
    else:
        assert [r["attributes"]["gen_ai.usage.output_tokens"] for r in requests] == [3]
    assert "nothing can be instrumented" not in done.stderr
