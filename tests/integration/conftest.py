"""The tiny-model fixtures for the tests that run a model in this process (one file per producer), and
the two emission modes every test that turns the instrumentation on runs in.

``instrumented`` and ``instrument`` are parametrized here: each test runs with background emission (the
default: spans, metrics and the content event built on the emitter's thread after ``generate()``
returns) and with ``background_emission=False`` (built on the calling thread before it returns). A test
that passes ``background_emission`` itself, or sets ``OTEL_GENERATE_BACKGROUND_EMISSION``, keeps its
own. What a test reads, it reads after a flush of the provider it reads from, as the docs tell users to
(tests/helpers/instrumenting.py: ``DrainingSpanExporter``, ``DrainingMetricReader``)."""

import os

import pytest

from otel_generate import GenerateInstrumentor
from tests.helpers.model_fixtures import gpt2, llama, t5, tokenizer  # noqa: F401  (fixtures)

MODES = {"background": True, "foreground": False}


@pytest.fixture(params=list(MODES))
def emission(request):
    """``"background"`` or ``"foreground"``: the emission mode of the test's instrumentation."""
    return request.param


def _with_mode(options, emission):
    if "background_emission" not in options and "OTEL_GENERATE_BACKGROUND_EMISSION" not in os.environ:
        options = dict(options, background_emission=MODES[emission])
    return options


@pytest.fixture
def instrumented(tracer_provider, meter_provider, emission):
    """Instrument in setup (in the test's emission mode), uninstrument in teardown (also on failure)."""
    instrumentor = GenerateInstrumentor()
    instrumentor.instrument(
        **_with_mode({"tracer_provider": tracer_provider, "meter_provider": meter_provider}, emission)
    )
    yield instrumentor
    instrumentor.uninstrument()


@pytest.fixture
def instrument(emission):
    """``instrument(**options)`` in the test's emission mode unless the options name one; uninstrumented
    at teardown."""
    instrumentor = GenerateInstrumentor()

    def start(**options):
        instrumentor.instrument(**_with_mode(options, emission))
        return instrumentor

    yield start
    if instrumentor.is_instrumented_by_opentelemetry:
        instrumentor.uninstrument()
