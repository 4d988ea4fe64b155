"""The step-span policy: which finished requests get step spans.

Steps are recorded for every sampled request anyway and spans are built after the request
ended, so the decision can look at its outcome (``instrument(step_spans=...)``,
``OTEL_GENERATE_STEP_SPANS``):

* ``all`` (the default): every sampled request;
* ``none``: no request (the request span still carries ``generate.step.latencies``);
* ``slow``: a request that failed, whose time to first token or time per output token is
  above its threshold, or that is among the slowest ``fraction`` of the recent requests of the
  same model (:class:`SlowRequests`).

The running distribution is kept per model in bounded memory: the last :data:`WINDOW` values of
time per output token and of time to first token (two sorted windows of at most 512 floats),
for at most :data:`MAX_MODELS` models (the least recently seen is forgotten first). A request
is "among the slowest fraction" when its value is above the ``1 - fraction`` quantile of the
window before it, once the window holds :data:`MIN_SAMPLES` values.
"""

from __future__ import annotations

import bisect
import collections
import threading
from typing import Any, Deque, Dict, List, Optional, Tuple

#: The step-span policies (``instrument(step_spans=...)``, ``OTEL_GENERATE_STEP_SPANS``), also the value of
#: the request span's ``generate.step_spans.policy``: every request's steps become spans, none do, or only
#: a slow request's do (:class:`SlowRequests`).
STEP_SPANS_ALL, STEP_SPANS_NONE, STEP_SPANS_SLOW = "all", "none", "slow"
STEP_SPAN_POLICIES = (STEP_SPANS_ALL, STEP_SPANS_NONE, STEP_SPANS_SLOW)

WINDOW = 512
MAX_MODELS = 64
MIN_SAMPLES = 20

REASON_ERROR = "error"
REASON_TIME_TO_FIRST_TOKEN = "time_to_first_token"
REASON_TIME_PER_OUTPUT_TOKEN = "time_per_output_token"
REASON_SLOWEST_FRACTION = "slowest_fraction"


class _Window:
    """The last ``size`` values, also kept sorted (insertion and eviction by bisection)."""

    def __init__(self, size: int) -> None:
        self.order: Deque[float] = collections.deque()
        self.sorted: List[float] = []
        self.size = size

    def above_quantile(self, value: float, fraction: float) -> bool:
        """Whether ``value`` is above the ``1 - fraction`` quantile of the window (before adding it)."""
        values = self.sorted
        if len(values) < MIN_SAMPLES or fraction <= 0:
            return False
        if fraction >= 1:
            return True
        rank = min(len(values) - 1, int((1 - fraction) * len(values)))
        return value > values[rank]

    def add(self, value: float) -> None:
        if len(self.order) >= self.size:
            oldest = self.order.popleft()
            del self.sorted[bisect.bisect_left(self.sorted, oldest)]
        self.order.append(value)
        bisect.insort(self.sorted, value)


class SlowRequests:
    """Decides, per finished request, whether it is slow enough for step spans (policy ``slow``).

    Args:
        time_to_first_token_s: a request whose time to first token exceeds this is slow (seconds).
        time_per_output_token_s: a request whose time per output token exceeds this is slow (seconds).
        fraction: the slowest fraction (0..1) of the recent requests of the same model is slow.
    """

    def __init__(self, time_to_first_token_s: float, time_per_output_token_s: float, fraction: float) -> None:
        self.time_to_first_token_s = time_to_first_token_s
        self.time_per_output_token_s = time_per_output_token_s
        self.fraction = fraction
        self._models: "collections.OrderedDict[str, Tuple[_Window, _Window]]" = collections.OrderedDict()
        self._lock = threading.Lock()

    def _windows(self, model: str) -> Tuple[_Window, _Window]:
        windows = self._models.get(model)
        if windows is None:
            windows = self._models[model] = (_Window(WINDOW), _Window(WINDOW))
            while len(self._models) > MAX_MODELS:
                self._models.popitem(last=False)
        else:
            self._models.move_to_end(model)
        return windows

    def reason(self, model: str, failed: bool, ttft_s: Optional[float], tpot_s: Optional[float]) -> Optional[str]:
        """Why this request's steps are emitted, or ``None`` when they are not; adds the request
        to its model's running distribution."""
        found = None
        if failed:
            found = REASON_ERROR
        elif ttft_s is not None and ttft_s > self.time_to_first_token_s:
            found = REASON_TIME_TO_FIRST_TOKEN
        elif tpot_s is not None and tpot_s > self.time_per_output_token_s:
            found = REASON_TIME_PER_OUTPUT_TOKEN
        with self._lock:
            ttft_window, tpot_window = self._windows(model)
            if found is None:
                if tpot_s is not None and tpot_window.above_quantile(tpot_s, self.fraction):
                    found = REASON_SLOWEST_FRACTION
                elif tpot_s is None and ttft_s is not None and ttft_window.above_quantile(ttft_s, self.fraction):
                    found = REASON_SLOWEST_FRACTION
            if not failed:  # the distribution of successful requests
                if ttft_s is not None:
                    ttft_window.add(ttft_s)
                if tpot_s is not None:
                    tpot_window.add(tpot_s)
        return found

    def models(self) -> Dict[str, int]:
        """Model -> values held (for tests and debugging)."""
        with self._lock:
            return {model: len(windows[0].order) + len(windows[1].order) for model, windows in self._models.items()}


class StepSpanPolicy:
    """Everything that decides a finished request's step spans, set once per ``instrument()``.

    The defaults are :mod:`otel_generate.options`' (this module sits below it and does not import it).

    Args:
        name: the policy, ``all``, ``none`` or ``slow`` (``instrument(step_spans=...)``).
        max_step_spans: at most this many step spans per request (``max_step_spans``).
        outlier_factor: a decode step slower than this many times the request's median decode
            step is flagged ``generate.step.outlier`` (``outlier_factor``).
        slow: the running distributions of the ``slow`` policy (required with it), else ignored.

    Raises:
        ValueError: policy ``slow`` without ``slow``.
    """

    __slots__ = ("name", "max_step_spans", "outlier_factor", "slow")

    def __init__(
        self,
        name: str = STEP_SPANS_ALL,
        max_step_spans: int = 1024,
        outlier_factor: float = 3.0,
        slow: Optional[SlowRequests] = None,
    ) -> None:
        self.name = name
        self.max_step_spans = max_step_spans
        self.outlier_factor = outlier_factor
        if name == STEP_SPANS_SLOW and slow is None:
            raise ValueError("the 'slow' step-span policy needs its SlowRequests")
        self.slow = slow if name == STEP_SPANS_SLOW else None

    @classmethod
    def from_options(cls, options: Any) -> "StepSpanPolicy":
        """The policy of a resolved :class:`~otel_generate.options.Options`."""
        slow = None
        if options.step_spans == STEP_SPANS_SLOW:
            slow = SlowRequests(
                options.slow_time_to_first_token, options.slow_time_per_output_token, options.slow_fraction
            )
        return cls(options.step_spans, options.max_step_spans, options.outlier_factor, slow)

    def decide(
        self, model: str, failed: bool, ttft_s: Optional[float], tpot_s: Optional[float]
    ) -> Tuple[bool, Optional[str]]:
        """``(emit, reason)``: whether this request's steps become spans, and why (policy ``slow``
        only, else ``None``). Under ``slow``, adds the request to its model's running distribution."""
        if self.name == STEP_SPANS_ALL:
            return True, None
        if self.name == STEP_SPANS_NONE or self.slow is None:
            return False, None
        reason = self.slow.reason(model, failed, ttft_s, tpot_s)
        return reason is not None, reason
