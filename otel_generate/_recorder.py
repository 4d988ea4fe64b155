"""The per-step hot path: a transformers ``StoppingCriteria`` that timestamps each decode step.

transformers calls the stopping criteria once per decoding iteration, right after the new
token(s) were appended (``GenerationMixin._sample``, ``_beam_search``, ``_assisted_decoding``).
That call is the step boundary. The recorder waits for the device (when a synchronize function
is given), reads the monotonic clock, and appends two integers. Spans are built from these
numbers only after ``generate()`` returns, so the loop pays no span cost.

It never stops generation: it returns an all-``False`` tensor of shape ``(batch,)``, cached on
the input's device, which ``StoppingCriteriaList`` ORs with the other criteria.
"""

from __future__ import annotations

from typing import Callable, List, Optional

import torch
from transformers.generation.stopping_criteria import StoppingCriteria


class StepRecorder(StoppingCriteria):
    """Records ``(monotonic_ns, sequence_length)`` at every decode-step boundary.

    Attributes:
        times_ns: monotonic clock (``time.perf_counter_ns``) after each step, in nanoseconds.
        lengths: ``input_ids.shape[-1]`` seen after each step (prompt included).
        fault: the first exception raised inside the recorder, or ``None``. After a fault the
            recorder stops recording (the data it holds stays valid) and generation goes on.
    """

    def __init__(
        self,
        synchronize: Optional[Callable[[], None]],
        clock: Callable[[], int],
        start_ns: int,
        prompt_length: int,
        on_fault: Callable[[str, BaseException], None],
        on_step: Optional[Callable[[int, float], None]] = None,
        skip_candidate_calls: bool = False,
    ) -> None:
        self.times_ns: List[int] = []
        self.lengths: List[int] = []
        self.fault: Optional[BaseException] = None
        self._sync = synchronize
        self._clock = clock
        self._append_time = self.times_ns.append
        self._append_length = self.lengths.append
        self._start_ns = start_ns
        self._prompt_length = prompt_length
        self._on_fault = on_fault
        self._on_step = on_step
        # transformers < 4.47's _assisted_decoding also calls the criteria on the candidate
        # tokens before verifying them; those calls are not step boundaries.
        self._skip_candidate_calls = skip_candidate_calls
        self._next_is_candidate = skip_candidate_calls
        self._false: Optional[torch.Tensor] = None

    def __deepcopy__(self, memo):  # a copied criteria list must still feed this request
        return self

    def __call__(self, input_ids: torch.LongTensor, scores=None, **kwargs) -> torch.BoolTensor:
        if self.fault is None:
            try:
                if self._next_is_candidate:
                    self._next_is_candidate = False
                else:
                    self._next_is_candidate = self._skip_candidate_calls
                    if self._sync is not None:
                        self._sync()
                    self._append_time(self._clock())
                    self._append_length(input_ids.shape[-1])
                    if self._on_step is not None:
                        self._call_on_step()
            except Exception as exc:  # never break generation
                self._fail(exc)
        false = self._false
        if false is None or false.shape[0] != input_ids.shape[0]:
            false = self._false = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        return false

    def _call_on_step(self) -> None:
        times, lengths = self.times_ns, self.lengths
        previous_time = times[-2] if len(times) > 1 else self._start_ns
        previous_length = lengths[-2] if len(lengths) > 1 else self._prompt_length
        try:
            self._on_step(previous_length - self._prompt_length, (times[-1] - previous_time) / 1e9)
        except Exception as exc:  # a user callback: logged once, generation and recording go on
            self._on_fault("per_token_latency_callback", exc)

    def _fail(self, exc: BaseException) -> None:
        # keep times and lengths paired: drop a half-written step
        del self.times_ns[len(self.lengths):]
        del self.lengths[len(self.times_ns):]
        self.fault = exc
        self._on_fault("step hook", exc)
