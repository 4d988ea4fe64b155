"""Test-only tiny random-weight models: those whose own ``generate()`` calls the base one several
times, or not at all, built from transformers configs on the CPU in well under a second each
(nothing downloaded).

The models the bench also uses (the tiny GPT-2, Llama and T5, their vocabulary and EOS/padding
ids) have one builder, :func:`otel_generate.bench.models.build_model`: the ``gpt2``, ``llama``
and ``t5`` fixtures of ``conftest.py`` and every test that needs one of them call it, so the tests
time and trace the same model as ``otel-generate bench``. Only models the bench never builds live
here."""

from __future__ import annotations

import os
import textwrap

import torch
import transformers as T

# Whisper's multilingual vocabulary layout (vocab_size 51865): <|endoftext|> = 50257 (EOS and pad),
# <|startoftranscript|> = 50258, <|notimestamps|> = 50363, timestamps 50364..51864 (0.00..30.00 s).
WHISPER_EOS, WHISPER_SOT, WHISPER_NO_TIMESTAMPS = 50257, 50258, 50363


def whisper(seed=0):
    """WhisperForConditionalGeneration, 1 encoder and 1 decoder layer, d_model 32, that supports
    ``return_timestamps=True`` (no language detection: no ``lang_to_id``)."""
    config = T.WhisperConfig(
        encoder_layers=1,
        decoder_layers=1,
        d_model=32,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        num_mel_bins=80,
        max_source_positions=1500,
        max_target_positions=448,
        vocab_size=51865,
        eos_token_id=WHISPER_EOS,
        pad_token_id=WHISPER_EOS,
        bos_token_id=WHISPER_EOS,
        decoder_start_token_id=WHISPER_SOT,
    )
    torch.manual_seed(seed)
    model = T.WhisperForConditionalGeneration(config).eval()
    gc = model.generation_config
    gc.no_timestamps_token_id = WHISPER_NO_TIMESTAMPS
    gc.decoder_start_token_id = WHISPER_SOT
    gc.eos_token_id = gc.pad_token_id = WHISPER_EOS
    gc.max_initial_timestamp_index = 50
    gc.forced_decoder_ids = None
    gc.suppress_tokens = None  # 4.46 needs None or at least two entries
    gc.begin_suppress_tokens = [220, WHISPER_EOS]
    return model


def blip2(seed=0):
    """Blip2ForConditionalGeneration: its generate() calls ``self.language_model.generate`` (OPT)."""
    vision = dict(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=16, patch_size=8
    )
    qformer = dict(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        encoder_hidden_size=16,
        vocab_size=99,
    )
    text = T.OPTConfig(
        vocab_size=128,
        hidden_size=16,
        ffn_dim=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        word_embed_proj_dim=16,
        max_position_embeddings=64,
        bos_token_id=2,
        eos_token_id=127,
        pad_token_id=1,
    )
    config = T.Blip2Config(
        vision_config=vision,
        qformer_config=qformer,
        text_config=text.to_dict(),
        num_query_tokens=4,
        image_token_index=100,
    )
    torch.manual_seed(seed)
    model = T.Blip2ForConditionalGeneration(config).eval()
    for gc in (model.generation_config, model.language_model.generation_config):
        gc.eos_token_id, gc.pad_token_id = 127, 1
    return model


def blip2_inputs():
    ids = torch.tensor([[100] * 4 + [2, 5, 6, 7]])
    return dict(pixel_values=torch.randn(1, 3, 16, 16), input_ids=ids, attention_mask=torch.ones_like(ids))


def musicgen(seed=0):
    """MusicgenForCausalLM: its generate() runs GenerationMixin's helpers and ``_sample`` itself,
    never ``GenerationMixin.generate``."""
    config = T.MusicgenDecoderConfig(
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        ffn_dim=32,
        num_codebooks=2,
        max_position_embeddings=64,
        pad_token_id=64,
        bos_token_id=64,
        audio_channels=1,
    )
    torch.manual_seed(seed)
    model = T.MusicgenForCausalLM(config).eval()
    gc = model.generation_config
    gc.pad_token_id = gc.decoder_start_token_id = gc.bos_token_id = 64
    gc.eos_token_id, gc.do_sample, gc.num_return_sequences = None, False, 1
    return model


def musicgen_inputs():
    # (batch * num_codebooks, 1) start tokens, and the (batch, 1) mask 4.46 needs
    return dict(input_ids=torch.full((2, 1), 64), attention_mask=torch.ones(1, 1, dtype=torch.long), max_new_tokens=5)


def seamless(cls="SeamlessM4TForTextToSpeech", seed=0):
    """SeamlessM4T: ForTextToText calls ``super().generate()`` once; ForTextToSpeech then also calls
    its text-to-unit submodule's ``generate()``, then the vocoder."""
    config = T.SeamlessM4TConfig(
        vocab_size=64,
        t2u_vocab_size=32,
        hidden_size=16,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        speech_encoder_layers=1,
        speech_encoder_attention_heads=2,
        speech_encoder_intermediate_size=32,
        t2u_encoder_layers=1,
        t2u_decoder_layers=1,
        t2u_encoder_attention_heads=2,
        t2u_decoder_attention_heads=2,
        t2u_encoder_ffn_dim=32,
        t2u_decoder_ffn_dim=32,
        max_position_embeddings=64,
        t2u_max_position_embeddings=64,
        unit_hifi_gan_vocab_size=32,
        unit_embed_dim=8,
        lang_embed_dim=4,
        spkr_embed_dim=4,
        vocoder_num_langs=2,
        vocoder_num_spkrs=2,
        upsample_initial_channel=8,
        upsample_rates=[2, 2],
        upsample_kernel_sizes=[4, 4],
        resblock_kernel_sizes=[3],
        resblock_dilation_sizes=[[1, 3]],
        variance_predictor_kernel_size=3,
        var_pred_dropout=0.0,
        t2u_max_new_tokens=8,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=3,
        decoder_start_token_id=3,
        t2u_bos_token_id=0,
        t2u_pad_token_id=1,
        t2u_eos_token_id=2,
        t2u_decoder_start_token_id=2,
        feature_projection_input_dim=16,
        adaptor_kernel_size=2,
        adaptor_stride=2,
        num_adapter_layers=1,
    )
    torch.manual_seed(seed)
    model = getattr(T, cls)(config).eval()
    gc = model.generation_config
    gc.text_decoder_lang_to_code_id = {"eng": 4}
    gc.t2u_lang_code_to_id = {"eng": 0}
    gc.vocoder_lang_code_to_id = {"eng": 0}
    gc.eos_token_id, gc.pad_token_id, gc.decoder_start_token_id = 3, 0, 3
    return model


def seamless_inputs():
    ids = torch.tensor([[2, 5, 6, 7, 3]])
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids), tgt_lang="eng", max_new_tokens=6)


def bark(seed=0):
    """BarkModel: generate() runs its semantic model (``super().generate()`` once), its coarse model
    (``super().generate()`` once per sliding window) and its fine model (a loop of forwards)."""
    from transformers.models.bark.generation_configuration_bark import (
        BarkCoarseGenerationConfig,
        BarkFineGenerationConfig,
        BarkGenerationConfig,
        BarkSemanticGenerationConfig,
    )

    sub = dict(block_size=1024, num_layers=1, num_heads=2, hidden_size=16)
    codec = T.EncodecConfig(
        hidden_size=8,
        num_filters=2,
        num_residual_layers=1,
        upsampling_ratios=[8, 5, 4, 2],
        codebook_size=1024,
        codebook_dim=8,
        target_bandwidths=[6.0],
        sampling_rate=24000,
    ).to_dict()
    config = T.BarkConfig(
        semantic_config=dict(sub, input_vocab_size=129600, output_vocab_size=10048),
        coarse_acoustics_config=dict(sub, input_vocab_size=12096, output_vocab_size=12096),
        fine_acoustics_config=dict(
            sub, input_vocab_size=1056, output_vocab_size=1056, n_codes_total=8, n_codes_given=1
        ),
        codec_config=codec,
    )
    torch.manual_seed(seed)
    model = T.BarkModel(config).eval()
    gc = BarkGenerationConfig()
    gc.semantic_config = BarkSemanticGenerationConfig(max_new_tokens=12, max_input_semantic_length=16).to_dict()
    gc.coarse_acoustics_config = BarkCoarseGenerationConfig(
        max_coarse_history=60, sliding_window_len=6, max_coarse_input_length=16
    ).to_dict()
    gc.fine_acoustics_config = BarkFineGenerationConfig(max_fine_history_length=16, max_fine_input_length=32).to_dict()
    model.generation_config = gc
    return model


def bark_inputs():
    ids = torch.randint(0, 1000, (1, 16), generator=torch.Generator().manual_seed(0))
    return dict(input_ids=ids, attention_mask=torch.ones_like(ids))


def mellum_with_mtp(directory, seed=0):
    """A MellumForCausalLM checkpoint saved in ``directory`` WITH multi-token-prediction weights, loaded
    back: ``generate(..., use_mtp=True)`` reads the MTP weights from the checkpoint files."""
    from safetensors.torch import load_file, save_file

    config = T.MellumConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        sliding_window=64,
        num_mtp_layers=1,
        mtp_layer_types=["full_attention"],
        bos_token_id=1,
        eos_token_id=127,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    T.MellumForCausalLM(config).eval().save_pretrained(directory)
    path = os.path.join(directory, "model.safetensors")
    weights = load_file(path)
    last = f"model.layers.{config.num_hidden_layers - 1}."
    for key in [k for k in weights if k.startswith(last)]:  # the MTP block: one more decoder layer
        weights["mtp.layers.0." + key[len(last) :]] = weights[key].clone()
    hidden = config.hidden_size
    weights["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden, generator=torch.Generator().manual_seed(seed + 1)) * 0.02
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        weights[f"mtp.{name}.weight"] = torch.ones(hidden)
    save_file(weights, path, metadata={"format": "pt"})
    model = T.AutoModelForCausalLM.from_pretrained(directory, local_files_only=True).eval()
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = 127, 0
    return model


#: A greedy loop without cache for ``custom_generate``: one full forward per step; it calls the
#: stopping criteria after each step only when ``call_criteria``.
LOOP_SOURCE = """
import torch


def loop(model, input_ids, logits_processor=None, stopping_criteria=None, generation_config=None, call_criteria=True,
         **model_kwargs):
    for _ in range(generation_config.max_new_tokens):
        logits = model(input_ids).logits[:, -1, :]
        if logits_processor is not None:
            logits = logits_processor(input_ids, logits)
        input_ids = torch.cat([input_ids, logits.argmax(-1, keepdim=True)], dim=-1)
        if call_criteria and stopping_criteria is not None and bool(stopping_criteria(input_ids, logits).all()):
            break
    return input_ids
"""


def custom_generate_dir(directory, kind):
    """Write ``directory/custom_generate/generate.py`` and return ``directory``.

    ``kind``: ``"reenter"`` (its generate() calls ``GenerationMixin.generate(model, ...,
    custom_generate=loop)``), ``"reenter_blind"`` (the same, but the loop never calls the stopping
    criteria) or ``"own_loop"`` (its generate() runs the loop itself, never entering GenerationMixin).
    """
    os.makedirs(os.path.join(directory, "custom_generate"), exist_ok=True)
    source = LOOP_SOURCE
    if kind == "reenter":
        source += textwrap.dedent("""
            from transformers.generation.utils import GenerationMixin


            def generate(model, *args, **kwargs):
                return GenerationMixin.generate(model, *args, custom_generate=loop, **kwargs)
        """)
    elif kind == "reenter_blind":
        source += textwrap.dedent("""
            from transformers.generation.utils import GenerationMixin


            def blind(model, input_ids, logits_processor=None, stopping_criteria=None, generation_config=None,
                      **kwargs):
                return loop(model, input_ids, logits_processor, stopping_criteria, generation_config,
                            call_criteria=False)


            def generate(model, *args, **kwargs):
                return GenerationMixin.generate(model, *args, custom_generate=blind, **kwargs)
        """)
    elif kind == "own_loop":
        source += textwrap.dedent("""
            class _Budget:
                def __init__(self, max_new_tokens):
                    self.max_new_tokens = max_new_tokens


            def generate(model, inputs=None, max_new_tokens=None, attention_mask=None, **kwargs):
                return loop(model, inputs, generation_config=_Budget(max_new_tokens), call_criteria=False)
        """)
    else:
        raise ValueError(f"unknown kind {kind!r}")
    with open(os.path.join(directory, "custom_generate", "generate.py"), "w", encoding="utf-8") as handle:
        handle.write(source)
    return directory
