"""examples/app.py: built model by default, a local checkpoint with --model PATH, clear errors."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
import torch

from otel_generate.bench.models import build_model

ROOT = pathlib.Path(__file__).resolve().parents[2]
APP = ROOT / "examples" / "app.py"


def run_app(*args):
    return subprocess.run([sys.executable, str(APP), *args], capture_output=True, text=True, timeout=300, cwd=str(ROOT))


@pytest.mark.parametrize("architecture", ["llama", "gpt2"])  # gpt2: transformers 5 finds an empty tokenizer
def test_app_loads_a_local_checkpoint_with_from_pretrained(tmp_path, architecture):
    model = build_model(architecture, seed=3)
    model.save_pretrained(tmp_path)
    done = run_app("--model", str(tmp_path), "--new-tokens", "4", "--prompt-tokens", "3", "--seed", "1")
    assert done.returncode == 0, done.stderr
    line = next(row for row in done.stdout.splitlines() if row.startswith("continuation tokens:"))
    printed = eval(line.split(":", 1)[1])  # a Python list literal of ints

    # the same generation done here on the same saved weights
    torch.manual_seed(1)
    ids = torch.randint(1, model.config.vocab_size - 1, (1, 3))
    expected = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False, eos_token_id=None
    )
    assert printed == expected[0, 3:].tolist()
    assert "time to first token:" in done.stdout and "time per output token:" in done.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "/nonexistent/checkpoint"], "does not exist"),
        (["--new-tokens", "0"], "must be at least 1"),
    ],
)
def test_app_bad_input_is_a_clear_error(args, message):
    done = run_app(*args)
    assert done.returncode == 2
    assert message in done.stderr
    assert "Traceback" not in done.stderr
