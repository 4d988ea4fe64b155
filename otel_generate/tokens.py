"""Token accounting from the tensors ``generate()`` takes and returns.

Only continuation tokens are output: never the prompt, never left padding, never the padding
transformers writes after a sequence has finished. These functions are shared by the
instrumentor and the benchmark harness so that both count the same way.
"""

from __future__ import annotations

import operator
from typing import Any, Iterable, List, Optional, Sequence

from otel_generate.attributes import FINISH_REASON_LENGTH, FINISH_REASON_STOP


def _as_id_list(token_ids: Any) -> List[int]:
    if token_ids is None:
        return []
    if hasattr(token_ids, "tolist"):
        token_ids = token_ids.tolist()
    if isinstance(token_ids, int):
        return [token_ids]
    return [int(t) for t in token_ids]


def count_new_tokens(
    sequences: Any,
    prompt_length: int,
    eos_token_id: Optional[Any] = None,
    pad_token_id: Optional[int] = None,
) -> List[int]:
    """Count the real generated tokens of each returned sequence.

    Args:
        sequences: LongTensor of shape ``(num_sequences, total_length)``, as returned by
            ``generate()`` (``output.sequences`` for a dict output). Each row is the prompt
            (``prompt_length`` positions, left padding included) followed by the continuation.
        prompt_length: number of leading positions that were not generated: the padded prompt
            width for decoder-only models, the decoder start tokens for encoder-decoder models,
            0 when generating from ``inputs_embeds`` only.
        eos_token_id: an int, a list of ints or a tensor of end-of-sequence ids, or ``None``.
            The first EOS in a continuation ends it and is counted as a generated token;
            anything after it is padding.
        pad_token_id: padding id. transformers writes it after a row has finished only when an
            EOS id is set (``has_eos_stopping_criteria`` in ``GenerationMixin._sample``); so when
            ``eos_token_id`` is given and the pad id differs from every EOS id, a run of pad ids
            at the end of a continuation is padding written after the row was stopped (e.g. by a
            user stopping criterion) and is not counted. Without EOS nothing is stripped.

    Returns:
        One count per row (``len == num_sequences``), each ``0 <= count <= total_length - prompt_length``.

    Raises:
        ValueError: if ``sequences`` is not 2-D or ``prompt_length`` is negative or larger than
            the sequence length.
    """
    shape = sequences.shape
    if len(shape) != 2:
        raise ValueError(f"sequences must be 2-D (num_sequences, length), got shape {tuple(shape)}")
    total = shape[-1]
    if prompt_length < 0 or prompt_length > total:
        raise ValueError(f"prompt_length must be between 0 and {total}, got {prompt_length}")
    eos_ids = _as_id_list(eos_token_id)
    width = total - prompt_length
    if not eos_ids or width == 0:  # nothing ends a row early: every row is its whole continuation
        return [width] * int(shape[0])
    import torch  # (imported here: the common case above needs no tensor operation)

    continuation = sequences[:, prompt_length:]
    rows = continuation.shape[0]
    counts = torch.full((rows,), width, dtype=torch.long, device=continuation.device)
    positions = torch.arange(1, width + 1, device=continuation.device)
    is_eos = torch.isin(continuation, torch.tensor(eos_ids, device=continuation.device))
    # position (1-based) of the first EOS, else width
    first_eos = torch.where(is_eos, positions, torch.full_like(positions, width + 1)).min(dim=-1).values
    counts = torch.minimum(counts, first_eos)
    if pad_token_id is not None and int(pad_token_id) not in eos_ids:
        not_pad = continuation != int(pad_token_id)
        last_real = torch.where(not_pad, positions, torch.zeros_like(positions)).max(dim=-1).values
        counts = torch.minimum(counts, last_real)
    return counts.tolist()


def counts_from_done(
    done: Sequence[Any], lengths: Sequence[int], prompt_length: int, sequences: Any
) -> Optional[List[int]]:
    """Generated tokens per row from when each row was stopped, as the stopping criteria said.

    Args:
        done: one tensor ``(rows,)`` per step, the value ``StoppingCriteriaList`` returned: bool,
            or long when a user criterion returns long values (``GenerationMixin._sample``/
            ``_assisted_decoding`` mark a row finished at its first ``True``; nonzero here).
        lengths: sequence length after each step (prompt included), ``len(lengths) == len(done)``.
        prompt_length: leading positions that were not generated.
        sequences: the returned LongTensor ``(rows, total_length)``.

    Returns:
        One count per row, or ``None`` when the shapes do not line up (then count from the
        tensor with :func:`count_new_tokens`). Exact where the tensor is ambiguous: a real
        generated pad token, or a row stopped by a criterion when pad equals EOS.
    """
    import torch

    if not done or len(done) != len(lengths):
        return None
    rows = int(sequences.shape[0])
    try:
        stacked = torch.stack(list(done))  # (steps, rows)
    except RuntimeError:  # steps of different shapes
        return None
    if stacked.dim() != 2 or stacked.shape[1] != rows:
        return None
    # A user criterion returning a LongTensor makes the list return long values (bool | long), not
    # only 0/1: a row is done at its first nonzero step, so truth values are searched, not the values.
    if stacked.dtype != torch.bool:
        stacked = stacked.bool()
    width = int(sequences.shape[-1]) - prompt_length
    if rows == 1:
        # a batch of one: its marks as Python bools in one copy from the device, the first True found
        # by list.index in C (each tensor reduction below costs about 10,000 instructions; with
        # many rows they cost less than a list of every row's marks)
        try:
            step = stacked.view(-1).tolist().index(True)
        except ValueError:  # never marked done: the whole continuation
            return [width]
        return [min(max(lengths[step] - prompt_length, 0), width)]
    marked = stacked.long()
    # per row: whether a step marked it done, and the first step that did (argmax: first maximum)
    ended, first = torch.stack([marked.amax(dim=0), marked.argmax(dim=0)]).cpu().tolist()
    return [min(max(lengths[step] - prompt_length, 0), width) if stop else width for stop, step in zip(ended, first)]


#: a 2-D integer or bool attention mask of at most this many values is summed from its Python list
#: (one copy, about 5,000 instructions and 150 a value) rather than by a tensor reduction and
#: ``item()`` (about 16,000)
_FEW_MASK_VALUES = 32


def count_input_tokens(
    inputs: Any,
    attention_mask: Optional[Any] = None,
    pad_token_id: Optional[int] = None,
    eos_token_id: Optional[Any] = None,
) -> int:
    """Count the non-padding prompt tokens of all rows.

    Args:
        inputs: the prompt, LongTensor ``(batch, prompt_length)`` of token ids, or a float
            ``inputs_embeds`` tensor ``(batch, prompt_length, hidden)``.
        attention_mask: ``(batch, prompt_length)`` 0/1 mask; when given it decides alone.
        pad_token_id, eos_token_id: used only without a mask, the way transformers infers one
            (``GenerationMixin._prepare_attention_mask_for_generation``): pad positions are
            padding when the pad id differs from every EOS id.

    Returns:
        The number of real prompt tokens over the whole batch.
    """
    if attention_mask is not None:
        mask_shape = attention_mask.shape
        # (the common case, two equal shapes, compared without slicing them)
        if mask_shape == inputs.shape or mask_shape[:2] == inputs.shape[:2]:
            if (
                len(mask_shape) == 2
                and mask_shape[0] * mask_shape[1] <= _FEW_MASK_VALUES
                and not attention_mask.is_floating_point()
            ):  # (integer or bool values: the same sum exactly; a float sum would round otherwise)
                return int(sum(map(sum, attention_mask.tolist())))
            return int(attention_mask.sum().item())
    batch, length = int(inputs.shape[0]), int(inputs.shape[1])
    is_ids = inputs.dim() == 2 and not inputs.is_floating_point()
    if pad_token_id is not None and is_ids and int(pad_token_id) not in _as_id_list(eos_token_id):
        return int((inputs != int(pad_token_id)).sum().item())
    return batch * length


def finish_reasons(
    sequences: Any,
    prompt_length: int,
    counts: Sequence[int],
    max_new_tokens: Optional[int],
    eos_token_id: Optional[Any] = None,
    forced_eos_token_id: Optional[Any] = None,
    budget_rows: Iterable[int] = (),
    stopped_rows: Iterable[int] = (),
) -> List[str]:
    """One GenAI finish reason per returned sequence (``gen_ai.response.finish_reasons``).

    ``"length"`` when a budget ended the row: it used all ``max_new_tokens`` (or ``max_length``)
    without an EOS of its own, ``budget_rows`` names it (rows that ``max_time`` stopped), or its
    last token is an EOS that ``forced_eos_token_id`` forced at the last budget position
    (``ForcedEOSTokenLogitsProcessor``). ``"stop"`` when the model produced EOS by itself, a
    stop string matched, or a stopping criterion of the user's ended it.

    Args:
        sequences: LongTensor ``(num_sequences, total_length)``.
        prompt_length: leading positions that were not generated.
        counts: generated tokens of each row (:func:`count_new_tokens` or :func:`counts_from_done`).
        max_new_tokens: the token budget, or ``None`` when unknown.
        eos_token_id: EOS id(s) (int, list, tensor or ``None``).
        forced_eos_token_id: the generation config's ``forced_eos_token_id`` (id(s) or ``None``).
        budget_rows: indices of rows a budget other than the token count ended (``max_time``).
        stopped_rows: indices of rows a stop string ended on the last position of the budget (both
            ended it: ``"stop"``).

    Returns:
        ``"stop"`` or ``"length"`` for each row, ``len == len(counts)``.
    """
    if eos_token_id is None and forced_eos_token_id is None and not budget_rows and not stopped_rows:
        # no EOS of any kind, no other budget, no stop string: a row that used its budget ended by it
        return [
            FINISH_REASON_LENGTH if max_new_tokens is not None and count >= max_new_tokens else FINISH_REASON_STOP
            for count in counts
        ]
    eos_ids = set(_as_id_list(eos_token_id))
    forced_ids = set(_as_id_list(forced_eos_token_id))
    budget_rows = set(budget_rows)
    stopped_rows = set(stopped_rows)
    reasons = []
    rows = sequences[:, prompt_length:].tolist() if eos_ids or forced_ids else None
    for row, count in enumerate(counts):
        last = rows[row][count - 1] if rows is not None and count > 0 else None
        full = max_new_tokens is not None and count >= max_new_tokens
        forced = full and last is not None and last in forced_ids
        ended_with_eos = last is not None and last in eos_ids and not forced
        if row in stopped_rows and not forced:
            reasons.append(FINISH_REASON_STOP)
        elif forced or (not ended_with_eos and (full or row in budget_rows)):
            reasons.append(FINISH_REASON_LENGTH)
        else:
            reasons.append(FINISH_REASON_STOP)
    return reasons


def step_tokens(lengths: Iterable[int], prompt_length: int, consecutive: bool = False) -> List[int]:
    """Tokens appended per sequence by each step, from the sequence length seen after each step.
    ``consecutive``: the caller knows the lengths grow by one a step (they were implied, not read:
    :meth:`~otel_generate.integrations.step_hook.StepRecorder.step_lengths`), so they are not compared."""
    lengths = lengths if type(lengths) is list else list(lengths)
    if lengths and (consecutive or lengths == list(range(lengths[0], lengths[0] + len(lengths)))):  # one token a step
        return [lengths[0] - prompt_length] + [1] * (len(lengths) - 1)
    return list(map(operator.sub, lengths, [prompt_length] + lengths[:-1]))
