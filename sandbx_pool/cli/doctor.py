"""``sandbx-pool doctor``: which protections each call gets on this machine, and the fallbacks.

Every line is a probe, not a guess from the kernel version: the namespace and Landlock probes
run in a throwaway child process (they change the process that makes them), the rest here.

    doctor --> python -c _probe_child() --> unshare(PID, mount, network), prctl, Landlock
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
from sandbx_pool.workers import _libc, cgroups, immortal, landlock, lockdown, overlay, seccomp
from sandbx_pool.workers.rg_binary import find_rg, symlinks_refused


class Check(msgspec.Struct, frozen=True):
    name: str
    ok: bool
    detail: str  # what holds when ok
    fallback: str  # what happens instead when not


def _child_probes() -> dict[str, Any]:
    """Run in a disposable child: each probe changes this process for good."""
    found: dict[str, Any] = {}
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
            lockdown.lock_out_root(int(f.read()))
        lockdown.drop_all_capabilities()
        found["root_locked_out"] = os.geteuid() != 0 or (
            _libc.prctl_get(_libc.PR_GET_SECUREBITS) != 0 and not any(_libc.capget())
        )
    except OSError:
        found["root_locked_out"] = False
    found["seccomp"] = False
    if seccomp.supported() and found["no_new_privs"]:
        seccomp.install()
        # keyctl(KEYCTL_GET_KEYRING_ID, KEY_SPEC_USER_KEYRING): the filter must refuse it.
        found["seccomp"] = _libc.try_syscall(seccomp.number("keyctl"), 0, -4, 0) == errno.EPERM
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


def _mount_probes() -> dict[str, bool]:
    """In the probe child's own mount namespace: what bash's worker mounts (sandbox.py)."""
    found: dict[str, bool] = {}
    scratch = tempfile.mkdtemp(prefix="sandbx-doctor-")
    try:
        lockdown.mask_secrets(scratch)
        found["secrets_masked"] = not os.path.exists("/etc/shadow") or (
            os.stat("/etc/shadow").st_size == 0 and os.stat("/etc/shadow").st_mode & 0o777 == 0
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


def _run_child_probes() -> dict[str, Any]:
    # An interpreter of this installation only (sandbx_pool.interpreter says why): the probes
    # below run as root, and must not import what the current directory holds.
    done = subprocess.run(
        python_command("sandbx_pool.cli.doctor", "--child-probes"),
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
            f"root, mount namespaces, Linux 5.10): {python}"
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


def diagnose() -> list[Check]:
    python = f"{sys.implementation.name} {sys.version.split()[0]}"
    child = _run_child_probes()
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
            "commands keep the worker's capabilities",
        ),
        Check(
            "seccomp filter",
            bool(child.get("seccomp")),
            "no io_uring, ptrace, keyrings, user namespaces, packet sockets, set-uid files"
            " (workers/seccomp.py)",
            "not x86_64/aarch64 or no seccomp: those system calls stay open",
        ),
        Check(
            "IPC namespaces",
            bool(child.get("ipc_namespaces")),
            "each bash call has SysV shared memory, semaphores and queues of its own",
            "calls share the host's SysV IPC objects",
        ),
        Check(
            "root's secrets masked",
            bool(child.get("secrets_masked")),
            "/etc/shadow, sudoers, ssh host keys, block devices read as empty in bash's mounts",
            "a command running as root reads /etc/shadow (it owns it)",
        ),
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
            "[sandbox] protected: write/edit denied, read-only in bash (mount_setattr)",
            "write/edit denied; bash can still change them",
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
        Check(
            "per-call process limit (pids cgroup)",
            pids is not None,
            "[limits] processes binds every call, root's too: a pids cgroup per worker"
            + (f" in {pids.base} (cgroup v{pids.version})" if pids is not None else ""),
            f"[limits] processes is not enforced ({'; '.join(pids_why)}); a fork bomb fails "
            "only the calls that find no pid for their worker, the pool keeps serving",
        ),
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
    checks = diagnose()
    if args.json:
        print(json.dumps(msgspec.to_builtins(checks), indent=2))
    else:
        print(report(checks))
    return 0


if __name__ == "__main__" and sys.argv[1:] == ["--child-probes"]:
    print(json.dumps(_child_probes()))
