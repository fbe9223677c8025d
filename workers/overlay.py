"""The call's view of its workspace in tracked and transactional mode: an overlay.

    worker, before confine(): a mount namespace of its own (slave of the host's)
        overlay on the workspace:  lowerdir = the workspace itself (read only through it)
                                   upperdir = <changes_dir>/upper  (the call's change set)
                                   workdir  = <changes_dir>/work
    tool: sees the merged view; every byte it writes, every file it removes (a whiteout),
    lands in upperdir, never in the workspace
    after the call: another worker, on the real workspace, scans upperdir and applies it or
    not (workers.upper_scan; the coordinator decides: sandbx_pool.change_sets)

The upper directory is made by the coordinator beside the journal (``J.d/changes/<call_id>``),
on the journal's filesystem, not the workspace's: overlayfs refuses an upper directory inside
its lower one. ``userxattr``: overlayfs marks opaque directories with ``user.overlay.opaque``
rather than a ``trusted.`` attribute, so the scanning worker, which holds no capability, can
read the mark. ``redirect_dir=nofollow`` and ``metacopy=off``: a renamed directory is copied whole
and a chmod copies the file's data, so the upper directory alone says what each path became
(no redirect or metadata-only entry pointing back into the lower layer).

The namespace is the worker's, so the mount goes with it: nothing is left mounted on the host,
whatever happens to the call. confine() makes a nested namespace for bash afterwards, which
inherits this mount.

A call in a layer (``enter_layer``; sandbx_pool.layers) is the same overlay made to last:

    lowerdir = the layer's base, reached one name at a time (O_NOFOLLOW) and named by its
               descriptor (/proc/self/fd/N): a base a call turned into a symlink since the
               layer was made refuses the call, never redirects the lower layer
    upperdir = <store>/<name>/upper, workdir = <store>/<name>/work  (kept between calls)
    mounted on <store>/<name>/root, an empty directory on the host: the call's workspace
    then the base bound onto itself read-only, in this namespace: with or without Landlock
    (``filesystem = "host"``), by its own path or /proc/self/root, nothing reaches it writable;
    and the whole store covered by an empty read-only tmpfs that holds only this layer's root,
    the overlay bound there again: no upper or work directory (its own, under the overlay's
    feet, or another layer's) is in the call's reach

The coordinator lets one call at a time mount a layer (two live overlays on one upper
directory are undefined in the kernel), and only once the previous call's worker is gone.
"""

from __future__ import annotations

import os

from sandbx_pool.workers import image_root
from sandbx_pool.workers import libc as _libc
from sandbx_pool.workers.errors import ToolError
from sandbx_pool.workers.protocol import ExecutionContext

OPTIONS = "userxattr,redirect_dir=nofollow,metacopy=off,index=off"


class OverlayError(ToolError):
    """The call's overlay could not be mounted: the call is refused (status ``error``), never
    run on the workspace itself."""


#: ``error_code`` of a call whose layer could not be mounted, and of one whose base is wrong.
LAYER_UNAVAILABLE = "LAYER_UNAVAILABLE"
LAYER_BASE = "LAYER_BASE"


class LayerBaseError(OverlayError):
    """A layer's base is not a directory, or not the one the layer was made over."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code=LAYER_BASE)


def enter(ctx: ExecutionContext) -> None:
    """Mount the call's overlay on its workspace (its view's directory, for a call made in a
    view), in a mount namespace of this worker's own."""
    assert ctx.changes_dir is not None
    workspace = os.path.realpath(ctx.sandbox.view or ctx.workspace)
    upper = os.path.join(ctx.changes_dir, "upper")
    work = os.path.join(ctx.changes_dir, "work")
    for path in (workspace, upper, work):
        if any(c in path for c in ",:\\"):
            raise OverlayError(
                f"cannot mount an overlay on a path holding ',', ':' or '\\': {path}"
            )
    if _libc.try_unshare(_libc.CLONE_NEWNS) != 0:
        raise OverlayError(
            "the call's changes cannot be kept apart: no mount namespace here (the pool needs"
            ' root with CAP_SYS_ADMIN; or use changes = "direct")'
        )
    try:
        _libc.mount("none", "/", None, _libc.MS_REC | _libc.MS_SLAVE, None)
        options = f"lowerdir={workspace},upperdir={upper},workdir={work},{OPTIONS}"
        _libc.mount("sandbx-changes", workspace, "overlay", 0, options)
    except OSError as exc:
        raise OverlayError(f"cannot mount the call's overlay on {workspace}: {exc}") from exc


_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def _enter_image(ctx: ExecutionContext, *, image_only: bool) -> None:
    """A layer over an image: its lowers are the image's layers (workers.image_root), mounted
    on the layer's root. Nothing of the store needs covering: the call enters the overlay as
    its ``/`` (or, for the diff, reads only the image and the layer's upper directory)."""
    assert ctx.layer_dir is not None
    assert ctx.layer_image is not None
    root = ctx.layer_mount or ctx.workspace
    if _libc.try_unshare(_libc.CLONE_NEWNS) != 0:
        raise OverlayError(
            "a layer over an image cannot be mounted: no mount namespace here (the pool needs"
            " root with CAP_SYS_ADMIN, or user namespaces allowed: see sandbx-pool doctor)",
            code=LAYER_UNAVAILABLE,
        )
    try:
        _libc.mount("none", "/", None, _libc.MS_REC | _libc.MS_SLAVE, None)
        image_root.mount(ctx.layer_dir, ctx.layer_image, root, OPTIONS, upper=not image_only)
    except image_root.ImageMountError as exc:
        raise OverlayError(str(exc), code=LAYER_UNAVAILABLE) from exc
    except OSError as exc:
        raise OverlayError(f"cannot mount the layer: {exc}", code=LAYER_UNAVAILABLE) from exc


def _open_base(base: str) -> int:
    """A descriptor of ``base`` (an absolute, resolved path) reached from ``/`` one name at a
    time, no symlink followed; LayerBaseError naming what is wrong."""
    fd = os.open("/", _DIRECTORY)
    try:
        for name in [part for part in base.split("/") if part]:
            try:
                child = os.open(name, _DIRECTORY, dir_fd=fd)
            except OSError as exc:
                raise LayerBaseError(
                    f"the layer's base {base} is not a directory reached without a symlink"
                    f" ({os.strerror(exc.errno or 0)} at {name!r})"
                ) from exc
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _cover_store(layer_dir: str, root: str) -> None:
    """Cover the whole layer store with an empty read-only tmpfs holding only this layer's
    root, the overlay bound there again: the call reaches no upper or work directory (its
    own, under the overlay's feet, nor another layer's) and no record, with or without the
    filesystem rules."""
    store = os.path.dirname(layer_dir)
    name = os.path.basename(layer_dir)
    own_root = os.path.join(layer_dir, "root")
    held = os.open(root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        flags = _libc.MS_NOSUID | _libc.MS_NODEV | _libc.MS_NOEXEC
        _libc.mount("sandbx-layers", store, "tmpfs", flags, "size=4k,mode=0755")
        if root == own_root:  # else the layer is mounted elsewhere (in a view): not here
            os.mkdir(os.path.join(store, name), 0o755)
            os.mkdir(own_root, 0o755)
            _libc.mount(f"/proc/self/fd/{held}", root, None, _libc.MS_BIND, None)
    finally:
        os.close(held)
    _libc.set_read_only(store, recursive=False)


def enter_layer(ctx: ExecutionContext, *, resolve: bool = False, image_only: bool = False) -> str:
    """Mount the call's layer on its workspace, in a mount namespace of this worker's own (see
    above); the base's real path. ``resolve``: the base as the caller named it (making a
    layer: symlinks allowed, resolved here), else it must be the recorded real path. A layer
    over an image mounts the image's layers instead (workers.image_root; ``image_only``: them
    alone, read-only, what the layer's diff compares with), and answers ""."""
    assert ctx.layer_dir is not None
    if ctx.layer_image is not None:
        _enter_image(ctx, image_only=image_only)
        return ""
    assert ctx.layer_base is not None
    base = os.path.realpath(ctx.layer_base) if resolve else ctx.layer_base
    if not os.path.isdir(base):
        raise LayerBaseError(f"the layer's base {ctx.layer_base} is not a directory")
    store = os.path.dirname(ctx.layer_dir)
    if _within(base, store) or _within(store, base):
        raise LayerBaseError(
            f"a layer's base must not lie inside the layer store {store}, nor the store"
            f" inside it: {base}"
        )
    root = ctx.layer_mount or ctx.workspace
    upper = os.path.join(ctx.layer_dir, "upper")
    work = os.path.join(ctx.layer_dir, "work")
    for path in (root, upper, work):
        if any(c in path for c in ",:\\"):
            raise OverlayError(
                f"cannot mount a layer on a path holding ',', ':' or '\\': {path}",
                code=LAYER_UNAVAILABLE,
            )
    if _libc.try_unshare(_libc.CLONE_NEWNS) != 0:
        raise OverlayError(
            "a layer cannot be mounted: no mount namespace here (the pool needs root with"
            " CAP_SYS_ADMIN, or user namespaces allowed: see sandbx-pool doctor)",
            code=LAYER_UNAVAILABLE,
        )
    try:
        _libc.mount("none", "/", None, _libc.MS_REC | _libc.MS_SLAVE, None)
    except OSError as exc:
        raise OverlayError(f"cannot mount the layer: {exc}", code=LAYER_UNAVAILABLE) from exc
    # Opened in this namespace, after the unshare: overlayfs clones its lower mount, which it
    # refuses for a mount of another namespace.
    fd = _open_base(base)
    try:
        lower = f"/proc/self/fd/{fd}"
        try:
            options = f"lowerdir={lower},upperdir={upper},workdir={work},{OPTIONS}"
            _libc.mount("sandbx-layer", root, "overlay", 0, options)
            _libc.mount(lower, lower, None, _libc.MS_BIND | _libc.MS_REC, None)
            _libc.set_read_only(base, recursive=True)
            _cover_store(ctx.layer_dir, root)
        except OSError as exc:
            raise OverlayError(
                f"cannot mount the layer on {root}: {exc}", code=LAYER_UNAVAILABLE
            ) from exc
        # The read-only bind must be on the base itself: a path swapped in between would leave
        # the base writable and make something else read-only.
        held, seen = os.fstat(fd), os.stat(base)
        if (held.st_dev, held.st_ino) != (seen.st_dev, seen.st_ino) or not (
            os.statvfs(base).f_flag & os.ST_RDONLY
        ):
            raise LayerBaseError(f"the layer's base {base} changed while it was mounted")
    finally:
        os.close(fd)
    return base


__all__ = [
    "LAYER_BASE",
    "LAYER_UNAVAILABLE",
    "OPTIONS",
    "LayerBaseError",
    "OverlayError",
    "enter",
    "enter_layer",
]
