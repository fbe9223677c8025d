"""Who a call in an image runs as: the image config's ``User``, as a container runtime reads it.

    User ""                 uid 0, gid 0 (the image names nobody)
    User "1000"             uid 1000; gid, home and groups from the image's /etc/passwd and
                            /etc/group when it lists uid 1000, else gid 0, home /
    User "app"              the entry named app in the image's /etc/passwd (none: the call is
                            refused, naming it, as docker refuses to start the container)
    User "app:staff"        ...and the group staff (or a number) as its gid, from /etc/group
    User "1000:1000"        numbers need no entry

Supplementary groups are the /etc/group entries that list the user by name, when the image
names no group (docker's and runc's reading). The files are read after the worker has entered
the image (workers.image_root.enter), so they are the image's, never the host's: a lookup
through ``pwd`` would read the host's (and the worker's NSS modules).

How the identity is taken (workers.sandbox): a root pool switches to it (setgroups, setgid,
setuid) where ``run_as`` would, so the image's file owners (kept by the root store) hold
against the call as in a container. A pool without root maps it instead: the call's user
namespace maps the image's uid and gid to the pool's own (workers.image_root.become), the one
pair the kernel lets an unprivileged process map. The call then is that uid, but every file of
the image (stored as the pool user's: no chown without root) is that uid's too, and it has no
supplementary groups; a rootless runtime with one mapped uid shows the same.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from sandbx_pool.workers.errors import ToolError

#: Most bytes of /etc/passwd or /etc/group read: an image's own, of any size it liked.
MAX_FILE_BYTES = 4 * 1024 * 1024
#: The highest id a user namespace maps (2^32 - 2: -1 means "no id").
MAX_ID = 4294967294


@dataclass(frozen=True)
class ImageUser:
    uid: int
    gid: int
    groups: tuple[int, ...]
    #: From the image's /etc/passwd: HOME when the call's environment sets none.
    home: str

    @property
    def is_root(self) -> bool:
        return self.uid == 0 and self.gid == 0 and not self.groups


ROOT = ImageUser(0, 0, (), "/root")


class ImageUserError(ToolError):
    """The image's User names a user or group the image does not have: the call is refused."""


def resolve(spec: str, root: str = "/") -> ImageUser:
    """The identity ``spec`` (the image's User) names, read from the image at ``root``."""
    spec = spec.strip()
    if not spec:
        return ROOT
    user, sep, group = spec.partition(":")
    if not user or (sep and not group):
        raise ImageUserError(f"the image's User {spec!r} is not USER[:GROUP]")
    passwd = _entries(os.path.join(root, "etc/passwd"), 7)
    if _is_id(user):
        uid = int(user)
        entry = next((e for e in passwd if e[2] == user), None)
    else:
        entry = next((e for e in passwd if e[0] == user), None)
        if entry is None:
            raise ImageUserError(
                f"the image's User {user!r} is not in the image's /etc/passwd: the call cannot"
                " run as it"
            )
        uid = _id(entry[2], f"/etc/passwd's uid of {user!r}")
    gid = 0 if entry is None else _id(entry[3], f"/etc/passwd's gid of {user!r}")
    home = (entry[5] if entry is not None else "") or "/"
    groups: tuple[int, ...] = ()
    etc_group = _entries(os.path.join(root, "etc/group"), 4)
    if sep:
        if _is_id(group):
            gid = int(group)
        else:
            found = next((e for e in etc_group if e[0] == group), None)
            if found is None:
                raise ImageUserError(
                    f"the image's User names group {group!r}, which is not in the image's"
                    " /etc/group"
                )
            gid = _id(found[2], f"/etc/group's gid of {group!r}")
    elif entry is not None:
        name = entry[0]
        groups = tuple(
            sorted(
                {
                    _id(e[2], f"/etc/group's gid of {e[0]!r}")
                    for e in etc_group
                    if name in e[3].split(",")
                }
                - {gid}
            )
        )
    return ImageUser(uid, gid, groups, home)


def _entries(path: str, fields: int) -> list[list[str]]:
    """The lines of a passwd-style file with at least ``fields`` fields; none if it is
    missing (an image without /etc/passwd still runs a numeric User)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as exc:
        raise ImageUserError(f"cannot read the image's {path}: {exc.strerror}") from None
    try:
        data = os.read(fd, MAX_FILE_BYTES)
    except OSError as exc:  # a directory, a FIFO with no writer (O_NONBLOCK): not a table
        raise ImageUserError(f"cannot read the image's {path}: {exc.strerror}") from None
    finally:
        os.close(fd)
    entries = []
    for line in data.decode("utf-8", "replace").splitlines():
        parts = line.split(":")
        if len(parts) >= fields and not line.startswith(("#", "+", "-")):
            entries.append(parts)
    return entries


def _is_id(text: str) -> bool:
    return text.isdecimal() and text.isascii() and int(text) <= MAX_ID


def _id(text: str, what: str) -> int:
    if not _is_id(text):
        raise ImageUserError(f"the image's {what} is not a number: {text!r}")
    return int(text)


__all__ = ["ROOT", "ImageUser", "ImageUserError", "resolve"]
