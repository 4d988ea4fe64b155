"""The benchmark tool, ``otel-generate bench``: a package of its own, apart from the instrumentation.

* :mod:`otel_generate.bench.cli`: the ``otel-generate`` command line (also ``python -m otel_generate``);
* :mod:`otel_generate.bench.harness`: configuration, the measured runs, ``--compare``, the result document;
* :mod:`otel_generate.bench.models`: small random-weight models and local checkpoints (nothing downloaded);
* :mod:`otel_generate.bench.stats`: samples, medians and interquartile ranges;
* :mod:`otel_generate.bench.plot`: the per-token latency plot.

The bench imports the instrumentation core (``otel_generate``); the core never imports the bench.
Importing this package imports nothing else.
"""
