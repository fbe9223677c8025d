"""Services (sandbx_pool.services, workers.tools.service): a command that outlives its call on
purpose, supervised: its output kept head and tail, its stdin and terminal fed, stopped with
its session or its pool, journaled, and gone with a coordinator killed by SIGKILL.
"""

from __future__ import annotations

import asyncio
import http.server
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import uuid
from pathlib import Path

import pytest
from conftest import marked_config
from helpers import alive, journal_records, wait_until

from sandbx_pool import KilledBy, Pool, Service, ServiceNotRunning, ServiceStatus, Status
from sandbx_pool.journal import reader as journal_reader
from sandbx_pool.transcript import KEEP_OUTPUT_BYTES, Transcript

#: How long a coordinator subprocess may take to start a pool and a service.
CHILD_S = 120


async def _output_holds(service: Service, text: bytes, within_s: float = 10.0) -> bytes:
    """The service's output once it holds ``text`` (waiting on another process's output)."""
    held = b""

    def holds() -> bool:
        nonlocal held
        held = service._transcript.read(0)[0]
        return text in held

    await wait_until(holds, within_s=within_s, what=f"{text!r} in the service's output")
    return held


def _processes_with(token: str) -> list[int]:
    """Pids whose command line holds ``token``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if token.encode() in f.read():
                    found.append(int(entry))
        except OSError:
            continue
    return found


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _fetch(port: int) -> str:
    """A bash command that GETs / on 127.0.0.1:``port`` with Python and prints the status."""
    script = (
        f"import urllib.request as u;print(u.urlopen('http://127.0.0.1:{port}/', timeout=5).status)"
    )
    return f'python3 -c "{script}"'


# -- start, output, stop -----------------------------------------------------------------------


async def test_a_service_runs_until_stopped_and_the_stop_is_journaled(
    pool: Pool, tmp_path: Path
) -> None:
    svc = await pool.service("ticker", "echo ready; exec sleep 1000")
    assert svc.status is ServiceStatus.RUNNING
    assert svc.exit_code is None
    await _output_holds(svc, b"ready\n")
    assert [s.name for s in pool.services()] == ["ticker"]
    pid = svc.pid
    assert pid is not None
    assert alive(pid)
    # A call in the meantime is not held up by it.
    assert (await pool.call("bash", {"command": "echo hi"}, timeout=30)).value["stdout"] == "hi\n"

    outcome = await svc.stop()
    assert svc.status is ServiceStatus.KILLED
    assert outcome.killed_by is KilledBy.TOKEN
    assert "ticker" in (outcome.reason or "")
    await wait_until(lambda: not alive(pid), what="the service's worker gone")
    assert (await svc.stop()) == outcome  # stopping an ended service says how it ended

    await pool.close()
    records = [r for r in journal_records(str(tmp_path / "journal.jsonl")) if r.get("call_id")]
    mine = [r for r in records if r["call_id"] == svc.call.call_id]
    assert [r["kind"] for r in mine if r["kind"] in ("intent", "outcome")] == [
        "intent",
        "outcome",
    ], mine
    intent, end = mine[0], mine[-1]
    assert intent["args"]["command"] == "echo ready; exec sleep 1000"
    assert end["killed_by"] == "token"


async def test_services_take_no_calls_slot(workspace: Path) -> None:
    async with Pool(workspace, config=marked_config(pool={"workers": 1})) as pool:
        first = await pool.service("one", "exec sleep 1000")
        second = await pool.service("two", "exec sleep 1000")
        done = await pool.call("bash", {"command": "echo free"}, timeout=30)
        assert done.value["stdout"] == "free\n"
        assert pool.max_workers == 3
        await first.stop()
        again = await pool.service("three", "exec sleep 1000")
        assert pool.max_workers == 3  # as many as ever ran at once, not one per start
        assert [s.status for s in pool.services()] == ["killed", "running", "running"]
        await second.stop()
        await again.stop()


async def test_a_service_that_exits_by_itself_says_its_exit_code(pool: Pool) -> None:
    svc = await pool.service("short", "echo done; exit 3")
    outcome = await svc.wait(timeout=30)
    assert outcome.status is Status.OK
    assert svc.status is ServiceStatus.EXITED
    assert svc.exit_code == 3
    assert (await svc.output())[0] == b"done\n"
    with pytest.raises(ServiceNotRunning, match="exited"):
        await svc.write("more\n")
    # The name is free again once its service has ended.
    again = await pool.service("short", "exit 0")
    assert (await again.wait(timeout=30)).status is Status.OK


async def test_a_service_lives_on_in_what_its_command_left_running(
    containment: str, workspace: Path
) -> None:
    async with Pool(workspace, config=marked_config()) as pool:
        await _lives_on(pool)


async def _lives_on(pool: Pool) -> None:
    # A launcher that starts the real server in the background and exits (pg_ctl start,
    # redis-server --daemonize yes): the service is what it left, until that ends too.
    svc = await pool.service("daemon", "(sleep 0.5; echo late) & echo launched; exit 4")
    await _output_holds(svc, b"launched\n")
    assert svc.status is ServiceStatus.RUNNING
    outcome = await svc.wait(timeout=30)
    assert outcome.status is Status.OK
    assert svc.exit_code == 4  # the launcher's
    assert (await svc.output())[0] == b"launched\nlate\n"
    # One that never ends is stopped like any service, its orphan with it.
    kept = await pool.service("kept", "setsid sleep 1000 >/dev/null 2>&1 & exit 0")
    with pytest.raises(TimeoutError):
        await kept.wait(timeout=0.5)
    assert kept.status is ServiceStatus.RUNNING
    pid = kept.pid
    assert pid is not None
    await kept.stop()
    await wait_until(lambda: not alive(pid), what="the worker and its orphan gone")


async def test_write_feeds_its_stdin_and_eof_closes_it(pool: Pool) -> None:
    svc = await pool.service("reader", 'while read -r line; do echo "got:$line"; done; echo end')
    await svc.write("one\n")
    await _output_holds(svc, b"got:one\n")
    await svc.write(b"two\n", eof=True)
    await svc.wait(timeout=30)
    assert svc.exit_code == 0
    assert (await svc.output())[0] == b"got:one\ngot:two\nend\n"


async def test_output_since_an_offset_returns_only_what_is_new(pool: Pool) -> None:
    svc = await pool.service("lines", "echo first; read -r _; echo second")
    await _output_holds(svc, b"first\n")
    data, offset = await svc.output()
    assert (data, offset) == (b"first\n", 6)
    await svc.write("go\n")
    await svc.wait(timeout=30)
    assert await svc.output(since=offset) == (b"second\n", 13)
    assert await svc.output(since=13) == (b"", 13)
    with pytest.raises(ValueError, match="since"):
        await svc.output(since=-1)


async def test_a_flood_of_output_is_kept_head_and_tail_within_the_bound(pool: Pool) -> None:
    # 2.6 MB of numbered lines, then a last line: past the bound. Nothing is dropped on the
    # way (the worker reads only as fast as its output is paced), so the tail is the end.
    command = "seq 1 400000; echo LAST"
    svc = await pool.service("flood", command)
    await svc.wait(timeout=120)
    data, offset = await svc.output()
    assert svc.exit_code == 0
    assert data.startswith(b"1\n2\n3\n")
    assert data.endswith(b"LAST\n")
    assert len(data) <= KEEP_OUTPUT_BYTES + 200
    assert svc.omitted > 0
    assert offset == len("".join(f"{n}\n" for n in range(1, 400001))) + len("LAST\n")
    marker = f"\n[... {svc.omitted} bytes omitted ...]\n".encode()
    assert data.count(marker) == 1
    assert len(data) - len(marker) + svc.omitted == offset


def test_the_transcript_holds_head_and_tail_and_marks_the_gap() -> None:
    kept = Transcript(keep=20)
    kept.add(b"0123456789")  # the head
    kept.add(b"abcde")
    kept.add(b"fghij")
    kept.add(b"klmno")  # the tail's bound is 10: "abcde" goes
    assert kept.read(0) == (b"0123456789\n[... 5 bytes omitted ...]\nfghijklmno", 25)
    assert kept.read(12) == (b"\n[... 3 bytes omitted ...]\nfghijklmno", 25)
    assert kept.read(22) == (b"mno", 25)
    kept.add(b"", dropped=4)  # the worker's stream bound dropped these
    kept.add(b"pq")
    assert kept.read(25) == (b"\n[... 4 bytes omitted ...]\npq", 31)
    # "pq" took the tail past its bound again: "fghij" went too.
    assert kept.omitted == 5 + 4 + 5
    assert kept.read(0) == (
        b"0123456789\n[... 10 bytes omitted ...]\nklmno\n[... 4 bytes omitted ...]\npq",
        31,
    )


# -- names and bad input ---------------------------------------------------------------------


async def test_names_follow_session_ids_and_a_running_name_is_taken(pool: Pool) -> None:
    with pytest.raises(ValueError, match="bad service name"):
        await pool.service("no spaces", "true")
    with pytest.raises(ValueError, match="command"):
        await pool.service("empty", "")
    with pytest.raises(ValueError, match="allow-list"):
        await pool.service("listed", "true", network=["example.com"], session="s")
    with pytest.raises(ValueError, match="host"):
        await pool.service("listed", "true", network=["http://example.com"])
    svc = await pool.service("db", "exec sleep 1000")
    with pytest.raises(ValueError, match="taken"):
        await pool.service("db", "true")
    assert [s.name for s in pool.services()] == ["db"]
    await svc.stop()


async def test_wait_times_out_and_wait_port_is_false_for_a_service_that_ends(pool: Pool) -> None:
    svc = await pool.service("sleeper", "exec sleep 1000")
    with pytest.raises(TimeoutError):
        await svc.wait(timeout=0.2)
    assert svc.status is ServiceStatus.RUNNING  # a wait's timeout does not stop it
    await svc.stop()
    gone = await pool.service("gone", "exit 0")
    assert await gone.wait_port(_free_port(), timeout=30) is False


async def test_the_gate_judges_a_service_as_the_bash_call_it_is(
    workspace: Path, tmp_path: Path
) -> None:
    asked: list[tuple[str, str]] = []

    def approve(tool: str, args: object) -> bool:
        asked.append((tool, getattr(args, "command", "")))
        return False

    async with Pool(workspace, config=marked_config(), approve=approve) as pool:
        svc = await pool.service("refused", "touch made")
        assert svc.outcome is not None
        assert svc.outcome.status is Status.DENIED
        assert svc.status is ServiceStatus.EXITED
        assert svc.exit_code is None
    assert asked == [("bash", "touch made")]
    assert not (workspace / "made").exists()


# -- ownership -------------------------------------------------------------------------------


async def test_ending_its_session_stops_its_services_and_closing_the_pool_the_rest(
    workspace: Path, tmp_path: Path
) -> None:
    journal = tmp_path / "owned.jsonl"
    config = marked_config(pool={"workers": 2})
    async with Pool(workspace, journal=journal, config=config) as pool:
        await pool.call("bash", {"command": "cd src && export MODE=dev"}, session="s1")
        mine = await pool.service("mine", 'pwd; echo "$MODE"; exec sleep 1000', session="s1")
        other = await pool.service("other", "exec sleep 1000")
        await _output_holds(mine, f"{workspace / 'src'}\ndev\n".encode())
        mine_pid, other_pid = mine.pid, other.pid
        assert mine_pid is not None
        assert other_pid is not None
        assert pool.end_session("s1")
        outcome = await mine.wait(timeout=30)
        assert outcome.killed_by is KilledBy.TOKEN
        assert "session 's1' ended" in (outcome.reason or "")
        assert other.status is ServiceStatus.RUNNING
    assert other.outcome is not None
    assert other.outcome.killed_by is KilledBy.SHUTDOWN
    assert not alive(mine_pid)
    assert not alive(other_pid)
    # A pool's close is how its services end: none is left in doubt by it.
    assert journal_reader.in_doubt_calls(journal_reader.read_journal(journal)) == []


KILLED_COORDINATOR = """
    import asyncio, sys
    from conftest import marked_config
    from sandbx_pool import Pool

    async def main():
        async with Pool(sys.argv[1], journal=sys.argv[2], config=marked_config()) as pool:
            command = "exec python3 -c 'import time; time.sleep(1000)' " + sys.argv[3]
            svc = await pool.service("left", command)
            print(svc.pid, flush=True)
            await asyncio.sleep(600)

    asyncio.run(main())
"""


def _coordinator(script: str, *args: str) -> subprocess.Popen[str]:
    """``script`` run by a new interpreter that imports this directory's conftest."""
    tests = os.path.dirname(os.path.abspath(__file__))
    source = f"import sys; sys.path.insert(0, {tests!r})\n" + textwrap.dedent(script)
    return subprocess.Popen(
        [sys.executable, "-c", source, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


async def test_a_coordinator_killed_with_sigkill_leaves_no_service_and_journals_it_interrupted(
    workspace: Path, tmp_path: Path
) -> None:
    token = f"sbx-service-{uuid.uuid4().hex}"
    journal = tmp_path / "killed.jsonl"
    proc = _coordinator(KILLED_COORDINATOR, str(workspace), str(journal), token)
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), CHILD_S)
        worker_pid = int(line)
        await wait_until(lambda: bool(_processes_with(token)), what="the service's command")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    await wait_until(lambda: not alive(worker_pid), what="the service's worker gone")
    await wait_until(lambda: not _processes_with(token), what="the service's command gone")

    async with Pool(workspace, journal=journal, config=marked_config()) as pool:
        interrupted = [r for r in pool.interrupted if r.tool == "_service"]
        assert len(interrupted) == 1
        assert token in interrupted[0].args["command"]
        assert pool.services() == []  # never started again
    scan = journal_reader.read_journal(journal)
    assert [c.tool for c in journal_reader.in_doubt_calls(scan)] == ["_service"]


# -- network ---------------------------------------------------------------------------------


async def test_a_call_reaches_a_service_on_the_hosts_network(pool: Pool) -> None:
    port = _free_port()
    server = f"exec python3 -m http.server {port} --bind 127.0.0.1"
    svc = await pool.service("web", server, network=True)
    assert await svc.wait_port(port, timeout=30)
    got = await pool.call("bash", {"command": _fetch(port)}, timeout=30, network=True)
    assert got.value["stdout"] == "200\n", got
    await svc.stop()


@pytest.mark.needs("network namespaces")
async def test_an_offline_services_port_is_its_sessions_alone(pool: Pool) -> None:
    if not pool.views or pool.fleet.in_user_namespaces:
        with pytest.raises(ValueError, match="share a network namespace"):
            await pool.service("web", "true", session="s1", network=False)
        pytest.skip("workers here cannot join one another's network namespace")
    port = 8000  # its own namespace's: nothing else listens there
    server = f"exec python3 -m http.server {port} --bind 127.0.0.1"
    svc = await pool.service("web", server, session="s1", network=False)
    assert await svc.wait_port(port, timeout=30)
    mine = await pool.call("bash", {"command": _fetch(port)}, session="s1", timeout=30)
    assert mine.value["stdout"] == "200\n", mine
    others = await pool.call(
        "bash", {"command": _fetch(port)}, session="s2", timeout=30, network=False
    )
    assert others.value["exit_code"] != 0
    assert "200" not in others.value["stdout"]
    plain = await pool.call("bash", {"command": _fetch(port)}, timeout=30, network=False)
    assert plain.value["exit_code"] != 0
    # Offline: the session's namespace has loopback only.
    online = await pool.call(
        "bash",
        {"command": "python3 -c \"import socket; socket.create_connection(('1.1.1.1', 53), 2)\""},
        session="s1",
        timeout=30,
    )
    assert online.value["exit_code"] != 0
    await svc.stop()


class _Hello(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"hello from the host\n"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.mark.needs("network allow-list")
async def test_an_allow_listed_service_reaches_its_hosts_through_the_proxy(
    workspace: Path,
) -> None:
    host = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Hello)
    thread = threading.Thread(target=host.serve_forever, daemon=True)
    thread.start()
    port = host.server_address[1]
    pinned = {"index.test": "127.0.0.1", "evil.test": "127.0.0.1"}
    config = marked_config(sandbox={"network_hosts": pinned})
    fetch = (
        "import urllib.request as u, urllib.error as e\n"
        "for name in ('index', 'evil'):\n"
        "    try:\n"
        f"        print(name, u.urlopen(f'http://{{name}}.test:{port}/', timeout=10).read())\n"
        "    except e.HTTPError as refused:\n"
        "        print(name, refused.code)\n"
    )
    (workspace / "fetch.py").write_text(fetch)
    try:
        async with Pool(workspace, config=config) as pool:
            listed = [f"index.test:{port}"]
            svc = await pool.service("fetcher", "python3 fetch.py; exec sleep 1000", network=listed)
            await _output_holds(svc, b"evil 403\n")
            assert (await svc.output())[0].startswith(b"index b'hello from the host\\n'\n")
            outcome = await svc.stop()
        assert outcome.value is not None
        assert outcome.value["network_denied"] == ["evil.test"]
    finally:
        host.shutdown()
        host.server_close()
        thread.join()


# -- terminals -------------------------------------------------------------------------------


async def test_a_tty_service_answers_a_prompt_and_sees_its_new_size(pool: Pool) -> None:
    command = 'stty size; read -r -p "name? " name; stty size; echo "hello $name"'
    svc = await pool.service("term", command, tty=True)
    await _output_holds(svc, b"24 80")
    await _output_holds(svc, b"name? ")
    await svc.resize(132, 50)
    await svc.write("ada\n")
    await svc.wait(timeout=30)
    text = (await svc.output())[0].replace(b"\r\n", b"\n")
    assert text.endswith(b"ada\n50 132\nhello ada\n"), text
    assert svc.exit_code == 0
    with pytest.raises(ValueError, match="cols and rows"):
        await svc.resize(0, 10)


async def test_a_tty_service_is_a_terminal_to_python(pool: Pool) -> None:
    command = "python3 -c \"import sys; print(sys.stdin.isatty()); print('got', input('> '))\""
    svc = await pool.service("repl", command, tty=True)
    await _output_holds(svc, b"> ")
    await svc.write("42\n")
    await svc.wait(timeout=30)
    text = (await svc.output())[0].replace(b"\r\n", b"\n")
    assert text.startswith(b"True\n> 42\ngot 42\n"), text


# -- the tools a model calls -------------------------------------------------------------------


async def test_bash_background_starts_a_service_the_service_tools_reach(
    pool: Pool, tmp_path: Path
) -> None:
    command = 'echo ready; while read -r line; do echo "got:$line"; done'
    started = await pool.call("bash", {"command": command, "background": True}, session="m")
    assert started.status is Status.OK, started
    name = started.value["service"]
    assert started.value["status"] == "running"
    svc = next(s for s in pool.services() if s.name == name)
    await _output_holds(svc, b"ready\n")

    wrote = await pool.call("service_write", {"service": name, "data": "hi\n"}, session="m")
    assert wrote.value["written"] == 3
    await _output_holds(svc, b"got:hi\n")
    read = await pool.call("service_output", {"service": name}, session="m")
    assert read.value["output"] == "ready\ngot:hi\n"
    assert read.value["next"] == 13
    again = await pool.call("service_output", {"service": name, "since": 13}, session="m")
    assert again.value["output"] == ""

    # Another session, or none, does not see it.
    for other in ("x", None):
        hidden = await pool.call("service_stop", {"service": name}, session=other)
        assert hidden.status is Status.ERROR
        assert "no service named" in (hidden.error or "")
    assert svc.status is ServiceStatus.RUNNING

    stopped = await pool.call("service_stop", {"service": name}, session="m")
    assert stopped.value == {"service": name, "status": "killed", "exit_code": None}
    late = await pool.call("service_write", {"service": name, "data": "x"}, session="m")
    assert late.status is Status.ERROR
    assert "killed" in (late.error or "")
    bad = await pool.call("service_output", {"service": name, "since": -1}, session="m")
    assert bad.status is Status.ERROR
    refused = await pool.call("bash", {"command": "true", "background": True, "stdin": "x"})
    assert refused.status is Status.ERROR

    await pool.close()
    tools = [
        r["tool"]
        for r in journal_records(str(tmp_path / "journal.jsonl"))
        if r["kind"] == "outcome"
    ]
    # Each tool call journaled as a call; the service's own call ends when it is stopped.
    assert tools[:4] == ["bash", "service_write", "service_output", "service_output"]
    assert {"_service", "service_stop"} <= set(tools)


async def test_a_background_command_the_gate_refuses_is_denied(
    workspace: Path, tmp_path: Path
) -> None:
    async with Pool(workspace, config=marked_config(), approve=lambda tool, args: False) as pool:
        refused = await pool.call("bash", {"command": "touch made", "background": True})
    assert refused.status is Status.DENIED
    assert refused.value is not None
    assert refused.value["status"] == "exited"
    assert not (workspace / "made").exists()
