"""The per-step hot path of the ``generate()`` loop: the stopping-criteria call that ends each
decode step is timestamped.

transformers calls its ``StoppingCriteriaList`` once per decoding iteration, right after the
new token(s) were appended (``GenerationMixin._sample``, ``_beam_search``,
``_assisted_decoding``). That call is the step boundary. ``_get_stopping_criteria``'s list is
replaced by a :class:`RecordingCriteriaList` (same criteria, same result) whose call, after the
criteria ran, hands ``input_ids`` and the per-row ``is_done`` tensor to a :class:`StepRecorder`:
it waits for the device (when a synchronize function is given), reads the monotonic clock and
appends (the ``is_done`` tensor too where a row may stop before the others). With
``synchronize="events"`` nothing waits: the clock it is given records a CUDA timing event on the
device's stream and appends it before reading the host clock (an event record and a list append;
:meth:`otel_generate.clock.DeviceEvents.step_clock`), and the events become device times after
the request. Where a step is
nothing but the clock read and the appends (no device to wait for, no callback), the list
appends them itself; where, in
addition, the loop is transformers' own greedy or sampling loop (``one_token_steps``: it appends
exactly one token per row before each call), the length is not read at all: after step ``i`` it
is the prompt width plus ``i + 1`` (:meth:`StepRecorder.step_lengths`; the accounting checks it
against the returned sequences). ``StoppingCriteriaList.__call__`` itself is always called, as
transformers calls it: a patch of it is followed from the next step. Spans are
built from these numbers only after ``generate()`` returns, so the loop pays no span cost, and
the criteria's result is never touched.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, List, Optional

from transformers.generation.stopping_criteria import MaxLengthCriteria, MaxTimeCriteria, StoppingCriteriaList

from otel_generate._faults import Fault

#: Stopping criteria that end every row at the same step (the length budget, ``max_time``).
_ALL_ROWS_AT_ONCE = (MaxLengthCriteria, MaxTimeCriteria)


def rows_may_end_apart(criteria) -> bool:
    """Whether a row of the batch may be stopped before the others: some criterion in ``criteria``
    is not one that ends every row at once (an EOS, a stop string, a user's criterion; a
    subclass of a budget criterion counts too, its call may differ). Only then does a row's
    stopping step need recording (:class:`StepRecorder` ``keep_done``); otherwise every row runs
    to the last step."""
    for criterion in criteria:  # (a loop, not any() of a generator: one to three criteria)
        if type(criterion) not in _ALL_ROWS_AT_ONCE:
            return True
    return False


#: :meth:`StepRecorder.plain_step`: ``[append time, clock, append length or None, append is_done
#: or None]``, a list (read by one unpacking a step; emptied of effect by :func:`stop_plain_step`)
PlainStep = List[Any]


def stop_plain_step(step: PlainStep) -> None:
    """Make every later step that reads ``step`` record nothing: ``append_time(clock())`` becomes
    ``bool(int())``, two builtins that do nothing, and no length or ``is_done`` is appended."""
    step[:] = [bool, int, None, None]


class StepRecorder:
    """Records ``(monotonic_ns, sequence_length[, is_done])`` at every decode-step boundary.

    Attributes:
        times_ns: monotonic clock (``time.perf_counter_ns``) after each step, in nanoseconds.
        lengths: ``input_ids.shape[-1]`` seen after each step (prompt included); empty while the
            lengths are implied (``implied_lengths``): read them with :meth:`step_lengths`.
        done: when ``keep_done``, each step's ``is_done`` BoolTensor of shape ``(rows,)``: a row's
            first ``True`` is the step that ended it (EOS, a stop string, a user criterion).
        fault: the first exception raised inside the recorder, or ``None``. After a fault the
            recorder stops recording (what it holds stays valid) and generation goes on.
        implied_lengths: the lengths are not read but implied (``one_token_steps`` and the plain
            path taken: :meth:`plain_appends`).
        events: ``synchronize="events"``: the CUDA timing event each step's clock read recorded
            (the ``clock`` appends them: :meth:`otel_generate.clock.DeviceEvents.step_clock`), else
            ``None``. Resolved into device times after the request, never read per step.
        energies: the energy counter read after each step's clock read (the ``clock`` appends it),
            else ``None``.
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
        keep_done: bool = False,
        token_offset: int = 0,
        one_token_steps: bool = False,
        events: Optional[List[Any]] = None,
        energies: Optional[List[Any]] = None,
    ) -> None:
        self.times_ns: List[int] = []
        self.events = events
        self.energies = energies
        self.lengths: List[int] = []
        self.done: List = []
        self.fault: Optional[BaseException] = None
        self._sync = synchronize
        self._clock = clock
        self._append_time = self.times_ns.append
        self._append_length = self.lengths.append
        self._append_done = self.done.append if keep_done else None
        self._start_ns = start_ns
        self._prompt_length = prompt_length
        self._on_fault = on_fault
        self._on_step = on_step
        self._token_offset = token_offset  # tokens of the request's earlier inner calls
        # transformers < 4.47's _assisted_decoding also calls the criteria on the candidate
        # tokens before verifying them; those calls are not step boundaries.
        self._skip_candidate_calls = skip_candidate_calls
        self._next_is_candidate = skip_candidate_calls
        #: the loop appends exactly one token per row before each criteria call (transformers' own
        #: greedy and sampling loops): the length after step i is the prompt width plus i + 1
        self._one_token_steps = one_token_steps
        self.implied_lengths = False
        self._plain_step: Optional[PlainStep] = None

    def plain_step(self) -> Optional[PlainStep]:
        """This recorder's :data:`PlainStep` (one list, made at the first call, shared by every
        list the recorder feeds) when a step is nothing but those appends (no synchronize, no
        callback, no candidate calls to skip), else ``None``. Its length append is ``None`` when
        the lengths are implied instead (``one_token_steps``; from then on :attr:`implied_lengths`);
        its ``is_done`` append is ``None`` unless ``keep_done``. After a fault
        (:func:`stop_plain_step`) it records nothing."""
        if self._plain_step is not None:
            return self._plain_step
        if self._sync is not None or self._on_step is not None:
            return None
        if self._skip_candidate_calls or self.fault is not None:
            return None
        if self._one_token_steps and not self.lengths:
            self.implied_lengths = True
            length = None
        else:
            length = self._append_length
        self._plain_step = [self._append_time, self._clock, length, self._append_done]
        return self._plain_step

    def step_lengths(self) -> List[int]:
        """The sequence length after each recorded step (prompt included), one per time in
        :attr:`times_ns`: read (:attr:`lengths`) or, when :attr:`implied_lengths`, the prompt
        width plus 1, 2, ... (a new list either way)."""
        if self.implied_lengths:
            first = self._prompt_length + 1
            return list(range(first, first + len(self.times_ns)))
        return list(self.lengths)

    def __deepcopy__(self, memo):  # a copied criteria list must still feed this request
        return self

    def __call__(self, input_ids, is_done) -> None:
        if self.fault is not None:
            return
        try:
            if self._next_is_candidate:
                self._next_is_candidate = False
                return
            self._next_is_candidate = self._skip_candidate_calls
            if self._sync is not None:
                self._sync()
            self._append_time(self._clock())
            self._append_length(input_ids.shape[-1])
            if self._append_done is not None:
                self._append_done(is_done)
            if self._on_step is not None:
                self._call_on_step()
        except Exception as exc:  # never break generation
            self._fail(exc)

    def _call_on_step(self) -> None:
        times, lengths = self.times_ns, self.lengths
        previous_time = times[-2] if len(times) > 1 else self._start_ns
        previous_length = lengths[-2] if len(lengths) > 1 else self._prompt_length
        try:
            self._on_step(previous_length - self._prompt_length + self._token_offset, (times[-1] - previous_time) / 1e9)
        except Exception as exc:  # a user callback: logged once, generation and recording go on
            self._on_fault(Fault.PER_TOKEN_LATENCY_CALLBACK, exc)

    def _fail(self, exc: BaseException) -> None:
        # keep the lists paired: drop a half-written step (implied lengths are paired by construction)
        steps = len(self.times_ns) if self.implied_lengths else min(len(self.times_ns), len(self.lengths))
        del self.times_ns[steps:], self.lengths[steps:], self.done[steps:]
        self.fault = exc
        if self._plain_step is not None:  # every list fed by this recorder stops recording
            stop_plain_step(self._plain_step)
        self._on_fault(Fault.STEP_HOOK, exc)


class RecordingCriteriaList(StoppingCriteriaList):
    """A ``StoppingCriteriaList`` that reports each call to a :class:`StepRecorder`.

    It holds the same criteria and returns exactly what ``StoppingCriteriaList`` returns (it calls
    it: a BoolTensor ``(rows,)``, ``True`` where a row is done), then records the step. On the plain
    path (:attr:`_plain`: a step is nothing but the appends of a :data:`PlainStep`) it appends
    them itself, the recorder's own call saved.
    """

    def __init__(self, criteria, recorder: StepRecorder) -> None:
        super().__init__(criteria)
        self.recorder = recorder
        #: the recorder's :data:`PlainStep` when a step is only its appends (no device to wait
        #: for, no callback, no candidate calls to skip): then this call appends them itself
        self._plain = recorder.plain_step()

    def __deepcopy__(self, memo):
        """A copy (transformers' ``validate_stopping_criteria`` deep-copies a criteria list) holds
        copies of the criteria and feeds the same recorder through the same :data:`PlainStep`, so
        that a fault in either stops both."""
        copied = type(self).__new__(type(self))
        memo[id(self)] = copied
        list.extend(copied, copy.deepcopy(list(self), memo))
        vars(copied).update(vars(self))
        return copied

    def __call__(self, input_ids, scores, **kwargs):
        if kwargs:
            is_done = StoppingCriteriaList.__call__(self, input_ids, scores, **kwargs)
        else:  # (how transformers calls it: no keyword to pass on)
            is_done = StoppingCriteriaList.__call__(self, input_ids, scores)
        step = self._plain
        if step is None:  # a device to wait for, a callback, candidate calls to skip
            self.recorder(input_ids, is_done)
            return is_done
        append_time, clock, append_length, append_done = step
        try:
            append_time(clock())  # (after a fault, stop_plain_step made these two do nothing)
            if append_length is not None:  # (None: the lengths are implied, one token a step)
                append_length(input_ids.shape[-1])
            if append_done is not None:  # (None: no row may stop before the others)
                append_done(is_done)
        except Exception as exc:  # never break generation: the recorder stops, and every list it feeds
            self.recorder._fail(exc)
        return is_done
