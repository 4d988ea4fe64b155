"""The ``otel-generate`` command line (also ``python -m otel_generate``).

Subcommands:

* ``bench``: time ``generate()`` and (``--compare``) what the instrumentation costs; see
  :mod:`otel_generate.bench.runner`, and for its other modes :mod:`otel_generate.bench.continuous`
  and :mod:`otel_generate.bench.instructions` (:func:`run` picks the mode).

Exit status: 0 on success, 2 on invalid input (argparse's convention: the subcommand's usage and
a message on stderr, nothing written).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any, Callable, Dict, List, Optional, Sequence

from otel_generate.bench import continuous, instructions, runner, serve
from otel_generate.bench.config import (
    DEFAULT_CONCURRENCY,
    DEFAULT_RATES,
    DEFAULT_SECONDS,
    DEFAULT_SERVE_NEW_TOKENS,
    DEFAULT_SERVE_PROMPT_TOKENS,
    DEVICES,
    DTYPES,
    EXPORTERS,
    MODEL_EOS,
    SAMPLERS,
    BenchConfig,
    BenchUsageError,
)
from otel_generate.bench.instructions import CONFIGURATIONS, DEFAULT_PAIRS
from otel_generate.bench.instructions import DEFAULT_NEW_TOKENS as INSTRUCTIONS_NEW_TOKENS
from otel_generate.bench.monitor import LOAD_PER_CORE_LIMIT
from otel_generate.bench.plot import MATPLOTLIB_MISSING, PLOT_FORMATS, plot_format
from otel_generate.bench.progress import Progress, wanted
from otel_generate.options import STEP_SPAN_POLICIES

PROG = "otel-generate"

BENCH_DESCRIPTION = (
    "Time complete generate() calls (greedy, cache on, EOS off unless --eos) after warmup, count only real "
    "continuation tokens, keep every sample; every median comes with its interquartile range (IQR, 25th-75th "
    "percentile). JSON to --output; the report on stdout (on stderr when --output - puts the JSON there), "
    "progress and warnings on stderr. The load average is read before, between and after the "
    "runs; the bench warns when the load besides its own (its --threads busy threads, counted in as they enter "
    f"the 1-minute average) was above {LOAD_PER_CORE_LIMIT} per core, and records every reading in the "
    "JSON under 'load'."
)


# --------------------------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``bench`` subcommand's options."""
    parser.add_argument(
        "--device",
        choices=DEVICES,
        default="cpu",
        help="where to run: cpu, cuda, or auto (cuda if available, else cpu); default cpu",
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--model",
        metavar="PATH",
        help="local checkpoint directory (from_pretrained, local files only); "
        "default: a small random-weight GPT-2-architecture model built locally",
    )
    source.add_argument(
        "--model-config",
        metavar="PATH",
        help="random-weight model of this transformers config.json (a file or a directory "
        "holding one), initialised on the device; nothing is downloaded",
    )
    parser.add_argument(
        "--prompt-tokens",
        type=int,
        default=None,
        metavar="N",
        help=f"prompt length in tokens (default 4; with --serve {DEFAULT_SERVE_PROMPT_TOKENS})",
    )
    parser.add_argument(
        "--new-tokens",
        type=int,
        default=None,
        metavar="N",
        help=f"max_new_tokens (default 8; with --instructions 128; with --serve {DEFAULT_SERVE_NEW_TOKENS})",
    )
    parser.add_argument(
        "--batch-size", type=int, default=1, metavar="N", help="prompts per generate() call (default 1)"
    )
    parser.add_argument("--warmup", type=int, default=2, metavar="N", help="unmeasured runs first (default 2)")
    parser.add_argument(
        "--runs",
        type=int,
        default=5,
        metavar="N",
        help="measured runs (default 5); with --compare also the number of A/B pairs",
    )
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="model dtype (default float32)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        metavar="N",
        help="torch CPU threads, torch.set_num_threads (default 1); also the bench's own "
        "share of the load average when it judges whether the machine was busy",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights and the prompt (default 0)")
    parser.add_argument(
        "--eos",
        nargs="?",
        const=MODEL_EOS,
        default=None,
        metavar="TOKEN_ID",
        help="let EOS stop generation: the model's EOS id, or TOKEN_ID if given "
        "(default: EOS disabled, every run generates --new-tokens tokens)",
    )
    parser.add_argument("--output", metavar="PATH", help="write the JSON result here ('-' for stdout)")
    parser.add_argument(
        "--plot",
        metavar="PATH",
        help="write the per-token latency of the measured runs (median and interquartile band "
        f"per token index, prefill marked) in the format of the extension: "
        f"{', '.join('.' + e for e in PLOT_FORMATS)} (needs matplotlib)",
    )
    parser.add_argument(
        "--compare",
        action="store_true",
        help="also time plain vs instrumented generate(), interleaved A B A B, --runs pairs; "
        "the work each instrumented call defers (span export, metric collection) is "
        "finished outside the timers and reported both apart and charged to that call; the report ends with "
        "one conclusion: the added time per decode step and the ratio, each with a confidence interval",
    )
    parser.add_argument(
        "--show-per-run",
        action="store_true",
        help="--compare: the report also shows the pairs whose instrumented runs each instrument() before and "
        "uninstrument() after (every call the first after instrument(); they always run and are in the JSON); "
        "by default it shows the steady state, the instrumentor set up once and kept",
    )
    parser.add_argument(
        "--exporter",
        choices=EXPORTERS,
        default="discard",
        help="--compare's (and --continuous-batching's, --serve --in-process's) exporter: discard (count spans and "
        "drop them, default) "
        "or otlp-encode "
        "(encode every span batch and metric collection as OTLP protobuf, as a real OTLP "
        "exporter does, count the bytes and drop them)",
    )
    parser.add_argument(
        "--max-step-spans",
        type=int,
        default=None,
        metavar="N",
        help="--compare, --continuous-batching, --serve: instrument(max_step_spans=N), at most N step spans "
        "per request (0: none); default: the instrumentation's own (OTEL_GENERATE_MAX_STEP_SPANS or 1024)",
    )
    parser.add_argument(
        "--step-spans",
        choices=STEP_SPAN_POLICIES,
        default=None,
        help="--compare, --continuous-batching, --serve: instrument(step_spans=...), which requests get step spans; "
        "default: the instrumentation's own (OTEL_GENERATE_STEP_SPANS or all)",
    )
    parser.add_argument(
        "--background-emission",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="--compare: instrument(background_emission=True) (the default: spans built on a worker thread; the "
        "flush after each instrumented call, outside its timer, waits for them and is charged to it) or, with "
        "--no-background-emission, False (built on the caller's thread); default: the instrumentation's own",
    )
    parser.add_argument(
        "--sampler",
        choices=SAMPLERS,
        default="always_on",
        help="--compare, --continuous-batching: the instrumented side's trace sampler; always_off makes "
        "every request unsampled "
        "(no span; its metrics are still recorded), to time what an unsampled request costs (default always_on)",
    )
    parser.add_argument(
        "--continuous-batching",
        action="store_true",
        help="time transformers' continuous batching instead: waves of --requests requests on one "
        "persistent manager, plain and instrumented interleaved A B A B (--runs pairs); "
        "throughput and the added cost per batch step (transformers 5.17 or newer); with --serve: the server "
        "batches continuously",
    )
    parser.add_argument(
        "--instructions",
        action="store_true",
        help="count instructions instead of time: valgrind's callgrind, a process per configuration and thread "
        "view, --pairs pairs of a plain call (instrumentation suppressed) and an instrumented call in it, the "
        "caller's thread and all threads apart; BLAS/OpenMP on one thread; needs valgrind",
    )
    parser.add_argument(
        "--pairs",
        type=int,
        default=None,
        metavar="N",
        help=f"--instructions: pairs of a plain and an instrumented call counted per configuration "
        f"(default {DEFAULT_PAIRS})",
    )
    parser.add_argument(
        "--configurations",
        metavar="NAMES",
        default=None,
        help="--instructions: comma-separated, from " + ", ".join(CONFIGURATIONS) + " (default all)",
    )
    parser.add_argument(
        "--requests",
        type=int,
        default=None,
        metavar="N",
        help="--continuous-batching: requests per run, submitted at once (default 16)",
    )
    parser.add_argument(
        "--serve",
        action="store_true",
        help="time a server under load instead: transformers serve (with --continuous-batching: continuous "
        "batching) under opentelemetry-instrument, streaming requests over HTTP, plain and instrumented rounds "
        "interleaved (--runs pairs per offered load, a fresh server each round): tokens/s, requests/s, time to "
        "first token and inter-token latency (p50, p99), requests dropped by the emitter, the emitter thread's CPU",
    )
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="--serve: the same load into one ContinuousBatchingManager in a process of its own per round, no "
        "HTTP (less noise); the instrumented side's exporter is --exporter",
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        default=None,
        metavar="N",
        help=f"--serve: requests always in flight at saturation, and in a warmup wave (default {DEFAULT_CONCURRENCY})",
    )
    parser.add_argument(
        "--seconds",
        type=float,
        default=None,
        metavar="S",
        help=f"--serve: the measured window of each round, seconds (default {DEFAULT_SECONDS:g})",
    )
    parser.add_argument(
        "--rates",
        metavar="LIST",
        default=None,
        help="--serve: the Poisson rates offered after saturation, comma-separated: fractions of the first plain "
        f"round's saturation requests/s (0.7), requests per second (20/s), or none (default {DEFAULT_RATES})",
    )
    shown = parser.add_mutually_exclusive_group()
    shown.add_argument(
        "--progress",
        action="store_true",
        help="show progress on stderr (the phase, runs done of the total, the time left) even when stderr is "
        "not a terminal; on a terminal it is shown without this option",
    )
    shown.add_argument(
        "--quiet",
        action="store_true",
        help="show no progress (warnings, such as a busy machine, and the report are still printed)",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="check the options and print what would run, then exit: no model is built, nothing is timed "
        "or counted, no device, valgrind or OpenTelemetry SDK is looked for",
    )


def config_from_args(args: argparse.Namespace, argv: Sequence[str] = ()) -> BenchConfig:
    return BenchConfig(
        device=args.device,
        model=args.model,
        model_config=args.model_config,
        prompt_tokens=args.prompt_tokens
        if args.prompt_tokens is not None
        else (DEFAULT_SERVE_PROMPT_TOKENS if args.serve else 4),
        new_tokens=args.new_tokens
        if args.new_tokens is not None
        else (INSTRUCTIONS_NEW_TOKENS if args.instructions else DEFAULT_SERVE_NEW_TOKENS if args.serve else 8),
        batch_size=args.batch_size,
        warmup=args.warmup,
        runs=args.runs,
        dtype=args.dtype,
        threads=args.threads,
        seed=args.seed,
        eos=args.eos,
        output=args.output,
        plot=args.plot,
        compare=args.compare,
        exporter=args.exporter,
        max_step_spans=args.max_step_spans,
        step_spans=args.step_spans,
        background_emission=args.background_emission,
        sampler=args.sampler,
        show_per_run=args.show_per_run,
        continuous_batching=args.continuous_batching,
        requests=args.requests,
        instructions=args.instructions,
        pairs=args.pairs if args.pairs is not None else DEFAULT_PAIRS,
        configurations=args.configurations,
        serve=args.serve,
        in_process=args.in_process,
        concurrency=args.concurrency,
        seconds=args.seconds,
        rates=args.rates,
        argv=list(argv),
    )


# --------------------------------------------------------------------------------------------
# Summary and output
# --------------------------------------------------------------------------------------------


def summary_text(result: Dict[str, Any], show_per_run: bool = False) -> str:
    """The report: every median with its interquartile range (with ``--compare``, ending with its
    conclusion). ``show_per_run``: ``--show-per-run``.

    Each mode writes its own: :func:`otel_generate.bench.runner.summary_text` (``generate()``,
    ``--compare``), :func:`otel_generate.bench.continuous.summary_text`,
    :func:`otel_generate.bench.instructions.summary_text`.
    """
    if result.get("mode") == "serve":
        return serve.summary_text(result)
    if result.get("mode") == "instructions":
        return instructions.summary_text(result)
    if result.get("mode") == "continuous_batching":
        return continuous.summary_text(result)
    return runner.summary_text(result, per_run=show_per_run)


def run(config: BenchConfig, progress: Optional[Progress] = None) -> Dict[str, Any]:
    """The result document of the mode ``config`` asks for (nothing is written here):
    :func:`otel_generate.bench.continuous.run` (``--continuous-batching``),
    :func:`otel_generate.bench.instructions.run` (``--instructions``), else
    :func:`otel_generate.bench.runner.run` (``generate()``, ``--compare``). ``progress`` shows how far it is.

    Raises:
        BenchUsageError: invalid input, before anything runs.
    """
    if config.serve:
        return serve.run(config, progress=progress)
    if config.continuous_batching:
        return continuous.run(config, progress=progress)
    if config.instructions:
        return instructions.run(config, progress=progress)
    return runner.run(config, progress=progress)


def plan_text(config: BenchConfig) -> str:
    """``--dry-run``: check the options as the mode would before it starts (not the machine: no device,
    valgrind or SDK is looked for) and say what would run.

    Raises:
        BenchUsageError: invalid input.
    """
    config.validate()
    if config.instructions:
        instructions.validate(config, check_tools=False)
        names = config.configurations.split(",")
        processes = len(names) * len(instructions.THREAD_VIEWS)
        what = (
            f"--instructions: {processes} processes under callgrind ({', '.join(names)}; the caller's thread and "
            f"all threads apart), {config.pairs} pairs of a plain and an instrumented call each after "
            f"{config.warmup} warmup pairs"
        )
    elif config.serve:
        what = serve.plan_text(config)
    elif config.continuous_batching:
        what = (
            f"--continuous-batching: {config.warmup} warmup and {config.runs} measured pairs of waves of "
            f"{config.requests} requests ({2 * (config.warmup + config.runs)} waves)"
        )
    else:
        what = (
            f"{config.warmup} warmup and {config.runs} measured runs"
            + (f", then --compare: 2 x ({config.warmup} + {config.runs}) pairs" if config.compare else "")
            + f" ({runner.runs_in_all(config)} generate() calls)"
        )
    model = config.model or config.model_config or ("the built tiny Llama" if config.serve else "the built tiny GPT-2")
    return (
        f"otel-generate bench --dry-run: the options are valid; nothing was run\n"
        f"  {what}\n"
        f"  device {config.device}, model {model}, {config.dtype}, prompt {config.prompt_tokens} x batch "
        f"{config.batch_size}, {config.new_tokens} new tokens"
    )


def _write_atomically(path: str, write: Callable[[str], None]) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    suffix = os.path.splitext(path)[1]
    fd, tmp = tempfile.mkstemp(prefix=".otel-generate-", suffix=suffix, dir=directory)
    os.close(fd)
    try:
        write(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; give the file the usual permissions
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def main_bench(config: BenchConfig, stdout: Any = None, stderr: Any = None, progress: Optional[Progress] = None) -> int:
    """Run, then write ``--plot`` and ``--output`` (each atomically), the warnings on stderr and the
    report on stdout (on stderr when ``--output -`` writes the JSON to stdout). What was written
    where is said on stderr. ``progress`` (default: none shown) is ended before the report is printed.

    Returns 0. Raises :class:`~otel_generate.bench.config.BenchUsageError` on invalid input,
    before anything is written.
    """
    stdout = stdout if stdout is not None else sys.stdout
    stderr = stderr if stderr is not None else sys.stderr
    try:
        result = run(config, progress)
    finally:
        if progress is not None:
            progress.close()
    text = json.dumps(result, indent=2)
    if config.plot is not None:
        from otel_generate.bench.plot import plot_latencies

        fmt = plot_format(config.plot)
        try:
            _write_atomically(config.plot, lambda tmp: plot_latencies(result, tmp, fmt))
        except ImportError:
            raise BenchUsageError(MATPLOTLIB_MISSING) from None
    if config.output == "-":
        stdout.write(text + "\n")
        stdout.flush()
    elif config.output is not None:

        def write_json(tmp: str) -> None:
            with open(tmp, "w", encoding="utf-8") as handle:
                handle.write(text + "\n")

        _write_atomically(config.output, write_json)
    for warning in result.get("warnings", []):
        print(f"WARNING: {warning}", file=stderr)
    stderr.flush()
    report = stderr if config.output == "-" else stdout
    print(summary_text(result, config.show_per_run), file=report)
    report.flush()
    if config.plot is not None:
        print(f"  plot written to {config.plot}", file=stderr)
    if config.output not in (None, "-"):
        print(f"  JSON written to {config.output}", file=stderr)
    return 0


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def build_parser(commands_from: Sequence[Callable[[Any], None]] = ()) -> argparse.ArgumentParser:
    """The ``otel-generate`` parser with its subcommands: ``bench``, then each of ``commands_from``
    (a function that adds its subcommand to the ``add_subparsers()`` object it is given)."""
    from otel_generate.version import __version__

    parser = argparse.ArgumentParser(
        prog=PROG,
        description="OpenTelemetry instrumentation for transformers generate(): tools.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True
    bench_parser = commands.add_parser(
        "bench",
        help="time generate() on a device (tokens/s, TTFT, TPOT); --compare: the instrumentation's cost",
        description=BENCH_DESCRIPTION,
    )
    add_arguments(bench_parser)
    bench_parser.set_defaults(handler=_bench, command_parser=bench_parser)
    for add in commands_from:
        add(commands)
    return parser


def _bench(args: argparse.Namespace, argv: List[str]) -> int:
    try:
        config = config_from_args(args, argv)
        if args.dry_run:
            print(plan_text(config))
            return 0
        return main_bench(config, progress=Progress(enabled=wanted(args.progress, args.quiet)))
    except BenchUsageError as exc:
        # usage + "otel-generate bench: error: ..." on stderr, SystemExit(2), as argparse does
        args.command_parser.error(str(exc))
        return 2  # pragma: no cover


def main(argv: Optional[Sequence[str]] = None, commands_from: Sequence[Callable[[Any], None]] = ()) -> int:
    """Run ``otel-generate`` with ``argv`` (default ``sys.argv[1:]``); return the exit status.
    ``commands_from``: more subcommands (:func:`build_parser`; the console script adds ``doctor``).

    An argument the subcommand does not know is reported with the subcommand's own usage
    (``usage: otel-generate bench ...``), not the top-level one.
    """
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(commands_from)
    try:
        args, unknown = parser.parse_known_args(args_list)
        if unknown:
            args.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        return int(args.handler(args, [PROG] + args_list))
    except SystemExit as exc:  # argparse errors (2), --help / --version (0)
        code = exc.code
        if code is None:
            return 0
        return code if isinstance(code, int) else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
