"""Finish reasons of the ``generate()`` loop, per returned row: ``max_time`` and a forced EOS at the last
budget position are ``length``; the model's EOS, user stopping criteria and stop strings are ``stop``."""

from __future__ import annotations

import time

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from otel_generate import attributes as A
from tests.helpers import only_request, prompt, request_spans, uninstrumented_generate


class SleepEachStep(LogitsProcessor):
    def __init__(self, seconds):
        self.seconds = seconds

    def __call__(self, input_ids, scores):
        time.sleep(self.seconds)
        return scores


@pytest.mark.parametrize("wall_clock_ahead_s", [0.0, 0.05], ids=["clocks_agree", "wall_clock_ahead"])
def test_max_time_ending_a_batch_is_length(instrumented, span_exporter, gpt2, monkeypatch, wall_clock_ahead_s):
    """``max_time`` ends the rows still running: ``length``. The VM's wall clock can be stepped
    against the monotonic clock during a request: with ``wall_clock_ahead``, ``MaxTimeCriteria``
    reads a wall clock 50 ms ahead of the one the request's step times are converted to, so the
    last step reads as ending before the deadline the criteria saw passed. With only the criteria
    generate() builds itself, what else ended a row is told from its tokens, not from the clocks."""
    if wall_clock_ahead_s:
        from types import SimpleNamespace

        from transformers.generation import stopping_criteria

        real_time = time.time
        monkeypatch.setattr(stopping_criteria, "time", SimpleNamespace(time=lambda: real_time() + wall_clock_ahead_s))
    ids, mask = prompt(batch=2, length=4, seed=30)
    # 400 steps of at least 5 ms cannot finish in 0.3 s, however fast the machine
    out = gpt2.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=400,
        max_time=0.3,
        eos_token_id=None,
        logits_processor=LogitsProcessorList([SleepEachStep(0.005)]),
    )
    new = out.shape[1] - 4
    assert 1 <= new < 400  # max_time, not the token budget, ended it
    request = only_request(span_exporter)
    assert request.attributes[A.GEN_AI_RESPONSE_FINISH_REASONS] == ("length", "length")
    assert request.attributes[A.GEN_AI_USAGE_OUTPUT_TOKENS] == 2 * new


def test_forced_eos_at_the_last_budget_position_is_length(instrumented, span_exporter, gpt2):
    ids, mask = prompt(length=4, seed=31)
    forced = 126  # the built gpt2 never emits it on this prompt by itself (checked below)
    plain = uninstrumented_generate(gpt2, ids, attention_mask=mask, max_new_tokens=6, eos_token_id=forced)
    assert forced not in plain[0, 4:].tolist()
    out = gpt2.generate(ids, attention_mask=mask, max_new_tokens=6, forced_eos_token_id=forced, eos_token_id=forced)
    assert out.shape[1] == 10 and int(out[0, -1]) == forced  # EOS written at the last budget position
    request = only_request(span_exporter)
    assert request.attributes[A.GEN_AI_RESPONSE_FINISH_REASONS] == ("length",)
    assert request.attributes[A.GEN_AI_USAGE_OUTPUT_TOKENS] == 6


class StopRowAt(StoppingCriteria):
    """Stops row ``row`` once it has ``length`` tokens (a user criterion)."""

    def __init__(self, row, length):
        self.row, self.length = row, length

    def __call__(self, input_ids, scores, **kwargs):
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        if input_ids.shape[1] >= self.length:
            done[self.row] = True
        return done


def test_model_eos_and_user_criteria_are_stop(instrumented, span_exporter, gpt2):
    ids, mask = prompt(batch=2, length=4, seed=32)
    # row 0 stopped by a user criterion after 3 tokens, row 1 by the budget of 6
    gpt2.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=6,
        eos_token_id=None,
        pad_token_id=0,
        stopping_criteria=StoppingCriteriaList([StopRowAt(0, 7)]),
    )
    # an EOS the model produced by itself: EOS = the token the model emits first on this prompt
    first = int(
        uninstrumented_generate(gpt2, ids[:1], attention_mask=mask[:1], max_new_tokens=1, eos_token_id=None)[0, -1]
    )
    gpt2.generate(ids[:1], attention_mask=mask[:1], max_new_tokens=6, eos_token_id=first)
    criterion, eos = sorted(request_spans(span_exporter), key=lambda s: s.start_time)
    assert criterion.attributes[A.GEN_AI_RESPONSE_FINISH_REASONS] == ("stop", "length")
    assert eos.attributes[A.GEN_AI_RESPONSE_FINISH_REASONS] == ("stop",)
    assert eos.attributes[A.GEN_AI_USAGE_OUTPUT_TOKENS] == 1


def test_stop_string_is_stop(instrumented, span_exporter, gpt2, tokenizer):
    ids, mask = prompt(length=4, seed=33)
    plain = uninstrumented_generate(gpt2, ids, attention_mask=mask, max_new_tokens=8, eos_token_id=None)
    text = tokenizer.decode(plain[0, 4:7])  # the first three generated tokens as text
    out = gpt2.generate(
        ids, attention_mask=mask, max_new_tokens=8, eos_token_id=None, stop_strings=[text], tokenizer=tokenizer
    )
    assert out.shape[1] <= 7 and torch.equal(out[0], plain[0, : out.shape[1]])  # the stop string ended it
    request = only_request(span_exporter)
    assert request.attributes[A.GEN_AI_RESPONSE_FINISH_REASONS] == ("stop",)
