"""README.md fits on a screen or two, and every link in it leads somewhere.

* At most 150 lines: what the package is, the two commands, what the first one prints, the quick test
  loops right below the full suite's command, the span tree, and links to docs/ for the rest.
* Every link: a relative one names a file (or folder) of the repository, and its ``#anchor`` is a heading
  of the markdown file it names (GitHub's slugs); an external one is a well-formed http(s) URL (nothing is
  fetched). Inline links, images, reference definitions, ``<...>`` autolinks and the bare URLs GitHub
  turns into links are all checked; links inside code are not links.
"""

from __future__ import annotations

import pathlib
import re
import urllib.parse

import pytest

from tests.unit.test_docs import _FENCE, README, ROOT, _anchors, code_blocks

MAX_LINES = 150

#: ``[text](target)`` or ``![alt](target)``, the target optionally in ``<...>`` and followed by a title
_INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*(<[^>]*>|[^)\s]+)(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
#: ``[label]: target`` at the start of a line: a reference definition
_DEFINITION = re.compile(r"^ {0,3}\[([^\]]+)\]:\s*(\S+)", re.M)
#: ``[text][label]`` or ``[label][]``: a use of a reference definition
_REFERENCE = re.compile(r"\[([^\[\]]+)\]\[([^\[\]]*)\]")
#: ``<https://...>``: an autolink
_AUTOLINK = re.compile(r"<((?:https?|ftp|mailto):[^>\s]*)>", re.I)
#: a bare URL GitHub links by itself, without the punctuation that ends a sentence or a parenthesis
_BARE = re.compile(r"(?<![(<\w/])https?://[^\s<>`]+", re.I)
_TRAILING = ".,:;!?*_~'\")"
_INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)


def prose(text: str) -> str:
    """``text`` without its fenced code blocks and inline code spans: what GitHub may render as links."""
    return _INLINE_CODE.sub("", _FENCE.sub("", text))


def links(text: str) -> list[str]:
    """Every link target of markdown ``text``: inline links and images, reference definitions, autolinks
    and bare URLs, in that order (a bare URL that is also an inline target is listed once)."""
    text = prose(text)
    inline = [target.strip("<>") for target in _INLINE.findall(text)]
    definitions = [target.strip("<>") for _, target in _DEFINITION.findall(text)]
    autolinks = _AUTOLINK.findall(text)
    rest = _AUTOLINK.sub("", _DEFINITION.sub("", _INLINE.sub("", text)))
    bare = [url.rstrip(_TRAILING) for url in _BARE.findall(rest)]
    return inline + definitions + autolinks + bare


def problem(page: pathlib.Path, link: str) -> str | None:
    """Why ``link`` of ``page`` leads nowhere, or None when it leads somewhere."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", link, re.I):
        parts = urllib.parse.urlsplit(link)
        if parts.scheme.lower() not in ("http", "https"):
            return f"{link}: not an http(s) link"
        try:
            parts.port  # noqa: B018 (raises on a port that is not a number in range)
        except ValueError as error:
            return f"{link}: {error}"
        host = parts.hostname or ""
        if not re.fullmatch(r"[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)*", host):
            return f"{link}: no valid host"
        if re.search(r"[\s<>\"{}|\\^`]", link):
            return f"{link}: a character a URL cannot hold"
        return None
    if link.startswith("//"):
        return f"{link}: a scheme-relative URL"
    target, _, fragment = link.partition("#")
    path = (page.parent / urllib.parse.unquote(target)).resolve() if target else page
    if ROOT.resolve() not in (path, *path.parents):
        return f"{link}: {path} is outside the repository"
    if not path.exists():
        return f"{link}: {path.relative_to(ROOT)} does not exist"
    if fragment:
        if path.suffix != ".md":
            return f"{link}: an anchor into {path.relative_to(ROOT)}, which is not markdown"
        if fragment not in _anchors(path):
            return f"{link}: {path.relative_to(ROOT)} has no heading #{fragment}"
    return None


# =============================================================================================
# The README
# =============================================================================================


def test_the_readme_fits_on_a_screen_or_two():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines, more than {MAX_LINES}"


def test_every_link_of_the_readme_leads_somewhere():
    found = links(README.read_text())
    assert len(found) >= 20, found  # the docs pages, BENCHMARKS.md and the URLs are all found
    problems = [p for p in (problem(README, link) for link in found) if p]
    assert not problems, "README.md: " + "; ".join(problems)


def test_every_reference_of_the_readme_is_defined():
    text = prose(README.read_text())
    defined = {label.lower() for label, _ in _DEFINITION.findall(text)}
    used = {(label or name).lower() for name, label in _REFERENCE.findall(text)}
    assert used <= defined, f"README.md: references without a definition: {sorted(used - defined)}"


def test_the_full_suite_and_its_quick_loops_are_one_after_the_other():
    """Command 2 (the full suite) is followed by the quick loops, with no heading between them; command 1
    runs the example under ``opentelemetry-instrument``."""
    text = README.read_text()
    blocks = code_blocks(text, "bash")
    assert "opentelemetry-instrument" in blocks[0] and "examples/app.py" in blocks[0]
    full = next(i for i, b in enumerate(blocks) if b.strip().endswith("&& python -m pytest"))
    assert blocks[full + 1].splitlines()[0].startswith("python -m pytest tests/unit")
    between = text[text.index(blocks[full]) + len(blocks[full]) : text.index(blocks[full + 1])]
    assert not re.search(r"^#", between, re.M), between
    assert re.search(r"\d+ minutes", between), f"no sentence says how long the full suite takes: {between!r}"


# =============================================================================================
# The checks themselves
# =============================================================================================


def test_links_finds_every_kind_of_link_and_none_in_code():
    text = (
        "See [the docs](docs/install.md#supported-versions), ![shot](docs/images/jaeger-trace.png) and\n"
        '[a title](BENCHMARKS.md "Benchmarks"), [ref][r], <https://example.org/a> and\n'
        "http://127.0.0.1:26006 (or http://localhost:16686).\n\n"
        "[r]: https://opentelemetry.io/docs/\n\n"
        "`[not](a-link.md)` and `http://in.code/`\n\n```bash\ncurl http://in.a.block/ [x](y.md)\n```\n"
    )
    assert links(text) == [
        "docs/install.md#supported-versions",
        "docs/images/jaeger-trace.png",
        "BENCHMARKS.md",
        "https://opentelemetry.io/docs/",
        "https://example.org/a",
        "http://127.0.0.1:26006",
        "http://localhost:16686",
    ]


@pytest.mark.parametrize(
    "link, expected",
    [
        ("docs/install.md", None),
        ("docs/install.md#supported-versions", None),
        ("docs/backends.md#without-docker-collectorlocalsh", None),
        ("#quick-start", None),
        ("collector/", None),
        ("https://github.com/open-telemetry/opentelemetry-python", None),
        ("http://127.0.0.1:26006", None),
        ("docs/no-such-page.md", "does not exist"),
        ("docs/install.md#no-such-heading", "has no heading #no-such-heading"),
        ("#no-such-heading", "has no heading"),
        ("collector/local.sh#up", "not markdown"),
        ("../outside.md", "outside the repository"),
        ("http://127.0.0.1:port/", "Port could not be cast"),
        ("https://exa mple.org/", "no valid host"),
        ("https:///path-only", "no valid host"),
        ("ftp://example.org/file", "not an http(s) link"),
    ],
)
def test_problem_tells_a_broken_link_from_a_good_one(link, expected):
    found = problem(README, link)
    if expected is None:
        assert found is None, found
    else:
        assert found is not None and expected in found, found
