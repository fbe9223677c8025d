"""``sandbx-pool doctor``: which protections each call gets on this machine, and the fallbacks.

Every line is a probe, not a guess from the kernel version: the namespace and Landlock probes
run in a throwaway child process (they change the process that makes them), the rest here.
Without CAP_SYS_ADMIN the child first enters a user namespace mapped as a worker's is
(workers.containment.UserNamespaces), unless ``--config`` says ``user_namespaces = false``, so
that what it reports is what a worker of this pool gets.

    doctor --> python -c _probe_child() --> [user namespace] the secrets layer (in a child of
                                            its own), unshare(PID, mount, network), prctl,
                                            seccomp, Landlock
           <-- JSON: what each step allowed
    doctor --> pidfd, cgroup v2 (mkdir + rmdir of a child group), FUSE, ZeroMQ peer pid,
               the rg binary grep runs (rg --version)
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes.util
import errno
import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any

import msgspec

from sandbx_pool.interpreter import CHILD_CWD, PACKAGE_PARENT, python_command
from sandbx_pool.workers import (
    _libc,
    cgroups,
    containment,
    immortal,
    landlock,
    lockdown,
    overlay,
    rules,
    seccomp,
)
from sandbx_pool.workers.rg_binary import find_rg, symlinks_refused


class Check(msgspec.Struct, frozen=True):
    name: str
    ok: bool
    detail: str  # what holds when ok
    fallback: str  # what happens instead when not


#: What ``_child_probes`` reports as "user_namespaces": not needed (CAP_SYS_ADMIN), entered,
#: refused by the kernel, turned off by the config, or not for root (a container's).
DIRECT, ENTERED, REFUSED, OFF, ROOT = "direct", "entered", "refused", "off", "root"


def _enter_user_namespace() -> tuple[str, str]:
    """Enter a user namespace as a worker's is made, and map our ids; REFUSED and why if not."""
    namespaces = containment.UserNamespaces()
    code = _libc.try_unshare(_libc.CLONE_NEWUSER)
    if code == errno.ENOSPC:
        return REFUSED, "the kernel refuses them (user.max_user_namespaces = 0)"
    if code != 0:
        return REFUSED, (
            f"the kernel refuses them ({errno.errorcode.get(code, code)}: a sysctl such as"
            " kernel.unprivileged_userns_clone = 0, or a container runtime's seccomp profile)"
        )
    try:
        namespaces.enter_child()
    except OSError as exc:
        return REFUSED, f"one is made but its ids cannot be mapped ({exc.strerror})"
    if _libc.try_unshare(_libc.CLONE_NEWNS) != 0:
        # Ubuntu 24.04: made, ids mapped, and no capability in it (AppArmor).
        return REFUSED, (
            "one is made, but holds no capability (Ubuntu's"
            " kernel.apparmor_restrict_unprivileged_userns = 1, or an AppArmor profile)"
        )
    return ENTERED, ""


def _child_probes(*, user_namespaces: bool = True) -> dict[str, Any]:
    """Run in a disposable child: each probe changes this process for good."""
    found: dict[str, Any] = {}
    # First, while /etc/shadow is as a worker without a mount namespace would find it.
    found["secrets_left_out"] = _secrets_layer_probe()
    found["pid_namespaces"] = _libc.try_unshare(_libc.CLONE_NEWPID) == 0
    found["user_namespaces"], found["user_namespaces_why"] = DIRECT, ""
    if not found["pid_namespaces"]:
        if os.geteuid() == 0:  # workers.containment.probe_user_namespaces says why
            found["user_namespaces"] = ROOT
        elif not user_namespaces:
            found["user_namespaces"] = OFF
        else:
            found["user_namespaces"], found["user_namespaces_why"] = _enter_user_namespace()
        if found["user_namespaces"] == ENTERED:
            found["pid_namespaces"] = _libc.try_unshare(_libc.CLONE_NEWPID) == 0
    mount_ns = _libc.try_unshare(_libc.CLONE_NEWNS) == 0
    # The recursive slave mount is the step the worker cannot do without (see sandbox.py).
    try:
        if mount_ns:
            _libc.mount("none", "/", None, _libc.MS_REC | _libc.MS_SLAVE, None)
        found["mount_namespaces"] = mount_ns
    except OSError:
        found["mount_namespaces"] = False
    found["network_namespaces"] = _libc.try_unshare(_libc.CLONE_NEWNET) == 0
    found["ipc_namespaces"] = _libc.try_unshare(_libc.CLONE_NEWIPC) == 0
    if found["mount_namespaces"]:
        found.update(_mount_probes())
    found["no_new_privs"] = _libc.try_prctl(_libc.PR_SET_NO_NEW_PRIVS, 1) == 0
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            last_cap = int(f.read())
        lockdown.lock_out_root(last_cap)
        lockdown.drop_all_capabilities()
        # What a command would hold: no capability, none it could gain (the bounding set), and
        # for uid 0 the securebits that keep exec from granting them back.
        found["root_locked_out"] = (
            not any(_libc.capget())
            and lockdown.bounding_set(last_cap) == 0
            and (os.geteuid() != 0 or _libc.prctl_get(_libc.PR_GET_SECUREBITS) != 0)
        )
    except OSError:
        found["root_locked_out"] = False
    found["seccomp"] = found["seccomp_sockets"] = found["seccomp_ipc"] = False
    if seccomp.supported() and found["no_new_privs"]:
        seccomp.install(offline=True, shared_ipc=True)
        # keyctl(KEYCTL_GET_KEYRING_ID, KEY_SPEC_USER_KEYRING): the filter must refuse it.
        found["seccomp"] = _libc.try_syscall(seccomp.number("keyctl"), 0, -4, 0) == errno.EPERM
        vsock = _libc.try_syscall(seccomp.number("socket"), seccomp.AF_VSOCK, 1, 0)
        uevent = _libc.try_syscall(seccomp.number("socket"), seccomp.AF_NETLINK, 2, 15)
        found["seccomp_sockets"] = vsock == uevent == errno.EPERM
        # shmget(IPC_PRIVATE, 4096, IPC_CREAT | 0600): refused before it reaches the kernel.
        ipc = _libc.try_syscall(seccomp.number("shmget"), 0, 4096, 0o1600)
        found["seccomp_ipc"] = ipc == errno.EPERM
    found["landlock_enforced"] = False
    if landlock.abi_version() > 0 and found["no_new_privs"]:
        ruleset = landlock.Ruleset(handled_fs=landlock.READ_FILE)
        ruleset.restrict_self()
        try:
            with open("/etc/passwd", "rb"):
                pass
        except PermissionError:
            found["landlock_enforced"] = True
    return found


def _secrets_layer_probe() -> bool | None:
    """Whether the secrets layer (workers.rules.SecretsLayer) keeps /etc/shadow from a root
    that reads it without the layer, and leaves /etc/passwd readable. In a child, since a
    Landlock domain is for good; None where nothing can read it anyway (not root)."""
    if os.geteuid() != 0 or landlock.abi_version() == 0 or not os.path.exists("/etc/shadow"):
        return None
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        answer = b"0"
        try:
            _libc.prctl(_libc.PR_SET_NO_NEW_PRIVS, 1)
            with open("/etc/shadow", "rb"):
                pass  # readable without the layer: root
            rules.SecretsLayer.build(rules.secret_tree(lockdown.masks())).ruleset.restrict_self()
            with open("/etc/passwd", "rb"):
                pass
            try:
                with open("/etc/shadow", "rb"):
                    pass
            except PermissionError:
                answer = b"1"
        except OSError:
            pass
        os.write(write_end, answer)
        os._exit(0)
    os.close(write_end)
    try:
        return os.read(read_end, 1) == b"1"
    finally:
        os.close(read_end)
        os.waitpid(pid, 0)


def _secrets_check(child: dict[str, Any]) -> Check:
    """How root's secrets are kept from the calls: a mount, a Landlock layer, file modes."""
    masked, left_out = bool(child.get("secrets_masked")), bool(child.get("secrets_left_out"))
    secrets = "/etc/shadow, gshadow, sudoers, ssh host keys, block devices"
    mount = f"bash: an empty, mode-0 mount over each of {secrets} (its mount namespace)"
    layer = (
        f"a Landlock layer grants reading every file but {secrets} (verified: /etc/shadow"
        " refused, /etc/passwd read)"
    )
    if os.geteuid() != 0:
        detail = "the pool is not root: file modes keep /etc/shadow, sudoers, host keys from it"
    elif masked:
        tools = layer if left_out else "their path checks only (no Landlock)"
        detail = f"{mount}; the file tools, which have none: {tools}"
    else:
        detail = f"no mount namespace to mask them in: for bash and the file tools, {layer}"
    return Check(
        "root's secrets unreadable",
        os.geteuid() != 0 or masked or left_out,
        detail,
        "a command running as root reads /etc/shadow (it owns it): no mount namespace to mask"
        " it in, no Landlock to leave it out",
    )


def _mount_probes() -> dict[str, bool]:
    """In the probe child's own mount namespace: what bash's worker mounts (sandbox.py)."""
    found: dict[str, bool] = {}
    scratch = tempfile.mkdtemp(prefix="sandbx-doctor-")
    try:
        lockdown.mask_secrets(scratch)
        # Masked where we could read it (root owns it; a user namespace's worker is not root
        # and masks only what its user can open).
        found["secrets_masked"] = (
            not os.path.exists("/etc/shadow")
            or not os.access("/etc/shadow", os.R_OK)
            or (os.stat("/etc/shadow").st_size == 0 and os.stat("/etc/shadow").st_mode & 0o777 == 0)
        )
    except OSError:
        found["secrets_masked"] = False
    try:
        _libc.mount("sandbx-tmp", scratch, "tmpfs", _libc.MS_NOSUID, "size=1m")
        _libc.set_read_only(scratch, recursive=True)
        found["private_tmpdir"] = found["read_only_binds"] = True
    except OSError:
        found["private_tmpdir"] = found["read_only_binds"] = False
    with contextlib.suppress(OSError):
        _libc.umount(scratch, _libc.MNT_DETACH)
    # grep's rg walks by path: it runs only on a bind of the workspace that follows no
    # symlink (workers.sandbox._follow_no_symlinks), made and checked here the same way.
    try:
        _libc.mount(scratch, scratch, None, _libc.MS_BIND | _libc.MS_REC, None)
        _libc.set_no_symlinks(scratch)
        found["symlinks_refused"] = symlinks_refused(scratch)
    except OSError:
        found["symlinks_refused"] = False
    with contextlib.suppress(OSError):
        _libc.umount(scratch, _libc.MNT_DETACH)
    found["overlay"] = _overlay_probe(scratch)
    os.rmdir(scratch)
    return found


def _overlay_probe(scratch: str) -> bool:
    """Whether a tracked or transactional call's overlay mounts here, with its options
    (workers.overlay), on a temporary directory's filesystem."""
    layers = [os.path.join(scratch, name) for name in ("lower", "upper", "work")]
    for layer in layers:
        os.mkdir(layer)
    lower, upper, work = layers
    options = f"lowerdir={lower},upperdir={upper},workdir={work},{overlay.OPTIONS}"
    try:
        _libc.mount("sandbx-changes", lower, "overlay", 0, options)
        mounted = True
    except OSError:
        mounted = False
    with contextlib.suppress(OSError):
        _libc.umount(lower, _libc.MNT_DETACH)
    for layer in reversed(layers):
        with contextlib.suppress(OSError):
            for name in os.listdir(layer):  # the work dir's own "work"
                os.rmdir(os.path.join(layer, name))
            os.rmdir(layer)
    return mounted


def _run_child_probes(*, user_namespaces: bool = True) -> dict[str, Any]:
    # An interpreter of this installation only (sandbx_pool.interpreter says why): the probes
    # below run as root, and must not import what the current directory holds.
    flags = [] if user_namespaces else ["--no-user-namespaces"]
    done = subprocess.run(
        python_command("sandbx_pool.cli.doctor", "--child-probes", *flags),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=CHILD_CWD,
    )
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1:] or ["probe failed"]}
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def _pidfd() -> bool:
    try:
        os.close(os.pidfd_open(os.getpid()))
    except (AttributeError, OSError):
        return False
    return True


def _cgroup2() -> tuple[str | None, bool]:
    """Our cgroup v2 directory, and whether we may make child groups in it."""
    mount = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split(" - ")
            if len(fields) == 2 and fields[1].split()[0] == "cgroup2":
                mount = fields[0].split()[4]
    if mount is None:
        return None, False
    own = "/"
    with open("/proc/self/cgroup") as f:
        for line in f:
            if line.startswith("0::"):
                own = line[3:].strip()
    path = os.path.join(mount, own.lstrip("/"))
    try:
        probe = tempfile.mkdtemp(prefix="sandbx-doctor-", dir=path)
    except OSError:
        return path, False
    with contextlib.suppress(OSError):
        os.rmdir(probe)
    return path, True


def _fuse() -> tuple[bool, str]:
    try:
        os.close(os.open("/dev/fuse", os.O_RDWR))
    except OSError as exc:
        return False, f"/dev/fuse: {exc.strerror}"
    missing = [
        what
        for what, present in (
            ("fusermount3", shutil.which("fusermount3") is not None),
            ("libfuse3", ctypes.util.find_library("fuse3") is not None),
        )
        if not present
    ]
    if missing:
        return False, f"/dev/fuse opens, but no {' and no '.join(missing)} (Debian: fuse3)"
    return True, "/dev/fuse, fusermount3 and libfuse3 present"


def _peer_pid() -> bool:
    """Whether ZeroMQ reports a worker connection's pid (the pool's check on Ready messages),
    the connection made as a worker makes it (workers.zmtp)."""
    import zmq

    from sandbx_pool.inbox import peer_pid
    from sandbx_pool.workers.zmtp import connect

    directory = tempfile.mkdtemp(prefix="sandbx-doctor-")
    context = zmq.Context()
    dealer = None
    try:
        router = context.socket(zmq.ROUTER)
        router.bind(f"ipc://{directory}/s")
        dealer = connect(f"ipc://{directory}/s", b"doctor", max_message_bytes=1024, timeout_s=5)
        dealer.handshake(timeout_s=5)
        dealer.send(b"x", timeout_s=5)
        if not router.poll(5000):
            return False
        frames = router.recv_multipart(copy=False)
        return peer_pid(frames[-1]) == os.getpid()
    except OSError:
        return False
    finally:
        if dealer is not None:
            dealer.close()
        context.destroy(linger=0)
        shutil.rmtree(directory, ignore_errors=True)


def rg_check(rg: str | None, version: str, symlinks_refused: bool) -> Check:
    """Whether grep runs ``rg`` (the binary found, its ``--version`` line) or its Python walk.

    find never runs rg: it lists directories, symlinks and FIFOs, which ``rg --files`` does not
    (workers/tools/find.py), so it walks in Python everywhere."""
    python = "grep walks the tree in Python (issue 12 measured 9x to 22x rg's time)"
    if rg is None:
        fallback = f"no rg next to this interpreter nor on PATH: {python}"
    elif not symlinks_refused:
        fallback = (
            f"{rg} ({version}) found, but no workspace bind that follows no symlink (needs "
            f"mount namespaces: root or user namespaces; Linux 5.10): {python}"
        )
    else:
        fallback = ""
    return Check(
        "grep runs rg",
        rg is not None and symlinks_refused,
        f"{rg} ({version}), confined as bash is, on a workspace bind that follows no symlink;"
        " a pattern rg refuses (look-around) takes the Python walk. find walks in Python: it"
        " lists what rg --files does not (directories, symlinks, FIFOs)",
        fallback,
    )


def _rg_version(rg: str | None) -> str:
    if rg is None:
        return ""
    try:
        done = subprocess.run(
            [rg, "--no-config", "--version"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return f"does not run: {exc}"
    lines = done.stdout.splitlines()
    return lines[0] if done.returncode == 0 and lines else f"--version failed ({done.returncode})"


def _process_limit_check(
    pids: cgroups.PidsHierarchy | None, pids_why: list[str], user_namespace: bool
) -> Check:
    """How ``[limits] processes`` binds a call here: a pids cgroup per worker, else RLIMIT_NPROC
    in each worker's own user namespace (Linux 5.14 counts it per namespace), else not at all."""
    nproc = user_namespace and containment.nproc_counts_per_user_namespace()
    if pids is not None:
        detail = (
            "[limits] processes binds every call, root's too: a pids cgroup per worker in"
            f" {pids.base} (cgroup v{pids.version})"
        )
    else:
        detail = (
            "[limits] processes binds every call: RLIMIT_NPROC in each worker's own user"
            " namespace, where the kernel counts that call's tasks alone (no pids cgroup:"
            f" {'; '.join(pids_why)}); a call's outcome does not name the limit then"
        )
    v2 = (
        "on cgroup v2 a pool needs the parent of its own cgroup writable with pids enabled (root,"
        " or a systemd unit with Delegate=pids whose processes run in a child group of it)"
    )
    return Check(
        "per-call process limit",
        pids is not None or nproc,
        detail,
        f"[limits] processes is not enforced ({'; '.join(pids_why)}; {v2}); a fork bomb fails "
        "only the calls that find no pid for their worker, the pool keeps serving",
    )


def user_namespaces_check(found: str, why: str) -> Check:
    """Whether workers are made in user namespaces of their own (``_child_probes``' finding)."""
    uid, gid = os.geteuid(), os.getegid()
    if found == DIRECT:
        return Check(
            "user namespaces",
            True,
            "not needed: the pool holds CAP_SYS_ADMIN and makes the namespaces below itself",
            "",
        )
    without = "without CAP_SYS_ADMIN, no PID, mount, IPC or network namespace: the fallbacks below"
    if found == OFF:
        why = "[sandbox] user_namespaces = false"
    elif found == ROOT:
        why = (
            "not made for root (a container's): run_as and bash's user need uids besides the"
            " one a user namespace of its own could map"
        )
    return Check(
        "user namespaces",
        found == ENTERED,
        f"each worker is made in one of its own, mapping only uid {uid} and gid {gid} to"
        " themselves (files keep their owner): the PID, mount, IPC and network namespaces"
        " below are made in it, without root; a call cannot make one (seccomp)",
        f"{why or 'not made'}: {without}",
    )


def diagnose(*, user_namespaces: bool = True) -> list[Check]:
    """The checks, as a pool of ``[sandbox] user_namespaces`` would meet them here."""
    python = f"{sys.implementation.name} {sys.version.split()[0]}"
    child = _run_child_probes(user_namespaces=user_namespaces)
    abi = landlock.abi_version()
    cgroup, cgroup_writable = _cgroup2()
    fuse_ok, fuse_detail = _fuse()
    pids_why: list[str] = []
    pids = cgroups.find_pids_hierarchy(pids_why)
    # The PATH a call gets by default is this one, scrubbed of nothing rg cares about.
    rg = find_rg({"PATH": os.environ.get("PATH", "")})
    return [
        Check(
            f"Landlock filesystem rules (ABI {abi})",
            bool(child.get("landlock_enforced")),
            "each call reads and writes only its workspace and TMPDIR (verified: a read "
            "outside the rules was refused)",
            "no kernel filesystem confinement: only the file tools' path checks; bash reaches "
            "whatever the worker's user can",
        ),
        Check(
            "Landlock network rules (ABI 4)",
            landlock.has_net_rules(abi),
            "network = false: TCP connect and bind fail with EACCES (Permission denied)",
            "network = false relies on a network namespace alone, else calls are refused",
        ),
        Check(
            "Landlock scoping (ABI 6)",
            landlock.has_scoping(abi),
            "a call can signal, and reach by abstract unix socket, only its own processes",
            "signals to outside processes are stopped by the PID namespace alone",
        ),
        user_namespaces_check(
            str(child.get("user_namespaces", REFUSED)), str(child.get("user_namespaces_why", ""))
        ),
        Check(
            "PID namespaces",
            bool(child.get("pid_namespaces")),
            "each worker is pid 1 of its own namespace: host pids are out of a call's reach",
            "subreaper containment (the template sweeps orphans); a call can signal host pids",
        ),
        Check(
            "mount namespaces",
            bool(child.get("mount_namespaces")),
            "a private /proc per call (no coordinator environ) and the socket dir hidden",
            "calls see every process in /proc, and can reach the coordinator's socket (which "
            "drops what is not from the worker it chose)",
        ),
        Check(
            "overlayfs (tracked, transactional changes)",
            bool(child.get("overlay")),
            "a tracked or transactional call runs on an overlay of the workspace: its change"
            " set is exact, a transactional one lands only if it ends ok",
            'changes = "tracked" and "transactional" are refused (each such call ends as'
            " error, never run direct); direct mode works",
        ),
        Check(
            "network namespaces",
            bool(child.get("network_namespaces")),
            "network = false also cuts UDP and raw traffic (ENETUNREACH)",
            "network = false blocks TCP only (Landlock), UDP still goes out",
        ),
        Check(
            "no_new_privs",
            bool(child.get("no_new_privs")),
            "nothing a call execs gains privileges (setuid binaries, file capabilities)",
            "Landlock cannot be used either",
        ),
        Check(
            "no root power",
            bool(child.get("root_locked_out")),
            "commands run with no capability (CapEff, CapPrm, CapBnd empty; securebits locked):"
            " no raw sockets, chown, DAC override, uid change",
            "commands keep the worker's capabilities"
            if os.geteuid() == 0
            else "commands hold no capability (CapEff, CapPrm empty: not root), but the bounding"
            " set stays full (no CAP_SETPCAP to empty it); no_new_privs keeps file capabilities"
            " from granting any",
        ),
        Check(
            "seccomp filter",
            bool(child.get("seccomp")) and bool(child.get("seccomp_sockets")),
            "no io_uring, ptrace, keyrings, user namespaces, set-uid files; no AF_PACKET,"
            " AF_VSOCK or uevent netlink socket, and with network = false no family but"
            " AF_UNIX, AF_INET, AF_INET6 and netlink route: EPERM (workers/seccomp.py)",
            "not x86_64/aarch64 or no seccomp: those system calls and sockets stay open",
        ),
        Check(
            "IPC namespaces",
            bool(child.get("ipc_namespaces")),
            "each bash call has SysV shared memory, semaphores and queues of its own",
            "SysV IPC and POSIX queue calls fail with EPERM (seccomp): the host's objects stay"
            " out of reach, and a program that needs SysV shared memory fails"
            if child.get("seccomp_ipc")
            else "calls share the host's SysV IPC objects",
        ),
        _secrets_check(child),
        Check(
            "private TMPDIR",
            bool(child.get("private_tmpdir")),
            "each bash call's TMPDIR is a tmpfs of its own ([sandbox] tmp_size_mb), invisible to"
            " other calls",
            "a 0700 directory on the pool's scratch disk, unbounded",
        ),
        Check(
            "protected paths",
            bool(child.get("read_only_binds")),
            "[sandbox] protected: write/edit denied, read-only in bash (mount_setattr); what"
            " bash makes of one that does not exist yet is set aside after the call",
            "write/edit denied; what bash makes, changes or removes of them is undone after"
            " each call (a snapshot taken before it)",
        ),
        Check(
            "installed code only",
            True,
            "the template and probes run python -I from this installation "
            f"({PACKAGE_PARENT}), never the caller's directory",
            "",
        ),
        Check(
            "root",
            os.geteuid() == 0,
            "[sandbox] run_as can drop calls to another user",
            "[sandbox] run_as is unavailable; calls run as this user",
        ),
        Check(
            "ZeroMQ peer credentials",
            _peer_pid(),
            "a Ready is accepted only from the pid the template forked for its token",
            "a Ready is matched on its token alone (results still need the call's secret)",
        ),
        Check(
            "pidfd",
            _pidfd(),
            "worker exits are observed through pidfds",
            "worker exits are learnt from the template's SIGCHLD reports only",
        ),
        Check(
            "cgroup v2 (writable)",
            cgroup_writable,
            f"child groups can be made in {cgroup}",
            f"{cgroup or 'no cgroup2 mount'}: not writable; limits use setrlimit only",
        ),
        _process_limit_check(pids, pids_why, child.get("user_namespaces") == ENTERED),
        Check(
            "immortal template",
            immortal.supported(),
            f"{python}: workers fork from a template whose objects are immortal, and copy"
            " fewer of its pages (workers/immortal.py)",
            f"{python}: workers copy every template page their reference counts touch"
            " (CPython 3.12 or 3.13 makes them cheaper)",
        ),
        rg_check(rg, _rg_version(rg), bool(child.get("symlinks_refused"))),
        Check(
            "FUSE (for the tests)",
            fuse_ok,
            fuse_detail,
            f"{fuse_detail}: the hung-filesystem tests skip (and fail under CI=true)",
        ),
    ]


def report(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = ["sandbx-pool doctor: what confines each call on this machine", ""]
    for check in checks:
        mark, text = ("yes", check.detail) if check.ok else ("no ", f"-> {check.fallback}")
        lines.append(f"  {mark}  {check.name:<{width}}  {text}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    user_namespaces = True
    if args.config is not None:
        from sandbx_pool.config import load_config

        user_namespaces = load_config(args.config).sandbox.user_namespaces
    checks = diagnose(user_namespaces=user_namespaces)
    if args.json:
        print(json.dumps(msgspec.to_builtins(checks), indent=2))
    else:
        print(report(checks))
    return 0


if __name__ == "__main__" and sys.argv[1:2] == ["--child-probes"]:
    print(json.dumps(_child_probes(user_namespaces="--no-user-namespaces" not in sys.argv)))
