"""otel_generate.fast_request_span: the request span started without ``start_span``'s call is the
span ``start_span`` starts, field by field, or the fast path is not taken."""

from __future__ import annotations

import threading

import pytest
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace import SpanLimits, TracerProvider, sampling
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.util import BoundedList

from otel_generate import fast_request_span
from otel_generate.fast_request_span import FastRequestSpans

ATTRIBUTES = {
    "gen_ai.operation.name": "text_completion",
    "gen_ai.provider.name": "transformers",
    "gen_ai.request.model": "tiny-gpt2",
    "gen_ai.response.model": "tiny-gpt2",
}


class CountingIds(IdGenerator):
    """Ids 1, 2, 3, ... in the order they are drawn (trace and span ids from one counter)."""

    def __init__(self) -> None:
        self.next = 0

    def generate_span_id(self) -> int:
        self.next += 1
        return self.next

    def generate_trace_id(self) -> int:
        self.next += 1
        return 1000 + self.next


class RecordingSampler(sampling.Sampler):
    """Records what it is asked; adds an attribute, so its answer's attributes are the span's."""

    def __init__(self, decision=sampling.Decision.RECORD_AND_SAMPLE, extra=None) -> None:
        self.calls = []
        self.decision = decision
        self.extra = extra or {}

    def should_sample(self, parent_context, trace_id, name, kind=None, attributes=None, links=None, trace_state=None):
        self.calls.append((parent_context, trace_id, name, kind, dict(attributes or {}), tuple(links or ())))
        return sampling.SamplingResult(self.decision, {**(attributes or {}), **self.extra})

    def get_description(self) -> str:
        return "recording"


def provider(sampler=None, limits=None):
    exporter = InMemorySpanExporter()
    kwargs = {"id_generator": CountingIds()}
    if sampler is not None:
        kwargs["sampler"] = sampler
    if limits is not None:
        kwargs["span_limits"] = limits
    tracer_provider = TracerProvider(**kwargs)
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    return tracer_provider, exporter


def comparable(span):
    """A span's fields, its locks and lists by kind and content (new objects in every span)."""
    fields = {}
    for name, value in vars(span).items():
        if name == "_lock":
            value = type(value)
        elif name == "_attributes" and hasattr(value, "_dict"):
            value = [(key, type(field) if key == "_lock" else field) for key, field in vars(value).items()]
        elif isinstance(value, BoundedList):
            value = (value.dropped, value._dq.maxlen, list(value._dq), type(value._lock))
        fields[name] = value
    return list(fields.items())


def both(tracer_provider, attributes=ATTRIBUTES, context=None, start_time=123, fast=None):
    """(public span, fast span) from two tracers of the same provider, the ids counted alike;
    ``fast``: one set up earlier (default: set up now)."""
    public_tracer = tracer_provider.get_tracer("otel_generate")
    if fast is None:
        fast = FastRequestSpans.for_tracer(tracer_provider.get_tracer("otel_generate"))
    assert fast is not None
    ids = tracer_provider.id_generator
    ids.next = 0
    public = public_tracer.start_span(
        "text_completion tiny-gpt2",
        context=context,
        kind=trace.SpanKind.INTERNAL,
        start_time=start_time,
        attributes=attributes,
    )
    ids.next = 0
    built = fast.start("text_completion tiny-gpt2", attributes, context, start_time)
    assert built is not None
    return public, built


def test_the_installed_sdk_is_the_known_code_so_the_fast_path_is_taken():
    tracer_provider, _ = provider()
    assert FastRequestSpans.for_tracer(tracer_provider.get_tracer("x")) is not None


@pytest.mark.parametrize("start_time", [123, None])
def test_a_root_span_has_the_fields_start_span_gives(start_time, monkeypatch):
    tracer_provider, _ = provider()
    if start_time is None:
        monkeypatch.setattr("opentelemetry.sdk.trace.time_ns", lambda: 777)
    public, built = both(tracer_provider, start_time=start_time)
    assert type(built) is type(public)
    assert comparable(built) == comparable(public)
    assert built.start_time == (123 if start_time is not None else 777)
    assert built._lock is not public._lock and built._attributes._lock is not public._attributes._lock
    assert built._events is not public._events and built._links is not public._links


def test_a_child_span_has_its_parent_trace_and_the_fields_start_span_gives():
    tracer_provider, _ = provider()
    parent = tracer_provider.get_tracer("app").start_span("request")
    context = trace.set_span_in_context(parent)
    public, built = both(tracer_provider, context=context)
    assert comparable(built) == comparable(public)
    assert built.parent == parent.get_span_context()
    # the current context when none is given
    token = otel_context.attach(context)
    try:
        public, built = both(tracer_provider)
    finally:
        otel_context.detach(token)
    assert comparable(built) == comparable(public) and built.parent == parent.get_span_context()


def test_the_sampler_is_asked_the_same_and_its_attributes_are_the_spans():
    sampler = RecordingSampler(extra={"sampler.rule": "kept", "sampler.rate": 0.5})
    tracer_provider, _ = provider(sampler=sampler)
    public, built = both(tracer_provider)
    assert sampler.calls[0] == sampler.calls[1]
    assert sampler.calls[0][3] == trace.SpanKind.INTERNAL and sampler.calls[0][5] == ()
    assert comparable(built) == comparable(public)
    assert dict(built.attributes) == {**ATTRIBUTES, "sampler.rule": "kept", "sampler.rate": 0.5}


@pytest.mark.parametrize("decision", [sampling.Decision.DROP, sampling.Decision.RECORD_ONLY])
def test_a_span_the_sampler_drops_or_only_records_is_what_start_span_gives(decision):
    tracer_provider, exporter = provider(sampler=RecordingSampler(decision))
    public, built = both(tracer_provider)
    assert type(built) is type(public)
    assert built.get_span_context() == public.get_span_context()
    assert built.is_recording() == public.is_recording() == (decision == sampling.Decision.RECORD_ONLY)
    if decision == sampling.Decision.RECORD_ONLY:
        assert comparable(built) == comparable(public)


@pytest.mark.parametrize(
    "attributes, limits",
    [
        ({**ATTRIBUTES, "gen_ai.request.model": "x" * 50}, SpanLimits(max_span_attribute_length=10)),  # truncated
        (ATTRIBUTES, SpanLimits(max_span_attributes=2)),  # the oldest dropped
        ({**ATTRIBUTES, "list": [1, 2]}, None),  # a list becomes a tuple
        ({**ATTRIBUTES, "none": None, "bytes": b"x"}, None),
        ({}, None),
        ({"n": 1, "f": 0.5, "b": True}, SpanLimits(max_span_attribute_length=0)),
    ],
)
def test_attributes_the_cleaning_changes_are_cleaned_as_the_constructor_cleans_them(attributes, limits):
    tracer_provider, _ = provider(limits=limits)
    public, built = both(tracer_provider, attributes=attributes)
    assert comparable(built) == comparable(public)
    assert built._attributes.dropped == public._attributes.dropped


def test_the_span_lives_as_a_span_start_span_started_does_and_ends_to_the_same_export():
    tracer_provider, exporter = provider()
    public, built = both(tracer_provider)
    for span in (public, built):
        span.set_attribute("gen_ai.usage.output_tokens", 128)
        span.add_event("event", {"k": 1}, timestamp=5)
        span.set_status(trace.Status(trace.StatusCode.ERROR, "x"))
        span.end(end_time=999)
    first, second = exporter.get_finished_spans()
    assert first.to_json() == second.to_json()
    assert dict(first.attributes) == dict(second.attributes)


def test_the_processors_on_start_is_called_with_the_span_and_the_context():
    tracer_provider, _ = provider()
    seen = []

    class Watching(SimpleSpanProcessor):
        def on_start(self, span, parent_context=None):
            seen.append((span, parent_context))

    tracer_provider.add_span_processor(Watching(InMemorySpanExporter()))
    context = otel_context.get_current()
    _, built = both(tracer_provider, context=context)
    assert seen[-1][0] is built and seen[-1][1] is context


def test_a_disabled_tracer_gives_start_spans_non_recording_span_and_draws_nothing():
    tracer_provider, _ = provider()
    tracer = tracer_provider.get_tracer("x")
    fast = FastRequestSpans.for_tracer(tracer)
    tracer._tracer_config = type(tracer._tracer_config)(is_enabled=False)
    parent = tracer_provider.get_tracer("app").start_span("request")
    context = trace.set_span_in_context(parent)
    public = tracer.start_span("n", context=context, attributes=ATTRIBUTES)
    built = fast.start("n", ATTRIBUTES, context)
    assert type(built) is type(public) is trace.NonRecordingSpan
    assert built.get_span_context() == public.get_span_context() == parent.get_span_context()
    assert tracer_provider.id_generator.next == 2  # the parent's trace and span ids only


def test_a_parent_that_is_not_a_span_context_raises_start_spans_type_error():
    class Odd(trace.NonRecordingSpan):
        def get_span_context(self):
            return (1, 2)

    tracer_provider, _ = provider()
    tracer = tracer_provider.get_tracer("x")
    fast = FastRequestSpans.for_tracer(tracer)
    context = trace.set_span_in_context(Odd(trace.INVALID_SPAN_CONTEXT))
    with pytest.raises(TypeError) as public:
        tracer.start_span("n", context=context, attributes=ATTRIBUTES)
    with pytest.raises(TypeError) as built:
        fast.start("n", ATTRIBUTES, context)
    assert str(built.value) == str(public.value)
    assert tracer_provider.id_generator.next == 0 and not fast.broken


def test_a_replaced_lock_class_is_the_one_the_span_gets_as_gevent_patches_it(monkeypatch):
    import threading

    tracer_provider, _ = provider()
    fast = FastRequestSpans.for_tracer(tracer_provider.get_tracer("otel_generate"))

    class GreenLock:
        def __init__(self):
            self.lock = threading.RLock()

        def __enter__(self):
            return self.lock.__enter__()

        def __exit__(self, *exc):
            return self.lock.__exit__(*exc)

    monkeypatch.setattr(threading, "Lock", GreenLock)
    public, built = both(tracer_provider, fast=fast)
    assert type(built._lock) is type(public._lock) is GreenLock
    assert type(built._attributes._lock) is type(public._attributes._lock) is GreenLock
    assert type(built._events._lock) is type(public._events._lock) is GreenLock


@pytest.mark.parametrize("name", ["_Span", "BoundedAttributes", "BoundedList"])
def test_a_class_the_sdk_module_names_replaced_after_set_up_builds_the_span_with_it(monkeypatch, name):
    from opentelemetry.sdk import trace as sdk_trace

    tracer_provider, _ = provider()
    fast = FastRequestSpans.for_tracer(tracer_provider.get_tracer("otel_generate"))
    replacement = type("Replacement", (getattr(sdk_trace, name),), {})
    monkeypatch.setattr(sdk_trace, name, replacement)
    public, built = both(tracer_provider, fast=fast)
    assert comparable(built) == comparable(public)
    found = {"_Span": built, "BoundedAttributes": built._attributes, "BoundedList": built._events}[name]
    assert type(found) is replacement


def test_attributes_are_read_through_items_once_as_the_cleaning_reads_them():
    class Reading(dict):
        reads = 0

        def items(self):
            type(self).reads += 1
            return super().items()

        def __getitem__(self, key):
            return "not what items() gives"

    sampler = RecordingSampler()
    tracer_provider, _ = provider(sampler=sampler)
    given = Reading(ATTRIBUTES)
    public, built = both(tracer_provider, attributes=given)
    assert comparable(built) == comparable(public)
    assert dict(built.attributes) == ATTRIBUTES


def patch_with_a_wrapper(monkeypatch, owner, name):
    import importlib

    module_name, class_name = owner.rsplit(".", 1)
    cls = getattr(importlib.import_module(module_name), class_name)
    original = getattr(cls, name)
    calls = []

    def patched(*args, **kwargs):
        calls.append(name)
        return original(*args, **kwargs)

    monkeypatch.setattr(cls, name, patched)
    return calls


@pytest.mark.parametrize(
    "owner, name", [("opentelemetry.sdk.trace.Tracer", "start_span"), ("opentelemetry.trace.SpanContext", "__new__")]
)
def test_a_patch_of_start_span_or_span_context_after_set_up_sends_the_span_to_start_span(monkeypatch, owner, name):
    tracer_provider, _ = provider()
    fast = FastRequestSpans.for_tracer(tracer_provider.get_tracer("x"))
    if name == "__new__":
        monkeypatch.setattr(trace.SpanContext, "__new__", staticmethod(lambda cls, *a, **k: tuple.__new__(cls, a)))
    else:
        patch_with_a_wrapper(monkeypatch, owner, name)
    assert fast.start("n", ATTRIBUTES) is None
    assert tracer_provider.id_generator.next == 0  # nothing drawn: the caller's start_span draws them
    monkeypatch.undo()
    assert fast.start("n", ATTRIBUTES) is not None


@pytest.mark.parametrize(
    "owner, name",
    [
        ("opentelemetry.sdk.trace.Span", "start"),
        ("opentelemetry.sdk.trace.Span", "__init__"),
        ("opentelemetry.attributes.BoundedAttributes", "_set_items"),
        ("opentelemetry.sdk.util.BoundedList", "__init__"),
    ],
)
def test_a_patch_of_what_building_a_span_repeats_builds_it_with_the_constructor_start_span_calls(
    monkeypatch, owner, name
):
    tracer_provider, _ = provider()
    public, _ = both(tracer_provider)  # (before the patch)
    calls = patch_with_a_wrapper(monkeypatch, owner, name)
    ids = tracer_provider.id_generator
    ids.next = 0
    again = FastRequestSpans.for_tracer(tracer_provider.get_tracer("otel_generate")).start(
        "text_completion tiny-gpt2", ATTRIBUTES, None, 123
    )
    assert calls  # the patched function ran: the span was built through it
    assert comparable(again) == comparable(public)
    monkeypatch.undo()


def test_start_span_set_on_the_tracer_object_sends_the_span_there():
    tracer_provider, _ = provider()
    tracer = tracer_provider.get_tracer("x")
    fast = FastRequestSpans.for_tracer(tracer)
    tracer.start_span = lambda *args, **kwargs: None
    assert fast.start("n", ATTRIBUTES) is None


def test_another_tracer_is_not_given_the_fast_path():
    assert FastRequestSpans.for_tracer(trace.NoOpTracer()) is None


def test_the_code_digests_are_those_of_the_installed_sdk_functions():
    from otel_generate._sdk_code import code_digest

    fast = FastRequestSpans.for_tracer(provider()[0].get_tracer("x"))
    assert code_digest(fast_request_span._start_functions(fast._owners)) == fast_request_span._START_CODE
    assert code_digest(fast_request_span._span_functions(fast._owners)) == fast_request_span._SPAN_CODE
    assert fast._builds_as_known()


def test_spans_started_on_threads_at_once_each_get_their_own_lock_and_lists():
    tracer_provider, _ = provider()
    fast = FastRequestSpans.for_tracer(tracer_provider.get_tracer("x"))
    spans = []
    threads = [threading.Thread(target=lambda: spans.append(fast.start("n", ATTRIBUTES))) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len({id(span._lock) for span in spans}) == 8
    assert len({id(span._attributes._dict) for span in spans}) == 8
