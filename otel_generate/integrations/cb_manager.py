"""Continuous batching's per-manager state: the scheduler thread's logs, read off that thread.

One :class:`ManagerState` per ``ContinuousBatchingManager``. The hooks
(:mod:`otel_generate.integrations.continuous_batching`) append to its logs on the scheduler thread
(:class:`~.cb_records.BatchLog`, :class:`~.cb_records.Delivery`, :class:`~.cb_records.Cancel`: appends
only, no lock); :meth:`ManagerState.process` takes them in on the background emitter's thread (or the
thread of a paged ``generate()`` call), files them under each request's :class:`~.cb_records.CBRecord`,
and hands the finished ones to :mod:`.cb_derive` and then :func:`otel_generate.emit.hand_over`.
"""

from __future__ import annotations

import collections
import re
import threading
import time
import weakref
from typing import Any, Deque, Dict, List, Optional, Tuple

from otel_generate import clock, emit, energy
from otel_generate._faults import Fault, log_fault_once
from otel_generate.integrations import cb_derive
from otel_generate.integrations.cb_records import (
    AsyncBatchLog,
    BatchLog,
    BatchStep,
    Cancel,
    CBRecord,
    Delivery,
    Finished,
    Outcome,
    base_id,
)
from otel_generate.integrations.loop_state import device_events
from otel_generate.options import SYNCHRONIZE_EVENTS
from otel_generate.request import Request
from otel_generate.telemetry import Telemetry

#: Where a manager (and its ``OutputRouter``) keeps this package's state.
STATE_ATTR = "_otel_generate_cb"
#: How long derivation waits for the batch step that delivered an output to end, seconds.
BODY_WAIT_S = 1.0
#: How often a manager reads the wall clock again to place its monotonic times on it, nanoseconds.
OFFSET_REFRESH_NS = 10 * clock.NS_PER_S

STATE_LOCK = threading.Lock()
#: every manager state alive (for ``uninstrument()``: the requests still in flight)
_LIVE_STATES: "weakref.WeakSet[Any]" = weakref.WeakSet()


class StepMarks:
    """What the scheduler thread records at a batch step's boundary besides the clock: a CUDA
    timing event on the compute stream (``synchronize="events"`` on one CUDA device) and/or the
    energy counter (NVML). Never waits for the device; never raises (a failing event record is
    logged once and events stop; a failing energy read is the meter's)."""

    __slots__ = ("events", "meter")

    def __init__(self, events: Optional[clock.DeviceEvents], meter: Optional[energy.EnergyMeter]) -> None:
        self.events = events
        self.meter = meter

    def take(self, stream: Any = None) -> Tuple[Any, Optional[int]]:
        """``(event or None, millijoules or None)`` now; ``stream``: the compute stream, if any."""
        event = None
        events = self.events
        if events is not None:
            try:
                event = events.mark(stream)
            except Exception as fault:
                self.events = None
                log_fault_once(Fault.DEVICE_EVENTS, fault)
        meter = self.meter
        return event, (meter.read() if meter is not None else None)


def step_marks_for(telemetry: Telemetry, model: Any) -> Optional[StepMarks]:
    """The manager's :class:`StepMarks`, or ``None`` (neither events nor energy: the hooks then
    record only the clock)."""
    options = getattr(telemetry, "options", None)
    if options is None or (options.synchronize != SYNCHRONIZE_EVENTS and not options.measure_energy):
        return None
    try:
        devices = list(clock.devices_of(model))
    except Exception:  # no device to tell: the clock alone
        return None
    on_device = any(clock.device_name(device) not in ("cpu", "meta") for device in devices)
    events = device_events(devices, on_device) if options.synchronize == SYNCHRONIZE_EVENTS else None
    meter = energy.meter_for(devices) if on_device and options.measure_energy else None
    return StepMarks(events, meter) if events is not None or meter is not None else None


class ManagerState:
    """This package's records for one ``ContinuousBatchingManager``.

    Written by the submitting threads (``records``, under ``lock``) and the scheduler thread (the
    ``steps``, ``delivered`` and ``cancelled`` logs: appends only, no lock); read and emptied by
    :meth:`process` on the emitter thread (or the thread of a paged ``generate()`` call).
    """

    def __init__(self, telemetry: Telemetry, manager: Any) -> None:
        from otel_generate.integrations._routing import model_name

        self.telemetry = telemetry
        self.lock = threading.Lock()
        self.records: Dict[str, CBRecord] = {}
        self.steps: Deque[Any] = collections.deque()  # BatchLog or AsyncBatchLog
        self.delivered: Deque[Delivery] = collections.deque()
        self.cancelled: Deque[Cancel] = collections.deque()
        #: entries of ids whose ``add_request`` has not returned yet (kept only while one is running)
        self.orphan_steps: Dict[str, List[BatchStep]] = {}
        self.orphan_outputs: Dict[str, Finished] = {}
        self.orphan_first_chunks: Dict[str, int] = {}
        self.ready: List[CBRecord] = []  # finished, waiting for the batch step that delivered them to end
        self.submitting = 0
        self.timed = 0
        self.collect = False  # read by the scheduler thread: append batch steps
        self.step_number = 0
        #: the marks of each batch step's boundaries (events, energy), or ``None``
        self.marks: Optional[StepMarks] = step_marks_for(telemetry, manager.model)
        # scheduler-thread bookkeeping
        self.last_t1: Optional[int] = None
        self.last_mark: Any = None  # the marks at the last batch step's end (the next one's start)
        self.body = 0  # number of the loop iteration running (0: none)
        self.bodies = 0  # loop iterations started
        self.done = 0  # number of the last loop iteration that ended
        self.last_delivery_body = 0
        #: async mode: id(launched batch) -> the iteration that launched it (its step starts there)
        self.pending_async: Dict[int, AsyncBatchLog] = {}
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

    def wait_for_events(self, timeout_s: float = BODY_WAIT_S) -> None:
        """``synchronize="events"``: poll (``Event.query()``, no blocking wait) until the end event of
        the last batch step logged has completed, at most ``timeout_s``; the events of one stream
        complete in order, so every earlier step's have too. Runs off the scheduler thread."""
        marks = self.marks
        if marks is None or marks.events is None:
            return
        try:
            last = self.steps[-1]
        except IndexError:
            return
        entry_marks = last.marks if type(last) is BatchLog else None
        event = entry_marks[1][0] if entry_marks is not None else None
        if event is None:
            return
        deadline = time.monotonic() + timeout_s
        try:
            while not event.query() and time.monotonic() < deadline:
                time.sleep(0.0002)
        except Exception as fault:  # read again (and given up) when the steps are taken in
            log_fault_once(Fault.DEVICE_EVENTS, fault)

    def _job(self) -> None:
        self.scheduled = False
        self.wait_for_body(self.last_delivery_body)
        self.wait_for_events()
        for record, request in self.process():  # (on the emitter's thread: built at once)
            emit.hand_over(self.telemetry, record.span, request, record.profilers, context=record.context)
            time.sleep(0)  # yield the interpreter lock to the scheduler between requests

    def request_of(self, record: CBRecord, outcome: Outcome) -> Request:
        return cb_derive.request_of(record, outcome, self.model_name, self.device)

    def incomplete_request(self, record: CBRecord, now_ns: int) -> Request:
        return cb_derive.incomplete_request(record, self.model_name, self.device, now_ns)

    def process(self) -> List[Tuple[CBRecord, Request]]:
        """Take in the logs; return the finished requests to emit (paged records go to their group)."""
        finished: List[CBRecord] = []
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
                outcome = cb_derive.derive(record)
                if record.group is not None:
                    record.group.add(record, outcome)
                    continue
                request = self.request_of(record, outcome)
            except Exception as fault:
                log_fault_once(Fault.CONTINUOUS_BATCHING_ACCOUNTING, fault)
                if record.group is not None:
                    continue  # the group reports the row as missing
                # the span still ends, marked incomplete; the other requests are not affected
                request = self.incomplete_request(record, clock.monotonic_ns())
            out.append((record, request))
        return out

    def _ingest_steps(self) -> None:
        steps, records = self.steps, self.records
        while steps:
            entry = steps.popleft()
            if type(entry) is AsyncBatchLog:
                entry = self._async_step(entry)
                if entry is None:
                    continue
            number = self.step_number
            self.step_number += 1
            batch = entry.batch
            sharing = len(batch)
            start_ns, device, shares = entry.start_ns, False, None
            if entry.marks is not None:
                start_ns, device, shares = _resolve_marks(entry)
            for position, future in enumerate(batch):
                rid = future.state.request_id
                record = records.get(base_id(rid))
                step = BatchStep(
                    number,
                    start_ns,
                    entry.end_ns,
                    sharing,
                    1 if future.has_new_token else 0,
                    shares[position] if shares is not None else None,
                    device,
                )
                if record is None:
                    if self.submitting:
                        self.orphan_steps.setdefault(rid, []).append(step)
                elif record.timed:
                    record.steps.setdefault(rid, []).append(step)

    def _async_step(self, entry: AsyncBatchLog) -> Optional[BatchLog]:
        """Async batching: batch j is launched in iteration j and updated in iteration j+1; its step
        runs from the start of the first to the end of the second (steps overlap, as the work does)."""
        result = None
        if entry.updated is not None:
            opened = self.pending_async.pop(id(entry.updated), None)
            if opened is not None:
                result = BatchLog(opened.start_ns, entry.end_ns, entry.updated)
        if entry.launched is not None:
            self.pending_async[id(entry.launched)] = entry
        return result

    def _close_async(self, end_ns: int) -> None:
        """The last batches of an async run are updated after the loop: they end at that delivery."""
        for opened in list(self.pending_async.values()):
            self.steps.appendleft(BatchLog(opened.start_ns, end_ns, opened.launched))
        self.pending_async.clear()
        self._ingest_steps()

    def _ingest_deliveries(self) -> None:
        delivered, records = self.delivered, self.records
        while delivered:
            delivery = delivered.popleft()
            at, body = delivery.at_ns, delivery.body
            if not body and self.pending_async:
                self._close_async(at)
            for output in delivery.outputs:
                rid = output.request_id
                record = records.get(base_id(rid))
                if record is None:
                    if self.submitting:
                        self.orphan_first_chunks.setdefault(base_id(rid), at)
                        if output.is_finished():
                            self.orphan_outputs[rid] = Finished(at, output, body)
                    continue
                if record.streaming and record.first_chunk_ns is None and output.generated_tokens:
                    record.first_chunk_ns = at  # the first chunk handed to the streaming consumer
                if output.is_finished():
                    self._deliver(record, rid, Finished(at, output, body))

    def _deliver(self, record: CBRecord, rid: str, finished: Finished) -> None:
        if record.complete() and record in self.ready:
            return
        record.outputs[rid] = finished
        record.last_body = max(record.last_body, finished.body)
        if record.complete():
            self.ready.append(record)

    def _ingest_cancels(self) -> None:
        cancelled, records = self.cancelled, self.records
        while cancelled:
            cancel = cancelled.popleft()
            record = records.get(cancel.request_id)
            if record is None or record.complete():
                continue
            record.cancelled_ns = cancel.at_ns
            # the loop iteration running when it was cancelled may still give it a token: wait for its step
            record.last_body = max(record.last_body, cancel.body)
            self.ready.append(record)

    def register(self, record: CBRecord) -> None:
        """An accepted request (under the caller's thread): adopt what the scheduler already logged."""
        with self.lock:
            rid = record.request_id
            self.records[rid] = record
            if record.timed:
                self.timed += 1
            first_chunk = self.orphan_first_chunks.pop(rid, None)
            if record.streaming and first_chunk is not None:
                record.first_chunk_ns = first_chunk
            for key in [key for key in self.orphan_steps if base_id(key) == rid]:
                if record.timed:
                    record.steps.setdefault(key, []).extend(self.orphan_steps[key])
                del self.orphan_steps[key]
            adopted = [key for key in self.orphan_outputs if base_id(key) == rid]
            for key in adopted:
                self._deliver(record, key, self.orphan_outputs.pop(key))
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

    def drop(self, records: List[CBRecord]) -> None:
        """Forget records that will never finish (their ``generate()`` raised)."""
        with self.lock:
            for record in records:
                if self.records.get(record.request_id) is record:
                    del self.records[record.request_id]
                    if record.timed:
                        self.timed -= 1
            self.collect = bool(self.submitting or self.timed)


def _resolve_marks(entry: BatchLog) -> Tuple[int, bool, Optional[List[float]]]:
    """A batch step's marks, off the scheduler thread: ``(start_ns, device, shares)``. With both
    events completed (``query()``: never a blocking wait), the step starts its device time
    (``elapsed_time`` of its two events) before its end, ``device`` true; else its host start.
    With two energy readings in which the counter advanced, each request of the batch gets a share
    in proportion to the tokens it computed in the step (``query_length``), else ``None``."""
    (start_event, start_mj), (end_event, end_mj) = entry.marks
    start_ns, device = entry.start_ns, False
    if start_event is not None and end_event is not None:
        try:
            if end_event.query():
                start_ns, device = entry.end_ns - clock.elapsed_ns(start_event, end_event), True
        except Exception as fault:  # the step keeps its host bounds
            log_fault_once(Fault.DEVICE_EVENTS, fault)
    step_mj = energy.request_energy_mj(start_mj, end_mj)
    shares = None
    if step_mj is not None:
        shares = energy.shares_mj(step_mj, [getattr(future, "query_length", None) for future in entry.batch])
    return start_ns, device, shares


def state_of(manager: Any, telemetry: Telemetry) -> ManagerState:
    """The manager's state for this instrumentation (created on its first request)."""
    state = manager.__dict__.get(STATE_ATTR)
    if state is not None and state.telemetry is telemetry:
        return state
    with STATE_LOCK:
        state = manager.__dict__.get(STATE_ATTR)
        if state is None or state.telemetry is not telemetry:
            state = ManagerState(telemetry, manager)
            _LIVE_STATES.add(state)
            setattr(manager, STATE_ATTR, state)
            setattr(manager.output_router, STATE_ATTR, state)
    return state


def end_in_flight(telemetry: Telemetry) -> None:
    """``uninstrument()``: emit what finished, and end the spans of the requests still in flight,
    marked ``generate.steps.incomplete`` with what was recorded so far (they go on generating,
    uninstrumented). Never raises."""
    for state in list(_LIVE_STATES):
        if state.telemetry is not telemetry:
            continue
        try:
            for record, request in state.process():
                emit.hand_over(telemetry, record.span, request, record.profilers, record.context, background=False)
            with state.lock:
                pending = [r for r in state.records.values() if r.group is None]
                for record in pending:
                    del state.records[record.request_id]
                state.timed = 0
                state.collect = False
            now = clock.monotonic_ns()
            for record in pending:
                try:
                    request = state.request_of(record, cb_derive.derive(record))
                    request.incomplete, request.finish_reasons, request.end_ns = True, None, max(now, record.start_ns)
                except Exception:
                    request = state.incomplete_request(record, now)
                emit.hand_over(telemetry, record.span, request, record.profilers, record.context, background=False)
        except Exception as fault:
            log_fault_once(Fault.CONTINUOUS_BATCHING_UNINSTRUMENT, fault)


# --- paged generate(): the rows of one generate() call ---------------------------------------------


class PagedGroup:
    """The continuous-batching requests one ``generate(..., cache_implementation="paged")`` submitted:
    accounted into that call's request (:class:`~otel_generate.integrations.loop_state.Loop`)."""

    def __init__(self, loop: Any) -> None:
        self.loop = loop
        self.records: List[CBRecord] = []
        self.states: List[ManagerState] = []
        self.done: Dict[int, Outcome] = {}  # id(record) -> its outcome (``records`` keeps the record alive)
        self._lock = threading.Lock()

    def submitted(self, state: ManagerState, record: CBRecord) -> None:
        with self._lock:
            self.records.append(record)
            if state not in self.states:
                self.states.append(state)

    def add(self, record: CBRecord, outcome: Outcome) -> None:
        with self._lock:
            self.done[id(record)] = outcome

    def collect(self) -> List[Tuple[CBRecord, Optional[Outcome]]]:
        """Every row, in input order, with its outcome (``None``: it never finished)."""
        for state in self.states:
            state.wait_for_body(state.last_delivery_body)
            state.wait_for_events()
            for record, request in state.process():  # another caller's requests: not this thread's work
                emit.hand_over(state.telemetry, record.span, request, record.profilers, record.context, background=True)
        with self._lock:
            records = list(self.records)
            done = dict(self.done)
        unfinished = [record for record in records if id(record) not in done]
        for state in self.states:
            state.drop(unfinished)
        numbered = all(re.fullmatch(r"req_\d+", record.request_id) for record in records)
        if numbered:  # add_requests submits in prefix-sharing order; generate() returns req_0..req_{n-1}
            records.sort(key=lambda record: int(record.request_id[4:]))
        return [(record, done.get(id(record))) for record in records]

    def account(self, loop: Any) -> None:
        """Fill ``loop`` (steps, tokens, finish reasons, parameters) from the rows."""
        call = loop.call
        cb_derive.account_rows(loop, self.collect(), call.timed, call.request.start_ns)
