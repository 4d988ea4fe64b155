"""Which span processors the fast step-span path serves, decided without a model."""

from __future__ import annotations

import enum

import pytest
import wrapt
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
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


class _Key(str):
    pass


class _Level(enum.IntEnum):
    HIGH = 2


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
    public, fast = _two_spans(max_span_attribute_length=5)
    mixed = {"k": [1, "short", True, 0.5], "t": ("a", "b")}  # at the limit, of every element type
    public.set_attributes(mixed)
    assert set_request_attributes(fast, mixed)
    assert _state(fast) == _state(public)


def test_request_attributes_not_taken_where_cleaning_would_change_or_drop_something():
    from otel_generate.fast_spans import set_request_attributes

    for limits, attributes in (
        ({"max_span_attribute_length": 5}, REQUEST_ATTRIBUTES),  # a string would be truncated
        ({"max_span_attributes": 4}, REQUEST_ATTRIBUTES),  # the oldest would be dropped
        ({}, {"k": None}),
        ({}, {"k": {"nested": 1}}),
        ({}, {"k": [1, None]}),
        ({}, {"k": (1, b"bytes")}),
        ({"max_span_attribute_length": 5}, {"k": [1, "short", "longer"]}),  # an element would be truncated
        ({}, {"": 1}),
        ({}, {3: 1}),
        ({}, {"k": b"bytes"}),
        ({}, {_Key("k"): 1}),  # a str subclass as a key
        ({}, {"k": _Level.HIGH}),  # an int subclass as a value
        ({}, {"k": [1, _Level.HIGH]}),  # ... and as an element
        ({"max_span_attribute_length": 5}, {"a": "short", "b": "longer", "c": 1}),  # one string too long
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


@pytest.mark.parametrize("way", ["functools.wraps", "wrapt"])
@pytest.mark.parametrize("owner, name", [("Span", "set_attributes"), ("BoundedAttributes", "_set_items")])
def test_request_attributes_not_taken_once_what_set_attributes_runs_is_patched(monkeypatch, way, owner, name):
    import functools

    import opentelemetry.attributes as attributes_module
    from opentelemetry.sdk.trace import Span

    from otel_generate.fast_spans import set_request_attributes

    public, fast = _two_spans()
    assert set_request_attributes(fast, {"a": 1})  # the known code: taken
    owner = {"Span": Span, "BoundedAttributes": attributes_module.BoundedAttributes}[owner]
    original, calls = getattr(owner, name), []
    if way == "wrapt":
        replacement = wrapt.FunctionWrapper(original, lambda f, i, a, k: calls.append(1) or f(*a, **k))
    else:

        @functools.wraps(original)
        def replacement(*args, **kwargs):  # another tool's (a redaction's) wrapper
            calls.append(1)
            return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, replacement)
    public, fast = _two_spans()
    before = _state(fast)
    del calls[:]  # (starting a span with attributes runs _set_items too)
    assert not set_request_attributes(fast, REQUEST_ATTRIBUTES)  # the caller's set_attributes then runs it
    assert _state(fast) == before and not calls  # nothing written, nothing run
    fast.set_attributes(REQUEST_ATTRIBUTES)
    assert calls  # the patch runs on the public path


def test_request_attributes_not_taken_where_set_attributes_is_set_on_the_span():
    from otel_generate.fast_spans import set_request_attributes

    public, fast = _two_spans()
    before = _state(fast)
    fast.set_attributes = lambda attributes: None  # what the caller's set_attributes calls
    assert not set_request_attributes(fast, REQUEST_ATTRIBUTES) and _state(fast) == before


def test_request_attributes_not_taken_for_another_span_or_attribute_class():
    from opentelemetry.sdk.trace import Span

    from otel_generate.fast_spans import _sets_attributes_as_expected, set_request_attributes

    class Mine(Span):
        def set_attributes(self, attributes):
            super().set_attributes(attributes)

    assert not _sets_attributes_as_expected(Mine, type(_two_spans()[0]._attributes))
    assert not set_request_attributes(object(), REQUEST_ATTRIBUTES)


# --- a request's step spans in one call (FastStepSpans.emit_many) --------------------------------


def _steps_through(processor, count=3, after_set_up=None, **kwargs):
    """``count`` step spans under one request span, built by ``emit_many``; returns what it
    returned, the request span and the tracer's fast path. ``after_set_up(tracer)`` runs once the
    fast path was found usable, before the request."""
    from opentelemetry import trace

    tracer = provider_with(processor).get_tracer("t")
    fast = FastStepSpans.for_tracer(tracer)
    assert fast is not None and fast.usable()
    if after_set_up is not None:
        after_set_up(tracer)
    request = tracer.start_span("request")
    context, parent = trace.set_span_in_context(request), request.get_span_context()
    names = ["prefill"] + ["decode"] * (count - 1)
    attributes = [{"generate.step.index": i, "generate.step.latency": 0.001 * (i + 1)} for i in range(count)]
    done = fast.emit_many(
        [context] * count,
        [parent] * count,
        names,
        [10 * i for i in range(count)],
        [10 * i + 9 for i in range(count)],
        attributes,
        **kwargs,
    )
    return done, request, fast


def _exported(spans):
    return [
        (s.name, s.parent.span_id, dict(s.attributes), s.start_time, s.end_time, int(s.context.trace_flags))
        for s in spans
    ]


def test_emit_many_through_a_batch_processor_exports_what_the_public_path_exports():
    from opentelemetry import trace
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    fast_exporter, public_exporter = InMemorySpanExporter(), InMemorySpanExporter()
    fast_processor = BatchSpanProcessor(fast_exporter)
    done, request, fast = _steps_through(fast_processor)
    assert done == 3 and not fast.broken
    fast_processor.force_flush()
    public_processor = BatchSpanProcessor(public_exporter)
    tracer = provider_with(public_processor).get_tracer("t")
    context = trace.set_span_in_context(request)
    for i, name in enumerate(["prefill", "decode", "decode"]):
        attributes = {"generate.step.index": i, "generate.step.latency": 0.001 * (i + 1)}
        tracer.start_span(name, context=context, start_time=10 * i, attributes=attributes).end(end_time=10 * i + 9)
    public_processor.force_flush()
    fast_spans, public_spans = fast_exporter.get_finished_spans(), public_exporter.get_finished_spans()
    assert len(fast_spans) == 3 and _exported(fast_spans) == _exported(public_spans)
    assert all(sorted(vars(a)) == sorted(vars(b)) for a, b in zip(fast_spans, public_spans))


def test_a_batch_processor_is_ended_through_its_batch_processor_only_for_sampled_spans():
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from otel_generate.fast_spans import _end_calls

    batch, simple = BatchSpanProcessor(InMemorySpanExporter()), SimpleSpanProcessor(InMemorySpanExporter())
    sampled, unsampled = _end_calls(provider_with(batch, simple)._active_span_processor, (batch, simple))
    # (what BatchSpanProcessor.on_end calls for a sampled span; for another it returns at once)
    assert sampled == (batch._batch_processor.emit, simple.on_end) and unsampled == (simple.on_end,)
    batch.shutdown()


def test_a_patched_batch_processor_on_end_is_called_not_gone_around(monkeypatch):
    import functools

    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    seen = []
    original = BatchSpanProcessor.on_end

    @functools.wraps(original)
    def counting(self, span):  # another tool's wrapper: its source reads as the original's
        seen.append(span.name)
        return original(self, span)

    monkeypatch.setattr(BatchSpanProcessor, "on_end", counting)
    exporter = InMemorySpanExporter()
    processor = BatchSpanProcessor(exporter)
    done, _, _ = _steps_through(processor)
    processor.force_flush()
    assert done == 3 and seen == ["prefill", "decode", "decode"] and len(exporter.get_finished_spans()) == 3


def test_an_on_end_set_on_a_batch_processor_object_is_called_not_gone_around():
    exporter = InMemorySpanExporter()
    processor = BatchSpanProcessor(exporter)
    seen = []
    on_end = processor.on_end

    def counting(span):  # another tool's wrapper, set on the object
        seen.append(span.name)
        on_end(span)

    processor.on_end = counting
    done, _, _ = _steps_through(processor)
    processor.force_flush()
    assert done == 3 and seen == ["prefill", "decode", "decode"] and len(exporter.get_finished_spans()) == 3


@pytest.mark.parametrize(
    "where, hook",
    [
        ("processor object", "on_start"),
        ("processor object", "_on_ending"),
        ("processor class", "on_start"),
        ("processor class", "_on_ending"),
        ("multi-processor object", "on_start"),
        ("multi-processor object", "_on_ending"),
        ("multi-processor object", "on_end"),
        ("multi-processor class", "on_start"),
        ("multi-processor class", "on_end"),
        ("processor class, wrapt", "on_start"),
        ("processor class, wrapt", "_on_ending"),
        ("multi-processor class, wrapt", "on_end"),
    ],
)
def test_a_span_hook_patched_after_set_up_sends_the_step_spans_to_the_public_path(monkeypatch, where, hook):
    import functools

    from opentelemetry.sdk.trace import SynchronousMultiSpanProcessor
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    exporter = InMemorySpanExporter()
    processor = SimpleSpanProcessor(exporter)

    def patch(tracer):  # another tool's hook, installed once instrument() had checked the processors
        if where.endswith("object"):
            target = processor if where == "processor object" else tracer.span_processor
            original = getattr(target, hook)
            setattr(target, hook, lambda *args, **kwargs: original(*args, **kwargs))
            return
        owner = SimpleSpanProcessor if where.startswith("processor class") else SynchronousMultiSpanProcessor
        original = getattr(owner, hook)
        if where.endswith("wrapt"):  # (the wrapper compares and hashes equal to the function it wraps)
            monkeypatch.setattr(owner, hook, wrapt.FunctionWrapper(original, lambda f, i, a, k: f(*a, **k)))
            return

        @functools.wraps(original)
        def wrapper(self, *args, **kwargs):  # its source reads as the original's
            return original(self, *args, **kwargs)

        monkeypatch.setattr(owner, hook, wrapper)

    done, _, fast = _steps_through(processor, after_set_up=patch)
    assert done == 0 and not fast.broken  # none taken: the caller builds them through the public API
    assert exporter.get_finished_spans() == ()


def test_a_batch_processor_on_end_wrapped_by_wrapt_after_a_request_is_called_not_gone_around(monkeypatch):
    exporter = InMemorySpanExporter()
    processor = BatchSpanProcessor(exporter)
    seen = []
    done, _, fast = _steps_through(processor)  # its on_end was found to be the known code
    assert done == 3

    def counting(wrapped, instance, args, kwargs):
        seen.append(args[0].name)
        return wrapped(*args, **kwargs)

    monkeypatch.setattr(BatchSpanProcessor, "on_end", wrapt.FunctionWrapper(BatchSpanProcessor.on_end, counting))
    done, _, _ = _steps_through(processor)
    processor.force_flush()
    assert done == 3 and seen == ["prefill", "decode", "decode"] and len(exporter.get_finished_spans()) == 6


def test_the_id_generator_and_the_tracer_are_read_at_every_request():
    from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

    class CountingIds(RandomIdGenerator):
        def __init__(self):
            self.span_ids = 0

        def generate_span_id(self):
            self.span_ids += 1
            return super().generate_span_id()

    exporter = InMemorySpanExporter()
    ids = CountingIds()

    def replace_generator(tracer):  # after instrument(): what start_span then draws from
        tracer.id_generator = ids

    done, _, _ = _steps_through(SimpleSpanProcessor(exporter), after_set_up=replace_generator)
    assert done == 3 and ids.span_ids == 1 + 3  # the request span's and the step spans'

    def disable(tracer):
        tracer._is_enabled = lambda: False  # (what a tracer configurator's rule does: start_span gives no span)

    done, _, fast = _steps_through(SimpleSpanProcessor(exporter), after_set_up=disable)
    assert done == 0 and not fast.broken


def test_a_processor_raising_for_one_step_span_is_logged_once_and_the_others_go_on(monkeypatch, caplog):
    import logging

    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from otel_generate import _faults

    monkeypatch.setattr(_faults, "_logged_kinds", set())
    exporter = InMemorySpanExporter()
    processor = SimpleSpanProcessor(exporter)
    on_end = processor.on_end

    def raising(span):
        if span.attributes["generate.step.index"] == 1:
            raise RuntimeError("processor bug")
        on_end(span)

    processor.on_end = raising
    with caplog.at_level(logging.WARNING, logger="otel_generate"):
        done, _, fast = _steps_through(processor, count=4)
    assert done == 4 and not fast.broken
    assert [s.attributes["generate.step.index"] for s in exporter.get_finished_spans()] == [0, 2, 3]
    assert sum("step span export failed" in r.getMessage() for r in caplog.records) == 1


def test_emit_many_stops_at_the_first_step_it_may_not_take():
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    done, _, _ = _steps_through(SimpleSpanProcessor(exporter), count=4, eligible=[True, True, False, True])
    assert done == 2 and [s.attributes["generate.step.index"] for s in exporter.get_finished_spans()] == [0, 1]
    exporter.clear()
    done, _, _ = _steps_through(SimpleSpanProcessor(exporter), count=4, begin=3)
    assert done == 4 and [s.attributes["generate.step.index"] for s in exporter.get_finished_spans()] == [3]


def test_an_on_end_object_that_cannot_be_hashed_is_called_for_every_step_span(monkeypatch):
    seen = []

    class Counted:  # a callable set on the class, not a function: with __eq__, so no __hash__
        def __eq__(self, other):
            return self is other

        def __call__(self, span):
            seen.append(span.name)

    monkeypatch.setattr(BatchSpanProcessor, "on_end", Counted())
    processor = BatchSpanProcessor(InMemorySpanExporter())
    done, _, fast = _steps_through(processor)
    assert done == 3 and not fast.broken and seen == ["prefill", "decode", "decode"]
    processor.shutdown()


def test_step_spans_carry_the_providers_resource_when_it_changes_as_after_a_fork():
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor

    exporter = InMemorySpanExporter()
    tracer = provider_with(SimpleSpanProcessor(exporter)).get_tracer("t")
    fast = FastStepSpans.for_tracer(tracer)
    child = Resource({"service.instance.id": "the-child"})
    tracer._set_resource(child)  # (what TracerProvider._handle_fork does in a forked child)
    request = tracer.start_span("request")
    done = fast.emit_many(
        [trace.set_span_in_context(request)], [request.get_span_context()], ["prefill"], [1], [2], [{"i": 0}]
    )
    (step,) = exporter.get_finished_spans()
    assert done == 1 and step.resource is child
