"""Reliability in production: never lose a span silently, never break generate(), never leak.

Each test names one guarantee of docs/production.md ("Operating in production"):

1. concurrency: threads sharing one model get exactly their own step spans;
2. processes: fork and spawn workers set up with the post-fork recipe export their spans;
3. no leak: memory held by otel_generate does not grow with requests, no request state outlives its call;
4. limits: the ``max_step_spans`` cap, the request span keeping totals and saying how many steps were not
   emitted, and a generation longer than the BatchSpanProcessor's queue losing nothing;
5. attribute limits: the contract survives the SDK's default and tight-but-realistic span limits, and
   limits below the contract size are reported by the SDK (not silent);
6. off means off: uninstrumented, suppressed, unsampled: no step hook call, no device synchronize;
7. other instrumentations alongside: ``opentelemetry-instrument`` plus a manual ``instrument()``, the
   threading instrumentation (the Flask case is ``tests/integration/test_flask_correlation.py``);
8. bad configuration: unparsable environment values, invalid ``instrument()`` keywords;
9. fault injection: exporters, span processors, the clock and the device synchronize raising.

The hypothesis property test of the token accounting is
``tests/integration/test_token_accounting_property.py``.
"""

from __future__ import annotations

import gc
import json
import logging
import multiprocessing
import os
import pathlib
import socket
import subprocess
import sys
import threading
import tracemalloc
import warnings
import weakref

import pytest
import torch
import wrapt
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.instrumentation.utils import suppress_instrumentation
from opentelemetry.sdk.trace import SpanLimits, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags
from transformers.generation.utils import GenerationMixin

import otel_generate
from otel_generate import GenerateInstrumentor, _faults, clock
from otel_generate import attributes as A
from otel_generate.bench.models import build_model
from otel_generate.integrations import loop_state
from otel_generate.integrations import step_hook as _recorder
from otel_generate.integrations._routing import _ACTIVE
from tests.helpers import (
    console_spans,
    contract_table,
    only_request,
    prompt,
    request_spans,
    step_spans,
    uninstrumented_generate,
)
from tests.helpers.instrumenting import LOGGER, DrainingSpanExporter, instrumentation, warnings_from_package

#: The attributes every successful request span carries (greedy, one sequence per prompt).
REQUEST_CONTRACT = {
    A.GEN_AI_OPERATION_NAME,
    A.GEN_AI_PROVIDER_NAME,
    A.GEN_AI_REQUEST_MODEL,
    A.GEN_AI_RESPONSE_MODEL,
    A.GEN_AI_REQUEST_MAX_TOKENS,
    A.GEN_AI_USAGE_INPUT_TOKENS,
    A.GEN_AI_USAGE_OUTPUT_TOKENS,
    A.GEN_AI_RESPONSE_FINISH_REASONS,
    A.GENERATE_STEPS,
    A.GENERATE_TIME_TO_FIRST_TOKEN,
    A.GENERATE_TIME_PER_OUTPUT_TOKEN,
    A.GENERATE_BATCH_SIZE,
    A.GENERATE_NUM_BEAMS,
    A.GENERATE_STRATEGY,
    A.GENERATE_DEVICE,
    A.GENERATE_SYNCHRONIZED,
    A.GENERATE_STEP_SPANS_DROPPED,
    A.GENERATE_STEP_SPANS_POLICY,
    A.GENERATE_STEP_SPANS_EMITTED,
    A.GENERATE_STEP_LATENCIES,
    A.GENERATE_STEP_OUTLIERS,
}
#: Present when the key/value cache object was reachable (every transformers 5.x request; a 4.x model
#: that keeps legacy tuples only with return_dict_in_generate=True).
CACHE_FIGURE = {A.GENERATE_KV_CACHE_SIZE}
#: Added when sampling / when more than one sequence per prompt is returned.
SAMPLING_CONTRACT = {A.GEN_AI_REQUEST_TEMPERATURE, A.GEN_AI_REQUEST_TOP_P, A.GEN_AI_REQUEST_TOP_K}
CHOICES_CONTRACT = {A.GEN_AI_REQUEST_CHOICE_COUNT}
#: Added when a streamer is passed (and the request is timed) / when stop_strings are given.
STREAM_CONTRACT = {A.GEN_AI_REQUEST_STREAM, A.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK, A.GENERATE_STREAMER_DURATION}
STOP_CONTRACT = {A.GEN_AI_REQUEST_STOP_SEQUENCES}
STEP_CONTRACT = {A.GENERATE_STEP_INDEX, A.GENERATE_TOKEN_INDEX, A.GENERATE_STEP_TOKENS, A.GENERATE_STEP_LATENCY}
#: An outlier factor no step reaches: tests comparing exact attribute sets must not depend on machine noise
#: (a step 3 times slower than the median gets generate.step.outlier).
NO_OUTLIERS = 1e9
#: A bound on the attributes of a request span: every attribute of the contract's request-span table
#: (docs/production.md: keep attribute count limits at or above it).
MAX_REQUEST_ATTRIBUTES = len(contract_table("## Request span"))


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def provider_with(processor_factory=SimpleSpanProcessor, exporter=None, **provider_kwargs):
    exporter = exporter if exporter is not None else DrainingSpanExporter()
    provider = TracerProvider(**provider_kwargs)
    provider.add_span_processor(processor_factory(exporter))
    return provider, exporter


@pytest.fixture
def fresh_fault_log(monkeypatch):
    """Faults are logged once per kind per process: start each test from an empty record."""
    monkeypatch.setattr(_faults, "_logged_kinds", set())


# --- 1. concurrency ------------------------------------------------------------------------------------


def test_four_threads_on_one_model_each_request_gets_exactly_its_own_steps(
    instrumented, span_exporter, tracer_provider, gpt2
):
    """4 threads x 10 requests at once on one model: 40 request spans, each with its own step spans."""
    new_tokens = {0: 2, 1: 3, 2: 4, 3: 5}  # a thread's requests are recognisable by their step count
    batch = {0: 1, 1: 2, 2: 1, 3: 3}
    tracer = tracer_provider.get_tracer("app")
    barrier = threading.Barrier(4)
    results, errors = {}, []

    def inputs(thread, i):
        return prompt(batch=batch[thread], length=3 + thread, seed=100 * thread + i)

    def worker(thread):
        try:
            barrier.wait(timeout=60)
            for i in range(10):
                ids, mask = inputs(thread, i)
                with tracer.start_as_current_span(f"handle_request {thread}.{i}") as app:
                    out = gpt2.generate(ids, attention_mask=mask, max_new_tokens=new_tokens[thread], eos_token_id=None)
                results[(thread, i)] = (out, app.get_span_context().span_id)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,), name=f"generate-{t}") for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads) and not errors, errors
    assert len(results) == 40

    # outputs are those of a sequential, uninstrumented run
    for (thread, i), (out, _) in results.items():
        ids, mask = inputs(thread, i)
        expected = uninstrumented_generate(
            gpt2, ids, attention_mask=mask, max_new_tokens=new_tokens[thread], eos_token_id=None
        )
        assert torch.equal(out, expected)

    requests = request_spans(span_exporter)
    assert len(requests) == 40
    owner = {span_id: key for key, (_, span_id) in results.items()}
    request_ids = {r.context.span_id for r in requests}
    all_steps = step_spans(span_exporter)
    # every step span belongs to one of the 40 requests, and to none other
    assert {s.parent.span_id for s in all_steps} == request_ids
    assert len(all_steps) == 10 * sum(new_tokens.values())
    seen = set()
    for request in requests:
        thread, i = owner[request.parent.span_id]
        seen.add((thread, i))
        out, _ = results[(thread, i)]
        prompt_length = 3 + thread
        steps = step_spans(span_exporter, request)
        assert len(steps) == new_tokens[thread] == out.shape[-1] - prompt_length
        attrs = request.attributes
        assert attrs[A.GENERATE_STEPS] == new_tokens[thread]
        assert attrs[A.GENERATE_BATCH_SIZE] == batch[thread]
        assert attrs[A.GEN_AI_USAGE_INPUT_TOKENS] == batch[thread] * prompt_length
        assert attrs[A.GEN_AI_USAGE_OUTPUT_TOKENS] == batch[thread] * new_tokens[thread]
        assert [s.attributes[A.GENERATE_STEP_INDEX] for s in steps] == list(range(new_tokens[thread]))
        assert [s.attributes[A.GENERATE_TOKEN_INDEX] for s in steps] == list(range(new_tokens[thread]))
        for step in steps:
            assert step.context.trace_id == request.context.trace_id
            assert request.start_time <= step.start_time <= step.end_time <= request.end_time
        for before, after in zip(steps, steps[1:]):
            assert after.start_time == before.end_time
    assert len(seen) == 40


# --- 2. processes ----------------------------------------------------------------------------------------


def post_fork_setup(spans_path):
    """docs/production.md's post-fork recipe (gunicorn ``post_fork`` / Celery ``worker_process_init``).

    A provider and a BatchSpanProcessor of the worker's own, then ``instrument()`` in the worker. The
    exporter writes JSON lines to ``spans_path`` (a stand-in for an OTLP exporter to a collector).
    """
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace.export import ConsoleSpanExporter

    provider = TracerProvider(resource=Resource.create({"service.name": "generate-worker", "process.pid": os.getpid()}))
    out = open(spans_path, "w", encoding="utf-8")
    provider.add_span_processor(
        BatchSpanProcessor(ConsoleSpanExporter(out=out, formatter=lambda span: span.to_json(indent=None) + "\n"))
    )
    GenerateInstrumentor().instrument(tracer_provider=provider)
    return provider


def serve_in_worker(model, spans_path, jobs):
    """A pre-fork server's worker: post-fork set-up, requests, then the ``worker_exit`` flush."""
    torch.set_num_threads(1)
    provider = post_fork_setup(spans_path)
    try:
        if model is None:  # spawn: the worker builds (loads) its own model
            model = build_model("gpt2", seed=0)
        tracer = provider.get_tracer("worker")
        for seed, new_tokens in jobs:
            ids, mask = prompt(length=4, seed=seed)
            with tracer.start_as_current_span("handle_request"):
                model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, eos_token_id=None)
    finally:
        provider.shutdown()  # a forked worker exits with os._exit: atexit handlers do not flush


@pytest.mark.parametrize("start_method", ["fork", "spawn"])
def test_requests_in_multiprocessing_workers_reach_the_exporter(start_method, gpt2, tmp_path):
    if start_method not in multiprocessing.get_all_start_methods():
        pytest.skip(f"no {start_method} start method on this platform")
    # the documented set-up: nothing instrumented in the parent (the pre-fork master)
    assert not GenerateInstrumentor().is_instrumented_by_opentelemetry
    context = multiprocessing.get_context(start_method)
    # two forked workers share the master's preloaded model; one spawned worker builds its own (it
    # re-imports torch and transformers: seconds)
    if start_method == "fork":
        jobs, model = {0: [(1, 2), (2, 3)], 1: [(3, 4), (4, 5)]}, gpt2
    else:
        jobs, model = {0: [(1, 2), (2, 3)]}, None
    workers = []
    for worker, worker_jobs in jobs.items():
        path = tmp_path / f"spans-{worker}.jsonl"
        process = context.Process(target=serve_in_worker, args=(model, str(path), worker_jobs))
        process.start()
        workers.append((process, path, worker_jobs))
    try:
        for process, _, _ in workers:
            process.join(timeout=240)
    finally:
        for process, _, _ in workers:
            if process.is_alive():  # hung: fail below, but leave no process behind
                process.kill()
                process.join(timeout=10)
    for process, path, worker_jobs in workers:
        assert process.exitcode == 0, f"worker {process.pid} exited with {process.exitcode}"
        spans = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
        assert {s["resource"]["attributes"]["process.pid"] for s in spans} == {process.pid}
        assert process.pid != os.getpid()
        requests = [s for s in spans if s["name"].startswith("text_completion ")]
        apps = {s["context"]["span_id"] for s in spans if s["name"] == "handle_request"}
        assert len(requests) == len(worker_jobs) == len(apps)
        for request, (_, new_tokens) in zip(
            sorted(requests, key=lambda s: s["attributes"][A.GENERATE_STEPS]),
            sorted(worker_jobs, key=lambda job: job[1]),
        ):
            assert request["parent_id"] in apps
            steps = [s for s in spans if s["parent_id"] == request["context"]["span_id"]]
            assert sorted(s["attributes"][A.GENERATE_STEP_INDEX] for s in steps) == list(range(new_tokens))
            assert request["attributes"][A.GEN_AI_USAGE_OUTPUT_TOKENS] == new_tokens
            assert request["attributes"][A.GENERATE_STEP_SPANS_DROPPED] == 0


# --- 3. no leak --------------------------------------------------------------------------------------------


class CountingProcessor(SpanProcessor):
    """Keeps nothing: counts ended request and step spans (so the loop is known to be instrumented)."""

    def __init__(self):
        self.requests = 0
        self.steps = 0

    def on_end(self, span):
        if span.name.startswith(A.OPERATION_TEXT_COMPLETION + " "):
            self.requests += 1
        elif span.name in (A.STEP_SPAN_PREFILL, A.STEP_SPAN_DECODE):
            self.steps += 1


def _package_bytes(snapshot):
    package_dir = os.path.dirname(otel_generate.__file__)
    filtered = snapshot.filter_traces([tracemalloc.Filter(True, os.path.join(package_dir, "*"))])
    return sum(stat.size for stat in filtered.statistics("filename"))


def _alive(cls):
    with warnings.catch_warnings():  # isinstance() on some torch objects warns about deprecated names
        warnings.simplefilter("ignore")
        return [o for o in gc.get_objects() if isinstance(o, cls)]


@pytest.mark.slow
def test_two_thousand_requests_do_not_grow_memory_held_by_the_package(gpt2, meter_provider):
    """tracemalloc: what otel_generate's own code allocated and still holds is the same after 200 and 2000."""
    counter = CountingProcessor()
    provider = TracerProvider()
    provider.add_span_processor(counter)
    ids, mask = prompt(length=3)
    before = otel_context.get_current()
    was_tracing = tracemalloc.is_tracing()
    tracemalloc.start()
    try:
        with instrumentation(tracer_provider=provider, meter_provider=meter_provider):
            for _ in range(200):
                gpt2.generate(ids, attention_mask=mask, max_new_tokens=2, eos_token_id=None)
            gc.collect()
            after_200 = _package_bytes(tracemalloc.take_snapshot())
            for _ in range(1800):
                gpt2.generate(ids, attention_mask=mask, max_new_tokens=2, eos_token_id=None)
            gc.collect()
            after_2000 = _package_bytes(tracemalloc.take_snapshot())
    finally:
        if not was_tracing:
            tracemalloc.stop()
    assert counter.requests == 2000 and counter.steps == 4000
    # a constant (caches, the fault log) is allowed; 1800 requests leaking even 3 bytes each is not
    assert after_2000 - after_200 <= 4096, (after_200, after_2000)
    assert _alive(loop_state.Call) == _alive(loop_state.Loop) == [] and _alive(_recorder.StepRecorder) == []
    assert _ACTIVE.get() is None
    assert otel_context.get_current() == before


def test_request_state_dies_with_its_request(instrumented, span_exporter, gpt2):
    """No Call, Loop or StepRecorder outlives its generate() call, not even until the next gc run.

    The request holds the prompt tensors and the user's keyword arguments (device memory for a GPU
    model); a reference cycle would keep them until a cyclic garbage collection, which for objects
    that reached the oldest generation can be a long time.
    """
    ids, mask = prompt(length=5)
    created = []
    originals = {cls: cls.__init__ for cls in (loop_state.Call, loop_state.Loop, _recorder.StepRecorder)}

    def tracking(cls):
        def init(self, *args, **kwargs):
            created.append(weakref.ref(self))
            originals[cls](self, *args, **kwargs)

        return init

    cases = [
        dict(max_new_tokens=3),
        dict(max_new_tokens=3, num_beams=2),
        dict(max_new_tokens=3, return_dict_in_generate=True, output_scores=True),
        dict(max_new_tokens=-1),  # raises inside generate()
    ]
    gc.collect()
    with pytest.MonkeyPatch.context() as patch:
        for cls in originals:
            patch.setattr(cls, "__init__", tracking(cls))
        gc.disable()
        try:
            for kwargs in cases:
                created.clear()
                try:
                    out = gpt2.generate(ids, attention_mask=mask, eos_token_id=None, **kwargs)
                except ValueError:
                    out = None
                del out
                assert _ACTIVE.get() is None
                assert created, "the instrumentation did not run"
                alive = [type(ref()).__name__ for ref in created if ref() is not None]
                assert alive == [], f"{alive} outlived generate({kwargs}) (kept alive by a reference cycle)"
        finally:
            gc.enable()
    assert len(request_spans(span_exporter)) == len(cases)


# --- 4. limits ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("how, cap", [("keyword", 5), ("environment", 5), ("environment", 0)])
def test_step_span_cap_keeps_totals_and_states_what_was_not_emitted(how, cap, no_package_env, monkeypatch, gpt2):
    provider, exporter = provider_with()
    options = {"tracer_provider": provider}
    if how == "keyword":
        options["max_step_spans"] = cap
    else:
        monkeypatch.setenv("OTEL_GENERATE_MAX_STEP_SPANS", str(cap))
    ids, mask = prompt(length=4, seed=20)
    with instrumentation(**options):
        out = gpt2.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=12,
            eos_token_id=None,
            return_dict_in_generate=True,
            track_token_latency=True,
        )
    latencies_s = list(out.token_latencies)  # every step, from the same clock
    assert len(latencies_s) == 12

    request = only_request(exporter)
    steps = step_spans(exporter, request)
    attrs = request.attributes
    assert len(step_spans(exporter)) == len(steps) == cap
    assert [s.attributes[A.GENERATE_STEP_INDEX] for s in steps] == list(range(cap))  # the first ones
    assert [s.attributes[A.GENERATE_STEP_LATENCY] for s in steps] == pytest.approx(latencies_s[:cap])
    assert attrs[A.GENERATE_STEPS] == 12
    assert attrs[A.GENERATE_STEP_SPANS_DROPPED] == 12 - cap
    assert attrs[A.GEN_AI_USAGE_OUTPUT_TOKENS] == 12
    # the summary is computed from all 12 steps, not only from the emitted ones
    assert attrs[A.GENERATE_TIME_TO_FIRST_TOKEN] == pytest.approx(latencies_s[0])
    assert attrs[A.GENERATE_TIME_PER_OUTPUT_TOKEN] == pytest.approx(sum(latencies_s[1:]) / 11)
    assert A.GENERATE_STEPS_INCOMPLETE not in attrs


class StalledExporter(SpanExporter):
    """A collector that hangs: every export blocks until released, then keeps what it got."""

    def __init__(self):
        self.entered = threading.Event()
        self.release = threading.Event()
        self.threads = set()
        self.spans = []
        self._lock = threading.Lock()

    def export(self, spans):
        self.entered.set()
        self.threads.add(threading.get_ident())
        self.release.wait(120)
        with self._lock:
            self.spans.extend(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self):
        self.release.set()


def test_generation_longer_than_the_batch_queue_loses_nothing_silently(no_package_env, caplog):
    """2,100 steps (the BatchSpanProcessor's default queue holds 2,048 spans) with the collector stalled.

    With the default cap (1,024 step spans) one request's spans fit the queue: every emitted span
    arrives, and the request span states the number of steps not emitted as spans.
    """
    steps_wanted = 2100
    model = build_model("gpt2", seed=0, max_positions=steps_wanted + 64)
    exporter = StalledExporter()
    processor = BatchSpanProcessor(exporter)
    queue_size = getattr(getattr(processor, "_batch_processor", processor), "_max_queue_size", None)
    assert queue_size in (None, 2048)  # the SDK's default (OTEL_BSP_MAX_QUEUE_SIZE); private, so when visible
    provider = TracerProvider()
    provider.add_span_processor(processor)
    ids, mask = prompt(length=4, seed=21)
    try:
        with caplog.at_level(logging.WARNING), instrumentation(tracer_provider=provider):
            out = model.generate(ids, attention_mask=mask, max_new_tokens=steps_wanted, eos_token_id=None)
            # generate() returned while the exporter is stuck: export never runs on the caller's thread
            assert exporter.entered.wait(60)
            assert threading.get_ident() not in exporter.threads
            exporter.release.set()
            assert provider.force_flush(60_000)
    finally:
        exporter.release.set()
        provider.shutdown()
    assert out.shape[-1] - 4 == steps_wanted
    requests = [s for s in exporter.spans if s.name.startswith(A.OPERATION_TEXT_COMPLETION + " ")]
    steps = [s for s in exporter.spans if s.name in (A.STEP_SPAN_PREFILL, A.STEP_SPAN_DECODE)]
    assert len(requests) == 1
    attrs = requests[0].attributes
    assert len(steps) == otel_generate.DEFAULT_MAX_STEP_SPANS == 1024
    assert sorted(s.attributes[A.GENERATE_STEP_INDEX] for s in steps) == list(range(1024))
    assert {s.parent.span_id for s in steps} == {requests[0].context.span_id}
    assert attrs[A.GENERATE_STEPS] == steps_wanted
    assert attrs[A.GENERATE_STEP_SPANS_DROPPED] == steps_wanted - 1024
    assert attrs[A.GEN_AI_USAGE_OUTPUT_TOKENS] == steps_wanted
    assert not [r for r in caplog.records if "queue" in r.getMessage().lower()]  # the SDK dropped nothing


# --- 5. attribute limits ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "limits",
    [None, "tight"],
    ids=["sdk-defaults", "32-attributes-64-chars"],
)
def test_contract_attributes_survive_span_limits(limits, no_package_env, gpt2):
    span_limits = SpanLimits() if limits is None else SpanLimits(max_span_attributes=32, max_span_attribute_length=64)
    if limits is None:
        assert span_limits.max_span_attributes == 128 and span_limits.max_span_attribute_length is None
    provider, exporter = provider_with(span_limits=span_limits)
    ids, mask = prompt(batch=2, length=4, seed=22)
    with instrumentation(tracer_provider=provider, outlier_factor=NO_OUTLIERS):
        torch.manual_seed(0)
        gpt2.generate(
            ids, attention_mask=mask, max_new_tokens=4, eos_token_id=None, do_sample=True, num_return_sequences=2
        )
        gpt2.generate(ids, attention_mask=mask, max_new_tokens=4, eos_token_id=None)
    sampled, greedy = sorted(request_spans(exporter), key=lambda s: s.start_time)
    assert set(sampled.attributes) - CACHE_FIGURE == REQUEST_CONTRACT | SAMPLING_CONTRACT | CHOICES_CONTRACT
    assert set(greedy.attributes) - CACHE_FIGURE == REQUEST_CONTRACT
    assert sampled.attributes[A.GEN_AI_REQUEST_MODEL] == type(gpt2).__name__  # not truncated
    assert sampled.attributes[A.GEN_AI_RESPONSE_FINISH_REASONS] == ("length",) * 4
    assert len(step_spans(exporter)) == 8
    for span in exporter.get_finished_spans():
        assert span.dropped_attributes == 0, span.name
        if span.name in (A.STEP_SPAN_PREFILL, A.STEP_SPAN_DECODE):
            assert set(span.attributes) == STEP_CONTRACT


def test_the_largest_request_span_fits_the_documented_bound(
    no_package_env, fresh_fault_log, monkeypatch, gpt2, tokenizer
):
    """Sampling, several sequences, a streamer, stop strings, the slow policy's reason, content capture
    and a fault (incomplete): every attribute kept under a limit of MAX_REQUEST_ATTRIBUTES."""
    from transformers.generation.streamers import BaseStreamer

    assert MAX_REQUEST_ATTRIBUTES == 57  # docs/production.md states this number
    monkeypatch.setattr(clock, "devices_of", lambda model: ["cuda:0"])

    def broken_synchronize(device=None):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    class Sink(BaseStreamer):
        def put(self, value):
            pass

        def end(self):
            pass

    monkeypatch.setattr(torch.cuda, "synchronize", broken_synchronize)
    provider, exporter = provider_with(span_limits=SpanLimits(max_span_attributes=MAX_REQUEST_ATTRIBUTES))
    ids, mask = prompt(length=4, seed=23)
    with instrumentation(
        tracer_provider=provider,
        step_spans="slow",
        slow_time_to_first_token=1e-9,
        capture_message_content=True,
        measure_memory=False,
    ):
        torch.manual_seed(0)
        gpt2.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=3,
            eos_token_id=None,
            do_sample=True,
            num_return_sequences=2,
            streamer=Sink(),
            stop_strings=["zz"],
            tokenizer=tokenizer,
        )
    request = only_request(exporter)
    assert request.dropped_attributes == 0
    expected = (
        REQUEST_CONTRACT
        | SAMPLING_CONTRACT
        | CHOICES_CONTRACT
        | STREAM_CONTRACT
        | STOP_CONTRACT
        | {A.GENERATE_STEPS_INCOMPLETE, A.GEN_AI_INPUT_MESSAGES, A.GEN_AI_OUTPUT_MESSAGES}
        | {A.GENERATE_STEP_SPANS_REASON}
    )
    assert set(request.attributes) - CACHE_FIGURE == expected, set(request.attributes) ^ expected
    assert len(request.attributes) <= len(expected | CACHE_FIGURE) <= MAX_REQUEST_ATTRIBUTES
    assert set(request.attributes) <= set(contract_table("## Request span"))
    assert request.attributes[A.GENERATE_STEPS_INCOMPLETE] is True


def test_limits_below_the_contract_are_reported_not_silent(no_package_env, gpt2):
    """Below the contract size the SDK evicts the oldest attributes and counts them as dropped."""
    ids, mask = prompt(length=4, seed=24)
    provider, exporter = provider_with()  # the SDK's defaults: how many attributes this request has
    with instrumentation(tracer_provider=provider, outlier_factor=NO_OUTLIERS):
        gpt2.generate(ids, attention_mask=mask, max_new_tokens=3, eos_token_id=None)
    total = len(only_request(exporter).attributes)
    assert total >= len(REQUEST_CONTRACT)
    provider, exporter = provider_with(span_limits=SpanLimits(max_span_attributes=8))
    with instrumentation(tracer_provider=provider, outlier_factor=NO_OUTLIERS):
        gpt2.generate(ids, attention_mask=mask, max_new_tokens=3, eos_token_id=None)
    request = only_request(exporter)
    assert len(request.attributes) == 8
    assert request.dropped_attributes == total - 8
    # the three attributes set when the span starts are the oldest, so the first evicted
    assert A.GEN_AI_OPERATION_NAME not in request.attributes
    for step in step_spans(exporter, request):  # 4 attributes: untouched
        assert set(step.attributes) == STEP_CONTRACT and step.dropped_attributes == 0


# --- 6. off means off ---------------------------------------------------------------------------------------


@pytest.fixture
def hot_path_calls(monkeypatch, count_recorders):
    """Count recorders built ("init"), step hook calls ("call") and device synchronizations, model on a fake cuda:0."""
    calls = count_recorders
    calls["synchronize"] = 0

    def counting_synchronize(device=None):
        calls["synchronize"] += 1

    monkeypatch.setattr(clock, "devices_of", lambda model: ["cuda:0"])
    monkeypatch.setattr(torch.cuda, "synchronize", counting_synchronize)
    return calls


def _unsampled_parent():
    parent = SpanContext(trace_id=0x1234, span_id=0x5678, is_remote=True, trace_flags=TraceFlags(TraceFlags.DEFAULT))
    return trace.set_span_in_context(NonRecordingSpan(parent))


@pytest.mark.parametrize(
    "mode", ["never instrumented", "uninstrumented", "suppressed", "always_off sampler", "parent not sampled"]
)
def test_off_means_no_hook_and_no_synchronize(mode, hot_path_calls, no_package_env, gpt2):
    ids, mask = prompt(length=4, seed=25)
    kwargs = dict(attention_mask=mask, max_new_tokens=4, eos_token_id=None)
    expected = uninstrumented_generate(gpt2, ids, **kwargs)
    provider, exporter = provider_with(sampler=ALWAYS_OFF if mode == "always_off sampler" else None)
    instrumentor = GenerateInstrumentor()
    if mode == "uninstrumented":
        instrumentor.instrument(tracer_provider=provider)
        instrumentor.uninstrument()
        assert not isinstance(
            GenerationMixin.__dict__["generate"], getattr(wrapt, "BaseObjectProxy", wrapt.ObjectProxy)
        )
    elif mode != "never instrumented":
        instrumentor.instrument(tracer_provider=provider)
    try:
        if mode == "suppressed":
            with suppress_instrumentation():
                out = gpt2.generate(ids, **kwargs)
        elif mode == "parent not sampled":
            token = otel_context.attach(_unsampled_parent())
            try:
                out = gpt2.generate(ids, **kwargs)
            finally:
                otel_context.detach(token)
        else:
            out = gpt2.generate(ids, **kwargs)
    finally:
        if instrumentor.is_instrumented_by_opentelemetry:
            instrumentor.uninstrument()
    assert torch.equal(out, expected)
    assert hot_path_calls == {"init": 0, "call": 0, "synchronize": 0}
    assert exporter.get_finished_spans() == ()

    # the same counting sees the work when the instrumentation is on: start + 4 steps + end
    with instrumentation(tracer_provider=provider_with()[0]):
        on = gpt2.generate(ids, **kwargs)
    assert torch.equal(on, expected)
    assert hot_path_calls == {"init": 1, "call": 4, "synchronize": 6}


# --- 7. other instrumentations alongside ---------------------------------------------------------------

APP = """
import sys
import torch
from opentelemetry import trace
from otel_generate import GenerateInstrumentor
from otel_generate.bench.models import build_model

torch.set_num_threads(1)
GenerateInstrumentor().instrument(max_step_spans=2)  # the application's own manual call
model = build_model("gpt2", seed=0)
ids = torch.randint(1, 126, (1, 4), generator=torch.Generator().manual_seed(0))
tracer = trace.get_tracer("app")
for new_tokens in (3, 5):
    with tracer.start_as_current_span("handle_request %d" % new_tokens):
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, eos_token_id=None)
"""


@pytest.mark.parametrize("auto", ["enabled", "disabled"])
def test_opentelemetry_instrument_plus_manual_instrument_gives_one_request_span_per_call(auto, tmp_path):
    """Under ``opentelemetry-instrument`` the app's own ``instrument()`` call adds nothing.

    The auto-instrumentation instruments first, so the manual call is a no-op (its options too);
    with ``OTEL_PYTHON_DISABLED_INSTRUMENTATIONS=transformers_generate`` the manual call is the one.
    """
    app = tmp_path / "app.py"
    app.write_text(APP, encoding="utf-8")
    instrument = pathlib.Path(sys.executable).with_name("opentelemetry-instrument")
    if not instrument.exists():
        pytest.skip("opentelemetry-instrument is not installed (opentelemetry-instrumentation)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(
        OTEL_SERVICE_NAME="manual-plus-auto",
        OTEL_TRACES_EXPORTER="console",
        OTEL_METRICS_EXPORTER="none",
        OTEL_LOGS_EXPORTER="none",
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="1",
    )
    if auto == "disabled":
        env["OTEL_PYTHON_DISABLED_INSTRUMENTATIONS"] = "transformers_generate"
    done = subprocess.run(
        [str(instrument), sys.executable, str(app)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=str(tmp_path),
    )
    assert done.returncode == 0, done.stderr
    if auto == "enabled":  # BaseInstrumentor's warning for the app's own, second, call
        assert "already instrumented" in done.stderr
    spans = console_spans(done.stdout)
    apps = {s["name"]: s for s in spans if s["name"].startswith("handle_request")}
    requests = [s for s in spans if s["name"].startswith("text_completion ")]
    assert set(apps) == {"handle_request 3", "handle_request 5"}
    assert len(requests) == 2  # one per call, never two
    cap = None if auto == "enabled" else 2  # the manual call's max_step_spans only counts when it instrumented
    for new_tokens in (3, 5):
        app_span = apps[f"handle_request {new_tokens}"]
        (request,) = [r for r in requests if r["parent_id"] == app_span["context"]["span_id"]]
        steps = [s for s in spans if s["parent_id"] == request["context"]["span_id"]]
        emitted = new_tokens if cap is None else min(cap, new_tokens)
        assert len(steps) == emitted
        assert request["attributes"][A.GENERATE_STEPS] == new_tokens
        assert request["attributes"][A.GENERATE_STEP_SPANS_DROPPED] == new_tokens - emitted


def test_threading_instrumentation_carries_the_app_span_into_plain_threads(
    instrumented, span_exporter, tracer_provider, gpt2
):
    threading_instrumentation = pytest.importorskip("opentelemetry.instrumentation.threading")
    from concurrent.futures import ThreadPoolExecutor

    tracer = tracer_provider.get_tracer("app")
    ids, mask = prompt(length=4, seed=26)
    kwargs = dict(attention_mask=mask, max_new_tokens=3, eos_token_id=None)

    def in_thread():
        thread = threading.Thread(target=gpt2.generate, args=(ids,), kwargs=kwargs)
        thread.start()
        thread.join(timeout=120)

    # without it, a plain thread starts from an empty context: the request span is a root
    with tracer.start_as_current_span("handle_request") as unrelated:
        in_thread()
    (orphan,) = request_spans(span_exporter)
    assert orphan.parent is None and orphan.context.trace_id != unrelated.get_span_context().trace_id
    span_exporter.clear()

    instrumentor = threading_instrumentation.ThreadingInstrumentor()
    instrumentor.instrument()
    try:
        with tracer.start_as_current_span("handle_request") as app_span:
            in_thread()
            with ThreadPoolExecutor(max_workers=1) as pool:
                pool.submit(gpt2.generate, ids, **kwargs).result(timeout=120)
    finally:
        instrumentor.uninstrument()
    requests = request_spans(span_exporter)
    assert len(requests) == 2
    for request in requests:
        assert request.parent.span_id == app_span.get_span_context().span_id
        assert request.context.trace_id == app_span.get_span_context().trace_id
        assert len(step_spans(span_exporter, request)) == 3


def test_asyncio_to_thread_keeps_the_callers_trace(instrumented, span_exporter, tracer_provider, gpt2):
    """``asyncio.to_thread`` (and Starlette/FastAPI's threadpool) copies the context into the worker."""
    import asyncio

    tracer = tracer_provider.get_tracer("app")
    ids, mask = prompt(length=4, seed=33)

    async def handler():
        with tracer.start_as_current_span("handle_request") as app_span:
            await asyncio.to_thread(gpt2.generate, ids, attention_mask=mask, max_new_tokens=3, eos_token_id=None)
        return app_span

    app_span = asyncio.run(handler())
    request = only_request(span_exporter)
    assert request.parent.span_id == app_span.get_span_context().span_id
    assert len(step_spans(span_exporter, request)) == 3


# --- 8. bad configuration ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "variable, value, option, default",
    [
        ("OTEL_GENERATE_SYNCHRONIZE", "maybe", "synchronize", True),
        ("OTEL_GENERATE_SYNCHRONIZE", "2", "synchronize", True),
        ("OTEL_GENERATE_MAX_STEP_SPANS", "lots", "max_step_spans", 1024),
        ("OTEL_GENERATE_MAX_STEP_SPANS", "-5", "max_step_spans", 1024),
        ("OTEL_GENERATE_MAX_STEP_SPANS", "12.5", "max_step_spans", 1024),
    ],
)
def test_unparsable_environment_value_warns_once_and_uses_the_default(
    variable,
    value,
    option,
    default,
    no_package_env,
    captured_telemetry,
    monkeypatch,
    caplog,
    tracer_provider,
    span_exporter,
    gpt2,
):
    monkeypatch.setenv(variable, value)
    ids, mask = prompt(length=4, seed=27)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        with instrumentation(tracer_provider=tracer_provider):
            GenerateInstrumentor().instrument(tracer_provider=tracer_provider)  # already on: no second warning
            gpt2.generate(ids, attention_mask=mask, max_new_tokens=3, eos_token_id=None)
    warnings = warnings_from_package(caplog)
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    message = warnings[0].getMessage()
    spelled = {True: "true", False: "false"}.get(default, str(default))  # as docs/configuration.md writes it
    assert variable in message and repr(value) in message and message.endswith(f"using the default {spelled}")
    (telemetry,) = captured_telemetry
    assert getattr(telemetry, option) == default
    request = only_request(span_exporter)
    assert request.attributes[A.GENERATE_SYNCHRONIZED] is True
    assert len(step_spans(span_exporter, request)) == 3


@pytest.mark.parametrize(
    "options, error, names",
    [
        (dict(synchronise=False, max_spans=3), TypeError, ["synchronise", "max_spans"]),
        (dict(max_step_spans="10"), TypeError, ["max_step_spans"]),
        (dict(max_step_spans=True), TypeError, ["max_step_spans"]),
        (dict(max_step_spans=2.0), TypeError, ["max_step_spans"]),
        (dict(synchronize=1), TypeError, ["synchronize"]),
        (dict(tracer_provider="http://localhost:4317"), TypeError, ["tracer_provider"]),
        (dict(meter_provider=object()), TypeError, ["meter_provider"]),
    ],
    ids=[
        "unknown-keywords",
        "max_step_spans-str",
        "max_step_spans-bool",
        "max_step_spans-float",
        "synchronize-int",
        "tracer_provider-str",
        "meter_provider-object",
    ],
)
def test_invalid_instrument_keyword_is_a_clear_error_and_changes_nothing(options, error, names):
    original = GenerationMixin.__dict__["generate"]
    with pytest.raises(error) as raised:
        GenerateInstrumentor().instrument(**options)
    for name in names:
        assert name in str(raised.value)
    assert not GenerateInstrumentor().is_instrumented_by_opentelemetry
    assert GenerationMixin.__dict__["generate"] is original


# --- 9. fault injection -------------------------------------------------------------------------------------


class RaisingExporter(SpanExporter):
    """A collector that is down: every export raises; it counts the spans it was offered."""

    def __init__(self):
        self.offered = 0

    def export(self, spans):
        self.offered += len(spans)
        raise ConnectionError("collector unreachable")

    def shutdown(self):
        pass


@pytest.mark.parametrize("processor", [SimpleSpanProcessor, BatchSpanProcessor])
def test_exporter_raising_on_every_export_does_not_touch_generate(processor, fresh_fault_log, caplog, gpt2):
    exporter = RaisingExporter()
    provider, _ = provider_with(processor, exporter)
    ids, mask = prompt(batch=2, length=4, seed=28)
    kwargs = dict(attention_mask=mask, max_new_tokens=5, eos_token_id=None)
    expected = uninstrumented_generate(gpt2, ids, **kwargs)
    with caplog.at_level(logging.WARNING), instrumentation(tracer_provider=provider):
        outs = [gpt2.generate(ids, **kwargs) for _ in range(2)]
        provider.force_flush()
    provider.shutdown()
    assert all(torch.equal(out, expected) for out in outs)
    assert exporter.offered == 2 * (1 + 5)  # every span was handed to the exporter
    # the SDK reports the failed exports; none of it is a fault of the instrumentation
    assert any("Exception while exporting" in r.getMessage() for r in caplog.records)
    assert warnings_from_package(caplog) == []


def test_collector_down_otlp_grpc_exporter_does_not_touch_generate(gpt2):
    """A real OTLP/gRPC exporter aimed at a closed 127.0.0.1 port, behind a BatchSpanProcessor."""
    otlp = pytest.importorskip("opentelemetry.exporter.otlp.proto.grpc.trace_exporter")
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    exporter = otlp.OTLPSpanExporter(endpoint=f"http://127.0.0.1:{port}", insecure=True, timeout=1)
    provider, _ = provider_with(BatchSpanProcessor, exporter)
    ids, mask = prompt(length=4, seed=29)
    kwargs = dict(attention_mask=mask, max_new_tokens=4, eos_token_id=None)
    expected = uninstrumented_generate(gpt2, ids, **kwargs)
    try:
        with instrumentation(tracer_provider=provider):
            out = gpt2.generate(ids, **kwargs)
    finally:
        provider.shutdown()
    assert torch.equal(out, expected)


class RaisingProcessor(SpanProcessor):
    """A broken third-party span processor (the SDK does not guard on_start/on_end)."""

    def __init__(self, where):
        self.where = where

    def on_start(self, span, parent_context=None):
        if self.where == "on_start":
            raise RuntimeError("processor on_start failed")

    def on_end(self, span):
        if self.where == "on_end":
            raise RuntimeError("processor on_end failed")


@pytest.mark.parametrize("where", ["on_start", "on_end"])
def test_span_processor_raising_does_not_break_generate(where, fresh_fault_log, caplog, gpt2):
    provider = TracerProvider()
    provider.add_span_processor(RaisingProcessor(where))
    ids, mask = prompt(length=4, seed=30)
    kwargs = dict(attention_mask=mask, max_new_tokens=4, eos_token_id=None)
    expected = uninstrumented_generate(gpt2, ids, **kwargs)
    with caplog.at_level(logging.WARNING, logger=LOGGER), instrumentation(tracer_provider=provider):
        outs = [gpt2.generate(ids, **kwargs) for _ in range(3)]
    assert all(torch.equal(out, expected) for out in outs)
    messages = [r.getMessage() for r in warnings_from_package(caplog)]
    assert messages, "the fault was not logged"
    kinds = [m.split(" failed ")[0] for m in messages]
    assert len(kinds) == len(set(kinds)), messages  # once per kind, not once per request
    assert _ACTIVE.get() is None


def _fault_records(caplog):
    return [r.getMessage() for r in warnings_from_package(caplog)]


@pytest.mark.parametrize("where", ["start", "step", "end"])
def test_synchronize_raising_is_logged_once_and_marks_the_request_incomplete(
    where, fresh_fault_log, monkeypatch, caplog, instrumented, span_exporter, gpt2
):
    new_tokens = 4
    fail_at = {"start": 1, "step": 3, "end": new_tokens + 2}[where]  # calls: start, 4 steps, end
    calls = {"n": 0}

    def failing_synchronize(device=None):
        calls["n"] += 1
        if calls["n"] == fail_at:
            raise RuntimeError("CUDA error: unspecified launch failure")

    monkeypatch.setattr(clock, "devices_of", lambda model: ["cuda:0"])
    monkeypatch.setattr(torch.cuda, "synchronize", failing_synchronize)
    ids, mask = prompt(length=4, seed=31)
    kwargs = dict(attention_mask=mask, max_new_tokens=new_tokens, eos_token_id=None)
    expected = uninstrumented_generate(gpt2, ids, **kwargs)
    outs = []
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for _ in range(2):  # the second request fails the same way: no second log line
            calls["n"] = 0
            outs.append(gpt2.generate(ids, **kwargs))
    assert all(torch.equal(out, expected) for out in outs)
    kind = "step hook" if where == "step" else "device synchronize"
    messages = _fault_records(caplog)
    assert len(messages) == 1 and messages[0].startswith(f"otel_generate: {kind} failed"), messages
    assert "unspecified launch failure" in messages[0]
    requests = request_spans(span_exporter)
    assert len(requests) == 2
    for request in requests:
        attrs = request.attributes
        assert attrs[A.GENERATE_STEPS_INCOMPLETE] is True
        assert attrs[A.GEN_AI_USAGE_OUTPUT_TOKENS] == new_tokens  # token accounting is not step data
        steps = step_spans(span_exporter, request)
        # a failed step sync stops the recording at that step; start/end faults keep every step
        assert len(steps) == (1 if where == "step" else new_tokens) == attrs[A.GENERATE_STEPS]
        if where != "step":
            assert attrs[A.GENERATE_SYNCHRONIZED] is False  # the device is no longer waited for


@pytest.mark.parametrize("failing", ["from step 1 on", "only the end read", "from the first read"])
def test_clock_raising_never_breaks_generate(
    failing, fresh_fault_log, monkeypatch, caplog, instrumented, span_exporter, gpt2
):
    """The monotonic clock failing for good inside a step, or at the end: generate() still returns."""
    real = clock.monotonic_ns
    reads = {"n": 0}
    new_tokens = 4

    def failing_clock():
        reads["n"] += 1
        n = reads["n"]  # reads: 1 start, 2..5 the 4 steps, 6 the end
        if (
            (failing == "from step 1 on" and n >= 3)
            or (failing == "only the end read" and n == new_tokens + 2)
            or failing == "from the first read"
        ):
            raise OSError("clock unavailable")
        return real()

    ids, mask = prompt(length=4, seed=32)
    kwargs = dict(attention_mask=mask, max_new_tokens=new_tokens, eos_token_id=None)
    expected = uninstrumented_generate(gpt2, ids, **kwargs)
    monkeypatch.setattr(clock, "monotonic_ns", failing_clock)
    outs = []
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for _ in range(2):
            reads["n"] = 0
            outs.append(gpt2.generate(ids, **kwargs))
    monkeypatch.setattr(clock, "monotonic_ns", real)
    assert all(torch.equal(out, expected) for out in outs)
    messages = _fault_records(caplog)
    kinds = [m.split(" failed ")[0] for m in messages]
    assert messages and len(kinds) == len(set(kinds)), messages  # logged, once per kind
    assert all("clock unavailable" in m for m in messages)
    for request in request_spans(span_exporter):  # whatever request span is exported says so
        assert request.attributes.get(A.GENERATE_STEPS_INCOMPLETE) is True
    assert len(request_spans(span_exporter)) == 2  # even a request that could not start is exported, marked
    assert _ACTIVE.get() is None
