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
* ``synchronize`` (``True``/``"wait"``, the default; ``"events"``; or ``False``): ``True`` waits for
  the device (``torch.cuda.synchronize``, ``torch.xpu.synchronize``, ``torch.mps.synchronize``)
  before each step's clock read; ``"events"`` (opt-in, one CUDA device) records a CUDA timing event
  per step instead, without waiting, and reads the steps' device times after the request
  (``generate.clock = device``; it falls back to ``True`` elsewhere, saying so once); ``False``
  waits for nothing. On CPU nothing is called either way. Environment:
  ``OTEL_GENERATE_SYNCHRONIZE=true|false|wait|events``.
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
* ``background_emission`` (bool, default ``True``): build a finished request's spans and
  metrics on a worker thread, so that ``generate()`` pays only for recording; it returns before
  its step spans exist. The providers' ``force_flush()``/``shutdown()`` and
  :func:`force_flush` wait for them. ``False`` builds them on the caller's thread before
  ``generate()`` returns. Environment: ``OTEL_GENERATE_BACKGROUND_EMISSION``.
* ``measure_memory`` (bool, default ``True``): on CUDA, the peak memory allocated during each
  request (resets ``torch.cuda``'s peak statistic at its start). Environment:
  ``OTEL_GENERATE_MEASURE_MEMORY``.
* ``measure_energy`` (bool, default ``True``): on CUDA with NVML (``pip install
  'otel-generate[energy]'``), the energy each request used (``generate.energy``, per output token,
  per total token, per step, its prefill and its decode), from the GPU's energy counter; without
  NVML it is off. Environment:
  ``OTEL_GENERATE_MEASURE_ENERGY``.
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

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from otel_generate.version import __version__

if TYPE_CHECKING:  # for type checkers and IDEs; at run time these load on first use (__getattr__)
    from otel_generate._lifecycle import force_flush
    from otel_generate.instrumentor import GenerateInstrumentor
    from otel_generate.options import DEFAULT_MAX_STEP_SPANS, ENV_MAX_STEP_SPANS, ENV_SYNCHRONIZE  # noqa: F401
    from otel_generate.profiler import TokenLatencyProfiler
    from otel_generate.record import GenerationRecord

__all__ = ["GenerateInstrumentor", "GenerationRecord", "TokenLatencyProfiler", "force_flush", "__version__"]

#: public name -> the module that defines it. Re-exports only, loaded when first read, so that
#: ``import otel_generate.request`` (or any core module) loads neither the instrumentor, nor the
#: integrations, nor transformers.
_EXPORTS = {
    "GenerateInstrumentor": "otel_generate.instrumentor",
    "TokenLatencyProfiler": "otel_generate.profiler",
    "GenerationRecord": "otel_generate.record",
    "force_flush": "otel_generate._lifecycle",
    "DEFAULT_MAX_STEP_SPANS": "otel_generate.options",
    "ENV_MAX_STEP_SPANS": "otel_generate.options",
    "ENV_SYNCHRONIZE": "otel_generate.options",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        # a submodule not imported yet (``otel_generate.content`` after a bare ``import otel_generate``)
        if not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
            return importlib.import_module(f"{__name__}.{name}")
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # read once
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(_EXPORTS))
