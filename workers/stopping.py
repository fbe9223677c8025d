"""The coordinator's SIGTERM, as a worker running a program sees it.

The coordinator stops a bash call by signalling the worker's process group: SIGTERM, then
SIGKILL once its grace period (``ExecutionContext.grace_s``) is over. The command takes the
SIGTERM as any program would. The worker survives it (runtime.serve installs ``on_signal``) so
that what the command printed until then is not lost: bash's pump (workers.tools.bash) wakes up
on ``fileno()``, lets the command use most of its grace to exit, then kills what is left itself,
and the runtime answers with the output so far (``Result.stopped``) before the SIGKILL comes.
"""

from __future__ import annotations

import os
import time

#: Share of the grace period the command gets after SIGTERM before the worker kills it; the
#: rest is for the worker to drain the pipes and answer before the coordinator's SIGKILL.
COMMAND_SHARE = 0.8


class StopRequest:
    """Whether (and when) the coordinator's SIGTERM arrived, readable as a file descriptor."""

    def __init__(self) -> None:
        # A pipe, not signal.set_wakeup_fd: that would also wake for signals we do not handle.
        self._read_fd, self._write_fd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.at: float | None = None

    def on_signal(self, signum: int, frame: object) -> None:
        if self.at is None:
            self.at = time.monotonic()
            os.write(self._write_fd, b"\0")

    def fileno(self) -> int:
        """Readable once the stop was requested (for a selector)."""
        return self._read_fd

    def deadline(self, grace_s: float) -> float | None:
        """When the worker should kill the command itself (None: not asked to stop)."""
        return None if self.at is None else self.at + grace_s * COMMAND_SHARE


#: This worker's stop request (set by runtime.serve; None outside a worker).
current: StopRequest | None = None
