"""Producer: transformers' continuous batching (``generate_batch``, ``init_continuous_batching()``
and its manager, ``continuous_batching_context_manager``, ``transformers serve --continuous-batching``).

One request span per request, in the trace of whoever submitted it. A
``ContinuousBatchingManager`` runs every request on one scheduler thread, a batch step at a time;
a request joins the batch steps until it finishes. The hooks (transformers 5.17 or newer: the
features are detected, not the version) record as little as possible where it happens and
derive everything else later, off the scheduler thread:

* ``ContinuousBatchingManager.add_request`` (the submitting thread: ``generate_batch`` and
  ``add_requests`` call it, the serve handler calls it on its event loop): the monotonic and wall
  clocks, the current OpenTelemetry context (the parent of the request span, which starts here,
  so that sampling is decided at submission) and the request's parameters.
* ``ContinuousBatchingManager._generation_loop_body`` (the scheduler thread, once per loop
  iteration): one clock read at the end of a batch step (the start is where the previous step
  ended, one more read after an idle wait) and, while a timed request is in flight, one append
  of ``(start, end, the batch's list of requests)``. No device synchronization: transformers has
  already waited for the device before the body returns (sync mode: the compute stream's
  ``synchronize()`` and the ``.tolist()`` of the new tokens; async mode: the device-to-host
  event of the batch it updates).
* ``OutputRouter.deliver`` / ``deliver_batch`` (the scheduler thread, when outputs are handed
  over): one append of ``(clock, outputs)``, and the background emitter is woken (at most one
  job pending per manager).
* ``ContinuousBatchingManager.cancel_request`` (the caller): a cancelled request never produces
  an output; its span ends with finish reason ``cancelled`` (not an error, :mod:`otel_generate.cancellation`)
  after the batch step running at that moment, counting the batch steps that gave it a token.

Derivation, on the :class:`~otel_generate.background.BackgroundEmitter`'s thread: which batch
steps each request took part in (``prefill`` chunks with no token, the step that produced its
first token, then one ``decode`` per token), the requests sharing each step, the queue time,
tokens, finish reasons and a streaming request's time to first chunk (the first delivered output
with generated tokens); then :func:`otel_generate.emit.finish` builds the spans and records the
metrics. The scheduler thread never builds a span nor records a metric.

A ``generate(..., cache_implementation="paged")`` call hands its rows to ``generate_batch``: the
requests it submits are accounted into that one ``generate()`` request (:class:`PagedGroup`),
not given spans of their own.
"""

from __future__ import annotations

import collections
import functools
import inspect
import logging
import re
import threading
import time
import weakref
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

import wrapt
from opentelemetry import context as otel_context
from opentelemetry.instrumentation.utils import is_instrumentation_enabled

from otel_generate import attributes as A
from otel_generate import clock, emit, ranks
from otel_generate._faults import log_fault_once
from otel_generate._patch import Patches
from otel_generate.request import Request

_LOG = logging.getLogger("otel_generate")

MODULE = "transformers.generation.continuous_batching.continuous_api"
#: Where a manager (and its ``OutputRouter``) keeps this package's state.
STATE_ATTR = "_otel_generate_cb"
#: transformers names the extra sequences of ``num_return_sequences`` ``{request_id}__child#{i}``.
CHILD_SEPARATOR = "__child#"
#: Finish reason of a request cancelled with ``cancel_request`` (the package-wide name, kept here too).
FINISH_REASON_CANCELLED = A.FINISH_REASON_CANCELLED
#: How long derivation waits for the batch step that delivered an output to end, seconds.
BODY_WAIT_S = 1.0
#: The emitter yields the interpreter lock after this many step spans.
YIELD_EVERY = 16
#: How often a manager reads the wall clock again to place its monotonic times on it, nanoseconds.
OFFSET_REFRESH_NS = 10 * clock.NS_PER_S

#: (class, method) the hooks need; without all of them continuous batching is not instrumented.
REQUIRED = (
    ("ContinuousBatchingManager", "add_request"),
    ("ContinuousBatchingManager", "cancel_request"),
    ("ContinuousBatchingManager", "_generation_loop_body"),
    ("OutputRouter", "deliver"),
    ("OutputRouter", "deliver_batch"),
)

_STATE_LOCK = threading.Lock()
#: every manager state alive (for ``uninstrument()``: the requests still in flight)
_LIVE_STATES: "weakref.WeakSet[Any]" = weakref.WeakSet()


def missing_features(module: Any) -> List[str]:
    """The hook points ``module`` (``continuous_api``) lacks, as ``Class.method`` (empty: all there)."""
    missing = []
    for cls_name, name in REQUIRED:
        cls = getattr(module, cls_name, None)
        if cls is None or name not in vars(cls):
            missing.append(f"{cls_name}.{name}")
    return missing


def install(patches: Patches, telemetry: emit.Telemetry) -> None:
    """Hook continuous batching now if its module is imported, else when it is (no import here)."""

    def on_import(module: Any) -> None:
        if not telemetry.active:
            return
        missing = missing_features(module)
        if missing:
            _LOG.info(
                "otel_generate: this transformers' continuous batching has no %s; its requests are not traced",
                ", ".join(missing),
            )
            return
        try:
            with _STATE_LOCK:
                telemetry.start_emitter(patches)  # the scheduler thread never builds a span itself
            manager, router = module.ContinuousBatchingManager, module.OutputRouter
            patches.replace(manager, "add_request", make_add_request, telemetry)
            patches.replace(manager, "cancel_request", make_cancel_request, telemetry)
            patches.replace(manager, "_generation_loop_body", make_generation_loop_body, telemetry)
            patches.replace(router, "deliver", make_deliver, telemetry)
            patches.replace(router, "deliver_batch", make_deliver_batch, telemetry)
        except Exception as fault:
            log_fault_once("continuous batching hook install", fault)

    wrapt.register_post_import_hook(on_import, MODULE)


# --- per request ---------------------------------------------------------------------------------


class _Record:
    """What is known about one submitted request (and its ``num_return_sequences`` children)."""

    __slots__ = (
        "request_id",
        "span",
        "start_ns",
        "start_wall_ns",
        "timed",
        "profilers",
        "parameters",
        "eos",
        "sequences",
        "steps",
        "outputs",
        "cancelled_ns",
        "group",
        "input_tokens",
        "last_body",
        "streaming",
        "first_chunk_ns",
    )

    def __init__(self, request_id: str, start_ns: int, start_wall_ns: int, sequences: int) -> None:
        self.request_id = request_id
        self.span: Any = None
        self.start_ns = start_ns
        self.start_wall_ns = start_wall_ns
        self.timed = False
        self.profilers: Tuple[Any, ...] = ()
        self.parameters: Dict[str, Any] = {}
        self.eos: frozenset = frozenset()
        self.sequences = sequences
        #: sequence id -> [(batch step number, start_ns, end_ns, requests in the step, produced a token)]
        self.steps: Dict[str, List[tuple]] = {}
        #: sequence id -> (delivered at ns, GenerationOutput)
        self.outputs: Dict[str, tuple] = {}
        self.cancelled_ns: Optional[int] = None
        self.group: Optional["PagedGroup"] = None
        self.input_tokens: Optional[int] = None
        self.last_body = 0  # the loop iteration that delivered the last output (0: outside one)
        self.streaming = False
        #: when the first output with generated tokens was handed over (streaming requests)
        self.first_chunk_ns: Optional[int] = None

    def complete(self) -> bool:
        if self.cancelled_ns is not None:
            return True
        parent = self.outputs.get(self.request_id)
        if parent is not None and parent[1].error is not None:
            return True  # failed before it could fork: no child will come
        return len(self.outputs) >= self.sequences


def _base_id(request_id: str) -> str:
    return request_id.split(CHILD_SEPARATOR, 1)[0] if CHILD_SEPARATOR in request_id else request_id


def _eos_set(eos: Any) -> frozenset:
    if eos is None:
        return frozenset()
    if isinstance(eos, int):
        return frozenset((eos,)) if eos >= 0 else frozenset()
    try:
        return frozenset(int(e) for e in eos if int(e) >= 0)
    except TypeError:
        return frozenset()


def _sequence_order(record: _Record) -> List[str]:
    """The record's sequence ids: the request itself, then its children by index."""
    children = sorted(
        (rid for rid in set(record.outputs) | set(record.steps) if rid != record.request_id),
        key=lambda rid: int(rid.rsplit("#", 1)[1]) if rid.rsplit("#", 1)[1].isdigit() else 0,
    )
    return [record.request_id] + children


def _finish_reason(output: Any, eos: frozenset) -> str:
    generated = output.generated_tokens
    return A.FINISH_REASON_STOP if generated and generated[-1] in eos else A.FINISH_REASON_LENGTH


class _Derived:
    """A finished record as numbers: the union of its sequences' batch steps, tokens, outcome."""

    __slots__ = ("steps", "input_tokens", "per_sequence", "finish_reasons", "error", "end_ns", "complete")

    def __init__(self) -> None:
        self.steps: List[list] = []  # [number, start_ns, end_ns, requests, tokens]
        self.input_tokens: Optional[int] = None
        self.per_sequence: List[int] = []
        self.finish_reasons: Optional[List[str]] = None
        self.error: Optional[BaseException] = None
        self.end_ns: Optional[int] = None
        self.complete = True


def _derive(record: _Record) -> _Derived:
    """Steps, tokens and outcome of a finished (or cancelled) record."""
    derived = _Derived()
    by_number: Dict[int, list] = {}
    reasons: List[str] = []
    errors: List[str] = []
    ends: List[int] = []
    for rid in _sequence_order(record):
        delivered = record.outputs.get(rid)
        output = delivered[1] if delivered is not None else None
        generated = len(output.generated_tokens) if output is not None else None
        got = 0
        for number, start, end, sharing, new_token in record.steps.get(rid, ()):
            if generated is not None and got >= generated:
                break  # async mode: a finished request can sit in one more batch; its token was dropped
            got += 1 if new_token else 0
            step = by_number.get(number)
            if step is None:
                by_number[number] = [number, start, end, sharing, 1 if new_token else 0]
            elif new_token:
                step[4] = 1
            ends.append(end)
        if output is None:
            continue
        if delivered[0] is not None:
            ends.append(delivered[0])
        if rid == record.request_id:
            derived.input_tokens = len(output.prompt_ids)
        derived.per_sequence.append(generated)
        if output.error is not None:
            errors.append(str(output.error))
        else:
            reasons.append(_finish_reason(output, record.eos))
        if record.timed and generated and got < generated:
            derived.complete = False  # a step that produced one of its tokens was not recorded
    derived.steps = [by_number[number] for number in sorted(by_number)]
    if record.cancelled_ns is not None and not record.outputs:
        reasons = [FINISH_REASON_CANCELLED]
        ends.append(record.cancelled_ns)
    if errors:
        derived.error = RuntimeError(errors[0])
    elif reasons:
        derived.finish_reasons = reasons
    if derived.input_tokens is None:
        derived.input_tokens = record.input_tokens
    derived.end_ns = max(ends) if ends else None
    return derived


def _fill_steps(request: Any, steps: List[list], start_ns: int) -> None:
    """Explicit batch-step bounds, tokens and sharing into ``request`` (starts clamped to ``start_ns``):
    a :class:`~otel_generate.request.Request`, or a ``generate()`` loop, which has the same step fields."""
    request.step_starts_ns = [max(step[1], start_ns) for step in steps]
    request.step_ends_ns = [max(step[2], start_ns) for step in steps]
    request.step_tokens = [step[4] for step in steps]
    request.step_requests = [step[3] for step in steps]
    first_token = next((index for index, step in enumerate(steps) if step[4]), None)
    request.prefill_steps = len(steps) if first_token is None else first_token + 1
    if steps:
        request.queue_ns = request.step_starts_ns[0] - start_ns


def _incomplete_request(state: "_ManagerState", record: _Record, now_ns: int) -> Request:
    """A request whose steps could not be accounted: its span still ends at ``now_ns`` (monotonic
    nanoseconds), marked incomplete, with what was known at submission."""
    return Request(
        model=state.model_name,
        start_ns=record.start_ns,
        start_wall_ns=record.start_wall_ns,
        timed=record.timed,
        device=state.device,
        parameters=dict(record.parameters),
        request_id=record.request_id,
        incomplete=True,
        end_ns=max(now_ns, record.start_ns),
    )


def _request_of(state: "_ManagerState", record: _Record, derived: _Derived) -> Request:
    request = Request(
        model=state.model_name,
        start_ns=record.start_ns,
        start_wall_ns=record.start_wall_ns,
        timed=record.timed,
        synchronized=True,  # every clock read follows transformers' own wait for the device
        device=state.device,
        parameters=dict(record.parameters),
        request_id=record.request_id,
    )
    if record.timed:
        _fill_steps(request, derived.steps, record.start_ns)
        request.incomplete = not derived.complete
    request.input_tokens = derived.input_tokens
    if derived.per_sequence:
        request.output_tokens_per_sequence = list(derived.per_sequence)
        request.output_tokens = int(sum(derived.per_sequence))
    elif record.cancelled_ns is not None:
        request.output_tokens = sum(1 for step in derived.steps if step[4]) if record.timed else None
    request.finish_reasons = derived.finish_reasons
    request.error = derived.error
    if record.first_chunk_ns is not None:
        request.first_chunk_ns = max(record.first_chunk_ns, record.start_ns)
    end = derived.end_ns if derived.end_ns is not None else clock.monotonic_ns()
    request.end_ns = max(end, record.start_ns)
    return request


# --- per manager ---------------------------------------------------------------------------------


class _ManagerState:
    """This package's records for one ``ContinuousBatchingManager``.

    Written by the submitting threads (``records``, under ``lock``) and the scheduler thread (the
    ``steps``, ``delivered`` and ``cancelled`` logs: appends only, no lock); read and emptied by
    :meth:`process` on the emitter thread (or the thread of a paged ``generate()`` call).
    """

    def __init__(self, telemetry: emit.Telemetry, manager: Any) -> None:
        from otel_generate.integrations.generate_loop import model_name

        self.telemetry = telemetry
        self.lock = threading.Lock()
        self.records: Dict[str, _Record] = {}
        self.steps: Deque[tuple] = collections.deque()
        self.delivered: Deque[tuple] = collections.deque()
        self.cancelled: Deque[tuple] = collections.deque()
        #: entries of ids whose ``add_request`` has not returned yet (kept only while one is running)
        self.orphan_steps: Dict[str, List[tuple]] = {}
        self.orphan_outputs: Dict[str, tuple] = {}
        self.orphan_first_chunks: Dict[str, int] = {}
        self.ready: List[_Record] = []  # finished, waiting for the batch step that delivered them to end
        self.submitting = 0
        self.timed = 0
        self.collect = False  # read by the scheduler thread: append batch steps
        self.step_number = 0
        # scheduler-thread bookkeeping
        self.last_t1: Optional[int] = None
        self.body = 0  # number of the loop iteration running (0: none)
        self.bodies = 0  # loop iterations started
        self.done = 0  # number of the last loop iteration that ended
        self.last_delivery_body = 0
        self.pending_async: Dict[int, tuple] = {}  # async mode: id(batch list) -> (start_ns, batch list)
        self.scheduled = False
        self.wake = False
        self.manager = weakref.ref(manager)
        self.model_name = model_name(manager.model)
        device = getattr(manager.model, "device", None)
        self.device = str(device) if device is not None else None
        self.job = self._job  # one bound method, submitted again and again
        self._offset: Optional[int] = None
        self._offset_at = 0

    def wall_offset(self, now_ns: int) -> int:
        """Wall clock minus monotonic clock, nanoseconds: read again every :data:`OFFSET_REFRESH_NS`, so that
        requests submitted in between place a shared batch step at exactly the same wall time."""
        if self._offset is None or now_ns - self._offset_at > OFFSET_REFRESH_NS:
            self._offset = clock.wall_ns() - clock.monotonic_ns()
            self._offset_at = now_ns
        return self._offset

    # --- the scheduler thread's side: O(1) -----------------------------------------------------
    def trigger(self) -> None:
        """Have :meth:`process` run on the emitter thread (at most one job pending)."""
        if self.scheduled:
            return
        emitter = self.telemetry.emitter
        if emitter is None:
            return
        self.scheduled = True
        if not emitter.submit(self.job):
            self.scheduled = False

    # --- the emitter's side ---------------------------------------------------------------------
    def _scheduler_alive(self) -> bool:
        manager = self.manager()
        thread = getattr(manager, "_generation_thread", None) if manager is not None else None
        return thread is not None and thread.is_alive()

    def wait_for_body(self, body: int, timeout_s: float = BODY_WAIT_S) -> None:
        """Wait until loop iteration ``body`` has ended (its last batch step is logged), at most ``timeout_s``."""
        if not body or self.done >= body:
            return
        deadline = time.monotonic() + timeout_s
        while self.done < body and self._scheduler_alive() and time.monotonic() < deadline:
            time.sleep(0.0002)

    def _job(self) -> None:
        self.scheduled = False
        self.wait_for_body(self.last_delivery_body)
        for record, request in self.process():
            emit.finish(self.telemetry, record.span, request, record.profilers, yield_every=YIELD_EVERY)

    def process(self) -> List[Tuple[_Record, Request]]:
        """Take in the logs; return the finished requests to emit (paged records go to their group)."""
        finished: List[_Record] = []
        with self.lock:
            self._ingest_steps()
            self._ingest_deliveries()
            self._ingest_cancels()
            done = self.done
            still = []
            for record in self.ready:
                if record.last_body and record.last_body > done and self._scheduler_alive():
                    still.append(record)  # its batch step has not ended yet: its last step is not logged
                else:
                    finished.append(record)
            self.ready = still
            if still:
                self.wake = True  # the end of that loop iteration triggers the next run
            for record in finished:
                if self.records.get(record.request_id) is record:
                    del self.records[record.request_id]
                if record.timed:
                    self.timed -= 1
            self.collect = bool(self.submitting or self.timed)
        out = []
        for record in finished:
            try:
                derived = _derive(record)
                if record.group is not None:
                    record.group.add(record, derived)
                    continue
                request = _request_of(self, record, derived)
            except Exception as fault:
                log_fault_once("continuous batching accounting", fault)
                if record.group is not None:
                    continue  # the group reports the row as missing
                # the span still ends, marked incomplete; the other requests are not affected
                request = _incomplete_request(self, record, clock.monotonic_ns())
            out.append((record, request))
        return out

    def _ingest_steps(self) -> None:
        steps, records = self.steps, self.records
        while steps:
            entry = steps.popleft()
            if len(entry) == 4:  # async mode: (start, end, launched batch, updated batch)
                entry = self._async_step(entry)
                if entry is None:
                    continue
            start, end, batch = entry
            number = self.step_number
            self.step_number += 1
            sharing = len(batch)
            for future in batch:
                rid = future.state.request_id
                record = records.get(_base_id(rid))
                item = (number, start, end, sharing, bool(future.has_new_token))
                if record is None:
                    if self.submitting:
                        self.orphan_steps.setdefault(rid, []).append(item)
                elif record.timed:
                    record.steps.setdefault(rid, []).append(item)

    def _async_step(self, entry: tuple) -> Optional[tuple]:
        """Async batching: batch j is launched in iteration j and updated in iteration j+1; its step
        runs from the start of the first to the end of the second (steps overlap, as the work does)."""
        start, end, launched, updated = entry
        result = None
        if updated is not None:
            opened = self.pending_async.pop(id(updated), None)
            if opened is not None:
                result = (opened[0], end, updated)
        if launched is not None:
            self.pending_async[id(launched)] = (start, launched)
        return result

    def _close_async(self, end: int) -> None:
        """The last batches of an async run are updated after the loop: they end at that delivery."""
        for start, batch in list(self.pending_async.values()):
            self.steps.appendleft((start, end, batch))
        self.pending_async.clear()
        self._ingest_steps()

    def _ingest_deliveries(self) -> None:
        delivered, records = self.delivered, self.records
        while delivered:
            at, outputs, body = delivered.popleft()
            if not body and self.pending_async:
                self._close_async(at)
            for output in outputs:
                rid = output.request_id
                record = records.get(_base_id(rid))
                if record is None:
                    if self.submitting:
                        self.orphan_first_chunks.setdefault(_base_id(rid), at)
                        if output.is_finished():
                            self.orphan_outputs[rid] = (at, output, body)
                    continue
                if record.streaming and record.first_chunk_ns is None and output.generated_tokens:
                    record.first_chunk_ns = at  # the first chunk handed to the streaming consumer
                if output.is_finished():
                    self._deliver(record, rid, at, output, body)

    def _deliver(self, record: _Record, rid: str, at: int, output: Any, body: int) -> None:
        if record.complete() and record in self.ready:
            return
        record.outputs[rid] = (at, output)
        record.last_body = max(record.last_body, body)
        if record.complete():
            self.ready.append(record)

    def _ingest_cancels(self) -> None:
        cancelled, records = self.cancelled, self.records
        while cancelled:
            at, rid, body = cancelled.popleft()
            record = records.get(rid)
            if record is None or record.complete():
                continue
            record.cancelled_ns = at
            # the loop iteration running when it was cancelled may still give it a token: wait for its step
            record.last_body = max(record.last_body, body)
            self.ready.append(record)

    def register(self, record: _Record) -> None:
        """An accepted request (under the caller's thread): adopt what the scheduler already logged."""
        with self.lock:
            rid = record.request_id
            self.records[rid] = record
            if record.timed:
                self.timed += 1
            first_chunk = self.orphan_first_chunks.pop(rid, None)
            if record.streaming and first_chunk is not None:
                record.first_chunk_ns = first_chunk
            for key in [key for key in self.orphan_steps if _base_id(key) == rid]:
                if record.timed:
                    record.steps.setdefault(key, []).extend(self.orphan_steps[key])
                del self.orphan_steps[key]
            adopted = [key for key in self.orphan_outputs if _base_id(key) == rid]
            for key in adopted:
                at, output, body = self.orphan_outputs.pop(key)
                self._deliver(record, key, at, output, body)
            self._left_submission()
        if adopted:
            self.trigger()

    def _left_submission(self) -> None:
        self.submitting -= 1
        if self.submitting <= 0:
            self.submitting = 0
            self.orphan_steps.clear()
            self.orphan_outputs.clear()
            self.orphan_first_chunks.clear()
        self.collect = bool(self.submitting or self.timed)

    def enter_submission(self) -> None:
        with self.lock:
            self.submitting += 1
            self.collect = True

    def abandon_submission(self) -> None:
        with self.lock:
            self._left_submission()

    def drop(self, records: List[_Record]) -> None:
        """Forget records that will never finish (their ``generate()`` raised)."""
        with self.lock:
            for record in records:
                if self.records.get(record.request_id) is record:
                    del self.records[record.request_id]
                    if record.timed:
                        self.timed -= 1
            self.collect = bool(self.submitting or self.timed)


def state_of(manager: Any, telemetry: emit.Telemetry) -> _ManagerState:
    """The manager's state for this instrumentation (created on its first request)."""
    state = manager.__dict__.get(STATE_ATTR)
    if state is not None and state.telemetry is telemetry:
        return state
    with _STATE_LOCK:
        state = manager.__dict__.get(STATE_ATTR)
        if state is None or state.telemetry is not telemetry:
            state = _ManagerState(telemetry, manager)
            _LIVE_STATES.add(state)
            setattr(manager, STATE_ATTR, state)
            setattr(manager.output_router, STATE_ATTR, state)
    return state


def end_in_flight(telemetry: emit.Telemetry) -> None:
    """``uninstrument()``: emit what finished, and end the spans of the requests still in flight,
    marked ``generate.steps.incomplete`` with what was recorded so far (they go on generating,
    uninstrumented). Never raises."""
    for state in list(_LIVE_STATES):
        if state.telemetry is not telemetry:
            continue
        try:
            for record, request in state.process():
                emit.finish(telemetry, record.span, request, record.profilers)
            with state.lock:
                pending = [r for r in state.records.values() if r.group is None]
                for record in pending:
                    del state.records[record.request_id]
                state.timed = 0
                state.collect = False
            now = clock.monotonic_ns()
            for record in pending:
                try:
                    request = _request_of(state, record, _derive(record))
                    request.incomplete, request.finish_reasons, request.end_ns = True, None, max(now, record.start_ns)
                except Exception:
                    request = _incomplete_request(state, record, now)
                emit.finish(telemetry, record.span, request, record.profilers)
        except Exception as fault:
            log_fault_once("continuous batching uninstrument", fault)


# --- paged generate(): the rows of one generate() call ---------------------------------------------


class PagedGroup:
    """The continuous-batching requests one ``generate(..., cache_implementation="paged")`` submitted:
    accounted into that call's request (:class:`~otel_generate.integrations.generate_loop.Loop`)."""

    def __init__(self, loop: Any) -> None:
        self.loop = loop
        self.records: List[_Record] = []
        self.states: List[_ManagerState] = []
        self.done: Dict[int, Tuple[_Record, _Derived]] = {}
        self._lock = threading.Lock()

    def submitted(self, state: _ManagerState, record: _Record) -> None:
        with self._lock:
            self.records.append(record)
            if state not in self.states:
                self.states.append(state)

    def add(self, record: _Record, derived: _Derived) -> None:
        with self._lock:
            self.done[id(record)] = (record, derived)

    def collect(self) -> List[Tuple[_Record, Optional[_Derived]]]:
        """Every row, in input order, with its numbers (``None``: it never finished)."""
        for state in self.states:
            state.wait_for_body(state.last_delivery_body)
            leftovers = state.process()
            emitter = state.telemetry.emitter
            for record, request in leftovers:  # another caller's requests: not this thread's work
                if emitter is not None:
                    emitter.submit(
                        functools.partial(
                            emit.finish, state.telemetry, record.span, request, record.profilers, YIELD_EVERY
                        )
                    )
        with self._lock:
            records = list(self.records)
            done = dict(self.done)
        unfinished = [record for record in records if id(record) not in done]
        for state in self.states:
            state.drop(unfinished)
        numbered = all(re.fullmatch(r"req_\d+", record.request_id) for record in records)
        if numbered:  # add_requests submits in prefix-sharing order; generate() returns req_0..req_{n-1}
            records.sort(key=lambda record: int(record.request_id[4:]))
        return [(record, done.get(id(record), (None, None))[1]) for record in records]

    def account(self, loop: Any) -> None:
        """Fill ``loop`` (steps, tokens, finish reasons, parameters) from the rows."""
        rows = self.collect()
        call = loop.call
        start_ns = call.request.start_ns
        by_number: Dict[int, list] = {}
        per_sequence: List[int] = []
        reasons: List[str] = []
        input_tokens = 0
        incomplete = False
        for record, derived in rows:
            if derived is None:
                incomplete = True
                if record.input_tokens is not None:
                    input_tokens += record.input_tokens
                continue
            incomplete = incomplete or not derived.complete
            for step in derived.steps:
                known = by_number.get(step[0])
                if known is None:
                    by_number[step[0]] = list(step)
                else:
                    known[4] = max(known[4], step[4])
            input_tokens += derived.input_tokens or 0
            per_sequence.extend(derived.per_sequence)
            reasons.extend(derived.finish_reasons or [])
        steps = [by_number[number] for number in sorted(by_number)]
        parameters: Dict[str, Any] = {}
        if rows:
            parameters.update(rows[0][0].parameters)
        parameters.pop(A.GEN_AI_REQUEST_STREAM, None)
        parameters[A.GENERATE_BATCH_SIZE] = len(rows)
        loop.parameters = parameters
        if call.timed:
            _fill_steps(loop, steps, start_ns)
            loop.incomplete = incomplete
        loop.input_tokens = input_tokens if rows else None
        if per_sequence:
            loop.per_sequence = per_sequence
            loop.output_tokens = int(sum(per_sequence))
        if len(reasons) == len(per_sequence) and reasons:
            loop.finish_reasons = reasons


def _paged_group(manager: Any) -> Any:
    """The :class:`PagedGroup` a request submitted now belongs to; ``None`` (a request of its own);
    or ``False``: inside a step of a running ``generate()`` loop (not traced)."""
    from otel_generate.integrations import generate_loop as G

    frame = G._ACTIVE.get()
    if frame is None:
        return None
    if frame is G._NESTED:
        return False
    model = getattr(manager, "model", None)
    if isinstance(frame, G.Loop):
        if frame.running:
            return False
        if frame.closed or not frame.call.owns(model):
            return None
        loop = frame
    elif isinstance(frame, G.Call):
        if not frame.owns(model):
            return None
        loop = frame.implicit_loop(model)
    else:
        return None
    if loop.paged is None:
        loop.paged = PagedGroup(loop)
    return loop.paged


# --- the hooks ------------------------------------------------------------------------------------


def _sampling_parameters(generation_config: Any, overrides: Dict[str, Any]) -> Dict[str, Any]:
    from otel_generate.integrations.generate_loop import strategy_of

    params: Dict[str, Any] = {A.GENERATE_STRATEGY: strategy_of(generation_config, None)}
    if getattr(generation_config, "do_sample", False):
        for key, name in (
            (A.GEN_AI_REQUEST_TEMPERATURE, "temperature"),
            (A.GEN_AI_REQUEST_TOP_P, "top_p"),
            (A.GEN_AI_REQUEST_TOP_K, "top_k"),
        ):
            value = overrides.get(name, getattr(generation_config, name, None))
            if value is not None:
                params[key] = float(value)
    return params


def make_add_request(original: Callable, telemetry: emit.Telemetry) -> Callable:
    """``ContinuousBatchingManager.add_request``: the submission (clocks, context, span, parameters)."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def add_request(self, *args, **kwargs):
        if not telemetry.active or not is_instrumentation_enabled():
            return original(self, *args, **kwargs)
        try:
            group = _paged_group(self)
            if group is False:
                return original(self, *args, **kwargs)
            state = state_of(self, telemetry)
            start_ns = clock.monotonic_ns()
            start_wall_ns = start_ns + state.wall_offset(start_ns)
            context = otel_context.get_current()
            state.enter_submission()
        except Exception as fault:
            log_fault_once("continuous batching submit", fault)
            return original(self, *args, **kwargs)
        try:
            request_id = original(self, *args, **kwargs)
        except BaseException:
            state.abandon_submission()
            raise
        if request_id is None:  # not the TP driver, or the manager is stopping: nothing was queued
            state.abandon_submission()
            return request_id
        try:
            record = _record(telemetry, self, signature, args, kwargs, request_id, start_ns, start_wall_ns)
            if group is not None:
                record.group = group
                record.timed = group.loop.call.timed
                group.submitted(state, record)
            else:
                record.span = emit.start_request_span(
                    telemetry, state.model_name, context=context, start_time=start_wall_ns
                )
                record.profilers = tuple(telemetry.profilers())
                # steps for the span, a profiler, or the latency metrics (every request, sampled or not)
                record.timed = record.span.is_recording() or bool(record.profilers) or telemetry.metrics_live()
            state.register(record)
        except Exception as fault:
            state.abandon_submission()
            log_fault_once("continuous batching submit", fault)
        return request_id

    return add_request


def _record(
    telemetry: emit.Telemetry,
    manager: Any,
    signature: inspect.Signature,
    args: tuple,
    kwargs: dict,
    request_id: str,
    start_ns: int,
    start_wall_ns: int,
) -> _Record:
    bound = signature.bind(manager, *args, **kwargs).arguments
    config = manager.generation_config
    max_new = bound.get("max_new_tokens")
    if max_new is None:
        max_new = getattr(config, "max_new_tokens", None)
    eos = bound.get("eos_token_id")
    if eos is None:
        eos = getattr(config, "eos_token_id", None)
    overrides = bound.get("logit_processor_kwargs") or {}
    sequences = int(getattr(manager, "num_return_sequences", 1) or 1)
    record = _Record(str(request_id), start_ns, start_wall_ns, sequences)
    record.eos = _eos_set(eos)
    prompt = bound.get("input_ids")
    try:
        record.input_tokens = len(prompt)
    except TypeError:
        record.input_tokens = None
    params = record.parameters
    if max_new is not None and max_new >= 0:
        params[A.GEN_AI_REQUEST_MAX_TOKENS] = int(max_new)
    if sequences > 1:
        params[A.GEN_AI_REQUEST_CHOICE_COUNT] = sequences
    if bound.get("streaming"):
        params[A.GEN_AI_REQUEST_STREAM] = True
        record.streaming = True
    params.update(ranks.attributes_of(manager.model))  # a distributed run: the driver's ranks
    per_request = getattr(getattr(manager, "continuous_batching_config", None), "per_request_processors", False)
    params.update(_sampling_parameters(config, overrides if per_request else {}))
    return record


def make_generation_loop_body(original: Callable, telemetry: emit.Telemetry) -> Callable:
    """``ContinuousBatchingManager._generation_loop_body``: one loop iteration; logs its batch step."""

    @functools.wraps(original)
    def _generation_loop_body(self, *args, **kwargs):
        state = self.__dict__.get(STATE_ATTR)
        if state is None or state.telemetry is not telemetry or not telemetry.active:
            return original(self, *args, **kwargs)
        before = self.current_batch
        start = state.last_t1
        if start is None:
            start = clock.monotonic_ns()
        body = state.bodies + 1
        state.bodies = body
        state.body = body
        try:
            result = original(self, *args, **kwargs)
        except BaseException:
            state.last_t1 = None
            state.body = 0
            state.done = body
            raise
        if self.current_batch != before:
            end = clock.monotonic_ns()
            state.last_t1 = end
            if state.collect:
                try:
                    _log_step(state, self, args, kwargs, start, end)
                except Exception as fault:
                    log_fault_once("continuous batching step", fault)
        else:
            state.last_t1 = None
        state.body = 0
        state.done = body
        if state.wake:
            state.wake = False
            state.trigger()
        return result

    return _generation_loop_body


def _log_step(state: _ManagerState, manager: Any, args: tuple, kwargs: dict, start: int, end: int) -> None:
    processor = args[0] if args else kwargs.get("batch_processor", manager.batch_processor)
    io = processor.inputs_and_outputs
    batch = getattr(io, "requests_in_batch", None)
    if batch is not None:  # sync mode: the batch this iteration ran and updated
        state.steps.append((start, end, batch))
        return
    # async mode: this iteration launched one batch and updated the previous one
    bootstrapping = args[1] if len(args) > 1 else kwargs.get("bootstrapping", False)
    pairs, current = io.io_pairs, io.current_pair
    launched = pairs[1 - current].host_io.requests_in_batch
    updated = None if bootstrapping else pairs[current].host_io.requests_in_batch
    state.steps.append((start, end, launched, updated))


def _make_deliver(original: Callable, telemetry: emit.Telemetry, single: bool) -> Callable:
    @functools.wraps(original)
    def deliver(self, *args, **kwargs):
        state = self.__dict__.get(STATE_ATTR)
        if (
            state is not None
            and state.telemetry is telemetry
            and telemetry.active
            and (state.records or state.submitting)
        ):
            try:
                outputs = args[0] if args else kwargs.get("output" if single else "outputs")
                body = state.body
                state.delivered.append((clock.monotonic_ns(), [outputs] if single else outputs, body))
                state.last_delivery_body = body
                state.trigger()  # before the caller can see the output: a flush then waits for its span
            except Exception as fault:
                log_fault_once("continuous batching delivery", fault)
        return original(self, *args, **kwargs)

    return deliver


def make_deliver(original: Callable, telemetry: emit.Telemetry) -> Callable:
    """``OutputRouter.deliver``: one output handed over (a failure, a streamed token)."""
    return _make_deliver(original, telemetry, single=True)


def make_deliver_batch(original: Callable, telemetry: emit.Telemetry) -> Callable:
    """``OutputRouter.deliver_batch``: the outputs of one batch step."""
    return _make_deliver(original, telemetry, single=False)


def make_cancel_request(original: Callable, telemetry: emit.Telemetry) -> Callable:
    """``ContinuousBatchingManager.cancel_request``: the request will never deliver an output."""

    @functools.wraps(original)
    def cancel_request(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        state = self.__dict__.get(STATE_ATTR)
        if state is not None and state.telemetry is telemetry and telemetry.active:
            try:
                request_id = args[0] if args else kwargs.get("request_id")
                if request_id in state.records:
                    state.cancelled.append((clock.monotonic_ns(), request_id, state.body))
                    state.trigger()
            except Exception as fault:
                log_fault_once("continuous batching cancel", fault)
        return result

    return cancel_request
