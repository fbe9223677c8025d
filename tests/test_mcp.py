"""``sandbx-pool mcp`` driven by the official MCP SDK client over stdio, against a real server.

Each test starts the server as a subprocess (``python -m sandbx_pool.cli mcp``), talks to it
through ``mcp.ClientSession`` and looks at the processes and the journal it leaves. A tap on the
client's streams records every message on the wire, to check what was (not) sent.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest
from anyio.abc import Process
from conftest import MARKER, marked_config
from helpers import (
    fifo_has_reader,
    pids_with,
    procfs_shows_workers,
    tagged_sleep,
    unique_tag,
    wait_until,
)
from mcp import Client, ClientSession, StdioServerParameters, stdio_client, types
from mcp.shared.exceptions import MCPError
from mcp.shared.message import SessionMessage

from sandbx_pool import Pool
from sandbx_pool.integrations.mcp import DEFAULT_TIMEOUT_S, error_text, outcome_result
from sandbx_pool.outcome import KilledBy, Outcome, Status
from sandbx_pool.tool_definitions import INTEGRATION_ONLY, tool_parameters
from sandbx_pool.workers.schemas import TOOL_ARGS, tool_schemas

REPO = Path(__file__).resolve().parent.parent

#: A hang guard, not a timing check: a server that does not exit fails the test instead of
#: blocking the run (it exits in about half a second).
EXIT_WITHIN_S = 60


@dataclass
class Wire:
    """Every JSON-RPC message seen between the client session and the server."""

    sent: list[Any] = field(default_factory=list)
    received: list[Any] = field(default_factory=list)

    def cancelled_ids(self) -> list[Any]:
        return [
            m.params["requestId"]
            for m in self.sent
            if isinstance(m, types.JSONRPCNotification) and m.method == "notifications/cancelled"
        ]

    def answered_ids(self) -> set[Any]:
        return {
            m.id for m in self.received if isinstance(m, types.JSONRPCResponse | types.JSONRPCError)
        }

    def call_ids(self, tool: str) -> list[Any]:
        return [
            m.id
            for m in self.sent
            if isinstance(m, types.JSONRPCRequest)
            and m.method == "tools/call"
            and m.params is not None
            and m.params["name"] == tool
        ]


@dataclass
class ServerSetup:
    workspace: Path
    journal: Path
    config: Path
    flags: list[str] = field(default_factory=list)

    def argv(self) -> list[str]:
        return [
            "-m",
            "sandbx_pool.cli",
            "mcp",
            "--workspace",
            str(self.workspace),
            "--config",
            str(self.config),
            "--journal",
            str(self.journal),
            *self.flags,
        ]

    def outcomes(self) -> list[dict[str, Any]]:
        if not self.journal.exists():
            return []
        records = [json.loads(line) for line in self.journal.read_text().splitlines() if line]
        return [r for r in records if r.get("kind") == "outcome"]


@pytest.fixture
def server(workspace: Path, tmp_path: Path) -> ServerSetup:
    # The marker reaches the server through its environment and bash through the config, so
    # the leftover-process check can tell our processes from anyone else's.
    config = tmp_path / "mcp.toml"
    config.write_text(
        f'[pool]\nworkers = 4\n\n[env]\nset = {{ {MARKER} = "{os.environ[MARKER]}" }}\n'
    )
    return ServerSetup(workspace, tmp_path / "journal.jsonl", config)


async def _pump(source: Any, sink: Any, log: list[Any]) -> None:
    async with source, sink:
        async for item in source:
            if isinstance(item, SessionMessage):
                log.append(item.message)
            await sink.send(item)


@asynccontextmanager
async def tapped_session(
    read_stream: Any, write_stream: Any
) -> AsyncIterator[tuple[ClientSession, Wire]]:
    """An initialized ClientSession whose every message in and out is recorded in a Wire."""
    wire = Wire()
    inbound_send, inbound = anyio.create_memory_object_stream[Any](0)
    outbound, outbound_receive = anyio.create_memory_object_stream[Any](0)
    async with anyio.create_task_group() as group:
        group.start_soon(_pump, read_stream, inbound_send, wire.received)
        group.start_soon(_pump, outbound_receive, write_stream, wire.sent)
        async with ClientSession(inbound, outbound) as session:
            await session.initialize()
            yield session, wire
        group.cancel_scope.cancel()


@asynccontextmanager
async def connect(server: ServerSetup) -> AsyncIterator[tuple[ClientSession, Wire]]:
    """The SDK's own stdio client: it spawns the server and stops it when the block ends."""
    params = StdioServerParameters(
        command=sys.executable,
        args=server.argv(),
        env={MARKER: os.environ[MARKER]},
        cwd=REPO,
    )
    async with stdio_client(params) as streams, tapped_session(*streams) as connected:
        yield connected


@asynccontextmanager
async def spawned(server: ServerSetup) -> AsyncIterator[tuple[Process, ClientSession]]:
    """The server as our own child, so a test can close its stdin or signal it."""
    # Our environment, marker included, is the server's.
    process = await anyio.open_process([sys.executable, *server.argv()], cwd=REPO, stderr=None)
    assert process.stdin is not None
    assert process.stdout is not None
    to_client, read_stream = anyio.create_memory_object_stream[Any](0)
    write_stream, to_server = anyio.create_memory_object_stream[Any](0)

    async def read_lines() -> None:
        assert process.stdout is not None
        buffer = b""
        async with to_client:
            async for chunk in process.stdout:
                *lines, buffer = (buffer + chunk).split(b"\n")
                for line in lines:
                    message = types.jsonrpc_message_adapter.validate_json(line, by_name=False)
                    await to_client.send(SessionMessage(message))

    async def write_lines() -> None:
        assert process.stdin is not None
        async with to_server:
            async for item in to_server:
                line = item.message.model_dump_json(by_alias=True, exclude_unset=True) + "\n"
                await process.stdin.send(line.encode())

    try:
        async with anyio.create_task_group() as group:
            group.start_soon(read_lines)
            group.start_soon(write_lines)
            async with ClientSession(read_stream, write_stream) as session:
                await session.initialize()
                yield process, session
            group.cancel_scope.cancel()
    finally:
        if process.returncode is None:
            process.kill()
        await process.aclose()


#: fifo_holders looks in a worker's /proc/PID/fd, which a worker (not dumpable) hides from a
#: test without CAP_SYS_PTRACE over it: an unprivileged user, a container's root.
needs_procfs = pytest.mark.skipif(
    not procfs_shows_workers(), reason="/proc hides the worker's descriptors (no CAP_SYS_PTRACE)"
)


def fifo_holders(path: Path) -> list[int]:
    """Processes other than this one that have ``path`` open, found without touching it.

    ``fifo_has_reader`` opens the FIFO for writing, which would release a reader blocked in
    open(): so while a worker must stay blocked, look in /proc instead.
    """
    target = os.stat(path)
    holders = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            fds = os.listdir(f"/proc/{entry}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                st = os.stat(f"/proc/{entry}/fd/{fd}")
            except OSError:
                continue
            if (st.st_dev, st.st_ino) == (target.st_dev, target.st_ino):
                holders.append(int(entry))
                break
    return holders


@contextmanager
def held_open(fifo: Path) -> Iterator[int]:
    """Our own end of a FIFO (read-write, which never blocks), so a worker's open() returns
    and its read() blocks until we write, or forever."""
    fd = os.open(fifo, os.O_RDWR)
    try:
        yield fd
    finally:
        os.close(fd)


def text_of(result: types.CallToolResult) -> str:
    (block,) = result.content
    assert isinstance(block, types.TextContent)
    return block.text


# -- listing ------------------------------------------------------------------------------------


async def test_lists_the_seven_tools_with_the_schemas_the_pool_validates(
    server: ServerSetup,
) -> None:
    async with connect(server) as (session, _):
        listed = await session.list_tools()
    schemas = tool_schemas()
    assert [tool.name for tool in listed.tools] == list(schemas)
    for tool in listed.tools:
        schema = dict(schemas[tool.name])
        assert tool.description == schema.pop("description")
        # What a model may set, each described; integration-only fields stay in tools --json.
        properties = tool.input_schema["properties"]
        hidden = INTEGRATION_ONLY.get(tool.name, frozenset())
        assert set(properties) == set(schema["properties"]) - hidden
        assert all(properties[key] == schema["properties"][key] for key in properties)
        assert all(value.get("description") for value in properties.values()), tool.name
        assert not hidden & set(tool.input_schema.get("required", []))
        assert tool.annotations is not None
        readers = {"read", "ls", "grep", "find", "service_output"}
        assert tool.annotations.read_only_hint is (tool.name in readers)


# -- calls ----------------------------------------------------------------------------------------


async def test_calls_each_tool(server: ServerSetup, workspace: Path) -> None:
    async with connect(server) as (session, _):
        wrote = await session.call_tool("write", {"path": "notes/a.txt", "content": "one\ntwo\n"})
        edited = await session.call_tool(
            "edit", {"path": "notes/a.txt", "old_string": "two", "new_string": "deux"}
        )
        read = await session.call_tool("read", {"path": "notes/a.txt"})
        listed = await session.call_tool("ls", {"path": "notes"})
        grepped = await session.call_tool("grep", {"pattern": "deux"})
        found = await session.call_tool("find", {"pattern": "**/*.txt"})
        ran = await session.call_tool("bash", {"command": "echo out; echo err >&2; exit 3"})
    results = [wrote, edited, read, listed, grepped, found, ran]
    assert [r.is_error for r in results] == [False] * 7
    assert (workspace / "notes/a.txt").read_text() == "one\ndeux\n"
    assert wrote.structured_content is not None
    assert wrote.structured_content["bytes"] == 8
    assert edited.structured_content == {"replacements": 1}
    assert text_of(read) == "one\ndeux\n"  # a file is given to the model as itself
    assert read.structured_content is not None
    assert read.structured_content["content"] == "one\ndeux\n"
    # Plain text for the model, the value beside it for programs.
    assert text_of(wrote) == "created 8 bytes to notes/a.txt"
    assert text_of(edited) == "1 replacement in notes/a.txt"
    assert text_of(listed) == "a.txt"
    assert listed.structured_content is not None
    assert [e["name"] for e in listed.structured_content["entries"]] == ["a.txt"]
    assert text_of(grepped) == "notes/a.txt:2:deux"
    assert text_of(found) == "hello.txt\nnotes/a.txt"
    assert text_of(ran) == "out\n[stderr]\nerr\n[exit code 3]"
    assert ran.structured_content is not None
    assert ran.structured_content["exit_code"] == 3
    assert ran.structured_content["stdout"] == "out\n"
    assert ran.structured_content["stderr"] == "err\n"
    assert ran.meta is not None
    call_ids = {o["call_id"] for o in server.outcomes()}
    assert ran.meta["sandbx-pool/call_id"] in call_ids  # the journal's id, for correlation


async def test_failed_outcomes_are_tool_errors_naming_their_status(server: ServerSetup) -> None:
    async with connect(server) as (session, _):
        missing = await session.call_tool("read", {"path": "nope.txt"})
        outside = await session.call_tool("read", {"path": "../secret"})
        bad_args = await session.call_tool("read", {"path": 3})
    assert missing.is_error
    assert text_of(missing).startswith("error: ")
    assert "nope.txt" in text_of(missing)
    assert outside.is_error
    assert text_of(outside).startswith("denied: ")
    assert outside.structured_content is not None
    assert outside.structured_content["status"] == "denied"
    assert bad_args.is_error
    assert text_of(bad_args).startswith("error: bad arguments")


async def test_a_client_cannot_choose_the_user_a_call_runs_as(server: ServerSetup) -> None:
    async with connect(server) as (session, _):
        for tool, args in [("bash", {"command": "id -u"}), ("read", {"path": "hello.txt"})]:
            with pytest.raises(MCPError, match="'user' is not an argument"):
                await session.call_tool(tool, {**args, "user": "nobody"})
        still = await session.call_tool("bash", {"command": "id -u"})
    assert not still.is_error


async def test_an_unknown_tool_is_a_protocol_error(server: ServerSetup) -> None:
    async with connect(server) as (session, _):
        with pytest.raises(MCPError, match="unknown tool 'teleport'") as caught:
            await session.call_tool("teleport", {})
        assert caught.value.code == types.INVALID_PARAMS
        assert not (await session.call_tool("ls", {})).is_error


@pytest.mark.parametrize(
    ("outcome", "start"),
    [
        (Outcome(call_id="c", tool="bash", status=Status.TIMEOUT, started=True,
                 killed_by=KilledBy.TIMEOUT, reason="timed out after 5 s"),
         "timeout: timed out after 5 s; its processes were killed"),
        (Outcome(call_id="c", tool="bash", status=Status.OUTPUT_LIMIT, started=True,
                 error="output passed 1048576 bytes"),
         "output_limit: output passed 1048576 bytes; its processes were killed"),
        (Outcome(call_id="c", tool="write", status=Status.CANCELLED, reason="stop"),
         "cancelled: stop; it was stopped before it started, nothing was done"),
        (Outcome(call_id="c", tool="read", status=Status.CRASHED, started=True,
                 error="worker died without answering: killed by SIGKILL"),
         "crashed: worker died without answering: killed by SIGKILL"),
        (Outcome(call_id="c", tool="read", status=Status.CANCELLED, started=True,
                 quarantined=True, wchan="fuse_wait"),
         "cancelled: the call was cancelled; its processes were killed (its worker is stuck"),
    ],
)  # fmt: skip
def test_every_failed_status_is_an_mcp_tool_error(outcome: Outcome, start: str) -> None:
    result = outcome_result(outcome)
    assert result.is_error
    assert text_of(result).startswith(start)
    assert error_text(outcome) == text_of(result)
    assert result.structured_content == outcome.to_dict()


# -- abandoning calls -----------------------------------------------------------------------------


async def test_abandoning_a_bash_call_kills_its_processes_and_gets_no_response(
    server: ServerSetup, workspace: Path
) -> None:
    tag = unique_tag()
    gate = workspace / "gate"
    os.mkfifo(gate)
    async with connect(server) as (session, wire):
        with held_open(gate) as gate_fd:
            async with anyio.create_task_group() as group:
                # A second call in flight, released by us: the cancel must stop one call only.
                other: list[types.CallToolResult] = []

                async def run_other() -> None:
                    other.append(await session.call_tool("bash", {"command": "head -1 gate"}))

                group.start_soon(run_other)
                abandoned = anyio.CancelScope()

                async def run_abandoned() -> None:
                    with abandoned:
                        await session.call_tool("bash", {"command": tagged_sleep(tag)})

                group.start_soon(run_abandoned)
                await wait_until(lambda: len(pids_with(tag)) == 1 and bool(fifo_holders(gate)))
                abandoned.cancel()  # what a harness does when its user presses stop
                await wait_until(lambda: pids_with(tag) == [])
                os.write(gate_fd, b"released\n")
        (sleep_id,) = [i for i in wire.call_ids("bash") if i not in wire.answered_ids()]
        assert wire.cancelled_ids() == [sleep_id]  # the SDK client told the server
        after = await session.call_tool("ls", {})  # and the server keeps serving
    assert other[0].structured_content is not None
    assert other[0].structured_content["stdout"] == "released\n"
    assert not after.is_error
    assert sleep_id not in wire.answered_ids()  # the spec: no response to a cancelled request
    (killed,) = [o for o in server.outcomes() if o["status"] == "cancelled"]
    assert killed["killed_by"] == "token"
    assert killed["reason"] == f"the MCP client cancelled request {sleep_id}"
    assert killed["started"]


async def abandon_a_blocked_read(session: ClientSession, fifo: Path) -> None:
    with held_open(fifo):  # while we hold it, only a kill can end the worker's read
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as group:
                group.start_soon(session.call_tool, "read", {"path": fifo.name})
                await wait_until(lambda: bool(fifo_holders(fifo)))  # the worker is in read()
                scope.cancel()
        await wait_until(lambda: fifo_holders(fifo) == [])
    assert not fifo_has_reader(fifo)  # our end is closed too: nobody reads it any more


@needs_procfs
async def test_abandoning_a_read_blocked_on_a_fifo_leaves_no_reader(
    server: ServerSetup, workspace: Path
) -> None:
    fifo = workspace / "fifo"
    os.mkfifo(fifo)
    async with connect(server) as (session, wire):
        await abandon_a_blocked_read(session, fifo)
        # Then keep calling: the pool is whole, and a new read of the FIFO blocks afresh.
        read = await session.call_tool("read", {"path": "hello.txt"})
        assert text_of(read) == "hello\nworld\n"
        await abandon_a_blocked_read(session, fifo)
        assert not (await session.call_tool("ls", {})).is_error
    assert len(wire.cancelled_ids()) == 2
    assert not set(wire.cancelled_ids()) & wire.answered_ids()
    killed = [o for o in server.outcomes() if o["tool"] == "read" and o["status"] == "cancelled"]
    assert len(killed) == 2
    assert all(o["started"] and o["killed_by"] == "token" for o in killed)


async def test_the_2026_protocol_era_lists_calls_and_cancels_too(server: ServerSetup) -> None:
    # mcp.Client in "auto" mode negotiates the per-request envelope era (no initialize).
    params = StdioServerParameters(
        command=sys.executable, args=server.argv(), env={MARKER: os.environ[MARKER]}, cwd=REPO
    )
    tag = unique_tag()
    async with Client(params, mode="auto") as client:
        assert client.session.protocol_version == "2026-07-28"
        assert len((await client.list_tools()).tools) == len(TOOL_ARGS)
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as group:
                group.start_soon(client.call_tool, "bash", {"command": tagged_sleep(tag)})
                await wait_until(lambda: len(pids_with(tag)) == 1)
                scope.cancel()
        await wait_until(lambda: pids_with(tag) == [])
        echoed = await client.call_tool("bash", {"command": "echo still here"})
    assert echoed.structured_content is not None
    assert echoed.structured_content["stdout"] == "still here\n"
    (killed,) = [o for o in server.outcomes() if o["status"] == "cancelled"]
    assert killed["reason"].startswith("the MCP client cancelled request")


# -- defaults and flags ---------------------------------------------------------------------------


async def test_every_call_has_a_deadline_by_default(server: ServerSetup) -> None:
    # No --timeout, no calls.timeout_s: a model's `sleep 1000` must still end one day.
    async with connect(server) as (session, _):
        await session.call_tool("bash", {"command": "true"})
    (outcome,) = server.outcomes()
    intents = [
        json.loads(line) for line in server.journal.read_text().splitlines() if '"intent"' in line
    ]
    assert [i["timeout_s"] for i in intents] == [DEFAULT_TIMEOUT_S]
    assert outcome["status"] == "ok"


async def test_timeout_flag_kills_a_call_past_it(server: ServerSetup) -> None:
    tag = unique_tag()
    server.flags = ["--timeout", "0.5"]
    async with connect(server) as (session, _):
        with anyio.fail_after(EXIT_WITHIN_S):
            slept = await session.call_tool("bash", {"command": tagged_sleep(tag)})
    assert slept.is_error
    assert text_of(slept).startswith("timeout: ")
    assert pids_with(tag) == []


async def test_workers_flag_runs_that_many_calls_at_once(server: ServerSetup) -> None:
    # The fixture's config says 4 workers; the flag wins. Ten `sleep 1` in parallel take about
    # one second with ten workers, three with four: the ratio, not the clock, is asserted.
    server.flags = ["--workers", "10"]
    sleep_s = 1.0
    async with connect(server) as (session, _):
        await session.call_tool("bash", {"command": "true"})  # the pool is up and warm
        started = time.monotonic()
        async with anyio.create_task_group() as group:
            for _ in range(10):
                group.start_soon(session.call_tool, "bash", {"command": f"sleep {sleep_s}"})
        elapsed = time.monotonic() - started
    assert elapsed / sleep_s < 2.5


async def test_bash_runs_an_argv_alone(server: ServerSetup) -> None:
    async with connect(server) as (session, _):
        ran = await session.call_tool("bash", {"argv": ["echo", "a  b"]})
        neither = await session.call_tool("bash", {})
    assert text_of(ran) == "a  b\n[exit code 0]"
    assert neither.is_error
    assert "give command" in text_of(neither)


async def test_a_background_command_is_a_service_the_service_tools_reach(
    server: ServerSetup,
) -> None:
    async with connect(server) as (session, _):
        command = 'echo ready; read -r line; echo "got:$line"; exec sleep 1000'
        started = await session.call_tool("bash", {"command": command, "background": True})
        assert not started.is_error, text_of(started)
        assert started.structured_content is not None
        name = started.structured_content["service"]
        assert text_of(started) == (
            f"[service {name} running; read it with service_output, stop it with service_stop]"
        )
        wrote = await session.call_tool("service_write", {"service": name, "data": "hi\n"})
        assert not wrote.is_error, text_of(wrote)
        with anyio.fail_after(30):  # the other process's output, polled as a model would
            for _ in itertools.count():
                read = await session.call_tool("service_output", {"service": name})
                if "got:hi" in text_of(read):
                    break
                await anyio.sleep(0.05)
        assert text_of(read) == f"ready\ngot:hi\n[service {name} running] [next: 13]"
        stopped = await session.call_tool("service_stop", {"service": name})
        assert text_of(stopped) == f"[service {name} killed]"
        unknown = await session.call_tool("service_output", {"service": "nope"})
        assert unknown.is_error
        assert "no service named 'nope'" in text_of(unknown)


def test_a_missing_workspace_is_one_line_at_start(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    done = subprocess.run(
        [sys.executable, "-m", "sandbx_pool.cli", "mcp", "--workspace", str(missing)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 2
    assert done.stderr == f"sandbx-pool mcp: --workspace {missing}: no such directory\n"


def test_stdin_at_eof_exits_zero_quietly(workspace: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "sandbx_pool.cli", "mcp", "--workspace", str(workspace)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, "", "")


# -- the server's own end -------------------------------------------------------------------------


async def test_closing_stdin_cancels_calls_in_flight_and_exits_cleanly(server: ServerSetup) -> None:
    tag = unique_tag()
    async with spawned(server) as (process, session):
        async with anyio.create_task_group() as group:

            async def abandoned_by_exit() -> None:
                with pytest.raises(MCPError):  # the connection ends under it
                    await session.call_tool("bash", {"command": tagged_sleep(tag)})

            group.start_soon(abandoned_by_exit)
            await wait_until(lambda: len(pids_with(tag)) == 1)
            assert process.stdin is not None
            await process.stdin.aclose()  # what a client does first to stop its server
            with anyio.fail_after(EXIT_WITHIN_S):
                assert await process.wait() == 0
        assert pids_with(tag) == []
    (outcome,) = server.outcomes()
    assert outcome["status"] == "cancelled"
    assert outcome["reason"] == "MCP server shutting down: the client closed stdin"


@needs_procfs
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
async def test_a_signal_cancels_calls_in_flight_and_exits_with_its_number(
    server: ServerSetup, workspace: Path, signum: int
) -> None:
    tag = unique_tag()
    fifo = workspace / "fifo"
    os.mkfifo(fifo)
    async with spawned(server) as (process, session), anyio.create_task_group() as group:
        with held_open(fifo):
            answers: list[types.CallToolResult] = []

            async def stopped_by_exit(tool: str, args: dict[str, Any]) -> None:
                answers.append(await session.call_tool(tool, args))

            group.start_soon(stopped_by_exit, "bash", {"command": tagged_sleep(tag)})
            group.start_soon(stopped_by_exit, "read", {"path": "fifo"})
            await wait_until(lambda: len(pids_with(tag)) == 1 and bool(fifo_holders(fifo)))
            process.send_signal(signum)  # stdin stays open: the server must not wait for it
            with anyio.fail_after(EXIT_WITHIN_S):
                assert await process.wait() == 128 + signum
            assert fifo_holders(fifo) == []
        assert pids_with(tag) == []
        assert not fifo_has_reader(fifo)
    # Each call was answered before the server went: a tool error the model can read.
    assert [a.is_error for a in answers] == [True, True]
    assert all(text_of(a).startswith("cancelled: pool closing") for a in answers)
    outcomes = server.outcomes()
    assert sorted(o["tool"] for o in outcomes) == ["bash", "read"]
    assert {(o["status"], o["killed_by"]) for o in outcomes} == {("cancelled", "shutdown")}


def test_schema_command_prints_the_mcp_definitions_the_server_lists() -> None:
    printed = subprocess.run(
        [sys.executable, "-m", "sandbx_pool.cli", "schema", "--format", "mcp"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    definitions = json.loads(printed.stdout)
    assert [d["name"] for d in definitions] == list(TOOL_ARGS)
    assert all(d["inputSchema"] == tool_parameters()[d["name"]] for d in definitions)


async def test_bash_output_arrives_as_progress_while_the_call_runs(server: ServerSetup) -> None:
    notes: list[tuple[float, float, str | None]] = []

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        notes.append((anyio.current_time(), progress, message))

    async with connect(server) as (session, _):
        command = "echo first; sleep 2; echo second"
        result = await session.call_tool(
            "bash", {"command": command}, progress_callback=on_progress
        )
        ended = anyio.current_time()
    assert not result.is_error
    assert [message for _, _, message in notes] == ["first\n", "second\n"]
    assert [progress for _, progress, _ in notes] == [6, 13]  # characters so far: increasing
    assert ended - notes[0][0] >= 1.0


@pytest.mark.needs("overlayfs (tracked, transactional changes)")
async def test_results_name_the_paths_a_tracked_call_changed(
    workspace: Path, tmp_path: Path
) -> None:
    config = marked_config(pool={"workers": 2})
    async with Pool(
        workspace, journal=tmp_path / "j.jsonl", config=config, changes="tracked"
    ) as pool:
        changed = await pool.call("bash", {"command": "echo a > a.txt; rm hello.txt"})
        failed = await pool.call("bash", {"command": "echo b > b.txt; exit 3"})
        kept = await pool.call(
            "bash", {"command": "echo c > c.txt; sleep 100"}, timeout=1, changes="transactional"
        )
    text = outcome_result(changed).content[0].text  # type: ignore[union-attr]
    assert text.endswith("\n[changed: a.txt (created), hello.txt (deleted)]")
    assert outcome_result(changed).meta == {
        "sandbx-pool/call_id": changed.call_id,
        "sandbx-pool/changes": changed.changes,
    }
    assert "[changed: b.txt (created)]" in outcome_result(failed).content[0].text  # type: ignore[union-attr]
    kept_text = outcome_result(kept).content[0].text  # type: ignore[union-attr]
    assert kept_text.startswith("timeout: ")
    assert kept_text.endswith("[changed, not applied to the workspace: c.txt (created)]")


# -- shell sessions (sandbx_pool.sessions) -------------------------------------------------------


async def test_without_session_every_bash_call_starts_afresh(
    server: ServerSetup, workspace: Path
) -> None:
    async with connect(server) as (session, _):
        await session.call_tool("bash", {"command": "cd src; export X=1"})
        fresh = await session.call_tool("bash", {"command": 'pwd; echo "${X-unset}"'})
    assert text_of(fresh).startswith(f"{workspace}\nunset\n")


async def test_session_flag_keeps_cd_and_exports_across_calls(
    server: ServerSetup, workspace: Path
) -> None:
    server.flags = ["--session"]
    async with connect(server) as (session, _):
        await session.call_tool("bash", {"command": "cd src; export X=1"})
        kept = await session.call_tool("bash", {"command": 'pwd; echo "$X"'})
        read = await session.call_tool("read", {"path": "a.py"})
    assert text_of(kept).startswith(f"{workspace / 'src'}\n1\n")
    assert not read.is_error
    outcomes = server.outcomes()
    assert [o["session"]["id"] for o in outcomes] == ["mcp", "mcp", "mcp"]
    assert outcomes[-1]["session"]["cwd"] == str(workspace / "src")


MCP_COMMAND = (sys.executable, "-m", "sandbx_pool.cli", "mcp")


def test_a_bad_session_id_is_a_usage_error(workspace: Path) -> None:
    done = subprocess.run(
        [*MCP_COMMAND, "--workspace", str(workspace), "--session", "a/b"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=REPO,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 2
    assert "bad session id" in done.stderr
