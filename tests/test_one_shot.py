"""A one-shot ``sandbx-pool call``: its template launched before its pool, loguru loaded only
when a message is shown, options and ``key=value`` pairs in any order.

Its speed is measured by ``python -m bench oneshot``, not here; these check that the shortcuts
taken for it change nothing a user sees and leave nothing behind.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest
from helpers import run_cli

from sandbx_pool.cli.main import main
from sandbx_pool.config import Config
from sandbx_pool.logs import _DeferredLogger
from sandbx_pool.pool import Pool
from sandbx_pool.template_launch import (
    TemplateLaunch,
    discard_prelaunched,
    prelaunch,
    take_prelaunched,
)
from sandbx_pool.workers.protocol import (
    Attach,
    Exited,
    Shutdown,
    Spawn,
    Spawned,
    SpawnFailed,
    TemplateReady,
    encoder,
    from_template_decoder,
)

CHILD_S = 60


def cli(
    *argv: str, cwd: Path, python_options: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    return run_cli(*argv, cwd=cwd, timeout=CHILD_S, python_options=python_options)


def light_config() -> Config:
    return Config().override(pool={"warm_up": False, "prefork": 0})


async def test_a_pool_adopts_the_template_launched_before_it(workspace: Path) -> None:
    prelaunch(warm_up=False)
    try:
        async with Pool(workspace, config=light_config()) as pool:
            assert take_prelaunched(warm_up=False) is None  # taken by the pool
            assert pool.fleet.template is not None
            launched = pool.fleet.template.launch.process
            assert launched is not None
            assert pool.fleet.template.pid == launched.pid
            outcome = await pool.call("read", {"path": "hello.txt"}, timeout=30)
        assert outcome.status == "ok"
        assert outcome.value["content"] == "hello\nworld\n"
        assert launched.returncode == 0  # asked to stop, it exited on its own
    finally:
        discard_prelaunched()


async def test_a_template_launched_for_other_settings_is_not_adopted(workspace: Path) -> None:
    prelaunch(warm_up=False)
    try:
        async with Pool(workspace, config=Config().override(pool={"prefork": 0})) as pool:
            assert (await pool.call("ls", {}, timeout=30)).status == "ok"
            waiting = take_prelaunched(warm_up=False)  # a warmed-up pool left it waiting
            assert waiting is not None
            assert waiting.launch.process is not None
            assert pool.fleet.template is not None
            assert pool.fleet.template.pid != waiting.launch.process.pid
        waiting.socket.close()  # its EOF: it exits on its own
        assert waiting.launch.process.wait(timeout=CHILD_S) is not None
        waiting.stop()
    finally:
        discard_prelaunched()


def test_a_command_that_fails_before_its_pool_leaves_no_template(workspace: Path) -> None:
    """In-process, so the fixture that checks for leftover processes sees the template if the
    command forgot it: it is our child, and nothing else would end it while we live."""
    assert main(["call", "read", "pth=hello.txt", "--workspace", str(workspace)]) == 2
    assert take_prelaunched(warm_up=False) is None


def test_a_spawn_before_attach_is_refused_not_fatal() -> None:
    launched = TemplateLaunch(warm_up=False, nofile=None)
    try:
        launched.socket.settimeout(CHILD_S)
        launched.socket.send(encoder.encode(Spawn(count=2)))
        refused = from_template_decoder.decode(launched.socket.recv(65536))
        assert isinstance(refused, SpawnFailed)
        assert refused.count == 2
        assert "Attach" in refused.error
        # Still serving: an Attach is taken (TemplateReady answers it), and a Shutdown ends it
        # cleanly.
        launched.socket.send(encoder.encode(Attach(endpoint="ipc:///nonexistent/x.sock")))
        ready = from_template_decoder.decode(launched.socket.recv(65536))
        assert isinstance(ready, TemplateReady)
        launched.socket.send(encoder.encode(Shutdown()))
        process = launched.launch.process
        assert process is not None
        assert process.wait(timeout=CHILD_S) == 0
    finally:
        launched.stop()


def test_options_and_pairs_in_any_order(workspace: Path, tmp_path: Path) -> None:
    result = cli("call", "read", "--workspace", str(workspace), "path=hello.txt", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["value"]["content"] == "hello\nworld\n"
    unknown = cli("call", "read", "--workspace", str(workspace), "path=x", "--bogus", cwd=tmp_path)
    assert unknown.returncode == 2
    assert "--bogus" in unknown.stderr


def test_a_quiet_call_never_loads_loguru_and_a_verbose_one_logs(
    workspace: Path, tmp_path: Path
) -> None:
    quiet = cli(
        "call", "read", "path=hello.txt", "--workspace", str(workspace),
        cwd=tmp_path, python_options=("-X", "importtime"),
    )  # fmt: skip
    assert quiet.returncode == 0
    imported = [line.rsplit("|", 1)[-1].strip() for line in quiet.stderr.splitlines()]
    assert "sandbx_pool.pool" in imported  # the listing is the one we think it is
    assert "loguru" not in imported
    verbose = cli(
        "-v", "call", "read", "path=hello.txt", "--workspace", str(workspace), cwd=tmp_path
    )
    assert verbose.returncode == 0
    assert "INFO" in verbose.stderr
    assert "journal" in verbose.stderr


def test_the_deferred_logger_loads_loguru_for_the_first_message_shown(
    capfd: pytest.CaptureFixture[str],
) -> None:
    deferred = _DeferredLogger()
    deferred.debug("not configured: never shown")
    deferred.configure("WARNING", None)
    deferred.info("below the level: {}", "dropped")
    assert deferred._real is None  # nothing shown yet: loguru not needed
    try:
        deferred.warning("shown: {}", "a warning")
        assert deferred._real is not None
        try:
            raise ValueError("boom")
        except ValueError:
            deferred.exception("failed")
        err = capfd.readouterr().err
        assert "shown: a warning" in err
        assert "dropped" not in err
        assert "never shown" not in err
        assert "ValueError: boom" in err
        # The record names the caller, not the logger's own module.
        assert "test_one_shot" in _record_name(deferred)
    finally:
        deferred.remove()


def _record_name(deferred: _DeferredLogger) -> str:
    assert deferred._real is not None
    names: list[str] = []
    sink = deferred._real.add(lambda message: names.append(message.record["name"] or ""))
    try:
        deferred.error("whose")
    finally:
        deferred._real.remove(sink)
    return names[0]


def test_the_template_exits_without_its_teardown_yet_reports_every_worker() -> None:
    """os._exit after Shutdown: each worker is still killed, reaped and reported first."""
    launched = TemplateLaunch(warm_up=False, nofile=None)
    try:
        launched.socket.settimeout(CHILD_S)
        # A short path (a unix socket's is at most 107 bytes); the worker waits on it, idle.
        with tempfile.TemporaryDirectory() as directory, socket.socket(socket.AF_UNIX) as listener:
            path = os.path.join(directory, "coordinator.sock")
            listener.bind(path)
            listener.listen()
            launched.socket.send(encoder.encode(Attach(endpoint=f"ipc://{path}")))
            ready = from_template_decoder.decode(launched.socket.recv(65536))
            assert isinstance(ready, TemplateReady)  # the answer to Attach
            launched.socket.send(encoder.encode(Spawn(count=1)))
            spawned = from_template_decoder.decode(launched.socket.recv(65536))
            launched.socket.send(encoder.encode(Shutdown()))
            exited = from_template_decoder.decode(launched.socket.recv(65536))
        assert isinstance(spawned, Spawned)
        assert isinstance(exited, Exited)
        assert exited.pid == spawned.pid
        process = launched.launch.process
        assert process is not None
        assert process.wait(timeout=CHILD_S) == 0
    finally:
        launched.stop()
