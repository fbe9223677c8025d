"""The system calls Python's ``os`` lacks, through ctypes: one libc handle, one way to fail.

prctl, unshare, setns, mount and raw syscall(2), with the constants their callers name. Each
wrapper raises ``OSError`` with the errno and the call's name, except the ``try_`` forms, which
return the errno (0 on success) for callers that treat a refusal as an answer ("not permitted
here"), not an error. A leaf module: it imports nothing of sandbx-pool.

``bare_fork`` keeps a handle of its own: it needs ``ctypes.PyDLL`` (the GIL held across fork),
which no other call here wants.
"""

from __future__ import annotations

import ctypes
import os

_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long

# prctl(2) options.
PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_CAPBSET_READ = 23
PR_CAPBSET_DROP = 24
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
PR_GET_NO_NEW_PRIVS = 39

# Namespace flags of unshare(2) and setns(2).
CLONE_NEWNS = 0x00020000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

# mount(2) flags.
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REC = 1 << 14
MS_SLAVE = 1 << 19


def _failed(what: str) -> OSError:
    code = ctypes.get_errno()
    return OSError(code, f"{what}: {os.strerror(code)}")


def try_prctl(option: int, arg: int = 0) -> int:
    """prctl(option, arg, 0, 0, 0): 0, or the errno it failed with."""
    # prctl is variadic and the kernel reads unsigned longs (and wants the unused ones zero).
    zero = ctypes.c_ulong(0)
    if _libc.prctl(option, ctypes.c_ulong(arg), zero, zero, zero) == 0:
        return 0
    return ctypes.get_errno()


def prctl(option: int, arg: int = 0, *, what: str = "prctl") -> None:
    if try_prctl(option, arg) != 0:
        raise _failed(what)


def try_unshare(flags: int) -> int:
    """unshare(flags): 0, or the errno it failed with."""
    return 0 if _libc.unshare(flags) == 0 else ctypes.get_errno()


def unshare(flags: int, *, what: str = "unshare") -> None:
    if _libc.unshare(flags) != 0:
        raise _failed(what)


def setns(fd: int, nstype: int, *, what: str = "setns") -> None:
    if _libc.setns(fd, nstype) != 0:
        raise _failed(what)


def mount(source: str, target: str, fstype: str | None, flags: int, data: str | None) -> None:
    result = _libc.mount(
        source.encode(),
        target.encode(),
        fstype.encode() if fstype else None,
        ctypes.c_ulong(flags),
        data.encode() if data else None,
    )
    if result != 0:
        raise _failed(f"mount {target}")


def syscall(what: str, number: int, *args: object) -> int:
    """syscall(number, *args); its non-negative result, or OSError."""
    # syscall(2) reads every argument as a long: pass ints as such, not as 32-bit C ints.
    wide = [ctypes.c_long(a) if isinstance(a, int) else a for a in args]
    ctypes.set_errno(0)
    result = int(_syscall(ctypes.c_long(number), *wide))
    if result < 0:
        raise _failed(what)
    return result
