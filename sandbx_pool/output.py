"""Output of a running call, as its caller sees it: ``pool.call(..., on_output=callback)``.

    worker: bash's pump --Output (paced, bounded: workers.streaming)--> ROUTER
        --> Inbox: from the worker holding the call, with the call's secret
        --> CallState.deliver_output --> callback(OutputChunk) on the event loop

The coordinator keeps none of it: each chunk is handed to the callback as it is read, so what
a fast writer can make wait is bounded by the worker's pace, not by the coordinator. The
journal never sees output. The call's ``value`` still carries the kept head and tail of
everything; the chunks are for watching, and say where a flood was thinned (``dropped``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import msgspec


class OutputChunk(msgspec.Struct, frozen=True, kw_only=True):
    """Text a call's command wrote to ``stream``. ``dropped``: bytes of that stream, written
    just before ``data``, that were not streamed (the writer outpaced the stream's bound)."""

    call_id: str
    stream: Literal["stdout", "stderr"]
    data: str
    dropped: int = 0

    def display(self) -> str:
        """``data``, after a line saying what was not streamed, if anything was not."""
        if not self.dropped:
            return self.data
        return f"[... {self.dropped} bytes not streamed ...]\n{self.data}"


#: Called on the event loop with each chunk while the command runs; it should return quickly
#: (the loop serves every other call meanwhile). An exception it raises is logged, not raised.
OutputCallback = Callable[[OutputChunk], None]

__all__ = ["OutputCallback", "OutputChunk"]
