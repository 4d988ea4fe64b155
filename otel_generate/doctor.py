"""``otel-generate doctor``: what the instrumentation can trace in this environment, and where it sends it.

It imports transformers' modules named in :data:`otel_generate.instrumentor.PATCHES` (no model is
built or run), turns the instrumentation on in its own process as ``opentelemetry-instrument`` would
(unless it is on already), and reports:

* the versions of Python, torch, transformers, the OpenTelemetry API and SDK, and this package;
* each patch point: ``installed`` (the hook is in place), ``found`` (transformers has it; not asked
  for by the options), or ``missing`` (not found, or its signature lacks what the hook reads);
* each feature (:data:`otel_generate.instrumentor.FEATURES`): ``traced``, ``not traced`` (with the
  points it lacks), ``not in this transformers`` (its module does not exist in this release), or
  ``not available here`` (its module needs a library that is not installed, e.g. a server's);
* the tracer, meter and logger providers in effect, the exporters the ``OTEL_*`` environment configures
  (what ``opentelemetry-instrument`` sets up) with their endpoints, and whether each endpoint
  accepts a TCP connection within 1 s;
* every option but the providers, in effect, and where each came from (an ``instrument()`` argument,
  the environment, the default);
* a hint when ``import otel_generate`` run from the current folder would find a folder named
  ``otel_generate`` that is no package (a clone's root seen from its parent folder): Python then
  imports it as a namespace package, and ``from otel_generate import GenerateInstrumentor`` fails;
* the problems, one line each, and last a verdict: ``OK`` or ``FAIL`` with the number of problems.

A problem is any of: a library this instrumentation instruments (transformers, torch) not installed,
or installed outside the supported range (``instrument()`` then refuses to run); a feature of the
installed transformers that is not traced (a patch point missing, a signature that lacks what the
hook reads, a module that fails to import); an OTLP endpoint the environment configures that
accepts no TCP connection within 1 s, or that is no host and port; an option whose environment
variable holds a value that cannot be parsed (the default applies instead).

Exit status: 0 when there is no problem, 1 when there is one, 2 on bad usage (argparse's usage line
and message on stderr).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.machinery
import json
import os
import platform
import socket
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple
from urllib.parse import urlsplit

PROG = "otel-generate doctor"
DESCRIPTION = (
    "Check this environment: the versions, each transformers patch point (installed, found, missing), each "
    "feature (traced or not), the tracer, meter and logger providers, the configured exporters and whether their "
    "endpoints accept a connection (1 s), and the options in effect with where each came from. Imports "
    "transformers, runs no model. Exit status 0: no problem; 1: a problem (transformers missing or outside the "
    "supported range, a feature not traced, an endpoint not reachable, an option with an invalid value); 2: bad usage."
)
#: Seconds to wait for an endpoint to accept a TCP connection.
CONNECT_TIMEOUT_S = 1.0
TRACED, NOT_TRACED, ABSENT = "traced", "not traced", "not in this transformers"
#: A feature whose module imports a library that is not installed (its optional dependency).
UNAVAILABLE = "not available here"
#: How a module of the patch table that exists but raises on import is reported.
FAILED = "failed to import"
INSTALLED, FOUND, MISSING = "installed", "found", "missing"
SIGNALS = ("traces", "metrics", "logs")
_DISTRIBUTIONS = (
    ("torch", "torch"),
    ("transformers", "transformers"),
    ("opentelemetry-api", "opentelemetry-api"),
    ("opentelemetry-sdk", "opentelemetry-sdk"),
    ("otel-generate", "otel-generate"),
)


# --- the command line --------------------------------------------------------------------------


def configure_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object on stdout")
    return parser


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``otel-generate doctor`` on its own."""
    return configure_parser(argparse.ArgumentParser(prog=PROG, description=DESCRIPTION))


def add_parser(commands: Any) -> None:
    """Add ``doctor`` to ``otel-generate``'s subcommands (an ``add_subparsers()`` result)."""
    parser = commands.add_parser(
        "doctor", help="check the environment: patch points, features, exporters", description=DESCRIPTION
    )
    configure_parser(parser)
    parser.set_defaults(handler=_handler, command_parser=parser)


def _handler(args: argparse.Namespace, argv: List[str]) -> int:
    return run(as_json=args.json)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``otel-generate doctor`` with ``argv`` (its own options); the exit status."""
    try:
        args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else 0
    return run(as_json=args.json)


def run(as_json: bool = False, stdout: Any = None) -> int:
    """Build the report, print it (text, or JSON with ``as_json``), return the exit status."""
    stdout = stdout if stdout is not None else sys.stdout
    found = report()
    stdout.write(json.dumps(found, indent=2) + "\n" if as_json else render(found))
    stdout.flush()
    return found["exit_status"]


# --- the report --------------------------------------------------------------------------------


def report() -> Dict[str, Any]:
    """Everything ``otel-generate doctor`` says, as one JSON-ready dictionary."""
    hint = namespace_hint()
    versions = _versions()
    from otel_generate import instrumentor as ins
    from otel_generate import options as _options

    instrumentor = ins.GenerateInstrumentor()
    turned_on_here = False
    unmet = requirement_problems(instrumentor.instrumentation_dependencies())
    if not instrumentor.is_instrumented_by_opentelemetry:
        instrumentor.instrument(skip_dep_check=True)  # to see every hook installed, whatever the versions say
        turned_on_here = True
    modules = _import_modules(ins)
    telemetry = instrumentor.telemetry
    patches = instrumentor.patches

    def wanted(row: Any) -> bool:
        return telemetry is not None and ins._wanted(row, telemetry) and row.when != "emitter"

    features = [_feature(ins, feature, modules, wanted) for feature in ins.FEATURES]
    points = _points(ins, modules, patches, features, wanted)
    given = instrumentor.given_options
    found_exporters = exporters()
    options = _options.explain(given)
    found = {
        "versions": versions,
        "transformers": ins.transformers_version() if "transformers" in sys.modules else None,
        "instrumentation": {
            "turned_on_by": "otel-generate doctor" if turned_on_here else "the application",
            "version_check": "refused" if unmet else "passed",
        },
        "patch_points": points,
        "features": features,
        "providers": _providers(given),
        "exporters": found_exporters,
        "options": options,
        "hint": hint,
    }
    problems = [{"kind": DEPENDENCY, "problem": text} for text in unmet]
    problems += _feature_problems(features)
    problems += _endpoint_problems(found_exporters)
    problems += [{"kind": OPTION, "problem": entry["problem"]} for entry in options.values() if "problem" in entry]
    found["problems"] = problems
    found["exit_status"] = 1 if problems else 0
    found["verdict"] = verdict(problems, found["transformers"], found_exporters)
    return found


# --- problems -----------------------------------------------------------------------------------

#: The kinds of problem, as the report and the verdict name them.
DEPENDENCY, FEATURE, ENDPOINT, OPTION = "dependency", "feature", "endpoint", "option"


def requirement_problems(requirements: Sequence[str]) -> List[str]:
    """One sentence per requirement (``"transformers >= 4.46.3"``) the installed distributions do not
    meet: not installed, or a version outside the range (a pre-release read as its release, as
    :func:`otel_generate.package.satisfies` reads it)."""
    from importlib import metadata

    from packaging.requirements import Requirement

    from otel_generate import package

    problems = []
    for text in requirements:
        requirement = Requirement(text)
        try:
            installed = metadata.version(requirement.name)
        except metadata.PackageNotFoundError:
            problems.append(f"{requirement.name} is not installed: this instrumentation needs {text}")
            continue
        if not package.satisfies(requirement, installed):
            problems.append(
                f"{requirement.name} {installed} is outside the supported range ({text}): instrument() "
                f"refuses to run and traces nothing (opentelemetry-instrument skips this instrumentation)"
            )
    return problems


def _feature_problems(features: List[Dict[str, Any]]) -> List[Dict[str, str]]:
    problems = []
    for feature in features:
        if feature["status"] == NOT_TRACED:
            for point, problem in feature["problems"].items():
                text = f"{feature['name']} not traced ({feature['lost']}): `{point}` {problem}"
                problems.append({"kind": FEATURE, "problem": text})
    return problems


def _endpoint_problems(found: List[Dict[str, Any]]) -> List[Dict[str, str]]:
    """One problem per OTLP endpoint not reachable (or not a host and port), naming its signals."""
    signals: Dict[Tuple[str, str], List[Dict[str, Any]]] = {}
    for entry in found:
        if "address" in entry and not entry["reachable"]:
            signals.setdefault((entry["endpoint"], entry["address"]), []).append(entry)
    problems = []
    for (endpoint, address), entries in signals.items():
        names = [entry["signal"] for entry in entries]
        names = ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else names[0]
        sources = sorted({entry["endpoint_source"] for entry in entries})
        if entries[0].get("error"):
            why = entries[0]["error"]
        else:
            why = f"no TCP connection to {address} within {CONNECT_TIMEOUT_S:g} s"
        text = f"the {names} endpoint {endpoint} ({', '.join(sources)}) is not reachable: {why}"
        problems.append({"kind": ENDPOINT, "problem": text})
    return problems


def verdict(problems: List[Dict[str, str]], transformers: Optional[str], found: List[Dict[str, Any]]) -> str:
    """The report's last line: ``OK: ...`` when there is no problem, else ``FAIL: ...`` with their count."""
    if problems:
        kinds = list(dict.fromkeys(problem["kind"] for problem in problems))
        count = f"{len(problems)} problem{'s' if len(problems) > 1 else ''}"
        return f"FAIL: {count} ({', '.join(kinds)})"
    endpoints = len({entry["address"] for entry in found if "address" in entry})
    reached = f"{endpoints} endpoint{'s' if endpoints > 1 else ''} reachable" if endpoints else "no OTLP endpoint"
    features = f"transformers {transformers} supported, every feature it has traced"
    return f"OK: no problem ({features}, {reached}, options valid)"


def _versions() -> Dict[str, Optional[str]]:
    from importlib import metadata

    versions: Dict[str, Optional[str]] = {"python": platform.python_version()}
    for label, distribution in _DISTRIBUTIONS:
        try:
            versions[label] = metadata.version(distribution)
        except metadata.PackageNotFoundError:
            versions[label] = None
    return versions


def _import_modules(ins: Any) -> Dict[str, Optional[str]]:
    """Import every transformers module of the patch table: ``{module: None}`` when imported, else why
    not, starting with :data:`ABSENT` (it does not exist in this transformers, or transformers is not
    installed), :data:`UNAVAILABLE` (a library outside transformers that it imports is not installed:
    the feature cannot be used here) or :data:`FAILED` (anything else: a problem)."""
    outcome: Dict[str, Optional[str]] = {}
    for row in ins.PATCHES:
        if row.module in outcome or not row.module.startswith("transformers"):
            continue
        try:
            importlib.import_module(row.module)
            outcome[row.module] = None
        except ModuleNotFoundError as exc:
            name = exc.name or ""
            if name and (row.module == name or row.module.startswith(name + ".")):
                outcome[row.module] = f"{ABSENT} ({_one_line(exc)})"
            elif name and name.split(".")[0] != "transformers":  # an optional library of the feature
                outcome[row.module] = f"{UNAVAILABLE} (needs {name.split('.')[0]}, which is not installed)"
            else:  # the module exists, and a module of transformers it imports does not
                outcome[row.module] = f"{FAILED} ({_one_line(exc)})"
        except Exception as exc:  # a module that exists and fails to import
            outcome[row.module] = f"{FAILED} ({_one_line(exc)})"
    return outcome


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}"


def _feature(ins: Any, feature: Any, modules: Dict[str, Optional[str]], wanted: Any) -> Dict[str, Any]:
    entry: Dict[str, Any] = {"name": feature.name, "anchor": feature.anchor}
    reason = modules.get(feature.anchor)
    if reason is not None and reason.startswith(FAILED):
        entry.update(status=NOT_TRACED, lost=feature.lost, problems={feature.anchor: reason})
        return entry
    if reason is not None and reason.startswith(UNAVAILABLE):
        entry.update(status=UNAVAILABLE, reason=reason)
        return entry
    if reason is not None or feature.anchor not in sys.modules:
        entry.update(status=ABSENT, reason=reason or "not imported")
        return entry
    problems = ins.feature_problems(feature, wanted)
    problems.update(ins.detail_problems(feature))
    if problems:
        entry.update(status=NOT_TRACED, lost=feature.lost, problems=problems)
    else:
        entry["status"] = TRACED
    return entry


def _points(
    ins: Any, modules: Dict[str, Optional[str]], patches: Any, features: List[Dict[str, Any]], wanted: Any
) -> List[Dict[str, Any]]:
    uses: Dict[str, List[str]] = {}
    for feature in ins.FEATURES:
        for point in {p for variant in feature.variants for p in variant} | set(feature.details):
            uses.setdefault(point, []).append(feature.name)
    points = []
    for row in ins.PATCHES:
        if not row.module.startswith("transformers"):
            continue
        point = ins.point_of(row)
        entry: Dict[str, Any] = {
            "point": point if not row.owner.endswith(ins.SUBCLASSES) else f"{point} (and subclasses)",
            "module": row.module,
            "features": uses.get(point, []),
        }
        traced = {f["name"] for f in features if f["status"] == TRACED}
        if modules.get(row.module) is not None:
            entry.update(status=MISSING, problem=modules[row.module])
        else:
            problem = ins.point_problem(row)
            if problem is not None:
                entry.update(status=MISSING, problem=problem)
                if entry["features"] and set(entry["features"]) <= traced:
                    entry["note"] = "another release's point: its features are traced without it"
            elif patches is not None and _installed(ins, patches, row):
                entry["status"] = INSTALLED
            else:
                entry["status"] = FOUND
                if not wanted(row):
                    entry["note"] = f"installed when asked for ({row.when})"
        points.append(entry)
    return points


def _installed(ins: Any, patches: Any, row: Any) -> bool:
    module = sys.modules.get(row.module)
    owner = module if row.owner == ins.MODULE_LEVEL else getattr(module, row.owner.rstrip(ins.SUBCLASSES), None)
    if owner is None:
        return False
    if row.owner.endswith(ins.SUBCLASSES):
        return patches.is_installed(owner, "__init_subclass__")
    return patches.is_installed(owner, row.attribute)


def _qualified(obj: Any) -> str:
    kind = type(obj)
    return f"{kind.__module__}.{kind.__qualname__}"


def _providers(given: Dict[str, Any]) -> Dict[str, Dict[str, str]]:
    """The tracer, meter and logger providers this package uses: the ``instrument()`` argument, else the global."""
    from opentelemetry import _logs, metrics, trace

    found = {}
    for label, name, current in (
        ("tracer", "tracer_provider", trace.get_tracer_provider),
        ("meter", "meter_provider", metrics.get_meter_provider),
        ("logger", "logger_provider", _logs.get_logger_provider),
    ):
        provider = given.get(name)
        source = "argument" if provider is not None else "global"
        provider = provider if provider is not None else current()
        text = _qualified(provider)
        if "Proxy" in type(provider).__name__ or "NoOp" in type(provider).__name__:
            text += " (none set: nothing is exported)"
        found[label] = {"provider": text, "source": source}
    return found


# --- exporters and endpoints ----------------------------------------------------------------------


def _env(*names: str) -> Tuple[Optional[str], Optional[str]]:
    """The first of ``names`` set (not empty) in the environment: ``(variable, value)``."""
    for name in names:
        value = os.environ.get(name)
        if value is not None and value.strip():
            return name, value.strip()
    return None, None


def exporters() -> List[Dict[str, Any]]:
    """The exporters the ``OTEL_*`` environment configures for each signal, as the SDK's
    auto-configuration (``opentelemetry-instrument``) reads it, each OTLP endpoint checked once."""
    found: List[Dict[str, Any]] = []
    checked: Dict[Tuple[str, int], bool] = {}
    for signal in SIGNALS:
        variable, names = _env(f"OTEL_{signal.upper()}_EXPORTER")
        for name in (names or "otlp").split(","):
            name = name.strip().lower()
            entry: Dict[str, Any] = {
                "signal": signal,
                "exporter": name,
                "source": f"environment ({variable})" if variable else "default",
            }
            if name == "otlp":
                entry.update(_otlp_endpoint(signal))
                address = _address(entry["endpoint"], entry["protocol"])
                if address is None:
                    entry.update(reachable=False, address=entry["endpoint"], error="not a host and port")
                else:
                    if address not in checked:
                        checked[address] = _reachable(address)
                    entry.update(reachable=checked[address], address=f"{address[0]}:{address[1]}")
            elif name == "console":
                entry["endpoint"] = "stdout"
            found.append(entry)
    return found


def _otlp_endpoint(signal: str) -> Dict[str, str]:
    upper = signal.upper()
    protocol_variable, protocol = _env(f"OTEL_EXPORTER_OTLP_{upper}_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
    protocol = (protocol or "grpc").lower()
    variable, endpoint = _env(f"OTEL_EXPORTER_OTLP_{upper}_ENDPOINT")
    if endpoint is None:
        variable, endpoint = _env("OTEL_EXPORTER_OTLP_ENDPOINT")
        if endpoint is not None and protocol != "grpc":
            endpoint = endpoint.rstrip("/") + f"/v1/{signal}"
    if endpoint is None:
        endpoint = "http://localhost:4317" if protocol == "grpc" else f"http://localhost:4318/v1/{signal}"
    return {
        "protocol": protocol,
        "protocol_source": f"environment ({protocol_variable})" if protocol_variable else "default",
        "endpoint": endpoint,
        "endpoint_source": f"environment ({variable})" if variable else "default",
    }


def _address(endpoint: str, protocol: str) -> Optional[Tuple[str, int]]:
    parts = urlsplit(endpoint if "://" in endpoint else f"//{endpoint}")
    try:
        port = parts.port
    except ValueError:
        return None
    if not parts.hostname:
        return None
    if port is None:
        port = 443 if parts.scheme == "https" else (4317 if protocol == "grpc" else 80)
    return parts.hostname, port


def _reachable(address: Tuple[str, int]) -> bool:
    try:
        with socket.create_connection(address, timeout=CONNECT_TIMEOUT_S):
            return True
    except OSError:
        return False


# --- running from a clone's parent folder ---------------------------------------------------------


def namespace_hint(folder: Optional[str] = None) -> Optional[str]:
    """The hint for ``import otel_generate`` from ``folder`` (default: the current one) when there it
    would find a folder ``otel_generate`` without ``__init__.py`` instead of the installed package
    (an editable install; :func:`otel_generate.package.namespace_hint`), else ``None``."""
    from otel_generate import package

    folder = os.path.abspath(folder or os.getcwd())
    hidden = package.hidden_by(folder)
    return None if hidden is None else package.namespace_hint(hidden, started_in=folder)


# --- text ---------------------------------------------------------------------------------------


def render(found: Dict[str, Any]) -> str:
    from otel_generate.options import spell

    lines = ["otel-generate doctor", ""]
    lines.append("versions")
    for name, version in found["versions"].items():
        lines.append(f"  {name:<20} {version or 'not installed'}")
    check = found["instrumentation"]
    version_check = "passed" if check["version_check"] == "passed" else "refused (see problems)"
    turned_on = f"turned on by {check['turned_on_by']}; version check: {version_check}"
    lines.append(f"  {'instrumentation':<20} {turned_on}")
    lines += ["", f"features (transformers {found['transformers'] or 'not installed'})"]
    for feature in found["features"]:
        status = feature["reason"] if feature["status"] == UNAVAILABLE else feature["status"]
        lines.append(f"  {feature['name']:<20} {status}")
        if feature["status"] == NOT_TRACED:
            for point, problem in feature["problems"].items():
                lines.append(f"  {'':<20}   {feature['lost']}: `{point}` {problem}")
    lines += ["", "patch points"]
    for point in found["patch_points"]:
        text = f"  {point['status']:<9} {point['point']:<55} {', '.join(point['features']) or '-'}"
        extra = "; ".join(point[key] for key in ("problem", "note") if point.get(key))
        lines.append(text + (f"  ({extra})" if extra else ""))
    lines += ["", "telemetry"]
    for label, entry in found["providers"].items():
        lines.append(f"  {label + ' provider':<16} {entry['provider']} ({entry['source']})")
    for entry in found["exporters"]:
        where = ""
        if "address" in entry:
            state = "reachable" if entry["reachable"] else "not reachable"
            where = f" {entry['protocol']} {entry['endpoint']} ({entry['endpoint_source']})"
            where += f": {state} at {entry['address']}"
        elif "endpoint" in entry:
            where = f" {entry['endpoint']}"
        lines.append(f"  {entry['signal'] + ' exporter':<16} {entry['exporter']} ({entry['source']}){where}")
    lines += ["", "options"]
    for name, entry in found["options"].items():
        source = entry["source"]
        if source == "environment":
            source = f"environment ({entry['variable']})"
        elif "ignored" in entry:
            source = f"default ({entry['variable']}={entry['ignored']!r} ignored)"
        lines.append(f"  {name:<28} {spell(entry['value']):<12} {source}")
    if found["hint"]:
        lines += ["", "hint", f"  {found['hint']}"]
    if found["problems"]:
        lines += ["", "problems"]
        lines += [f"  {problem['kind']}: {problem['problem']}" for problem in found["problems"]]
    lines += ["", found["verdict"]]
    return "\n".join(lines) + "\n"
