"""Per-request figures beyond latency: accelerator memory, key/value cache size, assisted decoding.

* Peak memory (``generate.memory.peak_allocated``, bytes): on CUDA only,
  ``torch.cuda.reset_peak_memory_stats(device)`` when the request starts and
  ``torch.cuda.max_memory_allocated(device)`` when it ends (after the device was synchronized).
  The statistic is per device, not per request: with several requests on one device at once,
  each reports the peak of all of them during its lifetime, and resetting it at each start
  changes what your own ``max_memory_allocated()`` returns. ``measure_memory=False`` leaves it
  alone. No accelerator function is called for a CPU model.
* Key/value cache size (``generate.kv_cache.size``, bytes): the tensors of the cache object the
  ``generate()`` loop built (``GenerationMixin._prepare_cache_for_generation``), read when the
  loop returns: ``numel() * element_size()`` of every key and value tensor it holds (a static
  cache counts its whole allocation).
* Assisted decoding (``generate.assisted.candidates.proposed`` / ``.accepted``, tokens): each
  iteration of ``GenerationMixin._assisted_decoding`` asks the candidate generator for
  candidates (``get_candidates``: proposed = their length) and tells it how many the model
  accepted (``update_candidate_strategy(..., num_matches)``); the step then appended
  ``num_matches + 1`` tokens.
"""

from __future__ import annotations

import sys
from typing import Any, Optional

_CACHE_PARTS = ("layers", "keys", "values", "key_cache", "value_cache", "self_attention_cache", "cross_attention_cache")


def cuda_device(device: Optional[str]) -> Optional[str]:
    """``device`` when it names a CUDA device (``"cuda"``, ``"cuda:1"``) and CUDA is available,
    else ``None`` (a CPU device never reaches ``torch.cuda``)."""
    if device is None or not str(device).startswith("cuda"):
        return None
    import torch

    return device if torch.cuda.is_available() else None


def reset_peak_memory(device: str) -> None:
    import torch

    torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: str) -> int:
    """Bytes: ``torch.cuda.max_memory_allocated(device)``."""
    import torch

    return int(torch.cuda.max_memory_allocated(device))


def cache_bytes(cache: Any) -> Optional[int]:
    """Bytes of every tensor a key/value cache holds (``DynamicCache`` and its layers in
    transformers 5.x, ``key_cache``/``value_cache`` lists in 4.x, encoder-decoder caches, legacy
    tuples), each tensor counted once; ``None`` when nothing in it is a tensor."""
    total = 0
    found = False
    seen = set()
    pending = [cache]
    torch = sys.modules.get("torch")
    tensor = torch.Tensor if torch is not None else None  # (its nbytes is numel() * element_size(), in one call)
    while pending:
        item = pending.pop()
        if item is None or id(item) in seen:
            continue
        seen.add(id(item))
        if type(item) is tensor:
            try:
                total += item.nbytes
            except RuntimeError:  # a sparse tensor has none: its dense size, as below
                total += int(item.numel()) * int(item.element_size())
            found = True
        elif hasattr(item, "element_size") and hasattr(item, "numel"):
            total += int(item.numel()) * int(item.element_size())
            found = True
        elif isinstance(item, (list, tuple)):
            pending.extend(item)
        else:
            for name in _CACHE_PARTS:
                part = getattr(item, name, None)
                if part is not None and not callable(part):
                    pending.append(part)
    return total if found else None


def count_candidates(generator: Any, loop: Any) -> None:
    """Make ``generator`` (a transformers candidate generator) count into ``loop.candidates_proposed``
    and ``loop.candidates_accepted`` (instance attributes: the class is not touched)."""
    get_candidates = generator.get_candidates
    update = generator.update_candidate_strategy

    def counting_get_candidates(input_ids: Any, *args: Any, **kwargs: Any) -> Any:
        result = get_candidates(input_ids, *args, **kwargs)
        try:
            candidates = result[0] if isinstance(result, tuple) else result
            loop.candidates_proposed += max(int(candidates.shape[-1]) - int(input_ids.shape[-1]), 0)
        except Exception:  # an unexpected return shape: no count, generation goes on
            loop.candidates_proposed = None
        return result

    def counting_update(input_ids: Any, scores: Any, num_matches: Any, *args: Any, **kwargs: Any) -> Any:
        if loop.candidates_accepted is not None:
            try:
                loop.candidates_accepted += int(num_matches)
            except Exception:
                loop.candidates_accepted = None
        return update(input_ids, scores, num_matches, *args, **kwargs)

    loop.candidates_proposed = 0
    loop.candidates_accepted = 0
    generator.get_candidates = counting_get_candidates
    generator.update_candidate_strategy = counting_update
