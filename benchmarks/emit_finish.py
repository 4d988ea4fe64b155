"""Instructions per request of the emitter: ``emit.finish`` for one hand-built request (no model).

A request of 128 one-token steps (ends jittered, 4 input and 128 output tokens) is started with
``emit.start_request_span`` and finished with ``emit.finish`` N times after 3 warm-up requests,
on an SDK ``TracerProvider`` with a ``SimpleSpanProcessor`` and a discarding exporter (no
background thread) and an SDK ``MeterProvider`` with an ``InMemoryMetricReader``. Configurations:
``all`` (sampled, every step a span), ``none`` (sampled, ``step_spans="none"``: the request span,
no step span) and ``unsampled`` (``ALWAYS_OFF``: the metrics only).

    PYTHONPATH=. python benchmarks/emit_finish.py --callgrind 20 120   # from a checkout's root

runs this script under valgrind's callgrind with N = 20 and N = 120 requests per configuration
and prints ``(Ir(120) - Ir(20)) / 100`` (the whole process is counted: set-up cancels out in the
difference; Python's garbage collector makes it vary by a few thousand instructions). It imports
the ``otel_generate`` found first: ``PYTHONPATH=.`` makes that the checkout's (an editable install
elsewhere would otherwise win). It also runs on the tree before ``otel_generate.telemetry``
existed, to compare before and after.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

CONFIGURATIONS = ("all", "none", "unsampled")
STEPS = 128


def _telemetry(options):
    try:
        from otel_generate.telemetry import Telemetry
    except ImportError:  # the tree before issue 16: the context was built field by field, in emit
        from otel_generate.emit import Telemetry, create_instruments, get_tracer

        return Telemetry(
            tracer=get_tracer(options.tracer_provider),
            instruments=create_instruments(options.meter_provider),
            synchronize=options.synchronize,
            max_step_spans=options.max_step_spans,
            skip_candidate_calls=False,
            profilers=lambda: (),
            options=options,
        )
    return Telemetry.from_options(options, profilers=lambda: ())


def run(config: str, n: int) -> None:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON

    from otel_generate import emit
    from otel_generate.options import Options
    from otel_generate.request import Request

    class Discard(SpanExporter):
        def export(self, spans):
            return SpanExportResult.SUCCESS

    tracer_provider = TracerProvider(sampler=ALWAYS_OFF if config == "unsampled" else ALWAYS_ON)
    tracer_provider.add_span_processor(SimpleSpanProcessor(Discard()))
    meter_provider = MeterProvider(metric_readers=[InMemoryMetricReader()])
    options = Options(
        tracer_provider=tracer_provider,
        meter_provider=meter_provider,
        step_spans="none" if config == "none" else "all",
    )
    telemetry = _telemetry(options)

    def request() -> Request:
        r = Request(model="m", start_ns=1000, start_wall_ns=1_700_000_000_000_000_000)
        r.step_ends_ns = [1000 + 1_000_000 + i * 200_000 + (i * 7919) % 5000 for i in range(STEPS)]
        r.step_tokens = [1] * STEPS
        r.end_ns = r.step_ends_ns[-1] + 100
        r.input_tokens, r.output_tokens, r.output_tokens_per_sequence = 4, STEPS, [STEPS]
        r.finish_reasons = ["length"]
        return r

    for _ in range(3 + n):  # 3 warm-up requests: aggregations created, fast paths checked
        emit.finish(telemetry, emit.start_request_span(telemetry, "m"), request())


def instructions(config: str, n: int, folder: str) -> int:
    log = os.path.join(folder, f"{config}.{n}.log")
    subprocess.run(
        [
            "valgrind",
            "--tool=callgrind",
            f"--callgrind-out-file={os.path.join(folder, 'callgrind.out')}",
            f"--log-file={log}",
            sys.executable,
            os.path.abspath(__file__),
            "--run",
            config,
            str(n),
        ],
        check=True,
        env={**os.environ, "PYTHONHASHSEED": "0", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"},
    )
    with open(log) as file:
        return int(re.search(r"Collected : (\d+)", file.read()).group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--callgrind", nargs=2, type=int, metavar=("N1", "N2"), default=(20, 120))
    parser.add_argument("--configurations", default=",".join(CONFIGURATIONS))
    parser.add_argument("--run", nargs=2, metavar=("CONFIG", "N"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        run(args.run[0], int(args.run[1]))
        return
    low, high = args.callgrind
    with tempfile.TemporaryDirectory() as folder:
        for config in args.configurations.split(","):
            added = (instructions(config, high, folder) - instructions(config, low, folder)) / (high - low)
            print(f"{config:10} {added:12,.0f} instructions per request")


if __name__ == "__main__":
    main()
