"""``GenerateInstrumentor``: options, the patch list, post-import hooks, ``uninstrument()``.

:data:`PATCHES` is every attribute this package replaces (class methods, one module-level function), on one screen. ``instrument()``
registers one post-import hook per transformers module named there (nothing is imported: a patch
is installed when its module is first imported, at once where it already is); ``uninstrument()``
undoes exactly what those hooks installed (:meth:`otel_generate._patch.Patches.restore_all`).
The integrations that provide the factories are imported inside :meth:`GenerateInstrumentor._instrument`,
never when this module is imported.

This module also owns the instrumentation a :class:`~otel_generate.profiler.TokenLatencyProfiler`
turns on by itself (:func:`acquire_for_profiler`, :func:`release_for_profiler`) and the registry of
open profilers (:func:`active_profilers`), so the profiler imports this module and not the reverse.
"""

from __future__ import annotations

import contextvars
import importlib
import logging
import sys
import threading
from typing import Any, Collection, NamedTuple, Optional, Tuple

from opentelemetry import metrics, trace
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor

from otel_generate import _lifecycle, package
from otel_generate import content as _content
from otel_generate import options as _options
from otel_generate._faults import LOGGER_NAME, Fault, log_fault_once
from otel_generate._patch import Patches
from otel_generate.telemetry import Telemetry

_LOG = logging.getLogger(LOGGER_NAME)

# --- every patch point --------------------------------------------------------------------------

GENERATION = "transformers.generation.utils"
WHISPER = "transformers.models.whisper.generation_whisper"
CONTINUOUS = "transformers.generation.continuous_batching.continuous_api"
SERVE = "transformers.cli.serving.utils"
SERVER = "transformers.cli.serving.server"
PIPELINES = "transformers.pipelines.base"
#: ``module`` of the rows that wrap the ``force_flush``/``shutdown`` of the tracer and meter providers
#: in use (those given to ``instrument()``, else the global ones): nothing is imported or named; the
#: class that defines the method is found from the provider object when the background emitter starts,
#: and again for a global provider set later (:func:`wrap_provider_flushes`). A provider without the
#: method (the API's no-op and stand-in providers) is left alone.
PROVIDERS = "<the providers in use>"
TRACER_PROVIDER, METER_PROVIDER = "tracer provider", "meter provider"
#: ``owner`` of a row that is a module-level function, not a class attribute.
MODULE_LEVEL = ""
#: ``owner`` suffix: the row also applies to every subclass defining the attribute, now and later
#: (through an ``__init_subclass__`` added to the class, removed by ``uninstrument()``).
SUBCLASSES = "+"


class Patch(NamedTuple):
    when: str  # "always"; "content", "logprobs": the capture option is on; "emitter": a background emitter runs
    module: str  # the module whose first import installs the patch
    owner: str  # class in that module (MODULE_LEVEL: the module itself; "Class+": and its subclasses)
    attribute: str
    factory: str  # "module.function" in otel_generate.integrations (background: otel_generate); (original, telemetry) -> replacement
    required: bool  # missing: GenerationMixin warns (no step spans); continuous batching is left uninstrumented


# fmt: off
PATCHES: Tuple[Patch, ...] = (
    #     when        module       owner                        attribute                        factory                                            required
    Patch("always",   GENERATION,  "GenerationMixin",           "generate",                      "generate_loop.make_generate",                     True),
    Patch("always",   GENERATION,  "GenerationMixin",           "_prepare_generated_length",     "generate_loop.make_prepare_generated_length",     True),
    Patch("always",   GENERATION,  "GenerationMixin",           "_get_stopping_criteria",        "generate_loop.make_get_stopping_criteria",        True),
    Patch("always",   GENERATION,  "GenerationMixin",           "_get_candidate_generator",      "generate_loop.make_get_candidate_generator",      False),
    Patch("always",   GENERATION,  "GenerationMixin",           "_prepare_cache_for_generation", "generate_loop.make_prepare_cache_for_generation", False),
    Patch("always",   GENERATION,  "GenerationMixin+",          "generate",                      "overrides.make_outer_generate",                   False),
    Patch("always",   GENERATION,  "GenerationMixin",           "load_custom_generate",          "overrides.make_load_custom_generate",             False),
    Patch("logprobs", GENERATION,  "GenerationMixin",           "_get_logits_processor",         "generate_content.make_get_logits_processor",      False),
    Patch("always",   WHISPER,     "WhisperGenerationMixin",    "generate_with_fallback",        "whisper.make_generate_with_fallback",             False),
    Patch("always",   WHISPER,     "WhisperGenerationMixin",    "_need_fallback",                "whisper.make_need_fallback",                      False),
    Patch("always",   CONTINUOUS,  "ContinuousBatchingManager", "add_request",                   "continuous_batching.make_add_request",            True),
    Patch("always",   CONTINUOUS,  "ContinuousBatchingManager", "cancel_request",                "continuous_batching.make_cancel_request",         True),
    Patch("always",   CONTINUOUS,  "ContinuousBatchingManager", "_generation_loop_body",         "continuous_batching.make_generation_loop_body",   True),
    Patch("always",   CONTINUOUS,  "OutputRouter",              "deliver",                       "continuous_batching.make_deliver",                True),
    Patch("always",   CONTINUOUS,  "OutputRouter",              "deliver_batch",                 "continuous_batching.make_deliver_batch",          True),
    Patch("always",   SERVE,       "InferenceThread",           "submit",                        "serve.make_submit",                               False),
    Patch("always",   SERVE,       "InferenceThread",           "async_submit",                  "serve.make_submit",                               False),
    Patch("always",   SERVER,      MODULE_LEVEL,                "build_server",                  "serve.make_build_server",                         False),
    Patch("content",  PIPELINES,   "Pipeline",                  "forward",                       "pipelines.make_forward",                          False),
    Patch("emitter",  PROVIDERS,   TRACER_PROVIDER,             "force_flush",                   "background.make_draining",                        False),
    Patch("emitter",  PROVIDERS,   TRACER_PROVIDER,             "shutdown",                      "background.make_draining",                        False),
    Patch("emitter",  PROVIDERS,   METER_PROVIDER,              "force_flush",                   "background.make_draining",                        False),
    Patch("emitter",  PROVIDERS,   METER_PROVIDER,              "shutdown",                      "background.make_draining",                        False),
)
# fmt: on
#: Not class patches, so not in :data:`PATCHES` and nothing for ``uninstrument()`` to undo: per
#: assisted call, ``figures.count_candidates`` wraps that call's candidate generator object
#: (``get_candidates``, ``update_candidate_strategy``, instance attributes that die with it).
PER_CALL = ("figures.count_candidates",)

_EMITTER_LOCK = threading.Lock()


#: Factory modules outside ``otel_generate.integrations``.
_CORE_FACTORY_MODULES = ("background",)


def _factory(path: str) -> Any:
    """``"whisper.make_need_fallback"`` -> that function (imports its module)."""
    module, _, name = path.rpartition(".")
    package = "otel_generate" if module in _CORE_FACTORY_MODULES else "otel_generate.integrations"
    return getattr(importlib.import_module(f"{package}.{module}"), name)


def _subclasses(root: type) -> list:
    found, seen, pending = [], set(), [root]
    while pending:
        for sub in type.__subclasses__(pending.pop()):
            if sub not in seen:
                seen.add(sub)
                found.append(sub)
                pending.append(sub)
    return found


def _replace_in_subclasses(patches: Patches, telemetry: Telemetry, root: type, row: Patch) -> None:
    """Row ``Class+``: the subclasses that define the attribute (a plain method) now, and the ones
    created later, through an ``__init_subclass__`` added to ``root``."""
    factory = _factory(row.factory)

    def hook(cls: type) -> None:
        own = vars(cls).get(row.attribute)
        if callable(own) and not isinstance(own, (staticmethod, classmethod)):
            patches.replace(cls, row.attribute, factory, telemetry)

    for cls in _subclasses(root):
        hook(cls)

    def __init_subclass__(cls, **kwargs):
        super(root, cls).__init_subclass__(**kwargs)
        if telemetry.active:
            try:
                hook(cls)
            except Exception as fault:  # never break class creation
                log_fault_once(Fault.GENERATE_OVERRIDE_HOOK, fault)

    patches.add(root, "__init_subclass__", classmethod(__init_subclass__))


def _wanted(row: Patch, telemetry: Telemetry) -> bool:
    content = telemetry.content
    if row.when == "content":
        return content is not None and content.mode is not _content.ContentMode.NO_CONTENT
    if row.when == "logprobs":
        return content is not None and content.step_logprobs
    return True


def _install_module(patches: Patches, telemetry: Telemetry, name: str, rows: Tuple[Patch, ...], module: Any) -> None:
    """The post-import hook of ``name``: install ``rows`` (one module's rows of :data:`PATCHES`)."""
    if not telemetry.active:
        return
    missing = missing_hooks(module, rows)
    if name == GENERATION:  # without the required hooks: request spans, no step spans
        if missing:
            _LOG.warning(
                "otel_generate: this transformers has no %s; request spans only, no step spans", ", ".join(missing)
            )
        from otel_generate.integrations._routing import assisted_calls_criteria_on_candidates

        telemetry.skip_candidate_calls = assisted_calls_criteria_on_candidates(module.GenerationMixin)
    elif name == CONTINUOUS:  # every hook point or none
        if missing:
            _LOG.info(
                "otel_generate: this transformers' continuous batching has no %s; its requests are not traced",
                ", ".join(missing),
            )
            return
        start_emitter(patches, telemetry)  # the scheduler thread never builds a span itself
    for row in rows:
        if row.owner == MODULE_LEVEL:
            if callable(getattr(module, row.attribute, None)):
                patches.replace(module, row.attribute, _factory(row.factory), telemetry)
            continue
        owner = getattr(module, row.owner.rstrip(SUBCLASSES), None)
        if owner is None:
            continue
        if row.owner.endswith(SUBCLASSES):
            _replace_in_subclasses(patches, telemetry, owner, row)
        elif callable(vars(owner).get(row.attribute)):
            argument = telemetry.emitter if row.when == "emitter" else telemetry
            patches.replace(owner, row.attribute, _factory(row.factory), argument)


def missing_hooks(module: Any, rows: Optional[Tuple[Patch, ...]] = None) -> list:
    """The required rows of :data:`PATCHES` for ``module`` (a transformers module object) that it
    lacks, as ``"Class.method"``; empty when every required hook point is there. ``rows``: that
    module's rows (default: every row naming ``module.__name__``). For continuous batching
    (``continuous_api``) a non-empty answer means its requests are not traced."""
    if rows is None:
        rows = tuple(row for row in PATCHES if row.module == module.__name__)
    return [f"{r.owner.rstrip(SUBCLASSES)}.{r.attribute}" for r in rows if r.required and not _has(module, r)]


def _has(module: Any, row: Patch) -> bool:
    owner = module if row.owner == MODULE_LEVEL else getattr(module, row.owner.rstrip(SUBCLASSES), None)
    return owner is not None and row.attribute in vars(owner)


def install(patches: Patches, telemetry: Telemetry, when: Collection[str] = ("always", "content", "logprobs")) -> None:
    """Register the post-import hooks for the rows of :data:`PATCHES` whose ``when`` is in ``when``
    (and that the options ask for), one hook per module, in table order; the :data:`PROVIDERS`
    rows are installed at once (:func:`wrap_provider_flushes`)."""
    modules: dict = {}
    for row in PATCHES:
        if row.when in when and _wanted(row, telemetry):
            modules.setdefault(row.module, []).append(row)
    providers = modules.pop(PROVIDERS, None)
    if providers:
        wrap_provider_flushes(patches, telemetry, tuple(providers))
    for name, rows in modules.items():

        def installer(module: Any, name: str = name, rows: Tuple[Patch, ...] = tuple(rows)) -> None:
            try:
                _install_module(patches, telemetry, name, rows, module)
            except Exception as fault:  # never break the application's import
                log_fault_once(Fault.hook_install(name), fault)

        patches.on_import(name, installer)


def _providers_in_use(telemetry: Telemetry) -> Tuple[Tuple[str, Any], ...]:
    options = telemetry.options
    tracer_provider = options.tracer_provider if options.tracer_provider is not None else trace.get_tracer_provider()
    meter_provider = options.meter_provider if options.meter_provider is not None else metrics.get_meter_provider()
    return ((TRACER_PROVIDER, tracer_provider), (METER_PROVIDER, meter_provider))


def wrap_provider_flushes(patches: Patches, telemetry: Telemetry, rows: Optional[Tuple[Patch, ...]] = None) -> None:
    """The :data:`PROVIDERS` rows: the ``force_flush``/``shutdown`` of the class of each provider in
    use drain the background emitter first. Each method is wrapped where the provider's class (or
    the first class of its MRO) defines it, once per set of patches; ``uninstrument()`` restores it.
    Public methods only, found on the object: no SDK module is imported or named here."""
    if rows is None:
        rows = tuple(row for row in PATCHES if row.module == PROVIDERS)
    emitter = telemetry.emitter
    if emitter is None:
        return
    in_use = _providers_in_use(telemetry)
    last = telemetry.wrapped_providers
    if len(last) == len(in_use) and all(a[1] is b[1] for a, b in zip(last, in_use)):
        return  # (before each background job: the same providers as last time)
    telemetry.wrapped_providers = in_use
    providers = dict(in_use)
    for row in rows:
        provider = providers.get(row.owner)
        if provider is None or not callable(getattr(provider, row.attribute, None)):
            continue
        owner = next((klass for klass in type(provider).__mro__ if row.attribute in vars(klass)), None)
        if owner is not None and owner is not object and not patches.is_installed(owner, row.attribute):
            patches.replace(owner, row.attribute, _factory(row.factory), emitter)


def start_emitter(patches: Patches, telemetry: Telemetry) -> Any:
    """The background emitter (created once), with the providers in use draining it first (the
    ``"emitter"`` rows of :data:`PATCHES`), also a global provider set after ``instrument()``
    (checked on the emitter's thread before each job)."""
    with _EMITTER_LOCK:
        if telemetry.emitter is None:
            from otel_generate.background import BackgroundEmitter

            def before_job() -> None:
                if telemetry.active:
                    wrap_provider_flushes(patches, telemetry)

            telemetry.emitter = BackgroundEmitter(on_drop=telemetry.count_dropped, before_job=before_job)
            install(patches, telemetry, when=("emitter",))
    return telemetry.emitter


# --- the instrumentor ---------------------------------------------------------------------------


class GenerateInstrumentor(BaseInstrumentor):
    """An instrumentor for ``transformers.GenerationMixin.generate``.

    See the :mod:`otel_generate` package docstring for usage and options. ``BaseInstrumentor``
    makes it a singleton: ``GenerateInstrumentor().instrument()`` a second time only logs a warning.
    """

    _telemetry: Optional[Telemetry] = None
    _patches: Optional[Patches] = None

    @property
    def telemetry(self) -> Optional[Telemetry]:
        """The :class:`~otel_generate.telemetry.Telemetry` of the instrumentation in place, else ``None``."""
        return self._telemetry

    def instrumentation_dependencies(self) -> Collection[str]:
        return package._instruments

    def _check_dependency_conflicts(self) -> Any:
        # pre-releases of supported versions pass, whatever packaging is installed (package.dependency_conflict)
        return package.dependency_conflict(self.instrumentation_dependencies())

    def instrument(self, **kwargs: Any) -> Any:
        """Instrument ``generate()`` (see the package docstring for the keywords).

        If only a :class:`~otel_generate.profiler.TokenLatencyProfiler` had turned the
        instrumentation on, this call takes it over with these keywords, and leaving the profiler
        no longer turns it off.
        """
        if self.is_instrumented_by_opentelemetry and _take_over_from_profilers():
            self.uninstrument()
        return super().instrument(**kwargs)

    def _instrument(self, **kwargs: Any) -> None:
        # Nothing of transformers is imported here: every row of PATCHES is installed when its module
        # is first imported (at once where it already is).
        options = _options.resolve(kwargs)
        # skip_candidate_calls is read from GenerationMixin when its module is imported
        telemetry = Telemetry.from_options(options, profilers=active_profilers)
        patches = Patches()
        install(patches, telemetry)
        if options.background_emission:
            start_emitter(patches, telemetry)
        self._telemetry, self._patches = telemetry, patches
        # pool workers flush on exit; a forked child drops the parent's aggregations of these instruments;
        # every flush drains the background emitter first
        _lifecycle.enable(
            options.tracer_provider,
            options.meter_provider,
            telemetry.instruments.values(),
            drain=telemetry.drain_emitter,
        )

    def _uninstrument(self, **kwargs: Any) -> None:
        telemetry, patches = self._telemetry, self._patches
        if telemetry is not None:
            # a producer module never imported (no hook of it was installed) has no request in flight
            continuous_batching = sys.modules.get("otel_generate.integrations.continuous_batching")
            generate_loop = sys.modules.get("otel_generate.integrations.generate_loop")
            if continuous_batching is not None:
                continuous_batching.end_in_flight(telemetry)  # requests in flight: ended, marked incomplete
            telemetry.stop_emitter()  # what it still holds is emitted first
            telemetry.active = False  # hooks still reachable (a bound method held somewhere) only call through
            # requests of other threads already started keep their loops' hooks until their set-up is done
            if generate_loop is not None:
                generate_loop.wait_for_setups(telemetry)
        if patches is not None:
            patches.restore_all()  # exactly what the hooks of PATCHES installed
        self._telemetry = self._patches = None
        _lifecycle.disable()  # the fork hook stays registered but does nothing


# --- profilers ----------------------------------------------------------------------------------

_PROFILERS: contextvars.ContextVar[Tuple[Any, ...]] = contextvars.ContextVar("otel_generate_profilers", default=())
_profiler_lock = threading.RLock()
_profiler_users = 0  # open profilers that count on the instrumentation they turned on
_profiler_owned = False  # the instrumentation is on only because a profiler turned it on


def active_profilers() -> Tuple[Any, ...]:
    """The profilers open in the current context (thread or task), innermost last."""
    return _PROFILERS.get()


def open_profiler(profiler: Any) -> None:
    """Add ``profiler`` to the current context's open profilers."""
    _PROFILERS.set(_PROFILERS.get() + (profiler,))


def close_profiler(profiler: Any) -> None:
    """Remove ``profiler`` from the current context's open profilers (in any order, not ``reset``)."""
    _PROFILERS.set(tuple(p for p in _PROFILERS.get() if p is not profiler))


def acquire_for_profiler() -> bool:
    """A profiler opens: instrument if nothing has. True when this profiler counts on the
    instrumentation a profiler turned on (then it calls :func:`release_for_profiler` on leaving)."""
    global _profiler_users, _profiler_owned
    with _profiler_lock:
        instrumentor = GenerateInstrumentor()
        if not instrumentor.is_instrumented_by_opentelemetry:
            instrumentor.instrument()
            _profiler_owned = True
        if _profiler_owned:
            _profiler_users += 1
            return True
        return False


def release_for_profiler() -> None:
    """A profiler that :func:`acquire_for_profiler` counted leaves: the last one uninstruments,
    unless ``instrument()`` took the instrumentation over meanwhile."""
    global _profiler_users, _profiler_owned
    with _profiler_lock:
        _profiler_users -= 1
        if _profiler_users == 0 and _profiler_owned:
            _profiler_owned = False
            GenerateInstrumentor().uninstrument()


def _take_over_from_profilers() -> bool:
    """True if profilers owned the instrumentation; from now on ``instrument()``'s caller does."""
    global _profiler_owned
    with _profiler_lock:
        owned, _profiler_owned = _profiler_owned, False
        return owned
