"""One call's state on this machine's pool, shared by its driver task and the receive path."""

from __future__ import annotations

import asyncio
import secrets
import signal
from typing import TYPE_CHECKING, Any

from sandbx_pool.call_life import CallLife
from sandbx_pool.logs import logger
from sandbx_pool.output import OutputCallback, OutputChunk
from sandbx_pool.worker_handle import Worker
from sandbx_pool.workers.protocol import ExecutionContext, Limits, Output, Result

if TYPE_CHECKING:
    from sandbx_pool.images.image import Image
    from sandbx_pool.layers import Layer


class CallState(CallLife):
    """One call on this machine's pool: its life (call_life), and what its driver task and the
    receive path share: the worker it is given, its Result, its output callback."""

    #: Whether the tool is one of the coordinator's own (a service's ``_service``): Pool.call
    #: never makes such a call, so no caller can name one.
    internal = False

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
        super().__init__(call_id, tool, raw_args, timeout_s, cwd, workspace)
        loop = asyncio.get_running_loop()
        self.env = env
        self.limits = limits
        self.view = view
        #: This call's network (Pool.call's ``network``), None: the pool's.
        self.network: bool | tuple[str, ...] | None = None
        self.context: ExecutionContext | None = None
        self.worker: Worker | None = None
        self.assigned: asyncio.Future[Worker] = loop.create_future()
        self.result: asyncio.Future[Result] = loop.create_future()
        # Only the worker this call is sent to learns it; its Result must carry it back.
        self.secret = secrets.token_hex(16)
        #: The caller's on_output: the worker streams only when there is one.
        self.on_output: OutputCallback | None = None
        #: Tracked and transactional calls that change files: their overlay's directory
        #: (sandbx_pool.changes), made once the call passed its checks.
        self.changes_dir: str | None = None
        #: A call in a layer (sandbx_pool.layers): its layer, whose directory and base the
        #: worker mounts as the call's workspace.
        self.layer: Layer | None = None
        self.layer_dir: str | None = None
        self.layer_base: str | None = None
        self.layer_mount: str | None = None
        #: A layer over an image: its layer directories (the overlay's lowers), and the image
        #: (its Env and WorkingDir: sandbx_pool.image_layer).
        self.layer_image: tuple[str, ...] | None = None
        self.image: Image | None = None
        #: Where the call starts when it names no cwd, relative paths in a view being the
        #: view's: an image's WorkingDir (sandbx_pool.image_layer.start_dir). None: the root.
        self.start_dir: str | None = None
        #: A session's bash call: the session's exports (sandbx_pool.sessions).
        self.session_env: dict[str, str] | None = None
        #: The network namespace of the session's service to run in (sandbx_pool.services).
        self.join_network: str | None = None
        #: Offline with a namespace of its own: TCP on its loopback allowed (a service).
        self.loopback = False

    def journaled_network(self) -> bool | list[str] | None:
        network = self.network
        return network if network is None or isinstance(network, bool) else list(network)

    def journaled_workspace(self) -> str | None:
        # A view's call: cwd and paths are the view's, the view is where they are.
        return self.view or self.workspace

    def shutdown_fields(self) -> dict[str, Any]:
        worker = self.worker
        return {"started": worker is not None, "worker_pid": worker.pid if worker else None}

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


def describe_exit(returncode: int) -> str:
    """How a process ended, from its subprocess-style return code: ``killed by SIGKILL``,
    ``exit status 70``."""
    if returncode >= 0:
        return f"exit status {returncode}"
    try:
        return f"killed by {signal.Signals(-returncode).name}"
    except ValueError:  # a signal the enum does not name (a real-time one)
        return f"killed by signal {-returncode}"


def crash_message(
    returncode: int, context: ExecutionContext, *, memory_killed: bool = False
) -> str:
    if memory_killed:
        return (
            f"memory limit exceeded ({context.limits.memory_bytes} bytes): the kernel killed"
            f" the worker ({describe_exit(returncode)})"
        )
    if returncode < 0:
        if returncode == -signal.SIGXCPU:
            return (
                f"CPU time limit exceeded ({context.limits.cpu_seconds} s):"
                f" {describe_exit(returncode)}"
            )
        return f"worker died without answering: {describe_exit(returncode)}"
    return f"worker exited with status {returncode} without answering"
