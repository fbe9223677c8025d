"""Landlock, called directly through its three system calls (ctypes, no dependency).

Landlock lets an unprivileged (or root) thread restrict itself, and everything it starts
afterwards, to a set of rules. Rules only ever narrow: a restricted process can add its own
restrictions but never lift one, and each ``restrict_self`` makes a new domain nested in the
previous one. What each ABI version added, and what this module uses of it:

====  ==================================================================================
ABI   feature
====  ==================================================================================
1     filesystem rules (read, write, execute, make/remove entries beneath a directory);
      ptrace and /proc/PID/mem of a process outside the caller's domain are refused
2     REFER: linking or renaming a file into another directory
3     TRUNCATE
4     TCP network rules: bind and connect, per port
5     IOCTL_DEV: ioctl on device files
6     scoping: no signals to, no abstract unix socket connection with, outside the domain
7     audit logging flags for restrict_self (unused here)
====  ==================================================================================

Why not the PyPI ``landlock`` package: its ruleset covers filesystem rights only (no network
rules, no scoping), and its error check reads a possibly stale errno after every call. The
kernel interface is three syscalls and three structs; they are written out below.
"""

from __future__ import annotations

import ctypes
import functools
import os
import stat

from sandbx_pool.workers import libc

# The generic syscall numbers: the same on every architecture since Linux 5.13.
_SYS_CREATE_RULESET = 444
_SYS_ADD_RULE = 445
_SYS_RESTRICT_SELF = 446
_CREATE_RULESET_VERSION = 1 << 0
_RULE_PATH_BENEATH = 1

# Filesystem access rights (include/uapi/linux/landlock.h).
EXECUTE = 1 << 0
WRITE_FILE = 1 << 1
READ_FILE = 1 << 2
READ_DIR = 1 << 3
REMOVE_DIR = 1 << 4
REMOVE_FILE = 1 << 5
MAKE_CHAR = 1 << 6
MAKE_DIR = 1 << 7
MAKE_REG = 1 << 8
MAKE_SOCK = 1 << 9
MAKE_FIFO = 1 << 10
MAKE_BLOCK = 1 << 11
MAKE_SYM = 1 << 12
REFER = 1 << 13  # ABI 2
TRUNCATE = 1 << 14  # ABI 3
IOCTL_DEV = 1 << 15  # ABI 5

# Network access rights (ABI 4) and scopes (ABI 6).
NET_BIND_TCP = 1 << 0
NET_CONNECT_TCP = 1 << 1
SCOPE_ABSTRACT_UNIX_SOCKET = 1 << 0
SCOPE_SIGNAL = 1 << 1

#: Rights that make sense on a file (a rule on a non-directory may grant only these).
FILE_RIGHTS = EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE | IOCTL_DEV

_FS_RIGHTS_BY_ABI = {
    1: (1 << 13) - 1,
    2: (1 << 14) - 1,
    3: (1 << 15) - 1,
    5: (1 << 16) - 1,
}


class _RulesetAttr(ctypes.Structure):
    _fields_ = [
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),  # ABI 4
        ("scoped", ctypes.c_uint64),  # ABI 6
    ]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1  # the kernel's struct is __attribute__((packed)): 12 bytes
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


@functools.cache
def abi_version() -> int:
    """The kernel's Landlock ABI version; 0 when Landlock is absent or disabled at boot."""
    try:
        return libc.syscall(
            "landlock_create_ruleset", _SYS_CREATE_RULESET, None, 0, _CREATE_RULESET_VERSION
        )
    except OSError:  # ENOSYS (not built in) or EOPNOTSUPP (not enabled in lsm=)
        return 0


def fs_rights(abi: int) -> int:
    """Every filesystem right the given ABI knows."""
    best = max((v for v in _FS_RIGHTS_BY_ABI if v <= abi), default=0)
    return _FS_RIGHTS_BY_ABI.get(best, 0)


def has_net_rules(abi: int) -> bool:
    return abi >= 4


def has_scoping(abi: int) -> bool:
    return abi >= 6


class PathBeneath:
    """A path opened for a rule (O_PATH: it grants nothing by itself), and the rights to grant
    beneath it, those a regular file cannot have already masked off."""

    __slots__ = ("fd", "identity", "rights")

    def __init__(self, fd: int, rights: int, identity: tuple[int, int]) -> None:
        self.fd = fd
        self.rights = rights
        #: What the path was when opened: (device, inode). A rule holds that, not the name.
        self.identity = identity

    @classmethod
    def open(cls, path: str, rights: int) -> PathBeneath | None:
        """None when the path cannot be opened (missing, say): there is nothing to grant."""
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError, PermissionError):
            return None
        found = os.fstat(fd)
        if not stat.S_ISDIR(found.st_mode):
            rights &= FILE_RIGHTS
        return cls(fd, rights, (found.st_dev, found.st_ino))

    def close(self) -> None:
        os.close(self.fd)


class Ruleset:
    """A ruleset being built: what it handles (denies unless a rule grants it), then rules.

    Rights the running kernel does not know are masked off, so one policy works on every ABI
    (it enforces what the kernel can). Close it, or let ``restrict_self`` consume it.
    """

    def __init__(self, *, handled_fs: int = 0, handled_net: int = 0, scoped: int = 0) -> None:
        self.abi = abi_version()
        if self.abi == 0:
            raise OSError("Landlock is not available on this kernel")
        self.handled_fs = handled_fs & fs_rights(self.abi)
        self.handled_net = handled_net if has_net_rules(self.abi) else 0
        self.scoped = scoped if has_scoping(self.abi) else 0
        attr = _RulesetAttr(self.handled_fs, self.handled_net, self.scoped)
        # The size tells the kernel which fields we know; older kernels refuse a larger one.
        size = 24 if has_scoping(self.abi) else 16 if has_net_rules(self.abi) else 8
        self.fd = libc.syscall(
            "landlock_create_ruleset", _SYS_CREATE_RULESET, ctypes.byref(attr), size, 0
        )

    @classmethod
    def adopt(cls, fd: int) -> Ruleset:
        """A ruleset built elsewhere (its descriptor inherited), to enter, not to add to."""
        ruleset = cls.__new__(cls)
        ruleset.abi = abi_version()
        ruleset.handled_fs = ruleset.handled_net = ruleset.scoped = 0  # unknown here
        ruleset.fd = fd
        return ruleset

    def allow_path(self, path: str, rights: int) -> tuple[int, int] | None:
        """Grant ``rights`` beneath ``path``; returns what it granted them on, (device, inode),
        or None (nothing granted) if we cannot open it."""
        beneath = PathBeneath.open(path, rights)
        if beneath is None:
            return None
        try:
            self.allow(beneath)
        finally:
            beneath.close()
        return beneath.identity

    def allow(self, beneath: PathBeneath) -> None:
        """Grant a rule whose path is open already (what this ruleset handles of it)."""
        self.allow_all([beneath])

    def allow_all(self, rules: list[PathBeneath]) -> None:
        """``allow`` each rule, with one attribute struct and the arguments converted once
        (workers.rules adds a few hundred in the template)."""
        attr = _PathBeneathAttr(0, -1)
        args = (ctypes.c_long(self.fd), ctypes.c_long(_RULE_PATH_BENEATH), ctypes.byref(attr))
        for beneath in rules:
            rights = beneath.rights & self.handled_fs
            if rights:
                attr.allowed_access, attr.parent_fd = rights, beneath.fd
                libc.syscall("landlock_add_rule", _SYS_ADD_RULE, *args, 0)

    def restrict_self(self) -> None:
        """Enforce the ruleset on the calling thread and what it starts from now on.

        Needs no_new_privs (or CAP_SYS_ADMIN). Only this thread is restricted: threads that
        already exist keep their access, and children are forked from this one.
        """
        try:
            libc.syscall("landlock_restrict_self", _SYS_RESTRICT_SELF, self.fd, 0)
        finally:
            self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
