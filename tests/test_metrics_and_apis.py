"""GenAI metrics, and the three Python-side latency APIs: callback, profiler, track_token_latency."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from conftest import prompt, request_spans, step_spans, uninstrumented_generate
from transformers import GenerationConfig
from transformers.generation.utils import GenerationMixin

from otel_generate import GenerateInstrumentor, TokenLatencyProfiler
from otel_generate import attributes as A
from otel_generate.bench.models import EOS_TOKEN_ID, PAD_TOKEN_ID
from otel_generate.tokens import count_new_tokens


def histograms(reader):
    """{metric name: [data points]} from an InMemoryMetricReader."""
    found = {}
    data = reader.get_metrics_data()
    for resource_metrics in data.resource_metrics if data else []:
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                found.setdefault(metric.name, []).extend(metric.data.data_points)
    return found


def by_token_type(points, token_type):
    return [p for p in points if p.attributes.get(A.GEN_AI_TOKEN_TYPE) == token_type]


# --- metrics ----------------------------------------------------------------------------------------


def test_twenty_requests_of_eight_tokens(instrumented, metric_reader, gpt2):
    ids, mask = prompt(length=4)
    for _ in range(20):
        out = gpt2.generate(ids, attention_mask=mask, max_new_tokens=8, eos_token_id=None)
        assert out.shape[-1] - 4 == 8
    found = histograms(metric_reader)

    (ttft,) = found[A.METRIC_TIME_TO_FIRST_TOKEN]
    assert ttft.count == 20
    (tpot,) = found[A.METRIC_TIME_PER_OUTPUT_TOKEN]
    assert tpot.count == 20
    (duration,) = found[A.METRIC_REQUEST_DURATION]
    assert duration.count == 20
    (operation,) = found[A.METRIC_CLIENT_OPERATION_DURATION]
    assert operation.count == 20 and operation.sum == duration.sum
    (output,) = by_token_type(found[A.METRIC_TOKEN_USAGE], A.TOKEN_TYPE_OUTPUT)
    (inputs,) = by_token_type(found[A.METRIC_TOKEN_USAGE], A.TOKEN_TYPE_INPUT)
    assert output.count == 20 and output.sum == 160
    assert inputs.count == 20 and inputs.sum == 80
    assert duration.sum >= ttft.sum > 0
    for point in (ttft, tpot, duration, output):
        assert point.attributes[A.GEN_AI_OPERATION_NAME] == "text_completion"
        assert point.attributes[A.GEN_AI_PROVIDER_NAME] == "transformers"
        assert point.attributes[A.GEN_AI_REQUEST_MODEL] == type(gpt2).__name__
        assert A.ERROR_TYPE not in point.attributes


@pytest.mark.parametrize("sampler_name", ["parentbased_always_off", "traceidratio_0.1"])
def test_every_request_is_in_every_histogram_whatever_the_sampler(
    sampler_name, span_exporter, meter_provider, metric_reader, gpt2
):
    """Issue 17, item 1: ten generate() calls of 8 new tokens under a sampler that keeps none or
    about one of them: each latency histogram counts 10, the inter-token latency 70, and only a
    sampled request span is an exemplar."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased, TraceIdRatioBased

    sampler = ParentBased(ALWAYS_OFF) if sampler_name == "parentbased_always_off" else TraceIdRatioBased(0.1)
    provider = TracerProvider(sampler=sampler)
    provider.add_span_processor(SimpleSpanProcessor(span_exporter))
    instrumentor = GenerateInstrumentor()
    instrumentor.instrument(tracer_provider=provider, meter_provider=meter_provider)
    try:
        ids, mask = prompt(length=4)
        for _ in range(10):
            out = gpt2.generate(ids, attention_mask=mask, max_new_tokens=8, eos_token_id=None)
            assert out.shape[-1] - 4 == 8
    finally:
        instrumentor.uninstrument()
    found = histograms(metric_reader)
    (ttft,) = found[A.METRIC_TIME_TO_FIRST_TOKEN]
    (tpot,) = found[A.METRIC_TIME_PER_OUTPUT_TOKEN]
    (duration,) = found[A.METRIC_REQUEST_DURATION]
    (operation,) = found[A.METRIC_CLIENT_OPERATION_DURATION]
    (itl,) = found[A.METRIC_INTER_TOKEN_LATENCY]
    assert (ttft.count, tpot.count, duration.count, operation.count) == (10, 10, 10, 10)
    assert itl.count == 70  # 7 decode steps after the first token, per request
    assert 0 < ttft.sum / 10 < duration.sum / 10
    # time per output token = (last step end - first token) / 7 = the mean of the request's 7 gaps
    assert itl.sum == pytest.approx(7 * tpot.sum, rel=1e-9)
    assert 0 < tpot.sum < duration.sum
    (output,) = by_token_type(found[A.METRIC_TOKEN_USAGE], A.TOKEN_TYPE_OUTPUT)
    (inputs,) = by_token_type(found[A.METRIC_TOKEN_USAGE], A.TOKEN_TYPE_INPUT)
    assert (output.count, output.sum, inputs.count, inputs.sum) == (10, 80, 10, 40)
    sampled = {span.context.trace_id for span in request_spans(span_exporter)}
    if sampler_name == "parentbased_always_off":
        assert sampled == set()
    exemplar_traces = {
        exemplar.trace_id
        for points in found.values()
        for point in points
        for exemplar in point.exemplars
        if exemplar.trace_id is not None
    }
    assert exemplar_traces <= sampled  # exemplars only where a sampled span exists


def test_sampled_requests_exemplars_point_at_their_span(instrumented, span_exporter, metric_reader, gpt2):
    ids, mask = prompt(length=4)
    gpt2.generate(ids, attention_mask=mask, max_new_tokens=8, eos_token_id=None)
    (span,) = request_spans(span_exporter)
    found = histograms(metric_reader)
    for name in (A.METRIC_TIME_TO_FIRST_TOKEN, A.METRIC_INTER_TOKEN_LATENCY):
        (point,) = found[name]
        assert point.exemplars and {e.span_id for e in point.exemplars} == {span.context.span_id}, name


def test_inter_token_latency_is_one_gap_per_decode_step(instrumented, span_exporter, metric_reader, gpt2):
    """Issue 17, item 2: one single-row request of 8 new tokens gives 7 observations, the latencies
    of its 7 decode step spans."""
    ids, mask = prompt(length=4)
    out = gpt2.generate(ids, attention_mask=mask, max_new_tokens=8, eos_token_id=None)
    assert out.shape[-1] - 4 == 8
    decode = [s.attributes[A.GENERATE_STEP_LATENCY] for s in step_spans(span_exporter) if s.name == "decode"]
    assert len(decode) == 7
    (itl,) = histograms(metric_reader)[A.METRIC_INTER_TOKEN_LATENCY]
    assert itl.count == 7
    assert itl.sum == pytest.approx(sum(decode), rel=1e-6)
    assert itl.min == pytest.approx(min(decode), rel=1e-6) and itl.max == pytest.approx(max(decode), rel=1e-6)
    assert list(itl.explicit_bounds) == list(A.BUCKETS_INTER_TOKEN_LATENCY_S)
    assert itl.attributes == {
        A.GEN_AI_OPERATION_NAME: "text_completion",
        A.GEN_AI_PROVIDER_NAME: "transformers",
        A.GEN_AI_REQUEST_MODEL: type(gpt2).__name__,
    }


def test_inter_token_latency_divides_a_step_by_its_tokens():
    """A step that produced 3 tokens per sequence (assisted decoding) is one gap of a third of its
    latency; a prompt step of a later inner call and a step with no token give none."""
    from otel_generate.derive import inter_token_latencies_ns
    from otel_generate.request import InnerCall, Request

    request = Request(model="m", start_ns=0, start_wall_ns=0)
    request.step_ends_ns = [10, 16, 25, 40, 44, 50]
    request.step_tokens = [1, 1, 3, 1, 0, 2]
    request.calls = [InnerCall(start_ns=0, first_step=0, steps=3), InnerCall(start_ns=25, first_step=3, steps=3)]
    assert list(inter_token_latencies_ns(request)) == [6, 3, 3]


def test_bucket_boundaries_are_the_semconv_ones(instrumented, metric_reader, gpt2):
    ids, mask = prompt()
    gpt2.generate(ids, attention_mask=mask, max_new_tokens=3, eos_token_id=None)
    found = histograms(metric_reader)
    expected = {
        A.METRIC_TIME_TO_FIRST_TOKEN: [
            0.001,
            0.005,
            0.01,
            0.02,
            0.04,
            0.06,
            0.08,
            0.1,
            0.25,
            0.5,
            0.75,
            1.0,
            2.5,
            5.0,
            7.5,
            10.0,
        ],
        A.METRIC_TIME_PER_OUTPUT_TOKEN: [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5],
        A.METRIC_REQUEST_DURATION: [
            0.01,
            0.02,
            0.04,
            0.08,
            0.16,
            0.32,
            0.64,
            1.28,
            2.56,
            5.12,
            10.24,
            20.48,
            40.96,
            81.92,
        ],
        A.METRIC_CLIENT_OPERATION_DURATION: [
            0.01,
            0.02,
            0.04,
            0.08,
            0.16,
            0.32,
            0.64,
            1.28,
            2.56,
            5.12,
            10.24,
            20.48,
            40.96,
            81.92,
        ],
        A.METRIC_TOKEN_USAGE: [
            1,
            4,
            16,
            64,
            256,
            1024,
            4096,
            16384,
            65536,
            262144,
            1048576,
            4194304,
            16777216,
            67108864,
        ],
    }
    for name, bounds in expected.items():
        for point in found[name]:
            assert list(point.explicit_bounds) == bounds, name


def test_a_fault_building_a_sampled_request_span_still_records_its_metrics(
    instrumented, span_exporter, metric_reader, gpt2, monkeypatch
):
    """Every request is in every histogram (issue 17), also when building the sampled span's
    attributes faults: the figures then come from the request itself, as for an unsampled one."""
    from otel_generate import emit

    def broken_annotate(*args, **kwargs):
        raise RuntimeError("attributes")

    monkeypatch.setattr(emit, "_annotate", broken_annotate)
    ids, mask = prompt()
    output = gpt2.generate(ids, attention_mask=mask, max_new_tokens=8, eos_token_id=None)
    (request,) = request_spans(span_exporter)
    assert request.attributes[A.GENERATE_STEPS_INCOMPLETE] is True
    counts = {name: sum(p.count for p in points) for name, points in histograms(metric_reader).items()}
    new_tokens = output.shape[1] - ids.shape[1]
    assert counts[A.METRIC_REQUEST_DURATION] == 1
    assert counts[A.METRIC_TIME_TO_FIRST_TOKEN] == 1
    assert counts[A.METRIC_TIME_PER_OUTPUT_TOKEN] == 1
    assert counts[A.METRIC_INTER_TOKEN_LATENCY] == new_tokens - 1 == 7
    output_usage = by_token_type(histograms(metric_reader)[A.METRIC_TOKEN_USAGE], "output")
    assert [p.sum for p in output_usage] == [new_tokens]


def test_failed_request_carries_error_type(instrumented, metric_reader, gpt2):
    ids, mask = prompt()
    with pytest.raises(ValueError):
        gpt2.generate(ids, attention_mask=mask, max_new_tokens=-1)
    (duration,) = histograms(metric_reader)[A.METRIC_REQUEST_DURATION]
    assert duration.attributes[A.ERROR_TYPE] == "ValueError"
    assert A.METRIC_TIME_TO_FIRST_TOKEN not in histograms(metric_reader)


def test_unit_and_instrument_names(instrumented, metric_reader, gpt2):
    ids, mask = prompt()
    gpt2.generate(ids, attention_mask=mask, max_new_tokens=2, eos_token_id=None)
    data = metric_reader.get_metrics_data()
    units = {m.name: m.unit for rm in data.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
    assert units == {
        A.METRIC_TIME_TO_FIRST_TOKEN: "s",
        A.METRIC_TIME_PER_OUTPUT_TOKEN: "s",
        A.METRIC_REQUEST_DURATION: "s",
        A.METRIC_CLIENT_OPERATION_DURATION: "s",
        A.METRIC_TOKEN_USAGE: "{token}",
        A.METRIC_INTER_TOKEN_LATENCY: "s",
    }


# --- per_token_latency_callback -----------------------------------------------------------------------


def test_callback_matches_step_spans(instrumented, span_exporter, gpt2):
    calls = []
    ids, mask = prompt(batch=2, length=5, seed=2)
    expected = uninstrumented_generate(gpt2, ids, attention_mask=mask, max_new_tokens=6, eos_token_id=None)
    out = gpt2.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=6,
        eos_token_id=None,
        per_token_latency_callback=lambda index, latency: calls.append((index, latency)),
    )
    assert torch.equal(out, expected)
    (request,) = request_spans(span_exporter)
    steps = step_spans(span_exporter, request)
    assert len(calls) == request.attributes[A.GENERATE_STEPS] == len(steps) == 6
    assert [index for index, _ in calls] == [s.attributes[A.GENERATE_TOKEN_INDEX] for s in steps] == list(range(6))
    for (_, latency), step in zip(calls, steps):
        assert isinstance(latency, float)
        assert latency == pytest.approx(step.attributes[A.GENERATE_STEP_LATENCY], rel=1e-12)


def test_callback_with_prompt_lookup_reports_first_token_index_of_each_step(instrumented, span_exporter, gpt2):
    from test_instrumentor import NoEos, _repetitive_prompt
    from transformers import LogitsProcessorList

    ids, mask = _repetitive_prompt(gpt2)
    calls = []
    gpt2.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=20,
        prompt_lookup_num_tokens=5,
        logits_processor=LogitsProcessorList([NoEos()]),
        per_token_latency_callback=lambda i, s: calls.append(i),
    )
    steps = step_spans(span_exporter)
    assert calls == [s.attributes[A.GENERATE_TOKEN_INDEX] for s in steps]
    assert len(calls) < 20


def test_raising_callback_does_not_break_generation(instrumented, span_exporter, gpt2, monkeypatch, caplog):
    from otel_generate import _faults

    monkeypatch.setattr(_faults, "_logged_kinds", set())
    seen = []

    def bad(index, latency):
        seen.append(index)
        raise RuntimeError("callback bug")

    ids, mask = prompt(seed=3)
    expected = uninstrumented_generate(gpt2, ids, attention_mask=mask, max_new_tokens=4, eos_token_id=None)
    with caplog.at_level("WARNING", logger="otel_generate"):
        out = gpt2.generate(
            ids, attention_mask=mask, max_new_tokens=4, eos_token_id=None, per_token_latency_callback=bad
        )
    assert torch.equal(out, expected)
    assert seen == [0, 1, 2, 3]  # still called every step
    assert len([r for r in caplog.records if "per_token_latency_callback" in r.getMessage()]) == 1
    (request,) = request_spans(span_exporter)
    assert len(step_spans(span_exporter, request)) == 4  # recording went on
    assert A.GENERATE_STEPS_INCOMPLETE not in request.attributes


def test_callback_keyword_never_reaches_transformers_even_when_suppressed(instrumented, gpt2):
    from opentelemetry.instrumentation.utils import suppress_instrumentation

    calls = []
    ids, mask = prompt()
    with suppress_instrumentation():
        out = gpt2.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=2,
            eos_token_id=None,
            per_token_latency_callback=lambda i, s: calls.append(i),
        )
    assert out.shape[-1] == 6
    assert calls == []  # suppressed: nothing runs per step


def test_non_callable_callback_is_a_type_error(instrumented, gpt2):
    ids, mask = prompt()
    with pytest.raises(TypeError, match="per_token_latency_callback must be callable"):
        gpt2.generate(ids, attention_mask=mask, max_new_tokens=2, per_token_latency_callback=3)


def test_callback_works_when_the_span_is_not_sampled(span_exporter, gpt2):
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

    instrumentor = GenerateInstrumentor()
    instrumentor.instrument(tracer_provider=TracerProvider(sampler=ALWAYS_OFF))
    try:
        calls = []
        ids, mask = prompt()
        gpt2.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=3,
            eos_token_id=None,
            per_token_latency_callback=lambda i, s: calls.append(i),
        )
    finally:
        instrumentor.uninstrument()
    assert calls == [0, 1, 2]


# --- TokenLatencyProfiler --------------------------------------------------------------------------------


def test_profiler_records_and_spans_both_with_sdk(instrumented, span_exporter, gpt2, tmp_path):
    ids, mask = prompt(batch=2, length=4, seed=5)
    with TokenLatencyProfiler() as prof:
        out1 = gpt2.generate(ids, attention_mask=mask, max_new_tokens=5, eos_token_id=None)
        out2 = gpt2.generate(ids[:1], attention_mask=mask[:1], max_new_tokens=3, eos_token_id=None)
    gpt2.generate(ids, attention_mask=mask, max_new_tokens=2, eos_token_id=None)  # outside: not recorded
    assert len(prof.records) == 2
    first, second = prof.records
    assert first.output_tokens == sum(count_new_tokens(out1, 4)) == 10
    assert second.output_tokens == out2.shape[-1] - 4 == 3
    assert first.input_tokens == 8 and second.input_tokens == 4
    assert first.step_tokens == [1] * 5
    assert len(request_spans(span_exporter)) == 3
    spans = step_spans(span_exporter, request_spans(span_exporter)[0])
    assert first.step_latencies_s == pytest.approx([s.attributes[A.GENERATE_STEP_LATENCY] for s in spans])
    assert first.time_to_first_token_s == first.step_latencies_s[0]
    assert first.time_per_output_token_s == pytest.approx(sum(first.step_latencies_s[1:]) / 4)

    summary = prof.summary()
    assert summary["requests"] == 2
    assert summary["output_tokens"] == 13 and summary["input_tokens"] == 12
    ttft = summary["time_to_first_token_s"]
    values = sorted(r.time_to_first_token_s for r in prof.records)
    assert ttft["count"] == 2
    assert ttft["mean"] == pytest.approx(sum(values) / 2)
    assert ttft["p50"] == pytest.approx(sum(values) / 2)  # linear interpolation between the two
    assert ttft["p99"] == pytest.approx(values[0] + 0.99 * (values[1] - values[0]))
    assert set(summary["time_per_output_token_s"]) == {"count", "mean", "p50", "p90", "p99"}

    path = tmp_path / "latency.json"
    text = prof.to_json(str(path))
    document = json.loads(path.read_text())
    assert document == json.loads(text)
    assert document["summary"]["requests"] == 2
    assert document["requests"][0]["step_latencies_s"] == first.step_latencies_s
    assert document["requests"][1]["output_tokens"] == 3


def test_profiler_instruments_itself_and_restores(gpt2):
    original = GenerationMixin.__dict__["generate"]
    assert not GenerateInstrumentor().is_instrumented_by_opentelemetry
    ids, mask = prompt()
    with TokenLatencyProfiler() as outer:
        assert GenerateInstrumentor().is_instrumented_by_opentelemetry
        with TokenLatencyProfiler() as inner:
            gpt2.generate(ids, attention_mask=mask, max_new_tokens=3, eos_token_id=None)
        gpt2.generate(ids, attention_mask=mask, max_new_tokens=2, eos_token_id=None)
        assert GenerateInstrumentor().is_instrumented_by_opentelemetry
    assert not GenerateInstrumentor().is_instrumented_by_opentelemetry
    assert GenerationMixin.__dict__["generate"] is original
    assert [r.output_tokens for r in inner.records] == [3]
    assert [r.output_tokens for r in outer.records] == [3, 2]  # nested: the outer sees both


def test_profilers_in_two_threads_do_not_cross_talk(instrumented, gpt2):
    ids, mask = prompt()
    barrier = threading.Barrier(2)
    profilers = {}
    errors = []

    def work(new_tokens, requests):
        try:
            with TokenLatencyProfiler() as prof:
                barrier.wait()
                for _ in range(requests):
                    gpt2.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, eos_token_id=None)
            profilers[new_tokens] = prof
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(3, 4)), threading.Thread(target=work, args=(5, 3))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert [r.output_tokens for r in profilers[3].records] == [3] * 4
    assert [r.output_tokens for r in profilers[5].records] == [5] * 3
    assert all(len(r.step_latencies_s) == 3 for r in profilers[3].records)


def test_profiler_with_only_the_api_installed(tmp_path):
    """The API-only dependency path: opentelemetry.sdk cannot be imported at all."""
    script = textwrap.dedent(
        """
        import importlib.abc, sys

        class NoSdk(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "opentelemetry.sdk" or name.startswith("opentelemetry.sdk."):
                    raise ImportError("opentelemetry-sdk is not installed (simulated)")
                return None

        sys.meta_path.insert(0, NoSdk())
        import json, torch
        from otel_generate import TokenLatencyProfiler
        from otel_generate.bench.models import build_model

        model = build_model("gpt2")
        ids = torch.tensor([[5, 6, 7, 8]])
        with TokenLatencyProfiler() as prof:
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, eos_token_id=None)
        assert "opentelemetry.sdk" not in sys.modules
        record = prof.records[0]
        print(json.dumps({"new": out.shape[-1] - 4, "output_tokens": record.output_tokens,
                          "steps": len(record.step_latencies_s), "ttft": record.time_to_first_token_s}))
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["new"] == result["output_tokens"] == result["steps"] == 4
    assert result["ttft"] > 0


# --- track_token_latency ----------------------------------------------------------------------------------


def test_generation_config_flag_attaches_token_latencies(instrumented, span_exporter, gpt2, recwarn):
    ids, mask = prompt(seed=6)
    config = GenerationConfig(
        track_token_latency=True,
        max_new_tokens=4,
        return_dict_in_generate=True,
        eos_token_id=None,
        pad_token_id=PAD_TOKEN_ID,
    )
    expected = uninstrumented_generate(gpt2, ids, attention_mask=mask, generation_config=config)
    out = gpt2.generate(ids, attention_mask=mask, generation_config=config)
    assert torch.equal(out.sequences, expected.sequences)
    assert set(out.keys()) == set(expected.keys())  # nothing added to the ModelOutput's fields
    steps = step_spans(span_exporter)
    assert out.token_latencies == pytest.approx([s.attributes[A.GENERATE_STEP_LATENCY] for s in steps])
    assert len(out.token_latencies) == 4
    assert not [w for w in recwarn if "track_token_latency" in str(w.message)]


def test_generate_keyword_flag_and_plain_tensor_return(instrumented, gpt2, caplog):
    ids, mask = prompt(seed=7)
    out = gpt2.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=3,
        eos_token_id=None,
        track_token_latency=True,
        return_dict_in_generate=True,
    )
    assert len(out.token_latencies) == 3 and all(t > 0 for t in out.token_latencies)
    expected = uninstrumented_generate(gpt2, ids, attention_mask=mask, max_new_tokens=3, eos_token_id=None)
    with caplog.at_level("INFO", logger="otel_generate"):
        plain = gpt2.generate(ids, attention_mask=mask, max_new_tokens=3, eos_token_id=None, track_token_latency=True)
    # documented: a plain tensor is returned unchanged, without token_latencies
    assert type(plain) is torch.Tensor and torch.equal(plain, expected)
    assert not hasattr(plain, "token_latencies")
    assert any("return_dict_in_generate=True" in r.getMessage() for r in caplog.records)


def test_flag_without_dict_output_and_eos(instrumented, gpt2):
    """Early EOS: one latency per step actually run."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class EosAtTwo(LogitsProcessor):
        def __call__(self, input_ids, scores):
            scores = scores.clone()
            if input_ids.shape[-1] - 4 == 2:
                scores[:, :] = -float("inf")
                scores[:, EOS_TOKEN_ID] = 0
            return scores

    ids, mask = prompt()
    out = gpt2.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=8,
        eos_token_id=EOS_TOKEN_ID,
        track_token_latency=True,
        return_dict_in_generate=True,
        logits_processor=LogitsProcessorList([EosAtTwo()]),
    )
    assert out.sequences.shape[-1] - 4 == 3
    assert len(out.token_latencies) == 3


# --- regressions ------------------------------------------------------------------------------------------


def test_profilers_closed_out_of_order(instrumented, gpt2):
    ids, mask = prompt()
    a, b = TokenLatencyProfiler(), TokenLatencyProfiler()
    a.__enter__()
    b.__enter__()
    a.__exit__(None, None, None)  # a closes first
    gpt2.generate(ids, attention_mask=mask, max_new_tokens=2, eos_token_id=None)
    b.__exit__(None, None, None)
    gpt2.generate(ids, attention_mask=mask, max_new_tokens=3, eos_token_id=None)
    assert [r.output_tokens for r in a.records] == []
    assert [r.output_tokens for r in b.records] == [2]
    from otel_generate.profiler import active_profilers

    assert active_profilers() == ()


def test_instrument_inside_a_profiler_takes_over(tracer_provider, span_exporter, gpt2):
    ids, mask = prompt()
    assert not GenerateInstrumentor().is_instrumented_by_opentelemetry
    try:
        with TokenLatencyProfiler() as prof:
            GenerateInstrumentor().instrument(tracer_provider=tracer_provider)  # the app's own set-up
            gpt2.generate(ids, attention_mask=mask, max_new_tokens=2, eos_token_id=None)
        assert GenerateInstrumentor().is_instrumented_by_opentelemetry  # leaving the profiler keeps it on
        gpt2.generate(ids, attention_mask=mask, max_new_tokens=3, eos_token_id=None)
    finally:
        GenerateInstrumentor().uninstrument()
    assert [r.output_tokens for r in prof.records] == [2]
    assert [s.attributes[A.GEN_AI_USAGE_OUTPUT_TOKENS] for s in request_spans(span_exporter)] == [2, 3]


def test_generate_keyword_false_overrides_the_config_flag(instrumented, gpt2):
    ids, mask = prompt()
    config = GenerationConfig(
        track_token_latency=True,
        max_new_tokens=2,
        return_dict_in_generate=True,
        eos_token_id=None,
        pad_token_id=PAD_TOKEN_ID,
    )
    out = gpt2.generate(ids, attention_mask=mask, generation_config=config, track_token_latency=False)
    assert not hasattr(out, "token_latencies")
    out = gpt2.generate(ids, attention_mask=mask, generation_config=config)
    assert len(out.token_latencies) == 2
