"""Edge cases, each a regression test: exit with background emission,
a nested generate() of the same model, beams whose tokens equal the pad id, Whisper batches,
instrumentation turned off mid-request, processors added late or raising, foreign wrappers on a
model class, and a stop string on the last budget position."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
import wrapt
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanProcessor
from transformers import LogitsProcessor, LogitsProcessorList

from otel_generate import attributes as A
from otel_generate.bench.models import build_model
from tests.helpers import only_request, request_spans, step_spans, tiny_models, uninstrumented_generate
from tests.helpers.instrumenting import DrainingSpanExporter
from tests.integration.test_semconv import histogram_points


def ids(*tokens):
    x = torch.tensor([list(tokens)])
    return x, torch.ones_like(x)


def test_background_emission_is_drained_at_interpreter_exit(tmp_path):
    """The SDK registered its exit-time shutdown before the drain hooks existed: the emitter's own
    atexit drain must run first, or every queued span is lost at a plain exit."""
    out = tmp_path / "spans.txt"
    child = textwrap.dedent(f"""
        import time
        import torch
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
        from otel_generate import GenerateInstrumentor
        from otel_generate.bench.models import build_model

        class Slow(SpanExporter):
            def export(self, spans):
                time.sleep(0.02)
                with open({str(out)!r}, "a") as handle:
                    handle.writelines(span.name + "\\n" for span in spans)
                return SpanExportResult.SUCCESS

        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(Slow()))
        GenerateInstrumentor().instrument(tracer_provider=provider, background_emission=True)
        model = build_model("gpt2", seed=0)
        x = torch.tensor([[5, 17, 42, 9]])
        model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=20, eos_token_id=None, pad_token_id=0)
        # no force_flush, no shutdown: a plain exit
    """)
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    names = out.read_text().split()
    assert names.count("text_completion") == 1 and names.count("prefill") + names.count("decode") == 20


class CallsGenerate(LogitsProcessor):
    """At its second call, runs ``model.generate`` on the same model (a nested call inside a step)."""

    def __init__(self, model):
        self.model, self.calls = model, 0

    def __call__(self, input_ids, scores):
        self.calls += 1
        if self.calls == 2:
            y, mask = ids(1, 2)
            self.model.generate(y, attention_mask=mask, max_new_tokens=2, eos_token_id=None, pad_token_id=0)
        return scores


@pytest.mark.parametrize("how", ["logits_processor", "assistant_early_exit", "assistant_model"])
def test_a_generate_inside_a_step_does_not_write_into_the_request(instrumented, span_exporter, llama, how):
    x, mask = ids(5, 17, 42, 9)
    kwargs = dict(attention_mask=mask, max_new_tokens=8, eos_token_id=None, pad_token_id=0)
    if how == "logits_processor":
        kwargs["logits_processor"] = LogitsProcessorList([CallsGenerate(llama)])
    elif how == "assistant_early_exit":
        if "assistant_early_exit" not in __import__("transformers").GenerationConfig().__dict__:
            pytest.skip("no early-exit assisted decoding in this transformers")
        kwargs["assistant_early_exit"] = 1
    else:
        kwargs["assistant_model"] = llama
    out = llama.generate(x, **kwargs)
    assert out.shape[1] - 4 == 8
    request = only_request(span_exporter)
    attrs = request.attributes
    assert attrs[A.GEN_AI_USAGE_INPUT_TOKENS] == 4 and attrs[A.GEN_AI_USAGE_OUTPUT_TOKENS] == 8
    assert attrs[A.GEN_AI_REQUEST_MAX_TOKENS] == 8
    assert attrs[A.GENERATE_STRATEGY] == ("greedy" if how == "logits_processor" else "assisted")
    assert sum(s.attributes[A.GENERATE_STEP_TOKENS] for s in step_spans(span_exporter, request)) == 8


class Always(LogitsProcessor):
    """Makes ``token`` the only choice at every step."""

    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores):
        forced = torch.full_like(scores, -float("inf"))
        forced[:, self.token] = 0
        return forced


@pytest.mark.parametrize("sampled", [True, False])
def test_beams_of_tokens_equal_to_the_pad_id_are_output(instrument, meter_provider, metric_reader, gpt2, sampled):
    """Beam search pads only after an EOS: a beam without EOS made of the pad id is real output, counted
    in the span when sampled and in the token-usage metric either way."""
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased

    exporter = DrainingSpanExporter()
    provider = TracerProvider(sampler=ParentBased(ALWAYS_ON if sampled else ALWAYS_OFF))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    instrument(tracer_provider=provider, meter_provider=meter_provider)
    x, mask = ids(5, 17, 42, 9)
    out = gpt2.generate(
        x,
        attention_mask=mask,
        max_new_tokens=8,
        num_beams=2,
        pad_token_id=9,
        eos_token_id=127,
        logits_processor=LogitsProcessorList([Always(9)]),
    )
    assert out[0, 4:].tolist() == [9] * 8
    usage = {
        dict(p.attributes)[A.GEN_AI_TOKEN_TYPE]: p.sum for p in histogram_points(metric_reader)[A.METRIC_TOKEN_USAGE]
    }
    assert usage == {"input": 4, "output": 8}
    if sampled:
        attrs = only_request(exporter).attributes
        assert attrs[A.GEN_AI_USAGE_OUTPUT_TOKENS] == 8 and attrs[A.GEN_AI_RESPONSE_FINISH_REASONS] == ("length",)
    else:
        assert exporter.get_finished_spans() == ()


def test_whisper_batch_has_one_finish_reason_per_returned_row(instrumented, span_exporter):
    whisper = tiny_models.whisper()
    torch.manual_seed(0)
    frames = 6500
    features = torch.randn(2, 80, frames)
    mask = torch.ones(2, frames)
    mask[1, 3500:] = 0  # the second clip is 35 s: its rows end in different windows
    features[1, :, 3500:] = 0
    out = whisper.generate(input_features=features, attention_mask=mask, return_timestamps=True, max_new_tokens=20)
    sequences = out if torch.is_tensor(out) else out["sequences"]
    request = only_request(span_exporter)
    reasons = request.attributes[A.GEN_AI_RESPONSE_FINISH_REASONS]
    assert len(reasons) == sequences.shape[0] == 2
    assert set(reasons) <= {"stop", "length"}


class Slow(LogitsProcessor):
    def __init__(self, started, release):
        self.started, self.release, self.calls = started, release, 0

    def __call__(self, input_ids, scores):
        self.calls += 1
        if self.calls == 3:
            self.started.set()
            self.release.wait(30)
        return scores


@pytest.mark.parametrize("background", [False, True])
def test_uninstrument_during_a_request_still_emits_it(instrument, span_exporter, tracer_provider, gpt2, background):
    instrumentor = instrument(tracer_provider=tracer_provider, background_emission=background)
    started, release = threading.Event(), threading.Event()
    x, mask = ids(5, 17, 42, 9)
    results = []
    worker = threading.Thread(
        target=lambda: results.append(
            gpt2.generate(
                x,
                attention_mask=mask,
                max_new_tokens=6,
                eos_token_id=None,
                pad_token_id=0,
                logits_processor=LogitsProcessorList([Slow(started, release)]),
            )
        )
    )
    worker.start()
    assert started.wait(30)
    instrumentor.uninstrument()  # while the request is in its third step
    release.set()
    worker.join(30)
    assert results and results[0].shape[1] == 10
    request = only_request(span_exporter)
    assert request.attributes[A.GEN_AI_USAGE_OUTPUT_TOKENS] == 6


class Tenant(SpanProcessor):
    """A processor that does something in on_start (as a baggage processor does)."""

    def on_start(self, span, parent_context=None):
        span.set_attribute("tenant", "acme")


def test_a_processor_added_after_instrument_sees_the_step_spans(instrument, gpt2):
    exporter = DrainingSpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    instrument(tracer_provider=provider)
    provider.add_span_processor(Tenant())  # after instrument(): the fast path must not skip its on_start
    x, mask = ids(5, 17, 42, 9)
    gpt2.generate(x, attention_mask=mask, max_new_tokens=3, eos_token_id=None, pad_token_id=0)
    assert {s.name: s.attributes.get("tenant") for s in exporter.get_finished_spans()} == {
        "text_completion GPT2LMHeadModel": "acme",
        "prefill": "acme",
        "decode": "acme",
    }


class RaisesOnDecode(SpanProcessor):
    def on_end(self, span):
        if span.name == A.STEP_SPAN_DECODE:
            raise RuntimeError("processor bug")


def test_a_processor_raising_for_step_spans_costs_neither_metrics_nor_other_spans(
    instrument, metric_reader, meter_provider, gpt2, caplog, monkeypatch
):
    from otel_generate import _faults

    monkeypatch.setattr(_faults, "_logged_kinds", set())
    exporter = DrainingSpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    provider.add_span_processor(RaisesOnDecode())
    instrument(tracer_provider=provider, meter_provider=meter_provider)
    x, mask = ids(5, 17, 42, 9)
    with caplog.at_level(logging.WARNING, logger="otel_generate"):
        out = gpt2.generate(x, attention_mask=mask, max_new_tokens=4, eos_token_id=None, pad_token_id=0)
    assert out.shape[1] == 8
    request = only_request(exporter)
    assert A.GENERATE_STEPS_INCOMPLETE not in request.attributes  # the step data was complete
    assert len(step_spans(exporter, request)) == 4  # the exporter (first processor) got every step
    points = histogram_points(metric_reader)
    for name in (A.METRIC_CLIENT_OPERATION_DURATION, A.METRIC_TIME_TO_FIRST_TOKEN):
        (point,) = points[name]
        assert point.count == 1, name
    assert sum("step span export failed" in r.getMessage() for r in caplog.records) == 1


def test_a_foreign_wrapper_on_a_model_class_is_rewired_by_uninstrument(
    instrument, tracer_provider, span_exporter, caplog
):
    import transformers
    from transformers.generation.utils import GenerationMixin

    original = GenerationMixin.__dict__["generate"]
    calls = []

    def foreign(wrapped, instance, args, kwargs):
        calls.append(1)
        return wrapped(*args, **kwargs)

    class Local(transformers.GPT2LMHeadModel):  # a class of its own: the foreign wrapper stays on it
        pass

    instrumentor = instrument(tracer_provider=tracer_provider)
    ours = GenerationMixin.__dict__["generate"]
    wrapt.wrap_function_wrapper(Local, "generate", foreign)  # wraps the inherited hook, on the subclass
    assert Local.__dict__["generate"].__wrapped__ is ours
    with caplog.at_level(logging.WARNING, logger="otel_generate"):
        instrumentor.uninstrument()
    assert Local.__dict__["generate"].__wrapped__ is original  # ours taken out, the foreign wrapper kept
    assert not [r for r in caplog.records if "could not remove" in r.getMessage()]
    model = Local(build_model("gpt2", seed=0).config).eval()  # the shared tiny GPT-2, in a class of its own
    x, mask = ids(5, 17, 42, 9)
    model.generate(x, attention_mask=mask, max_new_tokens=2, eos_token_id=None, pad_token_id=0)
    assert calls == [1] and request_spans(span_exporter) == []


def test_a_stop_string_on_the_last_budget_token_is_stop(instrumented, span_exporter, llama, tokenizer):
    x, mask = ids(1, 17, 42, 9)
    plain = uninstrumented_generate(llama, x, attention_mask=mask, max_new_tokens=2, eos_token_id=None, pad_token_id=0)
    text = tokenizer.decode(plain[0, 5:6])  # the last token the budget allows, as text
    out = llama.generate(
        x,
        attention_mask=mask,
        max_new_tokens=2,
        eos_token_id=None,
        pad_token_id=0,
        stop_strings=[text],
        tokenizer=tokenizer,
    )
    assert out.tolist() == plain.tolist()  # the stop string matched at the last position, not before
    llama.generate(x, attention_mask=mask, max_new_tokens=2, eos_token_id=None, pad_token_id=0)
    stopped, budget = sorted(request_spans(span_exporter), key=lambda s: s.start_time)
    assert stopped.attributes[A.GEN_AI_RESPONSE_FINISH_REASONS] == ("stop",)
    assert budget.attributes[A.GEN_AI_RESPONSE_FINISH_REASONS] == ("length",)


class _LongValuedCriterion:
    """A user stopping criterion that returns a LongTensor: 0 for every row until row 0 has
    ``after`` new tokens, then 1, 2, 3, ... for row 0 (``StoppingCriteriaList`` then returns long
    values, ``bool | long``)."""

    def __init__(self, prompt_length, after):
        self.prompt_length, self.after = prompt_length, after

    def __call__(self, input_ids, scores, **kwargs):
        out = torch.zeros(input_ids.shape[0], dtype=torch.long)
        out[0] = max(0, input_ids.shape[-1] - self.prompt_length - self.after + 1)
        return out


def test_a_row_ends_at_its_first_nonzero_done_value_when_a_criterion_returns_long_values(
    instrument, tracer_provider, span_exporter, gpt2
):
    """Token counts from the recorded done values used argmax over the values themselves, so a
    long-valued criterion (0, 0, 1, 2, 3, ...) read as ending the row at its largest value."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    from otel_generate.tokens import counts_from_done

    # the unit: a row marked done with 1 at step 1 stays ended there whatever values follow
    done = [torch.tensor([0]), torch.tensor([1]), torch.tensor([2]), torch.tensor([3])]
    assert counts_from_done(done, [5, 6, 7, 8], 4, torch.zeros(1, 8, dtype=torch.long)) == [2]

    criterion = type("LongValued", (_LongValuedCriterion, StoppingCriteria), {})(prompt_length=4, after=2)
    x = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    kwargs = dict(
        attention_mask=torch.ones_like(x), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    expected = uninstrumented_generate(gpt2, x, stopping_criteria=StoppingCriteriaList([criterion]), **kwargs)
    instrument(tracer_provider=tracer_provider)
    out = gpt2.generate(x, stopping_criteria=StoppingCriteriaList([criterion]), **kwargs)
    assert torch.equal(out, expected)
    # row 1 ran its 8 tokens; row 0 was stopped after 2 (transformers pads the rest of the row)
    assert out.shape[-1] - 4 == 8
    span = only_request(span_exporter)
    assert span.attributes[A.GEN_AI_USAGE_OUTPUT_TOKENS] == 2 + 8
    assert list(span.attributes[A.GEN_AI_RESPONSE_FINISH_REASONS]) == ["stop", "length"]
