"""Derive once, then emit: the figures of one finished request, computed in one place.

:func:`derive` turns a finished :class:`~otel_generate.request.Request` (monotonic timestamps
and token counts) into a :class:`Summary`: the figures, in seconds, that the request span, the
step spans, the metrics and the :class:`~otel_generate.record.GenerationRecord` read. The
emitter (:mod:`otel_generate.emit`) reads only the summary. Nothing here touches OpenTelemetry,
a model or ``transformers``; vLLM's ``do_tracing`` has the same shape (timestamps in, one pass out).

It derives only what its caller will read (an unsampled request builds no list it does not need):

* always: the duration, ``error.type``, the time to first token and the time per output token;
* ``inter_token``: the inter-token latencies (for their histogram; a successful request only);
* ``steps``: every step's latency (nanoseconds and seconds), the steps' start times and the
  prefill steps;
* ``spans`` (implies ``steps``): the step-span decision of the
  :class:`~otel_generate.policy.StepSpanPolicy` and the outlier steps.

Definitions, for steps of ``step_tokens[i]`` tokens per sequence ending at ``step_ends_ns[i]``:

* a step starts at ``step_starts_ns[i]`` when the producer gave starts (continuous batching),
  else where the previous step ended (``start_ns`` for step 0);
* time to first token: from ``start_ns`` to the end of the first step that produced a token;
* time per output token: the time after that step divided by the tokens produced after it (the
  GenAI conventions' definition, first token excluded); ``None`` when no token followed;
* inter-token latencies: for every decode step after the first token's step, its latency divided
  by its tokens; a step with no token and a prefill step (the first step of a later inner call,
  such as Whisper's next window) give none;
* prefill steps: the first ``prefill_steps`` steps and the first step of every inner call;
* outliers: decode steps slower than ``outlier_factor`` times the request's median decode step
  (none with fewer than 3 decode steps).
* energy: the request's millijoules in joules, divided by its output tokens for the energy per
  output token and by all its tokens (input and output) for the energy per total token; each
  step's, when the producer could attribute one to every step, and then the prefill steps' and
  the decode steps' sums.

:func:`derive` is pure except for the ``slow`` policy, whose decision adds the request to its
model's running distribution (:class:`~otel_generate.policy.SlowRequests`).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from itertools import repeat
from typing import AbstractSet, Iterator, List, Optional, Sequence

from otel_generate import clock
from otel_generate._faults import error_type
from otel_generate.policy import StepSpanPolicy
from otel_generate.request import Request

_NO_STEPS: tuple = ()
MJ_PER_J = 1000
_DEFAULT_POLICY = StepSpanPolicy()


@dataclass(slots=True)
class Summary:
    """The derived figures of one finished request (:func:`derive`). Seconds unless ``_ns``.

    Attributes:
        duration_s: the whole request (0.0 when it has no end).
        error_type: ``error.type`` when the request raised, else ``None``.
        time_to_first_token_s, time_per_output_token_s: see the module docstring; ``None`` when
            undefined.
        inter_token_latencies_s: one value per decode step (``inter_token``, successful requests
            with a time per output token), else empty.
        step_latencies_ns, step_latencies_s: every step's latency (``steps``), else empty.
        step_starts_ns, step_ends_ns: every step's bounds, monotonic nanoseconds (``steps``;
            the ends are always the request's).
        prefill: indices of the steps that processed a prompt (``steps`` or ``inter_token``).
        steps_unseen: no step count at all: none could be seen (``unobserved``), or
            ``uninstrument()`` ran before any step was timed.
        decided: the step-span policy was asked (``spans``, a timed request whose steps were seen).
        emit_steps: the policy's answer: its steps become spans.
        reason: why (policy ``slow`` only), else ``None``.
        steps_emitted: ``generate.step_spans.emitted``: spans will be built for at least one step.
        step_spans: how many step spans to build (the first ones, at most ``max_step_spans``).
        outliers: indices of the outlier decode steps (``spans``).
        time_to_first_chunk_s: from the start to the first chunk a streaming client was sent
            (``gen_ai.response.time_to_first_chunk``), when known.
        streamer_s, time_in_queue_s: the user streamer's own time and the time queued before the
            first step (``steps``), when known.
        acceptance_rate: assisted decoding's accepted ÷ proposed candidate tokens (``steps``),
            when any was proposed.
        energy_j: joules the request used (``Request.energy_mj``), else ``None``.
        energy_per_output_token_j: ``energy_j`` divided by the output tokens, when both are known
            and there is at least one token, else ``None``.
        energy_per_total_token_j: ``energy_j`` divided by the input and output tokens together, when
            all are known and there is at least one token, else ``None``.
        step_energies_j: joules per step (``steps``), when every step's energy is known, else ``None``.
        energy_prefill_j, energy_decode_j: the sums of ``step_energies_j`` over the prefill steps and
            over the decode steps (``steps``), when every step's energy is known and there is such a
            step, else ``None``.
    """

    duration_s: float
    error_type: Optional[str]
    time_to_first_token_s: Optional[float]
    time_per_output_token_s: Optional[float]
    inter_token_latencies_s: Sequence[float] = _NO_STEPS
    step_latencies_ns: Sequence[int] = _NO_STEPS
    step_latencies_s: Sequence[float] = _NO_STEPS
    step_starts_ns: Sequence[int] = _NO_STEPS
    step_ends_ns: Sequence[int] = _NO_STEPS
    prefill: AbstractSet[int] = frozenset()
    steps_unseen: bool = False
    decided: bool = False
    emit_steps: bool = False
    reason: Optional[str] = None
    steps_emitted: bool = False
    step_spans: int = 0
    outliers: AbstractSet[int] = frozenset()
    time_to_first_chunk_s: Optional[float] = None
    streamer_s: Optional[float] = None
    time_in_queue_s: Optional[float] = None
    acceptance_rate: Optional[float] = None
    energy_j: Optional[float] = None
    energy_per_output_token_j: Optional[float] = None
    energy_per_total_token_j: Optional[float] = None
    step_energies_j: Optional[List[float]] = None
    energy_prefill_j: Optional[float] = None
    energy_decode_j: Optional[float] = None


def derive(
    request: Request,
    policy: Optional[StepSpanPolicy] = None,
    *,
    steps: bool = False,
    spans: bool = False,
    inter_token: bool = False,
) -> Summary:
    """The figures of a finished ``request`` (``end_ns`` set), those asked for (module docstring).

    Args:
        request: the finished record.
        policy: decides the step spans (``spans``); default: every request's steps, at most
            :data:`~otel_generate.options.DEFAULT_MAX_STEP_SPANS`.
        steps: derive the per-step figures (a sampled request, a profiler, a record asked for).
        spans: also decide the step spans and find the outliers (a recording request span).
        inter_token: derive the inter-token latencies (the histogram exists).

    Raises:
        Nothing for a well-formed request; a malformed one (a step list of the wrong type) raises
        what the arithmetic raises.
    """
    per_second = clock.NS_PER_S
    start, ends, tokens = request.start_ns, request.step_ends_ns, request.step_tokens
    end = request.end_ns
    error = request.error
    ttft_s = tpot_s = None
    first = first_token_step(tokens)
    if first is not None and first < len(ends):
        ttft_s = (ends[first] - start) / per_second
        later = sum(tokens) - sum(tokens[: first + 1])  # (the tokens after the first step: no copy of them)
        if later > 0:
            tpot_s = ((ends[-1] - ends[first]) / later) / per_second
    summary = Summary(
        (end - start) / per_second if end is not None else 0.0,
        error_type(error) if error is not None else None,
        ttft_s,
        tpot_s,
    )
    if request.first_chunk_ns is not None:
        summary.time_to_first_chunk_s = (request.first_chunk_ns - start) / per_second
    if request.energy_mj is not None:
        energy_j = summary.energy_j = request.energy_mj / MJ_PER_J
        if request.output_tokens:
            summary.energy_per_output_token_j = energy_j / request.output_tokens
        if request.output_tokens is not None and request.input_tokens is not None:
            total_tokens = request.input_tokens + request.output_tokens
            if total_tokens > 0:
                summary.energy_per_total_token_j = energy_j / total_tokens
    if not (steps or spans or inter_token):
        return summary
    prefill = summary.prefill = prefill_indices(request)
    if steps or spans:
        starts = summary.step_starts_ns = step_starts_ns(request)
        latencies_ns = summary.step_latencies_ns = list(map(operator.sub, ends, starts))
        summary.step_latencies_s = list(map(operator.truediv, latencies_ns, repeat(per_second)))
        summary.step_ends_ns = ends
        summary.steps_unseen = request.unobserved is not None or (request.uninstrumented and not latencies_ns)
        if request.streamer_ns is not None:
            summary.streamer_s = request.streamer_ns / per_second
        if request.queue_ns is not None:
            summary.time_in_queue_s = request.queue_ns / per_second
        if request.candidates_proposed and request.candidates_accepted is not None:
            summary.acceptance_rate = request.candidates_accepted / request.candidates_proposed
        step_energy = request.step_energy_mj
        if step_energy is not None and len(step_energy) == len(latencies_ns):
            step_energies = summary.step_energies_j = [used / MJ_PER_J for used in step_energy]
            in_prefill = [used for index, used in enumerate(step_energies) if index in prefill]
            in_decode = [used for index, used in enumerate(step_energies) if index not in prefill]
            summary.energy_prefill_j = sum(in_prefill) if in_prefill else None
            summary.energy_decode_j = sum(in_decode) if in_decode else None
    plain = False  # the inter-token latencies are every step's latency after the first
    if inter_token and error is None and tpot_s is not None:
        if (steps or spans) and len(tokens) == len(ends) and _plain_steps(request, prefill):
            summary.inter_token_latencies_s = summary.step_latencies_s[1:]
            plain = True
        else:
            summary.inter_token_latencies_s = inter_token_latencies_s(
                request, prefill, summary.step_latencies_s if (steps or spans) else None
            )
    if spans and request.timed and not summary.steps_unseen:
        policy = policy if policy is not None else _DEFAULT_POLICY
        emit, summary.reason = policy.decide(request.model, error is not None, ttft_s, tpot_s)
        summary.decided, summary.emit_steps = True, emit
        summary.steps_emitted = emit and policy.max_step_spans > 0 and bool(ends)
        summary.step_spans = min(len(latencies_ns), policy.max_step_spans) if emit else 0
        factor = policy.outlier_factor
        # the common case: the decode steps are all but the first (and a float factor, as Options makes it)
        if prefill == {0} and len(latencies_ns) > 3 and type(factor) is float:
            # sorted once, in seconds (floats compare in fewer instructions than ints), for the scan
            ordered_s = sorted(summary.inter_token_latencies_s if plain else summary.step_latencies_s[1:])
            if _none_above(ordered_s, factor):
                summary.outliers = frozenset()
            else:  # (a step near or above the limit: the exact scan, in nanoseconds)
                summary.outliers = outliers(latencies_ns, prefill, factor)
        else:
            summary.outliers = outliers(latencies_ns, prefill, factor)
    return summary


#: how far below the outlier limit, relatively, the slowest decode step must be in seconds for
#: :func:`_none_above` to answer without the nanoseconds: far above the rounding of the division
#: by 10**9, of the median and of its product with the factor (a few units of 2**-53 each)
_MARGIN = 1e-9


def _none_above(ordered_s: Sequence[float], factor: float) -> bool:
    """Whether no decode step is an outlier (:func:`outliers`), told from the decode steps'
    latencies in seconds, sorted (at least 3), all positive, ``factor`` a float: true only where
    the slowest is below ``factor`` times the median by more than :data:`_MARGIN` relatively, so
    that the nanoseconds would say so too; false means "ask :func:`outliers`", not "there is one"."""
    median = _median_of_sorted(ordered_s)
    # (a latency of 0 or below, from a malformed record, leaves it to the scan: the margin is
    # relative, and a median of a negative and a positive latency cancels)
    return ordered_s[0] > 0 and ordered_s[-1] < factor * median * (1 - _MARGIN)


def _median_of_sorted(ordered: Sequence[float]) -> float:
    """The median of ``ordered`` (sorted, not empty): its middle value, or the mean of its two
    middle values."""
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def first_token_step(tokens: Sequence[int]) -> Optional[int]:
    """The index of the first step that produced a token, or ``None``."""
    for index, produced in enumerate(tokens):
        if produced > 0:
            return index
    return None


def prefill_indices(request: Request) -> set:
    """Indices of the steps that processed a prompt (named ``prefill``)."""
    first = set(range(request.prefill_steps))
    if request.calls:
        first.update(call.first_step for call in request.calls if call.steps)
    return first


def step_starts_ns(request: Request) -> List[int]:
    """Where every step started, monotonic nanoseconds (the producer's starts when it gave them)."""
    starts = request.step_starts_ns
    if starts is not None:
        return starts
    return [request.start_ns] + request.step_ends_ns[:-1]


def inter_token_latencies_ns(request: Request, prefill: Optional[AbstractSet[int]] = None) -> Iterator[float]:
    """The gaps between output tokens, nanoseconds (module docstring). A request of ``n`` steps of
    one token each gives ``n - 1`` gaps. Yields, builds no list."""
    ends, tokens = request.step_ends_ns, request.step_tokens
    starts = request.step_starts_ns
    if prefill is None:
        prefill = prefill_indices(request)
    first = None
    for index, produced in enumerate(tokens):
        if first is None:
            if produced > 0:
                first = index
            continue
        if produced <= 0 or index in prefill or index >= len(ends):
            continue
        start = starts[index] if starts is not None else ends[index - 1]
        yield (ends[index] - start) / produced


def inter_token_latencies_s(
    request: Request,
    prefill: Optional[AbstractSet[int]] = None,
    step_latencies_s: Optional[Sequence[float]] = None,
) -> List[float]:
    """:func:`inter_token_latencies_ns` in seconds, as a list. The common case (one token per step,
    only the first step a prefill, steps back to back) is every step's latency after the first:
    taken from ``step_latencies_s`` when given, else computed at once, to the same values (the
    producer's explicit starts, when it gave them, must then be the previous steps' ends)."""
    ends, tokens = request.step_ends_ns, request.step_tokens
    if prefill is None:
        prefill = prefill_indices(request)
    count = len(tokens)
    if _plain_steps(request, prefill):
        if step_latencies_s is not None:
            return step_latencies_s[1:count]  # type: ignore[return-value]  (a list's slice)
        per_second = clock.NS_PER_S
        # (C-level iteration: the same int / float division, exactly, for every gap)
        return list(map(operator.truediv, map(operator.sub, ends[1:count], ends[: count - 1]), repeat(per_second)))
    return [gap / clock.NS_PER_S for gap in inter_token_latencies_ns(request, prefill)]


def _plain_steps(request: Request, prefill: AbstractSet[int]) -> bool:
    """Whether the request's inter-token latencies are its steps' latencies after the first (up to
    its count of steps with tokens): more than one step, a step end for each, one token each, only
    the first a prefill (if any), and the steps back to back (no explicit starts, or each the
    previous step's end)."""
    ends, tokens, starts = request.step_ends_ns, request.step_tokens, request.step_starts_ns
    count = len(tokens)
    return (
        1 < count <= len(ends)
        and tokens.count(1) == count  # (every step one token; count() compares in C, identity first)
        and prefill <= {0}
        and (starts is None or starts[1:count] == ends[: count - 1])  # steps back to back
    )


def outliers(latencies_ns: Sequence[int], prefill: AbstractSet[int], factor: float) -> frozenset:
    """Indices of the decode steps slower than ``factor`` times the median decode step."""
    if prefill <= {0}:  # the common case: only the first step is a prefill
        ordered = list(latencies_ns[1:] if 0 in prefill else latencies_ns)
    else:
        ordered = [latency for index, latency in enumerate(latencies_ns) if index not in prefill]
    if len(ordered) < 3:
        return frozenset()
    # (sorted in place, once: a sort of ints compares in C, without the rich comparison that max()
    # and min() make per value, so it costs less than the two of them)
    ordered.sort()
    if ordered[-1] <= factor * ordered[0]:  # the median is at least the fastest step: no outlier
        return frozenset()
    median = _median_of_sorted(ordered)
    limit = factor * median
    if ordered[-1] <= limit:  # the common case: no outlier
        return frozenset()
    return frozenset(index for index, latency in enumerate(latencies_ns) if index not in prefill and latency > limit)


def seconds(nanoseconds: Optional[float]) -> Optional[float]:
    """Nanoseconds to seconds (``None`` stays ``None``)."""
    return None if nanoseconds is None else nanoseconds / clock.NS_PER_S
