"""The ``generate()`` workload: the model on its device, its prompt, and the one call every run makes.

* the model is built (or loaded) and placed on the device **before** warmup
  (:func:`build_bench_model`; the tiny random-weight models come from :mod:`otel_generate.bench.models`);
* greedy decoding, KV cache on, an explicit attention mask, EOS disabled unless ``--eos``
  (:func:`generate_kwargs`, :func:`resolve_eos`);
* a run times one complete ``generate()`` call with :func:`otel_generate.clock.timed_call`
  (:meth:`Runner.timed`), and its new tokens are counted from the returned tensor with
  :func:`otel_generate.tokens.count_new_tokens` (:meth:`Runner.counts`).

Errors: :class:`~otel_generate.bench.config.BenchUsageError` for lengths, ids or a config the model cannot take.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from otel_generate.bench.config import MODEL_EOS, BenchConfig, BenchUsageError, torch_dtype
from otel_generate.clock import synchronizer_for, timed_call
from otel_generate.tokens import count_new_tokens


def _text_config(model: Any) -> Any:
    config = model.config
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


def max_positions(model: Any) -> Optional[int]:
    """The model's position limit in tokens (``max_position_embeddings``/``n_positions``), or ``None``."""
    config = _text_config(model)
    for name in ("max_position_embeddings", "n_positions", "max_target_positions"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_lengths(prompt_tokens: int, new_tokens: int, positions: Optional[int]) -> None:
    """Refuse lengths the model cannot hold.

    The decoder sees ``prompt_tokens + new_tokens - 1`` positions (the last new token is never
    fed back), so that must not exceed ``positions``.

    Raises:
        BenchUsageError: ``prompt_tokens`` or ``new_tokens`` below 1, a prompt longer than the
            model's positions, or prompt plus continuation beyond them.
    """
    if prompt_tokens < 1:
        raise BenchUsageError(f"--prompt-tokens must be at least 1, got {prompt_tokens}")
    if new_tokens < 1:
        raise BenchUsageError(f"--new-tokens must be at least 1, got {new_tokens}")
    if positions is None:
        return
    if prompt_tokens > positions:
        raise BenchUsageError(f"--prompt-tokens {prompt_tokens} is longer than the model's {positions} positions")
    if prompt_tokens + new_tokens - 1 > positions:
        raise BenchUsageError(
            f"--prompt-tokens {prompt_tokens} plus --new-tokens {new_tokens} need {prompt_tokens + new_tokens - 1} "
            f"positions; the model has {positions}"
        )


def build_bench_model(config: BenchConfig, device: str) -> Any:
    """Build or load the model and place it on ``device`` in ``config.dtype`` (eval mode).

    * default: :func:`otel_generate.bench.models.build_model` ("gpt2", random weights, seeded);
    * ``--model PATH``: :func:`otel_generate.bench.models.load_model` (local checkpoint directory);
    * ``--model-config PATH``: random weights for a transformers ``config.json`` (a file, or a
      directory holding one), initialised directly on the device.
    """
    import torch

    from otel_generate.bench.models import build_model, dtype_keyword, load_model

    dtype = torch_dtype(config.dtype)
    if config.model is not None:
        model, _ = load_model(config.model, dtype=dtype)
        return model.to(device)
    if config.model_config is not None:
        import transformers

        path = config.model_config
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        try:
            with open(path, encoding="utf-8") as handle:
                data = json.load(handle)
            model_type = data.pop("model_type")
        except (OSError, ValueError, KeyError) as exc:
            raise BenchUsageError(
                f"--model-config {config.model_config!r}: not a transformers config.json ({exc})"
            ) from None
        model_config = transformers.AutoConfig.for_model(model_type, **data)
        cls = (
            transformers.AutoModelForSeq2SeqLM
            if getattr(model_config, "is_encoder_decoder", False)
            else transformers.AutoModelForCausalLM
        )
        torch.manual_seed(config.seed)
        with torch.device(device):
            model = cls.from_config(model_config, **{dtype_keyword(): dtype})
        return model.to(device=device, dtype=dtype).eval()
    model = build_model("gpt2", seed=config.seed)
    return model.to(device=device, dtype=dtype)


def model_description(config: BenchConfig, model: Any) -> str:
    if config.model is not None:
        return config.model
    kind = type(model).__name__
    source = f"config {config.model_config}" if config.model_config is not None else "built locally"
    return f"{kind} (random weights, seed {config.seed}, {source})"


def _as_ids(value: Any) -> List[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def special_token_ids(model: Any) -> List[int]:
    """EOS, BOS and padding ids of the model's generation config and config."""
    ids = set()
    for source in (getattr(model, "generation_config", None), _text_config(model)):
        for name in ("eos_token_id", "bos_token_id", "pad_token_id", "decoder_start_token_id"):
            ids.update(_as_ids(getattr(source, name, None)))
    return sorted(ids)


def make_inputs(
    model: Any, batch_size: int, prompt_tokens: int, seed: int, avoid: Sequence[int] = ()
) -> Dict[str, Any]:
    """A random prompt of ``(batch_size, prompt_tokens)`` ids and its all-ones attention mask.

    Ids are drawn with ``torch.Generator().manual_seed(seed)`` from the model's vocabulary minus
    its special tokens (EOS, BOS, padding) and ``avoid``; the tensors are on the model's device.
    """
    import torch

    vocab = int(model.get_input_embeddings().num_embeddings)
    excluded = set(special_token_ids(model)) | {int(i) for i in avoid}
    allowed = torch.tensor([i for i in range(vocab) if i not in excluded], dtype=torch.long)
    if allowed.numel() == 0:
        raise BenchUsageError("the model's vocabulary holds only special tokens; cannot build a prompt")
    generator = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, allowed.numel(), (batch_size, prompt_tokens), generator=generator)
    input_ids = allowed[picks].to(model.device)
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}


def resolve_eos(config: BenchConfig, model: Any) -> Optional[List[int]]:
    """The EOS ids that may stop generation: ``None`` (disabled, the default), the model's, or ``--eos ID``.

    Raises:
        BenchUsageError: ``--eos`` without an id for a model that has no EOS token, or an id
            outside the vocabulary.
    """
    if config.eos is None:
        return None
    vocab = int(model.get_input_embeddings().num_embeddings)
    if config.eos == MODEL_EOS:
        ids = _as_ids(getattr(model.generation_config, "eos_token_id", None))
        if not ids:
            raise BenchUsageError("--eos: the model has no EOS token id; give one, e.g. --eos 2")
        return ids
    token = int(config.eos)
    if token >= vocab:
        raise BenchUsageError(f"--eos {token} is outside the model's vocabulary (0..{vocab - 1})")
    return [token]


def generate_kwargs(model: Any, new_tokens: int, eos: Optional[List[int]]) -> Dict[str, Any]:
    """Keywords of every timed ``generate()``: greedy, cache on, EOS only when asked for."""
    kwargs: Dict[str, Any] = {
        "max_new_tokens": new_tokens,
        "do_sample": False,
        "num_beams": 1,
        "use_cache": True,
        "eos_token_id": eos,
    }
    pad = getattr(model.generation_config, "pad_token_id", None)
    if pad is None and eos:
        pad = eos[0]
    if pad is not None:
        kwargs["pad_token_id"] = pad
    return kwargs


def prompt_width(model: Any, inputs: Dict[str, Any]) -> int:
    """Leading positions of the output that were not generated (decoder start token for encoder-decoders)."""
    if getattr(model.config, "is_encoder_decoder", False):
        return 1
    return int(inputs["input_ids"].shape[-1])


def sequences_of(output: Any) -> Any:
    """The ``sequences`` tensor of a ``generate()`` output (the output itself when it is a tensor)."""
    return output if hasattr(output, "dim") else output.sequences


class Runner:
    """The model, its inputs and the one ``generate()`` call every run makes."""

    def __init__(self, config: BenchConfig, device: str, clock: Callable[[], float] = time.perf_counter) -> None:
        self.config = config
        self.device = device
        self.clock = clock
        self.model = build_bench_model(config, device)
        check_lengths(config.prompt_tokens, config.new_tokens, max_positions(self.model))
        self.eos = resolve_eos(config, self.model)
        self.inputs = make_inputs(self.model, config.batch_size, config.prompt_tokens, config.seed)
        self.kwargs = generate_kwargs(self.model, config.new_tokens, self.eos)
        self.pad = self.kwargs.get("pad_token_id")
        self.width = prompt_width(self.model, self.inputs)
        self.synchronize = synchronizer_for(device)

    def generate(self) -> Any:
        return self.model.generate(**self.inputs, **self.kwargs)

    def timed(self) -> Tuple[Any, float]:
        """One complete ``generate()`` between two synchronized clock reads: ``(output, seconds)``."""
        return timed_call(self.generate, self.synchronize, clock=self.clock)

    def counts(self, output: Any) -> List[int]:
        """Real new tokens per returned sequence (minus prompt, up to the first EOS, never padding)."""
        return count_new_tokens(sequences_of(output), self.width, self.eos, self.pad)
