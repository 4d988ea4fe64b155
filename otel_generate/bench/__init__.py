"""The benchmark tool, ``otel-generate bench``: a package of its own, apart from the instrumentation.

* :mod:`otel_generate.bench.cli`: the ``otel-generate`` command line (also ``python -m otel_generate``),
  and :func:`~otel_generate.bench.cli.run`, which picks the mode;
* :mod:`otel_generate.bench.runner`: the ``generate()`` bench (measured runs, ``--compare``, the result
  document, its report and the conclusion of ``--compare``);
* :mod:`otel_generate.bench.continuous`: ``--continuous-batching``;
  :mod:`otel_generate.bench.instructions`: ``--instructions`` (callgrind);
* :mod:`otel_generate.bench.serve`: ``--serve``, a server under load: over HTTP
  (:mod:`otel_generate.bench.serve_http`: ``transformers serve``, its OTLP sink
  :mod:`otel_generate.bench.sink`, the load generator) or in-process
  (:mod:`otel_generate.bench.serve_child`, a process per round); the offered loads and what a window
  measured in :mod:`otel_generate.bench.load`, CPU time from ``/proc`` in :mod:`otel_generate.bench.procstat`;
* :mod:`otel_generate.bench.common`: what the ``generate()`` and continuous-batching benches share (the
  instrumented side, the A/B loop, the paired figures, the frame of the result document);
* :mod:`otel_generate.bench.config`: :class:`~otel_generate.bench.config.BenchConfig`, its checks and
  :class:`~otel_generate.bench.config.BenchUsageError`;
* :mod:`otel_generate.bench.workload`: the model on its device, its prompt and the one timed call;
* :mod:`otel_generate.bench.models`: small random-weight models and local checkpoints (nothing downloaded),
  also the tests' builder;
* :mod:`otel_generate.bench.environment`, :mod:`otel_generate.bench.monitor`: versions and machine, the
  load monitor;
* :mod:`otel_generate.bench.exporters`: the instrumented side's counting (and OTLP-encoding) exporters;
* :mod:`otel_generate.bench.stats`: samples, medians and interquartile ranges;
* :mod:`otel_generate.bench.plot`: the per-token latency plot.

The bench imports the instrumentation core: the package (``GenerateInstrumentor``,
``TokenLatencyProfiler``), ``otel_generate.clock``, ``.stats``, ``.tokens``, ``.options`` and
``.version``, and the instrumentor's patch table (``missing_hooks``, whether continuous batching
can be instrumented: :func:`otel_generate.bench.continuous.check_supported`); it imports no
integration, and the core never imports the bench. Within the bench,
imports run one way: config, models, environment, monitor, stats, plot, procstat, sink → workload,
exporters, load → common, serve_http → runner, continuous, instructions (and its child process,
instructions_child), serve_child → serve → cli.
Importing this package imports nothing else.
"""
