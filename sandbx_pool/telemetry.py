"""OpenTelemetry: one span per call, sent over OTLP/HTTP, never in a call's way.

    CallLife.drive (call_life.py), once the call's outcome is journaled
        |  Telemetry.call_ended(life, outcome): a finished span, its start the call's, its
        |  attributes sandbx.*, its parent the batch's span (run_batch) if one is open
        v
    BatchSpanProcessor's queue (an append: the call goes on at once)
        |  its own thread, every SCHEDULE_MS or 512 spans: OTLPSpanExporter POSTs
        v
    [telemetry] otlp_endpoint + "/v1/traces" (protobuf ExportTraceServiceRequest)

Off unless ``[telemetry] otlp_endpoint`` is set, and then nothing of OpenTelemetry is even
imported: the SDK and its exporter (requests, protobuf) cost a one-shot ``sandbx-pool call``
more than the call itself. With it set, the ``otel`` extra must be installed (a ConfigError
saying so otherwise).

A dead collector (a closed port, or one that accepts and never answers) must never slow or
fail a call: spans are handed to the processor's queue only (a call never waits for an export),
each export gives up after ``export_timeout_s``, a full queue drops spans (the SDK logs it)
rather than blocking, and the pool's close waits for the last flush at most ``export_timeout_s``
plus a second, on a thread of its own: a shutdown stuck on the network is left behind, a
daemon, rather than held up.

The SDK reports a failed export through Python's ``logging``, once an export round (a second):
where nobody configured logging, that is a line on stderr each second, through a batch's
progress line. Then (and only then) its warnings go through this package's logger instead, at
most one per ``WARN_EVERY_S``, counting the ones left out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Final

from sandbx_pool.errors import ConfigError
from sandbx_pool.journal.costs import cpu_s
from sandbx_pool.logs import logger
from sandbx_pool.outcome import Outcome, Status

if TYPE_CHECKING:
    from sandbx_pool.call_life import CallLife
    from sandbx_pool.config import TelemetrySettings

#: How often the processor's thread exports what is queued (ms). Short: a batch's spans show
#: up while it runs, and few are left for close() to flush.
SCHEDULE_MS: Final = 1000

#: Spans queued at most; past it new ones are dropped (a collector that cannot keep up must
#: cost spans, never memory without bound or a call's time).
MAX_QUEUE: Final = 8192

#: Longest reason or error kept on a span.
TEXT_CHARS: Final = 256

#: The span of a call is named ``call <tool>``; a tool name is cut to this (the name is what
#: collectors index, and a model may write any tool name).
TOOL_CHARS: Final = 64

#: At most one of the SDK's own warnings (a failed export, a full queue) this often.
WARN_EVERY_S: Final = 30.0

#: Extra seconds close() waits beyond the export timeout for the last flush and shutdown.
CLOSE_GRACE_S: Final = 1.0


class Telemetry:
    """The pool's tracer and exporter. Made by ``open_telemetry``; one per pool."""

    def __init__(self, settings: TelemetrySettings) -> None:
        # Imported here and only here: nothing of OpenTelemetry loads without an endpoint.
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace import StatusCode, set_span_in_context

        assert settings.otlp_endpoint is not None
        self.endpoint = settings.otlp_endpoint.rstrip("/") + "/v1/traces"
        self.export_timeout_s = settings.export_timeout_s
        self._provider = TracerProvider(
            resource=Resource.create({"service.name": settings.service_name}),
            shutdown_on_exit=False,  # close() flushes, bounded; an exit never waits on a network
        )
        exporter = OTLPSpanExporter(endpoint=self.endpoint, timeout=settings.export_timeout_s)
        self._provider.add_span_processor(
            BatchSpanProcessor(
                exporter,
                max_queue_size=MAX_QUEUE,
                schedule_delay_millis=SCHEDULE_MS,
                export_timeout_millis=settings.export_timeout_s * 1000,
            )
        )
        self._tracer = self._provider.get_tracer("sandbx_pool")
        _forward_sdk_warnings()
        self._parent: Any = None  # the open batch's context, if any
        self._error = StatusCode.ERROR
        self._in_context = set_span_in_context
        self._closed = False

    def __repr__(self) -> str:
        return f"<Telemetry {self.endpoint}{' closed' if self._closed else ''}>"

    def call_ended(self, life: CallLife, outcome: Outcome) -> None:
        """The call's span, already finished: queued for export, nothing awaited."""
        if self._closed:
            return
        end_ns = time.time_ns()
        span = self._tracer.start_span(
            f"call {outcome.tool[:TOOL_CHARS]}",
            context=self._parent,
            start_time=life.started_at_ns,
            attributes=call_attributes(outcome),
        )
        if outcome.status != Status.OK:
            span.set_status(self._error, str(outcome.status))
        span.end(end_time=max(end_ns, life.started_at_ns))

    @contextlib.contextmanager
    def batch(self, name: str, **attributes: str | int | float | bool) -> Iterator[None]:
        """A span around a batch: every call that ends while it is open is its child."""
        span = self._tracer.start_span(name, attributes=attributes)
        earlier = self._parent
        self._parent = self._in_context(span)
        try:
            yield
        finally:
            self._parent = earlier
            span.end()

    async def close(self) -> None:
        """Export what is queued and stop, waiting at most ``export_timeout_s`` + 1 s."""
        if self._closed:
            return
        self._closed = True
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def shut() -> None:
            try:
                self._provider.force_flush(int(self.export_timeout_s * 1000))
                self._provider.shutdown()
            finally:
                with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits
                    loop.call_soon_threadsafe(_set_done, done)

        # Not the loop's executor: asyncio.run waits for its threads at exit, and this one
        # may be stuck on a collector that never answers.
        threading.Thread(target=shut, name="sandbx-telemetry-close", daemon=True).start()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(done), self.export_timeout_s + CLOSE_GRACE_S)


class _Forward(logging.Handler):
    """The SDK's warnings, through our logger, at most one per WARN_EVERY_S."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self._last = -math.inf
        self._left_out = 0

    def emit(self, record: logging.LogRecord) -> None:
        now = time.monotonic()
        if now - self._last < WARN_EVERY_S:
            self._left_out += 1
            return
        self._last, left_out, self._left_out = now, self._left_out, 0
        more = f" (and {left_out} more since the last)" if left_out else ""
        logger.warning("telemetry: {}{}", record.getMessage(), more)


_forwarding = threading.Lock()


def _forward_sdk_warnings() -> None:
    """Route OpenTelemetry's logger to ours, once, unless the application configured logging
    (a handler on the root or on ``opentelemetry``: then it is theirs to show)."""
    sdk = logging.getLogger("opentelemetry")
    with _forwarding:
        if sdk.handlers or logging.getLogger().handlers:
            return
        sdk.addHandler(_Forward())
        sdk.propagate = False


def _set_done(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def call_attributes(outcome: Outcome) -> dict[str, str | int | float | bool]:
    """A call's span attributes, ``sandbx.*``; facts the outcome lacks are left out
    (OpenTelemetry has no null)."""
    found: dict[str, str | int | float | bool] = {
        "sandbx.call_id": outcome.call_id,
        "sandbx.tool": outcome.tool,
        "sandbx.status": str(outcome.status),
        "sandbx.duration_s": outcome.duration_s,
        "sandbx.started": outcome.started,
    }
    optional: dict[str, Any] = {
        "sandbx.killed_by": None if outcome.killed_by is None else str(outcome.killed_by),
        "sandbx.worker_pid": outcome.worker_pid,
        "sandbx.node": outcome.node,
        "sandbx.exit_code": _exit_code(outcome.value),
        "sandbx.reason": _clip(outcome.reason),
        "sandbx.error": _clip(outcome.error),
        "sandbx.signal": outcome.signal,
        "sandbx.limit": outcome.limit,
        "sandbx.cpu_s": None if outcome.usage is None else round(cpu_s(outcome.usage), 6),
        "sandbx.max_rss_bytes": None if outcome.usage is None else outcome.usage["max_rss_bytes"],
    }
    found.update({key: value for key, value in optional.items() if value is not None})
    if outcome.quarantined:
        found["sandbx.quarantined"] = True
    return found


def _exit_code(value: dict[str, Any] | None) -> int | None:
    code = value.get("exit_code") if value else None
    return code if isinstance(code, int) and not isinstance(code, bool) else None


def _clip(text: str | None) -> str | None:
    return text if text is None or len(text) <= TEXT_CHARS else text[:TEXT_CHARS] + "..."


def open_telemetry(settings: TelemetrySettings) -> Telemetry | None:
    """The pool's Telemetry, or None when no endpoint is set (nothing is imported then)."""
    if settings.otlp_endpoint is None:
        return None
    try:
        return Telemetry(settings)
    except ImportError as exc:
        raise ConfigError(
            f"[telemetry] otlp_endpoint is set but OpenTelemetry is not installed ({exc.name}):"
            " pip install 'sandbx-pool[otel]'"
        ) from None
