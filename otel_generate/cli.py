"""The ``otel-generate`` command line (also ``python -m otel_generate``).

Subcommands:

* ``bench``: time ``generate()`` and (``--compare``) what the instrumentation costs; see
  :mod:`otel_generate.bench`.

Exit status: 0 on success, 2 on invalid input (argparse's convention: usage and a message on
stderr, nothing written).
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional, Sequence

PROG = "otel-generate"


def build_parser() -> argparse.ArgumentParser:
    """The ``otel-generate`` parser with its subcommands."""
    from otel_generate import bench
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
        description=(
            "Time complete generate() calls (greedy, cache on, EOS off unless --eos) after warmup, "
            "count only real continuation tokens, keep every sample. JSON to --output, summary on stderr."
        ),
    )
    bench.add_arguments(bench_parser)
    bench_parser.set_defaults(handler=_bench, command_parser=bench_parser)
    return parser


def _bench(args: argparse.Namespace, argv: List[str]) -> int:
    from otel_generate import bench

    try:
        return bench.main_bench(bench.config_from_args(args, argv))
    except bench.BenchUsageError as exc:
        # usage + "otel-generate bench: error: ..." on stderr, SystemExit(2), as argparse does
        args.command_parser.error(str(exc))
        return 2  # pragma: no cover


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``otel-generate`` with ``argv`` (default ``sys.argv[1:]``); return the exit status."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args = parser.parse_args(args_list)
        return int(args.handler(args, [PROG] + args_list))
    except SystemExit as exc:  # argparse errors (2), --help / --version (0)
        code = exc.code
        if code is None:
            return 0
        return code if isinstance(code, int) else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
