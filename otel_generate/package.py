"""Libraries this instrumentation instruments, and the version rule ``BaseInstrumentor`` checks them with.

``opentelemetry-instrument`` compares these requirement strings with what is installed
before it calls :meth:`otel_generate.GenerateInstrumentor.instrument`; a missing or too old
transformers or torch turns the instrumentor off with a log line instead of failing the app.
A pre-release of a supported version passes, whatever ``packaging`` is installed
(:func:`satisfies`; :mod:`otel_generate._versions` says why and where OpenTelemetry checks).
"""

from __future__ import annotations

from importlib import metadata as importlib_metadata
from typing import Any, Iterable, List

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
