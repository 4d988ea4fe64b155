"""The bench's configuration: what to run (:class:`BenchConfig`), its checks, and the error they raise.

Errors: invalid input raises :class:`BenchUsageError` (a ``ValueError``); the CLI turns it into
a message on stderr and exit status 2, before anything is written.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, List, Optional

from otel_generate.bench.plot import MATPLOTLIB_MISSING, PLOT_FORMATS, plot_format
from otel_generate.options import STEP_SPAN_POLICIES

DEVICES = ("cpu", "cuda", "auto")
DTYPES = ("float32", "float16", "bfloat16")
#: ``--exporter``: ``discard`` counts spans and drops them; ``otlp-encode`` encodes each batch as
#: an OTLP protobuf request (what a real OTLP exporter sends), counts the bytes, drops them.
EXPORTERS = ("discard", "otlp-encode")
#: ``--eos`` given without a value: use the model's own EOS id.
MODEL_EOS = "model"

#: ``--step-spans``: the instrumentation's step-span policies (otel_generate.options).
#: --sampler: the instrumented side's TracerProvider sampler (always_off: every request unsampled)
SAMPLERS = ("always_on", "always_off")
#: Default ``--requests`` of ``--continuous-batching``.
DEFAULT_REQUESTS = 16
#: ``--serve``'s defaults: requests in flight at saturation, seconds per window, offered rates.
DEFAULT_CONCURRENCY = 16
DEFAULT_SECONDS = 15.0
DEFAULT_RATES = "0.5,0.7"
#: ``--serve``'s default prompt and new tokens (``--prompt-tokens``, ``--new-tokens`` not given).
DEFAULT_SERVE_PROMPT_TOKENS = 8
DEFAULT_SERVE_NEW_TOKENS = 32


class BenchUsageError(ValueError):
    """Invalid bench input (a count, a length, a device, a path). The CLI exits with status 2."""


@dataclass
class BenchConfig:
    """What to run. Lengths are in tokens; see :func:`otel_generate.bench.cli.add_arguments` for each option."""

    device: str = "cpu"
    model: Optional[str] = None
    model_config: Optional[str] = None
    prompt_tokens: int = 4
    new_tokens: int = 8
    batch_size: int = 1
    warmup: int = 2
    runs: int = 5
    dtype: str = "float32"
    threads: int = 1
    seed: int = 0
    eos: Optional[str] = None  # None: EOS disabled; MODEL_EOS: the model's EOS; else an int id as text
    output: Optional[str] = None
    plot: Optional[str] = None
    compare: bool = False
    exporter: str = "discard"  # --compare's span exporter, one of EXPORTERS
    max_step_spans: Optional[int] = None  # --compare: instrument(max_step_spans=N); None: the instrumentation's default
    step_spans: Optional[str] = None  # --compare: instrument(step_spans=...); None: the instrumentation's default
    background_emission: Optional[bool] = None  # --compare: instrument(background_emission=...); None: its default
    sampler: str = "always_on"  # --compare: the TracerProvider's sampler, one of SAMPLERS
    show_per_run: bool = False  # --compare: the report also shows the pairs that instrument() around each run
    continuous_batching: bool = False  # the continuous-batching workload (otel_generate.bench.continuous)
    requests: Optional[int] = None  # --continuous-batching: requests per run (None: the default, 16)
    instructions: bool = False  # count instructions under callgrind (otel_generate.bench.instructions)
    pairs: int = 10  # --instructions: pairs of a plain and an instrumented call counted per configuration
    configurations: Optional[str] = None  # --instructions: comma-separated names (None: all)
    serve: bool = False  # a server under load (otel_generate.bench.serve)
    in_process: bool = False  # --serve: one ContinuousBatchingManager in a process per round, no HTTP
    concurrency: Optional[int] = None  # --serve: requests in flight at saturation (None: 16)
    seconds: Optional[float] = None  # --serve: the measured window of each round (None: 15)
    rates: Optional[str] = None  # --serve: the offered rates after saturation (None: "0.5,0.7")
    argv: List[str] = field(default_factory=list)

    def validate(self) -> None:
        """Check everything that can be checked before a model exists.

        Raises:
            BenchUsageError: naming the first problem found.
        """
        if self.runs < 1:
            raise BenchUsageError(f"--runs must be at least 1, got {self.runs}")
        if self.warmup < 0:
            raise BenchUsageError(f"--warmup must be 0 or more, got {self.warmup}")
        if self.new_tokens < 1:
            raise BenchUsageError(f"--new-tokens must be at least 1, got {self.new_tokens}")
        if self.prompt_tokens < 1:
            raise BenchUsageError(f"--prompt-tokens must be at least 1, got {self.prompt_tokens}")
        if self.batch_size < 1:
            raise BenchUsageError(f"--batch-size must be at least 1, got {self.batch_size}")
        if self.threads < 1:
            raise BenchUsageError(f"--threads must be at least 1, got {self.threads}")
        if self.device not in DEVICES:
            raise BenchUsageError(f"--device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.dtype not in DTYPES:
            raise BenchUsageError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.eos not in (None, MODEL_EOS):
            try:
                if int(self.eos) < 0:
                    raise ValueError
            except ValueError:
                raise BenchUsageError(f"--eos takes a non-negative token id (or nothing), got {self.eos!r}") from None
        if self.model is not None and self.model_config is not None:
            raise BenchUsageError("give --model or --model-config, not both")
        if self.model is not None and not os.path.isdir(self.model):
            raise BenchUsageError(f"--model {self.model!r} does not exist or is not a directory")
        if self.model_config is not None and not os.path.exists(self.model_config):
            raise BenchUsageError(f"--model-config {self.model_config!r} does not exist")
        if self.exporter not in EXPORTERS:
            raise BenchUsageError(f"--exporter must be one of {', '.join(EXPORTERS)}, got {self.exporter!r}")
        if self.max_step_spans is not None and self.max_step_spans < 0:
            raise BenchUsageError(f"--max-step-spans must be 0 or more, got {self.max_step_spans}")
        self._validate_serve()
        if self.continuous_batching and not self.serve:
            if self.requests is None:
                self.requests = DEFAULT_REQUESTS
            if self.requests < 1:
                raise BenchUsageError(f"--requests must be at least 1, got {self.requests}")
            if self.batch_size != 1:
                raise BenchUsageError(
                    "--batch-size does not apply to --continuous-batching (each request is one prompt); use --requests"
                )
            if self.plot is not None:
                raise BenchUsageError("--plot does not apply to --continuous-batching")
            require_module(
                "opentelemetry.sdk",
                "--continuous-batching needs the OpenTelemetry SDK: pip install "
                "opentelemetry-sdk (the package's [bench] extra)",
            )
        elif self.requests is not None:
            raise BenchUsageError("--requests applies to --continuous-batching; add --continuous-batching")
        if not self.compare and not self.continuous_batching and not self.instructions and not self.serve:
            if self.exporter != "discard":
                raise BenchUsageError("--exporter applies to the instrumented runs of --compare; add --compare")
            if self.max_step_spans is not None:
                raise BenchUsageError("--max-step-spans applies to the instrumented runs of --compare; add --compare")
            if self.step_spans is not None:
                raise BenchUsageError("--step-spans applies to the instrumented runs of --compare; add --compare")
            if self.background_emission is not None:
                raise BenchUsageError(
                    "--background-emission/--no-background-emission applies to the instrumented runs of --compare; "
                    "add --compare"
                )
            if self.sampler != "always_on":
                raise BenchUsageError("--sampler applies to the instrumented runs of --compare; add --compare")
        if self.show_per_run and not self.compare:
            raise BenchUsageError("--show-per-run shows pairs of --compare; add --compare")
        if self.sampler not in SAMPLERS:
            raise BenchUsageError(f"--sampler must be one of {', '.join(SAMPLERS)}, got {self.sampler!r}")
        if self.step_spans is not None and self.step_spans not in STEP_SPAN_POLICIES:
            raise BenchUsageError(
                f"--step-spans must be one of {', '.join(STEP_SPAN_POLICIES)}, got {self.step_spans!r}"
            )
        for option, path in (("--output", self.output), ("--plot", self.plot)):
            if path is None or path == "-" and option == "--output":
                continue
            if path == "-":
                raise BenchUsageError("--plot needs a file path, not '-'")
            parent = os.path.dirname(os.path.abspath(path))
            if not os.path.isdir(parent):
                raise BenchUsageError(f"{option} {path!r}: directory {parent!r} does not exist")
            if os.path.isdir(path):
                raise BenchUsageError(f"{option} {path!r} is a directory")
        if self.plot is not None:
            if plot_format(self.plot) is None:
                raise BenchUsageError(
                    f"--plot {self.plot!r}: unsupported file extension; use one of "
                    f".{', .'.join(PLOT_FORMATS)} (the file is written in the format its extension names)"
                )
            try:
                import matplotlib  # noqa: F401
            except ImportError:
                raise BenchUsageError(MATPLOTLIB_MISSING) from None
        if self.compare:
            require_module(
                "opentelemetry.sdk",
                "--compare needs the OpenTelemetry SDK: pip install opentelemetry-sdk (the package's [bench] extra)",
            )
        if self.exporter == "otlp-encode":
            require_module(
                "opentelemetry.exporter.otlp.proto.common",
                "--exporter otlp-encode needs opentelemetry-exporter-otlp-proto-common (the package's [bench] extra)",
            )

    def _validate_serve(self) -> None:
        """``--serve``'s options, and its options without it (see :mod:`otel_generate.bench.serve`)."""
        if not self.serve:
            for option, given in (
                ("--in-process", self.in_process),
                ("--concurrency", self.concurrency is not None),
                ("--seconds", self.seconds is not None),
                ("--rates", self.rates is not None),
            ):
                if given:
                    raise BenchUsageError(f"{option} applies to --serve; add --serve")
            return
        if self.compare or self.instructions:
            raise BenchUsageError(
                f"--serve is a mode of its own; drop {'--compare' if self.compare else '--instructions'}"
            )
        if self.batch_size != 1:
            raise BenchUsageError(
                "--batch-size does not apply to --serve (each request is one prompt); use --concurrency"
            )
        if self.requests is not None:
            raise BenchUsageError(
                "--requests applies to --continuous-batching's waves; --serve keeps --concurrency requests in flight"
            )
        if self.concurrency is None:
            self.concurrency = DEFAULT_CONCURRENCY
        if self.concurrency < 1:
            raise BenchUsageError(f"--concurrency must be at least 1, got {self.concurrency}")
        if self.seconds is None:
            self.seconds = DEFAULT_SECONDS
        if not (self.seconds > 0 and self.seconds < float("inf")):
            raise BenchUsageError(f"--seconds must be above 0, got {self.seconds}")
        if self.rates is None:
            self.rates = DEFAULT_RATES
        if not self.in_process and self.exporter != "discard":
            raise BenchUsageError(
                "--exporter applies to --serve --in-process; over HTTP the servers export OTLP/HTTP to a local sink"
            )


def require_module(module: str, message: str) -> None:
    import importlib

    try:
        importlib.import_module(module)
    except ImportError:
        raise BenchUsageError(message) from None


def resolve_device(requested: str) -> str:
    """``cpu`` -> ``cpu``; ``cuda`` -> ``cuda`` if available; ``auto`` -> ``cuda`` if available, else ``cpu``.

    ``cpu`` touches no CUDA function at all.

    Raises:
        BenchUsageError: ``cuda`` requested and ``torch.cuda.is_available()`` is false.
    """
    if requested == "cpu":
        return "cpu"
    import torch

    available = torch.cuda.is_available()
    if requested == "cuda" and not available:
        raise BenchUsageError("CUDA was requested but is not available (torch.cuda.is_available() is False)")
    return "cuda" if available else "cpu"


def torch_dtype(name: str) -> Any:
    """``"float32"`` / ``"float16"`` / ``"bfloat16"`` -> the ``torch.dtype``."""
    import torch

    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[name]
