"""Shell sessions: the cwd and exports a bash call leaves are the next call's in its session.

    Pool.call(tool, args, session="S")
        check_id("S")                      a bad id: ValueError, nothing journaled
        Sessions.accept(call)              synchronous, in call order: the call's turn comes
            |                              after the turn of S's previous call; S is bound to
            |                              the workspace and view of its first call
            v
    the driver (call_life), intent journaled, then the run, Sessions.around(call, run):
        wait for the previous call of S to end (a kill meanwhile: its outcome, nothing run)
        apply: call.cwd = S's cwd (unless the call gives one), call.session_env = S's exports
        run() --> the worker (workers.tools.shell_state) reports a ShellState with its Result
        settle: a bash call that ended ok (any exit status) --> S takes the reported state;
                any other end (error, timeout, cancel, crash, output_limit) --> S unchanged
        outcome.session = S's state after the call; the outcome record journals it
        S's next call may go

A new Pool on the same journal restores every session from the latest outcome record that
carries it (``Journal.sessions``), which is what ``run --resume`` relies on; a call whose
outcome was never journaled (its coordinator died) changed nothing the new pool sees.

Why the coordinator holds the state and the worker only reports it: the worker is disposable
and confined, and the coordinator decides, from the call's status, whether the report counts
(a killed call's does not). The coordinator never touches the workspace here either: the cwd
was resolved and confined by the worker that reported it, and is used as a lexical cwd.

Concurrent calls in one session run one after another, in the order ``pool.call`` was
entered; a call waiting for its turn holds no worker, and its timeout has not started. Other
tools than bash may name a session: they run in its cwd (a relative path means what the
shell meant) and leave it as it was.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

import msgspec

from sandbx_pool.call_seam import CallFeature, Run
from sandbx_pool.outcome import Outcome, Status

if TYPE_CHECKING:
    from sandbx_pool.call_state import CallState

#: A session id: a plain name of at most 128 characters.
MAX_ID_LENGTH: Final = 128
_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:@+-]*\Z")


def check_id(session: object) -> str:
    """``session`` if it is a plain id (letters, digits, ``_.:@+-``, not starting with a
    punctuation mark other than ``_``, at most 128 characters); else ValueError naming it."""
    if not isinstance(session, str):
        raise ValueError(f"session must be a str, not {type(session).__name__}")
    if not session or len(session) > MAX_ID_LENGTH or not _ID.match(session):
        shown = session if len(session) <= 64 else f"{session[:64]}... ({len(session)} chars)"
        raise ValueError(
            f"bad session id {shown!r}: 1 to {MAX_ID_LENGTH} letters, digits and _.:@+-,"
            " starting with a letter, digit or _"
        )
    return session


@dataclass
class Session:
    """One session's state: where its next call starts and what it exports."""

    workspace: str  # the absolute workspace its calls are confined to
    view: str | None = None  # their view, if they run in one (cwd is then the view's)
    cwd: str = "."  # relative to the workspace (or the view's root)
    env: dict[str, str] = field(default_factory=dict)
    #: Done once the latest call reserved in the session has ended.
    tail: asyncio.Future[None] | None = None

    def shown_cwd(self) -> str:
        """The cwd as the session's calls see it: a path in the view when they run in one."""
        root = "/" if self.view is not None else self.workspace
        return os.path.normpath(os.path.join(root, self.cwd))

    def public(self) -> dict[str, Any]:
        return {"cwd": self.shown_cwd(), "env": dict(self.env)}

    def record(self, session_id: str, *, updated: bool, note: str | None) -> dict[str, Any]:
        """What an outcome (and its journal record) says of the session after the call."""
        fields: dict[str, Any] = {"id": session_id, "workspace": self.workspace}
        if self.view is not None:
            fields["view"] = self.view
        fields.update(self.public(), updated=updated)
        if note is not None:
            fields["note"] = note
        return fields


class Sessions(CallFeature):
    """A pool's sessions, by id, and their calls' turns (a feature: call_seam.py). Used on the
    pool's event loop only."""

    def __init__(self) -> None:
        self._sessions: dict[str, Session] = {}
        #: Accepted calls, by id: their session, and the previous call's end to wait for.
        self._turns: dict[str, tuple[Session, asyncio.Future[None] | None]] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._sessions

    def restore(self, journaled: dict[str, dict[str, Any]]) -> None:
        """Sessions as the latest outcome records left them (Journal.sessions); a record that
        does not hold together (hand-edited, another version) is skipped."""
        for session_id, fields in journaled.items():
            with contextlib.suppress(KeyError, TypeError, ValueError):
                self._sessions[check_id(session_id)] = _from_record(fields)

    def accept(self, call: CallState) -> Callable[[], None] | None:
        """Take the call's turn in its session now (call order); returns the release of the
        turn, for when the call's driver is done: a driver may end without running it at all
        (killed before, its intent refused). Raises ValueError when the session belongs to
        another workspace or view. A call of no session: None."""
        session_id = call.session
        if session_id is None:
            return None
        workspace = call.workspace or ""
        session = self._sessions.get(session_id)
        if session is None:
            # Over an image, a session starts in the image's WorkingDir, as its calls do.
            start = os.path.relpath(call.start_dir or "/", "/") if call.view is not None else "."
            session = self._sessions[session_id] = Session(workspace, call.view, start)
        elif (session.workspace, session.view) != (workspace, call.view):
            where = f"workspace {session.workspace!r}, view {session.view!r}"
            raise ValueError(
                f"session {session_id!r} belongs to {where}; this call names workspace"
                f" {workspace!r}, view {call.view!r}"
            )
        previous, mine = session.tail, asyncio.get_running_loop().create_future()
        session.tail = mine
        self._turns[call.call_id] = (session, previous)

        def release() -> None:
            self._turns.pop(call.call_id, None)
            if not mine.done():
                mine.set_result(None)

        return release

    async def around(self, call: CallState, run: Run) -> Outcome:
        """Wait for the turn ``accept`` took, run the call in the session's state, settle it.
        A call not accepted here (a service's) just runs."""
        turn = self._turns.get(call.call_id)
        if turn is None or call.session is None:
            return await run()
        session_id, (session, previous) = call.session, turn
        if previous is not None and not previous.done():
            either: set[asyncio.Future[Any]] = {previous, call.kill_requested}
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
            if not previous.done():  # killed while it waited: nothing was run
                return self._settle(session_id, session, call, call.killed_outcome())
        self._apply(session, call)
        return self._settle(session_id, session, call, await run())

    async def state(self, session_id: str, workspace: str) -> dict[str, Any]:
        """``{"cwd", "env"}`` once the calls made in the session so far have ended; a session
        never used starts in ``workspace``'s root with no exports."""
        session = self._sessions.get(check_id(session_id))
        if session is None:
            return Session(workspace).public()
        tail = session.tail
        if tail is not None and not tail.done():
            await asyncio.shield(tail)
        return session.public()

    def forget(self, session_id: str) -> bool:
        """Drop a session (its next call starts afresh); False if there was none."""
        return self._sessions.pop(check_id(session_id), None) is not None

    @staticmethod
    def _apply(session: Session, call: CallState) -> None:
        if call.cwd is None:  # a cwd the call gives wins, for this call (relative to the root)
            call.cwd = session.cwd
        if call.tool == "bash":
            given = call.env or {}
            # The call's own env= wins for this call; the confinement never sees the rest.
            call.session_env = {k: v for k, v in session.env.items() if k not in given}

    @staticmethod
    def _settle(session_id: str, session: Session, call: CallState, outcome: Outcome) -> Outcome:
        shell = None
        if call.tool == "bash" and outcome.status is Status.OK and call.killer is None:
            result = call.result.result() if call.result.done() else None
            shell = result.session if result is not None else None
        note = None
        if call.tool != "bash":
            note = None
        elif outcome.status is not Status.OK:
            note = f"the call ended {outcome.status}: the session keeps its state"
        elif shell is None:
            note = "no shell ran (argv): the session keeps its state"
        else:
            note = shell.note
            if shell.cwd is not None:
                session.cwd = shell.cwd
            if shell.env is not None:
                env = dict(shell.env)
                for name in call.env or {}:
                    # Left at the value env= gave it: the session's own value is kept.
                    if name not in env and name in session.env:
                        env[name] = session.env[name]
                session.env = env
        updated = shell is not None and (shell.cwd is not None or shell.env is not None)
        record = session.record(session_id, updated=updated, note=note)
        return msgspec.structs.replace(outcome, session=record)


def _from_record(fields: dict[str, Any]) -> Session:
    workspace, view, cwd, env = (
        fields["workspace"],
        fields.get("view"),
        fields["cwd"],
        fields["env"],
    )
    if not (isinstance(workspace, str) and isinstance(cwd, str) and isinstance(env, dict)):
        raise TypeError("not a session record")
    root = "/" if view is not None else workspace
    relative = os.path.relpath(cwd, root)
    if relative == ".." or relative.startswith("../") or os.path.isabs(relative):
        raise ValueError(f"journaled cwd {cwd!r} is outside {root!r}")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise TypeError("env must map str to str")
    return Session(workspace, view, relative, dict(env))


__all__ = ["MAX_ID_LENGTH", "Session", "Sessions", "check_id"]
