"""What a call ends as: a status, who stopped it and why, and the tool's value.

Tool results are data, not exceptions: a file that does not exist is an ``Outcome`` with status
``error``; only misuse and broken infrastructure raise (see ``errors``).
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec


class Status(enum.StrEnum):
    OK = "ok"
    ERROR = "error"
    DENIED = "denied"
    CANCELLED = "cancelled"
    TIMEOUT = "timeout"
    OUTPUT_LIMIT = "output_limit"
    CRASHED = "crashed"


class KilledBy(enum.StrEnum):
    """Who decided to stop a call. Recorded before the kill, never inferred from the exit."""

    TOKEN = "token"
    TASK = "task"
    TIMEOUT = "timeout"
    OUTPUT_LIMIT = "output_limit"
    SHUTDOWN = "shutdown"


#: The status a call ends with when ``KilledBy`` stopped it.
STATUS_OF_KILLER: dict[KilledBy, Status] = {
    KilledBy.TOKEN: Status.CANCELLED,
    KilledBy.TASK: Status.CANCELLED,
    KilledBy.SHUTDOWN: Status.CANCELLED,
    KilledBy.TIMEOUT: Status.TIMEOUT,
    KilledBy.OUTPUT_LIMIT: Status.OUTPUT_LIMIT,
}


class Outcome(msgspec.Struct, kw_only=True, omit_defaults=True):
    """How one call ended.

    ``started`` says whether a worker received the call (its action may have happened).
    ``signal`` is the signal that ended a crashed worker. ``quarantined`` is set when the worker
    did not die after SIGKILL (blocked in the kernel, e.g. on a hung mount): the caller is
    released anyway and the worker is reaped whenever it finally exits; ``wchan`` says where it
    was stuck, and ``stuck_pid`` which process was (the worker, or a descendant: bash's).
    ``limit`` names the resource limit that stopped the call, if one did. ``error_code`` is the
    errno name (``"ENOENT"``) behind an ``error`` whose cause was an OS error: match on it, not
    on ``error``'s text, which names the caller's path. ``node`` is the Ray node id the call
    ran on, when it went through ``integrations.ray`` (None on one machine). ``changes``
    (tracked and transactional mode, sandbx_pool.changes): what the call did to the
    workspace, one dict per path, ``{"path", "kind", "type", "size", "applied"}``; ``[]``
    for a call that changed nothing; None in direct mode. ``session`` (a call made with
    ``session=``, sandbx_pool.sessions): the session's state after the call, ``{"id",
    "workspace", "cwd", "env", "updated", "note"}`` (``view`` too, in one); None otherwise.
    ``images_sha256``: for an applied change set, the sha256 of its kept images (J.d's
    images.json), journaled with the outcome: undo trusts no pre-image that does not match it.
    ``usage``: what the call's whole process tree cost, ``{"cpu_user_s", "cpu_system_s",
    "max_rss_bytes", "read_bytes", "write_bytes", "processes", "source"}`` (workers.usage says
    how each is measured, and what "cgroup" and "rusage" sources mean); None for a call that
    never started, and for one whose worker is still held by the kernel (quarantined).
    """

    call_id: str
    tool: str
    status: Status
    value: dict[str, Any] | None = None
    error: str | None = None
    reason: str | None = None
    started: bool = False
    duration_s: float = 0.0
    killed_by: KilledBy | None = None
    signal: int | None = None
    worker_pid: int | None = None
    limit: str | None = None
    quarantined: bool = False
    wchan: str | None = None
    stuck_pid: int | None = None
    error_code: str | None = None
    node: str | None = None
    changes: list[dict[str, Any]] | None = None
    session: dict[str, Any] | None = None
    images_sha256: str | None = None
    usage: dict[str, Any] | None = None

    @property
    def ok(self) -> bool:
        return self.status is Status.OK

    def to_dict(self) -> dict[str, Any]:
        result: dict[str, Any] = msgspec.to_builtins(self)
        return result
