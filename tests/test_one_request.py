"""One user call, one complete request span (issue 10): strategies, finish reasons, inner calls."""

from __future__ import annotations

import pytest
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from otel_generate import attributes as A
from otel_generate.bench.models import EOS_TOKEN_ID

from conftest import prompt, request_spans, step_spans, uninstrumented_generate


def only_request(exporter):
    spans = request_spans(exporter)
    assert len(spans) == 1, [s.name for s in exporter.get_finished_spans()]
    return spans[0]


# --- finish reasons ---------------------------------------------------------------------------------


def test_max_time_ending_a_batch_is_length(instrumented, span_exporter, gpt2):
    ids, mask = prompt(batch=2, length=4, seed=30)
    gpt2.generate(ids, attention_mask=mask, max_new_tokens=2, eos_token_id=None)  # warm up outside the timing
    span_exporter.clear()
    out = gpt2.generate(ids, attention_mask=mask, max_new_tokens=400, max_time=0.3, eos_token_id=None)
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
    gpt2.generate(ids, attention_mask=mask, max_new_tokens=6, eos_token_id=None, pad_token_id=0,
                  stopping_criteria=StoppingCriteriaList([StopRowAt(0, 7)]))
    # an EOS the model produced by itself: EOS = the token the model emits first on this prompt
    first = int(uninstrumented_generate(gpt2, ids[:1], attention_mask=mask[:1], max_new_tokens=1,
                                        eos_token_id=None)[0, -1])
    gpt2.generate(ids[:1], attention_mask=mask[:1], max_new_tokens=6, eos_token_id=first)
    criterion, eos = sorted(request_spans(span_exporter), key=lambda s: s.start_time)
    assert criterion.attributes[A.GEN_AI_RESPONSE_FINISH_REASONS] == ("stop", "length")
    assert eos.attributes[A.GEN_AI_RESPONSE_FINISH_REASONS] == ("stop",)
    assert eos.attributes[A.GEN_AI_USAGE_OUTPUT_TOKENS] == 1


def test_stop_string_is_stop(instrumented, span_exporter, gpt2, tokenizer):
    ids, mask = prompt(length=4, seed=33)
    plain = uninstrumented_generate(gpt2, ids, attention_mask=mask, max_new_tokens=8, eos_token_id=None)
    text = tokenizer.decode(plain[0, 4:7])  # the first three generated tokens as text
    out = gpt2.generate(ids, attention_mask=mask, max_new_tokens=8, eos_token_id=None, stop_strings=[text],
                        tokenizer=tokenizer)
    assert out.shape[1] <= 7 and torch.equal(out[0], plain[0, : out.shape[1]])  # the stop string ended it
    request = only_request(span_exporter)
    assert request.attributes[A.GEN_AI_RESPONSE_FINISH_REASONS] == ("stop",)


# --- strategies -----------------------------------------------------------------------------------------


def test_prompt_lookup_and_use_mtp_flags_name_assisted(gpt2):
    from transformers import GenerationConfig

    from otel_generate.integrations.generate_loop import strategy_of

    assert strategy_of(GenerationConfig(use_mtp=True), None) == A.STRATEGY_ASSISTED
    assert strategy_of(GenerationConfig(prompt_lookup_num_tokens=3), None) == A.STRATEGY_ASSISTED
    assert strategy_of(GenerationConfig(assistant_early_exit=1), None) == A.STRATEGY_ASSISTED
    assert strategy_of(GenerationConfig(), gpt2) == A.STRATEGY_ASSISTED
    assert strategy_of(GenerationConfig(), None) == A.STRATEGY_GREEDY


def test_eos_id_constant_is_the_built_models(gpt2):
    assert gpt2.generation_config.eos_token_id == EOS_TOKEN_ID
