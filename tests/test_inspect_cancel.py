"""The reason journaled for a call Inspect AI cancels says why, for each way Inspect cancels.

Every test runs a real eval (mockllm, the ``sandbx`` provider, a real pool): one sample starts a
tagged ``sleep 30`` through ``sandbox().exec``; while it runs (seen on the host, when the sample
itself triggers the stop), something of Inspect's stops the sample; the test reads the call's
``cancelled`` outcome in the journal.
"""

from __future__ import annotations

import asyncio
import fcntl
import gc
import os
import pty
import signal
import struct
import sys
import termios
import textwrap
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

pytest.importorskip("inspect_ai", reason="needs the 'inspect' extra")

from helpers import (
    journal_records,
    marked_pool_toml,
    pids_with,
    tagged_sleep,
    unique_tag,
    wait_until,
)
from inspect_ai import Task, eval_async
from inspect_ai.dataset import Sample
from inspect_ai.log import EvalLog
from inspect_ai.log._samples import sample_active
from inspect_ai.model import ChatMessageUser
from inspect_ai.solver import Generate, Solver, TaskState, solver
from inspect_ai.util import LimitExceededError, sandbox, time_limit

from sandbx_pool.integrations.inspect_cancel import MAX_REASON
from sandbx_pool.integrations.inspect_provider import SandbxConfig
from sandbx_pool.runtime_dir import owner_tag

pytestmark = [
    pytest.mark.asyncio(loop_scope="module"),
    # Inspect itself passes tenacity a deprecated argument and leaves anyio streams unclosed
    # (collected in _eval, so that they are reported here and not in a later test): not ours.
    pytest.mark.filterwarnings("ignore:The 'initial' parameter is deprecated:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]

#: Seconds allowed for the sample's sleep to show on the host: a fork and an exec, or, for an
#: eval in a process of its own, Inspect's imports and start too (5 s here when idle).
STARTS_WITHIN_S = 90.0

#: Seconds allowed for an eval to end after Ctrl-C (its logs written, its pool closed).
EXITS_WITHIN_S = 60.0

#: What a sample's other task does once the sleep runs: stop the sample, one way or another.
Trigger = Callable[[TaskState], Awaitable[None]]


@pytest.fixture(autouse=True)
def _no_display(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INSPECT_DISPLAY", "none")  # in-process evals: no screen to draw


async def _sleep(tag: str) -> None:
    await sandbox().exec(["bash", "-c", tagged_sleep(tag, 30)])


async def _sleeping(tag: str) -> None:
    await wait_until(lambda: pids_with(tag) != [], STARTS_WITHIN_S, "the sample's sleep")


@solver
def _sleep_while(tag: str, trigger: Trigger | None = None) -> Solver:
    """Sleep through the sandbox; meanwhile, in a task of its own, ``trigger`` stops it."""

    async def solve(state: TaskState, generate: Generate) -> TaskState:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_sleep, tag)
            if trigger is not None:
                await _sleeping(tag)
                await trigger(state)
        return state

    return solve


def _config(tmp_path: Path) -> SandbxConfig:
    return SandbxConfig(
        journal=str(tmp_path / "journal.jsonl"),
        pool_config=marked_pool_toml(tmp_path),
        view="host",  # the reasons do not depend on the view; this one needs no root
    )


async def _eval(
    tmp_path: Path, config: SandbxConfig, solve: Solver, samples: int = 1, **options: Any
) -> EvalLog:
    task = Task(
        dataset=[Sample(input=str(n)) for n in range(samples)],
        solver=solve,
        sandbox=("sandbx", config),
        **options,
    )
    [log] = await eval_async(task, model="mockllm/model", log_dir=str(tmp_path / "logs"))
    gc.collect()
    return log


def _outcome(journal: str, tag: str) -> dict[str, Any]:
    """The journaled outcome of the one call whose command carries ``tag``."""
    records = journal_records(journal)
    calls = {
        r["call_id"] for r in records if r["kind"] == "intent" and tag in str(r["args"].get("argv"))
    }
    (outcome,) = [r for r in records if r["kind"] == "outcome" and r["call_id"] in calls]
    assert len(outcome["reason"]) <= MAX_REASON
    assert "0x" not in outcome["reason"]  # no object's repr
    assert "<" not in outcome["reason"]
    return outcome


async def _reason(tmp_path: Path, solve: Callable[[str], Solver], **options: Any) -> str:
    tag, config = unique_tag(), _config(tmp_path)
    await _eval(tmp_path, config, solve(tag), **options)
    outcome = _outcome(config.journal or "", tag)
    assert outcome["status"] == "cancelled"
    assert pids_with(tag) == []
    return str(outcome["reason"])


# -- limits ------------------------------------------------------------------------------------


async def test_the_samples_time_limit(tmp_path: Path) -> None:
    reason = await _reason(tmp_path, _sleep_while, time_limit=1)
    assert reason == "Inspect: the sample's time limit (1 s) was reached"


@solver
def _sleep_in_a_scoped_time_limit(tag: str) -> Solver:
    async def solve(state: TaskState, generate: Generate) -> TaskState:
        try:
            with time_limit(1):
                await _sleep(tag)
        except LimitExceededError:
            pass
        return state

    return solve


async def test_a_scoped_time_limit(tmp_path: Path) -> None:
    reason = await _reason(tmp_path, _sleep_in_a_scoped_time_limit, time_limit=60)
    assert reason == "Inspect: a scoped time limit (1 s) was reached"


async def test_the_samples_working_time_limit(tmp_path: Path) -> None:
    # Inspect checks it every second, from a task of the sample's, and cancels the sample.
    reason = await _reason(tmp_path, _sleep_while, working_limit=1)
    assert reason == "Inspect: the sample's working time limit (1 s) was reached"


async def _too_many_messages(state: TaskState) -> None:
    for n in range(3):  # the input and two more: over a limit of 2
        state.messages.append(ChatMessageUser(content=f"more {n}"))


async def test_the_samples_message_limit(tmp_path: Path) -> None:
    # A message limit is enforced where the messages grow (here, beside the sleep), by raising.
    reason = await _reason(
        tmp_path, lambda tag: _sleep_while(tag, _too_many_messages), message_limit=2
    )
    assert reason == "Inspect: the sample's message limit (2) was reached"


@solver
def _sleep_under_a_deadline(tag: str) -> Solver:
    async def solve(state: TaskState, generate: Generate) -> TaskState:
        with anyio.move_on_after(1):  # the solver's own timeout, not one of Inspect's limits
            await _sleep(tag)
        return state

    return solve


async def test_the_solvers_own_timeout(tmp_path: Path) -> None:
    reason = await _reason(tmp_path, _sleep_under_a_deadline)
    assert reason == "Inspect: a timeout in the solver expired (a cancel scope's deadline)"


# -- the operator ------------------------------------------------------------------------------


@pytest.mark.parametrize("action", ["score", "error"])
async def test_the_operator_interrupting_the_sample(tmp_path: Path, action: str) -> None:
    # What Inspect's UI (and `inspect ctl`) do when the operator interrupts a running sample.
    async def interrupt(state: TaskState) -> None:
        active = sample_active()
        assert active is not None
        active.interrupt(action)  # type: ignore[arg-type]

    reason = await _reason(tmp_path, lambda tag: _sleep_while(tag, interrupt))
    assert reason == f"Inspect: the sample was interrupted by its operator ({action})"


# -- errors ------------------------------------------------------------------------------------


def _raises(message: str) -> Trigger:
    async def trigger(state: TaskState) -> None:
        raise ValueError(message)

    return trigger


async def test_another_part_of_the_sample_raising(tmp_path: Path) -> None:
    reason = await _reason(
        tmp_path, lambda tag: _sleep_while(tag, _raises("the grader's\nfile is missing"))
    )
    assert reason == (
        "Inspect: another part of the sample raised ValueError: the grader's file is missing"
    )


async def test_a_long_error_is_cut_short(tmp_path: Path) -> None:
    reason = await _reason(tmp_path, lambda tag: _sleep_while(tag, _raises("word " * 100)))
    assert reason.startswith("Inspect: another part of the sample raised ValueError: word word")
    assert reason.endswith("...")
    assert len(reason) <= MAX_REASON


@solver
def _one_fails_while_the_other_sleeps(tag: str) -> Solver:
    async def solve(state: TaskState, generate: Generate) -> TaskState:
        if state.input_text == "0":
            await _sleep(tag)
        else:
            await _sleeping(tag)
            raise ValueError("sample 1 broke")
        return state

    return solve


async def test_another_samples_error_ending_the_eval(tmp_path: Path) -> None:
    tag, config = unique_tag(), _config(tmp_path)
    log = await _eval(
        tmp_path, config, _one_fails_while_the_other_sleeps(tag), samples=2, fail_on_error=True
    )
    assert log.status == "error"
    outcome = _outcome(config.journal or "", tag)
    assert outcome["status"] == "cancelled"
    assert outcome["reason"] == (
        "Inspect: the eval stopped on an error elsewhere: ValueError: sample 1 broke"
    )


# -- the eval stopped from outside ---------------------------------------------------------------


async def test_the_eval_cancelled_by_its_caller(tmp_path: Path) -> None:
    tag, config = unique_tag(), _config(tmp_path)
    run = asyncio.create_task(_eval(tmp_path, config, _sleep_while(tag)))
    await _sleeping(tag)
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    outcome = _outcome(config.journal or "", tag)
    assert (outcome["status"], outcome["reason"]) == (
        "cancelled",
        "Inspect: the eval was cancelled",
    )


#: An eval in a process of its own, for Ctrl-C.
_EVAL_SCRIPT = textwrap.dedent(
    """
    import signal, sys
    # The default handler, whatever the shell that started us left (a background job
    # ignores SIGINT, and a process inherits that).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from inspect_ai import Task, eval
    from inspect_ai.dataset import Sample
    from inspect_ai.solver import solver
    from inspect_ai.util import sandbox
    from sandbx_pool.integrations.inspect_provider import SandbxConfig

    journal, pool_config, log_dir, command = sys.argv[1:]

    @solver
    def sleep():
        async def solve(state, generate):
            await sandbox().exec(["bash", "-c", command])
            return state
        return solve

    config = SandbxConfig(journal=journal, pool_config=pool_config, view="host")
    task = Task(dataset=[Sample(input="x")], solver=sleep(), sandbox=("sandbx", config))
    eval(task, model="mockllm/model", log_dir=log_dir)
    """
)


def _discard(loop: asyncio.AbstractEventLoop, fd: int) -> None:
    """Read and drop what the eval draws on its terminal, so that it never blocks writing."""
    try:
        os.read(fd, 65536)
    except OSError:  # EIO: the eval has closed the terminal
        loop.remove_reader(fd)


@pytest.mark.parametrize("display", ["none", "full"])
async def test_ctrl_c(tmp_path: Path, display: str) -> None:
    # "none": Ctrl-C as a terminal delivers it, SIGINT. "full": Inspect's full-screen display,
    # which reads the key itself from its terminal (a pseudo-terminal here), in raw mode.
    tag, config = unique_tag(), _config(tmp_path)
    assert config.journal is not None
    assert config.pool_config is not None
    argv = [config.journal, config.pool_config, str(tmp_path / "logs"), tagged_sleep(tag, 30)]
    env = {**os.environ, "INSPECT_DISPLAY": display, "TERM": "xterm-256color"}
    terminal, eval_side = pty.openpty()
    fcntl.ioctl(eval_side, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))  # a screen
    loop = asyncio.get_running_loop()
    loop.add_reader(terminal, _discard, loop, terminal)
    try:
        with os.fdopen(eval_side, "wb") as tty, (tmp_path / "stderr").open("wb") as stderr:
            process = await asyncio.create_subprocess_exec(
                *(sys.executable, "-c", _EVAL_SCRIPT, *argv),
                env=env,
                stdin=tty,
                stdout=tty,
                stderr=stderr,
                start_new_session=True,  # no terminal of ours: it has its own
            )
        try:
            await _sleeping(tag)
            if display == "full":
                os.write(terminal, b"\x03")
            else:
                process.send_signal(signal.SIGINT)
            await asyncio.wait_for(process.wait(), EXITS_WITHIN_S)
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
    finally:
        loop.remove_reader(terminal)
        os.close(terminal)
    stderr_tail = (tmp_path / "stderr").read_text(errors="replace")[-2000:]
    outcome = _outcome(config.journal, tag)
    assert (outcome["status"], outcome["reason"]) == (
        "cancelled",
        "Inspect: the eval was interrupted (Ctrl-C)",
    ), stderr_tail
    assert pids_with(tag) == []


@solver
def _runs_true() -> Solver:
    async def solve(state: TaskState, generate: Generate) -> TaskState:
        assert (await sandbox().exec(["true"])).success
        return state

    return solve


async def test_the_next_task_removes_what_an_interrupted_eval_left(tmp_path: Path) -> None:
    """An eval stopped by Ctrl-C (or killed) never cleans its task's directory up; the next
    task under the same root removes it once its owner is gone, and nothing of a live one."""
    root = tmp_path / "root"
    root.mkdir()
    gone = await asyncio.create_subprocess_exec("true")
    await gone.wait()  # a pid with no process behind it
    abandoned = root / f"sandbx-inspect-{gone.pid}-1-AbC123"
    (abandoned / "sample-1").mkdir(parents=True)
    (abandoned / "sample-1" / "work.txt").write_text("left by a killed eval")
    live = root / f"sandbx-inspect-{owner_tag()}-XyZ789"  # ours: alive
    live.mkdir()
    config = _config(tmp_path).model_copy(update={"root": str(root)})
    log = await _eval(tmp_path, config, _runs_true())
    assert log.status == "success"
    assert not abandoned.exists()
    assert live.exists()
