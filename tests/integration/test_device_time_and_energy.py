"""``synchronize="events"`` and energy on a machine without a GPU: the tiny models run on the CPU
while the instrumentation sees a fake ``cuda:0`` (tests/helpers/fake_cuda.py): timing events that log
every ``record``, ``query``, ``synchronize`` and ``elapsed_time`` call with its thread, and an NVML
whose energy counter advances by known amounts.

Expected values come from the doubles' own logs (each event's device time, each counter reading) and
from the returned tensors, never from the instrumentation's output.
"""

from __future__ import annotations

import logging

import pytest
import torch

from otel_generate import attributes as A
from otel_generate.integrations import step_hook
from tests.helpers import only_request, prompt, step_spans, uninstrumented_generate
from tests.helpers.fake_cuda import FakeEvents, FakeNVML, install_events, install_nvml
from tests.helpers.instrumenting import LOGGER
from tests.integration.test_metrics_and_latency_apis import histograms

NEW_TOKENS = 6


@pytest.fixture
def fresh_log(monkeypatch):
    """Each test sees the package's first log line of each kind (they are logged once per process)."""
    from otel_generate import _faults

    monkeypatch.setattr(_faults, "_logged_kinds", set())


def package_records(caplog, level=logging.INFO):
    return [r for r in caplog.records if r.name == LOGGER and r.levelno >= level]


def run(gpt2, seed=40, new_tokens=NEW_TOKENS, **kwargs):
    ids, mask = prompt(length=4, seed=seed)
    arguments = dict(attention_mask=mask, max_new_tokens=new_tokens, eos_token_id=None, **kwargs)
    expected = uninstrumented_generate(gpt2, ids, **arguments)
    out = gpt2.generate(ids, **arguments)
    assert torch.equal(out, expected)  # generation itself is untouched
    return out


# --- synchronize="events" -------------------------------------------------------------------------


def test_events_mode_records_one_event_per_step_and_waits_only_on_the_last(
    monkeypatch, instrument, tracer_provider, span_exporter, meter_provider, metric_reader, gpt2
):
    fake = install_events(monkeypatch, FakeEvents())
    recorder_calls = []
    monkeypatch.setattr(
        step_hook.StepRecorder, "__call__", lambda self, *a: recorder_calls.append(a)
    )  # the plain path appends itself: the recorder's own call never runs per step
    instrument(
        tracer_provider=tracer_provider, meter_provider=meter_provider, synchronize="events", measure_energy=False
    )
    run(gpt2)

    # one event when the request starts, one per step; then one wait, on the last event only; then
    # the elapsed times of consecutive events, read once the request is over
    steps = NEW_TOKENS
    assert fake.names() == ["record"] * (1 + steps) + ["synchronize"] + ["elapsed_time"] * steps
    assert fake.calls[1 + steps].events == (steps,)  # the last event recorded
    assert [call.events for call in fake.calls[2 + steps :]] == [(i, i + 1) for i in range(steps)]
    assert all(event.stream is fake.stream and event.enable_timing for event in fake.events)
    assert recorder_calls == []

    expected_ns = [fake.expected_ns(a, b) for a, b in zip(fake.events, fake.events[1:])]
    expected_s = [ns / 1e9 for ns in expected_ns]
    request = only_request(span_exporter)
    attrs = request.attributes
    assert attrs[A.GENERATE_CLOCK] == A.CLOCK_DEVICE
    assert attrs[A.GENERATE_SYNCHRONIZED] is True
    assert list(attrs[A.GENERATE_STEP_LATENCIES]) == expected_s
    spans = step_spans(span_exporter, request)
    assert [s.attributes[A.GENERATE_STEP_LATENCY] for s in spans] == expected_s
    assert [s.end_time - s.start_time for s in spans] == expected_ns
    assert attrs[A.GENERATE_TIME_TO_FIRST_TOKEN] == expected_s[0]
    assert attrs[A.GENERATE_TIME_PER_OUTPUT_TOKEN] == (sum(expected_ns[1:]) / (steps - 1)) / 1e9
    # the device's time line lies inside the request span (the device took half the host's time)
    assert request.start_time <= spans[0].start_time and spans[-1].end_time <= request.end_time

    found = histograms(metric_reader)
    (ttft,) = found[A.METRIC_TIME_TO_FIRST_TOKEN]
    assert ttft.sum == expected_s[0]
    (itl,) = found[A.METRIC_INTER_TOKEN_LATENCY]
    assert itl.count == steps - 1 and itl.sum == pytest.approx(sum(expected_s[1:]), rel=1e-12)
    (tpot,) = found[A.METRIC_TIME_PER_OUTPUT_TOKEN]
    assert tpot.sum == attrs[A.GENERATE_TIME_PER_OUTPUT_TOKEN]


def test_events_mode_with_a_callback_still_waits_for_nothing_per_step(
    monkeypatch, instrument, tracer_provider, span_exporter, gpt2
):
    """The recorder's own call path (a per-token callback): the same events, still no wait per step."""
    fake = install_events(monkeypatch, FakeEvents())
    instrument(tracer_provider=tracer_provider, synchronize="events", measure_energy=False)
    seen = []
    run(gpt2, per_token_latency_callback=lambda index, latency: seen.append(index))
    assert seen == list(range(NEW_TOKENS))
    assert fake.names().count("record") == 1 + NEW_TOKENS
    assert fake.names().count("synchronize") == 1 and "device synchronize" not in fake.names()
    spans = step_spans(span_exporter, only_request(span_exporter))
    expected = [fake.expected_ns(a, b) for a, b in zip(fake.events, fake.events[1:])]
    assert [s.end_time - s.start_time for s in spans] == expected


def test_events_mode_without_nvml_never_waits_for_the_device(
    monkeypatch, instrument, tracer_provider, span_exporter, gpt2
):
    """Energy on (the default) but no NVML here: no reading to line up, so no wait at the start either."""
    fake = install_events(monkeypatch, FakeEvents())
    install_nvml(monkeypatch, None)
    instrument(tracer_provider=tracer_provider, synchronize="events")
    run(gpt2, seed=50)
    assert "device synchronize" not in fake.names() and fake.names().count("synchronize") == 1
    assert only_request(span_exporter).attributes[A.GENERATE_CLOCK] == A.CLOCK_DEVICE


def test_events_on_the_cpu_change_nothing_and_say_so_once(
    monkeypatch, fresh_log, caplog, instrument, tracer_provider, span_exporter, gpt2
):
    def no_cuda(*args, **kwargs):
        raise AssertionError("a CPU model must not reach torch.cuda")

    monkeypatch.setattr(torch.cuda, "Event", no_cuda)
    monkeypatch.setattr(torch.cuda, "current_stream", no_cuda)
    instrument(tracer_provider=tracer_provider, synchronize="events")
    with caplog.at_level(logging.INFO, logger=LOGGER):
        run(gpt2)
        run(gpt2, seed=41)
    (record,) = package_records(caplog)
    assert "synchronize='events'" in record.getMessage() and record.levelno == logging.INFO
    for request in span_exporter.get_finished_spans():
        if request.name.startswith(A.OPERATION_TEXT_COMPLETION):
            assert request.attributes[A.GENERATE_SYNCHRONIZED] is True
            assert A.GENERATE_CLOCK not in request.attributes
            assert A.GENERATE_ENERGY not in request.attributes


def test_events_unavailable_fall_back_to_waiting_and_say_so_once(
    monkeypatch, fresh_log, caplog, instrument, tracer_provider, span_exporter, gpt2
):
    fake = install_events(monkeypatch, FakeEvents())

    def no_driver(device=None):
        raise RuntimeError("Found no NVIDIA driver on your system")

    monkeypatch.setattr(torch.cuda, "current_stream", no_driver)
    instrument(tracer_provider=tracer_provider, synchronize="events", measure_energy=False)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        run(gpt2)
        run(gpt2, seed=41)
    (record,) = package_records(caplog)
    assert record.levelno == logging.WARNING and "Found no NVIDIA driver" in record.getMessage()
    # today's mode: a wait before the start, at each step and at the end, for each request
    assert fake.names() == ["device synchronize"] * 2 * (NEW_TOKENS + 2)
    requests = [s for s in span_exporter.get_finished_spans() if s.name.startswith(A.OPERATION_TEXT_COMPLETION)]
    assert len(requests) == 2
    for request in requests:
        assert A.GENERATE_CLOCK not in request.attributes
        assert request.attributes[A.GENERATE_SYNCHRONIZED] is True


def test_an_event_failing_mid_request_leaves_host_times_marked(
    monkeypatch, fresh_log, caplog, instrument, tracer_provider, span_exporter, gpt2
):
    fake = install_events(monkeypatch, FakeEvents())
    real = fake.Event.elapsed_time

    def broken(self, end):
        if end.id == 3:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real(self, end)

    monkeypatch.setattr(fake.Event, "elapsed_time", broken)
    instrument(tracer_provider=tracer_provider, synchronize="events", measure_energy=False)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        run(gpt2)
    (record,) = package_records(caplog)
    assert record.getMessage().startswith("otel_generate: device events failed")
    attrs = only_request(span_exporter).attributes
    assert A.GENERATE_CLOCK not in attrs
    assert attrs[A.GENERATE_SYNCHRONIZED] is False and attrs[A.GENERATE_STEPS_INCOMPLETE] is True
    assert attrs[A.GENERATE_STEPS] == NEW_TOKENS  # the host's step times are kept, marked


# --- energy --------------------------------------------------------------------------------------------


def test_energy_of_the_request_its_steps_and_per_token_is_exact(
    monkeypatch, instrument, tracer_provider, span_exporter, meter_provider, metric_reader, gpt2
):
    install_events(monkeypatch, FakeEvents())  # a fake cuda:0, waited for at each step (synchronize=True)
    nvml = FakeNVML()
    install_nvml(monkeypatch, nvml)
    instrument(tracer_provider=tracer_provider, meter_provider=meter_provider)
    out = run(gpt2, seed=42)

    # the readings of this request: its start, one after each step, its end (one more before it:
    # the meter's check that the counter exists)
    readings = nvml.values()[-(NEW_TOKENS + 2) :]
    assert len(nvml.values()) == NEW_TOKENS + 3
    assert nvml.uuids == ["GPU-0e6b1b2c-aaaa-bbbb-cccc-000000000000"]
    energy_j = (readings[-1] - readings[0]) / 1000
    output_tokens = int(out.shape[-1] - 4)
    request = only_request(span_exporter)
    attrs = request.attributes
    assert attrs[A.GENERATE_ENERGY] == energy_j
    assert attrs[A.GEN_AI_USAGE_OUTPUT_TOKENS] == output_tokens == NEW_TOKENS
    assert attrs[A.GENERATE_ENERGY_PER_OUTPUT_TOKEN] == energy_j / output_tokens
    steps = [(b - a) / 1000 for a, b in zip(readings, readings[1:-1])]
    assert [s.attributes[A.GENERATE_STEP_ENERGY] for s in step_spans(span_exporter, request)] == steps
    # the prefill is the first step, the decode steps the rest; both add up to the start-to-last-step energy
    assert attrs[A.GENERATE_ENERGY_PREFILL] == (readings[1] - readings[0]) / 1000
    assert attrs[A.GENERATE_ENERGY_DECODE] == sum(steps[1:])
    assert attrs[A.GENERATE_ENERGY_DECODE] == pytest.approx((readings[-2] - readings[1]) / 1000, rel=1e-12)
    input_tokens = 4  # the prompt: 4 ids, no padding
    assert attrs[A.GEN_AI_USAGE_INPUT_TOKENS] == input_tokens
    assert attrs[A.GENERATE_ENERGY_PER_TOTAL_TOKEN] == energy_j / (input_tokens + output_tokens)
    (per_token,) = histograms(metric_reader)[A.METRIC_ENERGY_PER_OUTPUT_TOKEN]
    assert per_token.count == 1 and per_token.sum == energy_j / output_tokens


def test_a_counter_coarser_than_a_step_gives_the_request_its_energy_and_no_step_any(
    monkeypatch, instrument, tracer_provider, span_exporter, gpt2
):
    install_events(monkeypatch, FakeEvents())
    nvml = FakeNVML(increments=lambda k: 0 if k % 3 else 4000)  # it moves at every third read only
    install_nvml(monkeypatch, nvml)
    instrument(tracer_provider=tracer_provider)
    run(gpt2, seed=43)
    readings = nvml.values()[-(NEW_TOKENS + 2) :]
    request = only_request(span_exporter)
    assert request.attributes[A.GENERATE_ENERGY] == (readings[-1] - readings[0]) / 1000 > 0
    assert all(A.GENERATE_STEP_ENERGY not in s.attributes for s in step_spans(span_exporter, request))
    # no step's energy, so no split either; the per-token figures stay
    assert not {A.GENERATE_ENERGY_PREFILL, A.GENERATE_ENERGY_DECODE} & set(request.attributes)
    assert A.GENERATE_ENERGY_PER_TOTAL_TOKEN in request.attributes


def test_a_counter_that_never_moves_gives_no_energy(monkeypatch, instrument, tracer_provider, span_exporter, gpt2):
    install_events(monkeypatch, FakeEvents())
    install_nvml(monkeypatch, FakeNVML(increments=lambda k: 0))
    instrument(tracer_provider=tracer_provider)
    run(gpt2, seed=44)
    request = only_request(span_exporter)
    energy_keys = {
        A.GENERATE_ENERGY,
        A.GENERATE_ENERGY_PER_OUTPUT_TOKEN,
        A.GENERATE_ENERGY_PER_TOTAL_TOKEN,
        A.GENERATE_ENERGY_PREFILL,
        A.GENERATE_ENERGY_DECODE,
    }
    assert not energy_keys & set(request.attributes)
    assert all(A.GENERATE_STEP_ENERGY not in s.attributes for s in step_spans(span_exporter, request))


def test_step_spans_off_read_the_counter_only_at_the_request_bounds(
    monkeypatch, instrument, tracer_provider, span_exporter, gpt2
):
    install_events(monkeypatch, FakeEvents())
    nvml = FakeNVML()
    install_nvml(monkeypatch, nvml)
    instrument(tracer_provider=tracer_provider, step_spans="none")
    run(gpt2, seed=45)
    assert len(nvml.values()) == 1 + 2  # the meter's check, the start, the end
    values = nvml.values()
    assert only_request(span_exporter).attributes[A.GENERATE_ENERGY] == (values[2] - values[1]) / 1000


def test_events_mode_with_energy_waits_once_at_the_start_and_reads_no_step(
    monkeypatch, instrument, tracer_provider, span_exporter, gpt2
):
    fake = install_events(monkeypatch, FakeEvents())
    nvml = FakeNVML()
    install_nvml(monkeypatch, nvml)
    instrument(tracer_provider=tracer_provider, synchronize="events")
    run(gpt2, seed=46)
    # one device wait before the start reading (the only one), one event wait at the end
    assert fake.names().count("device synchronize") == 1 and fake.names()[0] == "device synchronize"
    assert fake.names().count("synchronize") == 1
    assert len(nvml.values()) == 3  # the check, the start, the end: the host runs ahead of the steps
    request = only_request(span_exporter)
    assert request.attributes[A.GENERATE_ENERGY] == (nvml.values()[2] - nvml.values()[1]) / 1000
    assert request.attributes[A.GENERATE_CLOCK] == A.CLOCK_DEVICE
    assert all(A.GENERATE_STEP_ENERGY not in s.attributes for s in step_spans(span_exporter, request))


@pytest.mark.parametrize("nvml", ["not installed", "init raising", "read raising mid-request"])
def test_no_nvml_or_nvml_raising_leaves_generation_alone_with_one_log_line(
    nvml, monkeypatch, fresh_log, caplog, instrument, tracer_provider, span_exporter, gpt2
):
    install_events(monkeypatch, FakeEvents())
    fake = {
        "not installed": None,
        "init raising": FakeNVML(fail_init=True),
        "read raising mid-request": FakeNVML(fail_read_after=3),  # the check, the start, step 0: then fails
    }[nvml]
    install_nvml(monkeypatch, fake)
    instrument(tracer_provider=tracer_provider)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        run(gpt2, seed=47)
        run(gpt2, seed=48)
    records = package_records(caplog)
    assert len(records) == 1, [r.getMessage() for r in records]
    assert "energy" in records[0].getMessage()
    requests = [s for s in span_exporter.get_finished_spans() if s.name.startswith(A.OPERATION_TEXT_COMPLETION)]
    assert len(requests) == 2
    for request in requests:
        assert not {A.GENERATE_ENERGY, A.GENERATE_ENERGY_PER_OUTPUT_TOKEN} & set(request.attributes)
        assert A.GENERATE_STEPS_INCOMPLETE not in request.attributes  # the steps are not affected
        assert request.attributes[A.GENERATE_STEPS] == NEW_TOKENS
        assert all(A.GENERATE_STEP_ENERGY not in s.attributes for s in step_spans(span_exporter, request))


def test_synchronize_false_reads_no_energy(monkeypatch, instrument, tracer_provider, span_exporter, gpt2):
    """Readings that follow no wait would not follow the device's work: none are taken."""
    install_events(monkeypatch, FakeEvents())
    nvml = FakeNVML()
    install_nvml(monkeypatch, nvml)
    instrument(tracer_provider=tracer_provider, synchronize=False)
    run(gpt2, seed=49)
    assert nvml.reads == []
    assert A.GENERATE_ENERGY not in only_request(span_exporter).attributes
