"""Where a pool keeps its socket and its write locks (removed on close) and its journals (kept)."""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
import time


def runtime_root() -> str:
    """A per-user directory, mode 0700: $XDG_RUNTIME_DIR/sandbx-pool or /tmp/sandbx-pool-UID."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    root = os.path.join(base, "sandbx-pool") if base else f"/tmp/sandbx-pool-{os.getuid()}"
    os.makedirs(root, mode=0o700, exist_ok=True)
    st = os.lstat(root)
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(f"{root} must be a directory owned by uid {os.getuid()}, mode 0700")
    return root


def make_private_dir() -> str:
    """A fresh 0700 directory for one pool's ZeroMQ socket (ipc paths must stay short).

    Its name carries our pid, so that directories left by a coordinator that was SIGKILLed
    (close never ran) are recognised and removed by the next one.
    """
    root = runtime_root()
    _remove_abandoned(root)
    return tempfile.mkdtemp(prefix=f"pool-{os.getpid()}-", dir=root)


def _remove_abandoned(root: str) -> None:
    for name in os.listdir(root):
        parts = name.split("-")
        ours = len(parts) == 3 and parts[0] == "pool" and parts[1].isdigit()
        if ours and not os.path.exists(f"/proc/{parts[1]}"):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def make_lock_dir() -> str:
    """A fresh directory for one pool's write locks (workers.tools.atomic says why).

    Sticky and writable by all, not listable (1733): a call may run as another user, whose
    worker must make and open lock files there, and must not remove another's. No call reaches
    it: the pool hides it from bash, and only the file tools' rules grant it.
    """
    path = tempfile.mkdtemp(prefix="sandbx-locks-")
    os.chmod(path, 0o1733)
    return path


def default_journal_path() -> str:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    directory = os.path.join(runtime_root(), "journals")
    os.makedirs(directory, mode=0o700, exist_ok=True)
    return os.path.join(directory, f"{stamp}-{os.getpid()}-{secrets.token_hex(3)}.jsonl")
