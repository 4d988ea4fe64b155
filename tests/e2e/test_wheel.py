"""The package as users get it: ``python -m build`` makes a wheel and an sdist, and
the wheel, installed into a fresh venv, runs the example under ``opentelemetry-instrument``;
docs/install.md's commands, word for word, install it from a clone and from a wheel built there.

Installing torch into the fresh venv would download it again (hundreds of MB). Instead the fresh
venv reaches this test venv's packages through a ``.pth`` file pointing at a directory of symbolic
links to them, leaving out otel_generate itself (the editable install, its ``.pth`` finder and its
``dist-info``): ``otel_generate`` and its entry points come from the wheel alone, which the test
checks (one ``otel-generate`` distribution, one ``transformers_generate`` instrumentor, the module
file inside the fresh venv). The build is isolated (``build`` fetches setuptools from the package
index), as a user's is: slow.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile

import pytest

from otel_generate import attributes as A
from otel_generate.version import __version__
from tests.helpers import console_spans

ROOT = pathlib.Path(__file__).resolve().parents[2]
INSTRUMENT = pathlib.Path(sys.executable).with_name("opentelemetry-instrument")
TIMEOUT_S = 600
NEW_TOKENS = 3
MODULES = sorted(p.name for p in (ROOT / "otel_generate").glob("*.py"))

RUN_EXAMPLE = r"""
import runpy, sys
import otel_generate
print("OTEL_GENERATE_FROM " + otel_generate.__file__, flush=True)
sys.argv = [sys.argv[1]] + sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""

CHECK_DISTRIBUTIONS = r"""
import importlib.metadata as md
dists = [d for d in md.distributions() if (d.metadata["Name"] or "").lower().replace("_", "-") == "otel-generate"]
print("DISTRIBUTIONS", len(dists), dists[0].version if dists else None)
for group in ("opentelemetry_instrumentor", "opentelemetry_pre_instrument", "opentelemetry_post_instrument"):
    names = [ep.value for ep in md.entry_points(group=group) if ep.name == "transformers_generate"]
    print("ENTRY_POINTS", group, len(names), names[0] if names else None)
"""


def _run(args, **kwargs):
    done = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=TIMEOUT_S, **kwargs)
    assert done.returncode == 0, f"{args}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done


def _is_this_package(name):
    lowered = name.lower()
    return lowered.startswith(("otel_generate", "otel-generate", "__editable__")) or lowered.endswith(".pth")


def _share_site_packages(into):
    """A directory of symbolic links to this venv's installed packages, otel_generate left out."""
    into.mkdir()
    seen = set()
    for key in ("purelib", "platlib"):
        site = pathlib.Path(sysconfig.get_paths()[key])
        for entry in site.iterdir():
            if entry.name in seen or _is_this_package(entry.name) or entry.name == "__pycache__":
                continue
            seen.add(entry.name)
            (into / entry.name).symlink_to(entry)
    return into


def _fresh_venv(venv, shared):
    """A venv without pip that reaches the ``shared`` packages through a ``.pth`` file, and a ``pip``
    command in its ``bin`` (``python -m pip``: pip from the shared packages, installing into the venv).

    Returns ``(python, env, site-packages)``; ``env`` puts the venv's ``bin`` first on ``PATH``.
    """
    _run([sys.executable, "-m", "venv", "--without-pip", venv])
    python = venv / "bin" / "python"
    env = {key: value for key, value in os.environ.items() if not key.startswith(("OTEL_", "PYTHON", "VIRTUAL_ENV"))}
    env.update(PYTHONNOUSERSITE="1", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    site = pathlib.Path(
        _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], env=env).stdout.strip()
    )
    (site / "zz_test_venv_packages.pth").write_text(f"{shared}\n", encoding="utf-8")
    pip = venv / "bin" / "pip"
    pip.write_text(f'#!/bin/sh\nexec "{python}" -m pip "$@"\n', encoding="utf-8")
    pip.chmod(0o755)
    return python, env, site


@pytest.mark.slow
def test_built_wheel_in_a_fresh_venv_runs_the_example_under_opentelemetry_instrument(tmp_path):
    if not INSTRUMENT.exists():
        pytest.skip("opentelemetry-instrument is not installed (opentelemetry-instrumentation)")
    pytest.importorskip("build")
    dist = tmp_path / "dist"
    built = subprocess.run(
        [sys.executable, "-m", "build", "--outdir", str(dist), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    if built.returncode != 0 and "Could not find a version that satisfies" in built.stdout + built.stderr:
        pytest.skip("the isolated build could not fetch setuptools from the package index")
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-3000:]
    (wheel,) = dist.glob("*.whl")
    (sdist,) = dist.glob("*.tar.gz")
    assert wheel.name == f"otel_generate-{__version__}-py3-none-any.whl"

    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        entry_points = archive.read(f"otel_generate-{__version__}.dist-info/entry_points.txt").decode()
    assert {f"otel_generate/{module}" for module in MODULES} <= names
    assert not any(name.startswith(("tests/", "examples/")) for name in names)  # the package only
    assert "transformers_generate = otel_generate:GenerateInstrumentor" in entry_points
    # the Apache-2.0 text travels with the wheel (PEP 639: dist-info/licenses/) and the sdist
    assert f"otel_generate-{__version__}.dist-info/licenses/LICENSE" in names
    with tarfile.open(sdist) as archive:
        members = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    assert {
        "pyproject.toml",
        "README.md",
        "LICENSE",
        "examples/app.py",
        "tests/conftest.py",
        "tests/helpers/otlp_receiver.py",
    } <= members
    assert {f"otel_generate/{module}" for module in MODULES} <= members

    python, env, site = _fresh_venv(tmp_path / "fresh-venv", _share_site_packages(tmp_path / "test-venv-packages"))
    # pip comes from the shared packages; it installs into the fresh venv (sys.prefix)
    _run(
        [python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", "--disable-pip-version-check", wheel],
        env=env,
        cwd=str(tmp_path),
    )

    found = _run([python, "-c", CHECK_DISTRIBUTIONS], env=env, cwd=str(tmp_path)).stdout.splitlines()
    assert f"DISTRIBUTIONS 1 {__version__}" in found  # the wheel's, not the editable install's
    assert "ENTRY_POINTS opentelemetry_instrumentor 1 otel_generate:GenerateInstrumentor" in found
    assert sum(line.startswith("ENTRY_POINTS opentelemetry_pre_instrument 1 ") for line in found) == 1

    runner = tmp_path / "run_example.py"
    runner.write_text(RUN_EXAMPLE, encoding="utf-8")
    done = _run(
        [
            python,
            INSTRUMENT,
            "--traces_exporter",
            "console",
            "--metrics_exporter",
            "none",
            "--logs_exporter",
            "none",
            python,
            runner,
            ROOT / "examples" / "app.py",
            "--new-tokens",
            str(NEW_TOKENS),
        ],
        env=dict(env, OTEL_SERVICE_NAME="from-wheel"),
        cwd=str(tmp_path),
    )
    origin = pathlib.Path(
        next(line for line in done.stdout.splitlines() if line.startswith("OTEL_GENERATE_FROM ")).split(" ", 1)[1]
    )
    assert origin == site / "otel_generate" / "__init__.py"  # the wheel's copy, not the source tree
    assert ROOT not in origin.parents
    requests = [s for s in console_spans(done.stdout) if s["name"].startswith(A.OPERATION_TEXT_COMPLETION + " ")]
    assert len(requests) == 1
    assert requests[0]["attributes"][A.GEN_AI_USAGE_OUTPUT_TOKENS] == NEW_TOKENS
    assert requests[0]["resource"]["attributes"]["service.name"] == "from-wheel"


# --- docs/install.md, as written --------------------------------------------------------------------------

INSTALL_PAGE = ROOT / "docs" / "install.md"
#: where docs/install.md's commands name the user's clone
CLONE = "/path/to/otel_generate"

CHECK_INSTALLED = r"""
import importlib.metadata as md, json, otel_generate
dist = md.distribution("otel-generate")
print("VERSION", dist.version)
print("FROM", otel_generate.__file__)
print("DIRECT_URL", json.dumps(json.loads(dist.read_text("direct_url.json") or "null")))
"""


def install_blocks():
    """The bash blocks of docs/install.md's "In your project" section, in order."""
    text = INSTALL_PAGE.read_text()
    section = text[text.index("## In your project") : text.index("## Supported versions")]
    return re.findall(r"^```bash\n(.*?)^```$", section, re.M | re.S)


def _clone(into):
    """A git repository at ``into`` holding this checkout's files as they are now (tracked ones and new
    ones git does not ignore), committed: what a user's clone is."""
    listed = _run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=str(ROOT)).stdout
    for name in filter(None, listed.split("\0")):
        source = ROOT / name
        if source.is_file():
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, into / name)
    git = ["git", "-C", into, "-c", "user.name=test", "-c", "user.email=test@localhost"]
    _run(git + ["init", "-q"])
    _run(git + ["add", "-A"])
    _run(git + ["commit", "-q", "-m", "the checkout under test"])
    return into


def test_install_page_has_the_commands_the_test_runs():
    clone, wheel = install_blocks()
    commands = [line for line in clone.splitlines() if line and not line.startswith("#")]
    assert commands == [
        f'pip install "{CLONE}[instruments]"',
        f'pip install "otel-generate[instruments] @ git+file://{CLONE}"',
    ]
    assert "python -m build --wheel" in wheel and f"cd {CLONE}" in wheel
    assert "<" not in "".join(commands) + wheel  # no placeholder left for the reader to fill in


@pytest.mark.slow
def test_install_page_commands_install_from_a_clone_and_from_a_wheel(tmp_path):
    """Each of docs/install.md's ways runs, word for word, in a fresh venv, with a clone of this checkout
    at the page's path; the installed package is this version, imported from the venv, with its console
    script, and its ``direct_url.json`` says where pip took it from."""
    pytest.importorskip("build")
    if shutil.which("git") is None:
        pytest.fail("git is needed to make the clone docs/install.md installs from")
    clone = _clone(tmp_path / "otel_generate")
    from_clone, from_wheel = install_blocks()
    scripts = [line for line in from_clone.splitlines() if line and not line.startswith("#")] + [from_wheel]
    shared = _share_site_packages(tmp_path / "test-venv-packages")
    installed = []
    for number, script in enumerate(scripts):
        python, env, site = _fresh_venv(tmp_path / f"venv-{number}", shared)
        done = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", script.replace(CLONE, str(clone))],
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            env=env,
            cwd=str(tmp_path),
        )
        if done.returncode != 0 and "Could not find a version that satisfies" in done.stdout + done.stderr:
            pytest.skip("the isolated build could not fetch setuptools from the package index")
        assert done.returncode == 0, f"{script}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        lines = _run([python, "-c", CHECK_INSTALLED], env=env, cwd=str(tmp_path)).stdout.splitlines()
        found = dict(line.split(" ", 1) for line in lines)
        assert found["VERSION"] == __version__
        assert pathlib.Path(found["FROM"]) == site / "otel_generate" / "__init__.py"  # a copy in the venv
        version = _run([python.with_name("otel-generate"), "--version"], env=env).stdout.strip()
        assert version == f"otel-generate {__version__}"
        installed.append(json.loads(found["DIRECT_URL"]))
    path, git, wheel = installed
    assert path["url"] == clone.as_uri() and "dir_info" in path
    assert git["url"] == clone.as_uri() and git["vcs_info"]["vcs"] == "git"
    commit = _run(["git", "-C", clone, "rev-parse", "HEAD"]).stdout.strip()
    assert git["vcs_info"]["commit_id"] == commit
    assert wheel["url"] == (clone / "dist" / f"otel_generate-{__version__}-py3-none-any.whl").as_uri()
