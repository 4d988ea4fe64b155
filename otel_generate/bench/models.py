"""Small random-weight models built from transformers configs, and loading a local checkpoint.

Part of the bench package; also used by the examples and the tests: nothing is downloaded. Real checkpoints are
loaded with ``from_pretrained`` from a local directory only (``local_files_only=True``).
"""

from __future__ import annotations

import os
import string
from typing import Any, Optional, Tuple

#: Vocabulary of the built models; token ids 0..VOCAB_SIZE-1.
VOCAB_SIZE = 128
#: EOS id of the built models (generation stops on it unless ``eos_token_id=None`` is passed).
EOS_TOKEN_ID = VOCAB_SIZE - 1
#: Padding id of the built models (distinct from EOS so that padding is visible).
PAD_TOKEN_ID = 0

ARCHITECTURES = ("gpt2", "llama", "t5")


def build_model(architecture: str = "gpt2", seed: int = 0, max_positions: int = 2048, **config: Any) -> Any:
    """A randomly initialised, tiny transformers model in eval mode, on CPU.

    Args:
        architecture: ``"gpt2"`` (GPT2LMHeadModel), ``"llama"`` (LlamaForCausalLM) or ``"t5"``
            (T5ForConditionalGeneration, encoder-decoder).
        seed: ``torch.manual_seed`` used for the weights.
        max_positions: position limit of the decoder-only models (tokens).
        **config: overrides passed to the transformers config class.

    Raises:
        ValueError: for an unknown architecture.
    """
    import torch
    import transformers

    ids = dict(bos_token_id=EOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID, pad_token_id=PAD_TOKEN_ID)
    if architecture == "gpt2":
        cfg = transformers.GPT2Config(
            vocab_size=VOCAB_SIZE, n_positions=max_positions, n_embd=32, n_layer=2, n_head=2, **{**ids, **config}
        )
        cls = transformers.GPT2LMHeadModel
    elif architecture == "llama":
        cfg = transformers.LlamaConfig(
            vocab_size=VOCAB_SIZE,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=max_positions,
            **{**ids, **config},
        )
        cls = transformers.LlamaForCausalLM
    elif architecture == "t5":
        cfg = transformers.T5Config(
            vocab_size=VOCAB_SIZE,
            d_model=32,
            d_kv=16,
            d_ff=64,
            num_layers=2,
            num_heads=2,
            decoder_start_token_id=PAD_TOKEN_ID,
            **{**ids, **config},
        )
        cls = transformers.T5ForConditionalGeneration
    else:
        raise ValueError(f"unknown architecture {architecture!r}; expected one of {', '.join(ARCHITECTURES)}")
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    model.generation_config.pad_token_id = PAD_TOKEN_ID
    model.generation_config.eos_token_id = EOS_TOKEN_ID
    return model


#: The tokenizer's first ids: the visible printable ASCII characters (no whitespace), one token each.
TOKEN_CHARACTERS = tuple(c for c in string.printable if not c.isspace())


def token_character(token_id: int) -> str:
    """The one character token ``token_id`` stands for in :func:`build_tokenizer`'s vocabulary: the visible
    printable ASCII characters first, then code points from U+0100 up, past the surrogates and U+FFFD."""
    if token_id < len(TOKEN_CHARACTERS):
        return TOKEN_CHARACTERS[token_id]
    point = 0x100 + token_id - len(TOKEN_CHARACTERS)
    if point >= 0xD800:  # the surrogates are no characters
        point += 0xE000 - 0xD800
    if point >= 0xFFFD:  # the replacement character would read as an incomplete one
        point += 1
    return chr(point)


def build_tokenizer(vocab_size: int) -> Any:
    """A ``PreTrainedTokenizerFast`` for a random-weight model of ``vocab_size`` ids, built locally: every id
    is one character of its own (:func:`token_character`; a prompt of N letters is N tokens), and no token
    is special. So every id a model generates decodes to exactly one character, and a streamed text of N
    characters is N tokens, however a server groups them into chunks.

    Raises:
        ValueError: ``vocab_size`` below 62 (the letters and digits a prompt is made of).
    """
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 62:
        raise ValueError(f"the tokenizer needs a vocabulary of at least 62 ids, got {vocab_size}")
    vocab = {token_character(i): i for i in range(vocab_size)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def dtype_keyword() -> str:
    """The dtype keyword of ``from_pretrained``/``from_config``: ``dtype`` from transformers 4.56,
    ``torch_dtype`` before."""
    import transformers

    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def load_model(path: str, dtype: Optional[Any] = None) -> Tuple[Any, Any]:
    """Load a causal LM (and its tokenizer, if the directory has one) from a local directory.

    Returns:
        ``(model, tokenizer_or_None)``: ``None`` when the directory holds no (non-empty) tokenizer.

    Raises:
        FileNotFoundError: when ``path`` is not an existing directory.
    """
    import transformers

    if not os.path.isdir(path):
        raise FileNotFoundError(f"model path {path!r} does not exist or is not a directory")
    kwargs = {"local_files_only": True}
    if dtype is not None:
        kwargs[dtype_keyword()] = dtype
    config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    cls = transformers.AutoModelForSeq2SeqLM if config.is_encoder_decoder else transformers.AutoModelForCausalLM
    model = cls.from_pretrained(path, **kwargs).eval()
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception:
        tokenizer = None
    if tokenizer is not None and len(tokenizer) == 0:
        tokenizer = None  # transformers 5 returns an empty tokenizer for a folder without tokenizer files
    return model, tokenizer
