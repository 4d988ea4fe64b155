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

import operator
import sys
from typing import Any, Optional

_CACHE_PARTS = ("layers", "keys", "values", "key_cache", "value_cache", "self_attention_cache", "cross_attention_cache")
_PART_NAMES = frozenset(_CACHE_PARTS)
_LAYER_PARTS = frozenset(("keys", "values"))
#: every name :func:`cache_bytes` reads from an object that is not a tensor
_READ_NAMES = _CACHE_PARTS + ("element_size", "numel", "__getattr__")
_MISSING = object()
#: class -> whether ``getattr(instance, name, None)`` of every name in :data:`_READ_NAMES` is the
#: instance dictionary's entry (see :func:`_names_in_dict`)
_reads_dict: dict = {}


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
    try:
        total = _layered_cache_bytes(cache)
    except Exception:  # (an object it did not foresee: the walk counts it)
        total = None
    if total is not None:
        return total
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


def _names_in_dict(cls: type) -> bool:
    """Whether the class defines none of :data:`_READ_NAMES` (no ``__getattr__`` either), keeps its
    instances' attributes in the ``__dict__`` Python gives it and looks them up with
    ``object.__getattribute__``, and is not a list or tuple: then an instance's dictionary answers
    every ``getattr`` of those names that :func:`cache_bytes` makes. Read once per class: a
    property or ``__getattr__`` added to such a class later is not seen."""
    known = _reads_dict.get(cls)
    if known is None:
        try:
            import inspect
            import types

            known = (
                cls.__getattribute__ is object.__getattribute__
                and not issubclass(cls, (list, tuple))
                and cls.__dictoffset__ != 0  # (instances have a dictionary: not None, object, __slots__)
                and isinstance(inspect.getattr_static(cls, "__dict__", None), types.GetSetDescriptorType)
                and all(inspect.getattr_static(cls, name, _MISSING) is _MISSING for name in _READ_NAMES)
            )
        except Exception:
            known = False
        if len(_reads_dict) < 64:
            _reads_dict[cls] = known
    return known


def _layered_cache_bytes(cache: Any) -> Optional[int]:
    """:func:`cache_bytes` of the common shape, without its walk (whose cost grows with the
    layers): an object whose only part is a list ``layers`` (a ``DynamicCache``), each layer an
    object whose only parts are ``keys`` and ``values`` (plain tensors, or ``None``), every class
    read from its instances' dictionaries (:func:`_names_in_dict`), no tensor-like object among
    them. ``None`` for any other shape (then the walk counts it) or no tensor at all."""
    if not _names_in_dict(type(cache)):
        return None
    state = vars(cache)
    if type(state) is not dict:
        return None
    layers = state.get("layers")
    if type(layers) is not list or not layers or _PART_NAMES.intersection(state) != {"layers"}:
        return None
    if "element_size" in state and "numel" in state:
        return None
    torch = sys.modules.get("torch")
    if torch is None or not all(map(_names_in_dict, set(map(type, layers)))):
        return None
    tensors = []
    for layer in layers:
        parts = vars(layer)
        if (
            type(parts) is not dict
            or not _LAYER_PARTS.issuperset(_PART_NAMES.intersection(parts))
            or ("element_size" in parts and "numel" in parts)
        ):
            return None
        tensors.append(parts.get("keys"))
        tensors.append(parts.get("values"))
    unique = {id(tensor): tensor for tensor in tensors if tensor is not None}  # (each counted once)
    if not unique or set(map(type, unique.values())) != {torch.Tensor}:
        return None
    # (a sparse tensor has no nbytes: the RuntimeError sends cache_bytes to the walk, which counts its dense size)
    return sum(map(_NBYTES, unique.values()))


_NBYTES = operator.attrgetter("nbytes")


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
