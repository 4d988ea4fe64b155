"""The README and docs/: the README's minimal SDK example runs as written and prints its spans, every
relative link leads somewhere, and CI runs the README's test command."""

from __future__ import annotations

import ast
import os
import pathlib
import re
import subprocess
import sys

import pytest

from otel_generate import attributes as A
from tests.helpers import console_spans

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.M | re.S)


def code_blocks(text: str, language: str) -> list[str]:
    """The bodies of the fenced code blocks of ``language`` in markdown ``text``, in order."""
    return [body for lang, body in _FENCE.findall(text) if lang == language]


def test_readme_has_exactly_one_python_example():
    assert len(code_blocks(README.read_text(), "python")) == 1


def test_readme_minimal_sdk_example_prints_its_span_tree(tmp_path):
    (code,) = code_blocks(README.read_text(), "python")
    script = tmp_path / "example.py"
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}  # as a new user's shell
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=str(tmp_path), env=env
    )
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr

    # What the script itself says it generated: the prompt in its source, the continuation it printed.
    prompt = ast.literal_eval(re.search(r"input_ids = torch\.tensor\((\[\[.*?\]\])\)", code).group(1))
    line = next(row for row in done.stdout.splitlines() if row.startswith("continuation tokens:"))
    continuation = ast.literal_eval(line.split(":", 1)[1].strip())
    assert 1 <= len(continuation) <= 8  # max_new_tokens=8; EOS (127) may stop it earlier
    assert all(isinstance(t, int) for t in continuation)

    spans = console_spans(done.stdout)
    requests = [s for s in spans if s["name"].startswith(A.OPERATION_TEXT_COMPLETION + " ")]
    assert [s["name"] for s in requests] == ["text_completion GPT2LMHeadModel"]
    (request,) = requests
    (app,) = [s for s in spans if s["name"] == "handle_request"]
    assert app["parent_id"] is None
    assert request["parent_id"] == app["context"]["span_id"]
    assert request["context"]["trace_id"] == app["context"]["trace_id"]

    attrs = request["attributes"]
    assert attrs[A.GEN_AI_OPERATION_NAME] == "text_completion"
    assert attrs[A.GEN_AI_REQUEST_MODEL] == "GPT2LMHeadModel"
    assert attrs[A.GEN_AI_USAGE_INPUT_TOKENS] == len(prompt[0])
    assert attrs[A.GEN_AI_USAGE_OUTPUT_TOKENS] == len(continuation)
    expected_reason = "stop" if continuation[-1] == 127 else "length"
    assert attrs[A.GEN_AI_RESPONSE_FINISH_REASONS] == [expected_reason]

    # greedy, batch 1: one step per continuation token, all children of the request span
    steps = [s for s in spans if s["name"] in (A.STEP_SPAN_PREFILL, A.STEP_SPAN_DECODE)]
    assert all(s["parent_id"] == request["context"]["span_id"] for s in steps)
    steps.sort(key=lambda s: s["attributes"][A.GENERATE_STEP_INDEX])
    assert len(steps) == len(continuation) == attrs[A.GENERATE_STEPS]
    assert [s["name"] for s in steps] == ["prefill"] + ["decode"] * (len(continuation) - 1)
    assert [s["attributes"][A.GENERATE_TOKEN_INDEX] for s in steps] == list(range(len(continuation)))

    # the console exporter prints each span when it ends: children before their parent
    names = [s["name"] for s in spans]
    assert names.index(request["name"]) > max(i for i, n in enumerate(names) if n in ("prefill", "decode"))
    assert names.index("handle_request") > names.index(request["name"])


# =============================================================================================
# Links
# =============================================================================================

_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: pathlib.Path) -> set[str]:
    text = _FENCE.sub("", path.read_text())
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}


def _links(path: pathlib.Path) -> list[str]:
    return _LINK.findall(_FENCE.sub("", path.read_text()))


def test_links_are_found():
    assert "docs/contract.md" in _links(README)
    assert "images/phoenix-trace.png" in _links(ROOT / "docs" / "backends.md")
    assert "images/jaeger-trace.png" in _links(ROOT / "docs" / "backends.md")


def test_slug_matches_githubs_rule():
    assert _slug("Step-span cap (`max_step_spans`)") == "step-span-cap-max_step_spans"
    assert _slug("Correlating with your web framework's spans") == "correlating-with-your-web-frameworks-spans"


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
    """The README's Quick start ends in the full suite's command, its "Running the tests" gives the three
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
