"""Continuous batching's derivation: a finished :class:`~.cb_records.CBRecord` in, a
:class:`~otel_generate.request.Request` out. Pure: no clock read unless the record has no end at
all, no lock, no OpenTelemetry, no transformers (outputs are read by their attributes:
``request_id``, ``prompt_ids``, ``generated_tokens``, ``error``).

Which batch steps a request took part in (``prefill`` chunks with no token, the step that produced
its first token, then one ``decode`` per token), the requests sharing each step, the queue time,
tokens, finish reasons and a streaming request's time to first chunk; its energy, the sum of its
shares of those steps (each step's energy shared among its requests in proportion to the tokens
each computed in it), when every one of them is known.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Tuple

from otel_generate import attributes as A
from otel_generate import clock
from otel_generate.integrations.cb_records import FINISH_REASON_CANCELLED, BatchStep, CBRecord, Outcome
from otel_generate.request import Request


def sequence_order(record: CBRecord) -> List[str]:
    """The record's sequence ids: the request itself, then its children by index."""
    children = sorted(
        (rid for rid in set(record.outputs) | set(record.steps) if rid != record.request_id),
        key=lambda rid: int(rid.rsplit("#", 1)[1]) if rid.rsplit("#", 1)[1].isdigit() else 0,
    )
    return [record.request_id] + children


def finish_reason(output: Any, eos: frozenset) -> str:
    """``stop`` when the last generated token is an end-of-sequence id, else ``length``."""
    generated = output.generated_tokens
    return A.FINISH_REASON_STOP if generated and generated[-1] in eos else A.FINISH_REASON_LENGTH


def _union(by_number: Dict[int, BatchStep], step: BatchStep) -> None:
    """Add ``step`` to the steps by number; a step shared by several sequences gave a token if any
    got one, and its energy is the sum of their shares (unknown if one is)."""
    known = by_number.get(step.number)
    if known is None:
        by_number[step.number] = step
        return
    energy_mj = None
    if known.energy_mj is not None and step.energy_mj is not None:
        energy_mj = known.energy_mj + step.energy_mj
    by_number[step.number] = known._replace(tokens=max(known.tokens, step.tokens), energy_mj=energy_mj)


def derive(record: CBRecord) -> Outcome:
    """Steps, tokens and outcome of a finished (or cancelled) record."""
    by_number: Dict[int, BatchStep] = {}
    per_sequence: List[int] = []
    reasons: List[str] = []
    errors: List[str] = []
    ends: List[int] = []
    input_tokens: Optional[int] = None
    complete = True
    for rid in sequence_order(record):
        finished = record.outputs.get(rid)
        output = finished.output if finished is not None else None
        generated = len(output.generated_tokens) if output is not None else None
        got = 0
        for step in record.steps.get(rid, ()):
            if generated is not None and got >= generated:
                break  # async mode: a finished request can sit in one more batch; its token was dropped
            got += step.tokens
            _union(by_number, step)
            ends.append(step.end_ns)
        if finished is None:
            continue
        if finished.at_ns is not None:
            ends.append(finished.at_ns)
        if rid == record.request_id:
            input_tokens = len(output.prompt_ids)
        per_sequence.append(generated)
        if output.error is not None:
            errors.append(str(output.error))
        else:
            reasons.append(finish_reason(output, record.eos))
        if record.timed and generated and got < generated:
            complete = False  # a step that produced one of its tokens was not recorded
    if record.cancelled_ns is not None and not record.outputs:
        reasons = [FINISH_REASON_CANCELLED]
        ends.append(record.cancelled_ns)
    return Outcome(
        steps=[by_number[number] for number in sorted(by_number)],
        input_tokens=input_tokens if input_tokens is not None else record.input_tokens,
        per_sequence=per_sequence,
        finish_reasons=reasons if reasons and not errors else None,
        error=RuntimeError(errors[0]) if errors else None,
        end_ns=max(ends) if ends else None,
        complete=complete,
    )


def fill_steps(target: Any, steps: List[BatchStep], start_ns: int) -> None:
    """Explicit batch-step bounds, tokens and sharing into ``target`` (starts clamped to ``start_ns``):
    a :class:`~otel_generate.request.Request`, or a ``generate()`` loop, which has the same step fields."""
    target.step_starts_ns = [max(step.start_ns, start_ns) for step in steps]
    target.step_ends_ns = [max(step.end_ns, start_ns) for step in steps]
    target.step_tokens = [step.tokens for step in steps]
    target.step_requests = [step.requests for step in steps]
    first_token = next((index for index, step in enumerate(steps) if step.tokens), None)
    target.prefill_steps = len(steps) if first_token is None else first_token + 1
    if steps:
        target.queue_ns = target.step_starts_ns[0] - start_ns


def incomplete_request(record: CBRecord, model: str, device: Optional[str], now_ns: int) -> Request:
    """A request whose steps could not be accounted: its span still ends at ``now_ns`` (monotonic
    nanoseconds), marked incomplete, with what was known at submission."""
    return Request(
        model=model,
        start_ns=record.start_ns,
        start_wall_ns=record.start_wall_ns,
        timed=record.timed,
        device=device,
        parameters=dict(record.parameters),
        request_id=record.response_id or record.request_id,
        incomplete=True,
        end_ns=max(now_ns, record.start_ns),
    )


def request_of(
    record: CBRecord, outcome: Outcome, model: str, device: Optional[str], now_ns: Optional[int] = None
) -> Request:
    """The :class:`~otel_generate.request.Request` of a finished record and its :func:`derive` outcome.

    ``model`` and ``device`` are the manager's (``gen_ai.request.model``, ``generate.device``). The
    request ends at the outcome's end, else at ``now_ns`` (monotonic nanoseconds; read from the
    clock when ``None``), never before it started.
    """
    request = Request(
        model=model,
        start_ns=record.start_ns,
        start_wall_ns=record.start_wall_ns,
        timed=record.timed,
        synchronized=True,  # every clock read follows transformers' own wait for the device
        device=device,
        parameters=dict(record.parameters),
        request_id=record.response_id or record.request_id,
    )
    if record.timed:
        fill_steps(request, outcome.steps, record.start_ns)
        request.incomplete = not outcome.complete
        steps = outcome.steps
        if steps and all(step.device for step in steps):
            request.clock = A.CLOCK_DEVICE  # every step's bounds are device time
        if steps and all(step.energy_mj is not None for step in steps):
            # its shares of the batch steps it took part in: known for every one, or not given
            request.step_energy_mj = [step.energy_mj for step in steps]
            request.energy_mj = sum(request.step_energy_mj)
    request.input_tokens = outcome.input_tokens
    if outcome.per_sequence:
        request.output_tokens_per_sequence = list(outcome.per_sequence)
        request.output_tokens = int(sum(outcome.per_sequence))
    elif record.cancelled_ns is not None:
        request.output_tokens = sum(step.tokens for step in outcome.steps) if record.timed else None
    request.finish_reasons = outcome.finish_reasons
    request.error = outcome.error
    if record.first_chunk_ns is not None:
        request.first_chunk_ns = max(record.first_chunk_ns, record.start_ns)
    end = outcome.end_ns
    if end is None:
        end = now_ns if now_ns is not None else clock.monotonic_ns()
    request.end_ns = max(end, record.start_ns)
    return request


def account_rows(loop: Any, rows: Iterable[Tuple[CBRecord, Optional[Outcome]]], timed: bool, start_ns: int) -> None:
    """The rows of one ``generate(..., cache_implementation="paged")`` call into its ``loop``
    (steps shared by rows counted once, tokens, finish reasons, parameters); ``rows`` in input
    order, each with its outcome (``None``: it never finished)."""
    rows = list(rows)
    by_number: Dict[int, BatchStep] = {}
    per_sequence: List[int] = []
    reasons: List[str] = []
    input_tokens = 0
    incomplete = False
    for record, outcome in rows:
        if outcome is None:
            incomplete = True
            if record.input_tokens is not None:
                input_tokens += record.input_tokens
            continue
        incomplete = incomplete or not outcome.complete
        for step in outcome.steps:
            _union(by_number, step)
        input_tokens += outcome.input_tokens or 0
        per_sequence.extend(outcome.per_sequence)
        reasons.extend(outcome.finish_reasons or [])
    parameters: Dict[str, Any] = {}
    if rows:
        first, _ = rows[0]
        parameters.update(first.parameters)
    parameters.pop(A.GEN_AI_REQUEST_STREAM, None)
    parameters[A.GENERATE_BATCH_SIZE] = len(rows)
    loop.parameters = parameters
    if timed:
        fill_steps(loop, [by_number[number] for number in sorted(by_number)], start_ns)
        loop.incomplete = incomplete
    loop.input_tokens = input_tokens if rows else None
    if per_sequence:
        loop.per_sequence = per_sequence
        loop.output_tokens = int(sum(per_sequence))
    if len(reasons) == len(per_sequence) and reasons:
        loop.finish_reasons = reasons
