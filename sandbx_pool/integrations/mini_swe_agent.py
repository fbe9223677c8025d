"""A mini-swe-agent environment whose every command runs in a sandbx-pool worker.

Select it by dotted path, with no change to mini-swe-agent::

    environment:
      environment_class: sandbx_pool.integrations.mini_swe_agent.SandbxEnvironment
      cwd: /path/to/repo
      timeout: 60

mini-swe-agent is synchronous; the Pool is asyncio. The environment therefore owns a private
event loop on a thread of its own, started with the environment and stopped by ``close()``, or,
for an environment dropped without it (mini-swe-agent's own scripts never call it), when the
collector takes the environment (at interpreter exit, the pool's own finalizer releases it):

    agent thread --execute(action)--> run_coroutine_threadsafe(pool.call("bash", ...))
                                           |
                                  loop thread: Pool --> a disposable worker per command

Both protocols are accepted, told apart by the action's type:

* v2, ``execute(action: dict, cwd="", *, timeout=None) -> dict``: ``output`` (stdout, then
  stderr), ``returncode``, ``exception_info``. A timeout is returned (returncode -1), never
  raised; its whole process tree is dead by then. Output whose first line is the submission
  sentinel, from a command that exited 0, raises ``Submitted`` as the local environment does.
* v1, ``execute(command: str, cwd="", *, timeout=None) -> dict``: ``output`` and
  ``returncode``; a timeout raises ``subprocess.TimeoutExpired`` (v1 agents catch it) and the
  agent, not the environment, looks for the sentinel.

With ``image: REF`` (any reference ``pool.image`` takes: ``oci:DIR:TAG``, ``HOST/REPO:TAG``...)
the fields of mini-swe-agent's docker environment (``image``, ``cwd``, ``env``, ``forward_env``,
``timeout``) mean what they mean there: the image is pulled into the pool's image store once,
the environment gets one layer of its own over it (sandbx_pool.image_layer), and every command
runs in that layer with the image as its ``/``: the image's programs, its Env, its WorkingDir
when no ``cwd`` is given; writes stay in the layer, which ``close()`` removes. Nothing of the
host's environment reaches a command but the ``forward_env`` names.

With ``session: true`` in the config, commands share one shell session
(sandbx_pool.sessions): a ``cd`` or an ``export`` lasts into the next command, as in a
terminal (background jobs still end with their command); without it each command starts in
``cwd`` with a fresh environment.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import platform
import subprocess
import threading
import uuid
import weakref
from typing import Any

from minisweagent.exceptions import Submitted
from minisweagent.utils.serialize import recursive_merge
from pydantic import BaseModel

from sandbx_pool.layers import Layer
from sandbx_pool.outcome import Outcome, Status
from sandbx_pool.pool import Pool
from sandbx_pool.sessions import check_id

#: The first line of output that means "the task is done; the rest is the submission".
SUBMIT_SENTINEL = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"

#: How long close() waits for the pool to shut down before leaving the loop thread behind.
CLOSE_TIMEOUT_S = 30.0


class SandbxEnvironmentConfig(BaseModel):
    #: A container image every command runs in (one layer of this environment's over it), as
    #: DockerEnvironment's ``image``; "": the host's tree, confined to ``workspace``.
    image: str = ""
    cwd: str = ""  # default working directory (default: the workspace; the image's WorkingDir)
    workspace: str = ""  # what every path is confined to (default: cwd, else the current dir)
    env: dict[str, str] = {}  # added to each command's environment
    #: Names of the caller's variables given to each command when set (``env`` wins), as
    #: DockerEnvironment forwards them.
    forward_env: list[str] = []
    #: Commands get the caller's whole environment (os.environ, then env), as LocalEnvironment
    #: gives them. Off by default: the scrubbed one keeps API keys from the commands.
    pass_env: bool = False
    timeout: int = 30  # seconds, when execute() is given none
    workers: int | None = None  # parallel commands at most
    journal: str | None = None  # the journal of every command (None: a fresh one, logged)
    pool_config: str | None = None  # a sandbx-pool TOML file (gate, limits, sandbox...)
    #: direct, tracked or transactional (sandbx_pool.changes; None: the pool config's):
    #: "transactional" keeps a timed-out or killed command's writes out of the workspace.
    changes: str | None = None
    #: A shell session (sandbx_pool.sessions): each command starts where the previous one
    #: left (cd, exports), as in a terminal. True: one of this environment's own; a str: that
    #: id (restored from ``journal`` by a new environment on it). False: every command starts
    #: in ``cwd`` with a fresh environment, as LocalEnvironment runs them.
    session: bool | str = False


class SandbxEnvironment:
    def __init__(self, *, config_class: type = SandbxEnvironmentConfig, **kwargs: Any) -> None:
        """Start a Pool for this environment. See ``SandbxEnvironmentConfig`` for kwargs."""
        self.config = config_class(**kwargs)
        if self.config.image and self.config.pass_env:
            raise ValueError(
                "mini-swe-agent: pass_env gives the host's whole environment, which an image's"
                " commands must not get (its PATH is the image's): name them in forward_env"
            )
        # With an image, cwd is a path of the image's, not a host directory: the pool's own
        # workspace is never a call's there (each runs in the layer).
        host_cwd = "" if self.config.image else self.config.cwd
        self.workspace = os.path.abspath(self.config.workspace or host_cwd or os.getcwd())
        chosen = self.config.session
        self.session: str | None = (
            check_id(chosen)
            if isinstance(chosen, str)
            else (f"mini-swe-agent-{uuid.uuid4().hex[:12]}" if chosen else None)
        )
        #: A new session's first command starts in ``cwd``; the next ones (and a session
        #: restored from the journal) where it left off.
        self._session_started = False
        #: image=: this environment's layer over the image, removed by close().
        self.layer: Layer | None = None
        self._loop = asyncio.new_event_loop()
        # A daemon, so that an environment nobody closed cannot keep the interpreter alive;
        # its workers die with us anyway (the template's parent-death signal).
        self._thread = threading.Thread(
            target=_serve, args=(self._loop,), name="sandbx-mini-swe-agent", daemon=True
        )
        self._thread.start()
        try:
            self.pool = Pool(
                self.workspace,
                workers=self.config.workers,
                journal=self.config.journal,
                config=self.config.pool_config,
                changes=self.config.changes,
            )
        except BaseException:
            _stop_loop(self._loop, self._thread)
            raise
        # What close() does, done by the collector if close() never runs. It holds the loop,
        # its thread and the pool, never the environment: that would keep it alive.
        self._held = _Held(self.pool)
        self._dropped = weakref.finalize(
            self, _release_dropped, self._loop, self._thread, self._held
        )
        # Not at exit: by then no executor takes work (concurrent.futures shut them down
        # first), which closing the pool needs. The pool's own finalizer releases it then, and
        # the loop's thread, a daemon, ends with the interpreter.
        self._dropped.atexit = False
        try:
            self._run(self.pool.start())
            if self.config.image:
                name = f"mini-swe-agent-{uuid.uuid4().hex[:12]}"
                self.layer = self._held.layer = self._run(
                    self.pool.layer(name, image=self.config.image)
                )
            self._session_started = self.session is not None and self.pool.has_session(self.session)
        except BaseException:
            with contextlib.suppress(Exception):  # the start's failure is the one to report
                self.close()
            raise

    # -- mini-swe-agent's Environment protocol -----------------------------------------------

    def execute(
        self,
        action: dict[str, Any] | str,
        cwd: str = "",
        *,
        timeout: int | None = None,
    ) -> dict[str, Any]:
        """Run one command in its own worker; see the module docstring for both protocols."""
        if isinstance(action, str):
            return self._execute_v1(action, cwd, timeout)
        output = self._execute_v2(str(action.get("command", "")), cwd, timeout)
        self._check_finished(output)
        return output

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        # os.environ only with pass_env, as the local environment: otherwise the commands never
        # see it either.
        environ = dict(os.environ) if self.config.pass_env else {}
        merged: dict[str, Any] = recursive_merge(
            self.config.model_dump(), platform.uname()._asdict(), environ, kwargs
        )
        return merged

    def serialize(self) -> dict[str, Any]:
        return {
            "info": {
                "config": {
                    "environment": self.config.model_dump(mode="json"),
                    "environment_type": f"{type(self).__module__}.{type(self).__name__}",
                }
            }
        }

    def close(self) -> None:
        """Remove the image's layer, close the pool (no worker outlives it) and stop the loop
        thread. Idempotent."""
        if self._dropped.detach() is not None:  # None: closed already
            _close(self._loop, self._thread, self._held)

    cleanup = close  # the name mini-swe-agent's container environments use

    def __enter__(self) -> SandbxEnvironment:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- internals ---------------------------------------------------------------------------

    def _call(self, command: str, cwd: str, timeout: int | None) -> tuple[Outcome, float]:
        seconds = float(timeout or self.config.timeout)
        # Merged, as LocalEnvironment runs commands (stderr=STDOUT): one output, in order.
        args: dict[str, Any] = {"command": command, "merge_stderr": True}
        env = self._env()
        where = self._cwd(cwd)
        if self.session is not None:
            # Only a cwd given to this execute() moves a session that has started.
            where = where if not self._session_started or cwd else None
            self._session_started = True
        call = self.pool.call(
            "bash",
            args,
            timeout=seconds,
            cwd=where,
            env=env or None,
            session=self.session,
            workspace=self.layer,
        )
        return self._run(call), seconds

    def _env(self) -> dict[str, str]:
        """A command's variables: ``forward_env``'s (or with ``pass_env`` all the caller's),
        then ``env``, as DockerEnvironment gives them."""
        names: list[str] = list(os.environ) if self.config.pass_env else self.config.forward_env
        own: dict[str, str] = self.config.env
        return {name: os.environ[name] for name in names if name in os.environ} | own

    def _cwd(self, cwd: str) -> str | None:
        """Where a command starts, as LocalEnvironment chooses it: the call's cwd, else the
        config's, else the current directory; a relative one from the current directory (the
        pool would take it from the workspace). None: the workspace, when the current directory
        is outside it (a cwd outside it, given, is refused: the outcome says so)."""
        chosen = cwd or self.config.cwd
        if self.layer is not None:  # a path of the image's; none: its WorkingDir
            return chosen or None
        if chosen:
            return os.path.abspath(chosen)
        here = os.getcwd()
        inside = os.path.commonpath([here, self.workspace]) == self.workspace
        return here if inside else None

    def _execute_v2(self, command: str, cwd: str, timeout: int | None) -> dict[str, Any]:
        outcome, seconds = self._call(command, cwd, timeout)
        if outcome.status is Status.OK and outcome.value is not None:
            return {
                "output": _output(outcome.value),
                "returncode": outcome.value["exit_code"],
                "exception_info": "",
            }
        if outcome.status is Status.TIMEOUT:
            problem = f"Command '{command}' timed out after {seconds:g} seconds"
            kind = "TimeoutExpired"
        else:
            problem = f"{outcome.status}: {outcome.error or outcome.reason or 'no detail'}"
            kind = f"sandbx.{outcome.status}"
        return {
            # What the command printed until it was stopped, as LocalEnvironment returns it.
            "output": _output(outcome.value),
            "returncode": -1,
            "exception_info": f"An error occurred while executing the command: {problem}",
            "extra": {"exception_type": kind, "exception": problem, "call_id": outcome.call_id},
        }

    def _execute_v1(self, command: str, cwd: str, timeout: int | None) -> dict[str, Any]:
        outcome, seconds = self._call(command, cwd, timeout)
        if outcome.status is Status.TIMEOUT:
            raise subprocess.TimeoutExpired(command, seconds, output=_output(outcome.value))
        if outcome.status is Status.OK and outcome.value is not None:
            return {"output": _output(outcome.value), "returncode": outcome.value["exit_code"]}
        return {"output": f"{outcome.status}: {outcome.error or ''}", "returncode": -1}

    def _check_finished(self, output: dict[str, Any]) -> None:
        lines = output.get("output", "").lstrip().splitlines(keepends=True)
        if lines and lines[0].strip() == SUBMIT_SENTINEL and output["returncode"] == 0:
            submission = "".join(lines[1:])
            raise Submitted(
                {
                    "role": "exit",
                    "content": submission,
                    "extra": {"exit_status": "Submitted", "submission": submission},
                }
            )

    def _run(self, coroutine: Any, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)


def _serve(loop: asyncio.AbstractEventLoop) -> None:
    """The loop thread: the environment's loop, until stopped; then closed, by its own thread
    (an environment dropped from another thread is stopped without being waited for)."""
    try:
        loop.run_forever()
    finally:
        loop.close()


class _Held:
    """What an environment holds that its close releases: its pool, and its layer over an image
    (the layer first: the pool removes it)."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.layer: Layer | None = None

    async def release(self) -> None:
        try:
            if self.layer is not None:
                await self.layer.remove()
        finally:
            await self.pool.close()


def _close(loop: asyncio.AbstractEventLoop, thread: threading.Thread, held: _Held) -> None:
    """Release ``held`` on ``loop`` and wait for it (bounded), then stop the loop and its thread."""
    try:
        asyncio.run_coroutine_threadsafe(held.release(), loop).result(CLOSE_TIMEOUT_S)
    finally:
        _stop_loop(loop, thread)


def _stop_loop(loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
    loop.call_soon_threadsafe(loop.stop)
    thread.join()


#: The closing of dropped environments' pools, held until done (a loop keeps only weak
#: references to its tasks).
_closing: set[asyncio.Task[None]] = set()


def _release_dropped(
    loop: asyncio.AbstractEventLoop, thread: threading.Thread, held: _Held
) -> None:
    """An environment nobody closed, collected: close its pool and stop its loop, once.

    On the main thread (a ``del`` there) this waits, as close() does. Elsewhere it must not: a
    collection can run on any thread, the loop's own included, or a thread the pool's close
    waits for (the journal writer's). There the loop is asked to close the pool and then stop,
    and its thread ends by itself.
    """
    if threading.current_thread() is threading.main_thread():
        _close(loop, thread, held)
        return

    def stop(closed: asyncio.Task[None]) -> None:
        _closing.discard(closed)
        loop.stop()

    def close_then_stop() -> None:
        task = loop.create_task(held.release())
        _closing.add(task)
        task.add_done_callback(stop)

    with contextlib.suppress(RuntimeError):  # the loop already closed: nothing to stop
        loop.call_soon_threadsafe(close_then_stop)


def _output(value: dict[str, Any] | None) -> str:
    """A bash value's output (stderr is merged into stdout; "" when there is no value)."""
    if value is None:
        return ""
    return str(value.get("stdout", "")) + str(value.get("stderr", ""))
