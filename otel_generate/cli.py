"""The ``otel-generate`` command (also ``python -m otel_generate``): ``bench`` and ``doctor``.

``bench`` (:mod:`otel_generate.bench.cli`) times ``generate()`` and the instrumentation's cost;
``doctor`` (:mod:`otel_generate.doctor`) checks what the instrumentation can trace here. Each
subcommand imports what it needs when it runs: ``otel-generate bench`` loads the bench and the core,
never the integrations.
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run ``otel-generate`` with ``argv`` (default ``sys.argv[1:]``); return the exit status."""
    from otel_generate import doctor
    from otel_generate.bench import cli as bench_cli

    return bench_cli.main(argv, commands_from=(doctor.add_parser,))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
