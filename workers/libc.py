"""The system calls Python's ``os`` lacks, through ctypes: one libc handle, one way to fail.

prctl, unshare, setns, mount, fallocate, fstatfs, renameat2 and raw syscall(2), with the
constants their callers name. Each wrapper raises ``OSError`` with the errno and the call's
name, except the ``try_`` forms, which return the errno (0 on success) for callers that treat a
refusal as an answer ("not permitted here"), and ``filesystem_type``, which answers 0, not an
error. A leaf module: it imports nothing of sandbx-pool.

``bare_fork`` keeps a handle of its own: it needs ``ctypes.PyDLL`` (the GIL held across fork),
which no other call here wants.
"""

from __future__ import annotations

import ctypes
import errno
import os

_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long
# Looked up here, in the template, not in each worker: the first lookup is a dlsym and a new
# function object, 20 µs of every call that drops its capabilities (measured).
_capget = _libc.capget
_capset = _libc.capset

# prctl(2) options.
PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_CAPBSET_READ = 23
PR_CAPBSET_DROP = 24
PR_GET_SECUREBITS = 27
PR_SET_SECUREBITS = 28
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
PR_GET_NO_NEW_PRIVS = 39
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4

# Namespace flags of unshare(2) and setns(2).
CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

# mount(2) flags.
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_BIND = 4096
MS_REC = 1 << 14
MS_SLAVE = 1 << 19
MNT_DETACH = 2

# mount_setattr(2): a generic syscall number, the same on every architecture.
_SYS_MOUNT_SETATTR = 442
_MOUNT_ATTR_RDONLY = 1
_MOUNT_ATTR_NOSYMFOLLOW = 0x00200000
#: statvfs f_flag: the mount follows no symlink (Linux 5.10; os has no constant for it).
ST_NOSYMFOLLOW = 0x2000
_AT_FDCWD = -100
_AT_RECURSIVE = 0x8000

#: pivot_root(2) has no libc wrapper: its number is x86_64's own, and the generic table's on the
#: newer architectures.
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "loongarch64": 41}


#: fallocate(2) mode: allocate blocks past the end without changing the file's size.
FALLOC_FL_KEEP_SIZE = 1


def try_fallocate(fd: int, mode: int, offset: int, length: int) -> int:
    """fallocate(2) (os.posix_fallocate has no mode); the errno, 0 on success."""
    function = _libc.fallocate
    function.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    if function(fd, mode, offset, length) != 0:
        return ctypes.get_errno()
    return 0


#: renameat2(2) flags: fail with EEXIST rather than replace the target; swap the two names
#: atomically (both must exist; any types, a directory included).
RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2


def renameat2(dir_fd: int, old: str, new: str, flags: int) -> None:
    """renameat2(2) within one directory (os.rename has no flags). Neither name is followed if
    it is a symlink: the names themselves move. EINVAL where the filesystem lacks ``flags``."""
    if _libc.renameat2(dir_fd, os.fsencode(old), dir_fd, os.fsencode(new), flags) != 0:
        raise _failed(f"renameat2 {old} {new}")


def filesystem_type(fd: int) -> int:
    """fstatfs(2)'s ``f_type`` (the filesystem's magic number) of what ``fd`` is open on; 0
    when it cannot be had (os.statvfs has no type)."""
    # struct statfs opens with f_type, a C long on every Linux ABI; 256 bytes hold the whole
    # struct (120 on x86_64 and aarch64).
    buffer = ctypes.create_string_buffer(256)
    if _libc.fstatfs(fd, buffer) != 0:
        return 0
    return ctypes.c_long.from_buffer(buffer).value & 0xFFFFFFFF


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


def prctl_get(option: int, arg: int = 0) -> int:
    """The value a prctl ``GET`` option returns (PR_GET_SECUREBITS, PR_CAPBSET_READ...)."""
    zero = ctypes.c_ulong(0)
    result = int(_libc.prctl(option, ctypes.c_ulong(arg), zero, zero, zero))
    if result < 0:
        raise _failed(f"prctl({option})")
    return result


def prctl(option: int, arg: int = 0, *, what: str = "prctl") -> None:
    if try_prctl(option, arg) != 0:
        raise _failed(what)


def sethostname(name: str) -> None:
    """sethostname(2), in a UTS namespace of the caller's own."""
    encoded = name.encode()
    if _libc.sethostname(encoded, ctypes.c_size_t(len(encoded))) != 0:
        raise _failed("sethostname")


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
        os.fsencode(source),
        os.fsencode(target),
        fstype.encode() if fstype else None,
        ctypes.c_ulong(flags),
        data.encode() if data else None,
    )
    if result != 0:
        raise _failed(f"mount {target}")


def try_syscall(number: int, *args: object) -> int:
    """syscall(number, *args): 0 when it succeeded, else the errno it failed with."""
    try:
        syscall("syscall", number, *args)
    except OSError as exc:
        return exc.errno or 0
    return 0


def syscall(what: str, number: int, *args: object) -> int:
    """syscall(number, *args); its non-negative result, or OSError."""
    # syscall(2) reads every argument as a long: pass ints as such, not as 32-bit C ints.
    wide = [ctypes.c_long(a) if isinstance(a, int) else a for a in args]
    ctypes.set_errno(0)
    result = int(_syscall(ctypes.c_long(number), *wide))
    if result < 0:
        raise _failed(what)
    return result


def umount(target: str, flags: int = 0) -> None:
    if _libc.umount2(os.fsencode(target), flags) != 0:
        raise _failed(f"umount {target}")


def pivot_root(new_root: str, put_old: str) -> None:
    """pivot_root(2); OSError (ENOSYS) on an architecture whose number we do not know."""
    number = _SYS_PIVOT_ROOT.get(os.uname().machine)
    if number is None:
        raise OSError(errno.ENOSYS, f"pivot_root: unknown on {os.uname().machine}")
    syscall(
        "pivot_root",
        number,
        ctypes.c_char_p(os.fsencode(new_root)),
        ctypes.c_char_p(os.fsencode(put_old)),
    )


def set_read_only(path: str, *, recursive: bool) -> None:
    """Make the mount at ``path`` (and, ``recursive``, every mount beneath it) read-only, in
    one call (mount_setattr, Linux 5.12): a remount would need each mount's own flags."""
    _set_mount_attributes(path, _MOUNT_ATTR_RDONLY, recursive=recursive)


def set_no_symlinks(path: str) -> None:
    """Make the mounts at and beneath ``path`` follow no symlink (MOUNT_ATTR_NOSYMFOLLOW,
    Linux 5.10): resolving a path through a symlink on them fails with ELOOP, whoever does it
    (readlink still works)."""
    _set_mount_attributes(path, _MOUNT_ATTR_NOSYMFOLLOW, recursive=True)


def _set_mount_attributes(path: str, attributes: int, *, recursive: bool) -> None:
    # struct mount_attr: attr_set, attr_clr, propagation, userns_fd; all u64.
    attr = (ctypes.c_uint64 * 4)(attributes)
    flags = _AT_RECURSIVE if recursive else 0
    path_arg = ctypes.c_char_p(os.fsencode(path))
    syscall(f"mount_setattr {path}", _SYS_MOUNT_SETATTR, _AT_FDCWD, path_arg, flags, attr, 32)


class CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class CapData(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint32) for name in ("effective", "permitted", "inheritable")]


#: _LINUX_CAPABILITY_VERSION_3: two CapData, the low and the high 32 capabilities.
CAP_VERSION_3 = 0x20080522


def capget() -> tuple[int, int, int]:
    """This thread's (effective, permitted, inheritable) capability sets, as 64-bit masks."""
    header, data = CapHeader(CAP_VERSION_3, 0), (CapData * 2)()
    if _capget(ctypes.byref(header), data) != 0:
        raise _failed("capget")
    low, high = data
    return (
        low.effective | high.effective << 32,
        low.permitted | high.permitted << 32,
        low.inheritable | high.inheritable << 32,
    )


def capset(kept: int = 0) -> None:
    """Set this thread's effective and permitted sets to ``kept`` (a subset of what it holds:
    shrinking is always permitted), the inheritable set to nothing."""
    if _capset(ctypes.byref(CapHeader(CAP_VERSION_3, 0)), cap_data(kept)) != 0:
        raise _failed("capset")


def cap_data(kept: int) -> ctypes.Array[CapData]:
    """capset's argument. Built once by a worker while idle too (workers.sandbox.rehearse):
    the first one built in a forked process cost 75 µs of copy-on-write faults, measured."""
    return (CapData * 2)(
        CapData(kept & 0xFFFFFFFF, kept & 0xFFFFFFFF, 0), CapData(kept >> 32, kept >> 32, 0)
    )
