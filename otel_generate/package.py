"""Libraries this instrumentation instruments, as ``BaseInstrumentor`` checks them.

``opentelemetry-instrument`` compares these requirement strings with what is installed
before it calls :meth:`otel_generate.GenerateInstrumentor.instrument`; a missing or too old
transformers or torch turns the instrumentor off with a log line instead of failing the app.
"""

_instruments = ("transformers >= 4.46", "torch >= 2.1")

_supports_metrics = True
