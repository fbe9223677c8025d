"""``sandbx-pool doctor``'s probes of what a worker gets: run in a throwaway child process.

The namespace, Landlock, seccomp and mount probes change the process that makes them, so
doctor (sandbx_pool.cli.doctor) runs them in a child of this installation's interpreter
(``run_child_probes``), which answers with one JSON object: what each step allowed. Without
CAP_SYS_ADMIN the child first enters a user namespace mapped as a worker's is
(workers.containment.UserNamespaces), unless told ``--no-user-namespaces``, so that what it
reports is what a worker of such a pool gets.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

from sandbx_pool.interpreter import CHILD_CWD, python_command
from sandbx_pool.workers import (
    containment,
    landlock,
    libc,
    lockdown,
    overlay,
    rules,
    seccomp,
)
from sandbx_pool.workers.rg_binary import symlinks_refused

#: What ``_child_probes`` reports as "user_namespaces": not needed (CAP_SYS_ADMIN), entered,
#: refused by the kernel, turned off by the config, or not for root (a container's).
DIRECT, ENTERED, REFUSED, OFF, ROOT = "direct", "entered", "refused", "off", "root"


def _enter_user_namespace() -> tuple[str, str]:
    """Enter a user namespace as a worker's is made, and map our ids; REFUSED and why if not."""
    namespaces = containment.UserNamespaces()
    code = libc.try_unshare(libc.CLONE_NEWUSER)
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
    if libc.try_unshare(libc.CLONE_NEWNS) != 0:
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
    found["pid_namespaces"] = libc.try_unshare(libc.CLONE_NEWPID) == 0
    found["user_namespaces"], found["user_namespaces_why"] = DIRECT, ""
    if not found["pid_namespaces"]:
        if os.geteuid() == 0:  # workers.containment.probe_user_namespaces says why
            found["user_namespaces"] = ROOT
        elif not user_namespaces:
            found["user_namespaces"] = OFF
        else:
            found["user_namespaces"], found["user_namespaces_why"] = _enter_user_namespace()
        if found["user_namespaces"] == ENTERED:
            found["pid_namespaces"] = libc.try_unshare(libc.CLONE_NEWPID) == 0
    mount_ns = libc.try_unshare(libc.CLONE_NEWNS) == 0
    # The recursive slave mount is the step the worker cannot do without (see sandbox.py).
    try:
        if mount_ns:
            libc.mount("none", "/", None, libc.MS_REC | libc.MS_SLAVE, None)
        found["mount_namespaces"] = mount_ns
    except OSError:
        found["mount_namespaces"] = False
    found["network_namespaces"] = libc.try_unshare(libc.CLONE_NEWNET) == 0
    found["ipc_namespaces"] = libc.try_unshare(libc.CLONE_NEWIPC) == 0
    if found["mount_namespaces"]:
        found.update(_mount_probes())
    found["no_new_privs"] = libc.try_prctl(libc.PR_SET_NO_NEW_PRIVS, 1) == 0
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            last_cap = int(f.read())
        lockdown.lock_out_root(last_cap)
        lockdown.drop_all_capabilities()
        # What a command would hold: no capability, none it could gain (the bounding set), and
        # for uid 0 the securebits that keep exec from granting them back.
        found["root_locked_out"] = (
            not any(libc.capget())
            and lockdown.bounding_set(last_cap) == 0
            and (os.geteuid() != 0 or libc.prctl_get(libc.PR_GET_SECUREBITS) != 0)
        )
    except OSError:
        found["root_locked_out"] = False
    found["seccomp"] = found["seccomp_sockets"] = found["seccomp_ipc"] = False
    if seccomp.supported() and found["no_new_privs"]:
        seccomp.install(offline=True, shared_ipc=True)
        # keyctl(KEYCTL_GET_KEYRING_ID, KEY_SPEC_USER_KEYRING): the filter must refuse it.
        found["seccomp"] = libc.try_syscall(seccomp.number("keyctl"), 0, -4, 0) == errno.EPERM
        vsock = libc.try_syscall(seccomp.number("socket"), seccomp.AF_VSOCK, 1, 0)
        uevent = libc.try_syscall(seccomp.number("socket"), seccomp.AF_NETLINK, 2, 15)
        found["seccomp_sockets"] = vsock == uevent == errno.EPERM
        # shmget(IPC_PRIVATE, 4096, IPC_CREAT | 0600): refused before it reaches the kernel.
        ipc = libc.try_syscall(seccomp.number("shmget"), 0, 4096, 0o1600)
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
            libc.prctl(libc.PR_SET_NO_NEW_PRIVS, 1)
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
        libc.mount("sandbx-tmp", scratch, "tmpfs", libc.MS_NOSUID, "size=1m")
        libc.set_read_only(scratch, recursive=True)
        found["private_tmpdir"] = found["read_only_binds"] = True
    except OSError:
        found["private_tmpdir"] = found["read_only_binds"] = False
    with contextlib.suppress(OSError):
        libc.umount(scratch, libc.MNT_DETACH)
    # grep's rg walks by path: it runs only on a bind of the workspace that follows no
    # symlink (workers.sandbox._follow_no_symlinks), made and checked here the same way.
    try:
        libc.mount(scratch, scratch, None, libc.MS_BIND | libc.MS_REC, None)
        libc.set_no_symlinks(scratch)
        found["symlinks_refused"] = symlinks_refused(scratch)
    except OSError:
        found["symlinks_refused"] = False
    with contextlib.suppress(OSError):
        libc.umount(scratch, libc.MNT_DETACH)
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
        libc.mount("sandbx-changes", lower, "overlay", 0, options)
        mounted = True
    except OSError:
        mounted = False
    with contextlib.suppress(OSError):
        libc.umount(lower, libc.MNT_DETACH)
    for layer in reversed(layers):
        with contextlib.suppress(OSError):
            for name in os.listdir(layer):  # the work dir's own "work"
                os.rmdir(os.path.join(layer, name))
            os.rmdir(layer)
    return mounted


def run_child_probes(*, user_namespaces: bool = True) -> dict[str, Any]:
    # An interpreter of this installation only (sandbx_pool.interpreter says why): the probes
    # below run as root, and must not import what the current directory holds.
    flags = [] if user_namespaces else ["--no-user-namespaces"]
    done = subprocess.run(
        python_command("sandbx_pool.cli.doctor_probes", "--child-probes", *flags),
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


if __name__ == "__main__" and sys.argv[1:2] == ["--child-probes"]:
    print(json.dumps(_child_probes(user_namespaces="--no-user-namespaces" not in sys.argv)))
