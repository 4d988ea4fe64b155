"""Supported version ranges admit pre-releases of supported versions, whatever ``packaging`` is installed.

OpenTelemetry checks the instrumented libraries' versions in two places, both with
``packaging``'s ``SpecifierSet.contains(installed_version)`` and the version that
``importlib.metadata.version()`` reports (the installed distribution's metadata, not
``transformers.__version__``):

1. ``BaseInstrumentor.instrument()`` checks ``instrumentation_dependencies()`` (this package's
   ``_instruments``) unless called with ``skip_dep_check=True``; on a conflict it logs an
   ERROR and instruments nothing.
2. ``opentelemetry-instrument``'s loader (``opentelemetry.instrumentation.auto_instrumentation.
   _load._load_instrumentors``) checks the ``instruments`` extra of the distribution that
   provides the ``opentelemetry_instrumentor`` entry point, before it imports the entry point,
   and skips it (logging why) on a conflict; it then calls ``instrument(skip_dep_check=True)``.

``packaging`` < 25 refuses any pre-release for a specifier that names none (``5.25.0.dev0`` is
not in ``>= 4.46``), so a transformers or torch built from source turned the instrumentation off.
Naming a pre-release in the requirement (``>= 4.46.0.dev0``) would fix the check but also make
pip pick pre-releases for ``pip install otel-generate[instruments]``, so the requirements stay
as they are, and:

1. :meth:`GenerateInstrumentor._check_dependency_conflicts` uses :func:`dependency_conflict`,
   which reads a pre-release as its release (``5.25.0.dev0`` as ``5.25.0``,
   ``2.9.0.dev20260101`` as ``2.9.0``) before checking the range.
2. :func:`before_auto_instrumentation`, an ``opentelemetry_pre_instrument`` entry point, runs
   before the loader's check. Only when the loader's own check would refuse this package while
   :func:`dependency_conflict` accepts it (a pre-release under ``packaging`` < 25) does it
   instrument right there, as the loader would have (``instrument(skip_dep_check=True)``, with
   the SDK the distro configured), and it keeps the loader's then-false "nothing can be
   instrumented" message out of the log. ``OTEL_PYTHON_DISABLED_INSTRUMENTATIONS`` is honoured.
"""

from __future__ import annotations

import logging
import os
import sys
from importlib import metadata as importlib_metadata
from typing import Optional

from otel_generate._faults import LOGGER_NAME
from otel_generate.instrumentor import GenerateInstrumentor
from otel_generate.package import (  # noqa: F401  (the version rule, kept importable here)
    DISTRIBUTION,
    ENTRY_POINT_NAME,
    INSTRUMENTS_EXTRA,
    dependency_conflict,
    imported_as_namespace,
    instruments_requirements,
    namespace_hint,
    satisfies,
)

_LOG = logging.getLogger(LOGGER_NAME)

_loader_filter: Optional[logging.Filter] = None


def _disabled_by_environment() -> bool:
    names = [name.strip() for name in os.environ.get("OTEL_PYTHON_DISABLED_INSTRUMENTATIONS", "").split(",")]
    return ENTRY_POINT_NAME in names or "*" in names


def before_auto_instrumentation() -> None:
    """``opentelemetry_pre_instrument`` entry point: see the module docstring. Never raises."""
    try:
        _before_auto_instrumentation()
    except Exception as exc:  # never break the application's start
        _LOG.warning(
            "otel_generate: the pre-release version check before auto-instrumentation failed (%s: %s)",
            type(exc).__name__,
            exc,
        )


def _before_auto_instrumentation() -> None:
    hidden = imported_as_namespace(sys.modules.get("otel_generate"))
    if hidden is not None:  # the loader will fail to load the instrumentor: say why, once, before it does
        _LOG.error("%s", namespace_hint(hidden, instrument=True))
        return
    if _disabled_by_environment():
        return
    from opentelemetry.instrumentation.dependencies import get_dist_dependency_conflicts

    distribution = importlib_metadata.distribution(DISTRIBUTION)
    if get_dist_dependency_conflicts(distribution) is None:
        return  # the loader accepts the installed versions and instruments as usual
    if dependency_conflict(instruments_requirements(distribution)) is not None:
        return  # out of range even as releases: the loader refuses and says why
    _keep_loader_conflict_out_of_the_log()
    GenerateInstrumentor().instrument(skip_dep_check=True)
    _LOG.debug("otel_generate: instrumented before the loader, whose packaging refuses the installed pre-release")


class _LoaderConflictFilter(logging.Filter):
    """Drops the loader's message that this entry point has a version conflict (it was instrumented)."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:
            return True
        return not (ENTRY_POINT_NAME in message and ("only instruments" in message or "Skipping" in message))


#: the logger of ``opentelemetry-instrument``'s loader (its module's name): looked up by name, nothing
#: of the loader is imported; under another name the filter only stops applying (its message shows)
LOADER_LOGGER = "opentelemetry.instrumentation.auto_instrumentation._load"


def _loader_logger() -> logging.Logger:
    return logging.getLogger(LOADER_LOGGER)


def _keep_loader_conflict_out_of_the_log() -> None:
    global _loader_filter
    try:
        logger = _loader_logger()
    except Exception:
        return
    if _loader_filter is None:
        _loader_filter = _LoaderConflictFilter()
        logger.addFilter(_loader_filter)


def after_auto_instrumentation() -> None:
    """``opentelemetry_post_instrument`` entry point: removes the filter the pre-instrument hook added,
    and keeps the interpreters the application spawns instrumented (:func:`keep_spawned_instrumented`)."""
    global _loader_filter
    try:
        keep_spawned_instrumented()
    except Exception:  # never break the application's start
        pass
    if _loader_filter is None:
        return
    try:
        _loader_logger().removeFilter(_loader_filter)
    except Exception:
        pass
    _loader_filter = None


#: the first ``opentelemetry-instrumentation`` release that puts its start-up folder back on
#: ``PYTHONPATH`` once it has initialized (open-telemetry/opentelemetry-python-contrib#4469)
KEEPS_PYTHONPATH = "0.63b0"


def keep_spawned_instrumented() -> bool:
    """Under ``opentelemetry-instrument`` of a release before :data:`KEEPS_PYTHONPATH`, put its
    start-up folder (the one of the ``sitecustomize`` it ran) back on ``PYTHONPATH``, as the newer
    releases do after initializing: those older ones remove it for good, so an interpreter the
    application starts afresh (``multiprocessing``'s ``spawn`` and ``forkserver`` workers,
    ``transformers serve``'s model process) would run uninstrumented. True when it did."""
    started_by = sys.modules.get("sitecustomize")
    auto = sys.modules.get("opentelemetry.instrumentation.auto_instrumentation")
    if started_by is None or auto is None:
        return False
    folder = os.path.dirname(os.path.abspath(auto.__file__))
    if os.path.dirname(os.path.abspath(getattr(started_by, "__file__", "") or "")) != folder:
        return False  # not started by opentelemetry-instrument
    from packaging.version import Version

    if Version(importlib_metadata.version("opentelemetry-instrumentation")) >= Version(KEEPS_PYTHONPATH):
        return False  # it puts the folder back itself
    current = os.environ.get("PYTHONPATH", "")
    parts = current.split(os.pathsep) if current else []
    if folder in parts:
        return False
    os.environ["PYTHONPATH"] = os.pathsep.join([folder, *parts])
    return True
