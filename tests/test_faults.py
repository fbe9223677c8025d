"""No single call, argument or fault ends the pool: each fault injected for real (descriptor
limits, unencodable arguments, a coordinator SIGKILLed, a pool dropped without close)."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import weakref
from pathlib import Path
from typing import Any, cast

import pytest
from conftest import marked_config
from helpers import alive, wait_until, wait_until_sync

from sandbx_pool import Limits, Pool, descriptors
from sandbx_pool.outcome import Status
from sandbx_pool.workers.procfs import children
from sandbx_pool.workers.protocol import MAX_MESSAGE_BYTES

#: A coordinator in a subprocess: runs a script with the package importable, marked as ours.
CHILD_S = 120


def is_dir(path: str) -> bool:
    return os.path.isdir(path)


def run_coordinator(
    script: str, *args: str, nofile: int | None = None, hard_nofile: int | None = None
) -> subprocess.Popen[str]:
    """Start ``script`` (Python) in a new interpreter, with RLIMIT_NOFILE = ``nofile`` (soft)
    and ``hard_nofile`` (hard; ``nofile`` if not given) if given."""

    def limit() -> None:
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, hard_nofile or nofile))

    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=limit,
    )


# -- descriptors -------------------------------------------------------------------------------

PARALLEL_CALLS = """
    import asyncio, collections, json, sys
    from conftest import marked_config
    from sandbx_pool import Pool

    async def main():
        config = marked_config(pool={"workers": 32})
        async with Pool(sys.argv[1], config=config) as pool:
            calls = [pool.call("bash", {"command": "sleep 0.3"}) for _ in range(32)]
            outcomes = await asyncio.gather(*calls)
        print(json.dumps([o.status.value for o in outcomes]))
        print(json.dumps(sorted({o.error for o in outcomes if o.error})))

    asyncio.run(main())
"""


def test_out_of_descriptors_calls_queue_and_the_coordinator_lives(workspace: Path) -> None:
    """Under `ulimit -n 64`, 32 parallel calls on 32 workers made libzmq abort the process
    (EMFILE in accept): now the workers are budgeted, the rest of the calls queue."""
    proc = run_coordinator(_with_tests_path(PARALLEL_CALLS), str(workspace), nofile=64)
    out, err = proc.communicate(timeout=CHILD_S)
    assert proc.returncode == 0, err[-2000:]
    assert json.loads(out.splitlines()[0]) == ["ok"] * 32


def test_no_descriptor_for_even_one_worker_is_an_error_outcome(workspace: Path) -> None:
    proc = run_coordinator(_with_tests_path(PARALLEL_CALLS), str(workspace), nofile=36)
    out, err = proc.communicate(timeout=CHILD_S)
    assert proc.returncode == 0, err[-2000:]
    statuses, errors = map(json.loads, out.splitlines())
    assert statuses == ["error"] * 32
    assert len(errors) == 1
    assert errors[0].startswith("out of file descriptors")


STRANGERS_THEN_CALLS = """
    import asyncio, json, sys
    from conftest import marked_config
    from sandbx_pool import Pool

    async def main():
        async with Pool(sys.argv[1], config=marked_config(pool={"workers": 4})) as pool:
            print(pool._runtime_dir + "/coordinator.sock", flush=True)
            await asyncio.to_thread(sys.stdin.readline)  # the strangers have connected
            outcomes = await asyncio.gather(
                *(pool.call("read", {"path": "hello.txt"}) for _ in range(8))
            )
            print(json.dumps([o.status.value for o in outcomes]), pool._inbox.refused)

    asyncio.run(main())
"""


def test_connections_from_strangers_are_refused_and_the_coordinator_lives(
    workspace: Path,
) -> None:
    """1,100 idle connections to the ROUTER socket under the default soft limit of 1024 made
    libzmq abort the coordinator. Now the soft limit is raised to the hard one, and a peer that
    is not a worker is disconnected as it comes: they do not pile up."""
    proc = run_coordinator(
        _with_tests_path(STRANGERS_THEN_CALLS), str(workspace), nofile=1024, hard_nofile=4096
    )
    strangers: list[socket.socket] = []
    try:
        assert proc.stdout is not None
        assert proc.stdin is not None
        path = proc.stdout.readline().strip()
        for _ in range(1100):
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            strangers.append(conn)
            conn.setblocking(False)
            # A full backlog refuses with EAGAIN until libzmq accepts: the outside world.
            wait_until_sync(lambda c=conn: connects(c, path), what="a connection accepted")
        proc.stdin.write("go\n")
        proc.stdin.flush()
        out, err = proc.communicate(timeout=CHILD_S)
    finally:
        for conn in strangers:
            conn.close()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-2000:]
    statuses, refused = out.rsplit(" ", 1)
    assert json.loads(statuses) == ["ok"] * 8
    assert int(refused) >= 1000  # every stranger, but for those not yet seen when it ended


def test_commands_keep_the_descriptor_limit_the_process_had(workspace: Path) -> None:
    """The coordinator raises its own soft limit; its commands keep the one it inherited."""
    script = """
        import asyncio, sys
        from conftest import marked_config
        from sandbx_pool import Pool

        async def main():
            async with Pool(sys.argv[1], config=marked_config()) as pool:
                outcome = await pool.call("bash", {"command": "ulimit -Sn; ulimit -Hn"})
            print(outcome.value["stdout"].split())

        asyncio.run(main())
    """
    proc = run_coordinator(_with_tests_path(script), str(workspace), nofile=1024, hard_nofile=4096)
    out, err = proc.communicate(timeout=CHILD_S)
    assert proc.returncode == 0, err[-2000:]
    assert out.strip() == "['1024', '4096']"


def connects(conn: socket.socket, path: str) -> bool:
    try:
        conn.connect(path)
    except BlockingIOError:
        return False
    return True


def _with_tests_path(script: str) -> str:
    tests = os.path.dirname(os.path.abspath(__file__))
    return f"import sys; sys.path.insert(0, {tests!r})\n" + textwrap.dedent(script)


def test_a_worker_costs_the_coordinator_the_descriptors_budgeted(workspace: Path) -> None:
    """descriptors.PER_WORKER is a measurement: idle workers, each connected, cost this many."""

    async def open_with(spares: int) -> int:
        config = marked_config(pool={"workers": max(spares, 1), "prefork": spares})
        async with Pool(workspace, config=config) as pool:
            await wait_until(lambda: len(pool._workers.idle) == spares, what="spares connected")
            # And nothing else: the worker that checked the workspace at start is reaped.
            await wait_until(lambda: len(pool._workers.by_token) == spares, what="only spares")
            return descriptors.open_count()

    none, six = asyncio.run(open_with(0)), asyncio.run(open_with(6))
    assert six - none == 6 * descriptors.PER_WORKER


# -- arguments -----------------------------------------------------------------------------


def template_children(pool: Pool) -> int:
    assert pool._template is not None
    assert pool._template.pid is not None
    return len(children(pool._template.pid))


async def test_unencodable_arguments_take_no_worker(pool: Pool, tmp_path: Path) -> None:
    spares = pool.prefork
    await wait_until(lambda: template_children(pool) == spares, what="the spares forked")
    bad = [
        ("read", {"path": "a\udc80b"}, None),  # a lone surrogate: not UTF-8
        ("write", {"path": "x", "content": "\ud800"}, None),
        ("read", {"path": "hello.txt"}, Limits(cpu_seconds=2**64 + 1)),  # beyond msgpack
        ("read", {"path": "hello.txt"}, Limits(open_files=2**63)),  # beyond rlim_t
    ]
    refused = []
    for _ in range(3):
        for tool, args, limits in bad:
            outcome = await pool.call(tool, args, limits=limits)
            assert outcome.status is Status.ERROR, outcome
            assert not outcome.started
            assert "limits." in (outcome.error or "") or "encode" in (outcome.error or "")
            refused.append(outcome.call_id)
    # Journaled like any call: an intent, then its one outcome.
    assert pool.journal is not None
    await pool.journal.flush()
    records = [json.loads(line) for line in (tmp_path / "journal.jsonl").read_text().splitlines()]
    for kind in ("intent", "outcome"):
        assert [r["call_id"] for r in records if r["kind"] == kind] == refused
    # A good call still runs, and then only the spares are left: no worker was stranded.
    assert (await pool.call("read", {"path": "hello.txt"})).ok
    await wait_until(lambda: template_children(pool) == spares, what="only the spares left")


async def test_api_misuse_is_a_type_or_value_error(pool: Pool) -> None:
    with pytest.raises(TypeError, match="timeout"):
        await pool.call("read", {"path": "hello.txt"}, timeout=cast(Any, "5"))
    with pytest.raises(ValueError, match="timeout"):
        await pool.call("read", {"path": "hello.txt"}, timeout=float("nan"))
    with pytest.raises(TypeError, match="env"):
        await pool.call("bash", {"command": "true"}, env=cast(Any, {"A": 1}))
    assert (await pool.call("read", {"path": "hello.txt"})).ok


async def test_a_call_id_in_flight_is_refused_and_close_settles_the_call(
    workspace: Path, tmp_path: Path
) -> None:
    config = marked_config(pool={"workers": 2, "close_timeout_s": 2.0})
    async with Pool(workspace, journal=tmp_path / "j.jsonl", config=config) as pool:
        long = asyncio.create_task(pool.call("bash", {"command": "sleep 30"}, call_id="same"))
        await wait_until(lambda: bool(pool.running()), what="the long call started")
        with pytest.raises(ValueError, match="already in flight"):
            await pool.call("bash", {"command": "true"}, call_id="same")
    outcome = await asyncio.wait_for(long, 10)
    assert outcome.status is Status.CANCELLED
    assert outcome.killed_by == "shutdown"


async def test_a_payload_over_the_frame_limit_is_an_error_before_anything_is_sent(
    pool: Pool, workspace: Path
) -> None:
    content = "x" * (MAX_MESSAGE_BYTES + 1)
    outcome = await pool.call("write", {"path": "big.txt", "content": content})
    assert outcome.status is Status.ERROR
    assert not outcome.started
    assert "frame limit" in (outcome.error or "")
    assert not (workspace / "big.txt").exists()


# -- leftovers -----------------------------------------------------------------------------

OPEN_AND_WAIT = """
    import asyncio, sys
    from conftest import marked_config
    from sandbx_pool import Pool

    async def main():
        async with Pool(sys.argv[1], config=marked_config()) as pool:
            print(pool._tmp_root, pool._runtime_dir, pool._template.pid, flush=True)
            await asyncio.sleep(60)

    asyncio.run(main())
"""


async def test_a_new_pool_removes_what_a_killed_coordinator_left_but_not_a_live_ones(
    pool: Pool, workspace: Path
) -> None:
    proc = run_coordinator(_with_tests_path(OPEN_AND_WAIT), str(workspace))
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(proc.stdout.readline), CHILD_S)
        tmp_root, runtime_dir, template_pid = line.split()
    finally:
        proc.kill()
        proc.communicate()
    assert proc.returncode == -signal.SIGKILL
    await wait_until(lambda: not alive(int(template_pid)), what="its template died with it")
    assert is_dir(tmp_root)
    assert is_dir(runtime_dir)

    async with Pool(workspace, config=marked_config()):
        assert not is_dir(tmp_root)
        assert not is_dir(runtime_dir)
        # The live pool's (the fixture's) are left alone.
        assert pool._tmp_root is not None
        assert is_dir(pool._tmp_root)
        assert pool._runtime_dir is not None
        assert is_dir(pool._runtime_dir)
        assert (await pool.call("read", {"path": "hello.txt"})).ok


def test_a_dropped_pool_is_released_when_collected(workspace: Path) -> None:
    async def open_and_drop() -> tuple[int, str, str]:
        pool = Pool(workspace, config=marked_config())
        await pool.start()
        assert (await pool.call("read", {"path": "hello.txt"})).ok
        assert pool._template is not None
        assert pool._template.pid is not None
        assert pool._tmp_root is not None
        assert pool._runtime_dir is not None
        return pool._template.pid, pool._tmp_root, pool._runtime_dir

    template_pid, tmp_root, runtime_dir = asyncio.run(open_and_drop())
    gc.collect()
    assert not os.path.exists(tmp_root)
    assert not os.path.exists(runtime_dir)
    wait_until_sync(lambda: not alive(template_pid), what="the template gone")
    # Its threads (the template's, the journal writer's) end too.
    wait_until_sync(
        lambda: not [t for t in threading.enumerate() if t.name.startswith("sandbx-")],
        what="the pool's threads gone",
    )


async def test_a_pool_dropped_while_its_loop_runs_is_released_and_the_loop_serves_on(
    workspace: Path,
) -> None:
    async def open_and_drop() -> tuple[int, str, weakref.ref[Pool]]:
        pool = Pool(workspace, config=marked_config())
        await pool.start()
        assert (await pool.call("read", {"path": "hello.txt"})).ok
        assert pool._template is not None
        assert pool._template.pid is not None
        assert pool._tmp_root is not None
        return pool._template.pid, pool._tmp_root, weakref.ref(pool)

    template_pid, tmp_root, ref = await open_and_drop()

    def collected() -> bool:
        # Callbacks already scheduled (a spawn request) hold it until the loop runs them.
        gc.collect()
        return ref() is None

    await wait_until(collected, what="the dropped pool collected")
    assert not is_dir(tmp_root)
    await wait_until(lambda: not alive(template_pid), what="the template gone")
    # The descriptors it watched were forgotten by the loop before being closed: the next
    # pool's sockets reuse their numbers.
    async with Pool(workspace, config=marked_config()) as pool:
        assert (await pool.call("read", {"path": "hello.txt"})).ok


def test_a_pool_never_closed_is_released_at_interpreter_exit(workspace: Path) -> None:
    script = """
        import asyncio, sys
        from conftest import marked_config
        from sandbx_pool import Pool

        pools = []  # held to the end: only the exit can release it

        async def main():
            pool = Pool(sys.argv[1], config=marked_config())
            pools.append(pool)
            await pool.start()
            print(pool._tmp_root, pool._runtime_dir, pool._template.pid, flush=True)

        asyncio.run(main())
    """
    proc = run_coordinator(_with_tests_path(script), str(workspace))
    out, err = proc.communicate(timeout=CHILD_S)
    assert proc.returncode == 0, err[-2000:]
    tmp_root, runtime_dir, template_pid = out.split()
    assert not os.path.exists(tmp_root)
    assert not os.path.exists(runtime_dir)
    wait_until_sync(lambda: not alive(int(template_pid)), what="the template gone")


# -- typed limits and bad input ----------------------------------------------------------------


def cli(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sandbx_pool.cli", *argv],
        capture_output=True,
        text=True,
        timeout=CHILD_S,
        cwd=cwd,
    )


def assert_one_line_error(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for needle in needles:
        assert needle in lines[0]


def test_cli_bad_inputs_exit_2_with_one_line(tmp_path: Path, workspace: Path) -> None:
    missing = cli("call", "read", "path=hello.txt", "--config", "missing.toml", cwd=workspace)
    assert_one_line_error(missing, "missing.toml")

    latin1 = tmp_path / "latin1.toml"
    latin1.write_bytes(b'[env]\nset = { A = "caf\xe9" }\n')
    assert_one_line_error(
        cli("call", "read", "path=hello.txt", "--config", str(latin1), cwd=workspace),
        "latin1.toml",
        "UTF-8",
    )

    wide = tmp_path / "wide.toml"
    # 40 MiB kept of each stream: two of them cannot travel in one 64 MiB frame.
    wide.write_text("[calls]\nkeep_output_bytes = 41943040\n")
    assert_one_line_error(
        cli("call", "read", "path=hello.txt", "--config", str(wide), cwd=workspace),
        "calls.keep_output_bytes",
    )

    (tmp_path / "a-file").write_text("")  # a file where the log's directory should be
    unwritable = tmp_path / "a-file" / "log.json"
    assert_one_line_error(
        cli("--log-json", str(unwritable), "tools", cwd=workspace), str(unwritable)
    )

    deep = tmp_path / "deep.jsonl"
    deep.write_text('{"tool": "read", "args": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    result = cli("run", str(deep), "--workspace", str(workspace), cwd=workspace)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert f"{deep}:1:" in result.stderr
