"""One call's state, shared by its caller, its driver task and the pool's receive path."""

from __future__ import annotations

import asyncio
import secrets
import signal
import time
from typing import Any

from sandbx_pool.logs import logger
from sandbx_pool.outcome import KilledBy, Outcome, Status
from sandbx_pool.output import OutputCallback, OutputChunk
from sandbx_pool.worker_handle import Worker
from sandbx_pool.workers.protocol import ExecutionContext, Limits, Output, Result


class CallState:
    """One call's state, shared by its caller, its driver task and the receive task."""

    def __init__(
        self,
        call_id: str,
        tool: str,
        raw_args: Any,
        timeout_s: float | None,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        limits: Limits | None = None,
        view: str | None = None,
        workspace: str | None = None,
    ) -> None:
        loop = asyncio.get_running_loop()
        self.call_id = call_id
        self.tool = tool
        self.raw_args = raw_args
        self.timeout_s = timeout_s
        self.cwd = cwd
        self.env = env
        self.limits = limits
        self.view = view
        #: The absolute workspace this call is confined to: the pool's, unless the call named
        #: its own (a node's pool serves every workspace on its node: integrations.ray).
        self.workspace = workspace
        self.started_at = time.monotonic()
        self.context: ExecutionContext | None = None
        self.worker: Worker | None = None
        self.assigned: asyncio.Future[Worker] = loop.create_future()
        self.result: asyncio.Future[Result] = loop.create_future()
        self.kill_requested: asyncio.Future[None] = loop.create_future()
        self.killer: KilledBy | None = None
        self.reason: str | None = None
        # Only the worker this call is sent to learns it; its Result must carry it back.
        self.secret = secrets.token_hex(16)
        #: The caller's on_output: the worker streams only when there is one.
        self.on_output: OutputCallback | None = None

    def request_kill(self, killer: KilledBy, reason: str | None = None) -> None:
        # The first killer wins and is recorded here, before any signal is sent.
        if self.killer is None and not self.kill_requested.done():
            self.killer = killer
            self.reason = reason
            self.kill_requested.set_result(None)

    def deliver_output(self, message: Output) -> None:
        """Hand a chunk of output to the caller's callback, now; a callback that raises
        loses its chunk, never the call."""
        if self.on_output is None:
            return
        chunk = OutputChunk(
            call_id=self.call_id, stream=message.stream, data=message.data, dropped=message.dropped
        )
        try:
            self.on_output(chunk)
        except Exception:
            logger.exception("call {}: the on_output callback raised", self.call_id)

    def outcome(self, status: Status, **fields: Any) -> Outcome:
        return Outcome(
            call_id=self.call_id,
            tool=self.tool,
            status=status,
            duration_s=time.monotonic() - self.started_at,
            **fields,
        )


def describe_exit(returncode: int) -> str:
    """How a process ended, from its subprocess-style return code: ``killed by SIGKILL``,
    ``exit status 70``."""
    if returncode >= 0:
        return f"exit status {returncode}"
    try:
        return f"killed by {signal.Signals(-returncode).name}"
    except ValueError:  # a signal the enum does not name (a real-time one)
        return f"killed by signal {-returncode}"


def crash_message(returncode: int, context: ExecutionContext) -> str:
    if returncode < 0:
        if returncode == -signal.SIGXCPU:
            return (
                f"CPU time limit exceeded ({context.limits.cpu_seconds} s):"
                f" {describe_exit(returncode)}"
            )
        return f"worker died without answering: {describe_exit(returncode)}"
    return f"worker exited with status {returncode} without answering"
