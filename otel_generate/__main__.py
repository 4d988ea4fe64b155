"""``python -m otel_generate bench ...`` / ``doctor``: the same as the ``otel-generate`` console script."""

import sys

from otel_generate.cli import main

sys.exit(main())
