"""``custom_generate``: a directory that re-enters ``generate()``, a loop of its own that cannot be seen,
a callable, and a checkpoint that ships one; each user call is one complete request."""

from __future__ import annotations

import pytest
import torch

from otel_generate import attributes as A
from tests.helpers import only_request, step_spans, tiny_models, uninstrumented_generate
from tests.integration.test_semconv import histogram_points

needs_custom_generate = pytest.mark.skipif(
    not hasattr(__import__("transformers").GenerationMixin, "load_custom_generate"),
    reason="custom_generate directories arrived in transformers 4.5x",
)


def custom_loop(call_criteria):
    namespace = {}
    exec(tiny_models.LOOP_SOURCE, namespace)
    loop = namespace["loop"]

    def run(model, input_ids, logits_processor=None, stopping_criteria=None, generation_config=None, **kwargs):
        return loop(
            model, input_ids, logits_processor, stopping_criteria, generation_config, call_criteria=call_criteria
        )

    return run


@needs_custom_generate
def test_custom_generate_directory_reentering_generate_is_one_complete_request(
    instrumented, span_exporter, metric_reader, gpt2, tmp_path
):
    ids = torch.tensor([[5, 6, 7, 8]])
    mask = torch.ones_like(ids)
    expected = uninstrumented_generate(gpt2, ids, attention_mask=mask, max_new_tokens=6, eos_token_id=None)
    directory = tiny_models.custom_generate_dir(str(tmp_path / "reenter"), "reenter")
    out = gpt2.generate(
        ids, attention_mask=mask, max_new_tokens=6, eos_token_id=None, custom_generate=directory, trust_remote_code=True
    )
    assert torch.equal(out, expected)
    request = only_request(span_exporter)
    attrs = request.attributes
    assert attrs[A.GEN_AI_USAGE_INPUT_TOKENS] == 4 and attrs[A.GEN_AI_USAGE_OUTPUT_TOKENS] == 6
    assert attrs[A.GENERATE_STEPS] == 6 == len(step_spans(span_exporter, request))
    assert attrs[A.GEN_AI_RESPONSE_FINISH_REASONS] == ("length",)
    assert attrs[A.GENERATE_STRATEGY] == A.STRATEGY_CUSTOM_GENERATE
    assert attrs[A.GENERATE_CUSTOM_GENERATE] == directory
    assert A.GENERATE_STEPS_INCOMPLETE not in attrs and A.GENERATE_STEPS_UNOBSERVED not in attrs
    assert not [s for s in span_exporter.get_finished_spans() if s.name == A.SPAN_INNER_GENERATE]
    (duration,) = histogram_points(metric_reader)[A.METRIC_REQUEST_DURATION]
    assert duration.count == 1


@needs_custom_generate
@pytest.mark.parametrize("kind", ["reenter_blind", "own_loop"])
def test_custom_generate_loop_that_cannot_be_seen_says_so(instrumented, span_exporter, gpt2, tmp_path, kind):
    ids = torch.tensor([[5, 6, 7, 8]])
    mask = torch.ones_like(ids)
    expected = uninstrumented_generate(gpt2, ids, attention_mask=mask, max_new_tokens=6, eos_token_id=None)
    directory = tiny_models.custom_generate_dir(str(tmp_path / kind), kind)
    out = gpt2.generate(
        ids, attention_mask=mask, max_new_tokens=6, eos_token_id=None, custom_generate=directory, trust_remote_code=True
    )
    assert torch.equal(out, expected)
    attrs = only_request(span_exporter).attributes
    assert attrs[A.GEN_AI_USAGE_INPUT_TOKENS] == 4 and attrs[A.GEN_AI_USAGE_OUTPUT_TOKENS] == 6
    assert attrs[A.GEN_AI_RESPONSE_FINISH_REASONS] == ("length",)
    assert attrs[A.GENERATE_STEPS_UNOBSERVED] == A.UNOBSERVED_CUSTOM_GENERATE
    assert A.GENERATE_STEPS not in attrs and A.GENERATE_STEPS_INCOMPLETE not in attrs
    assert attrs[A.GENERATE_CUSTOM_GENERATE] == directory
    assert step_spans(span_exporter) == []


@pytest.mark.skipif(
    "custom_generate"
    not in __import__("inspect").signature(__import__("transformers").GenerationMixin.generate).parameters,
    reason="custom_generate arrived in transformers 4.5x",
)
@pytest.mark.parametrize("call_criteria", [True, False])
def test_custom_generate_callable(instrumented, span_exporter, gpt2, call_criteria):
    ids = torch.tensor([[5, 6, 7, 8]])
    mask = torch.ones_like(ids)
    expected = uninstrumented_generate(gpt2, ids, attention_mask=mask, max_new_tokens=6, eos_token_id=None)
    loop = custom_loop(call_criteria)
    out = gpt2.generate(ids, attention_mask=mask, max_new_tokens=6, eos_token_id=None, custom_generate=loop)
    assert torch.equal(out, expected)
    attrs = only_request(span_exporter).attributes
    assert attrs[A.GEN_AI_USAGE_OUTPUT_TOKENS] == 6 and attrs[A.GEN_AI_RESPONSE_FINISH_REASONS] == ("length",)
    assert attrs[A.GENERATE_STRATEGY] == A.STRATEGY_CUSTOM_GENERATE
    assert attrs[A.GENERATE_CUSTOM_GENERATE].endswith("custom_loop.<locals>.run")
    assert A.GENERATE_STEPS_INCOMPLETE not in attrs
    if call_criteria:
        assert attrs[A.GENERATE_STEPS] == 6 and A.GENERATE_STEPS_UNOBSERVED not in attrs
    else:
        assert attrs[A.GENERATE_STEPS_UNOBSERVED] == A.UNOBSERVED_CUSTOM_GENERATE and A.GENERATE_STEPS not in attrs


@needs_custom_generate
@pytest.mark.parametrize("kind", ["reenter", "own_loop"])
def test_checkpoint_shipping_custom_generate(instrumented, span_exporter, gpt2, tmp_path, kind):
    """from_pretrained(trust_remote_code=True) sets model.generate on the instance, past every class hook."""
    import transformers

    ids = torch.tensor([[5, 6, 7, 8]])
    mask = torch.ones_like(ids)
    expected = uninstrumented_generate(gpt2, ids, attention_mask=mask, max_new_tokens=6, eos_token_id=None)
    directory = tiny_models.custom_generate_dir(str(tmp_path / kind), kind)
    gpt2.save_pretrained(directory)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True, local_files_only=True)
    assert "generate" in vars(model.eval())
    # the partial binds model= by keyword, so the prompt goes by keyword too (transformers' own quirk)
    out = model.generate(inputs=ids, attention_mask=mask, max_new_tokens=6, eos_token_id=None)
    assert torch.equal(out, expected)
    attrs = only_request(span_exporter).attributes
    assert attrs[A.GEN_AI_USAGE_OUTPUT_TOKENS] == 6 and attrs[A.GEN_AI_USAGE_INPUT_TOKENS] == 4
    assert attrs[A.GEN_AI_RESPONSE_FINISH_REASONS] == ("length",)
    assert A.GENERATE_STEPS_INCOMPLETE not in attrs
    if kind == "reenter":
        assert attrs[A.GENERATE_STEPS] == 6
    else:
        assert attrs[A.GENERATE_STEPS_UNOBSERVED] == A.UNOBSERVED_CUSTOM_GENERATE
