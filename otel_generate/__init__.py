"""OpenTelemetry instrumentation for Hugging Face transformers' ``generate()``.

Every ``generate()`` call becomes a span (``text_completion {model}``); every decode step
becomes a child span (``prefill`` for the first, ``decode`` for the rest) carrying its token
index and its latency, measured after waiting for the device. The same measurements feed the
GenAI metrics and the Python APIs (:class:`TokenLatencyProfiler`, ``per_token_latency_callback``,
``track_token_latency``).

Usage
-----
With no code change::

    pip install otel-generate opentelemetry-distro
    opentelemetry-instrument --traces_exporter console --metrics_exporter none python app.py

With one line::

    from otel_generate import GenerateInstrumentor

    GenerateInstrumentor().instrument()
    model.generate(**inputs)          # -> one request span with one child span per step

    GenerateInstrumentor().uninstrument()   # requests of other threads still in their set-up
                                            # are waited for (at most 2 s): they complete fully

Configuration
-------------
``instrument()`` takes these keywords (an unknown keyword raises ``TypeError``):

* ``tracer_provider`` / ``meter_provider``: providers to use instead of the global ones.
* ``synchronize`` (bool, default ``True``): wait for the device (``torch.cuda.synchronize``,
  ``torch.xpu.synchronize``, ``torch.mps.synchronize``) before each step's clock read. On CPU
  nothing is called either way. Environment: ``OTEL_GENERATE_SYNCHRONIZE=true|false``.
* ``max_step_spans`` (int >= 0, default 1024): at most this many step spans per request; the
  request span still carries the totals and ``generate.step_spans.dropped`` says how many steps
  were timed but not exported as spans. Environment: ``OTEL_GENERATE_MAX_STEP_SPANS``.
* ``capture_message_content`` (bool or ``"NO_CONTENT"``, ``"SPAN_ONLY"``, ``"EVENT_ONLY"``,
  ``"SPAN_AND_EVENT"``; default off): the prompt and completion text as
  ``gen_ai.input.messages`` / ``gen_ai.output.messages`` (``True`` means ``SPAN_ONLY``), when a
  tokenizer is at hand (see :mod:`otel_generate.content`). Environment:
  ``OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT``.
* ``logger_provider``: the logs-API provider the ``gen_ai.client.inference.operation.details``
  event goes to (``EVENT_ONLY``, ``SPAN_AND_EVENT``) instead of the global one.
* ``capture_step_token_ids`` (bool, default ``False``): ``generate.step.token_ids`` on the step
  spans. Environment: ``OTEL_GENERATE_CAPTURE_STEP_TOKEN_IDS``.
* ``capture_step_logprobs`` (bool, default ``False``): ``generate.step.logprobs`` (and the token
  ids) on the step spans, for greedy and sampling requests. Environment:
  ``OTEL_GENERATE_CAPTURE_STEP_LOGPROBS``.

* ``step_spans`` (``"all"``, ``"none"`` or ``"slow"``; default ``"all"``): which requests get
  step spans. ``slow``: only requests that failed, whose time to first token exceeds
  ``slow_time_to_first_token`` (seconds, default 1.0), whose time per output token exceeds
  ``slow_time_per_output_token`` (seconds, default 0.1), or that are among the slowest
  ``slow_fraction`` (default 0.05) of the recent requests of the same model. Every request span
  with timed steps carries ``generate.step.latencies`` either way. Environment:
  ``OTEL_GENERATE_STEP_SPANS``, ``OTEL_GENERATE_SLOW_TIME_TO_FIRST_TOKEN``,
  ``OTEL_GENERATE_SLOW_TIME_PER_OUTPUT_TOKEN``, ``OTEL_GENERATE_SLOW_FRACTION``.
* ``outlier_factor`` (number >= 1, default 3.0): a decode step slower than this many times the
  request's median decode step is flagged ``generate.step.outlier``. Environment:
  ``OTEL_GENERATE_STEP_OUTLIER_FACTOR``.
* ``background_emission`` (bool, default ``False``): build a finished request's spans and
  metrics on a worker thread; ``generate()`` returns before its step spans exist. The SDK
  providers' ``force_flush()``/``shutdown()`` wait for them. Environment:
  ``OTEL_GENERATE_BACKGROUND_EMISSION``.
* ``measure_memory`` (bool, default ``True``): on CUDA, the peak memory allocated during each
  request (resets ``torch.cuda``'s peak statistic at its start). Environment:
  ``OTEL_GENERATE_MEASURE_MEMORY``.
* ``tensor_parallel_spans`` (``"rank0"`` or ``"all"``; default ``"rank0"``): when the model is
  sharded by tensor parallelism (``tp_plan``), only the group's rank 0 emits a call's request
  (span and metrics); ``"all"``: every rank emits its own request span, tagged with its rank, and
  rank 0 alone records the metrics (see :mod:`otel_generate.ranks`). Environment:
  ``OTEL_GENERATE_TENSOR_PARALLEL_SPANS``.

Keyword arguments win over environment variables; an environment value that cannot be parsed
is reported once with a warning and the default is used (see :mod:`otel_generate.options`). Suppressing instrumentation
(``opentelemetry.instrumentation.utils.suppress_instrumentation``) turns all per-step work off. An
unsampled request span builds no span but still records every metric, with exact latencies (its
steps are timed for them), unless no meter provider collects metrics.
"""

from __future__ import annotations

import logging
from typing import Any, Collection

from opentelemetry.instrumentation.instrumentor import BaseInstrumentor

from otel_generate import _lifecycle, _versions
from otel_generate import content as _content
from otel_generate import options as _options
from otel_generate._patch import Patches
from otel_generate.emit import Telemetry, create_instruments, get_event_logger, get_tracer
from otel_generate.integrations import continuous_batching, generate_loop, overrides, serve, whisper
from otel_generate.options import DEFAULT_MAX_STEP_SPANS, ENV_MAX_STEP_SPANS, ENV_SYNCHRONIZE  # noqa: F401  (public names)
from otel_generate.package import _instruments
from otel_generate.record import GenerationRecord
from otel_generate.version import __version__

__all__ = ["GenerateInstrumentor", "GenerationRecord", "TokenLatencyProfiler", "__version__"]

_LOG = logging.getLogger("otel_generate")


def _content_options(options: _options.Options) -> Any:
    """The :class:`~otel_generate.content.ContentOptions` to capture, or ``None`` when nothing is."""
    mode = options.capture_message_content
    token_ids, logprobs = options.capture_step_token_ids, options.capture_step_logprobs
    if mode is _content.ContentMode.NO_CONTENT and not token_ids and not logprobs:
        return None
    return _content.ContentOptions(
        mode=mode,
        step_token_ids=token_ids or logprobs,
        step_logprobs=logprobs,
        event_logger=get_event_logger(options.logger_provider) if mode.on_event else None,
    )


class GenerateInstrumentor(BaseInstrumentor):
    """An instrumentor for ``transformers.GenerationMixin.generate``.

    See the module docstring for usage and options. ``BaseInstrumentor`` makes it a singleton:
    ``GenerateInstrumentor().instrument()`` a second time only logs a warning.
    """

    def instrumentation_dependencies(self) -> Collection[str]:
        return _instruments

    def _check_dependency_conflicts(self) -> Any:
        # pre-releases of supported versions pass, whatever packaging is installed (_versions)
        return _versions.dependency_conflict(self.instrumentation_dependencies())

    def instrument(self, **kwargs: Any) -> Any:
        """Instrument ``generate()`` (see the module docstring for the keywords).

        If only a :class:`TokenLatencyProfiler` had turned the instrumentation on, this call
        takes it over with these keywords, and leaving the profiler no longer turns it off.
        """
        from otel_generate import profiler

        if self.is_instrumented_by_opentelemetry and profiler.take_over_from_profilers():
            self.uninstrument()
        return super().instrument(**kwargs)

    def _instrument(self, **kwargs: Any) -> None:
        options = _options.resolve(kwargs)
        from transformers.generation.utils import GenerationMixin

        from otel_generate.profiler import active_profilers

        missing = [name for name in generate_loop.REQUIRED if name not in GenerationMixin.__dict__]
        if missing:
            _LOG.warning(
                "otel_generate: this transformers has no GenerationMixin.%s; request spans only, no step spans",
                ", ".join(missing),
            )
        telemetry = Telemetry(
            tracer=get_tracer(options.tracer_provider),
            instruments=create_instruments(options.meter_provider),
            synchronize=options.synchronize,
            max_step_spans=options.max_step_spans,
            skip_candidate_calls=generate_loop.assisted_calls_criteria_on_candidates(GenerationMixin),
            profilers=active_profilers,
            content=_content_options(options),
            options=options,
        )
        # Every patch, in one place: GenerationMixin's loop (generate_loop), every model class's own
        # generate() and custom_generate (overrides), Whisper's windows (whisper), and, only when
        # content capture is on, the pipelines' tokenizer and the step log-probabilities (content).
        patches = Patches()
        for name, factory in generate_loop.HOOKS.items():
            patches.replace(GenerationMixin, name, factory, telemetry)
        overrides.install(patches, telemetry, GenerationMixin)
        whisper.install(patches, telemetry)
        # Serving paths, hooked when their modules are imported: continuous batching (its requests'
        # spans are built on a background emitter, created then) and `transformers serve`.
        continuous_batching.install(patches, telemetry)
        serve.install(patches, telemetry)
        if telemetry.content is not None:
            from otel_generate.integrations import generate_content, pipelines

            if telemetry.content.mode is not _content.ContentMode.NO_CONTENT:
                pipelines.install(patches, telemetry)
            if telemetry.content.step_logprobs:
                generate_content.install(patches, telemetry, GenerationMixin)
        if options.background_emission:
            telemetry.start_emitter(patches)
        self._telemetry, self._patches = telemetry, patches
        # pool workers flush on exit; a forked child drops the parent's aggregations of these instruments
        _lifecycle.enable(options.tracer_provider, options.meter_provider, telemetry.instruments.values())

    def _uninstrument(self, **kwargs: Any) -> None:
        telemetry, patches = getattr(self, "_telemetry", None), getattr(self, "_patches", None)
        if telemetry is not None:
            from otel_generate.integrations import continuous_batching

            continuous_batching.end_in_flight(telemetry)  # requests in flight: ended, marked incomplete
            telemetry.stop_emitter()  # what it still holds is emitted first
            telemetry.active = False  # hooks still reachable (a bound method held somewhere) only call through
            # requests of other threads already started keep their loops' hooks until their set-up is done
            generate_loop.wait_for_setups(telemetry)
        if patches is not None:
            patches.restore_all()
        self._telemetry = self._patches = None
        _lifecycle.disable()  # the fork hook stays registered but does nothing


from otel_generate.profiler import TokenLatencyProfiler  # noqa: E402  (needs GenerateInstrumentor)
