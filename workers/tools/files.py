"""The file tools: read, write, edit and ls, plus the helpers the other tools share.

Every path goes through ``workers.paths.resolve`` first, so a path that leads outside the
workspace (through ``..`` or a symlink) is ``Denied`` before anything is opened.

Writes are atomic: the new content goes to a temp file in the target's directory, which is
fsynced and renamed over the target, then the directory is fsynced. A kill at any moment leaves
the old content or the new one. It can leave the temp file (``.<name>.sbx-tmp-<random>``) behind;
``remove_leftover_temps`` is for the recovery code that sweeps those up.

write and edit hold an exclusive flock on the target's directory from before they read until
after the rename, so two parallel edits of one file (each in its own worker) are serialised
and neither update is lost. The lock is on the directory, not the file, because the rename
swaps the file's inode: a lock on the old inode would not stop the next writer.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import fnmatch
import io
import os
import secrets
import stat
from collections.abc import Iterator
from typing import IO, Any

from workers.errors import LimitExceeded, ToolError
from workers.paths import resolve
from workers.protocol import ExecutionContext
from workers.schemas import EditArgs, LsArgs, ReadArgs, WriteArgs

#: A file with a NUL byte in its first SNIFF_BYTES is binary (the heuristic git and grep use).
SNIFF_BYTES = 8 * 1024

#: Marks write's temp files: ``.<basename>.sbx-tmp-<random>``.
TEMP_MARKER = ".sbx-tmp-"

#: Read buffer: large enough that one peek() sees the whole SNIFF_BYTES of a regular file.
_BUFFER_BYTES = 64 * 1024

#: Longest basename kept in a temp name, so the temp name stays under NAME_MAX (255 bytes).
_MAX_TEMP_STEM = 200

_LEFTOVER_GLOB = f".*{TEMP_MARKER}*"


# -- shared helpers ----------------------------------------------------------------------------


def os_error(path: str, exc: OSError) -> ToolError:
    """The ToolError (or LimitExceeded) reporting ``exc``, naming the caller's ``path``."""
    code = exc.errno
    if code == errno.ENOENT:
        return ToolError(f"{path} not found")
    if code == errno.EISDIR:
        return ToolError(f"{path} is a directory")
    if code == errno.ENOTDIR:
        return ToolError(f"{path}: a component of the path is not a directory")
    if code in (errno.EACCES, errno.EPERM):
        return ToolError(f"{path}: permission denied")
    if code == errno.EFBIG:
        # CPython ignores SIGXFSZ, so RLIMIT_FSIZE surfaces here as EFBIG instead of a kill.
        return LimitExceeded("file_size_bytes", f"{path}: file size limit exceeded")
    if code in (errno.EMFILE, errno.ENFILE):
        return LimitExceeded("open_files", f"{path}: too many open files")
    return ToolError(f"{path}: {exc.strerror or exc}")


def printable(name: str) -> str:
    """A file name safe to encode as UTF-8 in a result: undecodable bytes become U+FFFD.

    os functions decode such bytes to lone surrogates, which msgpack refuses to encode; one
    odd file name must not make the whole result unsendable.
    """
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return name.encode("utf-8", "surrogateescape").decode("utf-8", errors="replace")
    return name


def is_binary(head: bytes) -> bool:
    return b"\x00" in head[:SNIFF_BYTES]


def open_regular(real: str, *, dir_fd: int | None = None) -> io.BufferedReader | None:
    """Open a regular file for reading, or return None if ``real`` is anything else.

    O_NONBLOCK makes opening a FIFO return at once instead of waiting for a writer, so a FIFO
    swapped in after the caller's lstat still cannot hang a walk; the fstat then rejects it.
    O_NOFOLLOW refuses a final symlink swapped in after ``resolve``. Raises OSError.
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_NOCTTY | os.O_CLOEXEC
    fd = os.open(real, flags, dir_fd=dir_fd)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    return _buffered(fd)


def _buffered(fd: int) -> io.BufferedReader:
    """Take ownership of ``fd``: closed on failure too (FileIO leaves an fd it was given open)."""
    try:
        raw = io.FileIO(fd, "r")  # raises IsADirectoryError for a directory
    except BaseException:
        os.close(fd)
        raise
    # Buffer explicitly sized: the default follows st_blksize, often 4 KiB, and then one
    # peek() would see less than SNIFF_BYTES.
    return io.BufferedReader(raw, buffer_size=_BUFFER_BYTES)


@contextlib.contextmanager
def _locked_directory(directory: str, display: str) -> Iterator[int]:
    """Yield an fd of ``directory`` holding its exclusive flock (see the module docstring)."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise os_error(display, exc) from exc
    try:
        # Blocks while another worker writes in this directory; a cancel kills us meanwhile,
        # and the kernel drops a killed holder's lock with its fd.
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield fd
    finally:
        os.close(fd)


def _replace_in(dir_fd: int, name: str, data: bytes, display: str) -> bool:
    """Atomically make ``name`` (in the locked directory ``dir_fd``) hold ``data``.

    Returns True when the file did not exist before. Every step is relative to ``dir_fd``, so a
    directory renamed or swapped for a symlink meanwhile cannot redirect the write.
    """
    try:
        old = os.lstat(name, dir_fd=dir_fd)
    except FileNotFoundError:
        old = None
    except OSError as exc:
        raise os_error(display, exc) from exc
    if old is not None and stat.S_ISDIR(old.st_mode):
        raise ToolError(f"{display} is a directory")
    if old is not None and not stat.S_ISREG(old.st_mode):
        raise ToolError(f"{display} is not a regular file")

    stem = os.fsdecode(os.fsencode(name)[:_MAX_TEMP_STEM])
    temp = f".{stem}{TEMP_MARKER}{secrets.token_hex(4)}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        # 0o666 minus the umask for a new file, as open() would do.
        fd = os.open(temp, flags, 0o666, dir_fd=dir_fd)
    except OSError as exc:
        raise os_error(display, exc) from exc
    try:
        try:
            if old is not None:
                # The umask must not narrow an existing file's mode; keep its owner if we may.
                os.fchmod(fd, stat.S_IMODE(old.st_mode))
                if (old.st_uid, old.st_gid) != (os.geteuid(), os.getegid()):
                    with contextlib.suppress(PermissionError):
                        os.fchown(fd, old.st_uid, old.st_gid)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            # Durable before it becomes visible: a crash after the rename never shows a
            # half-written file.
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        # The rename itself is durable only once the directory is.
        os.fsync(dir_fd)
    except OSError as exc:
        _discard(dir_fd, temp)
        raise os_error(display, exc) from exc
    except BaseException:
        _discard(dir_fd, temp)
        raise
    return old is None


def _discard(dir_fd: int, name: str) -> None:
    # After a successful rename the temp name is gone already; that is fine too.
    with contextlib.suppress(OSError):
        os.unlink(name, dir_fd=dir_fd)


def remove_leftover_temps(directory: str) -> list[str]:
    """Delete write's temp files (``.*.sbx-tmp-*``) left in ``directory`` by killed workers.

    Takes the directory's write lock, so a write still under way there is never robbed of its
    temp file. Returns the names removed; a missing directory has none.
    """
    if not os.path.isdir(directory):
        return []
    removed: list[str] = []
    with _locked_directory(directory, directory) as dir_fd, os.scandir(dir_fd) as it:
        for entry in it:
            if fnmatch.fnmatchcase(entry.name, _LEFTOVER_GLOB) and entry.is_file(
                follow_symlinks=False
            ):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.name, dir_fd=dir_fd)
                    removed.append(entry.name)
    return sorted(removed)


def _encode(content: str, display: str) -> bytes:
    try:
        return content.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ToolError(f"content for {display} is not valid Unicode text: {exc}") from exc


# -- read --------------------------------------------------------------------------------------


def _skip_line(f: IO[bytes]) -> bool:
    """Consume one line without holding it all in memory; False if at EOF already."""
    got = False
    while part := f.readline(_BUFFER_BYTES):
        got = True
        if part.endswith(b"\n"):
            break
    return got


def _count_lines(f: IO[bytes]) -> int:
    """Lines from the current position (at a line start) to EOF, a final unterminated one too."""
    count = 0
    last = b"\n"
    while chunk := f.read(1024 * 1024):
        count += chunk.count(b"\n")
        last = chunk[-1:]
    return count if last == b"\n" else count + 1


def _utf8_prefix(data: bytes, limit: int) -> bytes:
    """``data`` cut to at most ``limit`` bytes, not inside a UTF-8 sequence."""
    cut = limit
    # Back off over continuation bytes (0b10xxxxxx) so the cut falls before a lead byte.
    while 0 < cut < len(data) and cut > limit - 4 and data[cut] & 0xC0 == 0x80:
        cut -= 1
    return data[:cut]


def read_file(args: ReadArgs, ctx: ExecutionContext) -> dict[str, Any]:
    """Lines ``offset`` to ``offset + limit`` of a text file, at most max_output_bytes of them.

    A plain blocking open: a read on a FIFO waits for a writer, and the coordinator's cancel or
    deadline ends it. When even the first requested line exceeds the byte cap, its prefix up to
    the cap is returned (``lines`` 1, ``truncated`` True) rather than nothing.
    """
    real = resolve(ctx, args.path)
    try:
        f = _buffered(os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC))
    except OSError as exc:
        raise os_error(args.path, exc) from exc
    with f:
        try:
            # One raw read fills the buffer, so peek sees the first SNIFF_BYTES of a file.
            if is_binary(f.peek(SNIFF_BYTES)):
                size = os.fstat(f.fileno()).st_size
                raise ToolError(f"{args.path} is a binary file ({size} bytes)")
            total = 0
            while total < args.offset and _skip_line(f):
                total += 1
            kept: list[bytes] = []
            used = 0
            truncated = False
            end = None if args.limit is None else args.offset + args.limit
            while end is None or total < end:
                room = ctx.max_output_bytes - used
                line = f.readline(room + 1)
                if not line:
                    break
                total += 1
                fits = len(line) <= room
                if not fits:
                    truncated = True
                    if not kept:
                        kept.append(_utf8_prefix(line, room))
                    if not line.endswith(b"\n"):
                        _skip_line(f)
                    break
                kept.append(line)
                used += len(line)
            total += _count_lines(f)
        except OSError as exc:
            raise os_error(args.path, exc) from exc
    data = b"".join(kept)
    try:
        content = data.decode("utf-8")
        invalid = False
    except UnicodeDecodeError:
        content = data.decode("utf-8", errors="replace")
        invalid = True
    return {
        "content": content,
        "lines": len(kept),
        "total_lines": total,
        "truncated": truncated,
        "invalid_utf8": invalid,
    }


# -- write and edit ----------------------------------------------------------------------------


def write_file(args: WriteArgs, ctx: ExecutionContext) -> dict[str, Any]:
    """Create or atomically replace a file, creating missing parent directories."""
    if args.path.endswith("/"):
        raise ToolError(f"{args.path} names a directory, not a file")
    real = resolve(ctx, args.path)
    data = _encode(args.content, args.path)
    parent, name = os.path.split(real)
    try:
        # resolve() confined the real path, and components that do not exist yet cannot be
        # symlinks, so every directory made here is inside the workspace.
        os.makedirs(parent, exist_ok=True)
    except OSError as exc:
        raise ToolError(
            f"cannot create the parent directory of {args.path}: {exc.strerror or exc}"
        ) from exc
    with _locked_directory(parent, args.path) as dir_fd:
        created = _replace_in(dir_fd, name, data, args.path)
    return {"bytes": len(data), "created": created}


def edit_file(args: EditArgs, ctx: ExecutionContext) -> dict[str, Any]:
    """Replace ``old_string`` (unique unless ``replace_all``) and write the file back atomically."""
    if args.old_string == args.new_string:
        raise ToolError("old_string and new_string are identical; the edit would change nothing")
    real = resolve(ctx, args.path)
    parent, name = os.path.split(real)
    with _locked_directory(parent, args.path) as dir_fd:
        # Read under the lock, so no other write lands between this read and our rename.
        try:
            f = open_regular(name, dir_fd=dir_fd)
            if f is None:
                raise ToolError(f"{args.path} is not a regular file")
            with f:
                raw = f.read()
        except OSError as exc:
            raise os_error(args.path, exc) from exc
        if is_binary(raw):
            raise ToolError(f"{args.path} is a binary file ({len(raw)} bytes)")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ToolError(f"{args.path} is not valid UTF-8 text: {exc}") from exc
        count = text.count(args.old_string)
        if count == 0:
            raise ToolError(f"old_string not found in {args.path}")
        if count > 1 and not args.replace_all:
            raise ToolError(
                f"old_string is not unique in {args.path} ({count} occurrences); include more "
                "surrounding context to make it unique, or set replace_all"
            )
        if args.replace_all:
            new_text = text.replace(args.old_string, args.new_string)
        else:
            new_text = text.replace(args.old_string, args.new_string, 1)
        _replace_in(dir_fd, name, _encode(new_text, args.path), args.path)
    return {"replacements": count if args.replace_all else 1}


# -- ls ----------------------------------------------------------------------------------------


def _entry_type(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISLNK(mode):
        return "symlink"
    return "other"


def list_directory(args: LsArgs, ctx: ExecutionContext) -> dict[str, Any]:
    """A directory's entries sorted by name, described by lstat (symlinks are not followed).

    Stops before the entries' estimated encoded size passes max_output_bytes (``truncated``).
    """
    real = resolve(ctx, args.path)
    try:
        with os.scandir(real) as it:
            found = sorted(it, key=lambda entry: entry.name)
    except NotADirectoryError:
        raise ToolError(f"{args.path} is not a directory") from None
    except OSError as exc:
        raise os_error(args.path, exc) from exc
    entries: list[dict[str, Any]] = []
    used = 0
    truncated = False
    for entry in found:
        try:
            info = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue  # removed since the listing
        except OSError:
            info = None
        name = printable(entry.name)
        # Name plus the encoded framing of one entry, roughly.
        used += len(name.encode()) + 48
        if used > ctx.max_output_bytes:
            truncated = True
            break
        entries.append(
            {
                "name": name,
                "type": "other" if info is None else _entry_type(info.st_mode),
                "size": 0 if info is None else info.st_size,
            }
        )
    return {"entries": entries, "truncated": truncated}
