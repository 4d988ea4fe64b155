"""At scale: background emission, the step-span policy, generate.step.latencies,
step outliers, and the per-request figures (memory, key/value cache, assisted candidates)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from transformers import LogitsProcessor, LogitsProcessorList

from otel_generate import attributes as A
from otel_generate.figures import cache_bytes
from tests.helpers import only_request, prompt, request_spans, step_spans, uninstrumented_generate


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """One intra-op thread: on a shared machine, torch's thread pool makes step times jump."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class SleepAt(LogitsProcessor):
    """Sleeps ``seconds`` at the given 1-based calls (one call per step): every call when ``at`` is None."""

    def __init__(self, seconds, at=None):
        self.seconds, self.at, self.calls = seconds, at, 0

    def __call__(self, input_ids, scores):
        self.calls += 1
        if self.at is None or self.calls in self.at:
            time.sleep(self.seconds)
        return scores


# --- background emission ------------------------------------------------------------------------------


class SleepingExporter(SpanExporter):
    """Keeps what it exports, sleeping ``seconds`` per span (a slow collector)."""

    def __init__(self, seconds):
        self.seconds = seconds
        self.spans = []
        self.lock = threading.Lock()

    def export(self, spans):
        for span in spans:
            time.sleep(self.seconds)
            with self.lock:
                self.spans.append(span)
        return SpanExportResult.SUCCESS

    def shutdown(self):
        pass


def test_background_emission_returns_before_the_step_spans_and_flush_delivers_them(instrument, gpt2):
    exporter = SleepingExporter(0.02)  # 20 ms per span: 31 spans take 0.62 s on the caller's thread
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    instrument(tracer_provider=provider, background_emission=True)
    ids, mask = prompt(seed=50)
    expected = uninstrumented_generate(gpt2, ids, attention_mask=mask, max_new_tokens=30, eos_token_id=None)
    started = time.perf_counter()
    out = gpt2.generate(ids, attention_mask=mask, max_new_tokens=30, eos_token_id=None)
    elapsed = time.perf_counter() - started
    delivered_at_return = len(exporter.spans)
    assert torch.equal(out, expected)
    assert delivered_at_return < 31 and elapsed < 0.6  # synchronous export cannot be under 0.62 s

    assert provider.force_flush()  # drains the emitter first
    spans = list(exporter.spans)
    assert len(spans) == 31
    (request,) = [s for s in spans if s.name.startswith(A.OPERATION_TEXT_COMPLETION + " ")]
    steps = sorted(
        (s for s in spans if s.parent is not None and s.parent.span_id == request.context.span_id),
        key=lambda s: s.attributes[A.GENERATE_STEP_INDEX],
    )
    assert [s.name for s in steps] == ["prefill"] + ["decode"] * 29
    latencies = list(request.attributes[A.GENERATE_STEP_LATENCIES])
    assert [s.attributes[A.GENERATE_STEP_LATENCY] for s in steps] == latencies
    # the same timestamps as synchronous emission: back to back from the request's start
    assert steps[0].start_time >= request.start_time and steps[-1].end_time <= request.end_time
    for previous, step, latency in zip([None] + steps[:-1], steps, latencies):
        assert step.end_time - step.start_time == pytest.approx(latency * 1e9, abs=2)
        if previous is not None:
            assert step.start_time == previous.end_time
    assert request.attributes[A.GEN_AI_USAGE_OUTPUT_TOKENS] == 30


def test_background_emission_matches_synchronous_attributes(instrument, gpt2, span_exporter, tracer_provider):
    ids, mask = prompt(seed=51)
    instrumentor = instrument(tracer_provider=tracer_provider)
    gpt2.generate(ids, attention_mask=mask, max_new_tokens=5, eos_token_id=None)
    instrumentor.uninstrument()
    instrument(tracer_provider=tracer_provider, background_emission=True)
    gpt2.generate(ids, attention_mask=mask, max_new_tokens=5, eos_token_id=None)
    assert tracer_provider.force_flush()
    synchronous, background = sorted(request_spans(span_exporter), key=lambda s: s.start_time)
    timing = {
        A.GENERATE_TIME_TO_FIRST_TOKEN,
        A.GENERATE_TIME_PER_OUTPUT_TOKEN,
        A.GENERATE_STEP_LATENCIES,
        A.GENERATE_STEP_OUTLIERS,
    }
    same = {k: v for k, v in synchronous.attributes.items() if k not in timing}
    assert {k: v for k, v in background.attributes.items() if k not in timing} == same
    assert set(background.attributes) == set(synchronous.attributes)
    assert len(step_spans(span_exporter, background)) == len(step_spans(span_exporter, synchronous)) == 5


def test_uninstrument_drains_the_background_emitter(instrument, gpt2):
    exporter = SleepingExporter(0.005)
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    instrumentor = instrument(tracer_provider=provider, background_emission=True)
    ids, mask = prompt(seed=52)
    for _ in range(3):
        gpt2.generate(ids, attention_mask=mask, max_new_tokens=4, eos_token_id=None)
    instrumentor.uninstrument()
    assert len(exporter.spans) == 3 * 5


# --- the step-span policy and generate.step.latencies ---------------------------------------------------


def test_latencies_equal_the_step_spans_in_order(instrumented, span_exporter, gpt2):
    ids, mask = prompt(seed=53)
    gpt2.generate(ids, attention_mask=mask, max_new_tokens=7, eos_token_id=None)
    request = only_request(span_exporter)
    latencies = list(request.attributes[A.GENERATE_STEP_LATENCIES])
    assert latencies == [s.attributes[A.GENERATE_STEP_LATENCY] for s in step_spans(span_exporter, request)]
    assert len(latencies) == 7 and all(isinstance(v, float) and v > 0 for v in latencies)
    assert request.attributes[A.GENERATE_STEP_SPANS_POLICY] == "all"
    assert request.attributes[A.GENERATE_STEP_SPANS_EMITTED] is True


def test_latencies_are_capped_like_the_step_spans(instrument, span_exporter, tracer_provider, gpt2):
    instrument(tracer_provider=tracer_provider, max_step_spans=3)
    ids, mask = prompt(seed=54)
    gpt2.generate(ids, attention_mask=mask, max_new_tokens=7, eos_token_id=None)
    request = only_request(span_exporter)
    assert len(request.attributes[A.GENERATE_STEP_LATENCIES]) == 3 == len(step_spans(span_exporter, request))
    assert request.attributes[A.GENERATE_STEP_SPANS_DROPPED] == 4 and request.attributes[A.GENERATE_STEPS] == 7


def test_slow_policy_emits_steps_only_above_the_threshold(
    instrument, span_exporter, tracer_provider, gpt2, monkeypatch
):
    monkeypatch.setenv("OTEL_GENERATE_STEP_SPANS", "slow")
    monkeypatch.setenv("OTEL_GENERATE_SLOW_TIME_TO_FIRST_TOKEN", "0.2")
    ids, mask = prompt(seed=55)
    for _ in range(2):  # warm up: a process's first calls are slow
        uninstrumented_generate(gpt2, ids, attention_mask=mask, max_new_tokens=4, eos_token_id=None)
    instrument(tracer_provider=tracer_provider)
    gpt2.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=4,
        eos_token_id=None,
        logits_processor=LogitsProcessorList([SleepAt(0.4, at={1})]),
    )  # a slow first token
    gpt2.generate(ids, attention_mask=mask, max_new_tokens=4, eos_token_id=None)
    slow, fast = sorted(request_spans(span_exporter), key=lambda s: s.start_time)
    assert slow.attributes[A.GENERATE_TIME_TO_FIRST_TOKEN] > 0.2 > fast.attributes[A.GENERATE_TIME_TO_FIRST_TOKEN]
    assert len(step_spans(span_exporter, slow)) == 4 and step_spans(span_exporter, fast) == []
    for request, emitted in ((slow, True), (fast, False)):
        assert request.attributes[A.GENERATE_STEP_SPANS_POLICY] == "slow"
        assert request.attributes[A.GENERATE_STEP_SPANS_EMITTED] is emitted
        assert len(request.attributes[A.GENERATE_STEP_LATENCIES]) == 4
        assert request.attributes[A.GENERATE_STEP_SPANS_DROPPED] == (0 if emitted else 4)
    assert slow.attributes[A.GENERATE_STEP_SPANS_REASON] == "time_to_first_token"
    assert A.GENERATE_STEP_SPANS_REASON not in fast.attributes


def test_slow_policy_emits_failed_requests_and_none_emits_nothing(instrument, span_exporter, tracer_provider, gpt2):
    class RaiseAt(LogitsProcessor):
        def __init__(self):
            self.calls = 0

        def __call__(self, input_ids, scores):
            self.calls += 1
            if self.calls == 3:
                raise RuntimeError("boom")
            return scores

    instrumentor = instrument(tracer_provider=tracer_provider, step_spans="slow")
    ids, mask = prompt(seed=56)
    with pytest.raises(RuntimeError):
        gpt2.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=5,
            eos_token_id=None,
            logits_processor=LogitsProcessorList([RaiseAt()]),
        )
    failed = only_request(span_exporter)
    assert failed.attributes[A.GENERATE_STEP_SPANS_REASON] == "error"
    assert len(step_spans(span_exporter, failed)) == 2
    instrumentor.uninstrument()
    span_exporter.clear()
    instrument(tracer_provider=tracer_provider, step_spans="none")
    gpt2.generate(ids, attention_mask=mask, max_new_tokens=5, eos_token_id=None)
    request = only_request(span_exporter)
    assert step_spans(span_exporter) == []
    assert request.attributes[A.GENERATE_STEP_SPANS_EMITTED] is False
    assert len(request.attributes[A.GENERATE_STEP_LATENCIES]) == 5


# --- step outliers --------------------------------------------------------------------------------------


def test_a_step_five_times_slower_is_the_only_outlier(instrumented, span_exporter, gpt2):
    ids, mask = prompt(seed=57)
    # every step sleeps 10 ms, so machine noise is small next to it; step 6 sleeps 100 ms more
    processors = LogitsProcessorList([SleepAt(0.01), SleepAt(0.1, at={6})])
    gpt2.generate(ids, attention_mask=mask, max_new_tokens=10, eos_token_id=None, logits_processor=processors)
    request = only_request(span_exporter)
    steps = step_spans(span_exporter, request)
    flagged = [s.attributes[A.GENERATE_STEP_INDEX] for s in steps if s.attributes.get(A.GENERATE_STEP_OUTLIER)]
    assert flagged == [5]  # the sixth call of the processors is step 5
    assert request.attributes[A.GENERATE_STEP_OUTLIERS] == 1
    assert all(A.GENERATE_STEP_OUTLIER not in s.attributes for s in steps if s.attributes[A.GENERATE_STEP_INDEX] != 5)


# --- figures --------------------------------------------------------------------------------------------


def test_kv_cache_size_is_the_bytes_of_the_returned_cache(instrumented, span_exporter, gpt2):
    ids, mask = prompt(seed=58)
    out = gpt2.generate(ids, attention_mask=mask, max_new_tokens=5, eos_token_id=None, return_dict_in_generate=True)
    cache = out.past_key_values

    def tensors_of(item):  # transformers 5: DynamicCache layers; 4.46: a DynamicCache or the legacy tuples
        if torch.is_tensor(item):
            return [item]
        if isinstance(item, (tuple, list)):
            return [t for part in item for t in tensors_of(part)]
        if hasattr(item, "layers"):
            return [t for layer in item.layers for t in (layer.keys, layer.values)]
        return [t for pair in zip(item.key_cache, item.value_cache) for t in pair]

    expected = sum(t.numel() * t.element_size() for t in tensors_of(cache))
    assert expected > 0 and cache_bytes(cache) == expected
    assert only_request(span_exporter).attributes[A.GENERATE_KV_CACHE_SIZE] == expected


def test_cache_bytes_of_tensors_views_parameters_and_duck_typed_ones():
    """Each tensor's numel() * element_size(), whether read by nbytes (a plain tensor) or by the two
    calls (a subclass such as a Parameter, an object that only looks like a tensor), each counted once."""

    class Duck:  # numel() and element_size() only
        def numel(self):
            return 7

        def element_size(self):
            return 3

    base = torch.zeros(4, 6, dtype=torch.bfloat16)
    tensors = [
        base,
        base[:, ::2],  # a non-contiguous view: its own elements, not the storage
        torch.zeros(0, 5),
        torch.ones(3, dtype=torch.int8),
        torch.nn.Parameter(torch.zeros(2, 2, dtype=torch.float64)),
        torch.sparse_coo_tensor([[0, 2]], [1.0, 2.0], (5,)),  # no nbytes: its dense size
    ]
    expected = sum(t.numel() * t.element_size() for t in tensors) + 21
    assert cache_bytes([tensors, (base, Duck())]) == expected  # base twice, counted once
    assert cache_bytes([[], None]) is None


def test_cache_bytes_reads_plain_objects_from_their_dictionary_as_getattr_would():
    """An object whose class defines none of the names read (a DynamicCache, its layers) is read
    from its dictionary; a property, a ``__getattr__``, a callable part and an object holding
    ``numel``/``element_size`` of its own are read as ``getattr`` reads them."""
    from otel_generate import figures

    a, b, c, d = (torch.zeros(n, dtype=torch.float32) for n in (1, 2, 3, 5))

    class Layer:  # plain: keys and values in the instance dictionary
        def __init__(self, keys, values):
            self.keys, self.values, self.device = keys, values, "cpu"

    class Cache:
        def __init__(self, layers):
            self.layers, self.key_cache = layers, len  # a callable part is skipped

    class ByProperty:  # the class defines "keys": read through it
        values = None

        @property
        def keys(self):
            return d

    class ByGetattr:
        def __getattr__(self, name):
            if name == "values":
                return c
            raise AttributeError(name)

    class OwnSize:  # numel and element_size of its own: counted as a tensor-like object
        def __init__(self):
            self.numel, self.element_size, self.keys = (lambda: 4), (lambda: 2), a

    class Layered:  # a DynamicCache's shape: counted without the walk, each tensor once
        def __init__(self, layers):
            self.layers, self.offloading = layers, False

    layered = Layered([Layer(a, b), Layer(b, None), Layer(None, None)])
    assert figures._layered_cache_bytes(layered) == (1 + 2) * 4 == figures.cache_bytes(layered)
    layered.layers[1].value_cache = [c]  # another part in a layer: walked
    assert figures._layered_cache_bytes(layered) is None and figures.cache_bytes(layered) == (1 + 2 + 3) * 4
    assert figures._layered_cache_bytes(Layered([Layer(a, torch.nn.Parameter(d))])) is None  # not a plain tensor
    assert figures.cache_bytes(Layered([Layer(a, torch.nn.Parameter(d))])) == (1 + 5) * 4

    class Slotted:
        __slots__ = ("keys",)

    slotted = Slotted()
    slotted.keys = c
    # no instance dictionary: walked, not read through vars() (the slotted layer's keys counted too)
    for odd, expected in ((None, 1 + 2), (object(), 1 + 2), (slotted, 1 + 2 + 3)):
        assert not figures._names_in_dict(type(odd))
        assert figures.cache_bytes(Layered([odd, Layer(a, b)])) == expected * 4
    assert figures.cache_bytes(None) is None and figures.cache_bytes(slotted) == 3 * 4
    cache = Cache([Layer(a, b), Layer(b, None)])
    assert figures._names_in_dict(Cache) and figures._names_in_dict(Layer)
    assert not figures._names_in_dict(ByProperty) and not figures._names_in_dict(ByGetattr)
    assert figures.cache_bytes(cache) == (1 + 2) * 4
    assert figures.cache_bytes([cache, ByProperty(), ByGetattr()]) == (1 + 2 + 5 + 3) * 4
    assert figures.cache_bytes(OwnSize()) == 8  # its own size; its keys are not walked
    only_one = Layer(a, None)
    only_one.numel = lambda: 100  # numel alone: not tensor-like, its parts are walked
    assert figures.cache_bytes(only_one) == 4


def test_peak_memory_on_cuda_is_read_after_a_reset(instrumented, span_exporter, gpt2, monkeypatch):
    """A faked CUDA device: the peak statistic is reset when the request starts and read when it ends."""
    from otel_generate import clock

    calls = []
    monkeypatch.setattr(clock, "devices_of", lambda model: ["cuda:0"])
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: calls.append(("reset", device)))

    def max_memory_allocated(device=None):
        calls.append(("peak", device))
        return 123456789

    monkeypatch.setattr(torch.cuda, "max_memory_allocated", max_memory_allocated)
    ids, mask = prompt(seed=59)
    gpt2.generate(ids, attention_mask=mask, max_new_tokens=3, eos_token_id=None)
    assert calls == [("reset", "cuda:0"), ("peak", "cuda:0")]
    assert only_request(span_exporter).attributes[A.GENERATE_MEMORY_PEAK_ALLOCATED] == 123456789


def test_cpu_requests_have_no_memory_figure(instrumented, span_exporter, gpt2):
    ids, mask = prompt(seed=60)
    gpt2.generate(ids, attention_mask=mask, max_new_tokens=3, eos_token_id=None)
    assert A.GENERATE_MEMORY_PEAK_ALLOCATED not in only_request(span_exporter).attributes


def test_prompt_lookup_counts_proposed_and_accepted_candidates(instrumented, span_exporter, gpt2):
    from tests.integration.test_generate_loop import NoEos, _repetitive_prompt

    ids, mask = _repetitive_prompt(gpt2)
    gpt2.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=20,
        prompt_lookup_num_tokens=5,
        logits_processor=LogitsProcessorList([NoEos()]),
    )
    request = only_request(span_exporter)
    steps = step_spans(span_exporter, request)
    accepted = sum(s.attributes[A.GENERATE_STEP_TOKENS] - 1 for s in steps)
    assert accepted > 0  # the repetitive prompt makes prompt lookup's candidates right
    attrs = request.attributes
    assert attrs[A.GENERATE_ASSISTED_ACCEPTED] == accepted
    assert attrs[A.GENERATE_ASSISTED_PROPOSED] >= accepted
    assert attrs[A.GENERATE_ASSISTED_ACCEPTANCE_RATE] == pytest.approx(accepted / attrs[A.GENERATE_ASSISTED_PROPOSED])
    assert attrs[A.GENERATE_ASSISTED_GENERATOR] == "PromptLookupCandidateGenerator"
