"""Token accounting from tensors (:mod:`otel_generate.tokens`), against plain-Python references."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from otel_generate.tokens import counts_from_done


def first_marked_counts(marks, lengths, prompt_length, width):
    """What a row's count is, per ``counts_from_done``'s docstring, computed per value in Python:
    the length after the first step whose mark is nonzero, less the prompt, clamped to the
    continuation; the whole continuation when no step marked the row."""
    counts = []
    for row in range(len(marks[0])):
        step = next((index for index, step_marks in enumerate(marks) if step_marks[row] != 0), None)
        counts.append(width if step is None else min(max(lengths[step] - prompt_length, 0), width))
    return counts


@st.composite
def done_lists(draw):
    rows = draw(st.sampled_from((1, 1, 2, 3, 4)))  # (one row and several take different paths)
    steps = draw(st.integers(1, 24))
    long_valued = draw(st.booleans())  # a user criterion's LongTensor: bool | long gives long values
    values = st.integers(0, 3) if long_valued else st.booleans()
    marks = draw(st.lists(st.lists(values, min_size=rows, max_size=rows), min_size=steps, max_size=steps))
    prompt_length = draw(st.integers(0, 6))
    # one token a step, or a step that appended several (assisted decoding), from the prompt on
    grown = draw(st.lists(st.integers(1, 3), min_size=steps, max_size=steps))
    lengths = [prompt_length + sum(grown[: index + 1]) for index in range(steps)]
    total = prompt_length + draw(st.integers(0, lengths[-1] - prompt_length + 2))
    return marks, lengths, prompt_length, total, long_valued


@settings(max_examples=200, deadline=None)
@given(done_lists())
def test_counts_from_done_is_each_rows_first_marked_step(case):
    marks, lengths, prompt_length, total, long_valued = case
    dtype = torch.long if long_valued else torch.bool
    done = [torch.tensor(step_marks, dtype=dtype) for step_marks in marks]
    sequences = torch.zeros((len(marks[0]), total), dtype=torch.long)
    expected = first_marked_counts(marks, lengths, prompt_length, total - prompt_length)
    assert counts_from_done(done, lengths, prompt_length, sequences) == expected


def test_counts_from_done_declines_steps_that_do_not_line_up():
    sequences = torch.zeros((2, 8), dtype=torch.long)
    two_rows = torch.tensor([False, True])
    # steps of different shapes, a step for the wrong number of rows, a step per length missing
    assert counts_from_done([two_rows, torch.tensor([True])], [5, 6], 4, sequences) is None
    assert counts_from_done([torch.tensor([True, False, False])], [5], 4, sequences) is None
    assert counts_from_done([two_rows], [5, 6], 4, sequences) is None
    assert counts_from_done([], [], 4, sequences) is None
    assert counts_from_done([torch.tensor([[True, False]])], [5], 4, sequences) is None


@settings(max_examples=120, deadline=None)
@given(
    rows=st.integers(1, 5),
    width=st.integers(1, 40),  # (masks of up to 32 values are summed from a list, larger ones as tensors)
    dtype=st.sampled_from((torch.long, torch.int32, torch.bool, torch.float32)),
    embeddings=st.booleans(),
    data=st.data(),
)
def test_input_tokens_with_a_mask_are_the_masks_ones(rows, width, dtype, embeddings, data):
    """With a mask of the prompt's shape, the input tokens are the mask's nonzero positions,
    counted here per value in Python, whatever the mask's size and dtype (a token-id or an
    embeddings prompt); a mask of another shape is not used (every position counts)."""
    from otel_generate.tokens import count_input_tokens

    row = st.lists(st.integers(0, 1), min_size=width, max_size=width)
    marks = data.draw(st.lists(row, min_size=rows, max_size=rows))
    mask = torch.tensor(marks).to(dtype)
    inputs = torch.zeros((rows, width, 3)) if embeddings else torch.zeros((rows, width), dtype=torch.long)
    expected = sum(value for row in marks for value in row)
    got = count_input_tokens(inputs, mask)
    assert type(got) is int and got == expected
    assert count_input_tokens(inputs, torch.ones((rows, width + 1), dtype=dtype)) == rows * width
    # a fractional float mask (not a 0/1 mask) is summed as a tensor whatever its size: as before
    fractional = torch.full((rows, width), 0.9)
    assert count_input_tokens(inputs, fractional) == int(fractional.sum().item())


@settings(max_examples=80, deadline=None)
@given(
    counts=st.lists(st.integers(0, 8), min_size=1, max_size=5),
    max_new=st.one_of(st.none(), st.integers(0, 8)),
)
def test_reasons_without_an_eos_are_length_for_a_row_that_used_its_budget(counts, max_new):
    """With no EOS, no forced EOS, no other budget and no stop string, a row is ``length`` when it
    used its whole budget and ``stop`` otherwise (a user's criterion ended it): as the general
    path (taken here with an iterator of no rows) says."""
    from otel_generate.tokens import finish_reasons

    sequences = torch.zeros((len(counts), 12), dtype=torch.long)
    expected = ["length" if max_new is not None and count >= max_new else "stop" for count in counts]
    assert finish_reasons(sequences, 4, counts, max_new) == expected
    assert finish_reasons(sequences, 4, counts, max_new, budget_rows=iter(())) == expected
