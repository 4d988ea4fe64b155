"""A process that exits right after ``generate()`` delivers every request the background emitter still
held, whether its tracer provider was set before ``instrument()`` or after it (its exit-time shutdown
is then registered after the emitter's drain, and ``atexit`` runs the last registered first)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
    from otel_generate import GenerateInstrumentor
    from otel_generate.bench.models import build_model

    class Lines(SpanExporter):  # one JSON line per span on stdout, as it is exported
        def export(self, spans):
            for span in spans:
                print(json.dumps({"name": span.name}), flush=True)
            return SpanExportResult.SUCCESS

    def provider():
        made = TracerProvider()
        made.add_span_processor(SimpleSpanProcessor(Lines()))
        trace.set_tracer_provider(made)

    if sys.argv[1] == "before":
        provider()
        GenerateInstrumentor().instrument()
    else:
        GenerateInstrumentor().instrument()
        if sys.argv[1] == "after, emitter busy":  # a long request's emission still running
            import time
            GenerateInstrumentor().telemetry.emitter.submit(lambda: time.sleep(0.5))
            time.sleep(0.05)
        provider()
    model = build_model("gpt2", seed=0)
    ids = torch.randint(1, 100, (1, 4), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, eos_token_id=None)
    print(json.dumps({"generated": 3}), flush=True)
    if sys.argv[1] == "after, emitter busy":  # the provider's own flush drains what generate() handed over
        print(json.dumps({"flushed": trace.get_tracer_provider().force_flush()}), flush=True)
    # no flush, no shutdown: the interpreter's exit handlers deliver what is still queued
    """
)


def _json_or_none(line: str):
    """The script's JSON lines; None for anything else it printed (transformers 4.46 prints dicts too)."""
    try:
        return json.loads(line)
    except ValueError:
        return None


@pytest.mark.parametrize("provider_set", ["before", "after", "after, emitter busy"])
def test_exit_delivers_what_the_emitter_still_held(provider_set):
    done = subprocess.run([sys.executable, "-c", SCRIPT, provider_set], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in map(_json_or_none, done.stdout.splitlines()) if isinstance(line, dict)]
    if provider_set == "after, emitter busy":  # every span out before force_flush() returned True
        flushed = next(i for i, line in enumerate(lines) if "flushed" in line)
        assert lines[flushed]["flushed"] is True
        lines = lines[:flushed]
    names = [line["name"] for line in lines if "name" in line]
    assert names.count("text_completion GPT2LMHeadModel") == 3, names
    assert names.count("prefill") == 3 and names.count("decode") == 3 * 5
    assert "Traceback" not in done.stderr
