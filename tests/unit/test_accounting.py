"""The pure accounting of a ``generate()`` request (:mod:`otel_generate.integrations.accounting`) on
hand-built loops: recorded steps and result tensors in, a :class:`~otel_generate.request.Request`'s
numbers out. No model, no transformers: the step recorder, the call and the generation config are
plain objects with the fields the hooks fill."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import torch

from otel_generate import attributes as A
from otel_generate.derive import step_starts_ns
from otel_generate.integrations import accounting
from otel_generate.integrations.loop_state import Loop
from otel_generate.request import Request

EOS, PAD = 9, 0
PROMPT = [[11, 12, 13], [14, 15, 16]]
START_NS = 1_000


def config(**values):
    """A GenerationConfig's fields the accounting reads (greedy unless told)."""
    fields = dict(eos_token_id=EOS, pad_token_id=PAD, max_new_tokens=4, max_length=None, num_beams=1, do_sample=False)
    fields.update(values)
    return SimpleNamespace(**fields)


def make_call(timed=True, active=True, model=None, **fields):
    request = Request(model="tiny", start_ns=START_NS, start_wall_ns=10_000_000_000, timed=timed)
    request.end_ns = START_NS + 10_000
    call = SimpleNamespace(
        request=request,
        loops=[],
        timed=timed,
        telemetry=SimpleNamespace(active=active),
        custom_generate=None,
        outer=False,
        model=model if model is not None else object(),
        streamer=None,
        detailed=False,
        kwargs={},
        args=(),
    )
    call.__dict__.update(fields)
    return call


def make_loop(call, sequences, generation_config, steps=None, done=None, kwargs=None, prompt_length=3, model=None):
    """A closed loop that returned ``sequences``; ``steps``: the sequence length after each step."""
    loop = Loop(call, model if model is not None else call.model, kwargs or {}, implicit=False, start_ns=START_NS)
    loop.generation_config = generation_config
    loop.prompt_length = prompt_length
    loop.inputs_tensor = torch.tensor(PROMPT[: sequences.shape[0]])
    loop.model_input_name = "input_ids"
    if steps is not None:
        loop.recorder = SimpleNamespace(
            times_ns=[START_NS + 100 * (i + 1) for i in range(len(steps))],
            lengths=list(steps),
            done=list(done or []),
            fault=None,
            implied_lengths=False,
            step_lengths=lambda: list(steps),
        )
        loop.criteria = None  # no StopStringCriteria or MaxTimeCriteria
    loop.close(sequences, read_clock=False)
    loop.end_ns = START_NS + 5_000
    call.loops.append(loop)
    return loop


def test_greedy_counts_each_row_to_its_stop_step_and_reasons():
    # row 0: EOS at step 2, then padding; row 1: the whole budget of 4
    sequences = torch.tensor([PROMPT[0] + [5, EOS, PAD, PAD], PROMPT[1] + [5, 6, 7, 8]])
    done = [torch.tensor(d) for d in ([False, False], [True, False], [True, False], [True, True])]
    call = make_call()
    make_loop(call, sequences, config(), steps=[4, 5, 6, 7], done=done)

    loops = accounting.account_call(call, sequences, None)

    request = call.request
    assert len(loops) == 1
    assert request.output_tokens_per_sequence == [2, 4]
    assert request.output_tokens == 6
    assert request.finish_reasons == [A.FINISH_REASON_STOP, A.FINISH_REASON_LENGTH]
    assert request.input_tokens == 6  # no pad id in the prompt
    assert request.step_tokens == [1, 1, 1, 1]
    assert request.step_ends_ns == [START_NS + 100, START_NS + 200, START_NS + 300, START_NS + 400]
    # one loop started with the request: no explicit starts, each step starts where the last ended
    assert request.step_starts_ns is None
    assert step_starts_ns(request) == [START_NS, START_NS + 100, START_NS + 200, START_NS + 300]
    assert request.parameters[A.GENERATE_STRATEGY] == A.STRATEGY_GREEDY
    assert request.parameters[A.GEN_AI_REQUEST_MAX_TOKENS] == 4
    assert request.parameters[A.GENERATE_BATCH_SIZE] == 2
    assert request.incomplete is False and request.unobserved is None


def test_a_real_pad_token_is_counted_when_the_step_data_says_the_row_ran_on():
    # the model generated the pad id as a real token (no EOS): the tensor alone would strip it
    sequences = torch.tensor([PROMPT[0] + [5, 6, PAD, PAD]])
    done = [torch.tensor([False])] * 3 + [torch.tensor([True])]
    call = make_call()
    make_loop(call, sequences, config(), steps=[4, 5, 6, 7], done=done)

    accounting.account_call(call, sequences, None)

    assert call.request.output_tokens_per_sequence == [4]
    assert call.request.finish_reasons == [A.FINISH_REASON_LENGTH]
    # without step data the trailing pad ids read as padding written after a stop
    untimed = make_call(timed=False)
    make_loop(untimed, sequences, config())
    accounting.account_call(untimed, sequences, None)
    assert untimed.request.output_tokens_per_sequence == [2]


def test_beams_keep_trailing_pad_ids_without_eos():
    # beam search pads only after an EOS: a beam without EOS ending in pad ids used its budget
    sequences = torch.tensor([PROMPT[0] + [5, PAD, PAD], PROMPT[0] + [6, EOS, PAD]])
    call = make_call()
    make_loop(call, sequences, config(num_beams=2, max_new_tokens=3), steps=[4, 5, 6])

    accounting.account_call(call, sequences, None)

    assert call.request.output_tokens_per_sequence == [3, 2]
    assert call.request.finish_reasons == [A.FINISH_REASON_LENGTH, A.FINISH_REASON_STOP]
    assert call.request.parameters[A.GENERATE_STRATEGY] == A.STRATEGY_BEAM_SEARCH
    assert call.request.parameters[A.GENERATE_NUM_BEAMS] == 2


def test_steps_transformers_undid_are_dropped():
    # MPS's deferred stop check: the recorder saw a step (length 7) the output does not contain
    sequences = torch.tensor([PROMPT[0] + [5, 6, EOS]])
    done = [torch.tensor([False]), torch.tensor([False]), torch.tensor([True]), torch.tensor([True])]
    call = make_call()
    make_loop(call, sequences, config(), steps=[4, 5, 6, 7], done=done)

    accounting.account_call(call, sequences, None)

    assert call.request.step_tokens == [1, 1, 1]
    assert len(call.request.step_ends_ns) == 3
    assert call.request.output_tokens == 3
    assert call.request.finish_reasons == [A.FINISH_REASON_STOP]


def _implied(loop, steps):
    """The loop's recorder as the plain path leaves it with one token a step: times only."""
    recorder = loop.recorder
    recorder.lengths, recorder.implied_lengths = [], True
    recorder.step_lengths = lambda: list(range(loop.prompt_length + 1, loop.prompt_length + 1 + steps))


def test_implied_lengths_one_token_a_step_give_the_tokens_of_read_ones():
    sequences = torch.tensor([PROMPT[0] + [5, 6, 7, 8]])
    call = make_call()
    loop = make_loop(call, sequences, config(eos_token_id=None), steps=[4, 5, 6, 7])
    _implied(loop, 4)

    accounting.account_call(call, sequences, None)

    assert call.request.step_tokens == [1, 1, 1, 1] and len(call.request.step_ends_ns) == 4
    assert call.request.output_tokens == 4 and not call.request.incomplete


def test_implied_lengths_a_wider_output_marks_the_request_incomplete(caplog):
    # two tokens appended at one of the 3 recorded steps: 3 implied, 4 returned
    sequences = torch.tensor([PROMPT[0] + [5, 6, 7, 8]])
    call = make_call()
    loop = make_loop(call, sequences, config(eos_token_id=None), steps=[4, 5, 7])
    _implied(loop, 3)

    accounting.account_call(call, sequences, None)

    assert call.request.incomplete is True
    assert call.request.output_tokens == 4  # counted from the tensor, as always


def test_implied_lengths_after_a_step_hook_fault_log_no_second_fault(caplog):
    # the recorder stopped at its 2nd step (a fault): fewer steps than the output, as any fault leaves
    sequences = torch.tensor([PROMPT[0] + [5, 6, 7, 8]])
    call = make_call()
    loop = make_loop(call, sequences, config(eos_token_id=None), steps=[4, 5])
    _implied(loop, 2)
    loop.recorder.fault = RuntimeError("the clock raised")

    accounting.account_call(call, sequences, None)

    assert "implied step lengths" not in caplog.text
    assert call.request.step_tokens == [1, 1]


def test_max_length_gives_the_budget_and_sampling_its_parameters():
    sequences = torch.tensor([PROMPT[0] + [5, 6]])
    call = make_call()
    cfg = config(max_new_tokens=None, max_length=5, do_sample=True, temperature=0.7, top_p=0.9, top_k=5)
    make_loop(call, sequences, cfg, steps=[4, 5], done=[torch.tensor([False]), torch.tensor([True])])

    accounting.account_call(call, sequences, None)

    params = call.request.parameters
    assert params[A.GEN_AI_REQUEST_MAX_TOKENS] == 2
    assert params[A.GENERATE_STRATEGY] == A.STRATEGY_SAMPLE
    assert (params[A.GEN_AI_REQUEST_TEMPERATURE], params[A.GEN_AI_REQUEST_TOP_P]) == (0.7, 0.9)
    assert params[A.GEN_AI_REQUEST_TOP_K] == 5.0 and isinstance(params[A.GEN_AI_REQUEST_TOP_K], float)
    assert call.request.finish_reasons == [A.FINISH_REASON_LENGTH]


def test_a_missing_stopping_criteria_hook_marks_the_request():
    sequences = torch.tensor([PROMPT[0] + [5, EOS]])
    call = make_call()
    make_loop(call, sequences, config())  # no recorder: _get_stopping_criteria's hook never ran
    accounting.account_call(call, sequences, None)
    assert call.request.incomplete is True and call.request.uninstrumented is False
    assert call.request.output_tokens == 2  # still counted from the tensor

    # the same after uninstrument() removed the hooks: uninstrumented, not a fault
    gone = make_call(active=False)
    make_loop(gone, sequences, config())
    accounting.account_call(gone, sequences, None)
    assert gone.request.uninstrumented is True and gone.request.incomplete is False


class _StopAtNine:
    """Stands for a ``StopStringCriteria``: a row is done when its last token is 9."""

    def __call__(self, sequences, scores):
        return sequences[:, -1] == 9


def test_a_stop_string_on_the_last_budget_position_is_stop():
    # both rows used the whole budget of 2; row 0's last token completes the stop string
    sequences = torch.tensor([PROMPT[0] + [5, 9], PROMPT[1] + [5, 6]])
    counts = [2, 2]
    stopped = accounting.rows_at_a_stop_string([_StopAtNine()], sequences, 3, counts, 2)
    assert stopped == [0]
    assert accounting.rows_at_a_stop_string([], sequences, 3, counts, 2) == []
    assert accounting.rows_at_a_stop_string([_StopAtNine()], sequences, 3, counts, None) == []
    # a row that ended before its budget is not the stop string's to claim here
    assert accounting.rows_at_a_stop_string([_StopAtNine()], sequences, 3, [1, 2], 2) == []
    # unless max_time may have ended it at the last step (running): then the stop string did
    assert accounting.rows_at_a_stop_string([_StopAtNine()], sequences, 3, counts, None, running=[0, 1]) == stopped
    assert accounting.rows_at_a_stop_string([_StopAtNine()], sequences, 3, counts, 5, running=[0]) == stopped
    from otel_generate.tokens import finish_reasons

    assert finish_reasons(sequences, 3, counts, 2, eos_token_id=None, stopped_rows=stopped) == [
        A.FINISH_REASON_STOP,
        A.FINISH_REASON_LENGTH,
    ]


def test_max_time_ends_the_rows_still_running_at_a_late_last_step():
    lengths = [4, 5, 6]  # prompt 3: the last step brought the rows still running to 3 tokens
    counts = [1, 3, 3]
    assert accounting.rows_out_of_time(12.5, [12.0], lengths, 3, counts) == [1, 2]
    assert accounting.rows_out_of_time(12.0, [12.0], lengths, 3, counts) == []  # not past the deadline
    assert accounting.rows_out_of_time(12.5, [13.0, 12.0], lengths, 3, counts) == [1, 2]  # the earliest
    assert accounting.rows_out_of_time(None, [12.0], lengths, 3, counts) == []
    assert accounting.rows_out_of_time(12.5, [], lengths, 3, counts) == []
    # only the criteria generate() builds: the rows still running at the last step, whatever the
    # step's converted time reads (the wall clock may have been stepped during the request)
    assert accounting.rows_out_of_time(11.9, [12.0], lengths, 3, counts, own_criteria_only=True) == [1, 2]
    assert accounting.rows_out_of_time(None, [12.0], lengths, 3, counts, own_criteria_only=True) == [1, 2]
    assert accounting.rows_out_of_time(11.9, [], lengths, 3, counts, own_criteria_only=True) == []
    from otel_generate.tokens import finish_reasons

    sequences = torch.tensor([PROMPT[0] + [EOS, PAD, PAD], PROMPT[1] + [5, 6, 7], PROMPT[1] + [5, 6, 7]])
    assert finish_reasons(sequences, 3, counts, 10, EOS, budget_rows=[1, 2]) == [
        A.FINISH_REASON_STOP,
        A.FINISH_REASON_LENGTH,
        A.FINISH_REASON_LENGTH,
    ]


class _Window:
    """Stands for Whisper's window: attempt 0 kept row 0 and sent row 1 (original row 7) on."""

    def __init__(self, kept):
        self.kept = kept

    def attributes(self, loop):
        attempt = loop.call.loops.index(loop)
        rows = [3, 7] if attempt == 0 else [7]
        return {A.GENERATE_ATTEMPT_ROWS: rows, A.GENERATE_ATTEMPT_INDEX: attempt}, self.kept[attempt]


def test_several_loops_sum_tokens_count_discarded_rows_and_take_each_rows_kept_reason():
    call = make_call(outer=True)
    first = make_loop(
        call,
        torch.tensor([PROMPT[0] + [5, EOS], PROMPT[1] + [5, 6]]),
        config(max_new_tokens=2),
        steps=[4, 5],
        done=[torch.tensor([False, False]), torch.tensor([True, True])],
    )
    second = make_loop(
        call,
        torch.tensor([PROMPT[1] + [5, 6]]),
        config(max_new_tokens=2),
        steps=[4, 5],
        done=[torch.tensor([False]), torch.tensor([True])],
    )
    window = _Window(kept=[{0}, {0}])
    first.window = second.window = window

    accounting.account_call(call, None, None)

    request = call.request
    assert request.output_tokens == 4 + 2
    assert request.discarded_output_tokens == 2  # attempt 0's row 1 went on to attempt 1
    # original row 3 ended by EOS in attempt 0, row 7 by the budget in attempt 1
    assert request.finish_reasons == [A.FINISH_REASON_STOP, A.FINISH_REASON_LENGTH]
    assert [c.first_step for c in request.calls] == [0, 2] and [c.steps for c in request.calls] == [2, 2]
    assert [c.output_tokens for c in request.calls] == [4, 2]
    assert request.calls[1].attributes[A.GENERATE_ATTEMPT_INDEX] == 1
    assert request.step_tokens == [1, 1, 1, 1]
    assert request.step_starts_ns == [START_NS, START_NS + 100, START_NS, START_NS + 100]


def test_a_call_whose_loop_was_not_seen_counts_from_its_input_and_output():
    prompt = torch.tensor([[PAD, 12, 13], [14, 15, 16]])
    output = torch.cat([prompt, torch.tensor([[5, EOS, PAD], [5, 6, 7]])], dim=1)
    model = SimpleNamespace(config=SimpleNamespace(is_encoder_decoder=False), generation_config=config())
    call = make_call(model=model, custom_generate="my/repo", kwargs={"input_ids": prompt, "max_new_tokens": 3})
    call.user_generation_config = lambda: model.generation_config

    loops = accounting.account_call(call, output, None)

    request = call.request
    assert loops == []
    assert request.unobserved == A.UNOBSERVED_CUSTOM_GENERATE
    assert request.parameters[A.GENERATE_CUSTOM_GENERATE] == "my/repo"
    assert request.input_tokens == 5  # the left pad is not a token
    assert request.output_tokens_per_sequence == [2, 3] and request.output_tokens == 5
    assert request.finish_reasons == [A.FINISH_REASON_STOP, A.FINISH_REASON_LENGTH]
    assert request.parameters[A.GEN_AI_REQUEST_MAX_TOKENS] == 3


def test_a_cancelled_call_has_one_cancelled_reason_per_row_and_the_steps_tokens():
    cancelled = type("_GenerationCancelled", (Exception,), {"__module__": "transformers.cli.serving.utils"})
    call = make_call()
    loop = make_loop(call, torch.tensor([PROMPT[0] + [5, 6]]), config(), steps=[4, 5])
    loop.result = None  # it raised: no result
    exc = cancelled()
    call.request.error = exc

    accounting.account_call(call, None, exc)

    assert call.request.error is None
    assert call.request.finish_reasons == [A.FINISH_REASON_CANCELLED]
    assert call.request.output_tokens == 2 and call.request.output_tokens_per_sequence == [2]


def test_accounting_imports_no_transformers():
    code = (
        "import sys; import otel_generate.integrations.accounting, otel_generate.integrations.loop_state; "
        "print('transformers' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_step_tokens_are_the_differences_of_the_lengths_seen():
    import random

    from otel_generate.tokens import step_tokens

    rng = random.Random(3)
    for _ in range(500):
        prompt = rng.randint(0, 6)
        lengths, length = [], prompt
        for _ in range(rng.randint(0, 9)):
            length += rng.choice((1, 1, 1, 0, 2, 5))
            lengths.append(length)
        expected = [after - before for before, after in zip([prompt] + lengths, lengths)]
        assert step_tokens(iter(lengths), prompt) == expected
    assert step_tokens([7, 8, 9], 4) == [3, 1, 1]  # the first step: the prompt's width to its first token


def test_the_request_model_is_the_models_name_else_its_configs_else_its_class():
    """``gen_ai.request.model``: a model's ``name_or_path``; where that is empty, its config's
    ``_name_or_path`` (read from the config's dictionary, or as an attribute where it is not in
    it); else the model's class name."""
    from otel_generate.integrations._routing import model_name

    class Config:
        def __init__(self, name):
            self._name_or_path = name

    class PropertyConfig:
        @property
        def _name_or_path(self):
            return "from-a-property"

    assert model_name(SimpleNamespace(name_or_path="org/model", config=Config("other"))) == "org/model"
    assert model_name(SimpleNamespace(name_or_path="", config=Config("from-config"))) == "from-config"
    assert model_name(SimpleNamespace(config=PropertyConfig())) == "from-a-property"
    assert model_name(SimpleNamespace(name_or_path="", config=Config(""))) == "SimpleNamespace"
    assert model_name(object()) == "object"
