"""Continuous batching with ``synchronize="events"`` and energy, on a fake ``cuda:0``
(tests/helpers/fake_cuda.py; the tiny Llama runs on the CPU): the scheduler thread records events
and reads the counter, and nothing on it ever waits; the events are read off it, once completed;
each batch step's energy is shared among its requests in proportion to the tokens each computed.

Expected values come from the doubles' logs (event device times, counter readings, the thread of
every call) and from what transformers returned, never from the instrumentation's output.
"""

from __future__ import annotations

import threading

import pytest

from otel_generate import attributes as A
from tests.helpers import step_spans
from tests.helpers.fake_cuda import FakeEvents, FakeNVML, install_events, install_nvml
from tests.integration.test_continuous_batching import PROMPTS, greedy, small_config, spans_by_id


@pytest.fixture
def model(llama):
    yield llama
    llama.destroy_cached_continuous_batching_manager()  # (a test that failed half-way leaves none behind)


def run_batch(llama, tracer_provider):
    outputs = llama.generate_batch(
        inputs=PROMPTS, generation_config=greedy(), continuous_batching_config=small_config()
    )
    tracer_provider.force_flush()  # waits for the background emitter's spans
    return outputs


def test_events_are_recorded_on_the_scheduler_thread_and_read_off_it_without_a_wait(
    monkeypatch, instrument, tracer_provider, span_exporter, model
):
    fake = install_events(monkeypatch, FakeEvents(pending_queries=3))  # still running at the first queries
    instrument(tracer_provider=tracer_provider, synchronize="events", measure_energy=False)
    outputs = run_batch(model, tracer_provider)

    names = fake.names()
    assert "synchronize" not in names and "device synchronize" not in names  # no blocking wait anywhere
    recording = {call.thread for call in fake.calls if call.name == "record"}
    (scheduler,) = recording
    assert scheduler is not threading.main_thread()
    readers = {call.thread for call in fake.calls if call.name in ("query", "elapsed_time")}
    assert readers and scheduler not in readers  # resolved off the scheduler thread
    assert names.count("query") > 3  # polled until the device said the events were done

    by_id = spans_by_id(span_exporter)
    assert set(by_id) == set(outputs)
    elapsed = {
        fake.expected_ns(fake.events[call.events[0]], fake.events[call.events[1]])
        for call in fake.calls
        if call.name == "elapsed_time"
    }
    for rid, output in outputs.items():
        request = by_id[rid]
        assert request.attributes[A.GENERATE_CLOCK] == A.CLOCK_DEVICE
        steps = step_spans(span_exporter, request)
        assert len(steps) == len(output.generated_tokens)
        for step in steps:  # each step lasts the device time between its two events
            assert step.end_time - step.start_time in elapsed
            assert step.attributes[A.GENERATE_STEP_LATENCY] == (step.end_time - step.start_time) / 1e9


def test_each_batch_step_energy_is_shared_by_tokens_computed_and_the_shares_add_up(
    monkeypatch, instrument, tracer_provider, span_exporter, model
):
    install_events(monkeypatch, FakeEvents())
    nvml = FakeNVML()
    install_nvml(monkeypatch, nvml)
    instrument(tracer_provider=tracer_provider)
    outputs = run_batch(model, tracer_provider)

    scheduler_readings = [value for value, thread in nvml.reads if thread is not threading.main_thread()]
    batch_steps = [b - a for a, b in zip(scheduler_readings, scheduler_readings[1:])]
    by_id = spans_by_id(span_exporter)
    by_end = {}  # a batch step's end time -> {request id: its share, joules}
    for rid in outputs:
        request = by_id[rid]
        steps = step_spans(span_exporter, request)
        shares = [step.attributes[A.GENERATE_STEP_ENERGY] for step in steps]
        assert request.attributes[A.GENERATE_ENERGY] == pytest.approx(sum(shares), rel=1e-12)
        assert request.attributes[A.GENERATE_ENERGY_PER_OUTPUT_TOKEN] == pytest.approx(
            sum(shares) / len(outputs[rid].generated_tokens), rel=1e-12
        )
        total_tokens = len(outputs[rid].prompt_ids) + len(outputs[rid].generated_tokens)
        assert request.attributes[A.GENERATE_ENERGY_PER_TOTAL_TOKEN] == pytest.approx(
            sum(shares) / total_tokens, rel=1e-12
        )
        # each prompt was prefilled in the first batch step; every later step decoded
        assert request.attributes[A.GENERATE_ENERGY_PREFILL] == shares[0]
        assert request.attributes[A.GENERATE_ENERGY_DECODE] == pytest.approx(sum(shares[1:]), rel=1e-12)
        for step in steps:
            by_end.setdefault(step.end_time, {})[rid] = step.attributes[A.GENERATE_STEP_ENERGY]
    for shared in by_end.values():  # the shares of one batch step add up to that step's energy
        total_mj = sum(shared.values()) * 1000
        assert any(total_mj == pytest.approx(used, rel=1e-12) for used in batch_steps), (total_mj, batch_steps)
    # the first batch step prefilled both prompts (5 and 3 tokens computed): shares 5/8 and 3/8;
    # every later step computed one token for each request still running: equal shares
    first = by_end[min(by_end)]
    assert len(first) == 2
    long_id, short_id = (
        (rid for rid in outputs if len(outputs[rid].prompt_ids) == 5),
        (rid for rid in outputs if len(outputs[rid].prompt_ids) == 3),
    )
    long_id, short_id = next(long_id), next(short_id)
    assert first[long_id] / first[short_id] == pytest.approx(5 / 3, rel=1e-12)
    for end, shared in by_end.items():
        if end != min(by_end) and len(shared) == 2:
            a, b = shared.values()
            assert a == pytest.approx(b, rel=1e-12)
