"""``python -m otel_generate bench ...``: the same as the ``otel-generate`` console script."""

import sys

from otel_generate.bench.cli import main

sys.exit(main())
