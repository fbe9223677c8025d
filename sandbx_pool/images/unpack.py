"""One layer blob unpacked into a directory an overlay can take as a lower, checked on the way.

    blob (gzip | zstd | plain) --sha256 == its digest?--> decompress --sha256 == diff_id?
        --> tar entries, each created by descriptor under the layer's directory

What a tar entry becomes:

* ``.wh.NAME``: a whiteout, the overlay's own kind: a 0/0 character device ``NAME`` (Linux
  lets any user make one since 5.8, so the store needs no user namespace to unpack);
  ``.wh..wh..opq``: its directory is opaque, ``user.overlay.opaque=y`` (the attribute an overlay
  mounted with ``userxattr`` reads, as root and in a user namespace alike).
* Regular files, directories, symlinks, hard links (to an entry of the same layer) and FIFOs as
  they are, modes without setuid and setgid (a call runs as uid 0 of its namespace; a set-id
  binary of the image could only ever matter outside it). Owners are kept when the store's user
  may chown (root); otherwise every file is the store user's, as a rootless runtime with one
  mapped uid has it. Extended attributes (file capabilities among them) are not kept.
* Device nodes other than whiteouts are skipped and counted: a call's ``/dev`` is its view's,
  never the image's, and a device node in a store is a hole in it.
* An entry that would land outside the layer (an absolute name, a ``..``, or a path through a
  symlink or a non-directory the layer made) is an ``ImageError`` naming the entry.

Every name is opened relative to its parent's descriptor with ``O_NOFOLLOW``: nothing a layer
contains is ever followed. Directories are made writable by their owner while the layer is
unpacked (a 0555 directory must still receive its entries as a non-root store); their modes
and times are set last. The caller unpacks into a temporary directory and renames it into place
only when this returns: a mismatch or a bad entry leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import errno
import gzip
import hashlib
import os
import stat
import subprocess
import tarfile
import zlib
from collections.abc import Iterator
from typing import IO

import msgspec

from sandbx_pool.errors import ImageError

CHUNK = 1 << 20
WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"
OPAQUE_XATTR = "user.overlay.opaque"
_SETID = stat.S_ISUID | stat.S_ISGID
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class Unpacked(msgspec.Struct, frozen=True, kw_only=True):
    """What one layer came to: ``size``, the bytes of its regular files; ``disk``, what its
    files take on disk; ``skipped_devices``, device nodes left out."""

    size: int
    disk: int
    skipped_devices: int = 0


def file_digest(path: str) -> str:
    """``sha256:HEX`` of a file's content."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return f"sha256:{digest.hexdigest()}"


def check_blob(path: str, digest: str, what: str) -> None:
    """An ImageError naming the blob unless ``path`` holds exactly ``digest``."""
    found = file_digest(path)
    if found != digest:
        raise ImageError(f"{what} {digest}: content does not match its digest (found {found})")


class _Hashing:
    """A read-only stream that hashes what passes through it (the uncompressed tar)."""

    def __init__(self, raw: IO[bytes]) -> None:
        self.raw = raw
        self.digest = hashlib.sha256()

    def read(self, size: int = -1) -> bytes:
        data = self.raw.read(size)
        self.digest.update(data)
        return data

    def drain(self) -> None:
        # The diff_id covers the whole stream: tar's zero blocks and any padding after them.
        while self.read(CHUNK):
            pass


@contextlib.contextmanager
def _decompressed(path: str) -> Iterator[IO[bytes]]:
    """The blob's tar stream: gzip (Python's zlib), zstd (Debian's ``zstd``: Python before
    3.14 has no zstd in its standard library, and a dependency for one codec is more to keep
    than a pipe), or plain, told by the first bytes."""
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic[:2] == b"\x1f\x8b":
        with open(path, "rb") as raw, gzip.GzipFile(fileobj=raw, mode="rb") as stream:
            yield stream  # type: ignore[misc]  # GzipFile is a binary stream; typeshed says no IO
        return
    if magic == b"\x28\xb5\x2f\xfd":
        try:
            process = subprocess.Popen(
                ["zstd", "-dcq", "--", path], stdout=subprocess.PIPE, stderr=subprocess.PIPE
            )
        except FileNotFoundError:
            raise ImageError("a zstd layer needs the zstd command (Debian: zstd)") from None
        assert process.stdout is not None
        try:
            yield process.stdout
        finally:
            process.stdout.close()
            process.kill()
            _, err = process.communicate()
        if process.returncode not in (0, -9):
            raise ImageError(f"zstd could not decompress {path}: {err.decode(errors='replace')}")
        return
    with open(path, "rb") as stream:
        yield stream


def unpack_layer(blob: str, blob_digest: str, diff_id: str, target: str) -> Unpacked:
    """Unpack the layer blob at ``blob`` into the empty directory ``target``, checking the
    blob against ``blob_digest`` first and its tar against ``diff_id`` after. ImageError
    naming the blob or the entry otherwise (``target`` is then the caller's to remove)."""
    check_blob(blob, blob_digest, "layer blob")
    with _decompressed(blob) as raw:
        hashing = _Hashing(raw)
        try:
            unpacked = _Layer(target).extract(hashing, blob_digest)
            hashing.drain()
        except (tarfile.TarError, EOFError, gzip.BadGzipFile, zlib.error) as exc:
            raise ImageError(f"layer blob {blob_digest}: not a readable tar: {exc}") from exc
        except ImageError:
            raise
        except OSError as exc:  # the store's disk (full, read-only), not the blob
            raise ImageError(f"layer blob {blob_digest}: unpacking failed: {exc}") from exc
    found = f"sha256:{hashing.digest.hexdigest()}"
    if found != diff_id:
        raise ImageError(
            f"layer blob {blob_digest}: its uncompressed tar is {found}, the config says {diff_id}"
        )
    return unpacked


class _Layer:
    """The directory being filled, reached only through descriptors."""

    def __init__(self, target: str) -> None:
        self.root = os.open(target, _DIR)
        self.chown = os.geteuid() == 0
        self.directories: dict[tuple[str, ...], tarfile.TarInfo] = {}
        self.size = 0
        self.disk = 0
        self.skipped = 0

    def extract(self, stream: _Hashing, blob_digest: str) -> Unpacked:
        try:
            with tarfile.open(fileobj=stream, mode="r|") as tar:  # type: ignore[call-overload]
                for member in tar:
                    self._entry(tar, member, blob_digest)
            self._finish_directories()
        finally:
            os.close(self.root)
        return Unpacked(size=self.size, disk=self.disk, skipped_devices=self.skipped)

    # -- names ---------------------------------------------------------------------------------

    @staticmethod
    def _parts(name: str, blob_digest: str, what: str = "entry") -> tuple[str, ...]:
        if name.startswith("/"):
            raise ImageError(f"layer blob {blob_digest}: {what} {name!r} is an absolute path")
        parts = tuple(p for p in name.split("/") if p not in ("", "."))
        if ".." in parts:
            raise ImageError(f"layer blob {blob_digest}: {what} {name!r} climbs out with '..'")
        return parts

    def _parent(self, parts: tuple[str, ...], name: str, blob_digest: str) -> int:
        """A descriptor of the directory that holds ``parts[-1]``, made as needed; never
        through a symlink or anything but a directory."""
        fd = os.dup(self.root)
        try:
            for depth, part in enumerate(parts[:-1]):
                try:
                    child = os.open(part, _DIR, dir_fd=fd)
                except FileNotFoundError:
                    os.mkdir(part, 0o755, dir_fd=fd)
                    self.directories.setdefault(parts[: depth + 1], _implied(0o755))
                    child = os.open(part, _DIR, dir_fd=fd)
                except OSError as exc:
                    if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                        raise
                    kind = "a symlink" if _is_link(fd, part) else "not a directory"
                    raise ImageError(
                        f"layer blob {blob_digest}: entry {name!r} goes through"
                        f" {'/'.join(parts[: depth + 1])!r}, {kind} of the layer"
                    ) from None
                os.close(fd)
                fd = child
            return fd
        except BaseException:
            os.close(fd)
            raise

    # -- entries -------------------------------------------------------------------------------

    def _entry(self, tar: tarfile.TarFile, member: tarfile.TarInfo, blob_digest: str) -> None:
        parts = self._parts(member.name, blob_digest)
        if not parts:  # the layer's root itself: its metadata is the upper's to give
            return
        parent = self._parent(parts, member.name, blob_digest)
        try:
            self._make(tar, member, parent, parts, blob_digest)
        finally:
            os.close(parent)

    def _make(
        self,
        tar: tarfile.TarFile,
        member: tarfile.TarInfo,
        parent: int,
        parts: tuple[str, ...],
        blob_digest: str,
    ) -> None:
        name = parts[-1]
        if name == OPAQUE:
            os.setxattr(parent, OPAQUE_XATTR, b"y")
            return
        if name.startswith(WHITEOUT):
            hidden = name[len(WHITEOUT) :]
            _clear(parent, hidden)
            os.mknod(hidden, stat.S_IFCHR | 0o600, os.makedev(0, 0), dir_fd=parent)
            return
        if member.isdir():
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, 0o700, dir_fd=parent)
            if _is_link(parent, name) or not stat.S_ISDIR(
                os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode
            ):
                _clear(parent, name)
                os.mkdir(name, 0o700, dir_fd=parent)
            os.chmod(name, 0o700, dir_fd=parent)  # writable by us until _finish_directories
            self.directories[parts] = member
            return
        _clear(parent, name)
        if member.isreg():
            fd = os.open(
                name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o600, dir_fd=parent,
            )  # fmt: skip
            try:
                source = tar.extractfile(member)
                assert source is not None
                while chunk := source.read(CHUNK):
                    view = memoryview(chunk)
                    while view:
                        view = view[os.write(fd, view) :]
                self.size += member.size
                self.disk += os.fstat(fd).st_blocks * 512
            finally:
                os.close(fd)
        elif member.issym():
            os.symlink(member.linkname, name, dir_fd=parent)
        elif member.islnk():
            target = self._parts(member.linkname, blob_digest, "hard link target")
            if not target:
                raise ImageError(f"layer blob {blob_digest}: hard link {member.name!r} to '/'")
            source_dir = self._parent(target, member.linkname, blob_digest)
            try:
                os.link(target[-1], name, src_dir_fd=source_dir, dst_dir_fd=parent,
                        follow_symlinks=False)  # fmt: skip
            except FileNotFoundError:
                raise ImageError(
                    f"layer blob {blob_digest}: hard link {member.name!r} to"
                    f" {member.linkname!r}, which the layer does not hold"
                ) from None
            finally:
                os.close(source_dir)
            return  # a link shares its target's inode: mode, owner and times are the target's
        elif member.isfifo():
            os.mkfifo(name, 0o600, dir_fd=parent)
        elif member.ischr() or member.isblk():
            self.skipped += 1
            return
        else:
            return  # tar's own kinds (long names, sparse maps) never reach here
        self._attributes(parent, name, member)

    def _attributes(self, parent: int, name: str, member: tarfile.TarInfo) -> None:
        if self.chown:
            os.chown(name, member.uid, member.gid, dir_fd=parent, follow_symlinks=False)
        if not member.issym():
            os.chmod(name, member.mode & 0o7777 & ~_SETID, dir_fd=parent)
        mtime = int(member.mtime * 1_000_000_000)
        os.utime(name, ns=(mtime, mtime), dir_fd=parent, follow_symlinks=False)

    def _finish_directories(self) -> None:
        # Deepest first: a parent's time is set after its children stop changing it.
        for parts in sorted(self.directories, key=len, reverse=True):
            member = self.directories[parts]
            parent = self._parent(parts, "/".join(parts), "")
            try:
                self._attributes(parent, parts[-1], member)
            finally:
                os.close(parent)


def _implied(mode: int) -> tarfile.TarInfo:
    """A directory the tar did not list but its entries need (root-owned, like umoci's)."""
    info = tarfile.TarInfo()
    info.type = tarfile.DIRTYPE
    info.mode = mode
    return info


def _is_link(parent: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode)
    except FileNotFoundError:
        return False


def _clear(parent: int, name: str) -> None:
    """Remove what ``name`` is in this layer, so a later entry of the same name replaces it."""
    try:
        mode = os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):
        _remove_tree(parent, name)
    else:
        os.unlink(name, dir_fd=parent)


def _remove_tree(parent: int, name: str) -> None:
    fd = os.open(name, _DIR, dir_fd=parent)
    try:
        os.fchmod(fd, 0o700)
        for entry in os.listdir(fd):
            if stat.S_ISDIR(os.stat(entry, dir_fd=fd, follow_symlinks=False).st_mode):
                _remove_tree(fd, entry)
            else:
                os.unlink(entry, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=parent)
