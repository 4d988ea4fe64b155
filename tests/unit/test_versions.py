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
