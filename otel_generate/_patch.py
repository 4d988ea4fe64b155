"""How this package's patches are installed and removed (which ones: :data:`otel_generate.instrumentor.PATCHES`).

Every hook replaces a function in a class's own ``__dict__`` (``GenerationMixin.generate``, a
model class's ``generate``, Whisper's helpers, ...) with a plain function built by a factory
from the original. Plain functions, not wrapt proxies: ``torch.compile`` inlines a wrapt
``FunctionWrapper`` as the function it wraps and skips it, while it runs a
``torch.compiler.disable``-d plain function eagerly.

:meth:`Patches.restore_all` (``uninstrument()``) removes exactly these, and nothing else,
wherever each one sits in a chain of wrappers:

* ours is outermost: the attribute is restored to what ours replaced (or deleted, when ours
  added it);
* a wrapt proxy (another instrumentation, a profiler) was applied over ours: ours is spliced
  out by pointing that proxy's ``__wrapped__`` at what ours replaced; the other wrapper stays
  and keeps running;
* something that is not a wrapt proxy (a ``functools.wraps`` closure) was applied over ours, or
  the attribute was replaced outright: ours cannot be taken out. It stays, as a pass-through
  (every hook calls its original once ``Telemetry.active`` is False), and one warning names it.

The chain is only searched down to our own function: what ours replaced (transformers'
``torch.no_grad()``-decorated ``generate``, with a ``__wrapped__`` of its own) is never unwrapped.

Nothing is imported to be patched: :meth:`Patches.on_import` runs an installer when its module
is first imported (at once when it already is), through ``wrapt.register_post_import_hook``.
wrapt cannot unregister such a hook, so :meth:`Patches.restore_all` cancels the ones that have
not fired: each registration becomes a no-op that holds nothing, and a later ``instrument()``
registers fresh ones.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, List, Optional, Tuple

import wrapt

from otel_generate._faults import LOGGER_NAME, Fault, log_fault_once

_LOG = logging.getLogger(LOGGER_NAME)
_MISSING = object()
#: wrapt's proxy base class (``BaseObjectProxy`` in wrapt 2, ``ObjectProxy`` in wrapt 1): its
#: ``__wrapped__`` can be re-pointed.
_PROXY = getattr(wrapt, "BaseObjectProxy", wrapt.ObjectProxy)
#: How deep a chain of wrappers above ours is searched.
_MAX_CHAIN = 64


class _ImportHook:
    """One post-import hook registered with wrapt; :meth:`cancel` makes it a no-op that holds nothing."""

    __slots__ = ("installer", "module")

    def __init__(self, installer: Callable[[Any], None], module: str) -> None:
        self.installer: Optional[Callable[[Any], None]] = installer
        self.module = module

    def __call__(self, module: Any) -> None:
        installer = self.installer
        if installer is None:
            return
        try:
            installer(module)
        except Exception as fault:  # never break the application's import
            log_fault_once(Fault.import_hook_install(self.module), fault)

    def cancel(self) -> None:
        self.installer = None


class Patches:
    """The replacements one ``instrument()`` installed, oldest first, and its pending import hooks."""

    def __init__(self) -> None:
        self._installed: List[Tuple[Any, str, Any, Any]] = []  # (owner, name, replacement, previous)
        self._hooks: List[_ImportHook] = []
        self._closed = False  # restore_all() ran: nothing more is installed
        self._lock = threading.RLock()

    def on_import(self, module: str, installer: Callable[[Any], None]) -> None:
        """Run ``installer(module object)`` when ``module`` is first imported, or now if it already is.

        Nothing is imported here. The installer runs inside the import that loads the module
        (before the importer continues), at most once; an exception it raises is logged once and
        never reaches the import. :meth:`restore_all` cancels it if it has not run yet.
        """
        hook = _ImportHook(installer, module)
        with self._lock:
            if self._closed:
                return
            self._hooks.append(hook)
        wrapt.register_post_import_hook(hook, module)

    def pending_imports(self) -> Tuple[str, ...]:
        """The modules whose hooks are registered and not cancelled (fired ones included)."""
        with self._lock:
            return tuple(hook.module for hook in self._hooks if hook.installer is not None)

    def replace(self, owner: Any, name: str, factory: Callable[..., Any], *factory_args: Any) -> bool:
        """Replace ``owner.__dict__[name]`` by ``factory(original, *factory_args)``.

        Returns False (and changes nothing) when ``owner`` does not define ``name`` itself, or
        when this set of patches already replaced it.
        """
        with self._lock:
            if self._closed:
                return False
            previous = vars(owner).get(name, _MISSING)
            if previous is _MISSING or self._find(owner, name) is not None:
                return False
            replacement = factory(previous, *factory_args)
            setattr(owner, name, replacement)
            self._installed.append((owner, name, replacement, previous))
            return True

    def add(self, owner: Any, name: str, value: Any) -> bool:
        """Set ``owner.name = value`` where ``owner`` does not define ``name`` itself (deleted again on restore)."""
        with self._lock:
            if self._closed or name in vars(owner):
                return False
            setattr(owner, name, value)
            self._installed.append((owner, name, value, _MISSING))
            return True

    def _find(self, owner: Any, name: str) -> Optional[Tuple[Any, str, Any, Any]]:
        return next((entry for entry in self._installed if entry[0] is owner and entry[1] == name), None)

    def is_installed(self, owner: Any, name: str) -> bool:
        with self._lock:
            return self._find(owner, name) is not None

    def installed(self) -> Tuple[Tuple[Any, str], ...]:
        """``(owner, name)`` of every patch in place, oldest first."""
        with self._lock:
            return tuple((owner, name) for owner, name, _, _ in self._installed)

    def restore_all(self) -> None:
        """Cancel the import hooks that have not fired, then undo every patch, newest first; never
        raises. Nothing is installed through this object afterwards. The caller turns the hooks
        inert first (``Telemetry.active = False``), so what cannot be removed only passes through;
        one warning names it."""
        with self._lock:
            self._closed = True
            hooks, self._hooks = self._hooks, []
            installed, self._installed = self._installed, []
        for hook in hooks:
            hook.cancel()
        stuck = []
        for owner, name, replacement, previous in reversed(installed):
            try:
                blocker = _remove(owner, name, replacement, previous)
            except Exception as exc:  # never let uninstrument() fail half-way
                blocker = f"an error while removing it ({type(exc).__name__}: {exc})"
            if blocker is not None:
                stuck.append(f"{getattr(owner, '__qualname__', owner)}.{name} ({blocker})")
            # another tool may have wrapped what a subclass inherited from ours, on the subclass
            for sub, blocker in _inherited_wrappers(owner, name, replacement, previous):
                if blocker is not None:
                    stuck.append(f"{getattr(sub, '__qualname__', sub)}.{name} ({blocker})")
        if stuck:
            _LOG.warning(
                "otel_generate: could not remove its hook of %s; left in place as a pass-through (the method works "
                "and this package records nothing through it). Remove the other wrapper first, then uninstrument, "
                "to remove ours completely.",
                "; ".join(stuck),
            )


def _inherited_wrappers(owner: Any, name: str, ours: Any, previous: Any):
    """``(subclass, blocker)`` for each subclass of ``owner`` whose own ``name`` is another tool's
    wrapper around ours (it wrapped the inherited attribute): ours is spliced out of it (``blocker``
    None) or cannot be."""
    if not isinstance(owner, type) or previous is _MISSING:
        return
    seen, pending = set(), list(type.__subclasses__(owner))
    while pending:
        sub = pending.pop()
        if sub in seen:
            continue
        seen.add(sub)
        pending.extend(type.__subclasses__(sub))
        current = vars(sub).get(name, _MISSING)
        if current is _MISSING or current is ours or not _leads_to(current, ours):
            continue
        yield sub, _remove(sub, name, ours, previous)


def _leads_to(current: Any, ours: Any) -> bool:
    link = current
    for _ in range(_MAX_CHAIN):
        try:
            link = link.__wrapped__
        except AttributeError:
            return False
        if link is ours:
            return True
    return False


def _describe(obj: Any) -> str:
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
    kind = type(obj).__qualname__
    return f"{kind} {name!r}" if isinstance(name, str) else kind


def _remove(owner: Any, name: str, ours: Any, previous: Any) -> Optional[str]:
    """Take ``ours`` out; ``None`` when done, else why it could not be done."""
    current = vars(owner).get(name, _MISSING)
    if current is ours:
        if previous is _MISSING:
            delattr(owner, name)
        else:
            setattr(owner, name, previous)
        return None
    if current is _MISSING:
        return "the attribute was removed"
    if previous is _MISSING:
        return f"the attribute was replaced by {_describe(current)}"
    above = current
    for _ in range(_MAX_CHAIN):
        try:
            below = above.__wrapped__  # a wrapt proxy answers this itself, never its wrapped object
        except AttributeError:
            break
        if below is ours:
            if isinstance(above, _PROXY):
                above.__wrapped__ = previous  # splice ours out; the other wrapper stays
                return None
            return f"{_describe(above)}, which is not a wrapt proxy, was applied over it and calls it directly"
        if below is above:
            break
        above = below
    return f"the attribute was replaced by {_describe(current)}, which does not lead to it"
