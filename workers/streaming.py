"""A running command's output on its way to the caller, as it comes (``Call.stream_output``).

    bash's pump --add(stream, bytes)--> OutputSink: per stream, a pending buffer of at most
        CHUNK_BYTES (what does not fit is counted as dropped, not kept)
        --flush() when due--> Output(stream, data, dropped) --DEALER--> coordinator
        --> the caller's on_output, on its event loop

Why a bound and a pace: the coordinator hands each Output to the caller's callback as it is
read and keeps nothing, so what could pile up is what waits in the sockets between us. One
message per stream per FLUSH_INTERVAL_S, each at most CHUNK_BYTES, caps the rate at about
1.3 MB/s per stream whatever the command writes (a flood of 100 MB/s included): a person, an
MCP client or a log file reads that much, and the call's ``value`` still has the head and tail
of everything (workers.tools.bash). Bytes past the bound are dropped and counted
(``Output.dropped``), so a reader can say where output is missing.

Latency: output waiting for a quiet stream is sent at once; under a steady writer, one
message each FLUSH_INTERVAL_S, so a chunk reaches the caller within about 25 ms plus transit.
"""

from __future__ import annotations

import codecs
import time
from collections.abc import Callable
from typing import Literal

from sandbx_pool.workers.protocol import Output, encoder

#: Most bytes of one stream in one Output message (and pending between two).
CHUNK_BYTES = 32 * 1024

#: Shortest time between two messages of the sink: coalesces a fast writer's reads.
FLUSH_INTERVAL_S = 0.025

Stream = Literal["stdout", "stderr"]
STREAMS: tuple[Stream, ...] = ("stdout", "stderr")


class OutputSink:
    """Collects a command's output and sends it as ``Output`` messages through ``send``."""

    def __init__(self, send: Callable[[bytes], None], *, call_id: str, secret: str) -> None:
        self._send = send
        self._call_id = call_id
        self._secret = secret
        self._pending = {stream: bytearray() for stream in STREAMS}
        self._dropped = dict.fromkeys(STREAMS, 0)
        # Incremental: a UTF-8 character split between two reads is sent whole, once.
        self._decoders = {
            stream: codecs.getincrementaldecoder("utf-8")(errors="replace") for stream in STREAMS
        }
        self._last_flush = 0.0
        self.broken = False

    def add(self, stream: Stream, data: bytes) -> None:
        pending = self._pending[stream]
        room = CHUNK_BYTES - len(pending)
        if len(data) > room:
            self._dropped[stream] += len(data) - room
            data = data[:room]
        pending += data

    def room(self, stream: Stream) -> int:
        """Bytes of ``stream`` the sink takes before its next flush without dropping any."""
        return CHUNK_BYTES - len(self._pending[stream])

    def due_in(self) -> float | None:
        """Seconds until a flush is due (0: now); None when nothing waits."""
        if not any(self._pending.values()) and not any(self._dropped.values()):
            return None
        return max(0.0, self._last_flush + FLUSH_INTERVAL_S - time.monotonic())

    def flush(self, *, final: bool = False) -> None:
        """Send what waits. A send that fails (the coordinator is gone or stopped reading)
        ends streaming for this call; the command runs on and its Result says the rest."""
        for stream in STREAMS:
            pending, dropped = self._pending[stream], self._dropped[stream]
            if not pending and not dropped and not final:
                continue
            decoder = self._decoders[stream]
            text = decoder.decode(bytes(pending), final=final)
            if dropped:
                decoder.reset()  # what follows the gap starts afresh
            pending.clear()
            self._dropped[stream] = 0
            if (text or dropped) and not self.broken:
                message = Output(
                    call_id=self._call_id,
                    stream=stream,
                    data=text,
                    dropped=dropped,
                    secret=self._secret,
                )
                try:
                    self._send(encoder.encode(message))
                except OSError:
                    self.broken = True
        self._last_flush = time.monotonic()

    def mark_started(self) -> None:
        """Tell the coordinator the command runs, confined (a service: workers.tools.service):
        an Output on ``stderr`` with nothing in it, which no command's output can be (a
        service's stdout and stderr share ``stdout``)."""
        message = Output(call_id=self._call_id, stream="stderr", data="", secret=self._secret)
        try:
            self._send(encoder.encode(message))
        except OSError:
            self.broken = True


#: This worker's sink, when its call asked for streaming (set by runtime.serve).
current: OutputSink | None = None
