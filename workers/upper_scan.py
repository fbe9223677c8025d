"""A call's change set: what its overlay's upper directory says it did.

Run by a worker on the real workspace (an internal action, workers.tools.change_actions), never by
the coordinator, which does not touch the workspace's filesystem:

    scan(upper, workspace)     the upper directory against the workspace it lay over:
                               created, modified, deleted (whiteouts, opaque directories),
                               bounded (TooLarge past a Bound's paths or bytes)
    listed(changes, applied)   the list an outcome carries
    workers.change_images      the pre-images kept, the paths set (apply) or put back (undo)

Both trees are read beneath their roots without following a symlink in any name
(workers.beneath): a symlink already in the workspace (``lnk -> /etc``) is a symlink, never a
way to ``/etc/shadow``, whatever the call made of ``lnk/shadow`` in its upper directory.

What counts as a change. A path in the upper directory whose type, mode and content (a
symlink: its target) equal the workspace's is not one: overlayfs copies a file up for a
``touch`` or an open for writing that writes nothing, and that is no change to the workspace.
A directory is listed only when it was created, deleted, or its mode changed: a directory
copied up because something inside it changed is no change of its own. Every path under a
deleted directory is listed (each has its pre-image). Owners and timestamps are not compared
nor applied: an applied file belongs to the pool's user, with the time it was applied.
"""

from __future__ import annotations

import os
import stat
from typing import Any, Literal

import msgspec

from sandbx_pool.workers.beneath import Beneath, Swapped

Kind = Literal["created", "modified", "deleted"]
EntryType = Literal["file", "dir", "symlink", "other"]

_OPAQUE = ("user.overlay.opaque", "trusted.overlay.opaque")


class Image(msgspec.Struct, frozen=True, omit_defaults=True):
    """What one path was: its type (``absent``: nothing there), mode, content's sha256 (a file)
    or target (a symlink)."""

    type: str
    mode: int | None = None
    sha256: str | None = None
    target: str | None = None


class PathImages(msgspec.Struct, frozen=True):
    pre: Image
    post: Image


class Change(msgspec.Struct, frozen=True):
    path: str
    kind: Kind
    type: EntryType
    size: int | None


class Images(msgspec.Struct, frozen=True):
    """A call's applied change set: each path's state before and after, and the change list
    as it was scanned before anything was applied (images.json)."""

    call_id: str
    paths: dict[str, PathImages]
    changes: list[Change] = []


images_encoder = msgspec.json.Encoder()
images_decoder = msgspec.json.Decoder(Images)

ABSENT = Image("absent")


class Bound(msgspec.Struct, frozen=True):
    """How large a change set may be (``[workspace] max_change_paths``, ``max_change_bytes``):
    the paths listed, and the bytes of the files it would write."""

    paths: int
    bytes: int


class TooLarge(Exception):
    """The change set passed its Bound: the scan stopped there."""


def _type_of(st: os.stat_result) -> EntryType:
    if stat.S_ISDIR(st.st_mode):
        return "dir"
    if stat.S_ISLNK(st.st_mode):
        return "symlink"
    if stat.S_ISREG(st.st_mode):
        return "file"
    return "other"


def _is_whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def _is_opaque(tree: Beneath, rel: str) -> bool:
    return any(tree.getxattr(rel, name) == b"y" for name in _OPAQUE)


def same_content(a: int, b: int) -> bool:
    """Whether two open files hold the same bytes (both descriptors closed)."""
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            chunk_a, chunk_b = fa.read(1 << 20), fb.read(1 << 20)
            if chunk_a != chunk_b:
                return False
            if not chunk_a:
                return True


def _unchanged(
    upper: Beneath, lower: Beneath, rel: str, upper_st: os.stat_result, lower_st: os.stat_result
) -> bool:
    if _type_of(upper_st) != _type_of(lower_st):
        return False
    if stat.S_IMODE(upper_st.st_mode) != stat.S_IMODE(lower_st.st_mode):
        return False
    if stat.S_ISLNK(upper_st.st_mode):
        return upper.readlink(rel) == lower.readlink(rel)
    if stat.S_ISREG(upper_st.st_mode):
        if upper_st.st_size != lower_st.st_size:
            return False
        ours = upper.read_file(rel)
        try:
            theirs = lower.read_file(rel)
        except BaseException:
            os.close(ours)
            raise
        return same_content(ours, theirs)
    return stat.S_ISDIR(upper_st.st_mode)


def _size(st: os.stat_result) -> int | None:
    return None if stat.S_ISDIR(st.st_mode) else st.st_size


class _Found:
    """The changes found so far, held to a Bound."""

    def __init__(self, bound: Bound | None) -> None:
        self.changes: list[Change] = []
        self.bound = bound
        self.bytes = 0

    def add(self, change: Change) -> None:
        self.changes.append(change)
        if self.bound is None:
            return
        if change.kind != "deleted" and change.type == "file" and change.size:
            self.bytes += change.size
        if len(self.changes) > self.bound.paths:
            raise TooLarge(f"more than {self.bound.paths} paths (max_change_paths)")
        if self.bytes > self.bound.bytes:
            raise TooLarge(f"more than {self.bound.bytes} bytes of files (max_change_bytes)")


def scan(upper: str, workspace: str, bound: Bound | None = None) -> list[Change]:
    """The change set of an upper directory laid over ``workspace``, sorted by path; TooLarge
    past ``bound``. Both are read beneath their roots, no symlink followed (workers.beneath):
    a name below one of the workspace's symlinks is not in the workspace."""
    with Beneath(upper) as up, Beneath(workspace) as lower:
        found = _Found(bound)
        _scan(up, lower, found)
    found.changes.sort(key=lambda change: change.path)
    return found.changes


def _lower_names(lower: Beneath, rel: str) -> list[str]:
    """The names of the workspace's directory ``rel``; none where it is not a directory
    reached without a symlink (it has no children the call could have removed)."""
    try:
        return lower.listdir(rel)
    except (Swapped, FileNotFoundError, NotADirectoryError):
        return []


def _scan(upper: Beneath, lower: Beneath, found: _Found) -> None:
    def deleted_below(rel: str) -> None:
        # Everything a deleted or replaced directory held, each with its own entry.
        for name in _lower_names(lower, rel):
            path = f"{rel}/{name}"
            st = lower.lstat(path)
            if st is None:
                continue
            found.add(Change(path, "deleted", _type_of(st), None))
            if stat.S_ISDIR(st.st_mode):
                deleted_below(path)

    def walk(rel: str) -> None:
        names = upper.listdir(rel)
        if rel and _is_opaque(upper, rel):
            present = set(names)
            lower_st = lower.lstat(rel)
            if lower_st is not None and stat.S_ISDIR(lower_st.st_mode):
                for name in _lower_names(lower, rel):
                    if name in present:
                        continue
                    path = f"{rel}/{name}"
                    st = lower.lstat(path)
                    if st is None:
                        continue
                    found.add(Change(path, "deleted", _type_of(st), None))
                    if stat.S_ISDIR(st.st_mode):
                        deleted_below(path)
        for name in names:
            path = f"{rel}/{name}" if rel else name
            upper_st, lower_st = upper.lstat(path), lower.lstat(path)
            if upper_st is None:
                continue  # gone since it was listed: the call's worker is over, so never
            if _is_whiteout(upper_st):
                if lower_st is not None:
                    found.add(Change(path, "deleted", _type_of(lower_st), None))
                    if stat.S_ISDIR(lower_st.st_mode):
                        deleted_below(path)
                continue
            replaced = lower_st is not None and stat.S_ISDIR(lower_st.st_mode)
            if replaced and not stat.S_ISDIR(upper_st.st_mode):
                deleted_below(path)  # a directory replaced by a file or symlink
            if lower_st is None:
                found.add(Change(path, "created", _type_of(upper_st), _size(upper_st)))
            elif not _unchanged(upper, lower, path, upper_st, lower_st):
                found.add(Change(path, "modified", _type_of(upper_st), _size(upper_st)))
            if stat.S_ISDIR(upper_st.st_mode):
                walk(path)

    walk("")


def listed(items: list[Change], applied: bool | set[str]) -> list[dict[str, Any]]:
    """The change list as an outcome carries it: ``applied`` True for every path that can be
    (a FIFO, socket or device is never made in the workspace), False for none, or the set
    of paths that were. A name that is not UTF-8 is shown escaped (the Result and the
    journal carry text only)."""
    return [
        {
            **msgspec.to_builtins(item),
            "path": item.path.encode("utf-8", "surrogateescape").decode(
                "utf-8", "backslashreplace"
            ),
            "applied": (
                item.path in applied
                if isinstance(applied, set)
                else applied and (item.type != "other" or item.kind == "deleted")
            ),
        }
        for item in items
    ]


# -- without an overlay: a listing before and after ------------------------------------------------

#: What a path is in a listing: type, mode, size, mtime and ctime (ns), inode, symlink target.
Entry = tuple[EntryType, int, int, int, int, int, str | None]


def listing(workspace: str) -> dict[str, Entry]:
    """Every path under ``workspace`` with what says it changed (tracked mode's fallback where
    no overlay can be mounted): one lstat a path, no content read. Directories it cannot read
    are left out, the same before and after."""
    found: dict[str, Entry] = {}

    def walk(directory: str, rel: str) -> None:
        try:
            with os.scandir(directory) as entries:
                items = [(entry.name, entry.path) for entry in entries]
        except OSError:
            return
        for name, path in items:
            try:
                st = os.lstat(path)
            except OSError:
                continue
            kind = _type_of(st)
            target = os.readlink(path) if kind == "symlink" else None
            key = f"{rel}/{name}" if rel else name
            mode = stat.S_IMODE(st.st_mode)
            size = st.st_size if kind != "dir" else 0
            found[key] = (kind, mode, size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, target)
            if kind == "dir":
                walk(path, key)

    walk(workspace, "")
    return found


def compare(before: dict[str, Entry], after: dict[str, Entry]) -> list[Change]:
    """What changed between two listings, sorted by path. A directory whose own type and mode
    are the same is not listed (its entries changing moves its times)."""
    changes: list[Change] = []
    for path, entry in after.items():
        kind = entry[0]
        size = None if kind == "dir" else entry[2]
        old = before.get(path)
        if old is None:
            changes.append(Change(path, "created", kind, size))
        elif kind == "dir" and old[0] == "dir":
            if old[1] != entry[1]:
                changes.append(Change(path, "modified", "dir", None))
        elif old != entry:
            changes.append(Change(path, "modified", kind, size))
    for path, entry in before.items():
        if path not in after:
            changes.append(Change(path, "deleted", entry[0], None))
    changes.sort(key=lambda change: change.path)
    return changes


__all__ = [
    "ABSENT",
    "Bound",
    "Change",
    "Image",
    "Images",
    "PathImages",
    "TooLarge",
    "compare",
    "listed",
    "listing",
    "same_content",
    "scan",
]
