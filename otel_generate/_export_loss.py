"""Spans lost by the OTLP gRPC exporter, said on this package's logger.

The OTLP gRPC exporters of traces, metrics and logs log through one logger, :data:`EXPORTER_LOGGER`,
and a filter on that logger drops a record whose message template, level and 20-second window equal
those of the last record it let through. The exporters share their templates: when the Collector is
down and the metrics exporter gives up on a batch shortly before the traces exporter does (both
export at exit, side by side), the exporter's ``Failed to export traces to ...`` ERROR is dropped, and
spans are lost without a line.

:func:`enable` puts a :class:`GiveUpWatch` first among that logger's filters. The logger is looked
up by name: nothing of the exporter is imported, and an exporter imported later adds its filter
behind the watch. The watch drops and changes nothing. When it sees the exporter give up on a batch
of traces (an ERROR record whose message starts ``Failed to export`` and whose first argument is
``"traces"``, in every exporter release from 1.37 on), it logs one ERROR on this package's logger,
which has no such filter::

    otel_generate: spans lost: the OTLP gRPC exporter gave up on a batch of traces to localhost:4317
    (StatusCode.UNAVAILABLE); its spans are not exported

:func:`disable` removes the watch. A record the exporter logger never handles (its level set above
ERROR, ``logging.disable``) is not seen, and then neither line appears.
"""

from __future__ import annotations

import logging
import threading
from typing import Optional

from otel_generate._faults import LOGGER_NAME

#: The logger of the OTLP gRPC exporters of every signal (their module's name).
EXPORTER_LOGGER = "opentelemetry.exporter.otlp.proto.grpc.exporter"
#: How the exporter's message starts when it gives up on a batch (its retries and timeout spent).
GIVE_UP = "Failed to export"
#: The signal this package's spans travel in, as the exporter names it.
TRACES = "traces"
#: This package's line: the endpoint and the status code, as the exporter gives them.
LOST = (
    "otel_generate: spans lost: the OTLP gRPC exporter gave up on a batch of traces to %s (%s); "
    "its spans are not exported"
)

_LOG = logging.getLogger(LOGGER_NAME)
_lock = threading.Lock()


class GiveUpWatch(logging.Filter):
    """A filter that lets every record through, and says when a batch of traces was given up."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            args = record.args
            if (
                record.levelno >= logging.ERROR
                and isinstance(record.msg, str)
                and record.msg.startswith(GIVE_UP)
                and isinstance(args, tuple)
                and len(args) >= 3
                and args[0] == TRACES
            ):
                _LOG.error(LOST, args[1], args[2])
        except Exception:  # never in the way of the exporter's own logging
            pass
        return True


_watch: Optional[GiveUpWatch] = None


def enable() -> None:
    """Put the watch first among the exporter logger's filters (once)."""
    global _watch
    with _lock:
        logger = logging.getLogger(EXPORTER_LOGGER)
        if _watch is None:
            _watch = GiveUpWatch()
        if _watch not in logger.filters:
            logger.filters.insert(0, _watch)


def disable() -> None:
    """Remove the watch."""
    with _lock:
        if _watch is not None:
            logging.getLogger(EXPORTER_LOGGER).removeFilter(_watch)
