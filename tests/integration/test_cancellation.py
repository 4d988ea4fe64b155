"""A generation stopped because its client went away is ``cancelled``, not an error.

``transformers serve`` (without continuous batching) raises its private ``_GenerationCancelled``
from the streamer's ``put()`` when the client disconnected; tests/integration/test_serve.py runs the real
server in both modes with the ``openai`` client. Here the same exception class shape (a class of a
``transformers`` module) is raised by a streamer inside ``generate()``, on every transformers version.
"""

from __future__ import annotations

import pytest
import torch
from opentelemetry.trace import StatusCode
from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList

from otel_generate import attributes as A
from otel_generate.cancellation import is_cancellation
from tests.helpers import only_request, prompt, step_spans


def _transformers_exception(name, module="transformers.cli.serving.utils"):
    return type(name, (Exception,), {"__module__": module})


StandInCancelled = _transformers_exception("_GenerationCancelled")


class CancellingStreamer:
    """Raises ``StandInCancelled`` on its ``cancel_at``-th put of generated tokens (the first put is the prompt)."""

    def __init__(self, cancel_at):
        self.cancel_at = cancel_at
        self.prompt_seen = False
        self.token_puts = 0
        self.delivered = 0

    def put(self, value):
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.token_puts += 1
        if self.token_puts >= self.cancel_at:
            raise StandInCancelled()
        self.delivered += int(value.numel())

    def end(self):
        raise AssertionError("a cancelled generate() never ends its streamer")


class CountingCriteria(StoppingCriteria):
    """Counts its calls: one per decoding step that appended a token, as transformers sees it."""

    def __init__(self):
        self.calls = 0

    def __call__(self, input_ids, scores, **kwargs):
        self.calls += 1
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def test_which_exceptions_are_a_cancellation():
    assert is_cancellation(StandInCancelled())
    assert is_cancellation(type("Sub", (StandInCancelled,), {})())  # a subclass, anywhere
    assert is_cancellation(_transformers_exception("RequestCancelled", "transformers.cli.serving.other")())  # renamed
    assert not is_cancellation(_transformers_exception("_GenerationCancelled", "myapp.serving")())
    assert not is_cancellation(_transformers_exception("CBWorkerDeadError")())
    assert not is_cancellation(ValueError("boom"))
    assert not is_cancellation(None)
    try:
        from transformers.cli.serving.utils import _GenerationCancelled
    except ImportError:
        return  # this transformers has no such serve (4.x)
    assert is_cancellation(_GenerationCancelled())


def test_a_generate_cancelled_by_its_streamer_is_not_an_error(gpt2, instrumented, span_exporter, metric_reader):
    ids, mask = prompt()
    streamer, criteria = CancellingStreamer(cancel_at=4), CountingCriteria()
    with pytest.raises(StandInCancelled):  # what generate() raises is never changed
        gpt2.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=40,
            min_new_tokens=40,
            do_sample=False,
            streamer=streamer,
            stopping_criteria=StoppingCriteriaList([criteria]),
        )
    span = only_request(span_exporter)
    attrs = span.attributes
    assert list(attrs[A.GEN_AI_RESPONSE_FINISH_REASONS]) == [A.FINISH_REASON_CANCELLED]
    assert span.status.status_code == StatusCode.UNSET
    assert A.ERROR_TYPE not in attrs
    assert not [event for event in span.events if event.name == "exception"]
    # the tokens produced: one per step transformers checked with the criteria (greedy, one row), which
    # include every token the streamer delivered before the cancellation
    assert attrs[A.GEN_AI_USAGE_OUTPUT_TOKENS] == criteria.calls
    assert criteria.calls >= streamer.delivered == streamer.cancel_at - 1
    assert attrs[A.GENERATE_STEPS] == criteria.calls == len(step_spans(span_exporter, span))
    assert A.GENERATE_STEPS_INCOMPLETE not in attrs
    # the metrics see no error either
    points = [
        point
        for resource in metric_reader.get_metrics_data().resource_metrics
        for scope in resource.scope_metrics
        for metric in scope.metrics
        for point in metric.data.data_points
    ]
    assert points and all(A.ERROR_TYPE not in point.attributes for point in points)
    usage = [
        p
        for p in points
        if p.attributes.get(A.GEN_AI_TOKEN_TYPE) == A.TOKEN_TYPE_OUTPUT and hasattr(p, "sum") and p.count == 1
    ]
    assert [p.sum for p in usage] == [criteria.calls]


def test_an_unsampled_cancelled_request_counts_its_tokens_in_the_metrics(gpt2, span_exporter, metric_reader):
    """Its steps are timed for the metrics (a meter provider collects them), so the tokens it produced
    are counted as a sampled one's are, with no error."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

    from otel_generate import GenerateInstrumentor

    provider = TracerProvider(sampler=ALWAYS_OFF)
    provider.add_span_processor(SimpleSpanProcessor(span_exporter))
    instrumentor = GenerateInstrumentor()
    instrumentor.instrument(tracer_provider=provider, meter_provider=MeterProvider(metric_readers=[metric_reader]))
    ids, mask = prompt()
    streamer, criteria = CancellingStreamer(cancel_at=4), CountingCriteria()
    try:
        with pytest.raises(StandInCancelled):
            gpt2.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=40,
                min_new_tokens=40,
                do_sample=False,
                streamer=streamer,
                stopping_criteria=StoppingCriteriaList([criteria]),
            )
    finally:
        instrumentor.uninstrument()
    assert span_exporter.get_finished_spans() == ()
    points = {
        (metric.name, point.attributes.get(A.GEN_AI_TOKEN_TYPE)): point
        for resource in metric_reader.get_metrics_data().resource_metrics
        for scope in resource.scope_metrics
        for metric in scope.metrics
        for point in metric.data.data_points
    }
    assert all(A.ERROR_TYPE not in point.attributes for point in points.values())
    output = points[(A.METRIC_TOKEN_USAGE, A.TOKEN_TYPE_OUTPUT)]
    assert (output.count, output.sum) == (1, criteria.calls)
    assert criteria.calls >= streamer.delivered == streamer.cancel_at - 1
    assert points[(A.METRIC_TIME_TO_FIRST_TOKEN, None)].count == 1
    assert points[(A.METRIC_INTER_TOKEN_LATENCY, None)].count == criteria.calls - 1
