"""A change set's images: the pre-images kept before it is applied, and the paths set to one
image or the other (apply: the post-images, undo: the pre-images).

    take_images(...)   each path's pre-image read from the workspace and its content kept
                       (J.d/objects/<sha256>, named by the hash of the bytes copied), its
                       post-image from the upper directory; images.json written durable before
                       the workspace is touched
    check_ancestors    every directory above a path that the change set does not set itself
                       must still be a directory reached without a symlink (Swapped otherwise:
                       the caller's conflict, before anything is written)
    set_to(...)        the paths set, one at a time: deletions deepest first, then
                       directories, files, symlinks shallowest first; a file by temp + rename
    mismatches(...)    the paths no longer what the apply left (undo refuses then)

Every path of the workspace and of the upper directory is reached beneath its root without
following a symlink (workers.beneath), through the descriptor of its own directory: a
directory swapped for a symlink at any moment is Swapped, never written through. J.d (objects,
images.json) is the coordinator's own directory, out of every call's reach from the pool's
start: it is opened by its path.

Applying the same change set twice leaves what applying it once left, and the pre-images are
taken once (images.json is kept): a coordinator killed mid-apply has the apply run again on
reopen (sandbx_pool.change_sets), which finishes it.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import stat
from collections.abc import Callable, Iterable
from typing import Literal

from sandbx_pool.workers import libc
from sandbx_pool.workers.beneath import Beneath, Swapped
from sandbx_pool.workers.upper_scan import (
    ABSENT,
    Change,
    Image,
    Images,
    PathImages,
    images_decoder,
    images_encoder,
)

#: syncfs(2)'s number where it is known (elsewhere: sync(2), the whole machine's).
_SYS_SYNCFS = {"x86_64": 306, "aarch64": 267}.get(os.uname().machine)
_TEMP = ".sbx-tmp-"

#: Gives an open descriptor to read a file's content from: (path, its image) -> fd.
Source = Callable[[str, Image], int]


def _copy(source_fd: int, dir_fd: int, name: str, mode: int) -> str:
    """Copy what ``source_fd`` holds to a new file ``name`` in ``dir_fd`` (O_EXCL, O_NOFOLLOW),
    its mode set; the sha256 of the bytes copied. Both descriptors are closed."""
    digest = hashlib.sha256()
    try:
        fd = os.open(
            name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=dir_fd
        )
    except BaseException:
        os.close(source_fd)
        raise
    with open(source_fd, "rb") as src, open(fd, "wb") as dst:
        while chunk := src.read(1 << 20):
            digest.update(chunk)
            dst.write(chunk)
        dst.flush()
        os.fchmod(dst.fileno(), mode)
    return digest.hexdigest()


def hash_fd(fd: int) -> str:
    """The sha256 of what ``fd`` holds (closed after)."""
    digest = hashlib.sha256()
    with open(fd, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def image_of(tree: Beneath, rel: str) -> Image:
    """What ``rel`` is now (its content hashed, not stored); absent below a symlink."""
    st = tree.lstat(rel)
    if st is None:
        return ABSENT
    mode = stat.S_IMODE(st.st_mode)
    if stat.S_ISREG(st.st_mode):
        return Image("file", mode, sha256=hash_fd(tree.read_file(rel)))
    if stat.S_ISLNK(st.st_mode):
        return Image("symlink", target=tree.readlink(rel))
    if stat.S_ISDIR(st.st_mode):
        return Image("dir", mode)
    return Image("other", mode)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def keep_pre_image(tree: Beneath, rel: str, objects: str) -> Image:
    """``rel``'s pre-image; a file's content copied into ``objects`` in the same pass, named by
    the hash of what was copied (a file rewritten meanwhile cannot be kept under another's
    name), made durable."""
    st = tree.lstat(rel)
    if st is None or not stat.S_ISREG(st.st_mode):
        return image_of(tree, rel)
    temp = f".object{_TEMP}{os.urandom(6).hex()}"
    objects_fd = os.open(objects, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            sha256 = _copy(tree.read_file(rel), objects_fd, temp, 0o600)
            fd = os.open(temp, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=objects_fd)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            if os.path.exists(os.path.join(objects, sha256)):
                os.unlink(temp, dir_fd=objects_fd)
            else:
                os.rename(temp, sha256, src_dir_fd=objects_fd, dst_dir_fd=objects_fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temp, dir_fd=objects_fd)
            raise
        os.fsync(objects_fd)
    finally:
        os.close(objects_fd)
    return Image("file", stat.S_IMODE(st.st_mode), sha256=sha256)


def write_images(images: Images, path: str) -> str:
    """images.json, durable; the sha256 of its bytes (journaled with the call's outcome)."""
    data = images_encoder.encode(images)
    temp = f"{path}.tmp"
    with open(temp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.rename(temp, path)
    _fsync_dir(os.path.dirname(path))
    return hashlib.sha256(data).hexdigest()


def read_images(path: str) -> tuple[Images, str]:
    """images.json and the sha256 of the bytes it was decoded from."""
    with open(path, "rb") as f:
        data = f.read()
    return images_decoder.decode(data), hashlib.sha256(data).hexdigest()


def take_images(
    call_id: str, changes: list[Change], upper: Beneath, workspace: Beneath, objects: str
) -> Images:
    """Each changed path's pre-image (its content kept in ``objects``) and post-image."""
    paths: dict[str, PathImages] = {}
    for change in changes:
        pre = keep_pre_image(workspace, change.path, objects)
        post = ABSENT if change.kind == "deleted" else image_of(upper, change.path)
        paths[change.path] = PathImages(pre, post)
    return Images(call_id, paths, changes)


def check_ancestors(paths: Iterable[str], workspace: Beneath) -> None:
    """Swapped, naming it, when a directory above one of ``paths`` that is not itself one of
    them (the change set sets those) is no longer a directory reached without a symlink."""
    own = set(paths)
    checked: set[str] = {""}
    for path in sorted(own):
        names = path.split("/")
        for depth in range(1, len(names)):
            above = "/".join(names[:depth])
            if above in checked or above in own:
                continue
            st = workspace.lstat(above)
            if st is None or not stat.S_ISDIR(st.st_mode):
                raise Swapped(above)
            checked.add(above)


# -- setting paths, each through its directory's descriptor ---------------------------------------


def _stat_at(dir_fd: int, name: str) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def _remove(workspace: Beneath, rel: str) -> bool:
    """Whether ``rel`` is gone: False for a directory that still holds what was not to be
    removed (a protected path, left)."""
    try:
        dir_fd, name = workspace.parent(rel)
    except FileNotFoundError:
        return True  # its directory is gone already: nothing there to remove
    try:
        st = _stat_at(dir_fd, name)
        if st is None:
            return True
        with contextlib.suppress(FileNotFoundError):
            if stat.S_ISDIR(st.st_mode):
                os.rmdir(name, dir_fd=dir_fd)
            else:
                os.unlink(name, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ENOTEMPTY:
            return False
        raise
    finally:
        os.close(dir_fd)
    return True


def _put_dir(workspace: Beneath, rel: str, mode: int | None) -> None:
    dir_fd, name = workspace.parent(rel)
    try:
        st = _stat_at(dir_fd, name)
        if st is not None and not stat.S_ISDIR(st.st_mode):
            os.unlink(name, dir_fd=dir_fd)  # a symlink or file where the directory goes
            st = None
        if st is None:
            os.mkdir(name, 0o700, dir_fd=dir_fd)
        if mode is not None:
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)
            try:
                os.fchmod(fd, mode)
            finally:
                os.close(fd)
    finally:
        os.close(dir_fd)


def _stage_file(workspace: Beneath, rel: str, source_fd: int, mode: int) -> str:
    """Write ``source_fd``'s content to a temp beside ``rel`` (not synced: set_to syncs the
    filesystem once for all of them); the temp's name."""
    try:
        dir_fd, name = workspace.parent(rel)
    except BaseException:
        os.close(source_fd)
        raise
    temp = f".{name}{_TEMP}{os.urandom(6).hex()}"
    try:
        _copy(source_fd, dir_fd, temp, mode)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp, dir_fd=dir_fd)
        raise
    finally:
        os.close(dir_fd)
    return temp


def _put_staged(workspace: Beneath, rel: str, temp: str) -> None:
    dir_fd, name = workspace.parent(rel)
    try:
        st = _stat_at(dir_fd, name)
        if st is not None and stat.S_ISDIR(st.st_mode):
            os.rmdir(name, dir_fd=dir_fd)  # emptied first: its contents were deleted
        os.rename(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    finally:
        os.close(dir_fd)


def _drop_staged(workspace: Beneath, rel: str, temp: str) -> None:
    with contextlib.suppress(OSError, Swapped):
        dir_fd, _ = workspace.parent(rel)
        try:
            os.unlink(temp, dir_fd=dir_fd)
        finally:
            os.close(dir_fd)


def _put_symlink(workspace: Beneath, rel: str, target: str) -> None:
    dir_fd, name = workspace.parent(rel)
    try:
        st = _stat_at(dir_fd, name)
        if st is not None and stat.S_ISDIR(st.st_mode):
            os.rmdir(name, dir_fd=dir_fd)
        temp = f".{name}{_TEMP}{os.urandom(6).hex()}"
        os.symlink(target, temp, dir_fd=dir_fd)
        os.rename(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    finally:
        os.close(dir_fd)


def _sync_filesystem(workspace: Beneath) -> None:
    """syncfs(2) on the workspace's filesystem: every staged file's data on disk in one flush,
    where an fsync per file cost 1.3 ms a file here (1,000 files: 1.3 s)."""
    if _SYS_SYNCFS is None or libc.try_syscall(_SYS_SYNCFS, workspace.fd) != 0:
        os.sync()


def _order(paths: dict[str, Image]) -> tuple[list[str], list[str]]:
    """Paths to remove (deepest first) and paths to set (shallowest first)."""
    removals = [path for path, image in paths.items() if image.type == "absent"]
    puts = [path for path, image in paths.items() if image.type != "absent"]
    removals.sort(key=lambda path: (-path.count("/"), path))
    puts.sort(key=lambda path: (path.count("/"), path))
    return removals, puts


def set_to(
    images: Images,
    which: Literal["pre", "post"],
    workspace: Beneath,
    source: Source,
    *,
    skip: frozenset[str] = frozenset(),
    done: list[str] | None = None,
) -> None:
    """Make every path of ``images`` but ``skip`` what its ``which`` image says.
    ``source(path, image)`` opens the file to copy a file's content from. Each path set is
    appended to ``done`` as it lands (the caller's record of what was applied, should a
    directory be Swapped half-way)."""
    wanted = {
        path: getattr(image, which) for path, image in images.paths.items() if path not in skip
    }
    done = done if done is not None else []
    removals, puts = _order(wanted)
    for path in removals:
        if _remove(workspace, path):
            done.append(path)
    # Directories and symlinks in place, files staged beside their targets; then one sync of
    # the filesystem, the files renamed over their targets, and a second sync for the renames.
    staged: list[tuple[str, str]] = []
    renamed = 0
    try:
        for path in puts:
            image = wanted[path]
            if image.type == "dir":
                _put_dir(workspace, path, image.mode)
                done.append(path)
            elif image.type == "symlink":
                assert image.target is not None
                _put_symlink(workspace, path, image.target)
                done.append(path)
            elif image.type == "file":
                temp = _stage_file(workspace, path, source(path, image), image.mode or 0o644)
                staged.append((path, temp))
            # A FIFO, socket or device ("other") is listed, never made: not applied, not restored.
        _sync_filesystem(workspace)
        for path, temp in staged:
            _put_staged(workspace, path, temp)
            renamed += 1
            done.append(path)
    finally:
        for path, temp in staged[renamed:]:  # not renamed: an error stopped the apply
            _drop_staged(workspace, path, temp)
    _sync_filesystem(workspace)


def mismatches(images: Images, workspace: Beneath, skip: frozenset[str] = frozenset()) -> list[str]:
    """The paths whose state in ``workspace`` is no longer their post-image, sorted."""
    return sorted(
        path
        for path, image in images.paths.items()
        if path not in skip and image_of(workspace, path) != image.post
    )


__all__ = [
    "Source",
    "check_ancestors",
    "hash_fd",
    "image_of",
    "keep_pre_image",
    "mismatches",
    "read_images",
    "set_to",
    "take_images",
    "write_images",
]
