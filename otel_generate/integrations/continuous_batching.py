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
  of a :class:`~.cb_records.BatchLog` (start, end, the batch's list of requests; an
  :class:`~.cb_records.AsyncBatchLog` in async mode). No device synchronization: transformers has
  already waited for the device before the body returns (sync mode: the compute stream's
  ``synchronize()`` and the ``.tolist()`` of the new tokens; async mode: the device-to-host
  event of the batch it updates). In sync mode, with ``synchronize="events"`` on one CUDA device
  or with NVML's energy counter (:mod:`otel_generate.energy`), each batch step's boundaries also
  record a CUDA timing event on the compute stream and/or read the counter (a
  :class:`~.cb_manager.StepMarks`, ``BatchLog.marks``); the events are read off this thread,
  once they have completed (``Event.query()``), never waited for here.
* ``OutputRouter.deliver`` / ``deliver_batch`` (the scheduler thread, when outputs are handed
  over): one append of a :class:`~.cb_records.Delivery` (clock, outputs, loop iteration), and the
  background emitter is woken (at most one job pending per manager).
* ``ContinuousBatchingManager.cancel_request`` (the caller): a cancelled request never produces
  an output; its span ends with finish reason ``cancelled`` (not an error, :mod:`otel_generate.cancellation`)
  after the batch step running at that moment, counting the batch steps that gave it a token
  (one :class:`~.cb_records.Cancel` appended).

Derivation, on the :class:`~otel_generate.background.BackgroundEmitter`'s thread: which batch
steps each request took part in (``prefill`` chunks with no token, the step that produced its
first token, then one ``decode`` per token), the requests sharing each step, the queue time,
tokens, finish reasons and a streaming request's time to first chunk (the first delivered output
with generated tokens); then :func:`otel_generate.emit.hand_over` builds the spans and records the
metrics. The scheduler thread never builds a span nor records a metric.

A ``generate(..., cache_implementation="paged")`` call hands its rows to ``generate_batch``: the
requests it submits are accounted into that one ``generate()`` request (:class:`PagedGroup`),
not given spans of their own.

The modules, one job each: :mod:`.cb_records` (the named log entries and the per-request record),
this one (the patch points and the hooks: the producer), :mod:`.cb_manager` (the per-manager state
that takes the logs in, off the scheduler thread) and :mod:`.cb_derive` (a finished record into a
:class:`~otel_generate.request.Request`: pure).
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any, Callable, Dict

from opentelemetry import context as otel_context
from opentelemetry.instrumentation.utils import is_instrumentation_enabled

from otel_generate import attributes as A
from otel_generate import clock, emit, ranks
from otel_generate._faults import LOGGER_NAME, Fault, log_fault_once
from otel_generate.integrations._routing import _ACTIVE, _NESTED, response_id, strategy_of
from otel_generate.integrations.cb_manager import (
    STATE_ATTR,
    ManagerState,
    PagedGroup,
    end_in_flight,
    state_of,
)
from otel_generate.integrations.cb_records import (
    CHILD_SEPARATOR,
    FINISH_REASON_CANCELLED,
    AsyncBatchLog,
    BatchLog,
    Cancel,
    CBRecord,
    Delivery,
    eos_set,
    new_entry,
)
from otel_generate.integrations.loop_state import Call, Loop
from otel_generate.telemetry import Telemetry

__all__ = [
    "CHILD_SEPARATOR",
    "FINISH_REASON_CANCELLED",
    "STATE_ATTR",
    "PagedGroup",
    "end_in_flight",
    "state_of",
]

_LOG = logging.getLogger(LOGGER_NAME)

# --- the paged generate() group a submission belongs to ----------------------------------------------


def _paged_group(manager: Any) -> Any:
    """The :class:`PagedGroup` a request submitted now belongs to; ``None`` (a request of its own);
    or ``False``: inside a step of a running ``generate()`` loop (not traced)."""
    frame = _ACTIVE.get()
    if frame is None:
        return None
    if frame is _NESTED:
        return False
    model = getattr(manager, "model", None)
    if isinstance(frame, Loop):
        if frame.running:
            return False
        if frame.closed or not frame.call.owns(model):
            return None
        loop = frame
    elif isinstance(frame, Call):
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


def make_add_request(original: Callable, telemetry: Telemetry) -> Callable:
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
            log_fault_once(Fault.CONTINUOUS_BATCHING_SUBMIT, fault)
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
            record.response_id = response_id(context)  # transformers serve 5.25+: the id its client receives
            record.context = context
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
            log_fault_once(Fault.CONTINUOUS_BATCHING_SUBMIT, fault)
        return request_id

    return add_request


def _record(
    telemetry: Telemetry,
    manager: Any,
    signature: inspect.Signature,
    args: tuple,
    kwargs: dict,
    request_id: str,
    start_ns: int,
    start_wall_ns: int,
) -> CBRecord:
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
    record = CBRecord(str(request_id), start_ns, start_wall_ns, sequences)
    record.eos = eos_set(eos)
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


def make_generation_loop_body(original: Callable, telemetry: Telemetry) -> Callable:
    """``ContinuousBatchingManager._generation_loop_body``: one loop iteration; logs its batch step."""

    @functools.wraps(original)
    def _generation_loop_body(self, *args, **kwargs):
        state = self.__dict__.get(STATE_ATTR)
        if state is None or state.telemetry is not telemetry or not telemetry.active:
            return original(self, *args, **kwargs)
        before = self.current_batch
        start = state.last_t1
        start_mark = state.last_mark  # (the previous step's end, when this one follows it)
        if start is None:
            start = clock.monotonic_ns()
            marks = state.marks
            # (whether or not a timed request is in flight yet: one may be scheduled in this body)
            if marks is not None:
                start_mark = marks.take(_compute_stream(self, args, kwargs))
        body = state.bodies + 1
        state.bodies = body
        state.body = body
        try:
            result = original(self, *args, **kwargs)
        except BaseException:
            state.last_t1 = state.last_mark = None
            state.body = 0
            state.done = body
            raise
        if self.current_batch != before:
            end = clock.monotonic_ns()
            state.last_t1 = end
            state.last_mark = None
            if state.collect:
                try:
                    _log_step(state, self, args, kwargs, start, end, start_mark)
                except Exception as fault:
                    log_fault_once(Fault.CONTINUOUS_BATCHING_STEP, fault)
        else:
            state.last_t1 = state.last_mark = None
        state.body = 0
        state.done = body
        if state.wake:
            state.wake = False
            state.trigger()
        return result

    return _generation_loop_body


def _compute_stream(manager: Any, args: tuple, kwargs: dict) -> Any:
    """The stream continuous batching computes on (``None``: the device's current stream)."""
    processor = args[0] if args else kwargs.get("batch_processor", getattr(manager, "batch_processor", None))
    return getattr(getattr(processor, "inputs_and_outputs", None), "compute_stream", None)


def _log_step(
    state: ManagerState, manager: Any, args: tuple, kwargs: dict, start: int, end: int, start_mark: Any = None
) -> None:
    processor = args[0] if args else kwargs.get("batch_processor", manager.batch_processor)
    io = processor.inputs_and_outputs
    batch = getattr(io, "requests_in_batch", None)
    if batch is not None:  # sync mode: the batch this iteration ran and updated
        marks = state.marks
        entry_marks = None
        if marks is not None:  # (transformers has waited for the device: the end mark follows the step's work)
            end_mark = state.last_mark = marks.take(getattr(io, "compute_stream", None))
            if start_mark is not None:
                entry_marks = (start_mark, end_mark)
        state.steps.append(new_entry(BatchLog, (start, end, batch, entry_marks)))
        return
    # async mode: this iteration launched one batch and updated the previous one
    bootstrapping = args[1] if len(args) > 1 else kwargs.get("bootstrapping", False)
    pairs, current = io.io_pairs, io.current_pair
    launched = pairs[1 - current].host_io.requests_in_batch
    updated = None if bootstrapping else pairs[current].host_io.requests_in_batch
    state.steps.append(new_entry(AsyncBatchLog, (start, end, launched, updated)))


def _make_deliver(original: Callable, telemetry: Telemetry, single: bool) -> Callable:
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
                state.delivered.append(
                    new_entry(Delivery, (clock.monotonic_ns(), [outputs] if single else outputs, body))
                )
                state.last_delivery_body = body
                state.trigger()  # before the caller can see the output: a flush then waits for its span
            except Exception as fault:
                log_fault_once(Fault.CONTINUOUS_BATCHING_DELIVERY, fault)
        return original(self, *args, **kwargs)

    return deliver


def make_deliver(original: Callable, telemetry: Telemetry) -> Callable:
    """``OutputRouter.deliver``: one output handed over (a failure, a streamed token)."""
    return _make_deliver(original, telemetry, single=True)


def make_deliver_batch(original: Callable, telemetry: Telemetry) -> Callable:
    """``OutputRouter.deliver_batch``: the outputs of one batch step."""
    return _make_deliver(original, telemetry, single=False)


def make_cancel_request(original: Callable, telemetry: Telemetry) -> Callable:
    """``ContinuousBatchingManager.cancel_request``: the request will never deliver an output."""

    @functools.wraps(original)
    def cancel_request(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        state = self.__dict__.get(STATE_ATTR)
        if state is not None and state.telemetry is telemetry and telemetry.active:
            try:
                request_id = args[0] if args else kwargs.get("request_id")
                if request_id in state.records:
                    state.cancelled.append(Cancel(clock.monotonic_ns(), request_id, state.body))
                    state.trigger()
            except Exception as fault:
                log_fault_once(Fault.CONTINUOUS_BATCHING_CANCEL, fault)
        return result

    return cancel_request
