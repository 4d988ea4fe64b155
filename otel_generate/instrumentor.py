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
import inspect
import logging
import os
import sys
import threading
import weakref
from typing import Any, Collection, Dict, List, NamedTuple, Optional, Tuple

from opentelemetry import metrics, trace
from opentelemetry.instrumentation.instrumentor import BaseInstrumentor

from otel_generate import _export_loss, _lifecycle, package
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
ENGINE = "transformers.cli.serving.model_manager"
PIPELINES = "transformers.pipelines.base"
#: ``module`` of the rows that wrap the ``force_flush``/``shutdown`` of the tracer, meter and (with the
#: content event on) logger providers this package emits to (those given to ``instrument()``, else the
#: global ones): nothing is imported or named; the class that defines the method is found from the
#: provider object when the background emitter starts, and again for a global provider set later
#: (:func:`wrap_provider_flushes`). The wrapper drains only for those provider objects: another
#: provider of the same class flushes exactly as without this package. A provider without the method
#: (the API's no-op and stand-in providers) is left alone.
PROVIDERS = "<the providers in use>"
TRACER_PROVIDER, METER_PROVIDER, LOGGER_PROVIDER = "tracer provider", "meter provider", "logger provider"
#: The signal each provider's flush drains (:meth:`otel_generate.background.BackgroundEmitter.drain`).
SIGNAL_OF = {TRACER_PROVIDER: "traces", METER_PROVIDER: "metrics", LOGGER_PROVIDER: "logs"}
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
    Patch("always",   SERVE,       "RequestIdMiddleware",       "__call__",                      "serve.make_request_id_middleware",                False),
    Patch("always",   SERVE,       "GenerateRunner",            "__init__",                      "serve.make_runner_init",                          False),
    Patch("always",   ENGINE,      "EngineClient",              "_send_request",                 "serve.make_send_request",                         False),
    Patch("always",   ENGINE,      "EngineClient",              "run_engine",                    "serve.make_run_engine",                           False),
    Patch("always",   SERVER,      MODULE_LEVEL,                "build_server",                  "serve.make_build_server",                         False),
    Patch("content",  PIPELINES,   "Pipeline",                  "forward",                       "pipelines.make_forward",                          False),
    Patch("emitter",  PROVIDERS,   TRACER_PROVIDER,             "force_flush",                   "background.make_draining",                        False),
    Patch("emitter",  PROVIDERS,   TRACER_PROVIDER,             "shutdown",                      "background.make_draining",                        False),
    Patch("emitter",  PROVIDERS,   METER_PROVIDER,              "force_flush",                   "background.make_draining",                        False),
    Patch("emitter",  PROVIDERS,   METER_PROVIDER,              "shutdown",                      "background.make_draining",                        False),
    Patch("emitter",  PROVIDERS,   LOGGER_PROVIDER,             "force_flush",                   "background.make_draining",                        False),
    Patch("emitter",  PROVIDERS,   LOGGER_PROVIDER,             "shutdown",                      "background.make_draining",                        False),
)
# fmt: on
#: Not class patches, so not in :data:`PATCHES` and nothing for ``uninstrument()`` to undo: per
#: assisted call, ``figures.count_candidates`` wraps that call's candidate generator object
#: (``get_candidates``, ``update_candidate_strategy``, instance attributes that die with it).
PER_CALL = ("figures.count_candidates",)


# --- what each feature needs: the self-check -----------------------------------------------------


class Feature(NamedTuple):
    name: str  # as `otel-generate doctor` lists it
    lost: str  # what a WARNING says is lost when the feature cannot be traced
    anchor: str  # the module whose first import checks the feature (it imports every module its points are in)
    variants: Tuple[Tuple[str, ...], ...]  # alternatives, newest release first: each the points it needs, all found
    details: Tuple[str, ...] = ()  # points that add details: missing, nothing is said; incompatible, a WARNING


# fmt: off
#: ``transformers serve``: the model's process and its API servers (transformers 5.25 and newer); the inference thread (up to 5.24).
_SERVE_PROCESS = ("EngineClient._send_request", "EngineClient.run_engine", "GenerateRunner.__init__", "RequestIdMiddleware.__call__", "build_server")
_SERVE_THREAD = ("InferenceThread.submit", "InferenceThread.async_submit", "build_server")
_GENERATE = ("GenerationMixin.generate", "GenerationMixin._prepare_generated_length", "GenerationMixin._get_stopping_criteria")
_GENERATE_DETAILS = ("GenerationMixin._prepare_cache_for_generation", "GenerationMixin.load_custom_generate", "GenerationMixin._get_logits_processor")
_CONTINUOUS = ("ContinuousBatchingManager.add_request", "ContinuousBatchingManager.cancel_request", "ContinuousBatchingManager._generation_loop_body", "OutputRouter.deliver", "OutputRouter.deliver_batch")

#: Every feature, with the points of :data:`PATCHES` it needs (``"Owner.attribute"``). A feature is traced
#: when every point of one of its variants is found with the signature its hook reads (:data:`READS`).
FEATURES: Tuple[Feature, ...] = (
    #       name                   what a WARNING says is lost                                   anchor      variants                                                                          details
    Feature("generate",            "`generate()` steps will not be timed",                       GENERATION, (_GENERATE,),                                                                     _GENERATE_DETAILS),
    Feature("streaming",           "streamed `generate()` calls will not be traced",             GENERATION, (("GenerationMixin.generate",),)),
    Feature("assisted decoding",   "assisted decoding's candidates will not be counted",         GENERATION, (("GenerationMixin._get_candidate_generator",),)),
    Feature("continuous batching", "continuous batching requests will not be traced",            CONTINUOUS, (_CONTINUOUS,)),
    Feature("transformers serve",  "`transformers serve` requests will not be traced",           SERVER,     (_SERVE_PROCESS, _SERVE_THREAD)),
    Feature("Whisper",             "Whisper's windows and fallbacks will not be traced",         WHISPER,    (("WhisperGenerationMixin.generate_with_fallback", "WhisperGenerationMixin._need_fallback"),)),
    Feature("pipelines",           "pipelines' prompt and completion text will not be captured", PIPELINES,  (("Pipeline.forward",),)),
)

#: The parameters each hook reads of its original's arguments (by name or position), by point.
READS: Dict[str, Tuple[str, ...]] = {
    "GenerationMixin._prepare_generated_length":         ("generation_config", "model_input_name", "input_ids_length", "inputs_tensor"),
    "GenerationMixin._get_stopping_criteria":            ("generation_config",),
    "GenerationMixin._prepare_cache_for_generation":     ("model_kwargs",),
    "GenerationMixin._get_logits_processor":             ("generation_config",),
    "WhisperGenerationMixin.generate_with_fallback":     ("seek", "batch_idx_map", "temperatures"),
    "WhisperGenerationMixin._need_fallback":             ("index",),
    "ContinuousBatchingManager.add_request":             ("input_ids", "max_new_tokens", "streaming", "eos_token_id"),
    "ContinuousBatchingManager.cancel_request":          ("request_id",),
    "ContinuousBatchingManager._generation_loop_body":   ("batch_processor", "bootstrapping"),
    "OutputRouter.deliver":                              ("output",),
    "OutputRouter.deliver_batch":                        ("outputs",),
    "InferenceThread.submit":                            ("fn",),
    "InferenceThread.async_submit":                      ("fn",),
    "RequestIdMiddleware.__call__":                      ("scope",),
    "EngineClient._send_request":                        ("args",),
    "EngineClient.run_engine":                           ("requests",),
}
# fmt: on

_EMITTER_LOCK = threading.RLock()
#: Per set of patches (one ``instrument()``): the points a WARNING already named.
_WARNED: "weakref.WeakKeyDictionary[Patches, set]" = weakref.WeakKeyDictionary()


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
    """The post-import hook of ``name``: install ``rows`` (one module's rows of :data:`PATCHES`) that
    the module has with the signature their hooks read, then check the features anchored there."""
    if not telemetry.active:
        return
    incompatible = {row for row in rows if point_problem(row, module) not in (None, NOT_FOUND)}
    missing = missing_hooks(module, rows)
    # one WARNING per point a feature anchored here lacks, before anything of it is installed
    warn_features(name, modules={name: module}, warned=_WARNED.setdefault(patches, set()))
    if name == GENERATION:  # without the required hooks: request spans, no step spans
        from otel_generate.integrations._routing import assisted_calls_criteria_on_candidates

        telemetry.skip_candidate_calls = assisted_calls_criteria_on_candidates(module.GenerationMixin)
    elif name == CONTINUOUS:  # every hook point or none
        if missing or incompatible:
            return
        start_emitter(patches, telemetry)  # the scheduler thread never builds a span itself
    for row in rows:
        if row in incompatible:
            continue
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


#: :func:`point_problem`'s answer for a point the module does not have.
NOT_FOUND = "not found"


def point_of(row: Patch) -> str:
    """``"Owner.attribute"`` (``"function"`` for a module-level row), as :data:`FEATURES` names points."""
    return row.attribute if row.owner == MODULE_LEVEL else f"{row.owner.rstrip(SUBCLASSES)}.{row.attribute}"


def row_of(point: str) -> Patch:
    """The first row of :data:`PATCHES` of ``point``."""
    return next(row for row in PATCHES if point_of(row) == point)


def point_problem(row: Patch, module: Any = None) -> Optional[str]:
    """``None`` when ``module`` (default: the row's module, if imported) has the row's attribute with
    every parameter its hook reads (:data:`READS`); else :data:`NOT_FOUND` or what is wrong with it."""
    if module is None:
        module = sys.modules.get(row.module)
        if module is None:
            return NOT_FOUND
    if row.owner == MODULE_LEVEL:
        value = getattr(module, row.attribute, None)
    else:
        owner = getattr(module, row.owner.rstrip(SUBCLASSES), None)
        value = vars(owner).get(row.attribute) if isinstance(owner, type) else None
    if value is None or not callable(value):
        return NOT_FOUND
    needed = READS.get(point_of(row), ())
    if not needed:
        return None
    function = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return "has a signature that cannot be read"
    absent = [name for name in needed if name not in parameters]
    if absent:
        return "has no parameter " + ", ".join(f"`{name}`" for name in absent)
    return None


def feature_problems(feature: Feature, wanted: Any = None, modules: Optional[Dict[str, Any]] = None) -> Dict[str, str]:
    """``{}`` when ``feature`` can be traced with the modules imported now; else ``{point: problem}``
    for the variant that is closest: the newest one any of whose own points is found (a point every
    variant shares says nothing about which release this is), else the newest. ``wanted(row)``:
    whether a row is asked for by the options (default: every row); the others are not needed.
    ``modules``: module objects to check instead of the imported ones, by name."""
    modules = modules or {}
    shared = set.intersection(*(set(variant) for variant in feature.variants))
    candidates = []
    for variant in feature.variants:
        problems: Dict[str, str] = {}
        found_own = False
        for point in variant:
            row = row_of(point)
            if wanted is not None and not wanted(row):
                continue
            problem = point_problem(row, modules.get(row.module))
            if problem is None:
                found_own = found_own or point not in shared
            else:
                problems[point] = problem
        if not problems:
            return {}
        candidates.append((found_own, problems))
    return next((problems for found_own, problems in candidates if found_own), candidates[0][1])


def detail_problems(feature: Feature, modules: Optional[Dict[str, Any]] = None) -> Dict[str, str]:
    """The detail points of ``feature`` found with a signature their hooks cannot read."""
    modules = modules or {}
    found = {point: point_problem(row_of(point), modules.get(row_of(point).module)) for point in feature.details}
    return {point: problem for point, problem in found.items() if problem not in (None, NOT_FOUND)}


def transformers_version() -> str:
    """The installed transformers' version, as its package says it."""
    module = sys.modules.get("transformers")
    version = getattr(module, "__version__", None)
    if not isinstance(version, str):
        try:
            from importlib.metadata import version as distribution_version

            version = distribution_version("transformers")
        except Exception:
            version = "(version unknown)"
    return version


def warn_features(
    anchor: str, wanted: Any = None, modules: Optional[Dict[str, Any]] = None, warned: Optional[set] = None
) -> List[str]:
    """Check the features anchored at module ``anchor``: one WARNING per point they cannot do
    without, naming the transformers version, the point, what is wrong and the features lost, never
    a traceback. ``warned``: the points already named (updated), so that each is named once per
    ``instrument()``. Returns the messages logged now."""
    warned = set() if warned is None else warned
    lost: Dict[str, List[str]] = {}
    problems: Dict[str, str] = {}
    for feature in FEATURES:
        if feature.anchor != anchor:
            continue
        found = dict(feature_problems(feature, wanted, modules))
        found.update(detail_problems(feature, modules))
        for point, problem in found.items():
            problems[point] = problem
            lost.setdefault(point, []).append(feature.lost)
    messages = []
    for point, features in lost.items():
        if point in warned:
            continue
        warned.add(point)
        message = (
            f"otel_generate: transformers {transformers_version()}: {'; '.join(features)}: `{point}` {problems[point]}"
        )
        _LOG.warning("%s", message)
        messages.append(message)
    return messages


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
    """``((role, provider), ...)``: the providers this package emits to now, those given to
    ``instrument()``, else the global ones; the logger provider only while the content event is on."""
    options = telemetry.options
    tracer_provider = options.tracer_provider if options.tracer_provider is not None else trace.get_tracer_provider()
    meter_provider = options.meter_provider if options.meter_provider is not None else metrics.get_meter_provider()
    in_use = ((TRACER_PROVIDER, tracer_provider), (METER_PROVIDER, meter_provider))
    content = telemetry.content
    if content is not None and content.event_logger is not None:
        from opentelemetry import _logs

        logger_provider = options.logger_provider
        if logger_provider is None:
            logger_provider = _logs.get_logger_provider()
        in_use += ((LOGGER_PROVIDER, logger_provider),)
    return in_use


def _ours(telemetry: Telemetry, role: str) -> Any:
    """``provider -> bool``: whether ``provider`` is the ``role`` provider this package emits to now."""

    def ours(provider: Any) -> bool:
        return telemetry.active and any(r == role and p is provider for r, p in _providers_in_use(telemetry))

    return ours


def wrap_provider_flushes(patches: Patches, telemetry: Telemetry, rows: Optional[Tuple[Patch, ...]] = None) -> None:
    """The :data:`PROVIDERS` rows: the ``force_flush``/``shutdown`` of the class of each provider in
    use drain the background emitter first, for the providers in use only. Each method is wrapped
    where the provider's class (or the first class of its MRO) defines it, once per set of patches;
    ``uninstrument()`` restores it. Public methods only, found on the object: no SDK module is
    imported or named here."""
    if rows is None:
        rows = tuple(row for row in PATCHES if row.module == PROVIDERS)
    emitter = telemetry.emitter
    if emitter is None:
        return
    in_use = _providers_in_use(telemetry)
    if _same_providers(telemetry.wrapped_providers, in_use):
        return  # (before each request handed to the emitter: the same providers as last time)
    with _EMITTER_LOCK:  # callers on several threads may meet a new provider at once
        last = telemetry.wrapped_providers
        if _same_providers(last, in_use):
            return
        if last:  # a provider set after the emitter started: its exit-time shutdown must run after the drain
            emitter.drain_at_exit_before_providers()
        providers = dict(in_use)
        for row in rows:
            provider = providers.get(row.owner)
            if provider is None or not callable(getattr(provider, row.attribute, None)):
                continue
            owner = next((klass for klass in type(provider).__mro__ if row.attribute in vars(klass)), None)
            if owner is not None and owner is not object and not patches.is_installed(owner, row.attribute):
                factory = _factory(row.factory)
                patches.replace(
                    owner, row.attribute, factory, emitter, SIGNAL_OF[row.owner], _ours(telemetry, row.owner)
                )
        telemetry.wrapped_providers = in_use


def _same_providers(last: tuple, in_use: tuple) -> bool:
    return len(last) == len(in_use) and all(a[1] is b[1] for a, b in zip(last, in_use))


def start_emitter(patches: Patches, telemetry: Telemetry) -> Any:
    """The background emitter (created once), with the providers in use draining it first (the
    ``"emitter"`` rows of :data:`PATCHES`), also a global provider set after ``instrument()``
    (checked on the caller's thread before each request is handed over, so that the provider's own
    ``force_flush`` after ``generate()`` returns drains it)."""
    with _EMITTER_LOCK:
        if telemetry.emitter is None:
            from otel_generate.background import BackgroundEmitter

            def before_submit() -> None:
                if telemetry.active:
                    wrap_provider_flushes(patches, telemetry)

            telemetry.emitter = BackgroundEmitter(on_drop=telemetry.count_dropped, before_submit=before_submit)
            install(patches, telemetry, when=("emitter",))
    return telemetry.emitter


def sdk_disabled() -> bool:
    """Whether ``OTEL_SDK_DISABLED`` is ``true`` (OpenTelemetry's switch that makes the SDK's
    providers hand out no-op tracers and meters; read as the SDK reads it)."""
    return os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"


# --- the instrumentor ---------------------------------------------------------------------------


class GenerateInstrumentor(BaseInstrumentor):
    """An instrumentor for ``transformers.GenerationMixin.generate``.

    See the :mod:`otel_generate` package docstring for usage and options. ``BaseInstrumentor``
    makes it a singleton: ``GenerateInstrumentor().instrument()`` a second time only logs a warning.
    """

    _telemetry: Optional[Telemetry] = None
    _patches: Optional[Patches] = None
    _given: Optional[dict] = None

    @property
    def patches(self) -> Optional[Patches]:
        """The patches the instrumentation in place installed, else ``None``."""
        return self._patches

    @property
    def given_options(self) -> dict:
        """The keywords the instrumentation in place was turned on with (``{}`` when off)."""
        return dict(self._given or {})

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
        if sdk_disabled():
            _LOG.info(
                "otel_generate: OTEL_SDK_DISABLED=true: the OpenTelemetry SDK records nothing, so generate() "
                "steps are not timed and the device is not waited for; per_token_latency_callback, "
                "track_token_latency and TokenLatencyProfiler still get their figures"
            )
        patches = Patches()
        install(patches, telemetry)
        if options.background_emission:
            start_emitter(patches, telemetry)
        self._telemetry, self._patches, self._given = telemetry, patches, dict(kwargs)
        # pool workers flush on exit; a forked child drops the parent's aggregations of these instruments;
        # every flush drains the background emitter first
        _lifecycle.enable(
            options.tracer_provider,
            options.meter_provider,
            telemetry.instruments.values(),
            drain=telemetry.drain_emitter,
            logs=telemetry.content is not None and telemetry.content.event_logger is not None,
            logger_provider=options.logger_provider,
        )
        _export_loss.enable()  # a batch of spans the OTLP gRPC exporter gives up on is said on our logger

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
        self._telemetry = self._patches = self._given = None
        _lifecycle.disable()  # the fork hook stays registered but does nothing
        _export_loss.disable()


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
