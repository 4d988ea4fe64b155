"""``otel-generate bench --instructions``: what the instrumentation costs, counted in instructions.

Time ratios on a shared machine move by several percent between identical runs; instruction
counts do not depend on what else the machine runs. This mode runs each configuration in a Python
process of its own under valgrind's callgrind (:mod:`otel_generate.bench.instructions_child`),
as many at a time as the machine has cores, at most :data:`MAX_PROCESSES`. Each process:

1. sets its configuration up once: an SDK ``TracerProvider`` with a ``BatchSpanProcessor`` and the
   ``--exporter``, an SDK ``MeterProvider``, and ``GenerateInstrumentor().instrument()`` with the
   configuration's keywords, kept for all its calls. The processor exports when a batch is full or
   at a flush, not on its 5 s timer (:func:`span_processor`: under valgrind the timer would fire
   about 50 times as often per call as natively);
2. warms up with ``--warmup`` pairs of calls, then turns callgrind's counting on itself
   (:func:`start_counting`, ``callgrind_control --instr=on``; valgrind starts with
   ``--instr-atstart=no``): imports, set-up and warmup are not counted;
3. runs ``--pairs`` pairs, each a **plain** call (the same ``generate()`` under OpenTelemetry's
   ``suppress_instrumentation()``: the hooks only pass through) and an **instrumented** call, each
   in a callgrind dump of its own (``os.getloadavg()`` marks the borders, ``--dump-before``),
   then, in a dump that is not read, a flush of the providers and a garbage collection (the
   collector is off while calls are counted: a collection's cost would land in whichever call
   crossed its threshold).

Paired in one process, the two arms share everything a process's count depends on besides the
instrumentation: the threads alive (the span processor's and the background emitter's: a second
thread makes glibc take its slower multi-threaded paths in the caller's own code), the imports,
and the layout term: CPython 3.11's attribute cache is indexed by a type's version tag and the
*address* of the attribute's name, so where a process's allocations land decides which lookups
collide. Compared across processes, two configurations' counts moved by up to about 3 M
instructions per call of the tiny GPT-2 (0.5 %) from those alone; paired in one process, the
added count is what the instrumentation runs. The plain arm includes the hooks' pass-through
checks (a few thousand instructions a call), which the added count therefore leaves out.

Each configuration is counted twice, in two processes:

* **the caller's thread**: with ``--separate-threads=yes``, a dump at a marker holds the thread
  that reached it, the one that calls ``generate()``: what the application's thread pays
  (``caller_*`` fields). The background emitter builds the request's spans and metrics on its own
  thread, mostly while the caller waits in the flush between pairs;
* **all threads**: without it, a dump holds every thread's counts since the last one; each call
  is followed by a flush inside its own dump, so the background emitter's work and the span
  processor's export are in the call that caused them (the plain fields).

Per call is the mean over the pairs, added is instrumented minus plain (its median and range over
the pairs are kept too), also as a share of plain; per step is per call divided by the decode
steps of a call (the new tokens of the longest row: greedy decoding adds one token per step). Each
configuration's instrumented output sequences are compared with its plain ones
(``outputs_identical``).

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

#: ``name: (description, instrument() keywords, sampled)``: each is paired with plain calls in its process.
CONFIGURATIONS: Dict[str, Tuple[str, Dict[str, Any], bool]] = {
    "all-step-spans": (
        "the default options: every step a span and the per-token histogram, built on the background emitter",
        {},
        True,
    ),
    "step-spans-none": (
        "step_spans='none' (the policy): the request span and every metric, no step span",
        {"step_spans": STEP_SPANS_NONE},
        True,
    ),
    "unsampled": (
        "sampler ParentBased(ALWAYS_OFF): the request is not sampled (no span; its metrics still are)",
        {},
        False,
    ),
    "max-step-spans-0": (
        "max_step_spans=0: the request span and metrics, no step span",
        {"max_step_spans": 0},
        True,
    ),
    "step-spans-slow": (
        "step_spans='slow': step spans only for slow requests",
        {"step_spans": STEP_SPANS_SLOW},
        True,
    ),
    "foreground": (
        "background_emission=False: every step a span and the per-token histogram, built on the caller's thread "
        "before generate() returns",
        {"background_emission": False},
        True,
    ),
}
#: The thread views each configuration is counted in: the caller's thread alone, and every thread.
THREAD_VIEWS = ("caller", "all")
DEFAULT_NEW_TOKENS = 128
DEFAULT_PAIRS = 10
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
    """``"unsampled,all-step-spans"`` -> the names, in :data:`CONFIGURATIONS` order.

    Raises:
        BenchUsageError: an unknown name, or none.
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
    return [name for name in CONFIGURATIONS if name in names]


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
    if config.pairs < 1:
        raise BenchUsageError(f"--pairs must be at least 1, got {config.pairs}")
    if config.warmup < 0:
        raise BenchUsageError(f"--warmup must be 0 or more, got {config.warmup}")
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
        processes = len(names) * len(THREAD_VIEWS)
        jobs = min(processes, max(1, os.cpu_count() or 1), MAX_PROCESSES)
        print(
            f"otel-generate bench --instructions: {len(names)} configuration(s) under callgrind in {processes} "
            f"processes (the caller's thread and all threads apart; {jobs} at a time), {config.pairs} pairs of "
            "plain and instrumented calls each; this takes minutes",
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
                for view in THREAD_VIEWS
            }
            if progress is not None:
                for future in concurrent.futures.as_completed(futures.values()):
                    future.result()  # a failed process raises here, at once
                    progress.advance()
            done = {key: future.result() for key, future in futures.items()}
        except BaseException:  # a configuration failed, or Ctrl-C: start no other, stop those running
            children.stop()
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        finally:
            pool.shutdown(wait=True)
        return result_document(config, {key: configuration_counts(*found) for key, found in done.items()})
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
        "view": "caller" if caller_only else "all",
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


def configuration_counts(child: Dict[str, Any], dumps: Dict[int, int]) -> Dict[str, Any]:
    """One process's counts: ``{"plain": [Ir per pair], "instrumented": [...], "run": child's run,
    "versions", "model", "parameters"}``, from its dumps read by their labels (``"NAME plain I"``,
    ``"NAME instrumented I"``; the others are not read)."""
    counts: Dict[str, List[int]] = {"plain": [], "instrumented": []}
    for number, label in enumerate(child["labels"], 1):
        parts = label.rsplit(" ", 2)
        if len(parts) == 3 and parts[1] in counts:
            counts[parts[1]].append(dumps[number])
    (name,) = child["configurations"]
    return {**counts, "run": child["runs"][name], **{key: child[key] for key in ("versions", "model", "parameters")}}


def _arm_figures(plain: Sequence[int], instrumented: Sequence[int], steps: int) -> Dict[str, Any]:
    """Per call, mean over the pairs; added = instrumented - plain, pair by pair."""
    pairs = min(len(plain), len(instrumented))
    if pairs == 0:
        raise BenchUsageError("the process under valgrind counted no pair of calls")
    added = [instrumented[i] - plain[i] for i in range(pairs)]
    plain_mean = sum(plain[:pairs]) / pairs
    mean_added = sum(added) / pairs
    ordered = sorted(added)
    middle = pairs // 2
    median = ordered[middle] if pairs % 2 else (ordered[middle - 1] + ordered[middle]) / 2
    return {
        "plain_per_call": plain_mean,
        "instructions_per_call": sum(instrumented[:pairs]) / pairs,
        "added_per_call": mean_added,
        "added_percent": 100.0 * mean_added / plain_mean,
        "added_per_step": mean_added / steps if steps else None,
        "added_median_per_call": median,
        "added_min_per_call": ordered[0],
        "added_max_per_call": ordered[-1],
        "pairs": pairs,
    }


def result_document(config: BenchConfig, counts: Dict[Tuple[str, str], Dict[str, Any]]) -> Dict[str, Any]:
    """The JSON document: one row per configuration (in :data:`CONFIGURATIONS` order), its figures for
    all threads and (``caller_*``) for the caller's thread, from :func:`configuration_counts` of its two
    processes (``(name, "all")`` and ``(name, "caller")``)."""
    names = [name for name in CONFIGURATIONS if (name, "all") in counts]
    rows: List[Dict[str, Any]] = []
    first: Optional[Dict[str, Any]] = None
    for name in names:
        every, caller = counts[(name, "all")], counts[(name, "caller")]
        first = first or every
        run = every["run"]
        steps = run["steps"]
        row: Dict[str, Any] = {"configuration": name, "description": CONFIGURATIONS[name][0], "steps_per_call": steps}
        row.update(_arm_figures(every["plain"], every["instrumented"], steps))
        row["instructions_per_step"] = row["instructions_per_call"] / steps if steps else None
        row.update(
            {
                f"caller_{key}": value
                for key, value in _arm_figures(caller["plain"], caller["instrumented"], steps).items()
            }
        )
        row["spans_per_call"] = run["spans_per_call"]
        row["spans_expected_per_call"] = run["spans_expected_per_call"]
        row["outputs_identical"] = bool(run["outputs_identical"]) and bool(caller["run"]["outputs_identical"])
        rows.append(row)
    if first is None:
        raise BenchUsageError("no configuration was counted")
    return {
        "mode": "instructions",
        "versions": first["versions"],
        "valgrind": valgrind_version(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": list(config.argv),
        "method": (
            "per configuration, two processes under valgrind --tool=callgrind --instr-atstart=no (as many at a time "
            f"as there are cores, at most {MAX_PROCESSES}); in each: set up once, {config.warmup} warmup pairs "
            f"uncounted, then {config.pairs} pairs of a plain call (suppress_instrumentation()) and an instrumented "
            f"call, each in a callgrind dump of its own (os.getloadavg() marks the borders, --dump-before={MARKER}); "
            "added per call = mean over the pairs of instrumented - plain; caller_*: --separate-threads=yes, the "
            "main thread's dumps, the providers flushed between pairs; the plain fields: every thread, each call "
            "followed by a flush in its own dump; "
            f"BatchSpanProcessor(schedule_delay_millis={EXPORT_DELAY_MILLIS}): spans exported when 512 are queued "
            "or at a flush, not on a timer"
        ),
        "environment": dict(SINGLE_THREAD_ENV, **HASH_SEED_ENV, torch_threads=config.threads),
        "machine": machine("cpu"),
        "model": first["model"],
        "parameters": first["parameters"],
        "device": "cpu",
        "dtype": config.dtype,
        "prompt_tokens": config.prompt_tokens,
        "new_tokens_requested": config.new_tokens,
        "batch_size": config.batch_size,
        "warmup": config.warmup,
        "pairs": config.pairs,
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
        f"  callgrind, {result['pairs']} pairs of a plain and an instrumented call per configuration, each "
        f"configuration in its own process; exporter {result['exporter']}",
    ]
    for title, prefix in (
        ("the caller's thread (the thread that calls generate())", "caller_"),
        ("all threads (the caller's, the background emitter's, the span processor's)", ""),
    ):
        lines.append(f"  {title}:")
        lines.append(
            f"  {'configuration':<18}{'plain/call':>14}{'added/call':>13}{'added':>9}{'added/step':>12}"
            f"{'pairs: min .. max added':>28}"
        )
        for row in rows:
            lines.append(
                f"  {row['configuration']:<18}{row[prefix + 'plain_per_call']:>14,.0f}"
                f"{row[prefix + 'added_per_call']:>+13,.0f}{row[prefix + 'added_percent']:>+8.3f}%"
                f"{(row[prefix + 'added_per_step'] or 0):>+12,.0f}"
                f"{row[prefix + 'added_min_per_call']:>+15,.0f} .. {row[prefix + 'added_max_per_call']:<+11,.0f}"
            )
    mismatched = [
        row["configuration"]
        for row in rows
        if row["spans_expected_per_call"] is not None and row["spans_per_call"] != row["spans_expected_per_call"]
    ]
    if mismatched:
        lines.append(f"  WARNING: spans exported differ from those expected in {', '.join(mismatched)}")
    if not all(row["outputs_identical"] for row in rows):
        lines.append("  WARNING: some instrumented outputs differ from plain generate()'s")
    lines.append(f"  {result['note']}")
    return "\n".join(lines)
