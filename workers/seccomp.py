"""A seccomp filter for what bash runs: the system calls that reach past a capless uid 0.

A command runs with no capability (workers.lockdown), so the kernel already refuses it most of
root's power. What remains is reachable without any capability, which this filter refuses:

* kernel attack surface no tool needs: io_uring (whose operations would also bypass this
  filter), perf_event_open, bpf, userfaultfd (stalls the kernel mid-copy: a race exploit's tool);
* other processes: ptrace, process_vm_readv/writev, pidfd_getfd, kcmp. A capless uid 0 passes
  the ptrace check against every other capless uid-0 process: another call's worker included;
* keyrings: keyctl, add_key, request_key. They are not namespaced: uid 0's user keyring is the
  whole host's;
* user namespaces: unshare or clone with CLONE_NEWUSER, and setns: a new user namespace gives
  every capability back inside it, over a fresh network stack (nf_tables) and mounts;
* set-uid and set-gid files, which outlive the call for anyone to exec: chmod, fchmod,
  fchmodat(2), creat, open/openat with O_CREAT or O_TMPFILE, mknod(at), whenever the mode has
  06000 bits. The owner of a file (root, of what root makes) needs no capability for these.
  mkdir needs no rule: the kernel drops those bits from its mode;
* sockets no namespace holds (socket and socketpair, by address family): AF_PACKET (a copy of
  every frame on an interface, loopback included), AF_VSOCK (nothing namespaces it: on a virtual
  machine it reaches the hypervisor's services, as in Docker's default profile) and netlink's
  NETLINK_KOBJECT_UEVENT (the host's device events, delivered into every network namespace);
  with ``network = false``, every family but AF_UNIX, AF_INET, AF_INET6 and netlink's
  NETLINK_ROUTE (which ip and getaddrinfo read): Bluetooth, CAN, AF_ALG, X.25, TIPC... reach
  past a network namespace or stand in for one that could not be made;
* SysV IPC (shmget, shmat, shmctl, semget, semop, semtimedop, semctl, msgget, msgsnd, msgrcv,
  msgctl) and POSIX message queues (mq_open, mq_unlink), only where the call could not have an
  IPC namespace of its own (a pool without CAP_SYS_ADMIN): they would reach the host's objects,
  every 0600 segment root made among them. Neither architecture has ipc() or socketcall(),
  whose one number multiplexes these (i386 has both: its calls are killed, below);
* TIOCSTI (typing into the terminal of whoever reads it next);
* prlimit64 on another process: the call's own worker, whose limits it could lower until the
  worker fails at its last step after the command (workers.protected).

clone3 and openat2 fail with ENOSYS, not EPERM: their flags and mode lie in memory the filter
cannot read, and on ENOSYS glibc falls back to clone and openat, which it can. (On EPERM glibc
does not fall back: Python could no longer start a thread.) A system call of another
architecture (i386 through int 0x80 on x86_64) or x32's kills the process: the numbers would
mean other calls.

Every refusal above is EPERM, but for clone3 and openat2: a program sees a refusal, not a
missing feature (EAFNOSUPPORT, ENOSYS), and says so.

Hand-written classic BPF rather than libseccomp: 90 to 150 instructions, in four variants (the
network on or off, an IPC namespace or none) built once per pool in the template
(``prepare``), installed with two system calls; no library to install, no ctypes binding to
keep in step with it. x86_64 and aarch64; elsewhere ``supported()`` is False and the doctor
says the filter is missing.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import platform
from typing import NamedTuple

from sandbx_pool.workers import libc

_LD_W_ABS, _JEQ_K, _JSET_K, _RET_K = 0x20, 0x15, 0x45, 0x06  # classic BPF opcodes
_RET_KILL_PROCESS, _RET_ALLOW, _RET_ERRNO = 0x80000000, 0x7FFF0000, 0x00050000
EPERM, ENOSYS = _RET_ERRNO | errno.EPERM, _RET_ERRNO | errno.ENOSYS
_OFF_NR, _OFF_ARCH = 0, 4  # struct seccomp_data: int nr; u32 arch; u64 ip; u64 args[6]
_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_SYS_SECCOMP = {"x86_64": 317, "aarch64": 277}
_SECCOMP_SET_MODE_FILTER, _SECCOMP_FILTER_FLAG_TSYNC = 1, 1
_X32_BIT, _SETID, _TIOCSTI = 0x40000000, 0o6000, 0x5412
# Address families (socket's argument 0) and netlink protocols (its argument 2).
AF_UNIX, AF_INET, AF_INET6, AF_NETLINK, AF_PACKET, AF_VSOCK = 1, 2, 10, 16, 17, 40
NETLINK_ROUTE, NETLINK_KOBJECT_UEVENT = 0, 15
_CREATES = 0o100 | 0o20000000  # O_CREAT | __O_TMPFILE: when open's mode argument counts

# Syscall numbers, x86_64 then aarch64 (which has only the *at forms; 0: absent).
_NUMBERS: dict[str, tuple[int, int]] = {
    "io_uring_setup": (425, 425),
    "io_uring_enter": (426, 426),
    "io_uring_register": (427, 427),
    "ptrace": (101, 117),
    "kcmp": (312, 272),
    "process_vm_readv": (310, 270),
    "process_vm_writev": (311, 271),
    "pidfd_getfd": (438, 438),
    "perf_event_open": (298, 241),
    "bpf": (321, 280),
    "userfaultfd": (323, 282),
    "keyctl": (250, 219),
    "add_key": (248, 217),
    "request_key": (249, 218),
    "unshare": (272, 97),
    "clone": (56, 220),
    "clone3": (435, 435),
    "setns": (308, 268),
    "chmod": (90, 0),
    "fchmod": (91, 52),
    "fchmodat": (268, 53),
    "fchmodat2": (452, 452),
    "open": (2, 0),
    "openat": (257, 56),
    "creat": (85, 0),
    "openat2": (437, 437),
    "mknod": (133, 0),
    "mknodat": (259, 33),
    "socket": (41, 198),
    "socketpair": (53, 199),
    "shmget": (29, 194),
    "shmat": (30, 196),
    "shmctl": (31, 195),
    "semget": (64, 190),
    "semop": (65, 193),
    "semtimedop": (220, 192),
    "semctl": (66, 191),
    "msgget": (68, 186),
    "msgsnd": (69, 189),
    "msgrcv": (70, 188),
    "msgctl": (71, 187),
    "mq_open": (240, 180),
    "mq_unlink": (241, 181),
    "ioctl": (16, 29),
    "prlimit64": (302, 261),
}


class _Rule(NamedTuple):
    syscall: str
    action: int
    # All must hold (none: always). A test on an argument's low 32 bits: "any" (arg & k), "eq"
    # (arg == k) or "ne" (arg != k). Every argument tested here is one the kernel reads as 32
    # bits or fewer (mode, flags, domain, protocol, cmd), or clone's flags, whose CLONE_NEWUSER
    # bit is in the low half: high bits a caller sets are bits the kernel never looks at.
    when: tuple[tuple[str, int, int], ...] = ()


_SOCKETS = ("socket", "socketpair")  # the same arguments: domain, type, protocol
_UNHELD = (AF_PACKET, AF_VSOCK)  # families no namespace of the call's holds
_UEVENTS = (("eq", 0, AF_NETLINK), ("eq", 2, NETLINK_KOBJECT_UEVENT))

#: Always, in this order (a system call's rules are tried in turn; the first that holds acts).
_RULES = [
    *[_Rule(name, EPERM) for name in ("io_uring_setup", "io_uring_enter", "io_uring_register")],
    _Rule("perf_event_open", EPERM),
    _Rule("bpf", EPERM),
    _Rule("userfaultfd", EPERM),
    *[_Rule(name, EPERM) for name in ("ptrace", "process_vm_readv", "process_vm_writev")],
    _Rule("pidfd_getfd", EPERM),
    _Rule("kcmp", EPERM),
    *[_Rule(name, EPERM) for name in ("keyctl", "add_key", "request_key")],
    _Rule("unshare", EPERM, (("any", 0, libc.CLONE_NEWUSER),)),
    _Rule("clone", EPERM, (("any", 0, libc.CLONE_NEWUSER),)),  # flags: argument 0 on both
    _Rule("clone3", ENOSYS),
    _Rule("setns", EPERM),
    _Rule("openat2", ENOSYS),
    *[_Rule(name, EPERM, (("any", 1, _SETID),)) for name in ("chmod", "fchmod", "creat")],
    *[_Rule(name, EPERM, (("any", 2, _SETID),)) for name in ("fchmodat", "fchmodat2")],
    _Rule("open", EPERM, (("any", 1, _CREATES), ("any", 2, _SETID))),
    _Rule("openat", EPERM, (("any", 2, _CREATES), ("any", 3, _SETID))),
    _Rule("mknod", EPERM, (("any", 1, _SETID),)),  # S_IFREG | 04755 makes a setuid file too
    _Rule("mknodat", EPERM, (("any", 2, _SETID),)),
    *[_Rule(name, EPERM, (("eq", 0, family),)) for name in _SOCKETS for family in _UNHELD],
    *[_Rule(name, EPERM, _UEVENTS) for name in _SOCKETS],
    _Rule("ioctl", EPERM, (("eq", 1, _TIOCSTI),)),
    # Another process's limits (pid, argument 0, not 0): a command could lower its worker's
    # descriptors or CPU time, and the worker could then not set aside what the call made of a
    # protected path (workers.protected). Its own limits (ulimit, setrlimit) stay its own.
    _Rule("prlimit64", EPERM, (("any", 0, 0xFFFFFFFF),)),
]

#: With ``network = false``: no family but these (netlink for NETLINK_ROUTE only).
_ONLINE_FAMILIES = (AF_UNIX, AF_INET, AF_INET6, AF_NETLINK)
_OFFLINE_RULES = [
    *[_Rule(name, EPERM, tuple(("ne", 0, f) for f in _ONLINE_FAMILIES)) for name in _SOCKETS],
    *[_Rule(name, EPERM, (("eq", 0, AF_NETLINK), ("ne", 2, NETLINK_ROUTE))) for name in _SOCKETS],
]

#: Without an IPC namespace of the call's own: the host's SysV objects and POSIX queues.
_SHARED_IPC_RULES = [
    _Rule(name, EPERM)
    for group in (
        ("shmget", "shmat", "shmctl"),
        ("semget", "semop", "semtimedop", "semctl"),
        ("msgget", "msgsnd", "msgrcv", "msgctl"),
        ("mq_open", "mq_unlink"),
    )
    for name in group
]

Program = tuple[tuple[int, int, int, int], ...]  # (code, jt, jf, k)


@functools.cache
def build_filter(arch: str, *, offline: bool = False, shared_ipc: bool = False) -> Program:
    """The program for one architecture's syscall numbers, jumps resolved from labels.

    ``offline``: the call has ``network = false``. ``shared_ipc``: it has no IPC namespace of
    its own. Each adds its rules after the ones that always apply."""
    index = list(_AUDIT_ARCH).index(arch)
    chosen = [
        *_RULES,
        *(_OFFLINE_RULES if offline else ()),
        *(_SHARED_IPC_RULES if shared_ipc else ()),
    ]
    by_syscall: dict[str, list[_Rule]] = {}
    for rule in chosen:
        if _NUMBERS[rule.syscall][index]:
            by_syscall.setdefault(rule.syscall, []).append(rule)
    code: list[tuple[int, str | None, str | None, int]] = []  # forward jumps to labels
    labels: dict[str, int] = {}

    def op(opcode: int, k: int, jt: str | None = None, jf: str | None = None) -> None:
        code.append((opcode, jt, jf, k))

    op(_LD_W_ABS, _OFF_ARCH)
    op(_JEQ_K, _AUDIT_ARCH[arch], jf="kill")
    op(_LD_W_ABS, _OFF_NR)
    if arch == "x86_64":
        op(_JSET_K, _X32_BIT, jt="kill")
    for name, rules in by_syscall.items():  # an unconditional rule: straight to a shared return
        target = f"{name}.0" if rules[0].when else str(rules[0].action)
        op(_JEQ_K, _NUMBERS[name][index], jt=target)
    op(_RET_K, _RET_ALLOW)
    for name, rules in by_syscall.items():
        if not rules[0].when:
            continue  # unconditional: nothing after it is ever tried
        for i, rule in enumerate(rules):
            labels[f"{name}.{i}"] = len(code)
            # The next rule of this system call when a test fails; allow after the last.
            fails = f"{name}.{i + 1}" if i + 1 < len(rules) else "allow"
            loaded = None
            for test, arg, k in rule.when:
                if arg != loaded:  # args[arg]'s low half (little-endian)
                    op(_LD_W_ABS, 16 + 8 * arg)
                    loaded = arg
                if test == "ne":
                    op(_JEQ_K, k, jt=fails)
                else:
                    op(_JSET_K if test == "any" else _JEQ_K, k, jf=fails)
            op(_RET_K, rule.action)
            if not rule.when:
                break
    names = {_RET_ALLOW: "allow", _RET_KILL_PROCESS: "kill"}
    unconditional = {rules[0].action for rules in by_syscall.values() if not rules[0].when}
    for action in (*names, *sorted(unconditional)):
        labels[names.get(action, str(action))] = len(code)
        op(_RET_K, action)

    def offset(at: int, label: str | None) -> int:
        distance = 0 if label is None else labels[label] - at - 1
        if not 0 <= distance <= 255:
            raise ValueError(f"jump to {label} out of range")
        return distance

    return tuple((c, offset(i, jt), offset(i, jf), k) for i, (c, jt, jf, k) in enumerate(code))


def supported() -> bool:
    return platform.machine() in _AUDIT_ARCH


def number(name: str, arch: str | None = None) -> int:
    """The number of a system call the filter names, on ``arch`` (default: this machine's),
    for probes and tests; 0 where the architecture lacks it."""
    return _NUMBERS[name][list(_AUDIT_ARCH).index(arch or platform.machine())]


def audit_arch(arch: str) -> int:
    """The AUDIT_ARCH value seccomp reports for ``arch`` (struct seccomp_data's ``arch``)."""
    return _AUDIT_ARCH[arch]


class _SockFilter(ctypes.Structure):
    _fields_ = [
        ("code", ctypes.c_uint16),
        ("jt", ctypes.c_uint8),
        ("jf", ctypes.c_uint8),
        ("k", ctypes.c_uint32),
    ]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


@functools.cache
def _fprog(
    arch: str, offline: bool, shared_ipc: bool
) -> tuple[_SockFprog, ctypes.Array[_SockFilter]]:
    # The array is returned too, to live as long as the fprog.
    program = build_filter(arch, offline=offline, shared_ipc=shared_ipc)
    instructions = (_SockFilter * len(program))(*(_SockFilter(*insn) for insn in program))
    return _SockFprog(len(program), instructions), instructions


def prepare() -> None:
    """In the template, before forking: every worker then shares the built programs."""
    if supported():
        for offline in (False, True):
            for shared_ipc in (False, True):
                _fprog(platform.machine(), offline, shared_ipc)


def install(*, offline: bool = False, shared_ipc: bool = False) -> None:
    """Enforce the filter on this process and all it starts (needs no_new_privs set first).

    ``offline``: refuse every address family but the four ``network = false`` leaves;
    ``shared_ipc``: refuse SysV IPC and POSIX queues (the call has no IPC namespace)."""
    arch = platform.machine()
    if arch not in _AUDIT_ARCH:
        raise OSError(errno.ENOSYS, f"no seccomp filter for {arch}")
    fprog = ctypes.byref(_fprog(arch, offline, shared_ipc)[0])
    libc.syscall(
        "seccomp", _SYS_SECCOMP[arch], _SECCOMP_SET_MODE_FILTER, _SECCOMP_FILTER_FLAG_TSYNC, fprog
    )
