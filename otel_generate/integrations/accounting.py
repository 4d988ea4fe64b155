"""Accounting of a ``generate()`` request: its loops' recorded steps and result tensors in, the
numbers of its :class:`~otel_generate.request.Request` out.

Nothing here reads a clock, starts a span or calls into transformers' decoding: the inputs are
the :class:`~.loop_state.Call` and :class:`~.loop_state.Loop` state the hooks filled (the step
recorder's ``times_ns``, ``lengths`` and ``done``; the returned sequences; the effective
``GenerationConfig``), so every function can be fed hand-built values (``tests/unit/test_accounting.py``).

* :func:`account_call`: the whole request: steps concatenated across its loops, tokens, finish
  reasons, parameters, one grouping record per inner loop (Whisper's windows, Bark's sub-models);
* :func:`account_loop`: one loop, from its steps and its result tensor;
* :func:`account_unobserved`: a call whose decoding loop could not be seen (a ``custom_generate``
  or a model's own loop): tokens from its input and output;
* :func:`rows_at_a_stop_string`, :func:`rows_out_of_time`: which rows a stop string or
  ``max_time`` ended (their finish reason is ``stop`` and ``length``).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from otel_generate import attributes as A
from otel_generate import cancellation, clock
from otel_generate._faults import Fault, log_fault_once
from otel_generate.integrations._routing import BEAM, ROW_ALIGNED, _is_tensor, _sequences, model_name
from otel_generate.request import InnerCall
from otel_generate.tokens import count_input_tokens, count_new_tokens, counts_from_done, finish_reasons, step_tokens


def account_call(call: Any, result: Any, exc: Optional[BaseException]) -> List[Any]:
    """Fill ``call.request`` from the loops that ran (or from the call itself when none could be
    seen); returns those loops. A cancelled call (:func:`otel_generate.cancellation.is_cancellation`)
    gets one ``cancelled`` finish reason per row.

    Args:
        call: a :class:`~.loop_state.Call` whose ``request.end_ns`` is set.
        result: what the user's call returned (``None`` when it raised).
        exc: what it raised, or ``None``.
    """
    loops = _account_loops(call, result, exc)
    if cancellation.is_cancellation(exc):
        cancellation.account(call.request, call.loops)
    return loops


def _account_loops(call: Any, result: Any, exc: Optional[BaseException]) -> List[Any]:
    request = call.request
    params = request.parameters
    loops = [loop for loop in call.loops if loop.observed()]
    if call.custom_generate is not None:
        params[A.GENERATE_CUSTOM_GENERATE] = call.custom_generate
    if not call.telemetry.active and (
        not loops or call.custom_generate is not None or call.outer or len(call.loops) > 1
    ):
        # uninstrument() ran during the request: an inner call it started afterwards went unseen
        # (with one loop seen so far as well: Whisper's later windows)
        request.uninstrumented = exc is None
    if not loops:
        account_unobserved(call, result, exc)
        return loops
    first = loops[0]
    for loop in loops:
        if loop.end_ns is None:  # an implicit loop, or a loop cut short by an exception
            loop.end_ns = request.end_ns
        account_loop(loop, None if len(loops) > 1 or loop.model is not call.model else result, exc)
    params.update(first.parameters)
    if first.assisted_generator is not None:
        params[A.GENERATE_ASSISTED_GENERATOR] = first.assisted_generator
    request.input_tokens = first.input_tokens
    request.kv_cache_bytes = loops[-1].kv_cache_bytes
    assisted = [loop for loop in loops if loop.candidates_proposed is not None]
    if assisted and all(loop.candidates_accepted is not None for loop in assisted):
        request.candidates_proposed = sum(loop.candidates_proposed for loop in assisted)
        request.candidates_accepted = sum(loop.candidates_accepted for loop in assisted)

    if (
        len(loops) == 1
        and first.step_starts_ns is None
        and first.start_ns == request.start_ns
        and len(first.step_ends_ns) == len(first.step_tokens)
    ):
        # one loop, started with the request: its lists as they are, each step starting where the
        # one before it ended (the request's start for the first: no explicit starts)
        request.step_ends_ns, request.step_starts_ns, request.step_tokens = first.step_ends_ns, None, first.step_tokens
    else:
        _concatenate_steps(request, loops)
    if call.timed and exc is None and any(loop.unobserved for loop in loops) and not request.step_ends_ns:
        request.unobserved = next(loop.unobserved for loop in loops if loop.unobserved)
    if len(loops) == 1:
        request.output_tokens_per_sequence = first.per_sequence
        request.output_tokens = first.output_tokens
        request.finish_reasons = first.finish_reasons
        request.prefill_steps = first.prefill_steps
        request.step_requests = first.step_requests
        request.queue_ns = first.queue_ns
        if call.timed and exc is None and first.incomplete:
            request.incomplete = True
        if first.uninstrumented:
            request.uninstrumented = True
        return loops
    _account_inner_calls(call, loops, exc)
    return loops


def _concatenate_steps(request: Any, loops: List[Any]) -> None:
    """The loops' steps concatenated in call order (indices and token positions continue across
    loops), each with its start: explicit where the loop gave them, else where the one before it
    in the same loop ended (the loop's start for its first)."""
    ends: List[int] = []
    starts: List[int] = []
    tokens: List[int] = []
    for loop in loops:
        if loop.step_starts_ns is not None:  # explicit starts (continuous batching's batch steps)
            starts.extend(loop.step_starts_ns)
            ends.extend(loop.step_ends_ns)
            tokens.extend(loop.step_tokens)
            continue
        steps = min(len(loop.step_ends_ns), len(loop.step_tokens))
        loop_ends = loop.step_ends_ns[:steps]
        if loop_ends:  # each step starts where the one before it ended
            starts.extend([loop.start_ns] + loop_ends[:-1])
        ends.extend(loop_ends)
        tokens.extend(loop.step_tokens[:steps])
    request.step_ends_ns, request.step_starts_ns, request.step_tokens = ends, starts, tokens


def _account_inner_calls(call: Any, loops: List[Any], exc: Optional[BaseException]) -> None:
    """Several loops: one grouping record each, tokens summed, a window's kept decisions applied."""
    request = call.request
    index = 0
    total = discarded = 0
    counted = False
    row_reasons: Dict[int, str] = {}
    for number, loop in enumerate(loops):
        attributes: Dict[str, Any] = {
            A.GENERATE_CALL_INDEX: number,
            A.GENERATE_CALL_MODEL: model_name(loop.model),
            A.GENERATE_CALL_STEPS: len(loop.step_ends_ns),
        }
        if loop.parameters.get(A.GENERATE_STRATEGY) is not None:
            attributes[A.GENERATE_STRATEGY] = loop.parameters[A.GENERATE_STRATEGY]
        kept_rows = None
        if loop.window is not None:
            extra, kept_rows = loop.window.attributes(loop)
            attributes.update(extra)
            # each batch row ends as its last kept attempt ended (rows are original batch rows)
            for position, row in enumerate(extra.get(A.GENERATE_ATTEMPT_ROWS, ())):
                if position in kept_rows and loop.finish_reasons and position < len(loop.finish_reasons):
                    row_reasons[row] = loop.finish_reasons[position]
        if loop.output_tokens is not None:
            counted = True
            attributes[A.GENERATE_CALL_OUTPUT_TOKENS] = loop.output_tokens
            total += loop.output_tokens
            if kept_rows is not None:
                discarded += sum(count for row, count in enumerate(loop.per_sequence) if row not in kept_rows)
        request.calls.append(
            InnerCall(
                start_ns=loop.start_ns,
                end_ns=loop.end_ns,
                first_step=index,
                steps=len(loop.step_ends_ns),
                output_tokens=loop.output_tokens,
                attributes=attributes,
            )
        )
        index += len(loop.step_ends_ns)
        if call.timed and exc is None and loop.incomplete:
            request.incomplete = True
        if loop.uninstrumented:
            request.uninstrumented = True
    if counted:
        request.output_tokens = total
        if any(loop.window is not None for loop in loops):
            request.discarded_output_tokens = discarded
    if row_reasons:  # Whisper: one reason per returned row, from the window that ended it
        request.finish_reasons = [row_reasons[row] for row in sorted(row_reasons)]
    else:
        request.finish_reasons = loops[-1].finish_reasons


def account_unobserved(call: Any, result: Any, exc: Optional[BaseException]) -> None:
    """No decoding loop could be seen (a ``custom_generate`` or a model's own loop): count the
    tokens from the call's token input and its output, and say why there are no steps."""
    request = call.request
    if exc is None and not request.uninstrumented:
        request.unobserved = (
            A.UNOBSERVED_CUSTOM_GENERATE if call.custom_generate is not None else A.UNOBSERVED_MODEL_LOOP
        )
    inputs = call.kwargs.get("input_ids", call.kwargs.get("inputs"))
    if inputs is None and call.args and _is_tensor(call.args[0]):
        inputs = call.args[0]
    if not _is_tensor(inputs) or inputs.dim() != 2 or inputs.is_floating_point():
        return  # audio, pixels, embeddings: no token input to count
    config = call.user_generation_config()
    eos = call.kwargs.get("eos_token_id", getattr(config, "eos_token_id", None))
    pad = call.kwargs.get("pad_token_id", getattr(config, "pad_token_id", None))
    mask = call.kwargs.get("attention_mask")
    request.parameters[A.GENERATE_BATCH_SIZE] = int(inputs.shape[0])
    request.input_tokens = count_input_tokens(inputs, mask, pad, eos)
    sequences = _sequences(result)
    if sequences is None or getattr(call.model.config, "is_encoder_decoder", False):
        return
    width = int(inputs.shape[-1])
    if sequences.shape[-1] < width:
        return
    max_new = call.kwargs.get("max_new_tokens", getattr(config, "max_new_tokens", None))
    per_sequence = count_new_tokens(sequences, width, eos, pad)
    request.output_tokens_per_sequence = per_sequence
    request.output_tokens = int(sum(per_sequence))
    request.finish_reasons = finish_reasons(sequences, width, per_sequence, max_new, eos)
    if max_new is not None:
        request.parameters[A.GEN_AI_REQUEST_MAX_TOKENS] = int(max_new)


def _missed_hook(loop: Any) -> None:
    """A hook of this loop never ran: a fault (``incomplete``), or ``uninstrument()`` removed the
    hooks while the request was being set up (``uninstrumented``: the loop itself ran normally)."""
    if loop.call.telemetry.active:
        loop.incomplete = True
    else:
        loop.uninstrumented = True


def account_loop(loop: Any, call_result: Any, exc: Optional[BaseException]) -> None:
    """Steps, tokens and parameters of one loop, from the hooks' data and its result tensor (its
    own result; for an implicit loop, ``call_result`` when it is the loop's output). A loop whose
    rows ran elsewhere (``loop.paged``, a :class:`~.loop_state.RowSource`) is filled by that."""
    if loop.paged is not None:  # the rows ran as continuous-batching requests
        loop.paged.account(loop)
        return
    call = loop.call
    params = loop.parameters
    config = loop.generation_config
    strategy = loop.strategy()
    if strategy is not None:
        params[A.GENERATE_STRATEGY] = strategy
    sequences = _sequences(loop.result if loop.result is not None else call_result)
    prompt_length = loop.prompt_length

    # --- steps ------------------------------------------------------------------------
    times: List[int] = []
    lengths: List[int] = []
    done: List[Any] = []
    recorder = loop.recorder
    if recorder is not None:
        times = list(recorder.times_ns)
        lengths = recorder.step_lengths()
        done = list(recorder.done)
        if sequences is not None and strategy in ROW_ALIGNED:
            # steps that transformers undid (MPS's deferred stop check) are not in the output
            final = int(sequences.shape[-1])
            while lengths and lengths[-1] > final:
                del lengths[-1], times[-1], done[-1:]
            if recorder.implied_lengths and recorder.fault is None and lengths and lengths[-1] != final:
                # one token a step was implied, yet the output is wider: the steps' tokens are not known
                loop.incomplete = True
                log_fault_once(
                    Fault.IMPLIED_STEP_LENGTHS, ValueError(f"{final} positions returned, {lengths[-1]} implied")
                )
        if not times and exc is None and loop.kwargs.get("custom_generate") is not None:
            loop.unobserved = A.UNOBSERVED_CUSTOM_GENERATE  # the custom loop never called the criteria
    elif call.timed and exc is None:
        _missed_hook(loop)  # the stopping-criteria hook was never reached
    if call.timed and exc is None and prompt_length is None:
        _missed_hook(loop)  # the prompt width was never learned: no token accounting
    loop.step_ends_ns = times
    loop.step_tokens = step_tokens(
        lengths,
        prompt_length if prompt_length is not None else 0,
        consecutive=recorder is not None and recorder.implied_lengths,
    )

    # --- token accounting from the tensors themselves -----------------------------------
    eos = pad = max_new = None
    if config is not None:
        eos = getattr(config, "eos_token_id", None)
        pad = getattr(config, "pad_token_id", None)
        max_new = getattr(config, "max_new_tokens", None)
        if max_new is None and getattr(config, "max_length", None) is not None and prompt_length is not None:
            max_new = int(config.max_length) - prompt_length
    inputs = loop.inputs_tensor
    if _is_tensor(inputs) and inputs.dim() >= 2:
        params[A.GENERATE_BATCH_SIZE] = int(inputs.shape[0])
        # tokens only for token inputs: not for audio features or pixels (Whisper, vision encoders)
        if loop.model_input_name in (None, "input_ids", "inputs_embeds"):
            loop.input_tokens = count_input_tokens(inputs, loop.kwargs.get("attention_mask"), pad, eos)
    if sequences is not None and prompt_length is not None and sequences.shape[-1] >= prompt_length:
        per_sequence = None
        if done and len(done) == len(lengths) and recorder.fault is None:
            # exact: each row ends at the step where a stopping criterion first said so
            per_sequence = counts_from_done(done, lengths, prompt_length, sequences)
        if per_sequence is None:  # beams, or no step data: read it off the tensor
            # beam search pads only after an EOS (which ends the count already): a trailing run of
            # tokens equal to the pad id in a beam without EOS is real output
            per_sequence = count_new_tokens(sequences, prompt_length, eos, None if strategy in BEAM else pad)
        loop.per_sequence = per_sequence
        loop.output_tokens = int(sum(per_sequence))
        stop_criteria, deadlines, own_only = _stop_string_and_time_criteria(loop.criteria)
        last_step_wall_s = call.request.wall_ns(times[-1]) / clock.NS_PER_S if times and deadlines and lengths else None
        out_of_time = rows_out_of_time(
            last_step_wall_s, deadlines, lengths, prompt_length, per_sequence, own_criteria_only=own_only
        )
        loop.finish_reasons = finish_reasons(
            sequences,
            prompt_length,
            per_sequence,
            max_new,
            eos,
            forced_eos_token_id=getattr(config, "forced_eos_token_id", None),
            budget_rows=out_of_time,
            stopped_rows=rows_at_a_stop_string(
                stop_criteria, sequences, prompt_length, per_sequence, max_new, running=out_of_time if own_only else ()
            ),
        )
    if config is not None:
        _config_parameters(params, config, max_new)
    if call.streamer is not None:
        call.request.first_chunk_ns = call.streamer._self_first_chunk_ns
        call.request.streamer_ns = call.streamer._self_inside_ns


def _config_parameters(params: Dict[str, Any], config: Any, max_new: Any) -> None:
    """The request parameters a loop's effective ``GenerationConfig`` gives."""
    if max_new is not None and max_new >= 0:
        params[A.GEN_AI_REQUEST_MAX_TOKENS] = int(max_new)
    params[A.GENERATE_NUM_BEAMS] = int(getattr(config, "num_beams", 1) or 1)
    choices = int(getattr(config, "num_return_sequences", 1) or 1)
    if choices > 1:
        params[A.GEN_AI_REQUEST_CHOICE_COUNT] = choices
    if getattr(config, "do_sample", False):
        for key, name in (
            (A.GEN_AI_REQUEST_TEMPERATURE, "temperature"),
            (A.GEN_AI_REQUEST_TOP_P, "top_p"),
            (A.GEN_AI_REQUEST_TOP_K, "top_k"),
        ):
            value = getattr(config, name, None)
            if value is not None:  # doubles, top_k included (GenAI span conventions)
                params[key] = float(value)
    stop_strings = getattr(config, "stop_strings", None)
    if stop_strings:
        params[A.GEN_AI_REQUEST_STOP_SEQUENCES] = (
            [stop_strings] if isinstance(stop_strings, str) else [str(s) for s in stop_strings]
        )


#: ``(StopStringCriteria, MaxTimeCriteria, the four criteria types generate() builds itself)``,
#: imported with the first criteria list accounted (an import statement per request costs about as
#: much as the rest of this function)
_criteria_types: Optional[tuple] = None


def _stop_string_and_time_criteria(criteria: Any) -> tuple:
    """The ``StopStringCriteria`` of a loop's criteria list, its ``MaxTimeCriteria`` deadlines
    (wall-clock seconds), and whether every criterion in it is one of the four that
    ``generate()`` builds from its config (``MaxLengthCriteria``, ``MaxTimeCriteria``,
    ``StopStringCriteria``, ``EosTokenCriteria``; exactly those types, not a subclass); empty and
    ``False`` without a criteria list (then transformers is not imported here)."""
    global _criteria_types
    if criteria is None:
        return [], [], False
    if _criteria_types is None:
        from transformers.generation.stopping_criteria import (
            EosTokenCriteria,
            MaxLengthCriteria,
            MaxTimeCriteria,
            StopStringCriteria,
        )

        _criteria_types = (
            StopStringCriteria,
            MaxTimeCriteria,
            frozenset((MaxLengthCriteria, MaxTimeCriteria, StopStringCriteria, EosTokenCriteria)),
        )
    stop_type, time_type, own_types = _criteria_types
    stop: List[Any] = []
    deadlines: List[float] = []
    own = True
    for criterion in criteria:  # (one pass: a list has one to three criteria)
        kind = type(criterion)
        if kind in own_types:  # (told by the type alone: isinstance of an ABC runs Python code)
            if kind is stop_type:
                stop.append(criterion)
            elif kind is time_type:
                deadlines.append(criterion.initial_timestamp + criterion.max_time)
            continue
        own = False
        if isinstance(criterion, stop_type):
            stop.append(criterion)
        if isinstance(criterion, time_type):
            deadlines.append(criterion.initial_timestamp + criterion.max_time)
    return stop, deadlines, own


def rows_at_a_stop_string(
    stop_criteria: Sequence[Any],
    sequences: Any,
    prompt_length: int,
    counts: List[int],
    max_new: Any,
    running: Sequence[int] = (),
) -> List[int]:
    """Rows that used their whole budget (or, ``running``, rows ``max_time`` may have ended) and
    whose last token also completed a stop string: the stop string ended them (each
    ``StopStringCriteria`` in ``stop_criteria`` is asked once more on the final ``(rows, length)``
    sequences; it has no state)."""
    if not stop_criteria or (max_new is None and not running):
        return []
    width = sequences.shape[-1]
    full = [
        row
        for row, count in enumerate(counts)
        if ((max_new is not None and count >= max_new) or row in running) and prompt_length + count == width
    ]
    if not full:
        return []
    matched = set()
    for criterion in stop_criteria:
        done = criterion(sequences, None)
        matched.update(row for row in full if bool(done[row]))
    return sorted(matched)


def rows_out_of_time(
    last_step_wall_s: Optional[float],
    deadlines: Sequence[float],
    lengths: List[int],
    prompt_length: int,
    counts: List[int],
    own_criteria_only: bool = False,
) -> List[int]:
    """Rows that ``max_time`` ended: still running at the last step, which ended after the deadline.

    ``MaxTimeCriteria`` stops every row at once when ``time.time() - initial_timestamp >
    max_time``; the step's clock read follows the criteria's, so a last step that ended (at
    ``last_step_wall_s``, wall-clock seconds) after the earliest of ``deadlines`` is the one
    ``max_time`` ended. ``lengths``: the sequence length after each step (prompt included).

    ``own_criteria_only``: every criterion is one ``generate()`` builds from its config
    (:func:`_stop_string_and_time_criteria`). Then the clocks are not compared: a row still running
    at the last step was ended there by its EOS, its token budget, a stop string or ``max_time``,
    and :func:`~otel_generate.tokens.finish_reasons` tells the first three apart from the tokens
    (with ``rows_at_a_stop_string``'s ``running``). The step's time converted to the wall clock can
    read before the deadline the criteria saw passed: the wall clock may be stepped or slewed
    against the monotonic one during the request (seen on these VMs: up to 0.5 ms).
    """
    if not deadlines or not lengths:
        return []
    if not own_criteria_only and (last_step_wall_s is None or last_step_wall_s <= min(deadlines)):
        return []
    last = lengths[-1] - prompt_length
    return [row for row, count in enumerate(counts) if count >= last]
