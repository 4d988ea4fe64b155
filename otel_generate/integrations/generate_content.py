"""Opt-in content of a ``generate()`` request: messages, step token ids, step log-probabilities.

Nothing here runs unless ``instrument()`` was asked for content (:mod:`otel_generate.content`):
then each request gets :data:`CAPTURE` as its ``Call.content`` (a
:class:`~.loop_state.ContentCapture`, attached by :func:`.generate_loop.run_request`), whose
:meth:`~_Capture.fill` (:func:`fill_request`) runs once, after ``generate()`` returned and its loops
were accounted; and, for log-probabilities only, the ``_get_logits_processor`` hook
(:func:`make_get_logits_processor`, a row of :data:`otel_generate.instrumentor.PATCHES`) appends
one :class:`StepLogprobs` processor to the loop's logits processors. The step hook
(:mod:`.step_hook`) is never changed: with content off, no code of this module runs per step.

Where text comes from: a tokenizer, either the ``tokenizer=`` keyword of ``generate()`` (the one
``stop_strings`` needs) or the tokenizer of the pipeline running the call
(:mod:`.pipelines`). Without one, no message is captured: token ids are not text, and guessing
a tokenizer from the model's name would mean loading files the application did not load.

* Input: one message per prompt row, the row's ids without padding (the attention mask when
  given, else every id equal to the pad id unless pad is also EOS, as transformers infers the
  mask) decoded with ``skip_special_tokens=True``. Only for token-id prompts (``input_ids``),
  not for ``inputs_embeds``, audio features or pixels.
* Output: one message per returned sequence, its real continuation only (the counts the
  producer already computed, :attr:`Request.output_tokens_per_sequence`: no prompt, no padding
  after the row finished) decoded with ``skip_special_tokens=True``, with that row's finish reason.
  A call of several decoding loops, or of a Whisper window (Whisper keeps only the segments between
  timestamp pairs), gets the text of what the call returned.
* Step token ids: read from the returned tensor after the call, at the positions each step
  appended (zero per-step cost).
* Step log-probabilities: greedy and sampling (``_sample``) only. transformers hands the stopping
  criteria the processed scores only when ``output_scores=True, return_dict_in_generate=True``
  (``scores`` is ``None`` otherwise), so a last logits processor keeps each step's processed
  scores until the next step shows which token was chosen. Beam search processes flattened beams
  that are re-ranked afterwards, and assisted decoding scores candidate tokens that may be
  rejected: neither gets ``generate.step.logprobs`` (token ids still are given).
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any, Callable, List, Optional, Sequence

from transformers.generation.logits_process import LogitsProcessor

from otel_generate import attributes as A
from otel_generate._faults import LOGGER_NAME, Fault, log_fault_once
from otel_generate.content import input_messages, output_messages
from otel_generate.integrations import pipelines
from otel_generate.integrations._routing import _ACTIVE, _sequences, compiler_disabled, strategy_of
from otel_generate.integrations.loop_state import Loop
from otel_generate.telemetry import Telemetry
from otel_generate.tokens import _as_id_list

#: The ``GenerationMixin`` method :func:`make_get_logits_processor` wraps.
LOGITS_PROCESSOR_METHOD = "_get_logits_processor"

#: Strategies that run ``GenerationMixin._sample``: one processed distribution per step, one token per row.
LOGPROB_STRATEGIES = (A.STRATEGY_GREEDY, A.STRATEGY_SAMPLE)


_LOG = logging.getLogger(LOGGER_NAME)
_no_tokenizer_lock = threading.Lock()
_no_tokenizer_warned = False

#: The warning logged (once per process) when message capture is on and a request has no tokenizer.
NO_TOKENIZER_WARNING = (
    "otel_generate: message content capture is on (%s) but generate() got no tokenizer= and runs in no "
    "pipeline, so no prompt or completion text is captured; pass generate(..., tokenizer=tokenizer) "
    "(see docs/content-capture.md). This warning is logged once."
)


def _warn_no_tokenizer(mode: Any) -> None:
    """Log :data:`NO_TOKENIZER_WARNING` the first time only."""
    global _no_tokenizer_warned
    with _no_tokenizer_lock:
        if _no_tokenizer_warned:
            return
        _no_tokenizer_warned = True
    _LOG.warning(NO_TOKENIZER_WARNING, mode.name)


def _is_id_tensor(value: Any) -> bool:
    return (
        hasattr(value, "dim")
        and hasattr(value, "is_floating_point")
        and value.dim() == 2
        and not value.is_floating_point()
    )


def tokenizer_of(call: Any) -> Any:
    """The tokenizer for ``call``'s text: ``generate(tokenizer=...)``, else the running pipeline's."""
    tokenizer = call.kwargs.get("tokenizer")
    if tokenizer is None:
        tokenizer = pipelines.tokenizer_for(call.model)
    return tokenizer


def fill_request(call: Any, loops: Sequence[Any], result: Any) -> None:
    """Fill ``call.request``'s content fields; never raises (a fault is logged once).

    Args:
        call: the finished :class:`~otel_generate.integrations.loop_state.Call`.
        loops: its decoding loops that ran (already accounted), in order.
        result: what the user's call returned (``None`` when it raised).
    """
    try:
        _fill(call, loops, result)
    except Exception as fault:
        log_fault_once(Fault.CONTENT_CAPTURE, fault)
    finally:
        for loop in loops:
            loop.step_logprobs = None  # holds the last step's scores tensor


class _Capture:
    """The :class:`~.loop_state.ContentCapture` of every request while content is captured (no
    state of its own: what it reads is on the call and its loops)."""

    __slots__ = ()

    def fill(self, call: Any, loops: Sequence[Any], result: Any) -> None:
        """:func:`fill_request`."""
        fill_request(call, loops, result)


#: Attached to each request as ``Call.content`` while content is captured.
CAPTURE = _Capture()


def _fill(call: Any, loops: Sequence[Any], result: Any) -> None:
    options = call.telemetry.content
    request = call.request
    recording = call.span.is_recording()
    single = loops[0] if len(loops) == 1 else None
    if options.mode.on_event or (options.mode.on_span and recording):
        tokenizer = tokenizer_of(call)
        if tokenizer is None:
            _warn_no_tokenizer(options.mode)
        else:
            if loops:
                prompts = _prompt_texts(loops[0], tokenizer)
                if prompts is not None:
                    request.input_messages = input_messages(prompts)
            counts = request.output_tokens_per_sequence
            if single is not None and single.window is None:
                sequences, prompt_length = (
                    _sequences(single.result if single.result is not None else result),
                    single.prompt_length,
                )
                if sequences is not None and prompt_length is not None and len(counts) == int(sequences.shape[0]):
                    rows = sequences[:, prompt_length:].tolist()
                    texts = [
                        tokenizer.decode(row[:count], skip_special_tokens=True) for row, count in zip(rows, counts)
                    ]
                    request.output_messages = output_messages(texts, request.finish_reasons)
            elif loops:
                # several inner calls, or a Whisper window (Whisper keeps only the segments between
                # timestamp pairs and may drop the tokens after the last one): the text is what the
                # user's call returned
                sequences = _sequences(result)
                if sequences is not None and _is_id_tensor(sequences):
                    texts = [tokenizer.decode(row, skip_special_tokens=True) for row in sequences.tolist()]
                    reasons = (
                        request.finish_reasons
                        if request.finish_reasons and len(request.finish_reasons) == len(texts)
                        else None
                    )
                    request.output_messages = output_messages(texts, reasons)
    if options.step_content and recording and request.timed:
        cap = call.telemetry.max_step_spans
        token_ids: List[List[int]] = []
        for loop in loops:
            sequences = _sequences(loop.result if loop.result is not None else result)
            if sequences is None or loop.prompt_length is None or not _is_id_tensor(sequences):
                token_ids.extend([] for _ in loop.step_tokens)
                continue
            token_ids.extend(_step_token_ids(sequences, loop.prompt_length, loop.step_tokens))
        if any(token_ids):
            request.step_token_ids = token_ids[:cap]
        if (
            options.step_logprobs
            and single is not None
            and single.step_logprobs is not None
            and all(t == 1 for t in request.step_tokens)
        ):
            sequences = _sequences(single.result if single.result is not None else result)
            steps = min(len(request.step_tokens), cap)
            if sequences is not None and single.prompt_length is not None:
                values = single.step_logprobs.values_per_step(sequences, single.prompt_length, steps)
                if values is not None and len(values) == steps:
                    request.step_logprobs = values


def _prompt_texts(loop: Any, tokenizer: Any) -> Optional[List[str]]:
    """Each prompt row's text without padding, or ``None`` when the prompt is not token ids."""
    inputs = loop.inputs_tensor
    if loop.model_input_name not in (None, "input_ids") or inputs is None or not _is_id_tensor(inputs):
        return None
    rows = inputs.tolist()
    mask = loop.kwargs.get("attention_mask")
    if mask is not None and tuple(mask.shape[:2]) == tuple(inputs.shape[:2]):
        keep = mask.tolist()
        rows = [[token for token, kept in zip(row, row_mask) if kept] for row, row_mask in zip(rows, keep)]
    else:
        config = loop.generation_config
        pad = getattr(config, "pad_token_id", None)
        if pad is not None and int(pad) not in _as_id_list(getattr(config, "eos_token_id", None)):
            rows = [[token for token in row if token != int(pad)] for row in rows]
    return [tokenizer.decode(row, skip_special_tokens=True) for row in rows]


def _step_token_ids(sequences: Any, prompt_length: int, step_tokens: List[int]) -> List[List[int]]:
    """Per step, the ids it appended to every returned sequence (row-major), read off the tensor."""
    rows = sequences[:, prompt_length:].tolist()
    out = []
    position = 0
    for count in step_tokens:
        out.append([token for row in rows for token in row[position : position + count]])
        position += count
    return out


class StepLogprobs(LogitsProcessor):
    """A logits processor, last in the list, that keeps what the log-probabilities need.

    transformers calls it once per ``_sample`` step with ``input_ids`` (the sequences so far) and
    the processed scores ``(rows, vocab)`` the next token is chosen from; it returns the scores
    unchanged. At each call the previous step's token is the last column of ``input_ids``, so the
    previous scores give its log-probability (``log_softmax`` then ``gather``, on the device, no
    wait); only that ``(rows,)`` tensor is kept, and the scores of one step at a time. The last
    step's token is read from the returned sequences in :meth:`values_per_step`.
    """

    def __init__(self) -> None:
        self.values: List[Any] = []
        self._previous: Any = None
        self.fault: Optional[BaseException] = None

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        if self.fault is None:
            try:
                previous = self._previous
                if previous is not None:
                    self.values.append(_logprob_of(previous, input_ids[:, -1]))
                self._previous = scores
            except Exception as fault:  # never break generation
                self.fault = fault
                log_fault_once(Fault.STEP_LOG_PROBABILITIES, fault)
        return scores

    def values_per_step(self, sequences: Any, prompt_length: int, steps: int) -> Optional[List[List[float]]]:
        """One list of log-probabilities (one per row) for each of the first ``steps`` steps (fewer
        when fewer were seen), or ``None`` after a fault."""
        import torch

        if self.fault is not None:
            return None
        values = self.values[:steps]
        position = prompt_length + len(self.values)
        if len(values) < steps and self._previous is not None and int(sequences.shape[-1]) > position:
            values.append(_logprob_of(self._previous, sequences[:, position].to(self._previous.device)))
        self._previous = None
        self.values = []
        if not values:
            return []
        return torch.stack(values).cpu().tolist()  # (steps, rows): one device transfer


def _logprob_of(scores: Any, tokens: Any) -> Any:
    import torch

    return torch.log_softmax(scores.float(), dim=-1).gather(-1, tokens[:, None]).squeeze(-1)


def make_get_logits_processor(original: Callable, telemetry: Telemetry) -> Callable:
    """``GenerationMixin._get_logits_processor``, hooked only when step log-probabilities are asked for.

    Appends a :class:`StepLogprobs` as the last processor (after the warpers, which transformers
    4.x adds after the user's processors) for a recorded greedy or sampling loop.
    """

    @functools.wraps(original)
    def _get_logits_processor(self, *args, **kwargs):
        processors = original(self, *args, **kwargs)
        loop = _ACTIVE.get()
        if (
            telemetry.active
            and isinstance(loop, Loop)
            and loop.model is self
            and loop.step_logprobs is None
            and loop.call.timed
            and loop.call.span.is_recording()
        ):
            try:
                config = kwargs.get("generation_config", args[0] if args else None)
                if strategy_of(config, loop.kwargs.get("assistant_model")) in LOGPROB_STRATEGIES:
                    recorder = StepLogprobs()
                    processors.append(recorder)
                    loop.step_logprobs = recorder
            except Exception as fault:
                log_fault_once(Fault.STEP_LOG_PROBABILITIES_INSTALL, fault)
        return processors

    return compiler_disabled(_get_logits_processor)
