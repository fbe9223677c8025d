"""``sandbx-pool mcp``: the tools as an MCP server on stdio, each call run by one Pool.

    MCP client --tools/call (JSON-RPC line on our stdin)--> SDK dispatcher: one task per request
        |  ToolServer.call_tool: pool.call(tool, args, cancel=token, timeout=T) in its own task
        |  ok -> plain text (result_text) + structuredContent;  other -> isError, status named
        |  bash, with a progressToken: notifications/progress carrying the new output meanwhile
        v
    response line on our stdout (the SDK's stdio transport; fds 0 and 1 point elsewhere meanwhile)

    client's notifications/cancelled --> SDK cancels that request's anyio scope
        --> call_tool cancels the call's CancelToken, waits (shielded) until the worker group is
            dead and the outcome journaled, and re-raises; the SDK sends no response for it.
    stdin EOF --> the SDK cancels every request in flight the same way, then ``run`` returns.
    TERM/INT/HUP/QUIT --> ``signals.Stopper`` closes the pool (killer ``shutdown``): each call in
        flight is answered as a ``cancelled`` tool error; then we stop reading stdin as if it
        had ended, and exit 128 + N with every worker gone (a second INT exits at once).

Why a token and not the task's cancellation: the SDK runs on anyio, whose cancel scopes deliver
the cancellation again at every turn of the loop until the task leaves the scope. ``Pool.call``
awaits its cleanup after the first CancelledError, so the second one cut that wait short: the
handler returned while the worker was still being killed. Instead the call runs in a task of its
own and the handler waits for it under a shielded scope, so a finished handler means a dead
worker group, and the token carries the reason (client cancel or shutdown) into the journal.

Why our own stdin reader: the SDK's reads stdin with a blocking readline in a worker thread that
nothing can interrupt, so after a signal the server waited for the client's next line (measured:
still running 3 s after SIGTERM with stdin open). ``_ClientLines`` waits for readability on the
event loop instead, so stopping it, or cancelling it, takes effect at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import select
import stat
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from importlib import metadata
from typing import Any, Final

import anyio
from mcp import types
from mcp.server import Server, ServerRequestContext
from mcp.server.stdio import stdio_server
from mcp.shared.exceptions import MCPError

from sandbx_pool.cancel import CancelToken
from sandbx_pool.config import Config
from sandbx_pool.errors import JournalError, JournalLocked, SandbxPoolError, WorkspaceError
from sandbx_pool.integrations.result_text import bash_output, result_text
from sandbx_pool.logs import logger
from sandbx_pool.outcome import Outcome, Status
from sandbx_pool.output import OutputChunk
from sandbx_pool.pool import Pool
from sandbx_pool.signals import Stopper, run_until_signalled
from sandbx_pool.tool_definitions import tool_definitions
from sandbx_pool.workers.schemas import TOOL_ARGS

#: Bytes read from stdin at a time; a request line longer than this is assembled from several.
READ_CHUNK: Final = 64 * 1024

#: Characters of a bash call's output waiting to be sent as progress before more is dropped.
PROGRESS_BACKLOG: Final = 256 * 1024

#: Every call's deadline when neither ``--timeout`` nor the config's ``calls.timeout_s`` sets
#: one: a model's ``sleep 1000`` must not run until the client gives up (some never do). Ten
#: minutes covers a long build or test run.
DEFAULT_TIMEOUT_S: Final = 600.0

#: What each non-ok status means, after the status itself, in the text a model reads.
_STATUS_TEXT: Final[dict[Status, str]] = {
    Status.ERROR: "the tool failed",
    Status.DENIED: "refused by the sandbox policy; nothing was done",
    Status.CANCELLED: "the call was cancelled",
    Status.TIMEOUT: "the call ran out of time",
    Status.OUTPUT_LIMIT: "the call produced more output than allowed",
    Status.CRASHED: "the worker process died without answering",
}
_KILLED: Final = frozenset({Status.TIMEOUT, Status.OUTPUT_LIMIT, Status.CANCELLED})


def outcome_result(outcome: Outcome, args: dict[str, Any] | None = None) -> types.CallToolResult:
    """The MCP result for an outcome: text for the model, structured data for programs.

    ``ok``: the text is the value as a model reads it best (``result_text``: a file as it is, a
    command's stdout, then its stderr and exit code labelled, lists as lines) and
    ``structuredContent`` is the value itself. Any other status is a tool error (``isError``),
    so the model sees it and can adapt, with the status first in the text (and what a killed
    command printed until then) and the whole outcome as ``structuredContent``. ``_meta``
    carries the journal's call id. A tracked or transactional call's text ends with the paths
    it changed (``changes_text``), and ``_meta`` carries its change list.
    """
    meta: dict[str, Any] = {"sandbx-pool/call_id": outcome.call_id}
    if outcome.changes is not None:
        meta["sandbx-pool/changes"] = outcome.changes
    if outcome.status is Status.OK:
        value = outcome.value or {}
        text = result_text(outcome.tool, value, args) + changes_text(outcome)
        return types.CallToolResult(
            content=[types.TextContent(text=text)], structured_content=value, _meta=meta
        )
    return types.CallToolResult(
        content=[types.TextContent(text=error_text(outcome) + changes_text(outcome))],
        structured_content=outcome.to_dict(),
        is_error=True,
        _meta=meta,
    )


#: At most this many changed paths are named in a result's text (all are in ``_meta``).
CHANGES_SHOWN = 20


def changes_text(outcome: Outcome) -> str:
    """``[changed: a (created), b (modified)]`` on a line of its own, saying when the changes
    were not applied; empty when the call was made in direct mode or changed nothing."""
    if not outcome.changes:
        return ""
    named = [f"{change['path']} ({change['kind']})" for change in outcome.changes[:CHANGES_SHOWN]]
    more = len(outcome.changes) - len(named)
    if more:
        named.append(f"and {more} more")
    applied = all(change.get("applied") for change in outcome.changes)
    label = "changed" if applied else "changed, not applied to the workspace"
    return f"\n[{label}: {', '.join(named)}]"


def error_text(outcome: Outcome) -> str:
    """``<status>: <what happened>``, e.g. ``timeout: timed out after 5 s; ... killed``, then
    what a stopped bash command printed until then."""
    detail = outcome.error or outcome.reason or _STATUS_TEXT[outcome.status]
    text = f"{outcome.status.value}: {detail}"
    if outcome.status in _KILLED:
        text += (
            "; its processes were killed"
            if outcome.started
            else "; it was stopped before it started, nothing was done"
        )
    if outcome.quarantined:
        text += (
            f" (its worker is stuck in the kernel at {outcome.wchan or '?'} and is reaped later)"
        )
    value = outcome.value or {}
    if outcome.tool == "bash" and (value.get("stdout") or value.get("stderr")):
        text += "\n[output until then]\n" + bash_output(value)
    return text


class ToolServer:
    """The MCP handlers over one open Pool."""

    def __init__(
        self, pool: Pool, timeout: float = DEFAULT_TIMEOUT_S, session: str | None = None
    ) -> None:
        self.pool = pool
        #: Every call's deadline, in seconds.
        self.timeout = timeout
        #: ``mcp --session``: the shell session every call of this connection runs in
        #: (sandbx_pool.sessions): bash keeps its cd and exports, the file tools its cwd.
        self.session = session
        #: Why calls still in flight are being stopped, once the server itself is ending.
        self.closing: str | None = None
        self._tools = [types.Tool.model_validate(d) for d in tool_definitions("mcp")]

    def server(self) -> Server[Any]:
        state = (
            " bash keeps its working directory and exported variables from one call to the"
            " next (background jobs end with their call: bash's background=true starts a"
            " service that stays, until service_stop or the end of the connection), and"
            " relative paths start there."
            if self.session is not None
            else " Every bash call starts in the workspace root with a fresh environment."
        )
        return Server(
            "sandbx-pool",
            version=_version(),
            instructions=(
                f"Tools for the workspace {self.pool.workspace}. Relative paths start there;"
                " nothing outside it can be touched. Every call runs in a disposable process"
                " that is killed, with everything it started, when the call is cancelled." + state
            ),
            on_list_tools=self.list_tools,
            on_call_tool=self.call_tool,
        )

    async def list_tools(
        self, ctx: ServerRequestContext[Any], params: types.PaginatedRequestParams | None
    ) -> types.ListToolsResult:
        return types.ListToolsResult(tools=self._tools)

    async def call_tool(
        self, ctx: ServerRequestContext[Any], params: types.CallToolRequestParams
    ) -> types.CallToolResult:
        if params.name not in TOOL_ARGS:
            known = ", ".join(TOOL_ARGS)
            raise MCPError(types.INVALID_PARAMS, f"unknown tool {params.name!r} (known: {known})")
        arguments = params.arguments or {}
        if "user" in arguments:
            # Who a call runs as is the operator's choice ([sandbox] run_as), never the
            # client's: a model naming a service account would get that account's files. The
            # listed schemas do not offer it (tool_definitions.INTEGRATION_ONLY).
            raise MCPError(types.INVALID_PARAMS, f"{params.name}: 'user' is not an argument here")
        token = CancelToken()
        progress_token = (ctx.meta or {}).get("progress_token")
        progress = (
            _OutputProgress(ctx, progress_token)
            if progress_token is not None and params.name == "bash"
            else None
        )
        call = asyncio.create_task(
            self.pool.call(
                params.name,
                arguments,
                timeout=self.timeout,
                cancel=token,
                on_output=progress.add if progress is not None else None,
                session=self.session,
            ),
            name=f"mcp-request-{ctx.request_id}",
        )
        try:
            outcome = await asyncio.shield(call)
            if progress is not None:
                await progress.finish()  # every notification before the response
        except asyncio.CancelledError:
            reason = self.closing or f"the MCP client cancelled request {ctx.request_id}"
            token.cancel(reason)
            # Bounded: the pool releases a call after its kill wait even if the worker is stuck.
            with anyio.CancelScope(shield=True):
                await asyncio.wait([call])
            if not call.cancelled() and call.exception() is None:
                done = call.result()
                logger.info(
                    "request {}: {} {} ({})", ctx.request_id, done.tool, done.status, reason
                )
            raise
        except SandbxPoolError as exc:  # the pool itself is gone: not the tool's failure
            raise MCPError(types.INTERNAL_ERROR, f"sandbx-pool cannot run calls: {exc}") from exc
        finally:
            if progress is not None:
                progress.stop()
        return outcome_result(outcome, params.arguments)


class _OutputProgress:
    """A bash call's output as ``notifications/progress`` for the request's progress token:
    ``message`` is the new output, ``progress`` the characters sent so far.

    Chunks come on the loop (Pool.call's on_output) and are sent by one task, in order; what
    waits while the client reads slowly is coalesced into one notification, and bounded by
    PROGRESS_BACKLOG (past it, output is dropped and the next notification says so).
    """

    def __init__(self, ctx: ServerRequestContext[Any], token: str | int) -> None:
        self._ctx = ctx
        self._token = token
        self._pending: list[str] = []
        self._pending_chars = 0
        self._dropped = 0
        self._sent = 0
        self._wake = asyncio.Event()
        self._done = False
        self._task = asyncio.create_task(self._send_all())

    def add(self, chunk: OutputChunk) -> None:
        text = chunk.display()
        if self._pending_chars + len(text) > PROGRESS_BACKLOG:
            self._dropped += len(text)
        else:
            self._pending.append(text)
            self._pending_chars += len(text)
        self._wake.set()

    async def finish(self) -> None:
        self._done = True
        self._wake.set()
        await asyncio.wait([self._task])

    def stop(self) -> None:
        self._task.cancel()

    async def _send_all(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self._dropped:
                self._pending.insert(0, f"[... {self._dropped} characters not sent ...]\n")
                self._dropped = 0
            text = "".join(self._pending)
            self._pending.clear()
            self._pending_chars = 0
            if text:
                self._sent += len(text)
                await self._ctx.session.send_progress_notification(
                    self._token, self._sent, message=text, related_request_id=self._request_id
                )
            if self._done and not self._pending:
                return

    @property
    def _request_id(self) -> str | None:
        request_id = self._ctx.request_id
        return None if request_id is None else str(request_id)


class _ClientLines(anyio.AsyncFile[str]):
    """The client's end of stdin as lines, read on the event loop rather than in a thread."""

    def __init__(self, fd: int, on_eof: Callable[[], None]) -> None:
        # The wrapped file is never read (only __aiter__ is used); it makes this an AsyncFile.
        super().__init__(open(fd, encoding="utf-8", closefd=False))  # noqa: SIM115
        self._fd = fd
        self._on_eof = on_eof
        self._stopped = False
        self._never_blocks = _never_blocks(fd)

    def stop(self) -> None:
        """End the lines now, as if the client had closed stdin, but without ``on_eof``."""
        self._stopped = True
        anyio.notify_closing(self._fd)  # a wait_readable under way raises ClosedResourceError

    async def __aiter__(self) -> AsyncIterator[str]:
        pending = b""
        while not self._stopped:
            if not self._never_blocks:
                try:
                    await anyio.wait_readable(self._fd)
                except anyio.ClosedResourceError:
                    return
            chunk = os.read(self._fd, READ_CHUNK)  # readable: returns what is there, or b"" at EOF
            if not chunk:
                self._on_eof()
                if pending.strip():
                    yield pending.decode("utf-8", errors="replace")
                return
            *lines, pending = (pending + chunk).split(b"\n")
            for line in lines:
                yield line.decode("utf-8", errors="replace")


def _never_blocks(fd: int) -> bool:
    """Whether epoll refuses ``fd``: regular files (`mcp < requests.jsonl`) and /dev/null
    (`mcp < /dev/null`), whose reads never block anyway, so they are read without waiting."""
    if stat.S_ISREG(os.fstat(fd).st_mode):
        return True
    with select.epoll() as probe:
        try:
            probe.register(fd, select.EPOLLIN)
        except PermissionError:
            return True
    return False


@contextlib.contextmanager
def _client_stdio(
    on_eof: Callable[[], None],
) -> Iterator[tuple[_ClientLines, anyio.AsyncFile[str]]]:
    """The client's stdin and stdout as the SDK transport's streams, on private descriptors.

    Meanwhile fd 0 reads /dev/null and fd 1 writes to stderr (as the SDK's own stdio_server
    arranges): done before the pool starts, the template and its workers inherit those, never
    the wire, so nothing they do can steal the client's bytes or corrupt our output.
    """
    wire_in = _move_away(0, os.open(os.devnull, os.O_RDONLY))
    wire_out = _move_away(1, os.dup(2))
    try:
        with open(wire_out, "w", encoding="utf-8", closefd=False) as out:
            yield _ClientLines(wire_in, on_eof), anyio.wrap_file(out)
    finally:
        for fd, wire in ((0, wire_in), (1, wire_out)):
            os.dup2(wire, fd)
            os.close(wire)


def _move_away(fd: int, replacement: int) -> int:
    """Point ``fd`` at ``replacement``; return a private (close-on-exec) copy of what it was."""
    wire = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3)
    os.dup2(replacement, fd)
    os.close(replacement)
    return wire


async def serve(
    stopper: Stopper,
    workspace: str,
    config: Config,
    journal: str | None,
    call_timeout_s: float,
    session: str | None = None,
) -> int:
    """Serve MCP on stdin/stdout until the client closes stdin or a signal stops us."""
    pool = stopper.watch(Pool(workspace, journal=journal, config=config))
    tools = ToolServer(pool, call_timeout_s, session)

    def client_left() -> None:
        tools.closing = "MCP server shutting down: the client closed stdin"

    with _client_stdio(client_left) as (client_in, client_out):

        async def stop_on_signal() -> None:
            await stopper.stopping.wait()  # the Stopper is closing the pool, killing every call
            await pool.close()  # so each call in flight is answered "cancelled" first;
            client_in.stop()  # then we end as at EOF

        async with pool, anyio.create_task_group() as serving:
            serving.start_soon(stop_on_signal)
            async with stdio_server(client_in, client_out) as (reader, writer):
                logger.info("serving MCP on stdio for {}", pool.workspace)
                server = tools.server()
                await server.run(reader, writer, server.create_initialization_options())
            serving.cancel_scope.cancel()
    return 0


def run(
    workspace: str,
    config: Config,
    journal: str | None,
    *,
    timeout: float | None = None,
    session: str | None = None,
) -> int:
    """The ``mcp`` command: 0 when the client closed stdin, 128 + N after signal N.

    ``timeout``: every call's deadline (default: the config's ``calls.timeout_s``, else
    DEFAULT_TIMEOUT_S). ``session``: the shell session id every call runs in (``--session``;
    None: each bash call starts afresh)."""
    deadline = timeout or config.calls.timeout_s or DEFAULT_TIMEOUT_S
    try:
        return run_until_signalled(
            lambda stopper: serve(stopper, workspace, config, journal, deadline, session)
        )
    except (JournalError, JournalLocked, WorkspaceError) as exc:
        # The command's input, as a bad workspace is (exit 2, one line): a --journal that
        # cannot be opened, or that another pool holds.
        print(f"sandbx-pool mcp: {exc}", file=sys.stderr)
        return 2
    except SandbxPoolError as exc:
        logger.error("sandbx-pool mcp: {}", exc)
        return 1


def _version() -> str:
    try:
        return metadata.version("sandbx-pool")
    except metadata.PackageNotFoundError:
        return "0"
