"""A call's change set: what its overlay's upper directory says it did, applied or undone.

Run by a worker on the real workspace (an internal action, workers.tools.changes), never by
the coordinator, which does not touch the workspace's filesystem:

    scan(upper, workspace)     the upper directory against the workspace it lay over:
                               created, modified, deleted (whiteouts, opaque directories)
    apply(...)                 each path's pre-image saved first (J.d/objects/<sha256>, and
                               images.json beside the upper directory, made durable before the
                               workspace is touched), then the paths set, one at a time:
                               deletions deepest first, then directories, files, symlinks
                               shallowest first; a file by temp + fsync + rename
    undo(...)                  the images' post-images checked against the workspace (a path
                               changed since: refused, nothing changed), then the pre-images put
                               back

What counts as a change. A path in the upper directory whose type, mode and content (a
symlink: its target) equal the workspace's is not one: overlayfs copies a file up for a
``touch`` or an open for writing that writes nothing, and that is no change to the workspace.
A directory is listed only when it was created, deleted, or its mode changed: a directory
copied up because something inside it changed is no change of its own. Every path under a
deleted directory is listed (each has its pre-image). Owners and timestamps are not compared
nor applied: an applied file belongs to the pool's user, with the time it was applied.

Applying the same change set twice leaves what applying it once left, and the pre-images are
taken once (images.json is kept): a coordinator killed mid-apply has the apply run again on
reopen (sandbx_pool.changes), which finishes it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
from typing import Any, Literal

import msgspec

from sandbx_pool.workers import _libc

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

#: syncfs(2)'s number where it is known (elsewhere: sync(2), the whole machine's).
_SYS_SYNCFS = {"x86_64": 306, "aarch64": 267}.get(os.uname().machine)


def _type_of(st: os.stat_result) -> EntryType:
    if stat.S_ISDIR(st.st_mode):
        return "dir"
    if stat.S_ISLNK(st.st_mode):
        return "symlink"
    if stat.S_ISREG(st.st_mode):
        return "file"
    return "other"


def _lstat(path: str) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None
    except NotADirectoryError:
        return None


def _is_whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def _is_opaque(path: str) -> bool:
    for name in _OPAQUE:
        with contextlib.suppress(OSError):
            if os.getxattr(path, name, follow_symlinks=False) == b"y":
                return True
    return False


def _same_content(a: str, b: str) -> bool:
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            chunk_a, chunk_b = fa.read(1 << 20), fb.read(1 << 20)
            if chunk_a != chunk_b:
                return False
            if not chunk_a:
                return True


def _unchanged(up: str, upper_st: os.stat_result, lo: str, lower_st: os.stat_result) -> bool:
    if _type_of(upper_st) != _type_of(lower_st):
        return False
    if stat.S_IMODE(upper_st.st_mode) != stat.S_IMODE(lower_st.st_mode):
        return False
    if stat.S_ISLNK(upper_st.st_mode):
        return os.readlink(up) == os.readlink(lo)
    if stat.S_ISREG(upper_st.st_mode):
        return upper_st.st_size == lower_st.st_size and _same_content(up, lo)
    return stat.S_ISDIR(upper_st.st_mode)


def _size(st: os.stat_result) -> int | None:
    return None if stat.S_ISDIR(st.st_mode) else st.st_size


def scan(upper: str, workspace: str) -> list[Change]:
    """The change set of an upper directory laid over ``workspace``, sorted by path."""
    changes: list[Change] = []

    def deleted_below(rel: str, lower: str) -> None:
        # Everything a deleted or replaced directory held, each with its own entry.
        with os.scandir(lower) as entries:
            names = sorted(entry.name for entry in entries)
        for name in names:
            path = f"{rel}/{name}" if rel else name
            st = os.lstat(os.path.join(lower, name))
            changes.append(Change(path, "deleted", _type_of(st), None))
            if stat.S_ISDIR(st.st_mode):
                deleted_below(path, os.path.join(lower, name))

    def walk(rel: str) -> None:
        here = os.path.join(upper, rel) if rel else upper
        with os.scandir(here) as entries:
            names = sorted(entry.name for entry in entries)
        lower_dir = os.path.join(workspace, rel) if rel else workspace
        opaque = bool(rel) and _is_opaque(here)
        if opaque and os.path.isdir(lower_dir) and not os.path.islink(lower_dir):
            present = set(names)
            with os.scandir(lower_dir) as entries:
                gone = sorted(entry.name for entry in entries if entry.name not in present)
            for name in gone:
                path = f"{rel}/{name}" if rel else name
                st = os.lstat(os.path.join(lower_dir, name))
                changes.append(Change(path, "deleted", _type_of(st), None))
                if stat.S_ISDIR(st.st_mode):
                    deleted_below(path, os.path.join(lower_dir, name))
        for name in names:
            path = f"{rel}/{name}" if rel else name
            up, lo = os.path.join(upper, path), os.path.join(workspace, path)
            upper_st, lower_st = os.lstat(up), _lstat(lo)
            if _is_whiteout(upper_st):
                if lower_st is not None:
                    changes.append(Change(path, "deleted", _type_of(lower_st), None))
                    if stat.S_ISDIR(lower_st.st_mode):
                        deleted_below(path, lo)
                continue
            replaced = lower_st is not None and stat.S_ISDIR(lower_st.st_mode)
            if replaced and not stat.S_ISDIR(upper_st.st_mode):
                deleted_below(path, lo)  # a directory replaced by a file or symlink
            if lower_st is None:
                changes.append(Change(path, "created", _type_of(upper_st), _size(upper_st)))
            elif not _unchanged(up, upper_st, lo, lower_st):
                changes.append(Change(path, "modified", _type_of(upper_st), _size(upper_st)))
            if stat.S_ISDIR(upper_st.st_mode):
                walk(path)

    walk("")
    changes.sort(key=lambda change: change.path)
    return changes


def listed(items: list[Change], applied: bool) -> list[dict[str, Any]]:
    """The change list as an outcome carries it. A name that is not UTF-8 is shown escaped
    (the Result and the journal carry text only); a FIFO, socket or device is never made in
    the workspace (set_to), so it is never applied."""
    return [
        {
            **msgspec.to_builtins(item),
            "path": item.path.encode("utf-8", "surrogateescape").decode(
                "utf-8", "backslashreplace"
            ),
            "applied": applied and (item.type != "other" or item.kind == "deleted"),
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


# -- images --------------------------------------------------------------------------------------


def _hash_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def image_of(path: str) -> Image:
    """What ``path`` is now (its content hashed, not stored)."""
    st = _lstat(path)
    if st is None:
        return ABSENT
    mode = stat.S_IMODE(st.st_mode)
    if stat.S_ISREG(st.st_mode):
        return Image("file", mode, sha256=_hash_file(path))
    if stat.S_ISLNK(st.st_mode):
        return Image("symlink", target=os.readlink(path))
    if stat.S_ISDIR(st.st_mode):
        return Image("dir", mode)
    return Image(_type_of(st), mode)


def _durable_copy(source: str, target_dir: str, name: str, mode: int = 0o600) -> None:
    """Copy ``source`` to ``target_dir/name`` by temp + fsync + rename + the directory's fsync."""
    temp = os.path.join(target_dir, f".{name}.sbx-tmp-{os.urandom(6).hex()}")
    try:
        with open(source, "rb") as src:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
            with open(fd, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
                dst.flush()
                os.fchmod(dst.fileno(), mode)
                os.fsync(dst.fileno())
        os.rename(temp, os.path.join(target_dir, name))
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    _fsync_dir(target_dir)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def keep_object(path: str, objects: str, sha256: str) -> None:
    """Store ``path``'s content as ``objects/<sha256>`` unless it is there already."""
    if not os.path.exists(os.path.join(objects, sha256)):
        _durable_copy(path, objects, sha256)


def write_images(images: Images, path: str) -> None:
    temp = f"{path}.tmp"
    with open(temp, "wb") as f:
        f.write(images_encoder.encode(images))
        f.flush()
        os.fsync(f.fileno())
    os.rename(temp, path)
    _fsync_dir(os.path.dirname(path))


def read_images(path: str) -> Images:
    with open(path, "rb") as f:
        return images_decoder.decode(f.read())


def take_images(
    call_id: str, changes: list[Change], upper: str, workspace: str, objects: str
) -> Images:
    """Each changed path's pre-image (its content kept in ``objects``) and post-image."""
    paths: dict[str, PathImages] = {}
    for change in changes:
        current = os.path.join(workspace, change.path)
        pre = image_of(current)
        if pre.sha256 is not None:
            keep_object(current, objects, pre.sha256)
        post = ABSENT if change.kind == "deleted" else image_of(os.path.join(upper, change.path))
        paths[change.path] = PathImages(pre, post)
    return Images(call_id, paths, changes)


# -- setting paths -------------------------------------------------------------------------------


def _remove(path: str) -> None:
    st = _lstat(path)
    if st is None:
        return
    if stat.S_ISDIR(st.st_mode):
        with contextlib.suppress(FileNotFoundError):
            os.rmdir(path)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _put_dir(path: str, mode: int | None) -> None:
    st = _lstat(path)
    if st is not None and not stat.S_ISDIR(st.st_mode):
        os.unlink(path)
        st = None
    if st is None:
        os.mkdir(path, 0o700)
    if mode is not None:
        os.chmod(path, mode)


def _stage_file(path: str, source: str, mode: int) -> str:
    """Write ``source``'s content to a temp beside ``path`` (not synced: set_to syncs the
    filesystem once for all of them); the temp's path."""
    parent, name = os.path.split(path)
    temp = os.path.join(parent, f".{name}.sbx-tmp-{os.urandom(6).hex()}")
    try:
        with open(source, "rb") as src:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with open(fd, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
                os.fchmod(dst.fileno(), mode)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    return temp


def _put_staged(path: str, temp: str) -> None:
    st = _lstat(path)
    if st is not None and stat.S_ISDIR(st.st_mode):
        os.rmdir(path)  # emptied first: its contents were deleted, deepest first
    os.rename(temp, path)


def _sync_filesystem(path: str) -> None:
    """syncfs(2) on ``path``'s filesystem: every staged file's data on disk in one flush,
    where an fsync per file cost 1.3 ms a file here (1,000 files: 1.3 s)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if _SYS_SYNCFS is None or _libc.try_syscall(_SYS_SYNCFS, fd) != 0:
            os.sync()
    finally:
        os.close(fd)


def _put_symlink(path: str, target: str) -> None:
    st = _lstat(path)
    if st is not None and stat.S_ISDIR(st.st_mode):
        os.rmdir(path)
    parent, name = os.path.split(path)
    temp = os.path.join(parent, f".{name}.sbx-tmp-{os.urandom(6).hex()}")
    os.symlink(target, temp)
    os.rename(temp, path)


def _order(images: Images) -> tuple[list[str], list[str]]:
    """Paths to remove (deepest first) and paths to set (shallowest first)."""
    removals = [path for path, image in images.paths.items() if image.post.type == "absent"]
    puts = [path for path, image in images.paths.items() if image.post.type != "absent"]
    removals.sort(key=lambda path: (-path.count("/"), path))
    puts.sort(key=lambda path: (path.count("/"), path))
    return removals, puts


def set_to(images: Images, which: Literal["pre", "post"], workspace: str, source: Any) -> None:
    """Make every path of ``images`` what its ``which`` image says. ``source(path, image)``
    gives the file to copy a file's content from."""
    selected = Images(
        images.call_id,
        {
            path: PathImages(image.pre, getattr(image, which))
            for path, image in images.paths.items()
        },
    )
    removals, puts = _order(selected)
    for path in removals:
        _remove(os.path.join(workspace, path))
    # Directories and symlinks in place, files staged beside their targets; then one sync of
    # the filesystem, the files renamed over their targets, and a second sync for the renames.
    staged: list[tuple[str, str]] = []
    renamed = 0
    try:
        for path in puts:
            image = selected.paths[path].post
            target = os.path.join(workspace, path)
            if image.type == "dir":
                _put_dir(target, image.mode)
            elif image.type == "symlink":
                assert image.target is not None
                _put_symlink(target, image.target)
            elif image.type == "file":
                staged.append(
                    (target, _stage_file(target, source(path, image), image.mode or 0o644))
                )
            # A FIFO, socket or device ("other") is listed, never made: not applied, not restored.
        _sync_filesystem(workspace)
        for target, temp in staged:
            _put_staged(target, temp)
            renamed += 1
    finally:
        for _, temp in staged[renamed:]:  # not renamed: an error stopped the apply
            with contextlib.suppress(OSError):
                os.unlink(temp)
    _sync_filesystem(workspace)


def mismatches(images: Images, workspace: str) -> list[str]:
    """The paths whose state in ``workspace`` is no longer their post-image, sorted."""
    return sorted(
        path
        for path, image in images.paths.items()
        if image_of(os.path.join(workspace, path)) != image.post
    )


__all__ = [
    "Change",
    "Image",
    "Images",
    "PathImages",
    "image_of",
    "mismatches",
    "read_images",
    "scan",
    "set_to",
    "take_images",
    "write_images",
]
