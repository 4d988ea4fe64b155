"""Which span processors the fast step-span path serves, decided without a model."""

from __future__ import annotations

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from otel_generate.fast_spans import FastStepSpans


def test_batch_processor_is_eligible_and_sdk_self_metrics_are_not():
    provider = provider_with(BatchSpanProcessor(InMemorySpanExporter()))
    tracer = provider.get_tracer("t")
    assert FastStepSpans.for_tracer(tracer) is not None

    class Counting:  # stands for the SDK's self-observability metrics, which the fast path would skip
        def start_span(self, *args):
            return lambda: None

    tracer._tracer_metrics = Counting()
    assert FastStepSpans.for_tracer(tracer) is None
    provider.shutdown()


def provider_with(*processors, **kwargs):
    provider = TracerProvider(**kwargs)
    for processor in processors:
        provider.add_span_processor(processor)
    return provider


# --- the request span's attributes (set_request_attributes) -------------------------------------

REQUEST_ATTRIBUTES = {
    "gen_ai.usage.output_tokens": 128,
    "gen_ai.response.finish_reasons": ["length", "stop"],
    "generate.synchronized": False,
    "generate.step.latencies": [0.004, 0.0041],
    "generate.time_to_first_token": 0.0123,
    "gen_ai.request.model": "a-much-longer-model-name",
    "generate.steps": 129,
}


def _two_spans(**limits):
    from opentelemetry.sdk.trace import SpanLimits

    tracer = TracerProvider(span_limits=SpanLimits(**limits)).get_tracer("t")
    start = {"gen_ai.request.model": "m", "gen_ai.operation.name": "text_completion"}
    return tracer.start_span("public", attributes=start), tracer.start_span("fast", attributes=start)


def _state(span):
    held = span._attributes
    return list(held.items()), held.dropped


def test_request_attributes_end_as_set_attributes_leaves_them():
    from otel_generate.fast_spans import set_request_attributes

    public, fast = _two_spans()
    public.set_attributes(REQUEST_ATTRIBUTES)
    assert set_request_attributes(fast, REQUEST_ATTRIBUTES)  # taken: the installed SDK's code is the one known
    assert _state(fast) == _state(public)
    assert dict(fast.attributes)["gen_ai.response.finish_reasons"] == ("length", "stop")  # a tuple, as cleaned
    # a key set again moves to the end, as the SDK deletes it first
    assert list(fast.attributes)[0] == "gen_ai.operation.name" and list(fast.attributes)[-2] == "gen_ai.request.model"


def test_request_attributes_not_taken_where_cleaning_would_change_or_drop_something():
    from otel_generate.fast_spans import set_request_attributes

    for limits, attributes in (
        ({"max_span_attribute_length": 5}, REQUEST_ATTRIBUTES),  # a string would be truncated
        ({"max_span_attributes": 4}, REQUEST_ATTRIBUTES),  # the oldest would be dropped
        ({}, {"k": None}),
        ({}, {"k": {"nested": 1}}),
        ({}, {"k": [1, None]}),
        ({}, {"": 1}),
        ({}, {3: 1}),
        ({}, {"k": b"bytes"}),
    ):
        public, fast = _two_spans(**limits)
        before = _state(fast)
        assert not set_request_attributes(fast, attributes), (limits, attributes)
        assert _state(fast) == before  # nothing half-written
        public.set_attributes(attributes)
        fast.set_attributes(attributes)  # what the caller then does
        assert _state(fast) == _state(public)
    public, fast = _two_spans()
    fast.end()
    assert not set_request_attributes(fast, REQUEST_ATTRIBUTES)  # ended: set_attributes warns and drops


def test_request_attributes_not_taken_for_another_span_or_attribute_class():
    from opentelemetry.sdk.trace import Span

    from otel_generate.fast_spans import _sets_attributes_as_expected, set_request_attributes

    class Mine(Span):
        def set_attributes(self, attributes):
            super().set_attributes(attributes)

    assert not _sets_attributes_as_expected(Mine, type(_two_spans()[0]._attributes))
    assert not set_request_attributes(object(), REQUEST_ATTRIBUTES)
