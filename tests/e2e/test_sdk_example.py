"""The minimal SDK example of docs/configuration.md, run as written in a subprocess, prints its span tree."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys

from otel_generate import attributes as A
from tests.helpers import console_spans
from tests.unit.test_docs import SDK_EXAMPLE_PAGE, code_blocks


def test_the_minimal_sdk_example_prints_its_span_tree(tmp_path):
    (code,) = code_blocks(SDK_EXAMPLE_PAGE.read_text(), "python")
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

    # the console exporter prints each span when it ends: the steps before their request span (both built
    # on the background emitter; the application's span, ended on its own thread, may come before or after)
    names = [s["name"] for s in spans]
    assert names.index(request["name"]) > max(i for i, n in enumerate(names) if n in ("prefill", "decode"))
