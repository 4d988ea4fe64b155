"""``uninstrument()`` (or the last self-instrumenting ``TokenLatencyProfiler`` closing) while another
thread's request is being set up: the request completes as an ordinary, fully
accounted request, never ``generate.steps.incomplete`` nor ``generate.steps.unobserved``.

The window is hit deterministically: the first thread's ``generate()`` stops inside its set-up
(``_prepare_special_tokens``, which transformers calls before the hooks that learn the prompt width
and install the step recorder) until the instrumentation has been turned off, then goes on.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from otel_generate import GenerateInstrumentor, TokenLatencyProfiler
from otel_generate import attributes as A
from otel_generate.integrations import generate_loop
from tests.helpers import only_request, prompt
from tests.integration.test_metrics_and_latency_apis import histograms

WAIT_S = 30.0


def _wait_until(condition, what):
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.001)


def _stop_in_setup(monkeypatch, model, released):
    """``model``'s next ``generate()`` signals ``entered`` inside its set-up, then waits for ``released()``."""
    entered = threading.Event()
    original = model._prepare_special_tokens

    def waiting(*args, **kwargs):
        entered.set()
        _wait_until(released, "the instrumentation to be turned off")
        return original(*args, **kwargs)

    monkeypatch.setattr(model, "_prepare_special_tokens", waiting)
    return entered


def _generate_in_thread(model, kwargs):
    result = {}

    def run():
        try:
            result["out"] = model.generate(**kwargs)
        except BaseException as exc:  # pragma: no cover - reported by the test
            result["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread, result


def test_uninstrument_during_another_threads_request_setup(
    span_exporter, tracer_provider, meter_provider, metric_reader, gpt2, monkeypatch
):
    instrumentor = GenerateInstrumentor()
    instrumentor.instrument(tracer_provider=tracer_provider, meter_provider=meter_provider)
    telemetry = instrumentor._telemetry
    entered = _stop_in_setup(monkeypatch, gpt2, lambda: not telemetry.active)
    ids, mask = prompt(length=4)
    thread, result = _generate_in_thread(
        gpt2, dict(inputs=ids, attention_mask=mask, max_new_tokens=8, eos_token_id=None)
    )
    try:
        assert entered.wait(WAIT_S)
    finally:
        instrumentor.uninstrument()  # the other thread is inside its set-up now
    thread.join(WAIT_S)
    assert "error" not in result
    out = result["out"]
    assert out.shape[-1] - 4 == 8
    span = only_request(span_exporter)
    attrs = dict(span.attributes)
    assert A.GENERATE_STEPS_INCOMPLETE not in attrs
    assert A.GENERATE_STEPS_UNOBSERVED not in attrs
    assert A.GENERATE_STEPS_UNINSTRUMENTED not in attrs  # it was fully accounted
    assert attrs[A.GENERATE_STEPS] == 8
    assert attrs[A.GEN_AI_USAGE_OUTPUT_TOKENS] == 8 and attrs[A.GEN_AI_USAGE_INPUT_TOKENS] == 4
    assert attrs[A.GEN_AI_RESPONSE_FINISH_REASONS] == ("length",)
    steps = [s for s in span_exporter.get_finished_spans() if s.parent and s.parent.span_id == span.context.span_id]
    assert [s.name for s in steps] == [A.STEP_SPAN_PREFILL] + [A.STEP_SPAN_DECODE] * 7
    (ttft,) = histograms(metric_reader)[A.METRIC_TIME_TO_FIRST_TOKEN]
    assert ttft.count == 1 and ttft.sum == pytest.approx(attrs[A.GENERATE_TIME_TO_FIRST_TOKEN])
    # and afterwards generate() is the original again
    gpt2.generate(ids, attention_mask=mask, max_new_tokens=2, eos_token_id=None)
    assert len(span_exporter.get_finished_spans()) == len(steps) + 1


def test_a_closing_profiler_during_another_threads_request_setup(gpt2, monkeypatch):
    """The profiler turned the instrumentation on; closing it in this thread turns it off while the
    other thread's request (which asked for its latencies) is in its set-up."""
    assert not GenerateInstrumentor().is_instrumented_by_opentelemetry
    profiler = TokenLatencyProfiler().__enter__()
    telemetry = GenerateInstrumentor()._telemetry
    entered = _stop_in_setup(monkeypatch, gpt2, lambda: not telemetry.active)
    ids, mask = prompt(length=4)
    latencies = []
    thread, result = _generate_in_thread(
        gpt2,
        dict(
            inputs=ids,
            attention_mask=mask,
            max_new_tokens=8,
            eos_token_id=None,
            return_dict_in_generate=True,
            track_token_latency=True,
            per_token_latency_callback=lambda index, latency: latencies.append(index),
        ),
    )
    try:
        assert entered.wait(WAIT_S)
    finally:
        profiler.__exit__(None, None, None)
    thread.join(WAIT_S)
    assert "error" not in result
    assert not GenerateInstrumentor().is_instrumented_by_opentelemetry
    out = result["out"]
    assert out.sequences.shape[-1] - 4 == 8
    assert latencies == list(range(8))
    assert len(out.token_latencies) == 8 and all(latency > 0 for latency in out.token_latencies)


def test_a_request_whose_hooks_were_missed_says_so(span_exporter, tracer_provider, gpt2, monkeypatch):
    """When the set-up outlasts the wait (here: no wait at all), the loop that ran is not
    called unobserved nor incomplete: the span says the instrumentation was turned off."""
    monkeypatch.setattr(generate_loop, "UNINSTRUMENT_SETUP_WAIT_S", 0.0)
    instrumentor = GenerateInstrumentor()
    instrumentor.instrument(tracer_provider=tracer_provider)
    telemetry = instrumentor._telemetry
    entered = _stop_in_setup(monkeypatch, gpt2, lambda: not telemetry.active)
    ids, mask = prompt(length=4)
    thread, result = _generate_in_thread(
        gpt2, dict(inputs=ids, attention_mask=mask, max_new_tokens=8, eos_token_id=None)
    )
    try:
        assert entered.wait(WAIT_S)
    finally:
        instrumentor.uninstrument()
    thread.join(WAIT_S)
    assert torch.is_tensor(result["out"])
    attrs = dict(only_request(span_exporter).attributes)
    assert attrs[A.GENERATE_STEPS_UNINSTRUMENTED] is True
    assert A.GENERATE_STEPS_INCOMPLETE not in attrs and A.GENERATE_STEPS_UNOBSERVED not in attrs
    assert A.GENERATE_STEPS not in attrs
    assert attrs[A.GEN_AI_USAGE_OUTPUT_TOKENS] == 8  # read off the output tensor


def test_uninstrument_during_a_multi_call_request_says_so(span_exporter, tracer_provider):
    """A model's own generate() whose loops are inner calls (Whisper's long-form windows): turned off
    during its first window, the windows after it run unseen (generate() is the original again), so
    the span carries ``generate.steps.uninstrumented`` even though only one loop was seen."""
    from transformers import LogitsProcessor, LogitsProcessorList

    from tests.helpers import tiny_models

    torch.manual_seed(0)
    whisper = tiny_models.whisper()
    frames = 9000  # 90 s: several 30 s windows
    features, mask = torch.randn(1, 80, frames), torch.ones(1, frames)
    instrumentor = GenerateInstrumentor()
    instrumentor.instrument(tracer_provider=tracer_provider)
    telemetry = instrumentor._telemetry
    entered = threading.Event()

    class WaitInFirstWindow(LogitsProcessor):
        calls = 0

        def __call__(self, input_ids, scores):
            WaitInFirstWindow.calls += 1
            if WaitInFirstWindow.calls == 2:
                entered.set()
                _wait_until(lambda: not telemetry.active, "the instrumentation to be turned off")
            return scores

    thread, result = _generate_in_thread(
        whisper,
        dict(
            input_features=features,
            attention_mask=mask,
            return_timestamps=True,
            max_new_tokens=20,
            logits_processor=LogitsProcessorList([WaitInFirstWindow()]),
        ),
    )
    try:
        assert entered.wait(WAIT_S)
    finally:
        instrumentor.uninstrument()
    thread.join(WAIT_S)
    assert "error" not in result
    assert WaitInFirstWindow.calls > 20  # the later windows ran (20 new tokens at most per window)
    attrs = dict(only_request(span_exporter).attributes)
    assert attrs[A.GENERATE_STEPS_UNINSTRUMENTED] is True
    assert attrs[A.GENERATE_STEPS] == 20  # the first window's steps, all timed
    assert A.GENERATE_STEPS_INCOMPLETE not in attrs and A.GENERATE_STEPS_UNOBSERVED not in attrs


def test_a_set_up_finishing_wakes_a_waiting_uninstrument_at_once():
    # setup_done notifies only while someone waits (setup_waiters): a waiter must still be woken
    # when the set-up it waits for ends, long before its bound
    from opentelemetry import trace

    from otel_generate.telemetry import Telemetry

    class Call:
        pass

    telemetry = Telemetry(trace.get_tracer("t"), None)
    call = Call()
    call.telemetry = telemetry
    telemetry.setups[call] = -1  # another thread's request, inside its set-up
    result = {}
    waiter = threading.Thread(target=lambda: result.update(done=generate_loop.wait_for_setups(telemetry, 60)))
    waiter.start()
    deadline = time.monotonic() + 30
    while telemetry.setup_waiters == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert telemetry.setup_waiters == 1
    ended = time.monotonic()
    generate_loop.setup_done(call)
    waiter.join(30)
    assert result == {"done": True} and time.monotonic() - ended < 20  # woken, not timed out (60 s)
    assert telemetry.setup_waiters == 0 and telemetry.setups == {}
