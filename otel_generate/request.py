"""The plain per-request record: what one request measured, whatever produced it.

A producer (the ``generate()`` loop wrappers, the continuous-batching hooks) fills a
:class:`Request` with numbers: monotonic timestamps, token counts, the request's parameters,
its outcome. It holds no OpenTelemetry object and no tensor, so it can be built and checked
without an SDK and handed to another thread. :mod:`otel_generate.emit` turns a finished record
into spans, metrics and the records of the Python APIs.

Units: every ``*_ns`` field is an integer number of nanoseconds of the monotonic clock
:data:`otel_generate.clock.monotonic_ns`, except ``start_wall_ns`` (nanoseconds since the epoch,
read at ``start_ns``), which places the monotonic times on the wall-clock time line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from otel_generate import clock


@dataclass(eq=False)
class InnerCall:
    """One inner ``generate()`` call of a request (a Whisper window or fallback attempt, the
    ``generate()`` an overriding model or a ``custom_generate`` function calls).

    Attributes:
        start_ns, end_ns: monotonic bounds of the call, nanoseconds.
        first_step: index in :attr:`Request.step_ends_ns` of the call's first step.
        steps: number of steps the call recorded.
        output_tokens: tokens the call generated (all its returned sequences), or ``None``.
        attributes: what identifies the call on its grouping span (window, attempt, temperature, kept).
    """

    start_ns: int
    end_ns: Optional[int] = None
    first_step: int = 0
    steps: int = 0
    output_tokens: Optional[int] = None
    attributes: Dict[str, Any] = field(default_factory=dict)


@dataclass(eq=False)
class Request:
    """One request, as numbers.

    Steps: step ``i`` ends at ``step_ends_ns[i]`` and appended ``step_tokens[i]`` tokens per
    sequence (1, or more in assisted decoding; 0 for a prefill chunk that produced no token). It
    starts at ``step_starts_ns[i]`` when the producer gives explicit starts (continuous batching:
    the start of the batch step), else where the previous step ended (``start_ns`` for step 0).

    Attributes:
        model: ``gen_ai.request.model``.
        start_ns: when the request started (``generate()`` entered, or the request was submitted).
        start_wall_ns: the wall clock at ``start_ns`` (nanoseconds since the epoch).
        timed: whether steps were recorded for this request (sampled, or a profiler asked).
        synchronized: whether each clock read waited for the device.
        device: ``generate.device``.
        parameters: request attributes known before generation (``gen_ai.request.*``,
            ``generate.strategy``, ``generate.batch_size``, ...), by attribute name.
        end_ns: when the request ended.
        input_tokens, output_tokens: totals over all rows (``None``: unknown).
        output_tokens_per_sequence: one count per returned sequence.
        finish_reasons: one ``stop``/``length`` per returned sequence, or ``None``.
        error: the exception that ended the request, or ``None``.
        incomplete: a fault inside the instrumentation cut the step data short.
        calls: the inner ``generate()`` calls, when the request has any.
        first_chunk_ns: when a streamer was first handed generated tokens (streaming requests).
        streamer_ns: nanoseconds spent inside the streamer's calls (streaming requests).
        input_messages, output_messages: opt-in content (:mod:`otel_generate.content`): the
            conventions' message structures as plain lists of dicts, or ``None`` when not captured.
        step_token_ids: opt-in, one list of token ids per step that gets a span (row-major
            over the returned sequences), or ``None``.
        step_logprobs: opt-in, the natural-log probability of each of those ids, same layout, or
            ``None`` (also when the strategy gives none: beam search, assisted decoding).
    """

    model: str
    start_ns: int
    start_wall_ns: int
    timed: bool = True
    synchronized: bool = True
    device: Optional[str] = None
    parameters: Dict[str, Any] = field(default_factory=dict)
    step_ends_ns: List[int] = field(default_factory=list)
    step_tokens: List[int] = field(default_factory=list)
    step_starts_ns: Optional[List[int]] = None
    end_ns: Optional[int] = None
    input_tokens: Optional[int] = None
    output_tokens: Optional[int] = None
    output_tokens_per_sequence: List[int] = field(default_factory=list)
    finish_reasons: Optional[List[str]] = None
    error: Optional[BaseException] = None
    incomplete: bool = False
    calls: List[InnerCall] = field(default_factory=list)
    first_chunk_ns: Optional[int] = None
    streamer_ns: Optional[int] = None
    input_messages: Optional[List[Dict[str, Any]]] = None
    output_messages: Optional[List[Dict[str, Any]]] = None
    step_token_ids: Optional[List[List[int]]] = None
    step_logprobs: Optional[List[List[float]]] = None

    # --- derived figures (nanoseconds) ---------------------------------------------------------
    def wall_ns(self, monotonic_ns: int) -> int:
        """A monotonic timestamp of this request on the wall-clock time line (ns since the epoch)."""
        return self.start_wall_ns + (monotonic_ns - self.start_ns)

    def step_bounds_ns(self) -> List[tuple]:
        """``(start_ns, end_ns)`` of every step, monotonic nanoseconds."""
        ends = self.step_ends_ns
        if self.step_starts_ns is not None:
            return list(zip(self.step_starts_ns, ends))
        return list(zip([self.start_ns] + ends[:-1], ends))

    def step_latencies_ns(self) -> List[int]:
        """The duration of every step, nanoseconds."""
        ends = self.step_ends_ns
        starts = self.step_starts_ns if self.step_starts_ns is not None else [self.start_ns] + ends[:-1]
        return [end - start for start, end in zip(starts, ends)]

    def time_to_first_token_ns(self) -> Optional[int]:
        """From the start of the request to the end of the first step that produced a token."""
        for end, tokens in zip(self.step_ends_ns, self.step_tokens):
            if tokens > 0:
                return end - self.start_ns
        return None

    def time_per_output_token_ns(self) -> Optional[float]:
        """Time after the first token divided by the tokens produced after it (per sequence).

        The GenAI conventions' time per output token: the first token excluded. ``None`` when no
        token followed the first one.
        """
        first = None
        later_tokens = 0
        for index, tokens in enumerate(self.step_tokens):
            if first is None:
                if tokens > 0:
                    first = index
            else:
                later_tokens += tokens
        if first is None or later_tokens <= 0:
            return None
        return (self.step_ends_ns[-1] - self.step_ends_ns[first]) / later_tokens

    def duration_ns(self) -> Optional[int]:
        return None if self.end_ns is None else self.end_ns - self.start_ns


def seconds(nanoseconds: Optional[float]) -> Optional[float]:
    """Nanoseconds to seconds (``None`` stays ``None``)."""
    return None if nanoseconds is None else nanoseconds / clock.NS_PER_S
