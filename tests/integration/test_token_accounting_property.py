"""Property test of the token accounting, with hypothesis.

Random small batches, prompt lengths, left padding per row, EOS positions, ``max_new_tokens`` and
decoding strategies (greedy, multinomial sampling with a fixed seed, beam search with 2 beams and 1
or 2 returned sequences). For every case the request span's ``gen_ai.usage.input_tokens``,
``gen_ai.usage.output_tokens`` and ``gen_ai.response.finish_reasons`` must equal a reference counted
from the input mask and the output tensor by a plain Python loop written here (not
``otel_generate.tokens``), and the instrumented output must equal the uninstrumented one.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from transformers import LogitsProcessor, LogitsProcessorList

from otel_generate import GenerateInstrumentor
from otel_generate import attributes as A
from otel_generate.bench.models import EOS_TOKEN_ID, PAD_TOKEN_ID
from tests.helpers import request_spans, step_spans, uninstrumented_generate
from tests.helpers.instrumenting import DrainingSpanExporter

NUM_BEAMS = 2


class ForceEosAt(LogitsProcessor):
    """EOS only where the case says: row ``r`` emits EOS as its ``eos_at[r]``-th new token (0-based).

    EOS is forbidden everywhere else, and PAD is never generated, so that every PAD in a continuation
    is padding written by transformers and every EOS is the one forced here.
    """

    def __init__(self, prompt_length, eos_at, beams_per_row):
        self.prompt_length = prompt_length
        self.eos_at = eos_at
        self.beams_per_row = beams_per_row

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        scores[:, PAD_TOKEN_ID] = -float("inf")
        scores[:, EOS_TOKEN_ID] = -float("inf")
        step = input_ids.shape[-1] - self.prompt_length
        for index in range(input_ids.shape[0]):  # beams of row r are rows r*beams .. r*beams+beams-1
            if self.eos_at[index // self.beams_per_row] == step:
                scores[index, :] = -float("inf")
                scores[index, EOS_TOKEN_ID] = 0.0
        return scores


@st.composite
def cases(draw):
    batch = draw(st.integers(1, 3))
    length = draw(st.integers(1, 6))
    max_new_tokens = draw(st.integers(1, 6))
    strategy = draw(st.sampled_from(["greedy", "sample", "beam_search"]))
    return dict(
        batch=batch,
        length=length,
        padding=[draw(st.integers(0, length - 1)) for _ in range(batch)],  # every row keeps >= 1 real token
        eos_at=[draw(st.none() | st.integers(0, max_new_tokens - 1)) for _ in range(batch)],
        max_new_tokens=max_new_tokens,
        strategy=strategy,
        returned=draw(st.integers(1, 2)) if strategy == "beam_search" else 1,
        seed=draw(st.integers(0, 2**16)),
    )


def reference(sequences, prompt_length, attention_mask):
    """Input tokens, output tokens per returned sequence, finish reasons: read off the tensors."""
    input_tokens = 0
    for row in attention_mask.tolist():
        for value in row:
            input_tokens += value
    counts, reasons = [], []
    for row in sequences.tolist():
        count, stopped = 0, False
        for token in row[prompt_length:]:
            if stopped:
                # after the EOS only transformers' fill: PAD, or EOS in transformers 5's beam search,
                # whose fill value is `pad_token_id or eos_token_id[0]` (a pad id of 0 falls through)
                assert token in (PAD_TOKEN_ID, EOS_TOKEN_ID), row
                continue
            count += 1
            stopped = token == EOS_TOKEN_ID
        counts.append(count)
        reasons.append("stop" if stopped else "length")
    return input_tokens, counts, reasons


@pytest.fixture(scope="module")
def exporter():
    exporter = DrainingSpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    instrumentor = GenerateInstrumentor()
    instrumentor.instrument(tracer_provider=provider)
    yield exporter
    instrumentor.uninstrument()


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_token_accounting_matches_the_output_tensor(exporter, gpt2, case):
    torch.set_num_threads(1)
    exporter.clear()
    batch, length = case["batch"], case["length"]
    ids = torch.randint(1, EOS_TOKEN_ID, (batch, length), generator=torch.Generator().manual_seed(case["seed"]))
    mask = torch.ones_like(ids)
    for row, pads in enumerate(case["padding"]):
        ids[row, :pads] = PAD_TOKEN_ID
        mask[row, :pads] = 0
    beams = NUM_BEAMS if case["strategy"] == "beam_search" else 1
    kwargs = dict(
        attention_mask=mask,
        max_new_tokens=case["max_new_tokens"],
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=PAD_TOKEN_ID,
        do_sample=case["strategy"] == "sample",
        num_beams=beams,
        num_return_sequences=case["returned"],
    )

    def run(generate):
        processor = ForceEosAt(length, case["eos_at"], beams)
        torch.manual_seed(case["seed"])
        return generate(ids, logits_processor=LogitsProcessorList([processor]), **kwargs)

    expected = run(lambda *a, **k: uninstrumented_generate(gpt2, *a, **k))
    out = run(gpt2.generate)
    assert torch.equal(out, expected)

    input_tokens, counts, reasons = reference(out, length, mask)
    (request,) = request_spans(exporter)
    attrs = request.attributes
    assert out.shape[0] == batch * case["returned"]
    assert attrs[A.GEN_AI_USAGE_INPUT_TOKENS] == input_tokens == batch * length - sum(case["padding"])
    assert attrs[A.GEN_AI_USAGE_OUTPUT_TOKENS] == sum(counts)
    assert list(attrs[A.GEN_AI_RESPONSE_FINISH_REASONS]) == reasons
    assert attrs[A.GENERATE_STRATEGY] == case["strategy"]
    if case["strategy"] != "beam_search":
        # one token per step and row: the reference is also what the case asked for
        wanted = [case["max_new_tokens"] if at is None else at + 1 for at in case["eos_at"]]
        assert counts == wanted
        assert attrs[A.GENERATE_STEPS] == out.shape[-1] - length == max(wanted)
        assert len(step_spans(exporter, request)) == max(wanted)
