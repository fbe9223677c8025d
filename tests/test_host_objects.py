"""What no namespace of the call's holds, attacked through a real Pool in whatever environment
the test runs in (root host R, unprivileged user U, root without CAP_SYS_ADMIN D):

* sockets: AF_VSOCK (the hypervisor's services) and netlink's NETLINK_KOBJECT_UEVENT (the
  host's device events) always refused; with ``network = false`` every address family but
  AF_UNIX, AF_INET, AF_INET6 and netlink route; socketpair too (workers/seccomp.py);
* the host's SysV IPC and POSIX message queues: an IPC namespace of the call's own where one
  can be made, else refused by the filter;
* root's secrets: masked by a mount in bash's namespace, else left out by a Landlock layer
  (workers/rules.py), for bash and the file tools; a file made in /etc after the pool started
  is readable, a symlink to a secret is not;
* moving files across directories with ``network = false`` (a Landlock layer that handles no
  rename must still grant it).

A refusal is asserted by its errno (the filter's EPERM), and what is kept by comparison with
what the same try gets in this test process, unconfined: a kernel without AF_APPLETALK says
EAFNOSUPPORT in and out, which is not the filter's doing.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import json
import os
import shlex
import socket
import sys
import textwrap
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import marked_config

from sandbx_pool import Pool, Status
from sandbx_pool.cli.doctor import Check, diagnose
from sandbx_pool.workers import seccomp

PY = sys.executable


@functools.cache
def doctor() -> dict[str, Check]:
    """What ``sandbx-pool doctor`` says of this machine, by check name (probed once)."""
    return {check.name: check for check in diagnose()}


def needs(name: str) -> None:
    """Skip, with doctor's reason, where doctor reports the protection absent."""
    check = doctor()[name]
    if not check.ok:
        pytest.skip(f"doctor: {name}: {check.fallback}")


def python(code: str) -> str:
    """A bash command running ``code`` with this test's interpreter (readable by every call)."""
    return f"{PY} -c {shlex.quote(textwrap.dedent(code))}"


async def bash(pool: Pool, command: str) -> dict[str, Any]:
    outcome = await pool.call("bash", {"command": command}, timeout=60)
    assert outcome.status is Status.OK, outcome
    assert outcome.value is not None
    return outcome.value


async def run_json(pool: Pool, code: str) -> Any:
    """Run ``code`` (which prints one JSON document) in python -c, started by bash."""
    value = await bash(pool, python(code))
    assert value["exit_code"] == 0, value
    return json.loads(value["stdout"])


@contextlib.asynccontextmanager
async def pool_with(workspace: Path, **sandbox: object) -> AsyncIterator[Pool]:
    config = marked_config(pool={"workers": 2}, sandbox=sandbox)
    async with Pool(workspace, config=config) as pool:
        yield pool


# -- sockets ------------------------------------------------------------------------------------

#: Opens each (name, socketpair?, domain, type, protocol) and prints what came of it: "ok" or
#: the errno's name. Run by bash, so whatever confines the command confines it.
_SOCKETS = """
    import errno, json, socket
    tries = {tries!r}
    found = {{}}
    for name, pair, domain, kind, protocol in tries:
        try:
            if pair:
                for end in socket.socketpair(domain, kind, protocol):
                    end.close()
            else:
                socket.socket(domain, kind, protocol).close()
            found[name] = "ok"
        except OSError as exc:
            found[name] = errno.errorcode[exc.errno]
    print(json.dumps(found))
"""

AF_APPLETALK, AF_X25, AF_CAN, AF_TIPC, AF_BLUETOOTH, AF_ALG = 5, 9, 29, 30, 31, 38
NETLINK_ROUTE, NETLINK_SOCK_DIAG, NETLINK_AUDIT, NETLINK_GENERIC, NETLINK_UEVENT = 0, 4, 9, 16, 15
DGRAM, STREAM, RAW, SEQPACKET = socket.SOCK_DGRAM, socket.SOCK_STREAM, socket.SOCK_RAW, 5

#: Refused with the network on or off.
ALWAYS = [
    ("vsock", False, socket.AF_VSOCK, STREAM, 0),
    ("vsock dgram", False, socket.AF_VSOCK, DGRAM, 0),
    ("vsock pair", True, socket.AF_VSOCK, STREAM, 0),
    ("uevent", False, socket.AF_NETLINK, DGRAM, NETLINK_UEVENT),
    ("uevent raw", False, socket.AF_NETLINK, RAW, NETLINK_UEVENT),
    ("packet", False, socket.AF_PACKET, RAW, 0),
]
#: Refused with the network off only.
OFFLINE = [
    ("appletalk", False, AF_APPLETALK, DGRAM, 0),
    ("x25", False, AF_X25, SEQPACKET, 0),
    ("can", False, AF_CAN, RAW, 1),
    ("tipc", False, AF_TIPC, SEQPACKET, 0),
    ("bluetooth", False, AF_BLUETOOTH, STREAM, 3),
    ("alg", False, AF_ALG, SEQPACKET, 0),
    ("appletalk pair", True, AF_APPLETALK, DGRAM, 0),
    ("netlink audit", False, socket.AF_NETLINK, RAW, NETLINK_AUDIT),
    ("netlink generic", False, socket.AF_NETLINK, RAW, NETLINK_GENERIC),
    ("netlink sock_diag", False, socket.AF_NETLINK, RAW, NETLINK_SOCK_DIAG),
]
#: Never refused by the filter: what a command needs (ip and getaddrinfo read netlink route).
KEPT = [
    ("unix", False, socket.AF_UNIX, STREAM, 0),
    ("unix dgram", False, socket.AF_UNIX, DGRAM, 0),
    ("unix pair", True, socket.AF_UNIX, STREAM, 0),
    ("inet tcp", False, socket.AF_INET, STREAM, 0),
    ("inet udp", False, socket.AF_INET, DGRAM, 0),
    ("inet6 tcp", False, socket.AF_INET6, STREAM, 0),
    ("netlink route", False, socket.AF_NETLINK, RAW, NETLINK_ROUTE),
    ("netlink route dgram", False, socket.AF_NETLINK, DGRAM, NETLINK_ROUTE),
]


def on_the_host(tries: list[tuple[str, bool, int, int, int]]) -> dict[str, str]:
    """The same tries, in this (unconfined) test process: what the kernel itself answers."""
    found = {}
    for name, pair, domain, kind, protocol in tries:
        try:
            ends = (
                socket.socketpair(domain, kind, protocol)
                if pair
                else (socket.socket(domain, kind, protocol),)
            )
            for end in ends:
                end.close()
            found[name] = "ok"
        except OSError as exc:
            found[name] = errno.errorcode[exc.errno]
    return found


@pytest.mark.parametrize("network", [True, False], ids=["online", "offline"])
async def test_sockets_no_namespace_holds_are_refused(workspace: Path, network: bool) -> None:
    needs("seccomp filter")
    tries = ALWAYS + OFFLINE + KEPT
    async with pool_with(workspace, network=network) as pool:
        plain = [(name, pair, int(d), int(k), p) for name, pair, d, k, p in tries]
        found = await run_json(pool, _SOCKETS.format(tries=plain))
    for name, *_ in ALWAYS:
        assert found[name] == "EPERM", (name, found)
    host = on_the_host(tries)
    for name, *_ in OFFLINE:
        # Online, the kernel answers as it would outside (EAFNOSUPPORT where it lacks the
        # family); offline, the filter refuses first, whatever the kernel has.
        assert found[name] == ("EPERM" if not network else host[name]), (name, found, host)
        assert network or host[name] != "EPERM", name  # the refusal is the filter's
    for name, *_ in KEPT:
        assert found[name] == host[name], (name, found, host)
        if name != "inet6 tcp":  # a kernel without IPv6 says EAFNOSUPPORT, in and out
            assert found[name] == "ok", (name, found)


async def test_offline_commands_still_resolve_interfaces(workspace: Path) -> None:
    """if_nameindex() asks the kernel over netlink route (as ip does): it still works."""
    needs("seccomp filter")
    async with pool_with(workspace, network=False) as pool:
        names = await run_json(
            pool, "import json, socket; print(json.dumps(socket.if_nameindex()))"
        )
        ip = await bash(pool, "ip -o link show lo || echo no-ip")
    assert "lo" in [name for _, name in names]
    assert "lo" in ip["stdout"] or "no-ip" in ip["stdout"], ip


def test_the_filter_decides_each_architecture_alike() -> None:
    """The programs both architectures get, run through a classic BPF interpreter: the same
    decisions from their own system call numbers (aarch64's cannot be run here)."""
    for arch in ("x86_64", "aarch64"):
        for offline in (False, True):
            for shared_ipc in (False, True):
                program = seccomp.build_filter(arch, offline=offline, shared_ipc=shared_ipc)

                def decide(name: str, *args: int, arch: str = arch, p: Any = program) -> str:
                    return run_bpf(p, arch, name, args)

                assert decide("socket", socket.AF_VSOCK, STREAM, 0) == "EPERM"
                assert decide("socketpair", socket.AF_VSOCK, STREAM, 0) == "EPERM"
                assert decide("socket", socket.AF_NETLINK, DGRAM, NETLINK_UEVENT) == "EPERM"
                # High bits the kernel ignores (it reads an int) do not slip a family past.
                assert decide("socket", (1 << 32) | socket.AF_VSOCK, STREAM, 0) == "EPERM"
                assert decide("socket", socket.AF_NETLINK, RAW, NETLINK_ROUTE) == "allow"
                assert decide("socket", socket.AF_UNIX, STREAM, 0) == "allow"
                assert decide("socket", socket.AF_INET6, STREAM, 0) == "allow"
                offline_only = "EPERM" if offline else "allow"
                assert decide("socket", AF_BLUETOOTH, STREAM, 3) == offline_only
                assert decide("socketpair", AF_APPLETALK, DGRAM, 0) == offline_only
                assert decide("socket", socket.AF_NETLINK, RAW, NETLINK_AUDIT) == offline_only
                ipc = "EPERM" if shared_ipc else "allow"
                for name in ("shmget", "shmat", "semop", "semtimedop", "msgrcv", "mq_open"):
                    assert decide(name, 0, 0, 0) == ipc, (arch, name)
                # The rules that were there: still there.
                assert decide("keyctl", 0) == "EPERM"
                assert decide("ptrace", 16) == "EPERM"
                assert decide("openat", 0, 0, 0o100, 0o4755) == "EPERM"
                assert decide("openat", 0, 0, 0o100, 0o755) == "allow"
                assert decide("clone3", 0) == "ENOSYS"
                assert decide("getpid") == "allow"


#: A system call the filter does not name: its number on x86_64 and aarch64.
_GETPID = {"x86_64": 39, "aarch64": 172}


def run_bpf(program: Any, arch: str, name: str, args: tuple[int, ...]) -> str:
    """Run a classic BPF seccomp program on one system call: "allow", "kill" or the errno."""
    nr = _GETPID[arch] if name == "getpid" else seccomp.number(name, arch)
    data = [nr, seccomp.audit_arch(arch)]  # struct seccomp_data: nr, arch, ip, args[6]
    words = [*args, *[0] * (6 - len(args))]
    pc, acc = 0, 0
    while True:
        code, jt, jf, k = program[pc]
        if code == 0x20:  # LD W ABS
            acc = data[k // 4] if k < 8 else (words[(k - 16) // 8] & 0xFFFFFFFF)
            pc += 1
        elif code in (0x15, 0x45):  # JEQ K, JSET K
            taken = acc == k if code == 0x15 else bool(acc & k)
            pc += 1 + (jt if taken else jf)
        else:
            assert code == 0x06, hex(code)  # RET K
            if k == 0x7FFF0000:
                return "allow"
            if k == 0x80000000:
                return "kill"
            return errno.errorcode[k & 0xFFFF]


# -- SysV IPC -----------------------------------------------------------------------------------

_IPC = """
    import ctypes, errno, json, os
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mq_open.argtypes = [ctypes.c_char_p, ctypes.c_int]
    def call(function, *args):
        result = function(*args)
        return "ok" if result >= 0 else errno.errorcode[ctypes.get_errno()]
    print(json.dumps({{
        "namespace": os.readlink("/proc/self/ns/ipc"),
        "host segment": call(libc.shmget, {key}, 0, 0),
        "own segment": call(libc.shmget, 0, 4096, 0o1600),
        "semaphore": call(libc.semget, 0, 1, 0o1600),
        "queue": call(libc.msgget, 0, 0o1600),
        "host mqueue": call(libc.mq_open, b"{mqueue}", os.O_RDONLY),
    }}))
"""


@pytest.fixture
def host_ipc() -> Iterator[tuple[int, str]]:
    """A SysV segment and a POSIX queue this test process makes, 0600, as root (or the pool's
    user) would on the host: the key and the queue's name."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mq_open.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p]
    key = 0x5BD0_0000 + os.getpid() % 0xFFFF
    shmid = libc.shmget(key, 4096, 0o1000 | 0o600)  # IPC_CREAT
    assert shmid >= 0, os.strerror(ctypes.get_errno())
    mqueue = f"/sbxtest-{uuid.uuid4().hex[:12]}"
    mqd = libc.mq_open(mqueue.encode(), os.O_CREAT | os.O_RDONLY, 0o600, None)
    assert mqd >= 0, os.strerror(ctypes.get_errno())
    try:
        yield key, mqueue
    finally:
        libc.shmctl(shmid, 0, None)  # IPC_RMID
        libc.mq_close(mqd)
        libc.mq_unlink(mqueue.encode())


async def test_the_hosts_ipc_objects_are_out_of_reach(
    workspace: Path, host_ipc: tuple[int, str]
) -> None:
    key, mqueue = host_ipc
    async with pool_with(workspace) as pool:
        found = await run_json(pool, _IPC.format(key=key, mqueue=mqueue))
        ipcmk = await bash(pool, "ipcmk -M 4096 && echo made || echo refused")
    shared = found.pop("namespace") == os.readlink("/proc/self/ns/ipc")
    if shared:
        # No IPC namespace could be made: the filter refuses every SysV and queue call.
        needs("seccomp filter")
        assert set(found.values()) == {"EPERM"}, found
        assert "refused" in ipcmk["stdout"] or "command not found" in ipcmk["stderr"], ipcmk
    else:
        # Its own namespace: the host's objects are not there, its own are its own.
        assert found == {
            "host segment": "ENOENT",
            "own segment": "ok",
            "semaphore": "ok",
            "queue": "ok",
            "host mqueue": "ENOENT",
        }, found


# -- root's secrets -----------------------------------------------------------------------------

SHADOW = "/etc/shadow"
SECRETS = [path for path in (SHADOW, "/etc/gshadow", "/etc/sudoers") if os.path.exists(path)]
needs_shadow = pytest.mark.skipif(not os.path.exists(SHADOW), reason="no /etc/shadow here")


@needs_shadow
async def test_bash_cannot_read_roots_secrets(workspace: Path, tmp_path: Path) -> None:
    needs("root's secrets unreadable")
    (workspace / "s").symlink_to(SHADOW)
    attempts = {
        "cat": "cat /etc/shadow /etc/gshadow",
        "through a symlink": "cat s",
        "copied": "cp /etc/shadow copy && cat copy",
        "linked away": 'ln /etc/shadow "$TMPDIR/x" && cat "$TMPDIR/x"',
        "python": python("print(open('/etc/shadow').read())"),
        "through /proc": "cat /proc/self/root/etc/shadow",
    }
    async with pool_with(workspace) as pool:
        for what, command in attempts.items():
            value = await bash(pool, command)
            assert value["exit_code"] != 0, (what, value)
            assert "root:" not in value["stdout"], (what, value)
        # What lies beside them is read as before.
        value = await bash(pool, "head -1 /etc/passwd && ls /etc | grep -cx shadow")
        assert value["stdout"].startswith("root:"), value
        assert value["stdout"].endswith("\n1\n"), value  # and its name is listed


@needs_shadow
async def test_the_file_tools_cannot_read_roots_secrets(tmp_path: Path) -> None:
    """A workspace of / (a Ray node's pool has one): the path checks let /etc/shadow through,
    the kernel must not."""
    needs("root's secrets unreadable")
    config = marked_config(pool={"workers": 2})
    async with Pool("/", journal=tmp_path / "j.jsonl", config=config) as pool:
        reads = [await pool.call("read", {"path": path}, timeout=60) for path in SECRETS]
        passwd = await pool.call("read", {"path": "/etc/passwd", "limit": 1}, timeout=60)
    for read in reads:
        assert read.status is Status.ERROR, read
        assert read.error_code == "EACCES", read
    assert passwd.status is Status.OK, passwd
    assert passwd.value is not None
    assert passwd.value["content"].startswith("root:"), passwd


@needs_shadow
async def test_a_file_made_in_etc_after_the_start_is_readable(workspace: Path) -> None:
    """Where a Landlock layer leaves the secrets out, it lists /etc once: an entry made since
    must still be readable, and a symlink to a secret must not lead to it."""
    if os.geteuid() != 0:
        pytest.skip("only root can make a file in /etc")
    needs("root's secrets unreadable")
    tag = f"sbxtest-{uuid.uuid4().hex[:12]}"
    made = [Path(f"/etc/{tag}"), Path(f"/etc/{tag}-to-shadow"), Path(f"/etc/{tag}-to-passwd")]
    async with pool_with(workspace) as pool:
        await bash(pool, "true")  # the pool is up, its next workers forked already
        try:
            made[0].write_text("made after the start\n")
            made[1].symlink_to(SHADOW)
            made[2].symlink_to("passwd")
            value = await bash(pool, f"cat /etc/{tag}; head -1 /etc/{tag}-to-passwd")
            assert value["stdout"].startswith("made after the start\nroot:"), value
            value = await bash(pool, f"cat /etc/{tag}-to-shadow")
            assert value["exit_code"] != 0, value
            assert "root:" not in value["stdout"], value
        finally:
            for path in made:
                path.unlink(missing_ok=True)


def test_doctor_says_how_the_secrets_are_kept() -> None:
    check = doctor()["root's secrets unreadable"]
    if os.geteuid() != 0:
        assert "not root" in check.detail
    elif check.ok:
        assert "mount" in check.detail or "Landlock" in check.detail, check
    assert "AF_VSOCK" in doctor()["seccomp filter"].detail


# -- moves across directories -------------------------------------------------------------------


@pytest.mark.parametrize(
    "sandbox", [{"network": False}, {"filesystem": "host"}, {}], ids=["offline", "host", "default"]
)
async def test_files_move_across_directories(workspace: Path, sandbox: dict[str, object]) -> None:
    """Every Landlock layer refuses linking or renaming into another directory unless it grants
    it, a layer that handles only the network (network = false) or no path (filesystem =
    "host") included."""
    command = (
        "mkdir a b && touch a/x && ln a/x b/y && "
        + python("import os; os.rename('a/x', 'b/z')")
        + " && ls b"
    )
    async with pool_with(workspace, **sandbox) as pool:
        value = await bash(pool, command)
    assert value["stdout"].split() == ["y", "z"], value
