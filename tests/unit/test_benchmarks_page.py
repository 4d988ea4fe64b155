"""BENCHMARKS.md and benchmarks/: a page of today's figures, each with a command that exists and runs, one
home for the measurement scripts, and a repository that speaks to its users about the product.

* BENCHMARKS.md is under 400 lines; every section with a table of figures has its command in a ``bash``
  block; every such command runs: ``otel-generate bench ... --dry-run`` (in process: the options are checked,
  nothing is run), ``python benchmarks/X.py --help``, ``bash -n`` for the shell scripts (which build or
  start things; tests/gpu/run_gpu_checks.sh --dry-run runs in tests/e2e/test_gpu_checks_script.py).
* benchmarks/README.md lists every file in benchmarks/ and nothing else, and every script there is
  cited by a command of BENCHMARKS.md.
* No heading or sentence of BENCHMARKS.md, README.md, docs/, benchmarks/, the package or the tests names a
  round of work or an attempt (a work session's number, "a helper found", ...).
"""

from __future__ import annotations

import os
import pathlib
import re
import shlex
import subprocess
import sys
from typing import List

import pytest

from otel_generate.bench import cli

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGE = ROOT / "BENCHMARKS.md"
TEXT = PAGE.read_text()
BENCHMARKS = ROOT / "benchmarks"

_FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.M | re.S)


def commands(text: str = TEXT) -> List[str]:
    """Every command of the ``bash`` blocks of ``text``: continued lines joined, comments dropped."""
    found = []
    for language, body in _FENCE.findall(text):
        if language != "bash":
            continue
        for line in body.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                found.append(" ".join(line.split()))
    return found


def program(command: str) -> List[str]:
    """The command's words without leading ``NAME=value`` assignments and ``time``."""
    words = shlex.split(command)
    while words and (re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]) or words[0] == "time"):
        words.pop(0)
    return words


COMMANDS = commands()


def test_the_page_is_under_400_lines():
    assert len(TEXT.splitlines()) < 400


def test_every_section_with_figures_gives_its_command():
    sections = re.split(r"^## ", _FENCE.sub(lambda m: f"```{m.group(1)}\n{m.group(2)}```", TEXT), flags=re.M)
    for section in sections[1:]:
        heading = section.splitlines()[0]
        has_table = re.search(r"^\|.*\|$", section, re.M) is not None
        if has_table:
            assert "```bash" in section, f"section {heading!r} has figures and no command next to them"


def test_the_commands_were_read():
    kinds = {program(c)[0] for c in COMMANDS}
    assert {"otel-generate", "python"} <= kinds, kinds
    assert any("--instructions" in c for c in COMMANDS) and any("--compare" in c for c in COMMANDS)


@pytest.mark.parametrize("command", [c for c in COMMANDS if program(c)[:2] == ["otel-generate", "bench"]])
def test_every_bench_command_of_the_page_is_valid(command, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)  # relative paths (--model-config benchmarks/configs/...) as from the repository root
    assert cli.main([*program(command)[1:], "--dry-run"]) == 0, capsys.readouterr().err
    assert "the options are valid; nothing was run" in capsys.readouterr().out


@pytest.mark.parametrize("command", [c for c in COMMANDS if program(c)[0] == "python"])
def test_every_script_command_of_the_page_runs_its_help(command):
    words = program(command)
    assert words[1].startswith("benchmarks/"), command
    script = ROOT / words[1]
    assert script.is_file(), f"{command}: {script} does not exist"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, str(script), "--help"], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300
    )
    assert done.returncode == 0 and "usage" in done.stdout.lower(), done.stderr


@pytest.mark.parametrize("command", [c for c in COMMANDS if program(c)[0].endswith(".sh")])
def test_every_shell_script_of_the_page_exists_and_parses(command):
    script = ROOT / program(command)[0]
    assert script.is_file() and os.access(script, os.X_OK), f"{command}: {script} is not an executable file"
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_every_command_is_one_of_the_kinds_checked():
    unchecked = [
        c
        for c in COMMANDS
        if program(c)[:2] != ["otel-generate", "bench"]
        and program(c)[0] != "python"
        and not program(c)[0].endswith(".sh")
    ]
    assert not unchecked, f"commands no test runs: {unchecked}"


# --- benchmarks/ -----------------------------------------------------------------------------------------


def _listed() -> List[str]:
    return re.findall(r"^- `([^`]+)`: \S", (BENCHMARKS / "README.md").read_text(), re.M)


def _files() -> List[str]:
    return sorted(
        str(path.relative_to(BENCHMARKS))
        for path in BENCHMARKS.rglob("*")
        if path.is_file() and path.name != "README.md" and "__pycache__" not in path.parts
    )


def test_benchmarks_readme_lists_every_file_of_the_folder_once_and_nothing_else():
    listed = _listed()
    assert len(listed) == len(set(listed)), "a file listed twice"
    assert sorted(listed) == _files()


def test_every_script_in_benchmarks_is_cited_by_a_command_of_the_page():
    cited = {program(c)[1] for c in COMMANDS if program(c)[0] == "python"}
    scripts = {f"benchmarks/{name}" for name in _files() if name.endswith(".py")}
    assert scripts <= cited, f"scripts no table of BENCHMARKS.md cites: {sorted(scripts - cited)}"
    configs = {f"benchmarks/{name}" for name in _files() if not name.endswith(".py")}
    assert all(any(config in c for c in COMMANDS) for config in configs), configs


# --- the repository speaks to its users ------------------------------------------------------------------

#: phrases that narrate how the work went rather than what the product does
DIARY = [
    r"\bsessions? \d+",
    r"\bissue \d+,? (item \d+,? )?session\b",
    r"\b(this|that|the last|the previous|the next|an earlier|a later|an? other) session\b",
    r"\bbefore this (session|round|change)\b",
    r"\bround \d+\b",
    r"\b(first|second|third|last|previous|this|earlier|later) round\b(?! trip)",
    r"\b(first|second|third|previous|earlier|failed) attempt\b",
    r"\b(a|the|another) helper (found|checked|measured|noticed|said)\b",
    r"\breview(er)? found\b",
    r"\bissue \d+",  # this project's work items; an upstream one is cited by its address (owner/repo#N)
]
_DIARY = re.compile("|".join(DIARY), re.I)


def _texts() -> List[pathlib.Path]:
    paths = [PAGE, ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted(BENCHMARKS.rglob("*.py"))]
    paths += sorted((ROOT / "otel_generate").rglob("*.py")) + sorted((ROOT / "tests").rglob("*.py"))
    paths += sorted((ROOT / "examples").glob("*.py")) + [BENCHMARKS / "README.md"]
    paths += sorted((ROOT / ".ci").iterdir()) + [ROOT / "pyproject.toml", ROOT / "docker-compose.yml"]
    paths += sorted(p for p in (ROOT / "collector").rglob("*") if p.suffix in (".sh", ".py", ".yaml", ".yml"))
    return [p for p in paths if p.resolve() != pathlib.Path(__file__).resolve()]


def test_the_diary_patterns_catch_what_they_are_for():
    work = "session"  # joined here, so that the repository's own text never names a numbered one
    for phrase in (
        f"### Counts (issue 18, {work} 9)",
        f"measured in {work} 22",
        "as a helper found it",
        "the first round of cuts",
        "before this session",
        "an adversarial review found",
        "the first attempt at the cut",
        "the GPU checks are pending (issue 43)",
        "# --- issue 19: the real backends",
    ):
        assert _DIARY.search(phrase), phrase
    for phrase in (
        "40 interleaved rounds, the order rotated each round",
        "a round trip to the device",
        "each temperature-fallback attempt",
        "the next attempt of this window",
        "attempt 0 kept row 0 and sent row 1 on",
        "scope='session'",
        "a workaround for open-telemetry/opentelemetry-python#2767",
    ):
        assert not _DIARY.search(phrase), phrase


@pytest.mark.parametrize("path", _texts(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_text_names_a_round_of_work_or_an_attempt(path):
    found = [(n, m.group(0)) for n, line in enumerate(path.read_text().splitlines(), 1) for m in _DIARY.finditer(line)]
    assert not found, f"{path.relative_to(ROOT)}: {found}"


@pytest.mark.parametrize("page", [PAGE, BENCHMARKS / "README.md"], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_of_the_page_and_the_scripts_list_leads_somewhere(page):
    from tests.unit.test_docs import _anchors, _links

    links = _links(page)
    assert links, page
    for link in links:
        if re.match(r"^[a-z][a-z0-9+.-]*:", link):
            continue
        target, _, fragment = link.partition("#")
        path = (page.parent / target).resolve() if target else page
        assert path.is_file(), f"{link} -> {path} does not exist"
        if fragment and path.suffix == ".md":
            assert fragment in _anchors(path), f"{page.name}: {link}: no heading #{fragment}"
