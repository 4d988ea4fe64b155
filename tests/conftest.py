"""Fixtures every layer shares: an in-memory span exporter and metric reader, and the instrumentor set up
and torn down. Nothing here imports ``transformers`` or ``torch`` (tests/unit must run without them); the
tiny-model fixtures are in tests/helpers/model_fixtures.py, which tests/integration and tests/e2e use."""

from __future__ import annotations

import sys

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

import otel_generate.emit
import otel_generate.energy
import otel_generate.instrumentor
import otel_generate.options
from otel_generate import GenerateInstrumentor
from tests.helpers.instrumenting import DrainingMetricReader, DrainingSpanExporter, drain_emitter  # noqa: F401


@pytest.fixture(autouse=True)
def no_real_nvml(request, monkeypatch):
    """No test but a ``gpu`` one reads the machine's own NVML: a test that shows the instrumentation a
    fake ``cuda:0`` would otherwise reach it (where ``nvidia-ml-py`` is installed), whatever this
    machine has. Tests of energy install a fake NVML (tests/helpers/fake_cuda.py)."""
    if request.node.get_closest_marker("gpu") is not None:
        return
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError: NVML not installed
    monkeypatch.setattr(otel_generate.energy, "_nvml", otel_generate.energy._UNTRIED)
    monkeypatch.setattr(otel_generate.energy, "_meters", {})


@pytest.fixture
def span_exporter():
    return DrainingSpanExporter()


@pytest.fixture
def tracer_provider(span_exporter):
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(span_exporter))
    span_exporter.provider = provider  # its reads flush the provider first, as an application's do
    return provider


@pytest.fixture
def metric_reader():
    return DrainingMetricReader()


@pytest.fixture
def meter_provider(metric_reader):
    provider = MeterProvider(metric_readers=[metric_reader])
    metric_reader.provider = provider  # its reads flush the provider first, as an application's do
    return provider


@pytest.fixture
def instrumented(tracer_provider, meter_provider):
    """Instrument in setup, uninstrument in teardown (also when the test failed)."""
    instrumentor = GenerateInstrumentor()
    instrumentor.instrument(tracer_provider=tracer_provider, meter_provider=meter_provider)
    yield instrumentor
    instrumentor.uninstrument()


@pytest.fixture
def instrument():
    """``instrument(**options)`` with any options, returning the instrumentor; uninstrumented at teardown."""
    instrumentor = GenerateInstrumentor()

    def start(**options):
        instrumentor.instrument(**options)
        return instrumentor

    yield start
    if instrumentor.is_instrumented_by_opentelemetry:
        instrumentor.uninstrument()


@pytest.fixture
def count_recorders(monkeypatch):
    """Count StepRecorder constructions ("init") and step hook calls ("call": the recording criteria
    list's calls, which record a step themselves or through their recorder)."""
    calls = {"init": 0, "call": 0}
    from otel_generate.integrations import step_hook as _recorder

    init, call = _recorder.StepRecorder.__init__, _recorder.RecordingCriteriaList.__call__

    def counting_init(self, *a, **k):
        calls["init"] += 1
        init(self, *a, **k)

    def counting_call(self, *a, **k):
        calls["call"] += 1
        return call(self, *a, **k)

    monkeypatch.setattr(_recorder.StepRecorder, "__init__", counting_init)
    monkeypatch.setattr(_recorder.RecordingCriteriaList, "__call__", counting_call)
    return calls


@pytest.fixture
def no_package_env(monkeypatch):
    monkeypatch.setattr(otel_generate.options, "_warned_env", {})  # each test sees its own first warning
    for name in (
        "OTEL_GENERATE_SYNCHRONIZE",
        "OTEL_GENERATE_MAX_STEP_SPANS",
        "OTEL_BSP_MAX_QUEUE_SIZE",
        "OTEL_BSP_MAX_EXPORT_BATCH_SIZE",
        "OTEL_ATTRIBUTE_COUNT_LIMIT",
        "OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT",
        "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT",
        "OTEL_SPAN_ATTRIBUTE_VALUE_LENGTH_LIMIT",
    ):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def captured_telemetry(monkeypatch):
    """The options instrument() actually used (the Telemetry object it built)."""
    built = []

    class Recording(otel_generate.telemetry.Telemetry):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self)

    monkeypatch.setattr(otel_generate.instrumentor, "Telemetry", Recording)
    return built
