"""Paths into ``generate()`` besides the plain loop, each user call one complete request span: Whisper's
windows and fallback attempts, model classes that override ``generate()`` (and subclasses defined after
``instrument()``), compiled ``generate()``, multi-token prediction, and the strategy flags that name
assisted decoding. Finish reasons are in test_finish_reasons.py, ``custom_generate`` in
test_custom_generate.py."""

from __future__ import annotations

import pytest
import torch

from otel_generate import attributes as A
from otel_generate.bench.models import EOS_TOKEN_ID
from tests.helpers import only_request, prompt, request_spans, step_spans, tiny_models, uninstrumented_generate
from tests.integration.test_semconv import histogram_points

# --- strategies -----------------------------------------------------------------------------------------


def test_prompt_lookup_and_use_mtp_flags_name_assisted(gpt2):
    from transformers import GenerationConfig

    from otel_generate.integrations._routing import strategy_of

    assert strategy_of(GenerationConfig(use_mtp=True), None) == A.STRATEGY_ASSISTED
    assert strategy_of(GenerationConfig(prompt_lookup_num_tokens=3), None) == A.STRATEGY_ASSISTED
    assert strategy_of(GenerationConfig(assistant_early_exit=1), None) == A.STRATEGY_ASSISTED
    assert strategy_of(GenerationConfig(), gpt2) == A.STRATEGY_ASSISTED
    assert strategy_of(GenerationConfig(), None) == A.STRATEGY_GREEDY


def test_eos_id_constant_is_the_built_models(gpt2):
    assert gpt2.generation_config.eos_token_id == EOS_TOKEN_ID


# --- custom_generate --------------------------------------------------------------------------------------


# --- Whisper: one request for all windows and attempts -----------------------------------------------------


@pytest.fixture(scope="module")
def whisper():
    return tiny_models.whisper()


def inner_spans(exporter, request):
    spans = [
        s
        for s in exporter.get_finished_spans()
        if s.name == A.SPAN_INNER_GENERATE and s.parent.span_id == request.context.span_id
    ]
    return sorted(spans, key=lambda s: s.attributes[A.GENERATE_CALL_INDEX])


def generated_per_inner_call(model, **kwargs):
    """Tokens each base generate() call generates, counted from its own output, uninstrumented."""
    from transformers.generation.utils import GenerationMixin

    from otel_generate.tokens import count_new_tokens

    counts = []
    original = GenerationMixin.__dict__["generate"]

    def counting(self, *args, **kw):
        width = kw["decoder_input_ids"].shape[-1]
        out = original(self, *args, **kw)
        sequences = out if torch.is_tensor(out) else out.sequences
        counts.append(sum(count_new_tokens(sequences, width, tiny_models.WHISPER_EOS, tiny_models.WHISPER_EOS)))
        return out

    GenerationMixin.generate = counting
    try:
        uninstrumented_generate(model, **kwargs)
    finally:
        GenerationMixin.generate = original
    return counts


@pytest.mark.parametrize("frames", [6500, 3000], ids=["65s", "30s"])
def test_whisper_long_form_is_one_request(instrumented, span_exporter, metric_reader, whisper, frames):
    torch.manual_seed(0)
    features = torch.randn(1, 80, frames)
    kwargs = dict(
        input_features=features, attention_mask=torch.ones(1, frames), return_timestamps=True, max_new_tokens=20
    )
    per_call = generated_per_inner_call(whisper, **kwargs)
    expected = uninstrumented_generate(whisper, **kwargs)
    out = whisper.generate(**kwargs)
    assert torch.equal(out, expected)

    requests = request_spans(span_exporter)
    assert len(requests) == 1  # one text_completion span, whatever the windows
    request = requests[0]
    assert request.name == "text_completion WhisperForConditionalGeneration"
    assert request.attributes[A.GEN_AI_USAGE_OUTPUT_TOKENS] == sum(per_call)
    inner = inner_spans(span_exporter, request)
    if len(per_call) == 1:  # one window (a 30 s input on transformers 4.x): no grouping span
        assert inner == []
    else:
        assert [s.attributes[A.GENERATE_CALL_OUTPUT_TOKENS] for s in inner] == per_call
        assert [s.attributes[A.GENERATE_WINDOW_INDEX] for s in inner] == list(range(len(per_call)))
        assert all(s.attributes[A.GENERATE_ATTEMPT_KEPT] for s in inner)
    # step and token indices count over the whole call, in time order
    steps = sorted(step_spans(span_exporter), key=lambda s: s.start_time)
    assert [s.attributes[A.GENERATE_STEP_INDEX] for s in steps] == list(range(request.attributes[A.GENERATE_STEPS]))
    assert [s.attributes[A.GENERATE_TOKEN_INDEX] for s in steps] == list(range(len(steps)))
    assert sum(s.name == A.STEP_SPAN_PREFILL for s in steps) == len(inner or [request])
    for group in inner:
        children = [s for s in steps if s.parent.span_id == group.context.span_id]
        assert len(children) == group.attributes[A.GENERATE_CALL_STEPS]
        assert group.start_time >= request.start_time and group.end_time <= request.end_time
    (duration,) = histogram_points(metric_reader)[A.METRIC_REQUEST_DURATION]
    assert duration.count == 1


def test_whisper_fallback_attempts_are_grouped_and_the_discarded_ones_counted(instrumented, span_exporter, whisper):
    """logprob_threshold=0.0: every attempt falls back (an average log-probability is below 0), the last is kept."""
    torch.manual_seed(0)
    kwargs = dict(
        input_features=torch.randn(1, 80, 3000),
        attention_mask=torch.ones(1, 3000),
        max_new_tokens=6,
        temperature=(0.0, 0.2, 0.4),
        logprob_threshold=0.0,
        do_sample=False,
    )
    whisper.generate(**kwargs)
    request = only_request(span_exporter)
    inner = inner_spans(span_exporter, request)
    window0 = [s for s in inner if s.attributes[A.GENERATE_WINDOW_INDEX] == 0]
    assert [s.attributes[A.GENERATE_ATTEMPT_INDEX] for s in window0] == [0, 1, 2]
    assert [s.attributes[A.GENERATE_ATTEMPT_TEMPERATURE] for s in window0] == [0.0, 0.2, 0.4]
    assert [s.attributes[A.GENERATE_ATTEMPT_KEPT] for s in window0] == [False, False, True]
    assert [s.attributes[A.GENERATE_STRATEGY] for s in window0] == ["greedy", "sample", "sample"]
    tokens = [s.attributes[A.GENERATE_CALL_OUTPUT_TOKENS] for s in inner]
    discarded = sum(
        s.attributes[A.GENERATE_CALL_OUTPUT_TOKENS] for s in inner if not s.attributes[A.GENERATE_ATTEMPT_KEPT]
    )
    assert request.attributes[A.GEN_AI_USAGE_OUTPUT_TOKENS] == sum(tokens)
    assert request.attributes[A.GENERATE_USAGE_DISCARDED_OUTPUT_TOKENS] == discarded > 0


# --- models that override generate() ---------------------------------------------------------------------


def overriding_classes():
    """(module, class) of every class in transformers' model sources that defines its own generate(),
    read from the source files without importing them."""
    import ast
    import pathlib

    import transformers

    found = []
    root = pathlib.Path(transformers.__file__).parent / "models"
    for path in sorted(root.glob("*/*.py")):
        text = path.read_text(encoding="utf-8")
        if "def generate(" not in text:
            continue
        for node in ast.parse(text).body:
            if isinstance(node, ast.ClassDef) and any(
                isinstance(item, ast.FunctionDef) and item.name == "generate" for item in node.body
            ):
                found.append((f"transformers.models.{path.parent.name}.{path.stem}", node.name))
    return found


REPRESENTATIVES = {
    # class the user calls: (builder, inputs, inner base-generate calls)
    "Blip2ForConditionalGeneration": (tiny_models.blip2, tiny_models.blip2_inputs, 1),
    "MusicgenForCausalLM": (tiny_models.musicgen, tiny_models.musicgen_inputs, 1),
    "SeamlessM4TForTextToSpeech": (tiny_models.seamless, tiny_models.seamless_inputs, 2),
    "BarkModel": (tiny_models.bark, tiny_models.bark_inputs, 7),
}


def test_model_classes_overriding_generate_are_enumerated_and_hooked(instrumented):
    import importlib

    from transformers.generation.utils import GenerationMixin

    found = overriding_classes()
    classes = {name for _, name in found}
    assert len(found) >= 30  # about 55 in transformers 5.x, 38 in 4.46
    for name in (
        "WhisperGenerationMixin",
        "Blip2ForConditionalGeneration",
        "MusicgenForCausalLM",
        "BarkModel",
        "BarkCoarseModel",
        "SeamlessM4TForTextToSpeech",
    ):
        assert name in classes, name
    # every one of them that is a GenerationMixin has its own generate hooked once imported
    patched = 0
    for module_name, name in found:
        if not any(key in module_name for key in ("whisper", "blip_2", "musicgen.", "bark", "seamless_m4t.")):
            continue
        if ".modeling_flax_" in module_name or ".modeling_tf_" in module_name:  # other frameworks (4.x)
            continue
        cls = getattr(importlib.import_module(module_name), name)
        if issubclass(cls, GenerationMixin):
            assert instrumented._patches.is_installed(cls, "generate"), name
            patched += 1
    assert patched >= 6


@pytest.mark.parametrize("name", sorted(REPRESENTATIVES))
def test_overriding_model_gives_one_request_per_call(instrumented, span_exporter, metric_reader, name):
    build, inputs, inner_calls = REPRESENTATIVES[name]
    model = build()
    torch.manual_seed(0)
    expected = uninstrumented_generate(model, **inputs())
    torch.manual_seed(0)
    out = model.generate(**inputs())
    expected = expected if torch.is_tensor(expected) else expected[0]
    out = out if torch.is_tensor(out) else out[0]
    assert torch.equal(out, expected)
    requests = request_spans(span_exporter)
    assert [r.name for r in requests] == [f"text_completion {name}"]
    request = requests[0]
    assert request.attributes[A.GEN_AI_REQUEST_MODEL] == name  # the model the user called, not an inner one
    inner = inner_spans(span_exporter, request)
    assert len(inner) == (inner_calls if inner_calls > 1 else 0)
    steps = step_spans(span_exporter)
    assert len(steps) == request.attributes[A.GENERATE_STEPS] > 0
    assert A.GENERATE_STEPS_INCOMPLETE not in request.attributes
    if inner:
        assert request.attributes[A.GEN_AI_USAGE_OUTPUT_TOKENS] == sum(
            s.attributes[A.GENERATE_CALL_OUTPUT_TOKENS] for s in inner
        )
    (duration,) = histogram_points(metric_reader)[A.METRIC_REQUEST_DURATION]
    assert duration.count == 1


def test_subclass_defined_after_instrument_is_one_request(instrumented, span_exporter, gpt2):
    import transformers

    class Wrapped(transformers.GPT2LMHeadModel):
        def generate(self, *args, **kwargs):  # two base calls, like a model that drafts then refines
            first = super().generate(*args, **kwargs)
            return super().generate(first, max_new_tokens=2, eos_token_id=None)

    model = Wrapped(gpt2.config).eval()
    model.load_state_dict(gpt2.state_dict())
    ids, mask = prompt(length=4, seed=34)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=3, eos_token_id=None)
    assert out.shape[1] == 4 + 3 + 2
    request = only_request(span_exporter)
    assert request.name == "text_completion Wrapped"
    inner = inner_spans(span_exporter, request)
    assert [s.attributes[A.GENERATE_CALL_OUTPUT_TOKENS] for s in inner] == [3, 2]
    assert request.attributes[A.GEN_AI_USAGE_OUTPUT_TOKENS] == 5 and request.attributes[A.GENERATE_STEPS] == 5
    steps = step_spans(span_exporter)
    assert [s.attributes[A.GENERATE_TOKEN_INDEX] for s in steps] == [0, 1, 2, 3, 4]
    assert [s.name for s in steps] == ["prefill", "decode", "decode", "prefill", "decode"]


# --- compiled generate, use_mtp -------------------------------------------------------------------------------


def _transformers_at_least(version):
    import transformers
    from packaging.version import Version

    return Version(Version(transformers.__version__).base_version) >= Version(version)


@pytest.mark.skipif(
    not _transformers_at_least("4.47"),
    reason="torch.compile(model.generate) fails uninstrumented on transformers 4.46 (unused model_kwargs)",
)
@pytest.mark.parametrize("how", ["compile(model.generate)", "compile(model).generate"])
def test_compiled_generate_is_one_complete_request(instrumented, span_exporter, gpt2, how):
    torch._dynamo.reset()
    ids = torch.tensor([[5, 6, 7, 8]])
    mask = torch.ones_like(ids)
    expected = uninstrumented_generate(gpt2, ids, attention_mask=mask, max_new_tokens=5, eos_token_id=None)
    if how == "compile(model.generate)":
        generate = torch.compile(gpt2.generate, backend="eager")
    else:
        generate = torch.compile(gpt2, backend="eager").generate
    out = generate(ids, attention_mask=mask, max_new_tokens=5, eos_token_id=None)
    assert torch.equal(out, expected)
    attrs = only_request(span_exporter).attributes
    assert attrs[A.GEN_AI_USAGE_OUTPUT_TOKENS] == 5 and attrs[A.GEN_AI_USAGE_INPUT_TOKENS] == 4
    assert attrs[A.GENERATE_STEPS] == 5 and A.GENERATE_STEPS_INCOMPLETE not in attrs


@pytest.mark.skipif(not hasattr(__import__("transformers"), "MellumConfig"), reason="no multi-token prediction here")
def test_use_mtp_is_assisted_decoding_by_the_mtp_generator(instrumented, span_exporter, tmp_path):
    model = tiny_models.mellum_with_mtp(str(tmp_path / "mellum"))
    ids = torch.tensor([[5, 6, 7, 8]])
    mask = torch.ones_like(ids)
    expected = uninstrumented_generate(model, ids, attention_mask=mask, max_new_tokens=8, eos_token_id=None)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=8, eos_token_id=None, use_mtp=True)
    assert torch.equal(out, expected)  # MTP verifies every candidate: greedy's output
    attrs = only_request(span_exporter).attributes
    assert attrs[A.GENERATE_STRATEGY] == A.STRATEGY_ASSISTED
    assert attrs[A.GENERATE_ASSISTED_GENERATOR] == "MTPCandidateGenerator"
    steps = step_spans(span_exporter)
    assert sum(s.attributes[A.GENERATE_STEP_TOKENS] for s in steps) == attrs[A.GEN_AI_USAGE_OUTPUT_TOKENS] == 8
