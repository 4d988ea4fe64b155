"""Energy from NVML's total-energy counter, and what can honestly be attributed from its readings.

NVML (``nvidia-ml-py``, the ``[energy]`` extra: ``pip install 'otel-generate[energy]'``) keeps a
counter of the energy each GPU has used since the driver loaded,
``nvmlDeviceGetTotalEnergyConsumption`` (millijoules). :func:`meter_for` gives an
:class:`EnergyMeter` for the CUDA devices a model runs on; its :meth:`EnergyMeter.read` is one
NVML call per device. The producers read it when a request starts and ends (and at each step
boundary when step spans are on), and the pure functions below turn the readings into what a
request or a step used:

* :func:`request_energy_mj`: end minus start, when the counter advanced;
* :func:`step_energies_mj`: each step's difference, only when the counter advanced within
  every step (a step in which it did not means the counter is updated less often than a step
  takes: no step figure is given then, the request's total still is);
* :func:`shares_mj`: one continuous-batching step's energy shared among its requests in
  proportion to the tokens each computed in it.

A reading that cannot be attributed is left out (``None``), never estimated. NVML missing, no
CUDA device, or NVML failing: no energy at all, one log line (the logger ``otel_generate``), and
generation goes on. Nothing here runs for a model on the CPU.

The counter belongs to the device, not to a request: two requests running at once on one GPU
(two threads calling ``generate()``) each count the energy of both, as the peak-memory
statistic does. Continuous batching shares each batch step's energy among the requests that
shared the step instead.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple

from otel_generate._faults import Fault, log_fault_once, note_once

#: the Python module of ``nvidia-ml-py``
NVML_MODULE = "pynvml"
_NOTE_KEY = "energy unavailable"

_lock = threading.Lock()
_UNTRIED: Any = object()
#: the ``pynvml`` module once ``nvmlInit()`` succeeded, ``None`` when NVML is unavailable, or
#: :data:`_UNTRIED`
_nvml: Any = _UNTRIED
#: sorted CUDA device indices -> their :class:`EnergyMeter`, or ``None`` (no energy for them)
_meters: Dict[Tuple[int, ...], Optional["EnergyMeter"]] = {}


class EnergyMeter:
    """NVML's total-energy counter of one or more CUDA devices, summed (millijoules).

    :meth:`read` never raises: a failing read is logged once (``energy reading``) and this meter
    returns ``None`` from then on.
    """

    __slots__ = ("_read", "_handles", "_failed")

    def __init__(self, read: Any, handles: Sequence[Any]) -> None:
        self._read = read  # nvmlDeviceGetTotalEnergyConsumption
        self._handles = tuple(handles)
        self._failed = False

    def read(self) -> Optional[int]:
        """Millijoules the devices used since the driver loaded, or ``None`` once a read failed."""
        if self._failed:
            return None
        try:
            if len(self._handles) == 1:
                return int(self._read(self._handles[0]))
            return sum(int(self._read(handle)) for handle in self._handles)
        except Exception as fault:
            self._failed = True
            log_fault_once(Fault.ENERGY_READING, fault)
            return None


def _library() -> Any:
    """The initialised ``pynvml`` module, or ``None`` (said once: not installed, or NVML failed)."""
    global _nvml
    if _nvml is not _UNTRIED:
        return _nvml
    with _lock:
        if _nvml is not _UNTRIED:
            return _nvml
        try:
            import pynvml
        except ImportError:
            note_once(
                _NOTE_KEY,
                "otel_generate: energy is not measured: NVML's Python bindings are not installed "
                "(pip install 'otel-generate[energy]')",
            )
            _nvml = None
            return None
        try:
            pynvml.nvmlInit()
        except Exception as fault:
            note_once(
                _NOTE_KEY,
                "otel_generate: energy is not measured: NVML did not start (%s: %s)",
                type(fault).__name__,
                fault,
                level=logging.WARNING,
            )
            _nvml = None
            return None
        _nvml = pynvml
        return _nvml


def _cuda_indices(devices: Any) -> Optional[Tuple[int, ...]]:
    """The CUDA device indices among ``devices`` (sorted, distinct), or ``None`` when there is none."""
    if isinstance(devices, (str, int)) or hasattr(devices, "type"):
        devices = [devices]
    indices = set()
    for device in devices:
        if isinstance(device, int):
            indices.add(device)
            continue
        kind = getattr(device, "type", None)
        index = getattr(device, "index", None)
        if kind is None:
            kind, _, text = str(device).partition(":")
            index = int(text) if text.isdigit() else None
        if kind != "cuda":
            continue
        if index is None:
            import torch

            index = torch.cuda.current_device()
        indices.add(int(index))
    return tuple(sorted(indices)) if indices else None


def _handle(nvml: Any, index: int) -> Any:
    """NVML's handle of CUDA device ``index``, found by the device's UUID (CUDA and NVML number
    devices differently under ``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER``)."""
    import torch

    uuid = str(torch.cuda.get_device_properties(index).uuid)
    if not uuid.startswith(("GPU-", "MIG-")):
        uuid = "GPU-" + uuid
    return nvml.nvmlDeviceGetHandleByUUID(uuid)


def meter_for(devices: Any) -> Optional[EnergyMeter]:
    """The :class:`EnergyMeter` of the CUDA devices among ``devices``, or ``None``: no CUDA device
    (NVML is not touched), NVML unavailable, or a device whose counter cannot be read (each said
    once on the logger ``otel_generate``). Remembered per set of devices; never raises."""
    try:
        indices = _cuda_indices(devices)
    except Exception:  # a device that cannot be told: no energy for it
        return None
    if indices is None:
        return None
    meter = _meters.get(indices, _UNTRIED)
    if meter is not _UNTRIED:
        return meter
    nvml = _library()
    meter = None
    if nvml is not None:
        try:
            handles = [_handle(nvml, index) for index in indices]
            read = nvml.nvmlDeviceGetTotalEnergyConsumption
            for handle in handles:
                int(read(handle))  # the counter exists on this device (Volta and newer; not a MIG slice)
            meter = EnergyMeter(read, handles)
        except Exception as fault:
            note_once(
                _NOTE_KEY + f" {indices}",
                "otel_generate: energy is not measured on CUDA device(s) %s: NVML cannot read their energy counter "
                "(%s: %s)",
                ", ".join(map(str, indices)),
                type(fault).__name__,
                fault,
                level=logging.WARNING,
            )
    _meters[indices] = meter  # (a dictionary store: atomic; two first requests may both look, alike)
    return meter


def reset() -> None:
    """Forget NVML and the meters: the next CUDA request starts NVML again."""
    global _nvml
    with _lock:
        _nvml = _UNTRIED
        _meters.clear()


def _after_fork_in_child() -> None:
    """A forked child starts NVML again, with a new lock (a thread of the parent may have held the
    old one at the fork: it would never be released here)."""
    global _lock, _nvml, _meters
    _lock = threading.Lock()
    _nvml = _UNTRIED
    _meters = {}


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


# --- what the readings can honestly say (pure) --------------------------------------------------------


def request_energy_mj(start_mj: Optional[int], end_mj: Optional[int]) -> Optional[int]:
    """Millijoules between two readings, or ``None``: a reading is missing, or the counter did not
    advance (the request was shorter than the counter's update period: nothing to attribute)."""
    if start_mj is None or end_mj is None:
        return None
    used = end_mj - start_mj
    return used if used > 0 else None


def step_energies_mj(start_mj: Optional[int], readings: Sequence[Optional[int]]) -> Optional[List[int]]:
    """Each step's millijoules, from the reading before the first step (``start_mj``) and one
    reading after each step, or ``None`` when a reading is missing or the counter did not advance
    within some step: then it is updated less often than a step takes, and a step's difference
    would hold the energy of other steps (the request's total stays honest: see
    :func:`request_energy_mj`)."""
    previous = start_mj
    if previous is None or not readings:
        return None
    steps = []
    for reading in readings:
        if reading is None:
            return None
        used = reading - previous
        if used <= 0:
            return None
        steps.append(used)
        previous = reading
    return steps


def shares_mj(energy_mj: Optional[float], computed: Sequence[Optional[int]]) -> Optional[List[float]]:
    """``energy_mj`` of one batch step shared in proportion to the tokens each request computed in
    it (``computed``, one count per request of the batch), or ``None`` when the energy or a count
    is unknown, or nothing was computed."""
    if energy_mj is None or not computed:
        return None
    total = 0
    for tokens in computed:
        if tokens is None or tokens < 0:
            return None
        total += tokens
    if total <= 0:
        return None
    return [energy_mj * tokens / total for tokens in computed]
