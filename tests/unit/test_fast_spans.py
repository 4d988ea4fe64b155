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
