"""Continuous batching's derivation, with no model and no transformers: hand-built log entries in
(what the scheduler-thread hooks append: :class:`BatchLog`, :class:`AsyncBatchLog`,
:class:`Delivery`, :class:`Cancel`), exact :class:`~otel_generate.request.Request` fields out.

The stand-ins carry only what the hooks and the derivation read of transformers' objects: a batch
entry's ``state.request_id`` and ``has_new_token``; an output's ``request_id``, ``prompt_ids``,
``generated_tokens``, ``error`` and ``is_finished()``. Times are made-up monotonic nanoseconds.
"""

from __future__ import annotations

import sys
import types

from otel_generate import attributes as A
from otel_generate.integrations import cb_derive
from otel_generate.integrations.cb_manager import ManagerState
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
    eos_set,
)


class Future:
    """A batch entry: ``state.request_id``, ``has_new_token``."""

    def __init__(self, request_id, has_new_token=True):
        self.state = types.SimpleNamespace(request_id=request_id)
        self.has_new_token = has_new_token


class Output:
    """A ``GenerationOutput``: the fields the derivation reads."""

    def __init__(self, request_id, prompt_ids, generated_tokens, error=None, finished=True):
        self.request_id = request_id
        self.prompt_ids = list(prompt_ids)
        self.generated_tokens = list(generated_tokens)
        self.error = error
        self._finished = finished

    def is_finished(self):
        return self._finished


class Manager:
    """A ``ContinuousBatchingManager``: its model (name, device) and router; no scheduler thread."""

    def __init__(self):
        self.model = types.SimpleNamespace(name_or_path="tiny-llama", device="cpu")
        self.output_router = types.SimpleNamespace()


def new_state():
    telemetry = types.SimpleNamespace(active=True, emitter=None)
    manager = Manager()
    state = ManagerState(telemetry, manager)
    state._manager = manager  # keep the weakly referenced stand-in alive
    return state


def submit(state, request_id, start_ns, *, timed=True, sequences=1, eos=None, streaming=False, prompt=None):
    """What the ``add_request`` hook does around transformers' own call, with a hand-built record."""
    state.enter_submission()
    record = CBRecord(request_id, start_ns=start_ns, start_wall_ns=1_000_000 + start_ns, sequences=sequences)
    record.timed = timed
    record.eos = eos_set(eos)
    record.streaming = streaming
    record.input_tokens = len(prompt) if prompt is not None else None
    record.parameters = {A.GEN_AI_REQUEST_MAX_TOKENS: 2}
    state.register(record)
    return record


def finished_requests(state):
    return {record.request_id: request for record, request in state.process()}


def test_two_requests_sharing_batch_steps():
    state = new_state()
    submit(state, "req_0", 50, eos=2)
    submit(state, "req_1", 150)
    state.steps.extend(
        [
            BatchLog(100, 200, [Future("req_0", False)]),  # a prefill chunk of req_0: no token
            BatchLog(200, 300, [Future("req_0"), Future("req_1")]),
            BatchLog(300, 400, [Future("req_0"), Future("req_1")]),
        ]
    )
    state.delivered.append(Delivery(410, [Output("req_0", [1, 2, 3], [7, 2]), Output("req_1", [4, 5], [8, 9])], body=3))
    state.done = 3  # that loop iteration ended
    requests = finished_requests(state)
    assert set(requests) == {"req_0", "req_1"}
    first, second = requests["req_0"], requests["req_1"]
    assert (first.model, first.device, first.request_id) == ("tiny-llama", "cpu", "req_0")
    assert (first.start_ns, first.start_wall_ns, first.end_ns) == (50, 1_000_050, 410)
    assert first.timed and first.synchronized and not first.incomplete
    assert first.parameters == {A.GEN_AI_REQUEST_MAX_TOKENS: 2}
    assert first.step_starts_ns == [100, 200, 300] and first.step_ends_ns == [200, 300, 400]
    assert first.step_tokens == [0, 1, 1] and first.step_requests == [1, 2, 2]
    assert first.prefill_steps == 2 and first.queue_ns == 50
    assert (first.input_tokens, first.output_tokens, first.output_tokens_per_sequence) == (3, 2, [2])
    assert first.finish_reasons == [A.FINISH_REASON_STOP] and first.error is None  # 2 is its EOS
    assert second.step_starts_ns == [200, 300] and second.step_ends_ns == [300, 400]
    assert second.step_tokens == [1, 1] and second.step_requests == [2, 2]
    assert second.prefill_steps == 1 and second.queue_ns == 50
    assert (second.input_tokens, second.output_tokens) == (2, 2)
    assert second.finish_reasons == [A.FINISH_REASON_LENGTH] and second.end_ns == 410
    assert state.records == {} and not state.collect  # nothing left in flight: the hooks stop logging


def test_a_request_waits_for_the_loop_iteration_that_delivered_it():
    """Delivered during loop iteration 2, which has not ended: its last step is not logged yet."""
    state = new_state()
    state._scheduler_alive = lambda: True
    submit(state, "req_0", 0)
    state.steps.append(BatchLog(10, 20, [Future("req_0")]))
    state.delivered.append(Delivery(25, [Output("req_0", [1], [5, 6])], body=2))
    state.done = 1
    assert finished_requests(state) == {} and state.wake
    state.steps.append(BatchLog(20, 30, [Future("req_0")]))
    state.done = 2
    (request,) = finished_requests(state).values()
    assert request.step_ends_ns == [20, 30] and request.output_tokens == 2 and not request.incomplete


def test_children_of_num_return_sequences_are_one_request():
    """``req_0__child#1`` is the second sequence of ``req_0``: the steps are their union, a step
    gives a token if it gave one to either sequence."""
    state = new_state()
    submit(state, "req_0", 0, sequences=2)
    state.steps.extend(
        [
            BatchLog(10, 20, [Future("req_0", False), Future("req_0__child#1", True)]),
            BatchLog(20, 30, [Future("req_0"), Future("req_0__child#1")]),
        ]
    )
    state.delivered.append(Delivery(35, [Output("req_0__child#1", [1, 2], [4, 5])], body=0))
    assert finished_requests(state) == {}  # one sequence of two
    state.delivered.append(Delivery(40, [Output("req_0", [1, 2], [6])], body=0))
    (request,) = finished_requests(state).values()
    assert request.step_tokens == [1, 1] and request.step_requests == [2, 2]
    assert request.output_tokens_per_sequence == [1, 2] and request.output_tokens == 3
    assert request.finish_reasons == [A.FINISH_REASON_LENGTH] * 2 and request.end_ns == 40


def test_async_batch_steps_run_from_launch_to_update():
    """Async batching launches batch j in loop iteration j and applies its tokens in iteration j+1:
    its step runs from the start of the first to the end of the second; the last batch ends when it is
    delivered after the loop."""
    state = new_state()
    submit(state, "req_0", 0)
    batches = [[Future("req_0")] for _ in range(3)]
    # iteration 1 (bootstrapping) launches batch 0; iterations 2, 3 launch 1, 2 and update 0, 1
    state.steps.extend(
        [
            AsyncBatchLog(10, 20, batches[0], None),
            AsyncBatchLog(20, 30, batches[1], batches[0]),
            AsyncBatchLog(30, 40, batches[2], batches[1]),
        ]
    )
    state.delivered.append(Delivery(55, [Output("req_0", [1], [5, 6, 7])], body=0))  # the update after the loop
    (request,) = finished_requests(state).values()
    assert list(zip(request.step_starts_ns, request.step_ends_ns)) == [(10, 30), (20, 40), (30, 55)]
    assert request.step_tokens == [1, 1, 1] and request.end_ns == 55 and not request.incomplete


def test_a_cancelled_request_counts_the_steps_that_gave_it_a_token():
    state = new_state()
    submit(state, "req_0", 0, prompt=[1, 2, 3, 4])
    state.steps.extend([BatchLog(10, 20, [Future("req_0")]), BatchLog(20, 30, [Future("req_0")])])
    state.cancelled.append(Cancel(25, "req_0", body=0))
    (request,) = finished_requests(state).values()
    assert request.finish_reasons == [cb_derive.FINISH_REASON_CANCELLED] and request.error is None
    assert request.output_tokens == 2 and request.output_tokens_per_sequence == []
    assert request.input_tokens == 4  # from the submission: no output came
    assert request.end_ns == 30  # its last step ended after the cancellation


def test_a_failed_request_carries_the_error_and_no_finish_reason():
    state = new_state()
    submit(state, "req_0", 0)
    state.delivered.append(Delivery(15, [Output("req_0", [1, 2], [], error="out of blocks")], body=0))
    (request,) = finished_requests(state).values()
    assert isinstance(request.error, RuntimeError) and str(request.error) == "out of blocks"
    assert request.finish_reasons is None and request.output_tokens == 0 and request.end_ns == 15


def test_a_token_whose_step_was_not_logged_marks_the_request_incomplete():
    state = new_state()
    submit(state, "req_0", 0)
    state.steps.append(BatchLog(10, 20, [Future("req_0")]))
    state.delivered.append(Delivery(30, [Output("req_0", [1], [5, 6])], body=0))
    (request,) = finished_requests(state).values()
    assert request.incomplete and request.step_ends_ns == [20] and request.output_tokens == 2


def test_an_untimed_request_keeps_its_counts_and_no_steps():
    state = new_state()
    submit(state, "req_0", 0, timed=False)
    state.steps.append(BatchLog(10, 20, [Future("req_0")]))
    state.delivered.append(Delivery(30, [Output("req_0", [1, 2], [5])], body=0))
    (request,) = finished_requests(state).values()
    assert not request.timed and request.step_ends_ns == [] and request.step_starts_ns is None
    assert (request.input_tokens, request.output_tokens, request.end_ns) == (2, 1, 30)


def test_a_streaming_request_records_its_first_chunk():
    state = new_state()
    submit(state, "req_0", 100, streaming=True)
    state.steps.extend([BatchLog(110, 120, [Future("req_0")]), BatchLog(120, 130, [Future("req_0")])])
    state.delivered.append(Delivery(121, [Output("req_0", [1], [5], finished=False)], body=0))
    state.delivered.append(Delivery(131, [Output("req_0", [1], [5, 6])], body=0))
    (request,) = finished_requests(state).values()
    assert request.first_chunk_ns == 121 and request.end_ns == 131 and request.output_tokens == 2


def test_logs_of_a_request_whose_submission_has_not_returned_are_adopted():
    """The scheduler can run a request before ``add_request`` returns: its entries wait, then are adopted."""
    state = new_state()
    state.enter_submission()  # transformers' add_request is running
    state.steps.append(BatchLog(10, 20, [Future("req_0")]))
    state.delivered.append(Delivery(25, [Output("req_0", [1, 2], [5])], body=0))
    assert finished_requests(state) == {}
    record = CBRecord("req_0", start_ns=5, start_wall_ns=1_000_005, sequences=1)
    record.timed = True
    state.register(record)  # that submission returns: it adopts what was logged for it
    (request,) = finished_requests(state).values()
    assert request.step_ends_ns == [20] and request.queue_ns == 5 and request.end_ns == 25
    assert state.orphan_steps == {} and state.orphan_outputs == {}


# --- the pure functions, on hand-built records --------------------------------------------------------


def test_derive_and_request_of_on_a_hand_built_record():
    record = CBRecord("req_3", start_ns=1000, start_wall_ns=5_000, sequences=1)
    record.timed = True
    record.eos = eos_set([9, -1])
    record.steps = {"req_3": [BatchStep(7, 900, 1100, 3, 0), BatchStep(8, 1100, 1200, 4, 1)]}
    record.outputs = {"req_3": Finished(1250, Output("req_3", [1, 2, 3], [9]), body=8)}
    outcome = cb_derive.derive(record)
    assert outcome == Outcome(
        steps=[BatchStep(7, 900, 1100, 3, 0), BatchStep(8, 1100, 1200, 4, 1)],
        input_tokens=3,
        per_sequence=[1],
        finish_reasons=[A.FINISH_REASON_STOP],
        error=None,
        end_ns=1250,
        complete=True,
    )
    request = cb_derive.request_of(record, outcome, "m", None)
    assert request.step_starts_ns == [1000, 1100]  # a step that began before the submission is clamped to it
    assert request.step_ends_ns == [1100, 1200] and request.queue_ns == 0 and request.prefill_steps == 2
    assert (request.model, request.device, request.start_wall_ns, request.end_ns) == ("m", None, 5_000, 1250)


def test_request_of_without_any_end_ends_at_now():
    record = CBRecord("req_0", start_ns=100, start_wall_ns=0, sequences=1)
    outcome = cb_derive.derive(record)
    assert outcome.end_ns is None
    assert cb_derive.request_of(record, outcome, "m", "cpu", now_ns=90).end_ns == 100  # never before the start
    assert cb_derive.request_of(record, outcome, "m", "cpu", now_ns=400).end_ns == 400
    incomplete = cb_derive.incomplete_request(record, "m", "cpu", 300)
    assert incomplete.incomplete and incomplete.end_ns == 300 and incomplete.request_id == "req_0"


def test_account_rows_counts_a_shared_step_once():
    """The rows of one paged ``generate()`` call: one request, steps shared by rows counted once."""
    first = CBRecord("req_0", 0, 0, 1)
    first.parameters = {A.GEN_AI_REQUEST_MAX_TOKENS: 2, A.GEN_AI_REQUEST_STREAM: True}
    second, lost = CBRecord("req_1", 0, 0, 1), CBRecord("req_2", 0, 0, 1)
    lost.input_tokens = 7
    shared = [BatchStep(0, 10, 20, 2, 1), BatchStep(1, 20, 30, 2, 1)]
    rows = [
        (first, Outcome(shared, 3, [2], [A.FINISH_REASON_LENGTH], None, 30, True)),
        (second, Outcome([BatchStep(0, 10, 20, 2, 0), shared[1]], 4, [1], [A.FINISH_REASON_STOP], None, 30, True)),
        (lost, None),
    ]
    loop = types.SimpleNamespace()
    cb_derive.account_rows(loop, rows, timed=True, start_ns=5)
    assert loop.parameters == {A.GEN_AI_REQUEST_MAX_TOKENS: 2, A.GENERATE_BATCH_SIZE: 3}
    assert loop.step_starts_ns == [10, 20] and loop.step_ends_ns == [20, 30] and loop.step_tokens == [1, 1]
    assert loop.queue_ns == 5 and loop.prefill_steps == 1 and loop.incomplete  # one row never finished
    assert (loop.input_tokens, loop.output_tokens, loop.per_sequence) == (14, 3, [2, 1])
    assert loop.finish_reasons == [A.FINISH_REASON_LENGTH, A.FINISH_REASON_STOP]


def test_record_helpers():
    assert base_id("req_4__child#2") == "req_4" and base_id("req_4") == "req_4"
    assert eos_set(None) == frozenset() and eos_set(-1) == frozenset() and eos_set([2, 3]) == {2, 3}


def test_no_transformers_needed():
    """These modules run without transformers (or torch) imported by them."""
    import subprocess

    code = (
        "import sys; import otel_generate.integrations.cb_manager, otel_generate.integrations.cb_derive; "
        "print('transformers' in sys.modules, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


# --- device time and energy of batch steps (marks) --------------------------------------------------


class Event:
    """A completed CUDA timing event at ``device_ms``; logs who asked it what."""

    def __init__(self, device_ms, log, done=True):
        self.device_ms, self.log, self.done = device_ms, log, done

    def query(self):
        self.log.append("query")
        return self.done

    def elapsed_time(self, end):
        self.log.append("elapsed_time")
        return end.device_ms - self.device_ms

    def synchronize(self):  # pragma: no cover - never called: the test fails if it is
        raise AssertionError("a blocking wait off the scheduler thread's logs")


def computing(request_id, query_length, has_new_token=True):
    future = Future(request_id, has_new_token)
    future.query_length = query_length
    return future


def test_batch_step_energy_is_shared_by_tokens_computed_and_device_time_read_from_completed_events():
    state = new_state()
    submit(state, "req_0", 500_000, prompt=[1, 2, 3, 4, 5])
    submit(state, "req_1", 600_000, prompt=[6, 7, 8])
    log = []
    events = [Event(ms, log) for ms in (0.0, 0.0625, 0.09375, 0.125)]
    readings = [10_000, 10_800, 11_150, 11_500]  # millijoules at each boundary
    marks = [(event, mj) for event, mj in zip(events, readings)]
    state.steps.extend(
        [
            # both prompts prefilled: 5 and 3 tokens computed, 800 mJ
            BatchLog(10**6, 2 * 10**6, [computing("req_0", 5), computing("req_1", 3)], (marks[0], marks[1])),
            BatchLog(2 * 10**6, 3 * 10**6, [computing("req_0", 1), computing("req_1", 1)], (marks[1], marks[2])),
            BatchLog(3 * 10**6, 4 * 10**6, [computing("req_0", 1)], (marks[2], marks[3])),  # req_0 alone
        ]
    )
    state.delivered.append(
        Delivery(4_100_000, [Output("req_0", [1, 2, 3, 4, 5], [7, 8, 9]), Output("req_1", [6, 7, 8], [8, 9])], body=3)
    )
    state.done = 3
    requests = finished_requests(state)
    first, second = requests["req_0"], requests["req_1"]
    assert first.step_energy_mj == [500.0, 175.0, 350.0] and first.energy_mj == 1025.0
    assert second.step_energy_mj == [300.0, 175.0] and second.energy_mj == 475.0
    assert first.energy_mj + second.energy_mj == readings[-1] - readings[0]  # every batch step's energy, shared
    # device time: each step starts its events' elapsed time before its (host) end
    assert first.step_ends_ns == [2 * 10**6, 3 * 10**6, 4 * 10**6]
    assert first.step_starts_ns == [2 * 10**6 - 62_500, 3 * 10**6 - 31_250, 4 * 10**6 - 31_250]
    assert first.clock == second.clock == A.CLOCK_DEVICE
    assert "query" in log and log.count("elapsed_time") == 3


def test_batch_steps_without_an_energy_or_event_answer_keep_host_time_and_give_no_energy():
    state = new_state()
    submit(state, "req_0", 0)
    log = []
    running = Event(0.5, log, done=False)  # not completed yet: its time is not read
    state.steps.extend(
        [
            BatchLog(10**6, 2 * 10**6, [computing("req_0", 2)], ((Event(0.0, log), 100), (running, 100))),  # stalled
            BatchLog(2 * 10**6, 3 * 10**6, [computing("req_0", 1)], ((running, 100), (Event(1.0, log), 900))),
        ]
    )
    state.delivered.append(Delivery(3_500_000, [Output("req_0", [1, 2], [5, 6])], body=2))
    state.done = 2
    (request,) = finished_requests(state).values()
    # the first step's end event had not completed: host bounds; the second's had: its device time
    assert request.step_starts_ns == [10**6, 3 * 10**6 - 500_000] and request.step_ends_ns == [2 * 10**6, 3 * 10**6]
    assert request.clock is None  # not every step is device time
    assert request.energy_mj is None and request.step_energy_mj is None  # one step's energy is unknown


def test_no_query_length_gives_no_energy_shares():
    state = new_state()
    submit(state, "req_0", 0)
    log = []
    state.steps.append(BatchLog(10, 20, [Future("req_0")], ((Event(0.0, log), 100), (Event(0.1, log), 200))))
    state.delivered.append(Delivery(25, [Output("req_0", [1], [5])], body=1))
    state.done = 1
    (request,) = finished_requests(state).values()
    assert request.energy_mj is None and request.clock == A.CLOCK_DEVICE


def test_children_share_a_step_their_energies_add_up():
    record = CBRecord("req_0", start_ns=0, start_wall_ns=0, sequences=2)
    record.timed = True
    record.steps = {
        "req_0": [BatchStep(0, 10, 20, 2, 1, 30.0), BatchStep(1, 20, 30, 2, 1, 20.0)],
        "req_0__child#1": [BatchStep(0, 10, 20, 2, 1, 30.0), BatchStep(1, 20, 30, 2, 1, 20.0)],
    }
    record.outputs = {
        "req_0": Finished(35, Output("req_0", [1], [5, 6]), 2),
        "req_0__child#1": Finished(35, Output("req_0__child#1", [1], [7, 8]), 2),
    }
    request = cb_derive.request_of(record, cb_derive.derive(record), "m", "cuda:0")
    assert request.step_energy_mj == [60.0, 40.0] and request.energy_mj == 100.0
