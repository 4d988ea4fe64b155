"""Clocks and device synchronization: the one module that decides when time is read.

A clock read on the host while an accelerator still has queued kernels measures when work was
*launched*, not when it finished. Every timing in this package therefore goes through
:func:`synchronizer_for` first: on CUDA, XPU and MPS it returns that backend's own
``synchronize``; on CPU (where eager PyTorch ops have finished when they return) it returns
``None`` and no accelerator function is ever called. The instrumentor's step hook and the
benchmark harness (:func:`timed_call`) both use this module.

Units: :data:`monotonic_ns` returns integer nanoseconds; :func:`timed_call` returns seconds.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable, Optional, Tuple, TypeVar

T = TypeVar("T")

Synchronize = Callable[[], None]

#: Monotonic clock used for every step boundary (integer nanoseconds, ``time.perf_counter_ns``).
monotonic_ns: Callable[[], int] = time.perf_counter_ns

#: Wall clock used to place spans on the epoch time line (integer nanoseconds since the epoch).
wall_ns: Callable[[], int] = time.time_ns

NS_PER_MS = 1_000_000
NS_PER_S = 1_000_000_000


def _device_type_and_index(device: Any) -> Tuple[str, Optional[int]]:
    """``"cuda:1"``, ``torch.device("cuda", 1)`` or ``1`` (CUDA ordinal) -> ``("cuda", 1)``."""
    if isinstance(device, int):
        return "cuda", device
    if hasattr(device, "type"):
        return str(device.type), getattr(device, "index", None)
    text = str(device)
    kind, _, index = text.partition(":")
    return kind, (int(index) if index.isdigit() else None)


def synchronizer_for(devices: Any) -> Optional[Synchronize]:
    """Return a function that waits for all queued work on ``devices``, or ``None``.

    Args:
        devices: one device (``torch.device``, ``"cuda:0"``, ``"cpu"``, an int CUDA ordinal) or an
            iterable of them (a model spread over several GPUs by ``device_map``).

    Returns:
        ``None`` when every device is a CPU (or ``meta``) device: nothing to wait for, and no
        accelerator API is touched. Otherwise a zero-argument function calling
        ``torch.cuda.synchronize(device)``, ``torch.xpu.synchronize(device)`` or
        ``torch.mps.synchronize()`` for each distinct accelerator device.

    Raises:
        ValueError: for a device type this package cannot synchronize (for example ``"hpu"``),
            rather than timing it wrongly.
    """
    if isinstance(devices, (str, int)) or hasattr(devices, "type"):
        devices = [devices]
    calls = []
    seen = set()
    for device in devices:
        kind, index = _device_type_and_index(device)
        if kind in ("cpu", "meta") or (kind, index) in seen:
            continue
        seen.add((kind, index))
        import torch  # imported here: the CPU path never needs it

        if kind == "cuda":
            target = torch.device("cuda", index) if index is not None else None
            calls.append(lambda target=target: torch.cuda.synchronize(target))
        elif kind == "xpu":
            target = torch.device("xpu", index) if index is not None else None
            calls.append(lambda target=target: torch.xpu.synchronize(target))
        elif kind == "mps":
            calls.append(torch.mps.synchronize)
        else:
            raise ValueError(f"cannot synchronize device type {kind!r}: expected cpu, cuda, xpu or mps")
    if not calls:
        return None
    if len(calls) == 1:
        return calls[0]

    def synchronize_all() -> None:
        for call in calls:
            call()

    return synchronize_all


def timed_call(
    fn: Callable[[], T],
    synchronize: Optional[Synchronize],
    clock: Callable[[], float] = time.perf_counter,
) -> Tuple[T, float]:
    """Time one call of ``fn`` as completed device work.

    The order is fixed: synchronize, read ``clock``, call ``fn``, synchronize, read ``clock``
    (the pattern of Triton's ``do_bench``, with one synchronization on each side).

    Args:
        fn: the zero-argument call to time, e.g. ``lambda: model.generate(**inputs)``.
        synchronize: from :func:`synchronizer_for`; ``None`` on CPU.
        clock: a clock in seconds (``time.perf_counter`` by default).

    Returns:
        ``(result of fn, elapsed seconds)``.

    Raises:
        ValueError: when the elapsed time is not positive (a clock that did not advance cannot
            give an honest rate).
    """
    if synchronize is not None:
        synchronize()
    start = clock()
    result = fn()
    if synchronize is not None:
        synchronize()
    elapsed = clock() - start
    if not elapsed > 0:
        raise ValueError(f"elapsed time must be positive, got {elapsed!r} s: the clock did not advance")
    return result, elapsed


def devices_of(model: Any) -> Iterable[Any]:
    """The devices a transformers model runs on: every device of ``hf_device_map`` plus ``model.device``."""
    found = []
    device_map = getattr(model, "hf_device_map", None)
    if isinstance(device_map, dict):
        for value in device_map.values():
            if isinstance(value, int):
                found.append(value)
            elif isinstance(value, str) and value not in ("disk",):
                found.append(value)
    device = getattr(model, "device", None)
    if device is not None:
        found.append(device)
    return found
