"""Version checks on their own, no model: a pre-release is checked as its release, torch local and dev
builds are in range, and the requirements name no pre-release."""

from __future__ import annotations

import pathlib

import pytest
from packaging.requirements import Requirement

from otel_generate import _versions
from otel_generate.package import _instruments

ROOT = pathlib.Path(__file__).resolve().parents[2]
TORCH_DEV = "2.9.0.dev20260101"


@pytest.mark.parametrize(
    "installed, expected",
    [
        ("5.25.0.dev0", True),  # a pre-release of a later version
        ("4.46.0rc1", True),  # a pre-release of the oldest supported version itself
        ("4.46.0", True),
        ("5.24.0.post1", True),
        ("4.45.2", False),
        ("4.46.0.dev0+local", True),
        ("4.45.0.dev0", False),
        ("not a version", False),
    ],
)
def test_a_pre_release_is_checked_as_its_release(installed, expected):
    assert _versions.satisfies(Requirement("transformers >= 4.46"), installed) is expected


def test_torch_local_and_dev_builds_are_in_range():
    requirement = Requirement("torch >= 2.1")
    assert _versions.satisfies(requirement, "2.13.0+cpu")
    assert _versions.satisfies(requirement, TORCH_DEV)
    assert not _versions.satisfies(requirement, "2.0.1")


def test_the_requirements_pip_reads_name_no_pre_release_so_pip_keeps_final_releases():
    pyproject = _tomllib().loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    extra = [Requirement(line) for line in pyproject["project"]["optional-dependencies"]["instruments"]]
    ours = [Requirement(line) for line in _instruments]
    assert {(r.name, str(r.specifier)) for r in extra} == {(r.name, str(r.specifier)) for r in ours}
    for requirement in extra:
        # pip allows pre-releases for a requirement whose specifier names one
        assert not requirement.specifier.prereleases
        newest_final, newer_pre_release = "99.0.0", "99.1.0rc1"
        assert list(requirement.specifier.filter([newest_final, newer_pre_release])) == [newest_final]


def _tomllib():
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    return tomllib


def test_the_pre_instrument_hook_names_a_folder_that_hides_the_package(monkeypatch, caplog, tmp_path):
    import sys
    import types

    from otel_generate import _versions, package

    folder = tmp_path / "otel_generate"
    namespace = types.ModuleType("otel_generate")
    namespace.__file__ = None
    namespace.__path__ = [str(folder)]
    assert package.imported_as_namespace(namespace) == [str(folder)]
    assert package.imported_as_namespace(sys.modules["otel_generate"]) is None  # the real package
    monkeypatch.setitem(sys.modules, "otel_generate", namespace)
    called = []
    monkeypatch.setattr(_versions, "GenerateInstrumentor", lambda: called.append("instrument"))
    with caplog.at_level("ERROR", logger="otel_generate"):
        _versions.before_auto_instrumentation()
    (record,) = caplog.records
    assert record.levelname == "ERROR" and f"finds {folder}, a folder without __init__.py" in record.getMessage()
    assert package.NAMESPACE_ERROR in record.getMessage() and "Run from another folder" in record.getMessage()
    assert called == []  # nothing else is tried


def test_doctor_names_a_hiding_folder_only_where_no_regular_package_is_found(tmp_path, monkeypatch):
    import sys

    from otel_generate import package

    (tmp_path / "clone" / "otel_generate").mkdir(parents=True)
    regular = tmp_path / "site" / "otel_generate"
    regular.mkdir(parents=True)
    (regular / "__init__.py").write_text("")
    monkeypatch.setattr(sys, "path", [str(tmp_path / "elsewhere")])
    assert package.hidden_by(str(tmp_path / "clone")) == [str(tmp_path / "clone" / "otel_generate")]
    monkeypatch.setattr(sys, "path", [str(tmp_path / "site")])  # a regular install on the path wins
    assert package.hidden_by(str(tmp_path / "clone")) is None


def test_doctor_names_each_requirement_not_met_and_passes_those_met():
    from importlib import metadata

    from otel_generate import doctor

    installed = metadata.version("packaging")
    assert doctor.requirement_problems(
        ["no-such-distribution-of-otel-generate >= 1.0", f"packaging > {installed}", f"packaging >= {installed}"]
    ) == [
        "no-such-distribution-of-otel-generate is not installed: this instrumentation needs "
        "no-such-distribution-of-otel-generate >= 1.0",
        f"packaging {installed} is outside the supported range (packaging > {installed}): instrument() refuses "
        "to run and traces nothing (opentelemetry-instrument skips this instrumentation)",
    ]
    assert doctor.requirement_problems(_instruments) == []  # this venv is a supported one


def test_doctor_tells_a_module_absent_from_one_missing_a_library_and_from_a_broken_one(monkeypatch):
    """How the doctor reads an import failure of a transformers module (the imports are faked: no
    transformers here): absent from this release, needing an optional library that is not installed
    (no problem), or failing otherwise (a problem)."""
    import types

    from otel_generate import doctor

    failures = {
        "transformers.cli.serving.server": ModuleNotFoundError(
            "No module named 'transformers.cli'", name="transformers.cli"
        ),
        "transformers.pipelines.base": ModuleNotFoundError("No module named 'fastapi'", name="fastapi.responses"),
        "transformers.generation.utils": ImportError("tokenizers>=0.20,<0.21 is required\nTry: pip install"),
        "transformers.models.whisper.generation_whisper": ModuleNotFoundError(
            "No module named 'transformers.utils.gone'", name="transformers.utils.gone"
        ),
    }

    def import_module(name):
        raise failures[name]

    monkeypatch.setattr(doctor.importlib, "import_module", import_module)
    ins = types.SimpleNamespace(PATCHES=[types.SimpleNamespace(module=name) for name in failures])
    assert doctor._import_modules(ins) == {
        "transformers.cli.serving.server": "not in this transformers (ModuleNotFoundError: No module named "
        "'transformers.cli')",
        "transformers.pipelines.base": "not available here (needs fastapi, which is not installed)",
        "transformers.generation.utils": "failed to import (ImportError: tokenizers>=0.20,<0.21 is required Try: "
        "pip install)",
        "transformers.models.whisper.generation_whisper": "failed to import (ModuleNotFoundError: No module named "
        "'transformers.utils.gone')",
    }
