"""Which process of a distributed run speaks for a ``generate()`` call, and the ranks on its span.

Tensor parallelism (transformers' ``tp_plan``): every rank of a tensor-parallel group runs
``generate()`` for the same user call, in lockstep (their collectives must match). That is one
request, not one per rank. By default (``tensor_parallel_spans="rank0"``) only the group's rank 0
emits it (request span, step spans, metrics); the other ranks run ``generate()`` uninstrumented:
no span, no metric, no per-step work, no profiler record, no ``per_token_latency_callback``
call. With ``tensor_parallel_spans="all"`` every rank emits its own request span (to find a
slow rank), and rank 0 alone records the request in the metrics.

Every request span in a distributed run carries the ranks (request-span attributes, not metric
attributes): ``generate.tensor_parallel.rank`` / ``.size`` / ``.call_index`` on a
tensor-parallel model, ``generate.distributed.rank`` / ``.world_size`` whenever
``torch.distributed`` is initialized. Data parallelism (no ``tp_plan``, or a group of size 1)
changes nothing but those tags: each rank's calls are its own requests.

No collective is added: putting every rank's span in rank 0's trace would need rank 0's span
context on the other ranks at the start of the call, which only a collective over the group
(a broadcast) could bring. A collective that the instrumentation adds must be made by every
rank, or the group hangs or pairs it with the model's own all-reduce; that holds only if every
rank makes the same instrumentation decision for every call (same options, same suppression,
same ``uninstrument()`` timing), which nothing guarantees; on NCCL it would also add a device
round trip before the first step. What ties the ranks' spans of one call together instead:
the same ``generate.tensor_parallel.call_index`` (and model, and ``generate.tensor_parallel.size``),
and the same parent trace when the launcher hands every rank the same parent context.

How the group is found (transformers 5.x, read from 5.24): ``model._mesh_manager.get_mesh("tp")``
(``from_pretrained(..., tp_plan=...)`` / ``distributed_config``); else ``model._device_mesh`` or
``model.device_mesh``, its ``"tp"`` dimension when it has named dimensions, or the mesh itself when
it is one-dimensional (transformers 4.47 to 5.16). The group's size is the mesh's size and the
rank its ``get_local_rank()``; a size of 1 is no tensor parallelism. Read once per model (a
weak reference: nothing is kept alive).
"""

from __future__ import annotations

import itertools
import sys
import weakref
from typing import Any, Dict, Optional, Tuple

from otel_generate import attributes as A
from otel_generate._faults import Fault, log_fault_once
from otel_generate.options import TENSOR_PARALLEL_SPANS_ALL

#: model -> _ModelRanks (or None when the model is not sharded by tensor parallelism)
_MODELS: "weakref.WeakKeyDictionary[Any, Optional[_ModelRanks]]" = weakref.WeakKeyDictionary()


class _ModelRanks:
    """A tensor-parallel model's place in its group, and the count of its calls in this process."""

    __slots__ = ("rank", "size", "calls")

    def __init__(self, rank: int, size: int) -> None:
        self.rank = rank
        self.size = size
        self.calls = itertools.count()


class Placement:
    """What one ``generate()`` call's ranks mean for its request.

    Attributes:
        silent: run the call uninstrumented (a tensor-parallel rank other than 0, default mode).
        metrics: record the request in the metrics (False on a rank other than 0 in ``all`` mode).
        attributes: the rank attributes for the request span.
    """

    __slots__ = ("silent", "metrics", "attributes")

    def __init__(self, silent: bool, metrics: bool, attributes: Dict[str, Any]) -> None:
        self.silent = silent
        self.metrics = metrics
        self.attributes = attributes


def tensor_parallel_group(model: Any) -> Optional[Tuple[int, int]]:
    """``(rank in the group, group size)`` of a model sharded by tensor parallelism, else ``None``."""
    mesh = None
    manager = getattr(model, "_mesh_manager", None)
    if manager is not None and callable(getattr(manager, "get_mesh", None)):
        try:
            mesh = manager.get_mesh("tp")
        except Exception:  # a mesh without a "tp" dimension
            mesh = None
    if mesh is None:
        for name in ("_device_mesh", "device_mesh"):
            mesh = getattr(model, name, None)
            if mesh is not None:
                break
        if mesh is not None:
            names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
            if "tp" in names:
                if len(names) > 1:
                    mesh = mesh["tp"]
            elif getattr(mesh, "ndim", 1) != 1:
                mesh = None  # several unnamed dimensions: not ours to interpret
    if mesh is None:
        return None
    size = int(mesh.size())
    if size <= 1:
        return None
    return int(mesh.get_local_rank()), size


def distributed_ranks() -> Optional[Tuple[int, int]]:
    """``(torch.distributed.get_rank(), get_world_size())`` when it is initialized, else ``None``
    (torch is not imported here)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    return int(dist.get_rank()), int(dist.get_world_size())


def _model_ranks(model: Any) -> Optional[_ModelRanks]:
    try:
        return _MODELS[model]
    except KeyError:
        pass
    except TypeError:  # not weakly referenceable: read it every time
        group = tensor_parallel_group(model)
        return _ModelRanks(*group) if group is not None else None
    group = tensor_parallel_group(model)
    ranks = _ModelRanks(*group) if group is not None else None
    _MODELS[model] = ranks
    return ranks


def placement(model: Any, mode: str) -> Optional[Placement]:
    """The placement of a ``generate()`` call of ``model`` starting now; ``None`` outside a
    distributed run (the common case: one dictionary look-up and ``is_initialized()``). Counts the
    call on a tensor-parallel model, instrumented or not. Never raises (a fault is logged once and
    the call is treated as a plain one)."""
    try:
        group = _model_ranks(model)
        world = distributed_ranks()
        if group is None and world is None:
            return None
        attributes: Dict[str, Any] = {}
        silent, metrics = False, True
        if group is not None:
            attributes[A.GENERATE_TENSOR_PARALLEL_RANK] = group.rank
            attributes[A.GENERATE_TENSOR_PARALLEL_SIZE] = group.size
            attributes[A.GENERATE_TENSOR_PARALLEL_CALL_INDEX] = next(group.calls)
            if group.rank != 0:
                if mode == TENSOR_PARALLEL_SPANS_ALL:
                    metrics = False
                else:
                    silent = True
        if world is not None:
            attributes[A.GENERATE_DISTRIBUTED_RANK] = world[0]
            attributes[A.GENERATE_DISTRIBUTED_WORLD_SIZE] = world[1]
        return Placement(silent, metrics, attributes)
    except Exception as fault:
        log_fault_once(Fault.DISTRIBUTED_RANKS, fault)
        return None


def apply(placement: Placement, request: Any) -> None:
    """Put ``placement`` on a :class:`~otel_generate.request.Request`: its rank attributes, and
    whether it is recorded in the metrics."""
    request.parameters.update(placement.attributes)
    request.metrics = placement.metrics


def attributes_of(model: Any) -> Dict[str, Any]:
    """The rank attributes of a request of ``model`` submitted now to continuous batching (only the
    group's driver, rank 0, submits), without a call index; empty outside a distributed run."""
    try:
        group = _model_ranks(model)
        world = distributed_ranks()
    except Exception as fault:
        log_fault_once(Fault.DISTRIBUTED_RANKS, fault)
        return {}
    attributes: Dict[str, Any] = {}
    if group is not None:
        attributes[A.GENERATE_TENSOR_PARALLEL_RANK] = group.rank
        attributes[A.GENERATE_TENSOR_PARALLEL_SIZE] = group.size
    if world is not None:
        attributes[A.GENERATE_DISTRIBUTED_RANK] = world[0]
        attributes[A.GENERATE_DISTRIBUTED_WORLD_SIZE] = world[1]
    return attributes
