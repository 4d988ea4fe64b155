"""The bench harness: configuration, the measured runs, ``--compare``, and the result document.

``otel-generate bench`` times ``generate()`` on a device and keeps every sample:

* the model is built (or loaded) and placed on the device **before** warmup; warmup runs are
  not measured;
* each measured run times one complete ``generate()`` call (prompt processing plus
  continuation) with :func:`otel_generate.clock.timed_call`: synchronize, read the clock, call,
  synchronize, read the clock (``time.perf_counter``, seconds);
* greedy decoding, KV cache on, an explicit attention mask, EOS disabled unless ``--eos``;
* new tokens are counted from the returned tensor with
  :func:`otel_generate.tokens.count_new_tokens` (per sequence, minus the prompt, up to and
  including the first EOS, never padding), so a model that stops early reports its real count;
* time to first token and time per output token come from the instrumentation itself
  (:class:`otel_generate.TokenLatencyProfiler` around the measured runs: the per-step hook is
  on in those runs, so they are *profiled* runs, not plain ones);
* every median comes with its interquartile range (:mod:`otel_generate.bench.stats`);
* the machine's load average is read before, between and after the runs, and a busy machine
  is reported (:class:`LoadMonitor`).

``--compare`` measures the instrumentation's cost in runs of its own: plain ``generate()``
(the original ``GenerationMixin.generate``, uninstrumented) and instrumented ``generate()``
(SDK ``TracerProvider`` with a ``BatchSpanProcessor`` and the ``--exporter``, SDK
``MeterProvider``) run interleaved A B A B on the same inputs. After each instrumented call the
work it deferred (the span processor's export, the metric collection) is finished outside any
timer and charged to that call, so it reports two paired ratios: the caller-visible one and
the one including deferred work.

A workload is a :class:`_Runner`: a model, its inputs and the one call each run times. The
continuous-batching workload (``--continuous-batching --requests N``: waves of requests on one
persistent manager, plain and instrumented interleaved) is :mod:`otel_generate.bench.continuous`.

Units: ``*_s`` keys are seconds, ``*_ms`` milliseconds, ``*_us`` microseconds.

Errors: invalid input raises :class:`BenchUsageError` (a ``ValueError``); the CLI turns it into
a message on stderr and exit status 2, before anything is written.
"""

from __future__ import annotations

import datetime as _dt
import gc
import json
import math
import os
import platform
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from otel_generate.bench.plot import MATPLOTLIB_MISSING, PLOT_FORMATS, plot_format
from otel_generate.bench.stats import iqr_of, make_sample, median_of, summarize
from otel_generate.clock import synchronizer_for, timed_call
from otel_generate.tokens import count_new_tokens

DEVICES = ("cpu", "cuda", "auto")
DTYPES = ("float32", "float16", "bfloat16")
#: ``--exporter``: ``discard`` counts spans and drops them; ``otlp-encode`` encodes each batch as
#: an OTLP protobuf request (what a real OTLP exporter sends), counts the bytes, drops them.
EXPORTERS = ("discard", "otlp-encode")
#: ``--eos`` given without a value: use the model's own EOS id.
MODEL_EOS = "model"
#: A load average above this many runnable tasks per core (besides the bench's own) is "busy".
LOAD_PER_CORE_LIMIT = 0.5

#: Keys every bench JSON document has (``samples`` entries have at least :data:`SAMPLE_KEYS`).
RESULT_KEYS = (
    "versions",
    "device",
    "dtype",
    "parameters",
    "prompt_tokens",
    "new_tokens_requested",
    "batch_size",
    "warmup",
    "runs",
    "threads",
    "samples",
    "median_elapsed_s",
    "median_tokens_per_s",
    "median_time_to_first_token_ms",
    "median_time_per_output_token_ms",
)
#: The interquartile range of each median in :data:`RESULT_KEYS`: ``[25th, 75th percentile]``, same unit.
IQR_KEYS = (
    "iqr_elapsed_s",
    "iqr_tokens_per_s",
    "iqr_time_to_first_token_ms",
    "iqr_time_per_output_token_ms",
)
SAMPLE_KEYS = ("elapsed_s", "new_tokens", "tokens_per_s")
VERSION_KEYS = ("python", "torch", "transformers", "otel_generate")

MEASURED_RUNS = (
    "profiled runs: generate() inside a TokenLatencyProfiler, so the instrumentation's per-step hook "
    "(and its device synchronization) is on; spans only if a global SDK tracer provider is set"
)


#: ``--step-spans``: the instrumentation's step-span policies (otel_generate.options).
STEP_SPAN_POLICIES = ("all", "none", "slow")
#: --sampler: the instrumented side's TracerProvider sampler (always_off: every request unsampled)
SAMPLERS = ("always_on", "always_off")


class BenchUsageError(ValueError):
    """Invalid bench input (a count, a length, a device, a path). The CLI exits with status 2."""


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


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
    background_emission: bool = False  # --compare: instrument(background_emission=True)
    sampler: str = "always_on"  # --compare: the TracerProvider's sampler, one of SAMPLERS
    continuous_batching: bool = False  # the continuous-batching workload (otel_generate.bench.continuous)
    requests: Optional[int] = None  # --continuous-batching: requests per run (None: the default, 16)
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
        if self.continuous_batching:
            if self.requests is None:
                from otel_generate.bench.continuous import DEFAULT_REQUESTS

                self.requests = DEFAULT_REQUESTS
            if self.requests < 1:
                raise BenchUsageError(f"--requests must be at least 1, got {self.requests}")
            if self.batch_size != 1:
                raise BenchUsageError(
                    "--batch-size does not apply to --continuous-batching (each request is one prompt); use --requests"
                )
            if self.plot is not None:
                raise BenchUsageError("--plot does not apply to --continuous-batching")
            _require(
                "opentelemetry.sdk",
                "--continuous-batching needs the OpenTelemetry SDK: pip install "
                "opentelemetry-sdk (the package's [bench] extra)",
            )
        elif self.requests is not None:
            raise BenchUsageError("--requests applies to --continuous-batching; add --continuous-batching")
        if not self.compare and not self.continuous_batching:
            if self.exporter != "discard":
                raise BenchUsageError("--exporter applies to the instrumented runs of --compare; add --compare")
            if self.max_step_spans is not None:
                raise BenchUsageError("--max-step-spans applies to the instrumented runs of --compare; add --compare")
            if self.step_spans is not None:
                raise BenchUsageError("--step-spans applies to the instrumented runs of --compare; add --compare")
            if self.background_emission:
                raise BenchUsageError(
                    "--background-emission applies to the instrumented runs of --compare; add --compare"
                )
            if self.sampler != "always_on":
                raise BenchUsageError("--sampler applies to the instrumented runs of --compare; add --compare")
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
            _require(
                "opentelemetry.sdk",
                "--compare needs the OpenTelemetry SDK: pip install opentelemetry-sdk (the package's [bench] extra)",
            )
        if self.exporter == "otlp-encode":
            _require(
                "opentelemetry.exporter.otlp.proto.common",
                "--exporter otlp-encode needs opentelemetry-exporter-otlp-proto-common (the package's [bench] extra)",
            )


def _require(module: str, message: str) -> None:
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


# --------------------------------------------------------------------------------------------
# Model and inputs
# --------------------------------------------------------------------------------------------


def _text_config(model: Any) -> Any:
    config = model.config
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


def max_positions(model: Any) -> Optional[int]:
    """The model's position limit in tokens (``max_position_embeddings``/``n_positions``), or ``None``."""
    config = _text_config(model)
    for name in ("max_position_embeddings", "n_positions", "max_target_positions"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_lengths(prompt_tokens: int, new_tokens: int, positions: Optional[int]) -> None:
    """Refuse lengths the model cannot hold.

    The decoder sees ``prompt_tokens + new_tokens - 1`` positions (the last new token is never
    fed back), so that must not exceed ``positions``.

    Raises:
        BenchUsageError: ``prompt_tokens`` or ``new_tokens`` below 1, a prompt longer than the
            model's positions, or prompt plus continuation beyond them.
    """
    if prompt_tokens < 1:
        raise BenchUsageError(f"--prompt-tokens must be at least 1, got {prompt_tokens}")
    if new_tokens < 1:
        raise BenchUsageError(f"--new-tokens must be at least 1, got {new_tokens}")
    if positions is None:
        return
    if prompt_tokens > positions:
        raise BenchUsageError(f"--prompt-tokens {prompt_tokens} is longer than the model's {positions} positions")
    if prompt_tokens + new_tokens - 1 > positions:
        raise BenchUsageError(
            f"--prompt-tokens {prompt_tokens} plus --new-tokens {new_tokens} need {prompt_tokens + new_tokens - 1} "
            f"positions; the model has {positions}"
        )


def build_bench_model(config: BenchConfig, device: str) -> Any:
    """Build or load the model and place it on ``device`` in ``config.dtype`` (eval mode).

    * default: :func:`otel_generate.bench.models.build_model` ("gpt2", random weights, seeded);
    * ``--model PATH``: :func:`otel_generate.bench.models.load_model` (local checkpoint directory);
    * ``--model-config PATH``: random weights for a transformers ``config.json`` (a file, or a
      directory holding one), initialised directly on the device.
    """
    import torch

    from otel_generate.bench.models import build_model, dtype_keyword, load_model

    dtype = torch_dtype(config.dtype)
    if config.model is not None:
        model, _ = load_model(config.model, dtype=dtype)
        return model.to(device)
    if config.model_config is not None:
        import transformers

        path = config.model_config
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        try:
            with open(path, encoding="utf-8") as handle:
                data = json.load(handle)
            model_type = data.pop("model_type")
        except (OSError, ValueError, KeyError) as exc:
            raise BenchUsageError(
                f"--model-config {config.model_config!r}: not a transformers config.json ({exc})"
            ) from None
        model_config = transformers.AutoConfig.for_model(model_type, **data)
        cls = (
            transformers.AutoModelForSeq2SeqLM
            if getattr(model_config, "is_encoder_decoder", False)
            else transformers.AutoModelForCausalLM
        )
        torch.manual_seed(config.seed)
        with torch.device(device):
            model = cls.from_config(model_config, **{dtype_keyword(): dtype})
        return model.to(device=device, dtype=dtype).eval()
    model = build_model("gpt2", seed=config.seed)
    return model.to(device=device, dtype=dtype)


def model_description(config: BenchConfig, model: Any) -> str:
    if config.model is not None:
        return config.model
    kind = type(model).__name__
    source = f"config {config.model_config}" if config.model_config is not None else "built locally"
    return f"{kind} (random weights, seed {config.seed}, {source})"


def _as_ids(value: Any) -> List[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def special_token_ids(model: Any) -> List[int]:
    """EOS, BOS and padding ids of the model's generation config and config."""
    ids = set()
    for source in (getattr(model, "generation_config", None), _text_config(model)):
        for name in ("eos_token_id", "bos_token_id", "pad_token_id", "decoder_start_token_id"):
            ids.update(_as_ids(getattr(source, name, None)))
    return sorted(ids)


def make_inputs(
    model: Any, batch_size: int, prompt_tokens: int, seed: int, avoid: Sequence[int] = ()
) -> Dict[str, Any]:
    """A random prompt of ``(batch_size, prompt_tokens)`` ids and its all-ones attention mask.

    Ids are drawn with ``torch.Generator().manual_seed(seed)`` from the model's vocabulary minus
    its special tokens (EOS, BOS, padding) and ``avoid``; the tensors are on the model's device.
    """
    import torch

    vocab = int(model.get_input_embeddings().num_embeddings)
    excluded = set(special_token_ids(model)) | {int(i) for i in avoid}
    allowed = torch.tensor([i for i in range(vocab) if i not in excluded], dtype=torch.long)
    if allowed.numel() == 0:
        raise BenchUsageError("the model's vocabulary holds only special tokens; cannot build a prompt")
    generator = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, allowed.numel(), (batch_size, prompt_tokens), generator=generator)
    input_ids = allowed[picks].to(model.device)
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}


def resolve_eos(config: BenchConfig, model: Any) -> Optional[List[int]]:
    """The EOS ids that may stop generation: ``None`` (disabled, the default), the model's, or ``--eos ID``.

    Raises:
        BenchUsageError: ``--eos`` without an id for a model that has no EOS token, or an id
            outside the vocabulary.
    """
    if config.eos is None:
        return None
    vocab = int(model.get_input_embeddings().num_embeddings)
    if config.eos == MODEL_EOS:
        ids = _as_ids(getattr(model.generation_config, "eos_token_id", None))
        if not ids:
            raise BenchUsageError("--eos: the model has no EOS token id; give one, e.g. --eos 2")
        return ids
    token = int(config.eos)
    if token >= vocab:
        raise BenchUsageError(f"--eos {token} is outside the model's vocabulary (0..{vocab - 1})")
    return [token]


def generate_kwargs(model: Any, new_tokens: int, eos: Optional[List[int]]) -> Dict[str, Any]:
    """Keywords of every timed ``generate()``: greedy, cache on, EOS only when asked for."""
    kwargs: Dict[str, Any] = {
        "max_new_tokens": new_tokens,
        "do_sample": False,
        "num_beams": 1,
        "use_cache": True,
        "eos_token_id": eos,
    }
    pad = getattr(model.generation_config, "pad_token_id", None)
    if pad is None and eos:
        pad = eos[0]
    if pad is not None:
        kwargs["pad_token_id"] = pad
    return kwargs


def prompt_width(model: Any, inputs: Dict[str, Any]) -> int:
    """Leading positions of the output that were not generated (decoder start token for encoder-decoders)."""
    if getattr(model.config, "is_encoder_decoder", False):
        return 1
    return int(inputs["input_ids"].shape[-1])


def _sequences(output: Any) -> Any:
    return output if hasattr(output, "dim") else output.sequences


# --------------------------------------------------------------------------------------------
# Environment
# --------------------------------------------------------------------------------------------


def versions() -> Dict[str, str]:
    """Versions of Python, torch, transformers, otel_generate and the OpenTelemetry SDK (if installed)."""
    import torch
    import transformers

    from otel_generate.version import __version__

    found = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "otel_generate": __version__,
    }
    try:
        from importlib.metadata import version

        found["opentelemetry_sdk"] = version("opentelemetry-sdk")
    except Exception:
        pass
    return found


def cpu_model() -> str:
    """The CPU's ``model name`` from ``/proc/cpuinfo``, else ``platform.processor()``."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(device: str) -> Dict[str, Any]:
    """Host facts; the GPU's name only when running on CUDA (the CPU path calls no CUDA function)."""
    info: Dict[str, Any] = {
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "nproc": os.cpu_count(),
    }
    if device == "cuda":
        import torch

        info["gpu"] = torch.cuda.get_device_name(torch.cuda.current_device())
    return info


def process_age_s() -> Optional[float]:
    """Seconds since this process started (``/proc/self/stat`` and ``/proc/uptime``); ``None`` where unknown."""
    try:
        with open("/proc/self/stat", encoding="utf-8") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime", encoding="utf-8") as handle:
            uptime = float(handle.read().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))  # field 22: starttime, in ticks
    except (OSError, ValueError, IndexError, AttributeError):
        return None


class LoadMonitor:
    """Readings of the machine's load average during a bench, and whether it was busy.

    Each :meth:`read` takes ``os.getloadavg()`` (the 1-, 5- and 15-minute averages of runnable
    and uninterruptible tasks, machine-wide). The bench reads it before the model is built,
    after the warmup, after every measured run and every ``--compare`` pair (outside the
    timers), and at the end.

    The bench's own threads count too: while it runs, it keeps up to ``own_threads`` threads
    runnable (``--threads``, the torch threads; the span processor's thread works while the
    calling thread waits for it). The 1-minute average approaches a constant load ``n`` as
    ``n (1 - exp(-t / 60 s))`` after ``t`` seconds, so each reading subtracts that estimate,
    with ``t`` the age of this process (the bench counts as busy from its start; from the first
    reading where ``/proc`` is missing). The machine was **busy** when, at any reading, the load
    left, divided by the number of cores (``os.cpu_count()``), was above
    :data:`LOAD_PER_CORE_LIMIT` (0.5). The 1-minute average lags: a neighbour that starts
    seconds before the end shows up only in part. Where ``os.getloadavg`` does not exist, there
    are no readings and no verdict.
    """

    def __init__(self, own_threads: int, cores: Optional[int] = None, clock: Callable[[], float] = time.monotonic):
        self.own_threads = int(own_threads)
        self.cores = int(cores or os.cpu_count() or 1)
        self.clock = clock
        age = process_age_s()
        self.age_from = "process start" if age is not None else "first reading"
        self._origin = clock() - (age or 0.0)
        self.readings: List[Dict[str, Any]] = []

    def read(self, at: str) -> None:
        """Take one reading, labelled ``at`` (e.g. ``"start"``, ``"run 3"``, ``"pair 7"``, ``"end"``)."""
        try:
            one, five, fifteen = os.getloadavg()
        except (AttributeError, OSError):
            return
        busy_s = self.clock() - self._origin
        own = self.own_threads * (1.0 - math.exp(-busy_s / 60.0))
        self.readings.append(
            {
                "at": at,
                "bench_age_s": busy_s,
                "load_1m": one,
                "load_5m": five,
                "load_15m": fifteen,
                "own_estimate": own,
                "other_per_core": max(0.0, one - own) / self.cores,
            }
        )

    def report(self) -> Dict[str, Any]:
        """The ``load`` section of the JSON: every reading, the worst one and the verdict."""
        worst = max(self.readings, key=lambda r: r["other_per_core"], default=None)
        busy = None if worst is None else worst["other_per_core"] > LOAD_PER_CORE_LIMIT
        warning = None
        if busy:
            warning = (
                f"the machine was busy: 1-minute load average {worst['load_1m']:.2f} at {worst['at']} on "
                f"{self.cores} core(s) is {worst['other_per_core']:.2f} per core besides this bench's own "
                f"(estimated {worst['own_estimate']:.2f}), above {LOAD_PER_CORE_LIMIT} per core; "
                f"the timings are likely noisy, rerun on a quiet machine"
            )
        return {
            "source": "os.getloadavg() (1-, 5-, 15-minute averages), read outside the timers",
            "cores": self.cores,
            "limit_per_core": LOAD_PER_CORE_LIMIT,
            "own_threads": self.own_threads,
            "own_estimate_formula": f"own_threads * (1 - exp(-t / 60 s)), t = seconds since {self.age_from}",
            "readings": list(self.readings),
            "max_other_per_core": None if worst is None else worst["other_per_core"],
            "busy": busy,
            "warning": warning,
        }


# --------------------------------------------------------------------------------------------
# The runs
# --------------------------------------------------------------------------------------------


class _Runner:
    """The model, its inputs and the one ``generate()`` call every run makes."""

    def __init__(self, config: BenchConfig, device: str, clock: Callable[[], float] = time.perf_counter) -> None:
        self.config = config
        self.device = device
        self.clock = clock
        self.model = build_bench_model(config, device)
        check_lengths(config.prompt_tokens, config.new_tokens, max_positions(self.model))
        self.eos = resolve_eos(config, self.model)
        self.inputs = make_inputs(self.model, config.batch_size, config.prompt_tokens, config.seed)
        self.kwargs = generate_kwargs(self.model, config.new_tokens, self.eos)
        self.pad = self.kwargs.get("pad_token_id")
        self.width = prompt_width(self.model, self.inputs)
        self.synchronize = synchronizer_for(device)

    def generate(self) -> Any:
        return self.model.generate(**self.inputs, **self.kwargs)

    def timed(self) -> Tuple[Any, float]:
        """One complete ``generate()`` between two synchronized clock reads: ``(output, seconds)``."""
        return timed_call(self.generate, self.synchronize, clock=self.clock)

    def counts(self, output: Any) -> List[int]:
        """Real new tokens per returned sequence (minus prompt, up to the first EOS, never padding)."""
        return count_new_tokens(_sequences(output), self.width, self.eos, self.pad)


def _flush_global_tracer_provider() -> None:
    """Finish the span export a global SDK tracer provider deferred (e.g. under ``opentelemetry-instrument``)."""
    from opentelemetry import trace

    flush = getattr(trace.get_tracer_provider(), "force_flush", None)
    if callable(flush):
        flush()


def measure(runner: _Runner, monitor: Optional[LoadMonitor] = None) -> List[Dict[str, Any]]:
    """Warmup, then ``runs`` measured runs under a :class:`~otel_generate.TokenLatencyProfiler`.

    These are *profiled* runs (:data:`MEASURED_RUNS`), the ones the headline medians describe.
    After each run, outside the timer, a global SDK tracer provider (if one is set) is flushed
    so that no span export lands in the next run's timer, and ``monitor`` reads the load.

    Returns one sample per measured run: :func:`~otel_generate.bench.stats.make_sample` plus the
    instrumentation's ``time_to_first_token_ms``, ``time_per_output_token_ms``,
    ``step_latencies_ms`` and ``step_tokens`` (milliseconds; tokens per sequence each step appended).
    """
    from otel_generate import TokenLatencyProfiler

    config = runner.config
    samples: List[Dict[str, Any]] = []
    with TokenLatencyProfiler() as profiler:
        for _ in range(config.warmup):
            runner.generate()
        _flush_global_tracer_provider()
        if monitor is not None:
            monitor.read("after warmup")
        for run in range(config.runs):
            before = len(profiler.records)
            gc.collect()
            output, elapsed = runner.timed()
            _flush_global_tracer_provider()
            sample = make_sample(elapsed, runner.counts(output))
            new_records = profiler.records[before:]
            record = new_records[-1] if new_records else None
            if record is not None:
                sample["time_to_first_token_ms"] = _ms(record.time_to_first_token_s)
                sample["time_per_output_token_ms"] = _ms(record.time_per_output_token_s)
                sample["step_latencies_ms"] = [lat * 1e3 for lat in record.step_latencies_s]
                sample["step_tokens"] = list(record.step_tokens)
            else:  # the instrumentation did not see the call (should not happen)
                sample["time_to_first_token_ms"] = None
                sample["time_per_output_token_ms"] = None
                sample["step_latencies_ms"] = []
                sample["step_tokens"] = []
            samples.append(sample)
            if monitor is not None:
                monitor.read(f"run {run + 1}")
    return samples


def _ms(seconds: Optional[float]) -> Optional[float]:
    return None if seconds is None else seconds * 1e3


# --------------------------------------------------------------------------------------------
# --compare: exporters, deferred work, paired ratios
# --------------------------------------------------------------------------------------------


def encode_spans_request(spans: Sequence[Any]) -> Any:
    """The OTLP ``ExportTraceServiceRequest`` a real OTLP exporter would send for ``spans``.

    opentelemetry-exporter-otlp-proto-common's ``encode_spans``, the encoder of the SDK's OTLP
    gRPC and HTTP span exporters.
    """
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    return encode_spans(spans)


def encode_metrics_request(data: Any) -> Any:
    """The OTLP ``ExportMetricsServiceRequest`` for ``data`` (``encode_metrics`` of the same package)."""
    from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics

    return encode_metrics(data)


def make_exporters(kind: str) -> Tuple[Any, Any]:
    """``(span exporter, metric reader)`` for ``--exporter kind`` (see :data:`EXPORTERS`).

    * ``discard``: the span exporter counts spans (``.spans``) and drops them; the metrics go
      to an SDK ``InMemoryMetricReader`` (collected, never encoded). ``.bytes`` is ``None``.
    * ``otlp-encode``: the span exporter encodes each batch with :func:`encode_spans_request`,
      serializes it (``SerializeToString``), adds its length to ``.bytes`` and its span count
      to ``.spans``, and drops the bytes; the metrics go to a ``PeriodicExportingMetricReader``
      (no timer thread: collected on flush) whose exporter does the same with
      :func:`encode_metrics_request` (``.bytes`` of the metric exporter, ``reader.exporter``).
      What is left out is only the network.

    Raises:
        ValueError: an unknown ``kind``.
    """
    from opentelemetry.sdk.metrics.export import (
        InMemoryMetricReader,
        MetricExporter,
        MetricExportResult,
        PeriodicExportingMetricReader,
    )
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    if kind not in EXPORTERS:
        raise ValueError(f"unknown exporter {kind!r}; expected one of {', '.join(EXPORTERS)}")
    encode = kind == "otlp-encode"

    class BenchSpanExporter(SpanExporter):
        """Counts the spans (and, encoding, the OTLP bytes) it receives and drops them."""

        def __init__(self) -> None:
            self.spans = 0
            self.bytes: Optional[int] = 0 if encode else None

        def export(self, spans: Sequence[Any]) -> Any:
            if encode:
                self.bytes += len(encode_spans_request(spans).SerializeToString())
            self.spans += len(spans)
            return SpanExportResult.SUCCESS

        def shutdown(self) -> None:
            pass

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            return True

    if not encode:
        return BenchSpanExporter(), InMemoryMetricReader()

    class EncodingMetricExporter(MetricExporter):
        """Encodes each metrics export as OTLP protobuf, counts the bytes and drops them."""

        def __init__(self) -> None:
            super().__init__()  # cumulative temporality, as the in-memory reader of ``discard`` collects
            self.bytes = 0

        def export(self, metrics_data: Any, timeout_millis: float = 10_000, **kwargs: Any) -> Any:
            self.bytes += len(encode_metrics_request(metrics_data).SerializeToString())
            return MetricExportResult.SUCCESS

        def force_flush(self, timeout_millis: float = 10_000) -> bool:
            return True

        def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
            pass

    metric_exporter = EncodingMetricExporter()
    reader = PeriodicExportingMetricReader(metric_exporter, export_interval_millis=math.inf)
    reader.exporter = metric_exporter
    return BenchSpanExporter(), reader


def _check_uninstrumented() -> None:
    from otel_generate import GenerateInstrumentor

    if GenerateInstrumentor().is_instrumented_by_opentelemetry:
        raise BenchUsageError(
            "--compare needs generate() uninstrumented to time the plain path; do not run it under "
            "opentelemetry-instrument or while GenerateInstrumentor().instrument() is active"
        )


def _with_iqr(result: Dict[str, Any], name: str, values: Sequence[float]) -> None:
    result[f"median_{name}"] = median_of(values)
    result[f"iqr_{name}"] = iqr_of(values)


class InstrumentedSide:
    """The instrumented side of a plain-vs-instrumented comparison (``--compare``, ``--continuous-batching``).

    SDK providers with the ``--exporter`` (a ``TracerProvider`` + ``BatchSpanProcessor``, a
    ``MeterProvider``; see :func:`make_exporters`) and the ``instrument()`` options the config asks
    for (``--max-step-spans``, ``--step-spans``, ``--background-emission``). :meth:`run` times one
    call instrumented and then finishes the work it deferred, outside its timer.

    Raises:
        BenchUsageError: generate() is already instrumented (e.g. under ``opentelemetry-instrument``),
            so no plain path exists in this process.
    """

    def __init__(self, config: BenchConfig, clock: Callable[[], float], max_queue_size: Optional[int] = None) -> None:
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON

        from otel_generate import GenerateInstrumentor
        from otel_generate.options import DEFAULT_MAX_STEP_SPANS, ENV_MAX_STEP_SPANS, env_int

        _check_uninstrumented()
        self.clock = clock
        self.instrumentor = GenerateInstrumentor()
        self.exporter, self.metric_reader = make_exporters(config.exporter)
        self.sampler = config.sampler
        self.tracer_provider = TracerProvider(sampler=ALWAYS_OFF if config.sampler == "always_off" else ALWAYS_ON)
        queue = {} if max_queue_size is None else {"max_queue_size": max_queue_size}
        self.tracer_provider.add_span_processor(BatchSpanProcessor(self.exporter, **queue))
        self.meter_provider = MeterProvider(metric_readers=[self.metric_reader])
        self.options: Dict[str, Any] = dict(
            tracer_provider=self.tracer_provider, meter_provider=self.meter_provider, skip_dep_check=True
        )
        if config.max_step_spans is not None:
            self.options["max_step_spans"] = config.max_step_spans
        if config.step_spans is not None:
            self.options["step_spans"] = config.step_spans
        if config.background_emission:
            self.options["background_emission"] = True
        #: what instrument() uses: the option, else its environment variable or default
        self.max_step_spans = (
            config.max_step_spans
            if config.max_step_spans is not None
            else env_int(ENV_MAX_STEP_SPANS, DEFAULT_MAX_STEP_SPANS)
        )
        self.policy = config.step_spans or os.environ.get("OTEL_GENERATE_STEP_SPANS", "all").strip().lower() or "all"
        self.flushes_complete = True
        self.description = (
            "GenerateInstrumentor().instrument(tracer_provider=SDK TracerProvider + BatchSpanProcessor + "
            + (
                "discarding SpanExporter, meter_provider=SDK MeterProvider + InMemoryMetricReader"
                if config.exporter == "discard"
                else "SpanExporter that encodes OTLP protobuf and discards the bytes, meter_provider=SDK "
                "MeterProvider + PeriodicExportingMetricReader whose exporter encodes OTLP protobuf and discards "
                "the bytes"
            )
            + (f", max_step_spans={config.max_step_spans}" if config.max_step_spans is not None else "")
            + (f", step_spans={config.step_spans!r}" if config.step_spans is not None else "")
            + (", background_emission=True" if config.background_emission else "")
            + ")"
            + (", sampler=ALWAYS_OFF: every request unsampled" if config.sampler == "always_off" else "")
        )

    def run(self, timed: Callable[[], Any]) -> Tuple[Any, float, float]:
        """``instrument()``, ``gc.collect()``, ``timed()`` (the call, which times itself), then the
        work it deferred, outside its timer: ``tracer_provider.force_flush()`` (drains the background
        emitter, then the span processor; with ``otlp-encode`` that is the encoding) and
        ``meter_provider.force_flush()`` (the metric collection), each timed; ``uninstrument()``.

        Returns:
            ``(timed()'s result, trace flush seconds, metric flush seconds)``.
        """
        self.instrumentor.instrument(**self.options)
        try:
            gc.collect()
            result = timed()
            start = self.clock()
            traced = self.tracer_provider.force_flush()
            middle = self.clock()
            metered = self.meter_provider.force_flush()
            end = self.clock()
        finally:
            self.instrumentor.uninstrument()
        self.flushes_complete = self.flushes_complete and traced is not False and metered is not False
        return result, middle - start, end - middle

    def spans_expected(self, tokens_per_request: Sequence[int]) -> Optional[int]:
        """Spans the requests should export: each a request span and one span per step (at most
        ``max_step_spans``; one prefill step, then one per further token), unless the step-span
        policy emits none (``none``) or only some (``slow``: not predictable, ``None``); none at all
        when the sampler keeps no trace (``always_off``)."""
        if self.sampler == "always_off":
            return 0
        if self.policy == "all":
            return sum(1 + min(n, self.max_step_spans) for n in tokens_per_request)
        if self.policy == "none":
            return len(tokens_per_request)
        return None

    def shutdown(self) -> None:
        self.tracer_provider.shutdown()
        self.meter_provider.shutdown()


def compare(runner: _Runner, monitor: Optional[LoadMonitor] = None) -> Dict[str, Any]:
    """Plain vs instrumented ``generate()``, interleaved A B A B; ``runs`` pairs after ``warmup`` pairs.

    These runs are separate from the measured (profiled) runs of the headline. Plain is the
    original ``GenerationMixin.generate`` (the instrumentor is uninstrumented, so no wrapper
    runs at all); instrumented is ``GenerateInstrumentor().instrument()`` (with
    ``max_step_spans=--max-step-spans`` when given) with an SDK ``TracerProvider`` +
    ``BatchSpanProcessor`` + the ``--exporter`` and an SDK ``MeterProvider`` (see
    :func:`make_exporters`). Instrumenting and uninstrumenting happen outside the timer;
    ``gc.collect()`` runs before every timed call on both sides.

    Deferred work: right after each instrumented timed call, outside any timer and before the
    next run, ``tracer_provider.force_flush()`` (the batch processor exports the call's spans
    on its thread; with ``otlp-encode`` that is the encoding) and then
    ``meter_provider.force_flush()`` (the metric collection, and its encoding) run, each timed
    with the same clock. Their sum is charged to that call: ``paired_ratios_with_deferred`` =
    (instrumented + deferred) / plain. The metric flush is periodic in a real deployment (every
    export interval, not every request), so charging one per request is an upper bound.

    Returns:
        per pair (lists): ``plain_elapsed_s``, ``instrumented_elapsed_s``,
        ``deferred_trace_flush_s``, ``deferred_metric_flush_s``, ``instrumented_deferred_s``
        (their sum), ``paired_ratios`` (instrumented / plain, caller-visible),
        ``paired_ratios_with_deferred``, ``steps`` (decode steps per run), ``added_us_per_step``
        and ``added_us_per_step_with_deferred`` ((instrumented [+ deferred] - plain) / steps,
        microseconds), ``plain_tokens_per_s``, ``spans_exported_after_each_flush`` (cumulative);
        for each of those a ``median_X`` and an ``iqr_X`` (``[25th, 75th percentile]``);
        ``spans_exported`` / ``spans_expected``, ``exported_bytes`` / ``exported_metric_bytes``
        (``otlp-encode``: serialized OTLP bytes; ``discard``: ``None``), ``flushes_complete``,
        ``outputs_identical`` and descriptions of both paths.

    Raises:
        BenchUsageError: generate() is already instrumented (e.g. under ``opentelemetry-instrument``),
            so no plain path exists in this process.
    """
    import torch

    config = runner.config
    side = InstrumentedSide(config, runner.clock)
    exporter, metric_reader = side.exporter, side.metric_reader

    def plain() -> Tuple[Any, float]:
        gc.collect()
        return runner.timed()

    def instrumented() -> Tuple[Any, float, float, float]:
        (output, elapsed), flush_trace, flush_metric = side.run(runner.timed)
        return output, elapsed, flush_trace, flush_metric

    try:
        for _ in range(config.warmup):
            plain()
            instrumented()
        spans_before = exporter.spans
        bytes_before = exporter.bytes
        metric_exporter = getattr(metric_reader, "exporter", None)
        metric_bytes_before = metric_exporter.bytes if metric_exporter is not None else None
        side.flushes_complete = True
        plain_s: List[float] = []
        instr_s: List[float] = []
        trace_flush_s: List[float] = []
        metric_flush_s: List[float] = []
        steps: List[int] = []
        plain_rates: List[float] = []
        exported_after: List[int] = []
        identical = True
        for pair in range(config.runs):
            out_a, elapsed_a = plain()
            out_b, elapsed_b, flush_trace, flush_metric = instrumented()
            exported_after.append(exporter.spans - spans_before)
            plain_s.append(elapsed_a)
            instr_s.append(elapsed_b)
            trace_flush_s.append(flush_trace)
            metric_flush_s.append(flush_metric)
            seq_a, seq_b = _sequences(out_a), _sequences(out_b)
            identical = identical and seq_a.shape == seq_b.shape and bool(torch.equal(seq_a, seq_b))
            counts_a = runner.counts(out_a)
            # decode steps = loop iterations = the longest sequence's new tokens (greedy: 1 token/step)
            steps.append(max(counts_a))
            plain_rates.append(sum(counts_a) / elapsed_a)
            if monitor is not None:
                monitor.read(f"pair {pair + 1}")
        spans_exported = exporter.spans - spans_before
        exported_bytes = None if exporter.bytes is None else exporter.bytes - bytes_before
        metric_bytes = None if metric_exporter is None else metric_exporter.bytes - metric_bytes_before
    finally:
        side.shutdown()
    deferred = [t + m for t, m in zip(trace_flush_s, metric_flush_s)]
    ratios = [b / a for a, b in zip(plain_s, instr_s)]
    ratios_deferred = [(b + d) / a for a, b, d in zip(plain_s, instr_s, deferred)]
    added = [(b - a) / n * 1e6 for a, b, n in zip(plain_s, instr_s, steps)]
    added_deferred = [(b + d - a) / n * 1e6 for a, b, d, n in zip(plain_s, instr_s, deferred, steps)]
    result: Dict[str, Any] = {
        "pairs": config.runs,
        "order": "A B A B (plain, then instrumented, per pair); deferred work finished after each B, untimed by A or B",
        "runs": "runs of their own, separate from the measured (profiled) runs of the headline",
        "plain": "GenerationMixin.generate uninstrumented (the original function; no wrapper runs)",
        "instrumented": side.description,
        "deferred": (
            "after each instrumented call, outside its timer and before the next run: "
            "tracer_provider.force_flush() then meter_provider.force_flush(), each timed; charged to that call"
        ),
        "exporter": config.exporter,
        "plain_elapsed_s": plain_s,
        "instrumented_elapsed_s": instr_s,
        "deferred_trace_flush_s": trace_flush_s,
        "deferred_metric_flush_s": metric_flush_s,
        "instrumented_deferred_s": deferred,
        "paired_ratios": ratios,
        "paired_ratios_with_deferred": ratios_deferred,
        "steps": steps,
        "added_us_per_step": added,
        "added_us_per_step_with_deferred": added_deferred,
        "plain_tokens_per_s": plain_rates,
    }
    _with_iqr(result, "paired_ratio", ratios)
    _with_iqr(result, "paired_ratio_with_deferred", ratios_deferred)
    _with_iqr(result, "added_us_per_step", added)
    _with_iqr(result, "added_us_per_step_with_deferred", added_deferred)
    _with_iqr(result, "plain_elapsed_s", plain_s)
    _with_iqr(result, "instrumented_elapsed_s", instr_s)
    _with_iqr(result, "instrumented_deferred_s", deferred)
    _with_iqr(result, "plain_tokens_per_s", plain_rates)
    result.update(
        {
            "spans_exported": spans_exported,
            "spans_exported_after_each_flush": exported_after,
            "max_step_spans": side.max_step_spans,
            "step_spans": side.policy,
            "sampler": side.sampler,
            "spans_expected": side.spans_expected(steps),
            "exported_bytes": exported_bytes,
            "exported_metric_bytes": metric_bytes,
            "flushes_complete": side.flushes_complete,
            "outputs_identical": identical,
        }
    )
    return result


# --------------------------------------------------------------------------------------------
# The whole run
# --------------------------------------------------------------------------------------------


def run(config: BenchConfig, clock: Callable[[], float] = time.perf_counter) -> Dict[str, Any]:
    """Validate, build, warm up, measure (and compare); return the result document.

    Nothing is written here (see :func:`otel_generate.bench.cli.main_bench`). ``torch``'s CPU
    thread count is set to ``config.threads`` for the run and restored afterwards. The load
    average is read throughout (:class:`LoadMonitor`); ``warnings`` lists what makes the numbers
    less trustworthy (a busy machine, a flush that timed out).

    Raises:
        BenchUsageError: invalid input (see :meth:`BenchConfig.validate`, :func:`resolve_device`,
            :func:`check_lengths`, :func:`resolve_eos`).
        ValueError: a timed call whose clock did not advance.
    """
    if config.continuous_batching:
        from otel_generate.bench import continuous

        return continuous.run(config, clock)
    config.validate()
    monitor = LoadMonitor(own_threads=config.threads)
    monitor.read("start")
    device = resolve_device(config.device)
    if config.compare:
        _check_uninstrumented()
    import torch

    previous_threads = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    try:
        runner = _Runner(config, device, clock=clock)
        samples = measure(runner, monitor)
        result: Dict[str, Any] = {
            "versions": versions(),
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "command": list(config.argv),
            # settings the instrumentation reads from the environment (e.g. OTEL_GENERATE_MAX_STEP_SPANS)
            "environment": {k: v for k, v in sorted(os.environ.items()) if k.startswith("OTEL_GENERATE_")},
            "machine": machine(device),
            "model": model_description(config, runner.model),
            "device": str(runner.model.device),
            "dtype": config.dtype,
            "parameters": int(sum(p.numel() for p in runner.model.parameters())),
            "prompt_tokens": config.prompt_tokens,
            "new_tokens_requested": config.new_tokens,
            "batch_size": config.batch_size,
            "warmup": config.warmup,
            "runs": config.runs,
            "threads": torch.get_num_threads(),
            "seed": config.seed,
            "eos_token_id": runner.eos,
            "synchronize": f"{device} synchronize before each clock read"
            if runner.synchronize is not None
            else "none needed (cpu: eager work has finished when ops return)",
            "timer": "time.perf_counter around one complete generate(), synchronized before and after",
            "measured_runs": MEASURED_RUNS,
            "samples": samples,
        }
        result.update(summarize(samples))
        if config.compare:
            result["compare"] = compare(runner, monitor)
        monitor.read("end")
        result["load"] = monitor.report()
        warnings = [result["load"]["warning"]] if result["load"]["warning"] else []
        if config.compare and not result["compare"]["flushes_complete"]:
            warnings.append("a flush of deferred work timed out: some deferred work was not charged to its run")
        result["warnings"] = warnings
        return result
    finally:
        torch.set_num_threads(previous_threads)
