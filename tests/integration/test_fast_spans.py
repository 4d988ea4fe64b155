"""The fast step-span path gives exactly what the public API gives, and is taken only where it can."""

from __future__ import annotations

import logging

import pytest
from opentelemetry.sdk.trace import SpanLimits
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, Decision, ParentBased, Sampler, SamplingResult

from otel_generate import GenerateInstrumentor
from otel_generate import attributes as A
from tests.helpers import prompt, request_spans, step_spans
from tests.unit.test_fast_spans import provider_with


def run(provider, model, fast, monkeypatch=None, **options):
    """One instrumented generate(); ``fast=False`` forces the public API for every span."""
    instrumentor = GenerateInstrumentor()
    instrumentor.instrument(tracer_provider=provider, **options)
    try:
        taken = instrumentor._telemetry.fast is not None
        if not fast:
            instrumentor._telemetry.fast = None
        ids, mask = prompt(seed=70)
        model.generate(ids, attention_mask=mask, max_new_tokens=6, eos_token_id=None)
    finally:
        instrumentor.uninstrument()
    return taken


def described(span):
    """Everything an exporter reads off a step span, relative to its request span."""
    return dict(
        type=type(span),
        fields=sorted(vars(span)),  # the same fields as ReadableSpan's constructor sets
        context_type=type(span.context),
        context_valid=span.context.is_valid,
        parent_remote=span.parent.is_remote,
        name=span.name,
        kind=span.kind,
        attributes=dict(span.attributes),
        dropped=span.dropped_attributes,
        duration=span.end_time - span.start_time,
        events=tuple(span.events),
        links=tuple(span.links),
        status=(span.status.status_code, span.status.description),
        sampled=span.context.trace_flags.sampled,
        flags=int(span.context.trace_flags),
        remote=span.context.is_remote,
        resource=dict(span.resource.attributes),
        scope=(
            span.instrumentation_scope.name,
            span.instrumentation_scope.version,
            span.instrumentation_scope.schema_url,
        ),
    )


def test_fast_and_public_paths_give_the_same_step_spans(gpt2):
    outputs = []
    for fast in (True, False):
        exporter = InMemorySpanExporter()
        provider = provider_with(SimpleSpanProcessor(exporter))
        assert run(provider, gpt2, fast)
        (request,) = request_spans(exporter)
        steps = step_spans(exporter, request)
        assert len(steps) == 6
        for step in steps:
            assert step.parent.span_id == request.context.span_id and step.context.trace_id == request.context.trace_id
            assert request.start_time <= step.start_time <= step.end_time <= request.end_time
            assert step.context.span_id not in {s.context.span_id for s in steps if s is not step}
        offsets = [(s.start_time - request.start_time) for s in steps]
        assert offsets == sorted(offsets)
        outputs.append([{**described(s), "trace_state": s.context.trace_state} for s in steps])
    fast, public = outputs
    for a, b in zip(fast, public):
        a.pop("duration"), b.pop("duration")  # two runs: times differ
        for timing in (A.GENERATE_STEP_LATENCY, A.GENERATE_STEP_OUTLIER):  # two runs: timing-derived values differ
            a["attributes"].pop(timing, None), b["attributes"].pop(timing, None)
        assert a == b


def test_a_processor_of_another_kind_takes_the_public_path(gpt2):
    class Counting(SpanProcessor):  # may do something in on_start: the fast path cannot call it
        def __init__(self):
            self.started = 0

        def on_start(self, span, parent_context=None):
            self.started += 1

    exporter, counting = InMemorySpanExporter(), Counting()
    provider = provider_with(SimpleSpanProcessor(exporter), counting)
    assert not run(provider, gpt2, fast=True)
    assert counting.started == 1 + 6 == len(exporter.get_finished_spans())


def test_a_custom_sampler_decides_every_step_span(gpt2):
    class NoDecodeSpans(Sampler):
        def should_sample(
            self, parent_context, trace_id, name, kind=None, attributes=None, links=None, trace_state=None
        ):
            decision = Decision.DROP if name == A.STEP_SPAN_DECODE else Decision.RECORD_AND_SAMPLE
            extra = {**(attributes or {}), "sampler.saw": name} if decision.is_sampled() else None
            return SamplingResult(decision, extra)

        def get_description(self):
            return "NoDecodeSpans"

    class CountingIds(RandomIdGenerator):
        def __init__(self):
            self.span_ids = 0

        def generate_span_id(self):
            self.span_ids += 1
            return super().generate_span_id()

    exporters, drawn = [], []
    for fast in (True, False):
        exporter, ids = InMemorySpanExporter(), CountingIds()
        assert run(
            provider_with(
                SimpleSpanProcessor(exporter),
                sampler=ParentBased(ALWAYS_ON, local_parent_sampled=NoDecodeSpans()),
                id_generator=ids,
            ),
            gpt2,
            fast,
        )
        exporters.append(exporter)
        drawn.append(ids.span_ids)
    # a span id is drawn for every span, the dropped decode steps' too, as start_span draws them
    assert drawn == [1 + 6, 1 + 6]
    for exporter in exporters:
        (request,) = request_spans(exporter)
        (prefill,) = step_spans(exporter, request)  # the decode steps were dropped by the sampler
        assert prefill.name == A.STEP_SPAN_PREFILL and prefill.attributes["sampler.saw"] == A.STEP_SPAN_PREFILL


def test_tight_span_limits_take_the_public_path(gpt2):
    exporter = InMemorySpanExporter()
    provider = provider_with(SimpleSpanProcessor(exporter), span_limits=SpanLimits(max_span_attributes=3))
    assert not run(provider, gpt2, fast=True, outlier_factor=1e9)  # no noise-dependent outlier flag
    steps = [s for s in exporter.get_finished_spans() if s.name in (A.STEP_SPAN_PREFILL, A.STEP_SPAN_DECODE)]
    assert len(steps) == 6
    for step in steps:  # as the SDK limits them: the oldest attribute (the step index) evicted and counted
        assert len(step.attributes) == 3 and step.dropped_attributes == 1
        assert A.GENERATE_STEP_INDEX not in step.attributes


def test_a_fault_in_the_fast_path_falls_back_to_the_public_path(gpt2, monkeypatch, caplog):
    from otel_generate import _faults

    monkeypatch.setattr(_faults, "_logged_kinds", set())
    exporter = InMemorySpanExporter()
    provider = provider_with(SimpleSpanProcessor(exporter))
    instrumentor = GenerateInstrumentor()
    instrumentor.instrument(tracer_provider=provider)
    try:
        fast = instrumentor._telemetry.fast
        assert fast is not None

        def broken(*args, **kwargs):
            raise RuntimeError("readable span broke")

        monkeypatch.setattr(fast, "_readable", broken)
        ids, mask = prompt(seed=71)
        with caplog.at_level(logging.WARNING, logger="otel_generate"):
            gpt2.generate(ids, attention_mask=mask, max_new_tokens=4, eos_token_id=None)
            gpt2.generate(ids, attention_mask=mask, max_new_tokens=4, eos_token_id=None)
    finally:
        instrumentor.uninstrument()
    assert fast.broken
    assert [len(step_spans(exporter, r)) for r in request_spans(exporter)] == [4, 4]  # nothing lost
    assert sum("fast step spans failed" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("kind", ["content", "outlier"])
def test_non_numeric_or_extra_attributes_still_arrive(gpt2, kind):
    exporter = InMemorySpanExporter()
    provider = provider_with(SimpleSpanProcessor(exporter))
    options = {"capture_step_token_ids": True} if kind == "content" else {"outlier_factor": 1.0}
    assert run(provider, gpt2, fast=True, **options)
    (request,) = request_spans(exporter)
    steps = step_spans(exporter, request)
    if kind == "content":
        assert all(len(s.attributes[A.GENERATE_STEP_TOKEN_IDS]) == 1 for s in steps)
    else:
        flagged = [s for s in steps if s.attributes.get(A.GENERATE_STEP_OUTLIER)]
        assert len(flagged) == request.attributes[A.GENERATE_STEP_OUTLIERS]
