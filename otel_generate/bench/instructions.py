"""``otel-generate bench --instructions``: what the instrumentation costs, counted in instructions.

Time ratios on a shared machine move by several percent between identical runs; instruction
counts do not depend on what else the machine runs. This mode runs each configuration in a Python
process of its own under valgrind's callgrind (:mod:`otel_generate.bench.instructions_child`),
as many at a time as the machine has cores, at most :data:`MAX_PROCESSES` (a count does not
depend on what runs beside it). Each process:

1. sets its configuration up once (plain: nothing; ``plain-sdk``: the SDK providers below, nothing
   instrumented; instrumented: ``GenerateInstrumentor().instrument()`` with an SDK
   ``TracerProvider`` + ``BatchSpanProcessor`` + the ``--exporter`` and an SDK
   ``MeterProvider``, kept for all its calls), then runs ``--warmup`` calls. The processor
   exports when a batch is full or at a flush, not on its 5 s timer (:func:`span_processor`:
   under valgrind the timer would fire about 50 times as often per call as natively);
2. runs ``K_lo`` calls (``--calls-low``, default 2), then flushes the providers (the span export
   and the metric collection those calls deferred are counted with them);
3. runs ``K_hi`` calls (``--calls-high``, default 18) the same way;
4. uninstruments.

A process of its own per configuration keeps one configuration's heap out of the next one's:
run one after another in one process, each configuration inherited the heap the ones before it
had left, and the allocator's work (glibc's ``malloc``/``free``, ``pymalloc``) moved with it. What
a fresh process does not remove is the layout term: CPython 3.11's attribute cache is indexed by
a type's version tag and the *address* of the attribute's name, so where a process's allocations
land decides which lookups collide, and every miss walks the classes' dictionaries. The same
configuration started the same way repeats to the instruction (plain, tiny GPT-2, 128 tokens:
560,569,280.375 twice); started from another folder, or as another configuration that allocates
differently before its calls, its count moves by up to about 2 M instructions per call (0.4 %;
the method notes of BENCHMARKS.md). An added figure below that size is not resolved by one run.

The process marks the borders between these parts by calling ``os.getloadavg()`` (libc's
``getloadavg``, which nothing else calls here): callgrind runs with
``--dump-before=getloadavg``, so each part's instructions land in a dump of their own. A
``gc.collect()`` before each part keeps collections of earlier garbage out of it. Then, per
configuration (the difference method):

    instructions per call = (Ir(K_hi calls) - Ir(K_lo calls)) / (K_hi - K_lo)

which cancels everything a part pays once (the flush's fixed cost, the marker), as well as
process start, imports and set-up, which are in other dumps. "Ir" is callgrind's count of
executed instructions. Each configuration runs twice, in two processes:

* **the caller's thread**: with ``--separate-threads=yes``, a dump at a marker holds the thread
  that called it, the one that calls ``generate()``: what the application's thread pays
  (``caller_*`` fields);
* **all threads**: without it, a dump holds every thread's counts since the last one, the
  background emitter's and the span processor's included (the flush at the end of each part
  drains both): the whole work (the plain fields).

Per step is per call divided by the decode steps of a call (the new tokens of the longest row:
greedy decoding adds one token per step). Added is instrumented minus plain, also as a share of
plain, for the caller's thread and for all threads. Each instrumented configuration's output
sequences are compared with plain's (``outputs_identical``).

BLAS and OpenMP are kept to one thread (``OPENBLAS_NUM_THREADS=1``, ``OMP_NUM_THREADS=1``,
``MKL_NUM_THREADS=1``, ``torch.set_num_threads(--threads)``), so that no idle thread spins, and
string hashing is fixed (``PYTHONHASHSEED=0``), so that dict and set layouts are the same in every
run.

Instructions are not time: a cache miss or a branch misprediction costs more than an add, and
valgrind runs the program about 50 times slower, one thread at a time. The counts say how much
work the instrumentation adds; the time ratios of ``--compare`` say what it costs in time on a
given machine, with its noise.

Configurations (``--configurations``, comma-separated; default all): see :data:`CONFIGURATIONS`.

Errors: :class:`~otel_generate.bench.config.BenchUsageError` (exit status 2) when valgrind is not
installed, on invalid input, or when the process under valgrind fails.
"""

from __future__ import annotations

import concurrent.futures
import datetime as _dt
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple

from otel_generate.bench.config import BenchConfig, BenchUsageError, require_module
from otel_generate.bench.environment import machine
from otel_generate.options import STEP_SPANS_NONE, STEP_SPANS_SLOW

#: ``name: (description, instrument() keywords, sampled)``; ``plain`` and ``plain-sdk`` (see
#: :data:`PROVIDERS_ONLY`) are uninstrumented.
CONFIGURATIONS: Dict[str, Tuple[str, Optional[Dict[str, Any]], bool]] = {
    "plain": ("plain generate(): GenerationMixin.generate uninstrumented", None, True),
    "plain-sdk": (
        "plain generate(), uninstrumented, with the SDK providers of the instrumented configurations set up "
        "(their span processor's thread alive): the baseline the instrumentation adds to",
        None,
        True,
    ),
    "all-step-spans": (
        "instrumented with the default options: every step a span and the per-token histogram, built on the "
        "background emitter",
        {},
        True,
    ),
    "max-step-spans-0": (
        "instrumented, max_step_spans=0: the request span and metrics, no step span",
        {"max_step_spans": 0},
        True,
    ),
    "step-spans-none": (
        "instrumented, step_spans='none' (the policy): no step span",
        {"step_spans": STEP_SPANS_NONE},
        True,
    ),
    "step-spans-slow": (
        "instrumented, step_spans='slow': step spans only for slow requests",
        {"step_spans": STEP_SPANS_SLOW},
        True,
    ),
    "unsampled": (
        "instrumented, sampler ParentBased(ALWAYS_OFF): the request is not sampled (its metrics still are)",
        {},
        False,
    ),
    "foreground": (
        "instrumented, background_emission=False: every step a span and the per-token histogram, built on the "
        "caller's thread before generate() returns",
        {"background_emission": False},
        True,
    ),
}
#: The thread views each configuration is counted in: the caller's thread alone, and every thread.
THREAD_VIEWS = ("caller", "all")
#: Configurations that run one thread (BLAS and OpenMP kept to one): counted once, threads apart,
#: which is also their count of every thread.
SINGLE_THREADED = frozenset({"plain"})
SINGLE_THREADED_VIEWS = ("caller",)
#: Uninstrumented configurations that still set up the SDK providers (a ``TracerProvider`` with
#: :func:`span_processor`, a ``MeterProvider``), so that their span processor's thread is alive: the
#: baseline of what instrumenting ``generate()`` adds in a process that has OpenTelemetry set up.
#: A second thread makes glibc take its multi-threaded mutex paths (``__pthread_mutex_unlock_usercnt``
#: +0.49 M instructions per call of the tiny GPT-2, ``pthread_mutex_lock`` -0.16 M, in every run
#: that separated it); the rest of what ``plain-sdk`` reads over ``plain`` (+10,412 to +2.1 M per call
#: in fresh processes) is the layout term of the module docstring.
PROVIDERS_ONLY = frozenset({"plain-sdk"})
DEFAULT_NEW_TOKENS = 128
DEFAULT_CALLS_LOW = 2
DEFAULT_CALLS_HIGH = 18
#: The libc function whose call marks a border between parts (``--dump-before``).
MARKER = "getloadavg"
#: Set by the parent: the child turns callgrind's counting on itself (``callgrind_control -i on``)
#: once its imports, set-up and warmup are done; valgrind starts with ``--instr-atstart=no``.
COUNT_SWITCH_ENV = "OTEL_GENERATE_CALLGRIND_SWITCH"


def start_counting() -> None:
    """In the process under valgrind: turn callgrind's counting on (``callgrind_control -i on``,
    which returns once valgrind has done it); nothing when the parent did not ask for it.

    Raises:
        RuntimeError: ``callgrind_control`` failed (the counts would be empty).
    """
    if os.environ.get(COUNT_SWITCH_ENV) != "1":
        return
    done = subprocess.run(
        ["callgrind_control", "--instr=on", str(os.getpid())], capture_output=True, text=True, timeout=600
    )
    if done.returncode != 0 or "OK" not in done.stdout:
        raise RuntimeError(f"callgrind_control --instr=on failed: {done.stdout[-500:]} {done.stderr[-500:]}")


#: At most this many processes under valgrind at a time (each holds about 2 GB with torch loaded).
MAX_PROCESSES = 4
VALGRIND_MISSING = (
    "--instructions needs valgrind (its callgrind tool and callgrind_control) on PATH; install it, e.g. "
    "apt-get install valgrind"
)
SINGLE_THREAD_ENV = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
#: String hashing fixed, so that dict and set layouts (and their probe counts) are the same in
#: every run: with a random seed, two runs of one configuration differed by up to 1 M
#: instructions per call.
HASH_SEED_ENV = {"PYTHONHASHSEED": "0"}
#: The ``BatchSpanProcessor``'s ``schedule_delay_millis`` in the process under valgrind: one day,
#: so the processor exports when its batch is full (512 spans) or at a part's flush, never on its
#: timer. Under valgrind a call runs about 50 times slower, so the SDK's 5 s timer would wake the
#: export thread about 50 times as often per call as it does natively: measured with jemalloc
#: (``tiny GPT-2``, 128 tokens), a provider whose processor has the 5 s timer, uninstrumented, added
#: +0.26 M instructions per call to plain ``generate()``, and the unsampled configuration read
#: +2.6 M added per call with the 5 s timer against +2.0 M with this delay (means of the 5-6
#: calls after the first, counted with one callgrind dump per call).
EXPORT_DELAY_MILLIS = 86_400_000


def span_processor(exporter: Any) -> Any:
    """The SDK ``BatchSpanProcessor`` for ``exporter`` that the process under valgrind uses.

    Its timer is :data:`EXPORT_DELAY_MILLIS` (one day): spans are exported when a batch of 512 is
    queued or when the part's ``force_flush()`` runs, so the export's instructions do not depend
    on how long valgrind takes. The queue and batch sizes are the SDK's defaults.
    """
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    return BatchSpanProcessor(exporter, schedule_delay_millis=EXPORT_DELAY_MILLIS)


def parse_configurations(text: Optional[str]) -> List[str]:
    """``"plain,unsampled"`` -> the names, in :data:`CONFIGURATIONS` order, ``plain`` always first.

    Raises:
        BenchUsageError: an unknown name.
    """
    if text is None:
        return list(CONFIGURATIONS)
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in CONFIGURATIONS]
    if unknown or not names:
        raise BenchUsageError(
            f"--configurations: unknown {', '.join(map(repr, unknown)) or 'empty list'}; "
            f"choose from {', '.join(CONFIGURATIONS)}"
        )
    chosen = set(names) | {"plain"}  # the added share needs plain
    return [name for name in CONFIGURATIONS if name in chosen]


def validate(config: BenchConfig, check_tools: bool = True) -> None:
    """What ``--instructions`` accepts, checked before valgrind starts; without ``check_tools``
    (``--dry-run``) the options only, not whether the SDK and valgrind are installed.

    Raises:
        BenchUsageError: naming the first problem (valgrind missing included).
    """
    if config.compare or config.continuous_batching:
        raise BenchUsageError("--instructions is a mode of its own; drop --compare / --continuous-batching")
    if config.plot is not None:
        raise BenchUsageError("--plot does not apply to --instructions")
    if config.device != "cpu":
        raise BenchUsageError("--instructions counts instructions on the CPU only (--device cpu)")
    for option, value in (
        ("--max-step-spans", config.max_step_spans),
        ("--step-spans", config.step_spans),
        ("--background-emission", config.background_emission),
        ("--sampler", None if getattr(config, "sampler", "always_on") == "always_on" else config.sampler),
    ):
        if value is not None:
            raise BenchUsageError(
                f"{option} does not apply to --instructions, which runs fixed configurations (--configurations)"
            )
    if config.calls_low < 0:
        raise BenchUsageError(f"--calls-low must be 0 or more, got {config.calls_low}")
    if config.calls_high <= config.calls_low:
        raise BenchUsageError(f"--calls-high must be above --calls-low, got {config.calls_high} and {config.calls_low}")
    config.configurations = ",".join(parse_configurations(config.configurations))
    if not check_tools:
        return
    require_module(
        "opentelemetry.sdk",
        "--instructions needs the OpenTelemetry SDK: pip install opentelemetry-sdk (the package's [bench] extra)",
    )
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise BenchUsageError(VALGRIND_MISSING)


# --------------------------------------------------------------------------------------------
# The parent: valgrind, the dumps, the figures
# --------------------------------------------------------------------------------------------


def valgrind_version() -> str:
    try:
        done = subprocess.run(["valgrind", "--version"], capture_output=True, text=True, timeout=60)
        return done.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def read_total(path: str) -> int:
    """The ``summary:`` (or ``totals:``) Ir count of one callgrind dump file."""
    with open(path, encoding="utf-8", errors="replace") as handle:
        for line in handle:
            if line.startswith(("summary:", "totals:")):
                return int(line.split()[1])
    raise ValueError(f"{path}: no summary line")


_DUMP = re.compile(r"\.(\d+)$")
#: a dump of one thread (``--separate-threads=yes``): ``prefix.N-TT``; thread 01 is the main thread
_THREAD_DUMP = re.compile(r"\.(\d+)-(\d+)$")


def read_dumps(prefix: str, caller_only: bool = False) -> Dict[int, int]:
    """``{dump number: Ir}`` of the numbered dumps ``prefix.N`` (all threads together), or with
    ``caller_only`` of ``prefix.N-01`` (the main thread, the one that calls ``generate()`` and
    marks the parts: a dump at a marker holds only the thread that reached it)."""
    dumps: Dict[int, int] = {}
    for path in glob.glob(prefix + ".*"):
        match = (_THREAD_DUMP if caller_only else _DUMP).search(path)
        if match is None or (caller_only and int(match.group(2)) != 1):
            continue
        dumps[int(match.group(1))] = read_total(path)
    return dumps


def run(config: BenchConfig, progress: Optional[Any] = None) -> Dict[str, Any]:
    """Run the configurations under callgrind and return the result document (see the module docstring).
    ``progress`` (:class:`~otel_generate.bench.progress.Progress`) counts the processes done.

    Raises:
        BenchUsageError: invalid input, valgrind missing, or the process under valgrind failed.
    """
    config.validate()
    validate(config)
    names = config.configurations.split(",")
    workdir = tempfile.mkdtemp(prefix="otel-generate-instructions-")
    try:
        views = {name: SINGLE_THREADED_VIEWS if name in SINGLE_THREADED else THREAD_VIEWS for name in names}
        processes = sum(len(v) for v in views.values())
        jobs = min(processes, max(1, os.cpu_count() or 1), MAX_PROCESSES)
        print(
            f"otel-generate bench --instructions: {len(names)} configuration(s) under callgrind in {processes} "
            f"processes (the caller's thread and all threads apart; {jobs} at a time), {config.calls_low} and "
            f"{config.calls_high} calls each; this takes minutes",
            file=sys.stderr,
        )
        if progress is not None:
            progress.begin(processes, "callgrind, one process per configuration and thread view", unit="processes")
        children = _Children()
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=jobs)
        try:
            # (folders named alike, c00a, c00c, ...: the paths a process is started with are the same
            # length for every configuration, so they move no allocation of one against another)
            futures = {
                (name, view): pool.submit(
                    _run_configuration,
                    config,
                    name,
                    os.path.join(workdir, f"c{index:02d}{view[0]}"),
                    children,
                    view == "caller",
                )
                for index, name in enumerate(names)
                for view in views[name]
            }
            if progress is not None:
                for future in concurrent.futures.as_completed(futures.values()):
                    future.result()  # a failed process raises here, at once
                    progress.advance()
            done = {key: future.result() for key, future in futures.items()}
            for name in names:  # a single thread: the caller's count is every thread's
                done.setdefault((name, "all"), done[(name, "caller")])
        except BaseException:  # a configuration failed, or Ctrl-C: start no other, stop those running
            children.stop()
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        finally:
            pool.shutdown(wait=True)
        every = merge_processes([done[(name, "all")] for name in names])
        caller = merge_processes([done[(name, "caller")] for name in names])
        return result_document(config, *every, caller_dumps=caller[1])
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


class _Children:
    """The processes under valgrind that are running; once stopped, none is started any more."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: List[subprocess.Popen] = []
        self._stopped = False

    def run(self, command: List[str], env: Dict[str, str]) -> int:
        """Run ``command`` to its end and return its exit status (-1 when stopped before it started)."""
        with self._lock:
            if self._stopped:
                return -1
            process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL)
            self._running.append(process)
        try:
            return process.wait()
        finally:
            with self._lock:
                self._running.remove(process)

    def stop(self) -> None:
        """Terminate the running processes; start no other."""
        with self._lock:
            self._stopped = True
            for process in self._running:
                process.terminate()


def _run_configuration(
    config: BenchConfig, name: str, folder: str, children: "_Children", caller_only: bool = False
) -> Tuple[Dict[str, Any], Dict[int, int]]:
    """One configuration in a process of its own under callgrind: ``(what the child wrote, its
    dumps)``, in ``folder``; ``caller_only``: threads counted apart, the dumps of the main thread.
    A fresh process keeps one configuration's heap out of the next one's (the module docstring says
    what it does not remove).

    Raises:
        BenchUsageError: the process under valgrind failed, or its dumps do not match its markers.
    """
    os.makedirs(folder)
    spec_path = os.path.join(folder, "spec.json")
    child_path = os.path.join(folder, "child.json")
    prefix = os.path.join(folder, "callgrind.out")
    log_path = os.path.join(folder, "valgrind.log")
    spec = {
        "config": {k: v for k, v in vars(config).items() if k != "argv"},
        "configurations": [name],
        "result": child_path,
    }
    with open(spec_path, "w", encoding="utf-8") as handle:
        json.dump(spec, handle)
    command = [
        "valgrind",
        "--tool=callgrind",
        # counting starts when the child turns it on (callgrind_control), after its imports and warmup:
        # importing torch alone is about 17 G instructions, which valgrind runs about 10 times faster uncounted
        "--instr-atstart=no",
        *(["--separate-threads=yes"] if caller_only else []),
        f"--dump-before={MARKER}",
        f"--callgrind-out-file={prefix}",
        f"--log-file={log_path}",
        sys.executable,
        "-m",
        "otel_generate.bench.instructions_child",
        spec_path,
    ]
    env = dict(os.environ)
    env.update(SINGLE_THREAD_ENV)
    env.update(HASH_SEED_ENV)
    env[COUNT_SWITCH_ENV] = "1"
    # the process's own progress lines go to this stderr; valgrind's messages to its log
    returncode = children.run(command, env)
    if returncode != 0 or not os.path.exists(child_path):
        try:
            with open(log_path, encoding="utf-8", errors="replace") as handle:
                tail = "\n".join(handle.read().strip().splitlines()[-15:])
        except OSError:
            tail = ""
        raise BenchUsageError(
            f"the process under valgrind for {name!r} failed (exit status {returncode}); valgrind's log ends:\n{tail}"
        )
    with open(child_path, encoding="utf-8") as handle:
        child = json.load(handle)
    dumps = read_dumps(prefix, caller_only)
    if sorted(dumps) != list(range(1, len(child["labels"]) + 1)):
        raise BenchUsageError(
            f"callgrind wrote dumps {sorted(dumps)} for {len(child['labels'])} markers of {name!r}: something "
            f"else called {MARKER}(); the parts cannot be told apart"
        )
    return child, dumps


def merge_processes(
    processes: Sequence[Tuple[Dict[str, Any], Dict[int, int]]],
) -> Tuple[Dict[str, Any], Dict[int, int], List[str]]:
    """The children's results and dumps of one process per configuration, in order, as one
    ``(child, dumps, labels)`` for :func:`result_document`: the labels concatenated, the dumps
    numbered on, the runs together. A configuration's ``outputs_identical`` also requires its
    sequences to equal the first configuration's (``plain``), read in another process."""
    child: Dict[str, Any] = {"configurations": [], "runs": {}}
    dumps: Dict[int, int] = {}
    labels: List[str] = []
    reference = None
    for own, own_dumps in processes:
        for number, ir in own_dumps.items():
            dumps[len(labels) + number] = ir
        labels.extend(own["labels"])
        for name in own["configurations"]:
            run = dict(own["runs"][name])
            sequences = run.pop("sequences", None)
            if reference is None:
                reference = sequences
            run["outputs_identical"] = bool(run["outputs_identical"]) and sequences == reference
            child["configurations"].append(name)
            child["runs"][name] = run
        for key in ("versions", "model", "parameters"):
            child.setdefault(key, own[key])
    return child, dumps, labels


def result_document(
    config: BenchConfig,
    child: Dict[str, Any],
    dumps: Dict[int, int],
    labels: Sequence[str],
    caller_dumps: Optional[Dict[int, int]] = None,
) -> Dict[str, Any]:
    """The JSON document: one entry per configuration, plain first, with the added share vs plain,
    for all threads and (``caller_dumps``: the same parts counted on the caller's thread) for the
    caller's thread."""
    part = {label: dumps[index + 1] for index, label in enumerate(labels)}
    caller_part = {label: caller_dumps[index + 1] for index, label in enumerate(labels)} if caller_dumps else None
    span = config.calls_high - config.calls_low
    caller_plain: Optional[float] = None
    rows: List[Dict[str, Any]] = []
    plain: Optional[Dict[str, Any]] = None
    baseline: Optional[Dict[str, Any]] = None  # plain-sdk's row, when it ran
    for name in child["configurations"]:
        info = child["runs"][name]
        total_low, total_high = part[f"{name} low"], part[f"{name} high"]
        per_call = (total_high - total_low) / span
        steps = info["steps"]
        row: Dict[str, Any] = {
            "configuration": name,
            "description": CONFIGURATIONS[name][0],
            "ir_low": total_low,
            "ir_high": total_high,
            "instructions_per_call": per_call,
            "steps_per_call": steps,
            "instructions_per_step": per_call / steps if steps else None,
            "spans_per_call": info["spans_per_call"],
            "spans_expected_per_call": info["spans_expected_per_call"],
            "outputs_identical": info["outputs_identical"],
        }
        if name == "plain":
            plain = row
        if plain is not None and name != "plain":
            added = per_call - plain["instructions_per_call"]
            row["added_per_call"] = added
            row["added_percent"] = 100.0 * added / plain["instructions_per_call"]
            row["added_per_step"] = added / steps if steps else None
        if caller_part is not None:
            caller_low, caller_high = caller_part[f"{name} low"], caller_part[f"{name} high"]
            caller_per_call = (caller_high - caller_low) / span
            row["caller_ir_low"], row["caller_ir_high"] = caller_low, caller_high
            row["caller_instructions_per_call"] = caller_per_call
            if name == "plain":
                caller_plain = caller_per_call
            elif caller_plain is not None:
                row["caller_added_per_call"] = caller_per_call - caller_plain
                row["caller_added_percent"] = 100.0 * (caller_per_call - caller_plain) / caller_plain
                row["caller_added_per_step"] = (caller_per_call - caller_plain) / steps if steps else None
        if name in PROVIDERS_ONLY:
            baseline = row
        elif baseline is not None and name != "plain":
            added = per_call - baseline["instructions_per_call"]
            row["added_over_sdk_per_call"] = added
            row["added_over_sdk_percent"] = 100.0 * added / baseline["instructions_per_call"]
        rows.append(row)
    return {
        "mode": "instructions",
        "versions": child["versions"],
        "valgrind": valgrind_version(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": list(config.argv),
        "method": (
            "one process per configuration under valgrind --tool=callgrind (as many at a time as there are "
            f"cores, at most {MAX_PROCESSES}); in each: set up once, "
            f"warmup, then {config.calls_low} calls + flush and {config.calls_high} calls + flush, each part in a "
            f"callgrind dump of its own (os.getloadavg() marks the borders, --dump-before={MARKER}); "
            "instructions per call = (Ir(high) - Ir(low)) / (calls_high - calls_low); each configuration in two "
            "processes: --separate-threads=yes, the main thread's dumps (caller_*: the thread that calls generate()), "
            "and without it, Ir summed over all threads (the plain fields); "
            f"BatchSpanProcessor(schedule_delay_millis={EXPORT_DELAY_MILLIS}): spans exported when 512 are queued "
            "or at the flush, not on a timer"
        ),
        "environment": dict(SINGLE_THREAD_ENV, **HASH_SEED_ENV, torch_threads=config.threads),
        "machine": machine("cpu"),
        "model": child["model"],
        "parameters": child["parameters"],
        "device": "cpu",
        "dtype": config.dtype,
        "prompt_tokens": config.prompt_tokens,
        "new_tokens_requested": config.new_tokens,
        "batch_size": config.batch_size,
        "warmup": config.warmup,
        "calls_low": config.calls_low,
        "calls_high": config.calls_high,
        "exporter": config.exporter,
        "configurations": rows,
        "note": (
            "instructions are not time: a cache miss costs more than an add; --compare gives the time ratios, "
            "both are shown"
        ),
    }


def summary_text(result: Dict[str, Any]) -> str:
    """The table printed on stderr."""
    rows = result["configurations"]
    lines = [
        f"otel-generate bench --instructions: {result['model']}, {result['new_tokens_requested']} new tokens, "
        f"prompt {result['prompt_tokens']} x batch {result['batch_size']}, cpu, "
        f"{result['environment']['torch_threads']} torch thread(s)",
        f"  callgrind, difference of {result['calls_high']} and {result['calls_low']} calls; exporter "
        f"{result['exporter']}",
    ]
    if any(row.get("caller_instructions_per_call") is not None for row in rows):
        lines.append("  the caller's thread (the thread that calls generate()):")
        lines.append(f"  {'configuration':<22}{'per call':>14}{'added/call':>14}{'added':>9}{'added/step':>12}")
        for row in rows:
            added = row.get("caller_added_per_call")
            lines.append(
                f"  {row['configuration']:<22}{row['caller_instructions_per_call']:>14,.0f}"
                + (
                    f"{added:>+14,.0f}{row['caller_added_percent']:>+8.3f}%"
                    f"{(row['caller_added_per_step'] or 0):>+12,.0f}"
                    if added is not None
                    else ""
                )
            )
    lines += [
        "  all threads (the caller's, the background emitter's, the span processor's):",
        f"  {'configuration':<22}{'per call':>14}{'per step':>12}{'added/call':>14}{'added':>9}{'added/step':>12}"
        # (the plain-sdk column only where that configuration ran)
        + (
            f"{'over plain-sdk':>16}"
            if any(row.get("added_over_sdk_per_call") is not None for row in result["configurations"])
            else ""
        ),
    ]
    for row in result["configurations"]:
        added = row.get("added_per_call")
        over_sdk = row.get("added_over_sdk_per_call")
        lines.append(
            f"  {row['configuration']:<22}{row['instructions_per_call']:>14,.0f}"
            f"{(row['instructions_per_step'] or 0):>12,.0f}"
            + (
                f"{added:>+14,.0f}{row['added_percent']:>+8.3f}%{(row['added_per_step'] or 0):>+12,.0f}"
                if added is not None
                else ""
            )
            + (f"{row['added_over_sdk_percent']:>+15.3f}%" if over_sdk is not None else "")
        )
    mismatched = [
        row["configuration"]
        for row in result["configurations"]
        if row["spans_expected_per_call"] is not None and row["spans_per_call"] != row["spans_expected_per_call"]
    ]
    if mismatched:
        lines.append(f"  WARNING: spans exported differ from those expected in {', '.join(mismatched)}")
    if not all(row["outputs_identical"] for row in result["configurations"]):
        lines.append("  WARNING: some instrumented outputs differ from plain generate()'s")
    lines.append(f"  {result['note']}")
    return "\n".join(lines)
