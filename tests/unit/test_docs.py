"""The README and docs/: every relative link leads somewhere, and CI runs the README's test commands (the
minimal SDK example of docs/configuration.md is run by tests/e2e/test_sdk_example.py; the README's length
and links are tests/unit/test_readme.py's)."""

from __future__ import annotations

import os
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
#: the page whose one Python block is the minimal SDK example
SDK_EXAMPLE_PAGE = ROOT / "docs" / "configuration.md"

_FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.M | re.S)


def code_blocks(text: str, language: str) -> list[str]:
    """The bodies of the fenced code blocks of ``language`` in markdown ``text``, in order."""
    return [body for lang, body in _FENCE.findall(text) if lang == language]


def test_the_configuration_page_has_one_python_block_the_minimal_sdk_example():
    (code,) = code_blocks(SDK_EXAMPLE_PAGE.read_text(), "python")
    assert "GenerateInstrumentor().instrument(tracer_provider=provider)" in code
    assert "trace.set_tracer_provider(provider)" in code


# =============================================================================================
# Links
# =============================================================================================

_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: pathlib.Path) -> set[str]:
    """The anchors of the headings of ``path``, as GitHub makes them: a repeated slug gets ``-1``, ``-2``, ..."""
    text = _FENCE.sub("", path.read_text())
    anchors: set[str] = set()
    for m in re.finditer(r"^#{1,6} (.+?)(?: +#+)? *$", text, re.M):
        slug = base = _slug(m.group(1))
        n = 0
        while slug in anchors:
            n += 1
            slug = f"{base}-{n}"
        anchors.add(slug)
    return anchors


def _links(path: pathlib.Path) -> list[str]:
    return _LINK.findall(_FENCE.sub("", path.read_text()))


def test_links_are_found():
    assert "docs/contract.md" in _links(README)
    assert "images/phoenix-trace.png" in _links(ROOT / "docs" / "backends.md")
    assert "images/jaeger-trace.png" in _links(ROOT / "docs" / "backends.md")
    assert "images/serve-trace.png" in _links(ROOT / "docs" / "serving.md")


def test_slug_matches_githubs_rule(tmp_path):
    assert _slug("Step-span cap (`max_step_spans`)") == "step-span-cap-max_step_spans"
    assert _slug("Correlating with your web framework's spans") == "correlating-with-your-web-frameworks-spans"
    assert _slug("Without Docker: `collector/local.sh`") == "without-docker-collectorlocalsh"
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n## Usage\n\n```\n# not a heading\n```\n\n### Usage ##\n\n## Usage\n")
    assert _anchors(page) == {"title", "usage", "usage-1", "usage-2"}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_points_to_an_existing_file_and_heading(page):
    for link in _links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", link):  # http:, https:, mailto:
            continue
        target, _, fragment = link.partition("#")
        path = (page.parent / target).resolve() if target else page
        assert path.is_file(), f"{page.relative_to(ROOT)}: {link} -> {path} does not exist"
        if fragment and path.suffix == ".md":
            assert fragment in _anchors(path), f"{page.relative_to(ROOT)}: {link}: no heading #{fragment}"


def test_readme_links_every_docs_page():
    linked = {(README.parent / link.partition("#")[0]).resolve() for link in _links(README)}
    missing = [p.name for p in PAGES[1:] if p.resolve() not in linked]
    assert not missing, f"docs pages the README does not link: {missing}"


def test_ci_runs_the_readmes_test_command():
    """The README's Quick start ends in the full suite's command, the block after it gives the three
    commands (the unit loop, everything but slow, the full suite), and .ci/run runs the full suite."""
    blocks = [b for b in code_blocks(README.read_text(), "bash") if "pytest" in b]
    quick_start, running = blocks
    command = quick_start.strip().split("&&")[-1].strip()
    assert command == "python -m pytest"
    commands = [line.split("#", 1)[0].strip() for line in running.strip().splitlines()]
    assert commands == ["python -m pytest tests/unit", 'python -m pytest -m "not slow"', command]
    ci = [line.split("#", 1)[0] for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert any(re.search(rf"(^|[\s(&;]){re.escape(command)}(\s|\"|$)", line) for line in ci), (
        f".ci/run does not run {command!r}"
    )


# =============================================================================================
# docs/serving.md: where a span's process.pid comes from
# =============================================================================================


def test_the_serve_command_of_serving_md_gives_each_process_its_pid(monkeypatch):
    """The variable the server command sets makes the SDK's ``Resource.create()`` (what the agent's
    providers use) put this process's pid on the resource; without it there is none.
    tests/e2e/test_serve_processes.py starts the server with the same variable and checks the pids."""
    from opentelemetry.sdk.resources import Resource

    from tests.helpers import serve_command_environment

    documented = serve_command_environment()["OTEL_EXPERIMENTAL_RESOURCE_DETECTORS"]
    monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES", raising=False)
    monkeypatch.delenv("OTEL_EXPERIMENTAL_RESOURCE_DETECTORS", raising=False)
    assert "process.pid" not in Resource.create().attributes
    monkeypatch.setenv("OTEL_EXPERIMENTAL_RESOURCE_DETECTORS", documented)
    attributes = Resource.create({"service.name": "tiny-serve"}).attributes
    assert attributes["process.pid"] == os.getpid()
    assert attributes["process.parent_pid"] == os.getppid()
    assert attributes["service.name"] == "tiny-serve"
