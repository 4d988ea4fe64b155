"""Libraries this instrumentation instruments, and the version rule ``BaseInstrumentor`` checks them with.

``opentelemetry-instrument`` compares these requirement strings with what is installed
before it calls :meth:`otel_generate.GenerateInstrumentor.instrument`; a missing or too old
transformers or torch turns the instrumentor off with a log line instead of failing the app.
A pre-release of a supported version passes, whatever ``packaging`` is installed
(:func:`satisfies`; :mod:`otel_generate._versions` says why and where OpenTelemetry checks).
"""

from __future__ import annotations

import os
import sys
from importlib import metadata as importlib_metadata
from typing import Any, Iterable, List, Optional, Sequence

from packaging.requirements import InvalidRequirement, Requirement
from packaging.version import InvalidVersion, Version

#: transformers: the range CI tests, from the oldest release it runs (4.46.3) to the newest pip resolves.
_instruments = ("transformers >= 4.46.3", "torch >= 2.1")

_supports_metrics = True

#: This package's distribution and its ``opentelemetry_instrumentor`` entry point name.
DISTRIBUTION = "otel-generate"
ENTRY_POINT_NAME = "transformers_generate"
#: The extra the loader reads (``pip install otel-generate[instruments]`` installs it too).
INSTRUMENTS_EXTRA = "instruments"


def satisfies(requirement: Requirement, installed: str) -> bool:
    """Whether the installed version is in the requirement's range, a pre-release read as its release.

    ``5.25.0.dev0`` and ``5.25.0rc1`` are checked as ``5.25.0``; a final or post release, local
    label included (``2.13.0+cpu``), as it is. A version that is not PEP 440 is never in range.
    """
    try:
        version = Version(installed)
    except InvalidVersion:
        return False
    if version.is_prerelease:  # alpha, beta, rc, dev
        version = Version(version.base_version)
    return requirement.specifier.contains(version, prereleases=True)


def dependency_conflict(requirements: Iterable[Any]) -> Any:
    """The first requirement the installed distributions do not meet, as OpenTelemetry reports it.

    Args:
        requirements: requirement strings or ``packaging`` ``Requirement`` objects.

    Returns:
        ``None`` when all are met (see :func:`satisfies`), else an
        ``opentelemetry.instrumentation.dependencies.DependencyConflict`` naming the requirement
        and, when installed, what was found.
    """
    from opentelemetry.instrumentation.dependencies import DependencyConflict

    for dep in requirements:
        try:
            requirement = dep if isinstance(dep, Requirement) else Requirement(dep)
        except InvalidRequirement:
            return DependencyConflict(str(dep))
        try:
            installed = importlib_metadata.version(requirement.name)
        except importlib_metadata.PackageNotFoundError:
            return DependencyConflict(str(dep))
        if not satisfies(requirement, installed):
            return DependencyConflict(str(dep), f"{requirement.name} {installed}")
    return None


def instruments_requirements(distribution: Any) -> List[Requirement]:
    """The ``instruments`` extra of ``distribution``'s metadata, read as the loader reads it."""
    found = []
    for line in distribution.requires or ():
        try:
            requirement = Requirement(line)
        except InvalidRequirement:
            continue
        if requirement.marker is not None and requirement.marker.evaluate({"extra": INSTRUMENTS_EXTRA}):
            found.append(requirement)
    return found


# --- a clone's folder that hides the installed package ---------------------------------------------

#: What ``from otel_generate import GenerateInstrumentor`` raises where ``otel_generate`` was imported
#: as a namespace package (a folder of that name without ``__init__.py``, such as a clone's root).
NAMESPACE_ERROR = "ImportError: cannot import name 'GenerateInstrumentor' from 'otel_generate' (unknown location)"


def imported_as_namespace(module: Any) -> Optional[List[str]]:
    """The folders ``module`` was made of when Python imported it as a namespace package (no
    ``__init__.py`` found; its ``__file__`` is ``None``), else ``None``."""
    if module is None or getattr(module, "__file__", None) is not None:
        return None
    folders = [str(folder) for folder in (getattr(module, "__path__", None) or ())]
    return folders or None


def namespace_hint(folders: Sequence[str], started_in: Optional[str] = None, instrument: bool = False) -> str:
    """What to do when ``import otel_generate`` finds ``folders`` (without ``__init__.py``) instead of
    the installed package. That happens with an editable install (``pip install -e``): its import
    hook is asked only after every folder on ``sys.path``, and a folder named ``otel_generate`` on
    the path (a clone's root, seen from its parent folder) becomes a namespace package first. A
    regular install is found on ``sys.path`` itself and is not hidden. ``instrument``: said by the
    ``opentelemetry-instrument`` hook, which puts the current folder first on ``PYTHONPATH``."""
    started_in = started_in or os.getcwd()
    where = ", ".join(folders)
    how = (
        f"opentelemetry-instrument puts the current folder ({started_in}) first on PYTHONPATH"
        if instrument
        else f"Python started in {started_in} (a script there, `python -c`, `python -m`, the REPL) looks there first"
    )
    return (
        f"otel_generate: {how}, and there `import otel_generate` finds {where}, a folder without __init__.py "
        f"(a clone of this repository, seen from its parent folder): Python imports it as a namespace package "
        f"instead of the installed otel_generate (an editable install, pip install -e, is looked for only after "
        f"the folders on the path), so the instrumentation cannot load and `from otel_generate import "
        f"GenerateInstrumentor` fails with: {NAMESPACE_ERROR}. Run from another folder (the clone's root works "
        f"too), or rename the clone's folder."
    )


def hidden_by(folder: str) -> Optional[List[str]]:
    """The folders ``import otel_generate`` would find as a namespace package if Python looked in
    ``folder`` first (then ``sys.path``), else ``None``: ``None`` when a regular package is found."""
    from importlib.machinery import PathFinder

    spec = PathFinder.find_spec("otel_generate", [folder, *sys.path])
    if spec is None or spec.origin not in (None, "namespace") or not spec.submodule_search_locations:
        return None
    return [str(location) for location in spec.submodule_search_locations]
