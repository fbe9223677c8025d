"""The file tools: read, write, edit and ls, plus the helpers the other tools share.

Every path goes through ``workers.paths.resolve`` first, so a path that leads outside the
workspace (through ``..`` or a symlink) is ``Denied`` before anything is opened. write and edit
then refuse a protected path (``workers.paths.check_protected``: ``.git/hooks/**``...), and
reach the directory they change, as ls does the one it lists, one name at a time from the
workspace (``workers.paths.open_directory``).

write and edit replace a file atomically, under a lock on its directory, and clean up the temp
files killed writers leave: see ``sandbx_pool.workers.tools.atomic`` (whose ``TEMP_MARKER`` and
``remove_leftover_temps`` are re-exported here).
"""

from __future__ import annotations

import errno
import io
import os
import stat
from typing import IO, Any

from sandbx_pool.workers import users
from sandbx_pool.workers.errors import LimitExceeded, ToolError
from sandbx_pool.workers.paths import check_opened, check_protected, open_directory, resolve
from sandbx_pool.workers.protocol import ExecutionContext
from sandbx_pool.workers.schemas import EditArgs, LsArgs, ReadArgs, WriteArgs
from sandbx_pool.workers.tools.atomic import TEMP_MARKER as TEMP_MARKER
from sandbx_pool.workers.tools.atomic import locked_directory, replace_in, sweep_leftovers
from sandbx_pool.workers.tools.atomic import remove_leftover_temps as remove_leftover_temps

#: A file with a NUL byte in its first SNIFF_BYTES is binary (the heuristic git and grep use).
SNIFF_BYTES = 8 * 1024

#: Read buffer: large enough that one peek() sees the whole SNIFF_BYTES of a regular file.
_BUFFER_BYTES = 64 * 1024


# -- shared helpers ----------------------------------------------------------------------------


def os_error(path: str, exc: OSError) -> ToolError:
    """The ToolError (or LimitExceeded) reporting ``exc``, naming the caller's ``path``."""
    code = exc.errno
    name = errno.errorcode.get(code) if code is not None else None
    if code == errno.EFBIG:
        # CPython ignores SIGXFSZ, so RLIMIT_FSIZE surfaces here as EFBIG instead of a kill.
        return LimitExceeded("file_size", f"{path}: file size limit exceeded")
    if code in (errno.EMFILE, errno.ENFILE):
        return LimitExceeded("open_files", f"{path}: too many open files")
    if code == errno.ENOENT:
        message = f"{path} not found"
    elif code == errno.EISDIR:
        message = f"{path} is a directory"
    elif code == errno.ENOTDIR:
        message = f"{path}: a component of the path is not a directory"
    elif code in (errno.EACCES, errno.EPERM):
        message = f"{path}: permission denied"
    else:
        message = f"{path}: {exc.strerror or exc}"
    return ToolError(message, code=name)


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


def _skip_lines(f: io.BufferedReader, count: int) -> int:
    """Consume up to ``count`` lines and return how many there were.

    Counts newlines a whole buffer at a time: on a 200 000-line file, skipping to line 150 000
    this way takes a few milliseconds, against 100 line by line.
    """
    skipped = 0
    mid_line = False
    while skipped < count:
        chunk = f.peek(_BUFFER_BYTES)
        if not chunk:
            return skipped + int(mid_line)  # a last line without its newline counts too
        need = count - skipped
        newlines = chunk.count(b"\n")
        if newlines < need:
            f.read(len(chunk))
            skipped += newlines
            mid_line = not chunk.endswith(b"\n")
            continue
        end = -1
        for _ in range(need):
            end = chunk.index(b"\n", end + 1)
        f.read(end + 1)
        return count
    return skipped


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
    if args.encoding == "bytes" and (args.offset or args.limit is not None):
        raise ToolError("offset and limit count lines: they do not apply to encoding 'bytes'")
    if args.user is not None:
        users.become(users.lookup(args.user))  # before the path is even resolved: as them
    real = resolve(ctx, args.path)
    try:
        f = _buffered(os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC))
    except OSError as exc:
        raise os_error(args.path, exc) from exc
    with f:
        check_opened(ctx, f.fileno(), args.path)
        if args.encoding == "bytes":
            return _read_bytes(f, args.path, ctx.max_output_bytes)
        try:
            # One raw read fills the buffer, so peek sees the first SNIFF_BYTES of a file.
            if is_binary(f.peek(SNIFF_BYTES)):
                size = os.fstat(f.fileno()).st_size
                raise ToolError(f"{args.path} is a binary file ({size} bytes)")
            total = _skip_lines(f, args.offset)
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


def _read_bytes(f: io.BufferedReader, path: str, cap: int) -> dict[str, Any]:
    """The file's raw bytes, at most ``cap`` of them; ``size`` is the whole file's."""
    try:
        size = os.fstat(f.fileno()).st_size
        data = f.read(cap + 1)
    except OSError as exc:
        raise os_error(path, exc) from exc
    return {"data": data[:cap], "size": max(size, len(data)), "truncated": len(data) > cap}


# -- write and edit ----------------------------------------------------------------------------


def write_file(args: WriteArgs, ctx: ExecutionContext) -> dict[str, Any]:
    """Create or atomically replace a file, creating missing parent directories."""
    if args.path.endswith("/"):
        raise ToolError(f"{args.path} names a directory, not a file")
    if args.user is not None:
        users.become(users.lookup(args.user))  # before the path is even resolved: as them
    real = resolve(ctx, args.path)
    check_protected(ctx, real, args.path)  # before makedirs: not even a directory is made
    data = (
        args.content_bytes if args.content_bytes is not None else _encode(args.content, args.path)
    )
    parent, name = os.path.split(real)
    try:
        # resolve() confined the real path, and components that do not exist yet cannot be
        # symlinks, so every directory made here is inside the workspace.
        os.makedirs(parent, exist_ok=True)
    except OSError as exc:
        raise ToolError(
            f"cannot create the parent directory of {args.path}: {exc.strerror or exc}",
            code=errno.errorcode.get(exc.errno or 0),
        ) from exc
    try:
        with locked_directory(parent, args.path, ctx) as dir_fd:
            sweep_leftovers(dir_fd)
            created = replace_in(dir_fd, name, data, args.path)
    except OSError as exc:
        raise os_error(args.path, exc) from exc
    return {"bytes": len(data), "created": created}


def edit_file(args: EditArgs, ctx: ExecutionContext) -> dict[str, Any]:
    """Replace ``old_string`` (unique unless ``replace_all``) and write the file back atomically."""
    if args.old_string == args.new_string:
        raise ToolError("old_string and new_string are identical; the edit would change nothing")
    real = resolve(ctx, args.path)
    check_protected(ctx, real, args.path)
    parent, name = os.path.split(real)
    try:
        with locked_directory(parent, args.path, ctx) as dir_fd:
            sweep_leftovers(dir_fd)
            # Read under the lock, so no other write lands between this read and our rename.
            f = open_regular(name, dir_fd=dir_fd)
            if f is None:
                raise ToolError(f"{args.path} is not a regular file")
            with f:
                raw = f.read()
            new_text, count = _edited(raw, args)
            replace_in(dir_fd, name, _encode(new_text, args.path), args.path)
    except OSError as exc:
        raise os_error(args.path, exc) from exc
    return {"replacements": count}


def _edited(raw: bytes, args: EditArgs) -> tuple[str, int]:
    """The file's new text and the number of replacements, or the ToolError saying why not."""
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
        return text.replace(args.old_string, args.new_string), count
    return text.replace(args.old_string, args.new_string, 1), 1


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
        fd = open_directory(ctx, real, args.path)  # a FIFO there fails at once: O_NONBLOCK
    except NotADirectoryError:
        raise ToolError(f"{args.path} is not a directory", code="ENOTDIR") from None
    except OSError as exc:
        raise os_error(args.path, exc) from exc
    try:
        # Listed and lstat'ed relative to the fd, which must stay open meanwhile.
        with os.scandir(fd) as it:
            found = sorted(it, key=lambda entry: entry.name)
        return _describe(found, ctx.max_output_bytes)
    except OSError as exc:
        raise os_error(args.path, exc) from exc
    finally:
        os.close(fd)


def _describe(found: list[os.DirEntry[str]], max_bytes: int) -> dict[str, Any]:
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
        if used > max_bytes:
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
