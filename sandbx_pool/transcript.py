"""A service's output by byte offset, bounded: its head and its tail kept, the middle counted.

    Output chunks (sandbx_pool.services, in arrival order) --> add(data, dropped)
        the first KEEP_OUTPUT_BYTES / 2 bytes: the head, kept for good
        after it: pieces (offset, bytes), the oldest dropped past KEEP_OUTPUT_BYTES / 2
    read(since) --> what is held from that offset, a marker line where a gap is, the total

A reader that polls with the offset it was last given gets each byte once while it keeps up,
and a marker saying how much it missed when it does not; memory never grows past the bound
(plus one chunk) whatever the service writes.
"""

from __future__ import annotations

#: Bytes of a service's output kept: the first half of this and the last half, the bytes in
#: between counted. An idle server holds a few KiB; a flood never more than this.
KEEP_OUTPUT_BYTES = 1024 * 1024


class Transcript:
    """A service's output by byte offset: its head and its tail, the middle counted."""

    def __init__(self, keep: int = KEEP_OUTPUT_BYTES) -> None:
        self.head_cap = keep // 2
        self.tail_cap = keep - self.head_cap
        self.head = bytearray()
        #: (offset, bytes) pieces after the head, oldest first, at most about tail_cap bytes.
        self.tail: list[tuple[int, bytes]] = []
        self.tail_bytes = 0
        self.total = 0
        #: Bytes written and no longer held (dropped by the worker's stream bound, or trimmed).
        self.omitted = 0

    def add(self, data: bytes, dropped: int = 0) -> None:
        """``data``, then a gap of ``dropped`` bytes (the worker's sink keeps the first bytes
        of an interval and counts the rest; a service's drops none unless its sink broke)."""
        self._add(data)
        self.total += dropped
        self.omitted += dropped

    def _add(self, data: bytes) -> None:
        if not data:
            return
        if self.total == len(self.head) and len(self.head) < self.head_cap:
            room = self.head_cap - len(self.head)
            self.head += data[:room]
            self.total += len(data[:room])
            data = data[room:]
        if data:
            self.tail.append((self.total, bytes(data)))
            self.total += len(data)
            self.tail_bytes += len(data)
            while self.tail_bytes > self.tail_cap and len(self.tail) > 1:
                _, oldest = self.tail.pop(0)
                self.tail_bytes -= len(oldest)
                self.omitted += len(oldest)

    def read(self, since: int) -> tuple[bytes, int]:
        """The bytes from offset ``since`` that are held, a marker line where some are not."""
        pieces = [(0, bytes(self.head)), *self.tail]
        out = bytearray()
        at = since
        for start, data in pieces:
            end = start + len(data)
            if end <= at or not data:
                continue
            if start > at:
                out += f"\n[... {start - at} bytes omitted ...]\n".encode()
                at = start
            out += data[at - start :]
            at = end
        if at < self.total:
            out += f"\n[... {self.total - at} bytes omitted ...]\n".encode()
        return bytes(out), self.total


__all__ = ["KEEP_OUTPUT_BYTES", "Transcript"]
