"""The per-request timing record handed to profilers, callbacks and metrics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional


@dataclass(frozen=True)
class GenerationRecord:
    """What one ``generate()`` call measured. Times are in seconds.

    Attributes:
        model: ``gen_ai.request.model`` of the call.
        strategy: ``generate.strategy`` (``greedy``, ``sample``, ``beam_search``, ``beam_sample``, ``assisted``).
        device: ``generate.device``, e.g. ``"cpu"`` or ``"cuda:0"``.
        synchronized: whether step boundaries waited for the device.
        duration_s: the whole call, seconds.
        step_latencies_s: one latency per decode step, seconds; step 0 is prefill (prompt
            processing plus the first token), so ``step_latencies_s[0]`` is the time to first token.
        step_tokens: tokens each step appended per sequence (1, or more in assisted decoding).
        input_tokens: non-padding prompt tokens of all rows.
        output_tokens: real generated tokens of all returned sequences.
        output_tokens_per_sequence: the same, one count per returned sequence.
        error_type: ``error.type`` when the call raised, else ``None``.
        incomplete: True when a fault inside the instrumentation cut the step data short.
        time_to_first_token_s: from the start of the request to the end of the first step that
            produced a token (for ``generate()``, the prefill step's latency), seconds; ``None``
            when no step completed.
        time_per_output_token_s: time after the first token divided by the tokens produced
            after it per sequence, seconds (the GenAI conventions' ``time_per_output_token``,
            first token excluded; the mean decode-step latency when every step adds one token);
            ``None`` with fewer than two steps.
    """

    model: str
    strategy: Optional[str]
    device: Optional[str]
    synchronized: bool
    duration_s: float
    step_latencies_s: List[float] = field(default_factory=list)
    step_tokens: List[int] = field(default_factory=list)
    input_tokens: Optional[int] = None
    output_tokens: Optional[int] = None
    output_tokens_per_sequence: List[int] = field(default_factory=list)
    error_type: Optional[str] = None
    incomplete: bool = False
    time_to_first_token_s: Optional[float] = None
    time_per_output_token_s: Optional[float] = None
