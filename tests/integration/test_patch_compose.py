"""Instrument and uninstrument compose with other tools (wrappers of other tools before and after ours).

``otel_generate._patch.Patches`` is the one place where this package installs and removes its patches.
``uninstrument()`` removes only our wrappers: a foreign wrapt wrapper applied after ours keeps
running (ours is spliced out from under it), one applied before ours is restored as the method,
and a foreign wrapper that is not a wrapt proxy and closes over ours leaves ours in place as a
pass-through with exactly one warning. In every case ``generate()`` keeps returning what the
uninstrumented ``generate()`` returns, and no request span is emitted after ``uninstrument()``.
"""

from __future__ import annotations

import functools
import logging

import pytest
import torch
import wrapt
from transformers.generation.utils import GenerationMixin

from otel_generate import GenerateInstrumentor
from tests.helpers import prompt, request_spans

PATCHED = ("generate", "_prepare_generated_length", "_get_stopping_criteria")
NEW_TOKENS = 3


@pytest.fixture
def pristine():
    """The three methods exactly as transformers defines them, restored after the test whatever happened."""
    before = {name: vars(GenerationMixin)[name] for name in PATCHED}
    assert not isinstance(before["generate"], wrapt.FunctionWrapper), "a previous test left generate() wrapped"
    yield before
    instrumentor = GenerateInstrumentor()
    if instrumentor.is_instrumented_by_opentelemetry:
        instrumentor.uninstrument()
    for name, original in before.items():
        setattr(GenerationMixin, name, original)


@pytest.fixture
def reference(gpt2):
    """The uninstrumented output for the prompt every test uses."""
    ids, mask = prompt(length=4, seed=3)
    return gpt2.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None)


def _generate(model):
    ids, mask = prompt(length=4, seed=3)
    return model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None)


class Counting:
    """A foreign wrapt wrapper (another instrumentation, a profiler): counts its calls, passes through."""

    def __init__(self):
        self.calls = 0

    def __call__(self, wrapped, instance, args, kwargs):
        self.calls += 1
        return wrapped(*args, **kwargs)


def test_foreign_wrapt_wrapper_applied_after_ours_keeps_running_after_uninstrument(
    pristine, reference, gpt2, tracer_provider, span_exporter
):
    instrumentor = GenerateInstrumentor()
    instrumentor.instrument(tracer_provider=tracer_provider)
    foreign = Counting()
    wrapt.wrap_function_wrapper("transformers.generation.utils", "GenerationMixin.generate", foreign)
    output = _generate(gpt2)
    assert foreign.calls == 1 and len(request_spans(span_exporter)) == 1  # both wrappers ran
    assert torch.equal(output, reference)

    instrumentor.uninstrument()
    outer = vars(GenerationMixin)["generate"]
    assert isinstance(outer, wrapt.FunctionWrapper)  # the foreign wrapper is still installed ...
    assert outer.__wrapped__ is pristine["generate"]  # ... directly over transformers' own function
    for name in ("_prepare_generated_length", "_get_stopping_criteria"):
        assert vars(GenerationMixin)[name] is pristine[name]
    assert "__init_subclass__" not in vars(GenerationMixin) and instrumentor._patches is None

    output = _generate(gpt2)
    assert foreign.calls == 2  # the foreign wrapper still runs
    assert len(request_spans(span_exporter)) == 1  # and no request span of ours
    assert torch.equal(output, reference)


def test_foreign_wrapt_wrapper_applied_before_ours_is_the_method_again_after_uninstrument(
    pristine, reference, gpt2, tracer_provider, span_exporter
):
    foreign = Counting()
    installed = wrapt.wrap_function_wrapper("transformers.generation.utils", "GenerationMixin.generate", foreign)
    instrumentor = GenerateInstrumentor()
    instrumentor.instrument(tracer_provider=tracer_provider)
    assert torch.equal(_generate(gpt2), reference)
    assert foreign.calls == 1 and len(request_spans(span_exporter)) == 1

    instrumentor.uninstrument()
    assert vars(GenerationMixin)["generate"] is installed
    assert torch.equal(_generate(gpt2), reference)
    assert foreign.calls == 2 and len(request_spans(span_exporter)) == 1


def test_a_closure_over_our_wrapper_leaves_it_inert_with_one_warning_and_instrumenting_again_works(
    pristine, reference, gpt2, tracer_provider, span_exporter, caplog
):
    instrumentor = GenerateInstrumentor()
    instrumentor.instrument(tracer_provider=tracer_provider)
    ours = vars(GenerationMixin)["generate"]
    calls = []

    @functools.wraps(ours)
    def foreign(self, *args, **kwargs):  # not a wrapt proxy: it calls ours through its closure
        calls.append(1)
        return ours(self, *args, **kwargs)

    GenerationMixin.generate = foreign
    caplog.set_level(logging.WARNING)
    instrumentor.uninstrument()
    warnings = [r for r in caplog.records if r.name == "otel_generate" and r.levelno == logging.WARNING]
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    assert "GenerationMixin.generate" in message and "pass-through" in message and "not a wrapt proxy" in message
    assert "_get_stopping_criteria" not in message  # the other two were removed cleanly
    assert vars(GenerationMixin)["generate"] is foreign  # the foreign wrapper stays

    assert torch.equal(_generate(gpt2), reference)
    assert len(calls) == 1 and request_spans(span_exporter) == []  # ours passed through

    # instrument again: one request span per call (the inert wrapper adds none), then a clean uninstrument
    caplog.clear()
    instrumentor.instrument(tracer_provider=tracer_provider)
    assert torch.equal(_generate(gpt2), reference)
    assert len(request_spans(span_exporter)) == 1 and len(calls) == 2
    instrumentor.uninstrument()
    assert [r for r in caplog.records if r.name == "otel_generate" and r.levelno >= logging.WARNING] == []
    assert vars(GenerationMixin)["generate"] is foreign
    assert torch.equal(_generate(gpt2), reference)
    assert len(request_spans(span_exporter)) == 1 and len(calls) == 3


def test_instrument_uninstrument_instrument_again(pristine, reference, gpt2, tracer_provider, span_exporter):
    instrumentor = GenerateInstrumentor()
    for round_ in (1, 2):
        instrumentor.instrument(tracer_provider=tracer_provider)
        assert set(PATCHED) <= {name for owner, name in instrumentor._patches.installed() if owner is GenerationMixin}
        assert torch.equal(_generate(gpt2), reference)
        assert len(request_spans(span_exporter)) == round_
        instrumentor.uninstrument()
        assert {name: vars(GenerationMixin)[name] for name in PATCHED} == pristine
        assert torch.equal(_generate(gpt2), reference)
        assert len(request_spans(span_exporter)) == round_


def test_a_bound_method_taken_while_instrumented_records_nothing_after_uninstrument(
    pristine, reference, gpt2, tracer_provider, span_exporter
):
    instrumentor = GenerateInstrumentor()
    instrumentor.instrument(tracer_provider=tracer_provider)
    generate = gpt2.generate  # bound through our wrapper
    instrumentor.uninstrument()
    ids, mask = prompt(length=4, seed=3)
    output = generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None)
    assert torch.equal(output, reference)
    assert request_spans(span_exporter) == []
