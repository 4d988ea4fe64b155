"""The one place where otel_generate installs and removes its patches.

Every patch this package applies goes through :func:`wrap`; :func:`unwrap_all` (called by
``GenerateInstrumentor.uninstrument()``) removes exactly those, and nothing else, wherever each
one sits in a chain of wrappers:

* ours is outermost: the attribute is restored to what ours wrapped (or deleted again when ours
  created it, e.g. it shadowed an inherited method).
* a wrapt proxy (``wrapt.FunctionWrapper``, ``wrapt.ObjectProxy``; another instrumentation,
  a profiler) was applied over ours: ours is spliced out of the chain by pointing that proxy's
  ``__wrapped__`` at what ours wrapped. The other wrapper stays installed and keeps running.
* something that is not a wrapt proxy (say a ``functools.wraps`` closure) was applied over ours,
  or the attribute was replaced outright: that wrapper calls ours directly and cannot be
  re-pointed. Ours is then left in place as a pass-through (it calls what it wraps and does
  nothing else), and one warning per :func:`unwrap_all` call names what could not be removed.

Every wrapper installed by :func:`wrap` also turns into a pass-through the moment
:func:`unwrap_all` runs, so a bound method taken while instrumented (``gen = model.generate``)
stops emitting telemetry too. The chain is only ever searched down to our own wrapper: what ours
wrapped (for ``generate()``, transformers' ``torch.no_grad()``-decorated function, which has a
``__wrapped__`` of its own) is never unwrapped.

Interface::

    from otel_generate import _patch

    _patch.wrap(GenerationMixin, "generate", wrapper)   # wrapper(wrapped, instance, args, kwargs)
    ...
    _patch.unwrap_all()                                # removes every patch wrap() installed
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, List, Tuple

import wrapt

_LOG = logging.getLogger("otel_generate")

#: wrapt's proxy base class (``BaseObjectProxy`` in wrapt 2, ``ObjectProxy`` in wrapt 1):
#: every wrapt wrapper, FunctionWrapper included, is one, and its ``__wrapped__`` can be set.
_PROXY = getattr(wrapt, "BaseObjectProxy", wrapt.ObjectProxy)
#: How deep a chain of wrappers above ours is searched.
_MAX_CHAIN = 64

_lock = threading.Lock()


class Patch:
    """One wrapper installed by :func:`wrap`.

    Attributes:
        owner: the class or module that holds the patched attribute.
        name: the attribute's name.
        proxy: the ``wrapt.FunctionWrapper`` that was installed.
        active: ``False`` once :func:`unwrap_all` ran; the wrapper then only calls what it wraps.
    """

    __slots__ = ("owner", "name", "proxy", "active", "_created")

    def __init__(self, owner: Any, name: str, created: bool) -> None:
        self.owner = owner
        self.name = name
        self.proxy: Any = None
        self.active = True
        self._created = created

    @property
    def label(self) -> str:
        return f"{getattr(self.owner, '__qualname__', getattr(self.owner, '__name__', self.owner))}.{self.name}"

    def __repr__(self) -> str:
        return f"<otel_generate patch {self.label} {'active' if self.active else 'inert'}>"


_installed: List[Patch] = []


def wrap(owner: Any, name: str, wrapper: Callable[[Any, Any, tuple, dict], Any]) -> Patch:
    """Install ``wrapper`` around ``owner.name`` with ``wrapt.FunctionWrapper`` and record it.

    Args:
        owner: a class or module (not a dotted path).
        name: the attribute to wrap; ``getattr(owner, name)`` must exist.
        wrapper: ``wrapper(wrapped, instance, args, kwargs)``, wrapt's wrapper signature.

    Returns:
        The :class:`Patch` record (kept until :func:`unwrap_all`).

    Raises:
        AttributeError: ``owner`` has no attribute ``name``.
    """
    try:
        created = name not in vars(owner)
    except TypeError:  # an object without __dict__: wrapt resolves the attribute as it can
        created = False
    patch = Patch(owner, name, created)

    def switchable(wrapped, instance, args, kwargs):
        if patch.active:
            return wrapper(wrapped, instance, args, kwargs)
        return wrapped(*args, **kwargs)

    with _lock:
        patch.proxy = wrapt.wrap_function_wrapper(owner, name, switchable)
        _installed.append(patch)
    return patch


def installed() -> Tuple[Patch, ...]:
    """The patches :func:`wrap` installed and :func:`unwrap_all` has not removed yet, oldest first."""
    with _lock:
        return tuple(_installed)


def unwrap_all() -> None:
    """Remove every patch :func:`wrap` installed, newest first; never raises.

    Patches that cannot be removed (see the module docstring) are left as pass-throughs and
    reported in one warning.
    """
    with _lock:
        patches = list(reversed(_installed))
        _installed.clear()
    inert = []
    for patch in patches:
        patch.active = False  # first: whatever follows, ours does nothing from now on
        try:
            blocker = _remove(patch)
        except Exception as exc:  # never let uninstrument() fail half-way
            blocker = f"an error while removing it ({type(exc).__name__}: {exc})"
        if blocker is not None:
            inert.append(f"{patch.label} ({blocker})")
    if inert:
        _LOG.warning(
            "otel_generate: could not remove its wrapper of %s; left in place as a pass-through "
            "(the method works and this package records nothing through it). Remove the other "
            "wrapper first, then uninstrument, to remove ours completely.",
            "; ".join(inert),
        )


def _describe(obj: Any) -> str:
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    kind = type(obj).__qualname__
    return f"{kind} {name!r}" if isinstance(name, str) else kind


def _remove(patch: Patch):
    """Take ``patch`` out of its chain; ``None`` when done, else why it could not be done."""
    owner, name, proxy = patch.owner, patch.name, patch.proxy
    try:
        current = vars(owner).get(name, None)
    except TypeError:
        current = getattr(owner, name, None)
    if current is proxy:  # outermost: restore what ours wrapped
        if patch._created:
            delattr(owner, name)
        else:
            setattr(owner, name, proxy.__wrapped__)
        return None
    if current is None:
        return "the attribute was removed"
    above = current
    for _ in range(_MAX_CHAIN):
        try:
            below = above.__wrapped__  # a wrapt proxy answers this itself, never its wrapped object
        except AttributeError:
            break
        if below is proxy:
            if isinstance(above, _PROXY):
                above.__wrapped__ = proxy.__wrapped__  # splice ours out; the other wrapper stays
                return None
            return f"{_describe(above)}, which is not a wrapt proxy, was applied over it and calls it directly"
        if below is above:
            break
        above = below
    return f"the attribute was replaced by {_describe(current)}, which does not lead to it"
