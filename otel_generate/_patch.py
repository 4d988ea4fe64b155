"""The one place where this package's patches are installed and removed.

Every hook replaces a function in a class's own ``__dict__`` (``GenerationMixin.generate``, a
model class's ``generate``, Whisper's helpers, ...) with a plain function built by a factory
from the original. :class:`Patches` records each replacement, so that ``uninstrument()``
restores exactly what was there, and leaves other tools' wrappers working.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, List, Optional, Tuple

_LOG = logging.getLogger("otel_generate")
_MISSING = object()


class Patches:
    """The replacements one ``instrument()`` installed.

    Each hook must also check that the instrumentation is still on (``Telemetry.active``) and
    call its original when it is not: a hook that cannot be taken out of another tool's chain of
    wrappers then stays behind inert.
    """

    def __init__(self) -> None:
        self._installed: List[Tuple[Any, str, Any, Any]] = []  # (owner, name, replacement, previous)
        self._lock = threading.Lock()

    def replace(self, owner: Any, name: str, factory: Callable[..., Any], *factory_args: Any) -> bool:
        """Replace ``owner.__dict__[name]`` by ``factory(original, *factory_args)``.

        Returns False (and changes nothing) when ``owner`` does not define ``name`` itself, or
        when it is already replaced by this set of patches.
        """
        with self._lock:
            previous = owner.__dict__.get(name, _MISSING)
            if previous is _MISSING or any(o is owner and n == name for o, n, _, _ in self._installed):
                return False
            replacement = factory(previous, *factory_args)
            setattr(owner, name, replacement)
            self._installed.append((owner, name, replacement, previous))
            return True

    def add(self, owner: Any, name: str, value: Any) -> bool:
        """Set ``owner.name = value`` where ``owner`` does not define ``name`` itself (removed on restore)."""
        with self._lock:
            if name in owner.__dict__:
                return False
            setattr(owner, name, value)
            self._installed.append((owner, name, value, _MISSING))
            return True

    def is_installed(self, owner: Any, name: str) -> bool:
        return any(o is owner and n == name for o, n, _, _ in self._installed)

    def restore_all(self) -> None:
        """Undo every replacement, newest first. Where another tool wrapped one of ours since, ours
        is taken out of its chain; where that is impossible, ours stays inert and one warning says so."""
        with self._lock:
            installed, self._installed = self._installed, []
        for owner, name, replacement, previous in reversed(installed):
            current = owner.__dict__.get(name, _MISSING)
            if current is replacement:
                if previous is _MISSING:
                    delattr(owner, name)
                else:
                    setattr(owner, name, previous)
            elif not _splice(current, replacement, previous):
                _LOG.warning(
                    "otel_generate: %s.%s was wrapped by another tool after instrument() and its wrapper cannot be "
                    "rewired; otel_generate's hook stays inside it, inert (it only calls the original)",
                    getattr(owner, "__qualname__", owner), name,
                )


def _splice(current: Any, ours: Any, previous: Any) -> bool:
    """Take ``ours`` out of a chain of wrappers that starts at ``current``: the wrapper whose
    ``__wrapped__`` is ours is pointed at what ours replaced."""
    if previous is _MISSING:
        return False
    link: Optional[Any] = current
    for _ in range(64):  # a chain of wrappers, not a cycle
        inner = getattr(link, "__wrapped__", None)
        if inner is None:
            return False
        if inner is ours:
            try:
                link.__wrapped__ = previous
            except (AttributeError, TypeError):
                return False
            return getattr(link, "__wrapped__", None) is previous
        link = inner
    return False
