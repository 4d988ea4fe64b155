"""Instructions to start one request span: the SDK's ``start_span`` against ``FastRequestSpans.start``.

    python benchmarks/callgrind_request_span.py

For each of ``public`` (``tracer.start_span(name, kind=INTERNAL, attributes=...)``) and ``fast``
(:class:`otel_generate.fast_request_span.FastRequestSpans`), with ``ALWAYS_ON`` (a recording
span) and ``ALWAYS_OFF`` (not recorded): an SDK ``TracerProvider`` with a ``BatchSpanProcessor``
and an in-memory exporter, the request span's name and its four start attributes, 5 warm-up
starts, then 10 starts each entered through ``operator.call`` under callgrind
(``--toggle-collect=_operator_call``), garbage collection off. Prints instructions per start. One
process per case. Needs valgrind on Linux.
"""

from __future__ import annotations

import gc
import operator
import os
import re
import subprocess
import sys
import tempfile

CASES = [(path, sampler) for sampler in ("on", "off") for path in ("public", "fast")]
STARTS = 10


def child(path: str, sampler: str) -> None:
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider, sampling
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from otel_generate.fast_request_span import FastRequestSpans

    provider = TracerProvider(sampler=sampling.ALWAYS_ON if sampler == "on" else sampling.ALWAYS_OFF)
    provider.add_span_processor(BatchSpanProcessor(InMemorySpanExporter()))
    tracer = provider.get_tracer("otel_generate")
    fast = FastRequestSpans.for_tracer(tracer)
    if fast is None:
        raise SystemExit("the fast path is not available with this SDK")
    name = "text_completion tiny-gpt2"
    attributes = {
        "gen_ai.operation.name": "text_completion",
        "gen_ai.provider.name": "transformers",
        "gen_ai.request.model": "tiny-gpt2",
        "gen_ai.response.model": "tiny-gpt2",
    }
    if path == "public":

        def start():
            return tracer.start_span(name, kind=trace.SpanKind.INTERNAL, attributes=attributes)

    else:

        def start():
            return fast.start(name, attributes)

    kept = [start() for _ in range(5)]
    gc.collect()
    gc.disable()
    kept += [operator.call(start) for _ in range(STARTS)]


def count(path: str, sampler: str) -> float:
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "callgrind.out")
        subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                "--collect-atstart=no",
                "--toggle-collect=_operator_call",
                f"--callgrind-out-file={out}",
                sys.executable,
                os.path.abspath(__file__),
                "--child",
                path,
                sampler,
            ],
            check=True,
            capture_output=True,
            env=dict(os.environ, PYTHONHASHSEED="0"),
        )
        with open(out, encoding="utf-8", errors="replace") as handle:
            found = re.search(r"^(?:summary|totals): (\d+)", handle.read(), re.M)
    if found is None:
        raise SystemExit("callgrind wrote no total")
    return int(found.group(1)) / STARTS


def main() -> int:
    if sys.argv[1:2] == ["--child"]:
        child(sys.argv[2], sys.argv[3])
        return 0
    if len(sys.argv) != 1:
        raise SystemExit("usage: callgrind_request_span.py")
    for path, sampler in CASES:
        print(f"{path:6s} ALWAYS_{sampler.upper():3s} {count(path, sampler):>10,.0f} instructions per start")
    return 0


if __name__ == "__main__":
    sys.exit(main())
