"""Version of the ``otel_generate`` package."""

__version__ = "0.1.0"
