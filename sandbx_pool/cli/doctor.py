"""``sandbx-pool doctor``: which protections each call gets on this machine, and the fallbacks.

Every line is a probe, not a guess from the kernel version: the namespace and Landlock probes
run in a throwaway child process (they change the process that makes them: doctor_probes),
the rest here.

    doctor --> doctor_probes, in a child --> [user namespace] the secrets layer, unshare(PID,
           <-- JSON: what each step allowed    mount, network), prctl, seccomp, Landlock, overlay
    doctor --> pidfd, cgroup v2 (mkdir + rmdir of a child group), FUSE, ZeroMQ peer pid,
               the rg binary grep runs (rg --version)
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes.util
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any

import msgspec

from sandbx_pool.cli.doctor_probes import DIRECT, ENTERED, OFF, REFUSED, ROOT, run_child_probes
from sandbx_pool.config import ImageSettings
from sandbx_pool.interpreter import PACKAGE_PARENT
from sandbx_pool.timeline.browser import find_chromium
from sandbx_pool.workers import (
    cgroups,
    containment,
    immortal,
    landlock,
    memory_cgroup,
)
from sandbx_pool.workers.rg_binary import find_rg


class Check(msgspec.Struct, frozen=True):
    name: str
    ok: bool
    detail: str  # what holds when ok
    fallback: str  # what happens instead when not


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


def memory_checks(pids: cgroups.PidsHierarchy | None) -> list[Check]:
    """How ``[limits] memory_mb`` (Limits.memory_bytes) binds a call here, and where
    ``outcome.usage`` comes from (workers.memory_cgroup, workers.usage)."""
    where, version, why = memory_cgroup.probe(pids)
    limit = Check(
        "per-call memory limit",
        where is not None,
        f"[limits] memory_mb binds each call's whole process tree: a memory cgroup per worker in"
        f" {where} (cgroup v{version}); the kernel's OOM kill ends the call crashed, limit"
        ' "memory"',
        f"[limits] memory_mb is RLIMIT_DATA in each process ({why}): it bounds each process"
        " alone, a command may raise it, and an allocation past it fails instead of a kill",
    )
    usage = Check(
        "per-call usage (outcome.usage)",
        version == 2,
        "source cgroup: each worker's cgroup's cpu.stat, memory.peak and io.stat (the tree's"
        " peak at once)",
        "source rusage: the accounts of the worker and every process it reaped (peak memory"
        " is the largest process's)",
    )
    return [limit, usage]


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


def images_check(overlay_mounts: bool, store: str) -> Check:
    """Whether images run here: skopeo to pull, a store we can write (with user xattrs, for
    opaque directories), and an overlay with ``userxattr`` for a layer over an image."""
    missing = []
    if shutil.which("skopeo") is None:
        missing.append("no skopeo to pull with (Debian: skopeo)")
    where = store
    while not os.path.isdir(where) and os.path.dirname(where) != where:
        where = os.path.dirname(where)
    try:
        with tempfile.NamedTemporaryFile(dir=where, prefix=".sandbx-doctor-") as probe:
            os.setxattr(probe.name, "user.overlay.opaque", b"y")
    except OSError as exc:
        missing.append(f"the store {store} is not writable with user xattrs ({exc.strerror})")
    if not overlay_mounts:
        missing.append("no overlay mounts here (with userxattr): no layer over an image")
    return Check(
        "container images",
        not missing,
        f"skopeo pulls into {store}; a layer over an image mounts its layers as an overlay",
        "; ".join(missing),
    )


def diagnose(*, user_namespaces: bool = True, image_store: str | None = None) -> list[Check]:
    """The checks, as a pool of ``[sandbox] user_namespaces`` would meet them here."""
    python = f"{sys.implementation.name} {sys.version.split()[0]}"
    child = run_child_probes(user_namespaces=user_namespaces)
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
            "overlayfs layers (pool.layer)",
            bool(child.get("overlay")),
            "pool.layer(name, base=DIR) makes copy-on-write workspaces: each call in a layer"
            " mounts an overlay of DIR (read only) in its own mount namespace",
            "pool.layer raises LayerUnavailable naming why (no mount namespace per call, or"
            " no overlay mounts); the Inspect provider's base= and batch lines' base fail so",
        ),
        Check(
            "network namespaces",
            bool(child.get("network_namespaces")),
            "network = false also cuts UDP and raw traffic (ENETUNREACH)",
            "network = false blocks TCP only (Landlock), UDP still goes out",
        ),
        Check(
            "network allow-list",
            bool(child.get("network_namespaces")) and bool(child.get("mount_namespaces")),
            "network = [hosts]: each call gets a network namespace with loopback only, its one"
            " way out the pool's proxy, which lets through the listed names and nothing else",
            "network = [hosts] is refused (each such call ends as error, never run online): it"
            " needs network and mount namespaces; network = true or false work",
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
        *memory_checks(pids),
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
        images_check(bool(child.get("overlay")), image_store or ImageSettings().store_dir()),
        _chromium_check(),
        _otel_check(),
    ]


def _chromium_check() -> Check:
    browser = find_chromium()
    return Check(
        "headless Chromium (timeline --png)",
        browser is not None,
        f"{browser}: journal timeline --png renders the page to a PNG",
        "not on PATH: journal timeline --png exits 2 (the HTML page needs no browser; Debian:"
        " chromium); the timeline's browser tests skip (and fail under CI=true)",
    )


def _otel_check() -> Check:
    # find_spec, not import: the SDK and its exporter are heavy, and doctor only asks.
    try:
        missing = [
            name
            for name in ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http")
            if importlib.util.find_spec(name) is None
        ]
    except ImportError:  # a parent package missing
        missing = ["opentelemetry"]
    return Check(
        "OpenTelemetry (otel extra)",
        not missing,
        "[telemetry] otlp_endpoint can send a span per call over OTLP/HTTP",
        f"no {', '.join(missing)}: a pool with [telemetry] otlp_endpoint set refuses to start"
        " (pip install 'sandbx-pool[otel]'); unset, nothing needs it",
    )


def report(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = ["sandbx-pool doctor: what confines each call on this machine", ""]
    for check in checks:
        mark, text = ("yes", check.detail) if check.ok else ("no ", f"-> {check.fallback}")
        lines.append(f"  {mark}  {check.name:<{width}}  {text}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    user_namespaces, image_store = True, None
    if args.config is not None:
        from sandbx_pool.config import load_config

        config = load_config(args.config)
        user_namespaces = config.sandbox.user_namespaces
        image_store = config.images.store_dir()
    checks = diagnose(user_namespaces=user_namespaces, image_store=image_store)
    if args.json:
        print(json.dumps(msgspec.to_builtins(checks), indent=2))
    else:
        print(report(checks))
    return 0
