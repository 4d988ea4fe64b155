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
    import json, sys, threading
    import torch
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
    from otel_generate import GenerateInstrumentor
    from otel_generate.bench.models import build_model

    # one JSON line per span, as it is exported, in a file of its own: the emitter's thread and the
    # caller's write to it under one lock, and nothing else (transformers' own prints) reaches it
    out, lock = open(sys.argv[2], "a", encoding="utf-8"), threading.Lock()

    def line(record):
        with lock:
            out.write(json.dumps(record) + "\\n")
            out.flush()

    class Lines(SpanExporter):
        def export(self, spans):
            for span in spans:
                line({"name": span.name})
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
    line({"generated": 3})
    if sys.argv[1] == "after, emitter busy":  # the provider's own flush drains what generate() handed over
        line({"flushed": trace.get_tracer_provider().force_flush()})
    # no flush, no shutdown: the interpreter's exit handlers deliver what is still queued
    """
)


@pytest.mark.parametrize("provider_set", ["before", "after", "after, emitter busy"])
def test_exit_delivers_what_the_emitter_still_held(provider_set, tmp_path):
    out = tmp_path / "spans.jsonl"
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, provider_set, str(out)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    if provider_set == "after, emitter busy":  # every span out before force_flush() returned True
        flushed = next(i for i, line in enumerate(lines) if "flushed" in line)
        assert lines[flushed]["flushed"] is True
        lines = lines[:flushed]
    names = [line["name"] for line in lines if "name" in line]
    assert names.count("text_completion GPT2LMHeadModel") == 3, names
    assert names.count("prefill") == 3 and names.count("decode") == 3 * 5
    assert "Traceback" not in done.stderr


EVENT_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    from opentelemetry import _logs
    from opentelemetry.sdk._logs import LoggerProvider
    from opentelemetry.sdk._logs.export import BatchLogRecordProcessor, LogExporter
    try:
        from opentelemetry.sdk._logs.export import LogExportResult
    except ImportError:  # (the name on the newest SDK)
        from opentelemetry.sdk._logs.export import LogRecordExportResult as LogExportResult
    from otel_generate import GenerateInstrumentor
    from otel_generate.bench.models import build_model

    class Lines(LogExporter):
        def export(self, batch):
            with open(sys.argv[1], "a", encoding="utf-8") as out:
                for item in batch:
                    record = getattr(item, "log_record", item)
                    out.write(json.dumps({"event": record.event_name,
                                          "output_tokens": record.attributes["gen_ai.usage.output_tokens"]}) + "\\n")
            return LogExportResult.SUCCESS

        def shutdown(self):
            pass

        def force_flush(self, timeout_millis=30_000):
            return True

    provider = LoggerProvider()  # exports only when flushed: its batch schedule is a day
    provider.add_log_record_processor(BatchLogRecordProcessor(Lines(), schedule_delay_millis=86_400_000))
    _logs.set_logger_provider(provider)
    GenerateInstrumentor().instrument(capture_message_content="EVENT_ONLY")
    model = build_model("gpt2", seed=0)
    ids = torch.randint(1, 100, (1, 4), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, eos_token_id=None)
    # no flush: the interpreter's exit handlers deliver the events still queued
    """
)


def test_exit_delivers_every_content_event_the_emitter_still_held(tmp_path):
    out = tmp_path / "events.jsonl"
    done = subprocess.run([sys.executable, "-c", EVENT_SCRIPT, str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    events = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert events == [{"event": "gen_ai.client.inference.operation.details", "output_tokens": 6}] * 3
