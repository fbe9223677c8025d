"""Where a pool keeps its socket (private, removed on close), the parent of its calls' TMPDIRs
and its write locks (removed on close) and its default journals (kept).

A coordinator that is SIGKILLed never runs close(): its socket directory, its TMPDIR parent
(tens of MB of what its calls left) and its lock directory would stay forever. So all three are
named after their owner,
``<prefix><pid>-<start>-<random>``, where ``start`` is the owner's start time (clock ticks since
boot, field 22 of /proc/PID/stat), and the next pool started by the same user removes those
whose owner is provably dead: no process with that pid, or one that started at another time (the
pid was reused). A name that does not parse, or a live owner, is left alone.

The socket directory is the exception: its path is listed, with every other bound unix socket,
in /proc/net/unix, which any call sharing the host's network (``network = true``) can read, and
a pid and start time there tell a call which process to aim at. So it is named at random,
``<SOCKET_DIR_PREFIX><random>``, and its owner is written in a file inside it (``OWNER_FILE``),
out of every call's reach like the rest of the runtime root.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import tempfile
import time

#: The prefixes of what a pool makes; the names continue with its owner (see above).
SOCKET_DIR_PREFIX = "pool-"
#: The file in a socket directory that names its owner (``<pid>-<start time>``).
OWNER_FILE = "owner"
TMP_ROOT_PREFIX = "sandbx-tmp-"
LOCK_DIR_PREFIX = "sandbx-locks-"


def runtime_root() -> str:
    """A per-user directory, mode 0700: $XDG_RUNTIME_DIR/sandbx-pool or /tmp/sandbx-pool-UID."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    root = os.path.join(base, "sandbx-pool") if base else f"/tmp/sandbx-pool-{os.getuid()}"
    os.makedirs(root, mode=0o700, exist_ok=True)
    st = os.lstat(root)
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(f"{root} must be a directory owned by uid {os.getuid()}, mode 0700")
    return root


def _stat_field(pid: int, index: int) -> int | None:
    """Field ``index`` (0-based, counted after the command name) of /proc/PID/stat."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # The command name (field 2) may hold spaces and parentheses: split after its end.
            return int(f.read().rsplit(")", 1)[1].split()[index])
    except (OSError, IndexError, ValueError):
        return None


def start_time(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot), None if there is no such process."""
    return _stat_field(pid, 19)


def parent_pid(pid: int) -> int | None:
    """The parent of process ``pid``, None if there is no such process."""
    return _stat_field(pid, 1)


def owner_tag() -> str:
    """``<pid>-<start time>`` of this process, what names its directories."""
    return f"{os.getpid()}-{start_time(os.getpid())}"


def owner_is_dead(name: str, prefix: str) -> bool:
    """Whether ``name`` (``<prefix><pid>-<start>-<random>``) was made by a process that is gone."""
    parts = name[len(prefix) :].split("-") if name.startswith(prefix) else []
    if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit():
        return False  # not ours, or made before names carried their owner: cannot prove it
    return start_time(int(parts[0])) != int(parts[1])


def remove_abandoned(directory: str, prefix: str) -> list[str]:
    """Remove the directories under ``directory`` named ``prefix...`` whose owner is dead and
    that belong to our uid; return their paths."""
    removed = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(directory):
            if not owner_is_dead(entry.name, prefix):
                continue
            with contextlib.suppress(OSError):
                if entry.is_dir(follow_symlinks=False) and entry.stat().st_uid == os.getuid():
                    shutil.rmtree(entry.path, ignore_errors=True)
                    removed.append(entry.path)
    return removed


def owner_of(directory: str) -> str | None:
    """The owner (``<pid>-<start time>``) written in a socket directory, None if none is."""
    try:
        with open(os.path.join(directory, OWNER_FILE)) as f:
            return f.read(64).strip()
    except OSError:
        return None


def _socket_dir_is_abandoned(path: str) -> bool:
    """Whether the socket directory at ``path`` names an owner that is gone. One without an
    owner file is being made (or is not ours): left alone."""
    owner = owner_of(path)
    return owner is not None and owner_is_dead(f"{SOCKET_DIR_PREFIX}{owner}-x", SOCKET_DIR_PREFIX)


def remove_abandoned_socket_dirs(root: str) -> list[str]:
    """Remove the socket directories under ``root`` whose owner is dead; return their paths.
    Those named after their owner (made by earlier versions) are judged by their name."""
    removed = remove_abandoned(root, SOCKET_DIR_PREFIX)
    with contextlib.suppress(OSError):
        for entry in os.scandir(root):
            if not entry.name.startswith(SOCKET_DIR_PREFIX):
                continue
            with contextlib.suppress(OSError):
                if (
                    entry.is_dir(follow_symlinks=False)
                    and entry.stat().st_uid == os.getuid()
                    and _socket_dir_is_abandoned(entry.path)
                ):
                    shutil.rmtree(entry.path, ignore_errors=True)
                    removed.append(entry.path)
    return removed


def make_private_dir() -> str:
    """A fresh 0700 directory for one pool's ZeroMQ socket (ipc paths must stay short), named
    at random: no socket path a call can list names this process (see above)."""
    root = runtime_root()
    remove_abandoned_socket_dirs(root)
    path = tempfile.mkdtemp(prefix=SOCKET_DIR_PREFIX, dir=root)
    with open(os.path.join(path, OWNER_FILE), "x") as f:
        f.write(owner_tag())
    return path


def make_tmp_root() -> str:
    """A fresh directory (mode 0700) for the private TMPDIRs of one pool's calls, in the system's
    temporary directory; those of dead coordinators go first."""
    remove_abandoned(tempfile.gettempdir(), TMP_ROOT_PREFIX)
    return tempfile.mkdtemp(prefix=f"{TMP_ROOT_PREFIX}{owner_tag()}-")


def make_lock_dir() -> str:
    """A fresh directory for one pool's write locks (workers.tools.atomic says why).

    Sticky and writable by all, not listable (1733): a call may run as another user, whose
    worker must make and open lock files there, and must not remove another's. No call reaches
    it: the pool hides it from bash, and only the file tools' rules grant it.
    """
    remove_abandoned(tempfile.gettempdir(), LOCK_DIR_PREFIX)
    path = tempfile.mkdtemp(prefix=f"{LOCK_DIR_PREFIX}{owner_tag()}-")
    os.chmod(path, 0o1733)
    return path


def default_journals_dir() -> str:
    """Where journals go when no path is given (journal.prune keeps it small)."""
    return os.path.join(runtime_root(), "journals")


def default_journal_path() -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    directory = default_journals_dir()
    os.makedirs(directory, mode=0o700, exist_ok=True)
    return os.path.join(directory, f"{stamp}-{os.getpid()}-{secrets.token_hex(3)}.jsonl")
