"""Who a call runs as, when it names a user (``user`` in bash's and read's arguments).

The pool's own user is the default; naming another needs a root worker. bash hands the ids to
the command it starts (the worker keeps its own); read drops the worker itself to them, which
a disposable worker can afford: nothing after the tool needs more than its open connection.
"""

from __future__ import annotations

import os
import pwd
from dataclasses import dataclass

from sandbx_pool.workers.errors import ToolError


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int
    groups: list[int]
    home: str


def lookup(name: str) -> User:
    """The user ``name`` (or a uid); ToolError when unknown, or when we cannot become them."""
    try:
        entry = pwd.getpwuid(int(name)) if name.isdecimal() else pwd.getpwnam(name)
    except (KeyError, ValueError):
        raise ToolError(f"unknown user {name!r}") from None
    if os.geteuid() != 0 and entry.pw_uid != os.geteuid():
        raise ToolError(f"cannot run as user {name!r}: the worker is not root")
    groups = os.getgrouplist(entry.pw_name, entry.pw_gid)
    return User(entry.pw_name, entry.pw_uid, entry.pw_gid, groups, entry.pw_dir)


def become(user: User) -> None:
    """Drop this process to ``user`` for good: groups, then gid, then uid. The worker stays
    non-dumpable (the kernel resets the flag to fs.suid_dumpable, 0 by default, on the
    switch), so the call's secret in its memory stays closed to that user's processes."""
    if os.geteuid() == user.uid and os.getegid() == user.gid:
        return
    os.setgroups(user.groups)
    os.setgid(user.gid)
    os.setuid(user.uid)


__all__ = ["User", "become", "lookup"]
