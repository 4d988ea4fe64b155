"""GenAI semantic conventions as otel_generate follows them: names, types, units,
streaming, the client duration metric, success-only latency histograms, exemplars, schema URL."""

from __future__ import annotations

import time

import pytest
import torch
from opentelemetry import trace
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.generation.streamers import BaseStreamer

from otel_generate import attributes as A
from tests.helpers import prompt, request_spans, step_spans, uninstrumented_generate


def histogram_points(metric_reader):
    """metric name -> data points, for this package's scope."""
    found = {}
    data = metric_reader.get_metrics_data()
    for rm in data.resource_metrics if data else ():
        for sm in rm.scope_metrics:
            if sm.scope.name != "otel_generate":
                continue
            for metric in sm.metrics:
                found.setdefault(metric.name, []).extend(metric.data.data_points)
    return found


def test_top_k_is_a_double_and_response_model_is_set(instrumented, span_exporter, gpt2):
    ids, mask = prompt(seed=11)
    torch.manual_seed(0)
    gpt2.generate(ids, attention_mask=mask, max_new_tokens=3, eos_token_id=None, do_sample=True, top_k=7)
    (request,) = request_spans(span_exporter)
    top_k = request.attributes[A.GEN_AI_REQUEST_TOP_K]
    assert type(top_k) is float and top_k == 7.0
    assert (
        request.attributes[A.GEN_AI_RESPONSE_MODEL] == request.attributes[A.GEN_AI_REQUEST_MODEL] == "GPT2LMHeadModel"
    )


def test_no_millisecond_names_and_latencies_in_seconds(instrumented, span_exporter, gpt2):
    ids, mask = prompt(seed=12)
    gpt2.generate(ids, attention_mask=mask, max_new_tokens=6, eos_token_id=None)
    (request,) = request_spans(span_exporter)
    steps = step_spans(span_exporter, request)
    assert len(steps) == 6
    for span in [request, *steps]:
        assert not [name for name in span.attributes if name.endswith("_ms")], span.name
    for step in steps:
        # the span's own duration, in seconds, is the attribute
        assert step.attributes[A.GENERATE_STEP_LATENCY] == pytest.approx(
            (step.end_time - step.start_time) / 1e9, abs=1e-6
        )
    assert request.attributes[A.GENERATE_TIME_TO_FIRST_TOKEN] == steps[0].attributes[A.GENERATE_STEP_LATENCY]
    assert sum(s.attributes[A.GENERATE_STEP_LATENCY] for s in steps) <= (request.end_time - request.start_time) / 1e9


def test_stop_strings_are_the_stop_sequences(instrumented, span_exporter, gpt2, tokenizer):
    ids, mask = prompt(seed=13)
    gpt2.generate(
        ids, attention_mask=mask, max_new_tokens=3, eos_token_id=None, stop_strings=["zz", "q!"], tokenizer=tokenizer
    )
    gpt2.generate(
        ids, attention_mask=mask, max_new_tokens=3, eos_token_id=None, stop_strings="abc", tokenizer=tokenizer
    )
    gpt2.generate(ids, attention_mask=mask, max_new_tokens=3, eos_token_id=None)
    lists, single, none = sorted(request_spans(span_exporter), key=lambda s: s.start_time)
    assert lists.attributes[A.GEN_AI_REQUEST_STOP_SEQUENCES] == ("zz", "q!")
    assert single.attributes[A.GEN_AI_REQUEST_STOP_SEQUENCES] == ("abc",)
    assert A.GEN_AI_REQUEST_STOP_SEQUENCES not in none.attributes


class RecordingStreamer(BaseStreamer):
    """Remembers what it was given; its put is slow enough to be visible in the totals."""

    def __init__(self):
        self.puts = []
        self.ended = False

    def put(self, value):
        self.puts.append(value.clone())

    def end(self):
        self.ended = True


def test_streaming_request_says_so_and_times_the_first_chunk(instrumented, span_exporter, gpt2):
    ids, mask = prompt(seed=14)
    expected = uninstrumented_generate(gpt2, ids, attention_mask=mask, max_new_tokens=5, eos_token_id=None)
    streamer = RecordingStreamer()
    out = gpt2.generate(ids, attention_mask=mask, max_new_tokens=5, eos_token_id=None, streamer=streamer)
    gpt2.generate(ids, attention_mask=mask, max_new_tokens=5, eos_token_id=None)
    assert torch.equal(out, expected)
    # the user's streamer got everything, in order: the prompt, then one token per step
    assert len(streamer.puts) == 6 and streamer.ended
    assert torch.equal(streamer.puts[0], ids)
    assert [int(p.reshape(-1)[0]) for p in streamer.puts[1:]] == out[0, 4:].tolist()

    streamed, plain = sorted(request_spans(span_exporter), key=lambda s: s.start_time)
    attrs = streamed.attributes
    assert attrs[A.GEN_AI_REQUEST_STREAM] is True
    first_chunk = attrs[A.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK]
    duration = (streamed.end_time - streamed.start_time) / 1e9
    assert isinstance(first_chunk, float) and 0 < first_chunk <= duration
    # the first generated token is put next to the prefill step's boundary: just before it
    # (transformers 4.x puts before calling the stopping criteria), or within the next step (5.x
    # puts after them, in StopCheck)
    steps = step_spans(span_exporter, streamed)
    assert first_chunk <= attrs[A.GENERATE_TIME_TO_FIRST_TOKEN] + steps[1].attributes[A.GENERATE_STEP_LATENCY]
    assert 0 < attrs[A.GENERATE_STREAMER_DURATION] < duration
    assert A.GEN_AI_REQUEST_STREAM not in plain.attributes
    assert A.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK not in plain.attributes
    assert A.GENERATE_STREAMER_DURATION not in plain.attributes


def test_client_operation_duration_counts_one_per_request(instrumented, metric_reader, gpt2):
    ids, mask = prompt(seed=15)
    for _ in range(3):
        gpt2.generate(ids, attention_mask=mask, max_new_tokens=2, eos_token_id=None)
    (point,) = histogram_points(metric_reader)[A.METRIC_CLIENT_OPERATION_DURATION]
    assert point.count == 3
    (server,) = histogram_points(metric_reader)[A.METRIC_REQUEST_DURATION]
    assert point.sum == server.sum > 0
    data = metric_reader.get_metrics_data()
    units = {m.name: m.unit for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
    assert units[A.METRIC_CLIENT_OPERATION_DURATION] == "s"


class SlowFirstStep(LogitsProcessor):
    """Sleeps in the prefill step only, so that this request's time to first token lands in a later bucket."""

    def __init__(self, seconds):
        self.seconds, self.calls = seconds, 0

    def __call__(self, input_ids, scores):
        self.calls += 1
        if self.calls == 1:
            time.sleep(self.seconds)
        return scores


def test_exemplars_point_at_the_request_spans(instrumented, span_exporter, tracer_provider, metric_reader, gpt2):
    """The SDK's default reservoir keeps the last exemplar of each bucket: the two requests'
    times to first token fall in different buckets (one sleeps 1.1 s in prefill, past the 1 s bucket
    bound; the other's prefill takes well under that even on a loaded machine, where a 50 ms sleep
    was not enough to separate them), so both are kept."""
    ids, mask = prompt(seed=16)
    tracer = tracer_provider.get_tracer("app")
    with tracer.start_as_current_span("handle_request") as app:
        gpt2.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=3,
            eos_token_id=None,
            logits_processor=LogitsProcessorList([SlowFirstStep(1.1)]),
        )
    gpt2.generate(ids, attention_mask=mask, max_new_tokens=3, eos_token_id=None)  # outside any span
    requests = {s.context.span_id for s in request_spans(span_exporter)}
    assert len(requests) == 2 and app.get_span_context().span_id not in requests
    points = histogram_points(metric_reader)
    (ttft,) = points[A.METRIC_TIME_TO_FIRST_TOKEN]
    assert {e.span_id for e in ttft.exemplars} == requests
    for name in (
        A.METRIC_TIME_PER_OUTPUT_TOKEN,
        A.METRIC_REQUEST_DURATION,
        A.METRIC_CLIENT_OPERATION_DURATION,
        A.METRIC_TOKEN_USAGE,
    ):
        for point in points[name]:
            exemplar_spans = {e.span_id for e in point.exemplars}
            assert exemplar_spans and exemplar_spans <= requests, name


class RaiseAtCall(LogitsProcessor):
    def __init__(self, at):
        self.at, self.calls = at, 0

    def __call__(self, input_ids, scores):
        self.calls += 1
        if self.calls == self.at:
            raise RuntimeError("logits processor failed")
        return scores


def test_failed_request_records_no_latency_histograms(instrumented, span_exporter, metric_reader, gpt2):
    ids, mask = prompt(seed=17)
    with pytest.raises(RuntimeError, match="logits processor failed"):
        gpt2.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=6,
            eos_token_id=None,
            logits_processor=LogitsProcessorList([RaiseAtCall(3)]),
        )
    (request,) = request_spans(span_exporter)
    assert request.status.status_code == trace.StatusCode.ERROR
    assert request.attributes[A.ERROR_TYPE] == "RuntimeError"
    assert request.attributes[A.GENERATE_STEPS] == 2  # two steps completed before the failure
    points = histogram_points(metric_reader)
    assert A.METRIC_TIME_TO_FIRST_TOKEN not in points and A.METRIC_TIME_PER_OUTPUT_TOKEN not in points
    for name in (A.METRIC_REQUEST_DURATION, A.METRIC_CLIENT_OPERATION_DURATION):
        (point,) = points[name]
        assert point.count == 1 and point.attributes[A.ERROR_TYPE] == "RuntimeError"
    # a successful request afterwards is counted
    gpt2.generate(ids, attention_mask=mask, max_new_tokens=3, eos_token_id=None)
    (ttft,) = histogram_points(metric_reader)[A.METRIC_TIME_TO_FIRST_TOKEN]
    assert ttft.count == 1 and A.ERROR_TYPE not in ttft.attributes


def test_tracer_and_meter_carry_the_schema_url(instrumented, span_exporter, metric_reader, gpt2):
    ids, mask = prompt(seed=18)
    gpt2.generate(ids, attention_mask=mask, max_new_tokens=2, eos_token_id=None)
    assert A.SCHEMA_URL == "https://opentelemetry.io/schemas/1.41.0"
    for span in span_exporter.get_finished_spans():
        assert span.instrumentation_scope.schema_url == A.SCHEMA_URL
    data = metric_reader.get_metrics_data()
    scopes = [sm.scope for rm in data.resource_metrics for sm in rm.scope_metrics if sm.scope.name == "otel_generate"]
    assert scopes and all(scope.schema_url == A.SCHEMA_URL for scope in scopes)
