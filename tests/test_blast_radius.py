"""What one call can reach past itself, attacked as a hostile model would, through a Pool.

Each attack is a bash command (or a file tool call) against a pool with the default config,
and each protection is checked from the host's side: the command's /proc/PID/status, the stat
of what it left, a SysV segment or a key this test made. Those about root's power need a root
pool; the others run wherever doctor reports their protection (``needs``): as root, or as a
user where user namespaces are allowed.

* planted code: the template and doctor's probe run this installation's code, never what the
  caller's directory (or PYTHONPATH) holds;
* root power: a command holds no capability (CapEff, CapPrm, CapAmb are 0), so no packet
  socket, no chown to another uid, no reading another uid's 0600 file, no uid change, no
  /etc/shadow;
* planted for later: no set-uid/set-gid file, no file capabilities;
* kernel objects: a private IPC namespace, no host keyrings, no nested user namespace, no
  io_uring, no ptrace;
* the call's TMPDIR: private to it, bounded in size.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import shlex
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import MakePool, marked_config
from helpers import bash_value as bash
from helpers import pids_with, unique_tag, wait_until

from sandbx_pool import Pool, Status

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the attacks need a pool run as root")

#: Everything a planted module does when imported: leave a mark where the test looks.
_PLANT = "import os; open(os.environ.get('PLANT_MARK', '/nonexistent/x'), 'w').write('ran')\n"


@pytest.fixture
async def pool(make_pool: MakePool) -> Pool:
    return await make_pool(journal=None, pool={"workers": 4})


# -- planted code -------------------------------------------------------------------------------


def _plant(directory: Path) -> None:
    """What a call could have written in a workspace that is also some caller's directory."""
    for package in ("sandbx_pool", "sandbx_pool/workers", "workers", "msgspec", "zmq"):
        (directory / package).mkdir(parents=True, exist_ok=True)
        (directory / package / "__init__.py").write_text(_PLANT)
    (directory / "sandbx_pool" / "workers" / "template.py").write_text(_PLANT)
    (directory / "workers" / "template.py").write_text(_PLANT)
    for module in ("sitecustomize.py", "usercustomize.py"):
        (directory / module).write_text(_PLANT)


_COORDINATOR = """
import asyncio, json, sys
sys.path.insert(0, sys.argv[3])  # the caller imports the real package (its own business)
from sandbx_pool import Pool, Config

async def main() -> None:
    config = Config().override(env={"set": json.loads(sys.argv[2])})
    async with Pool(sys.argv[1], config=config) as pool:
        outcome = await pool.call("read", {"path": "a.txt"}, timeout=30)
        print(outcome.status)

asyncio.run(main())
"""


def test_template_runs_the_installed_code_only(tmp_path: Path) -> None:
    planted = tmp_path / "planted"
    _plant(planted)
    (planted / "a.txt").write_text("hello")
    mark = tmp_path / "mark"
    script = tmp_path / "coordinator.py"
    script.write_text(_COORDINATOR)
    import sandbx_pool

    real = str(Path(sandbx_pool.__file__).resolve().parent.parent)
    env = {**os.environ, "PLANT_MARK": str(mark)}
    marker = {k: v for k, v in os.environ.items() if k.startswith("SANDBX_TEST")}
    done = subprocess.run(
        [sys.executable, str(script), str(planted), json.dumps(marker), real],
        cwd=planted,  # the caller's directory is the workspace, full of planted code
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok", done.stdout + done.stderr
    assert not mark.exists(), "a planted module ran"


def test_doctor_probes_run_the_installed_code_only(tmp_path: Path) -> None:
    _plant(tmp_path)
    mark = tmp_path / "mark"
    # The installed command: its sys.path starts with its own directory, not the cwd.
    command = Path(sys.executable).parent / "sandbx-pool"
    done = subprocess.run(
        [str(command), "doctor"],
        cwd=tmp_path,  # doctor's probe child used to import from here, as root
        env={**os.environ, "PLANT_MARK": str(mark)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode in (0, 1), done.stderr
    assert "probe failed" not in done.stdout
    assert not mark.exists(), "a planted module ran"


# -- root power ----------------------------------------------------------------------------------

#: System call numbers the attacks make directly (x86_64, aarch64).
_NR = {
    "x86_64": {"keyctl": 250, "io_uring_setup": 425, "ptrace": 101},
    "aarch64": {"keyctl": 219, "io_uring_setup": 425, "ptrace": 117},
}
NR = _NR.get(os.uname().machine, {})
needs_known_arch = pytest.mark.skipif(not NR, reason="syscall numbers known for x86_64, aarch64")


def python(code: str) -> str:
    """A bash command running ``code`` with this test's interpreter (readable by every call)."""
    return f"{sys.executable} -c {shlex.quote(textwrap.dedent(code))}"


def status_fields(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as f:
        return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)


@pytest.mark.needs("no root power")
async def test_a_command_holds_no_capability_seen_from_the_host(pool: Pool) -> None:
    tag = unique_tag()
    call = asyncio.ensure_future(pool.call("bash", {"command": f"exec -a {tag} sleep 60"}))
    try:
        await wait_until(lambda: len(pids_with(tag)) == 1)
        (pid,) = pids_with(tag)
        fields = status_fields(pid)
        # Still the pool's uid (0 as root): the workspace stays its own.
        assert int(fields["Uid"].split()[0]) == os.geteuid()
        for name in ("CapEff", "CapPrm", "CapAmb", "CapInh", "CapBnd"):
            assert int(fields[name], 16) == 0, f"{name} = {fields[name]}"
    finally:
        call.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await call


@needs_root
async def test_root_power_is_refused(pool: Pool, workspace: Path) -> None:
    other = workspace / "others.txt"
    other.write_text("another user's secret")
    os.chown(other, 1000, 1000)
    other.chmod(0o600)
    attacks = {
        "packet socket": python("import socket; socket.socket(socket.AF_PACKET, socket.SOCK_RAW)"),
        "chown": "touch mine && chown 1000 mine",
        "another uid's 0600 file": "cat others.txt",
        "uid change": python("import os; os.setuid(1000)"),
        "shadow": "cat /etc/shadow",
        "core_pattern": "echo '|/bin/sh' > /proc/sys/kernel/core_pattern",
    }
    for what, command in attacks.items():
        value = await bash(pool, command)
        assert value["exit_code"] != 0, f"{what}: {value}"
        assert "another user's secret" not in value["stdout"]
        assert "root:" not in value["stdout"], f"{what} read /etc/shadow"
    assert (workspace / "mine").stat().st_uid == 0


# -- planted for later ---------------------------------------------------------------------------


@pytest.mark.needs("seccomp filter")
async def test_no_setuid_file_or_file_capability_is_left_behind(
    pool: Pool, workspace: Path
) -> None:
    attempts = [
        "cp /bin/sh a; chmod u+s a",
        "cp /bin/sh b; chmod g+s b",
        "cp /bin/sh c; chmod 6755 c",
        "install -m 4755 /bin/sh d",
        python("import os; os.close(os.open('e', os.O_CREAT | os.O_WRONLY, 0o4755))"),
        python("import os; os.mknod('f', 0o104755)"),
        "mkdir -m 2775 g",
        python(
            """
            import os
            open('h', 'w').close()
            # a v2 security.capability granting cap_setuid: what setcap writes
            value = bytes.fromhex('0000000280000000000000000000000000000000')
            os.setxattr('h', 'security.capability', value)
            """
        ),
    ]
    for command in attempts:
        await pool.call("bash", {"command": command}, timeout=30)
    for path in await asyncio.to_thread(lambda: list(workspace.rglob("*"))):
        mode = path.lstat().st_mode
        # Set-id as the pool's user (root, or the user a pool without root runs as).
        assert not (mode & (stat.S_ISUID | stat.S_ISGID) and path.lstat().st_uid == os.geteuid()), (
            f"{path.name} is set-id: {oct(mode)}"
        )
        assert "security.capability" not in os.listxattr(path, follow_symlinks=False), path.name


# -- kernel objects ------------------------------------------------------------------------------


@pytest.mark.needs("seccomp filter")
@needs_known_arch
async def test_kernel_objects_beyond_the_call_are_out_of_reach(pool: Pool) -> None:
    syscall = "import ctypes, os; libc = ctypes.CDLL(None, use_errno=True)\n"
    attacks = {
        # KEYCTL_GET_KEYRING_ID of KEY_SPEC_USER_KEYRING: uid 0's keyring is the host's.
        "keyring": f"r = libc.syscall({NR['keyctl']}, 0, -4, 0)",
        "io_uring": f"r = libc.syscall({NR['io_uring_setup']}, 8, ctypes.c_buffer(128))",
        # PTRACE_ATTACH to the worker, our parent: another capless uid-0 process.
        "ptrace": f"r = libc.syscall({NR['ptrace']}, 16, os.getppid(), 0, 0)",
        "user namespace": "r = libc.unshare(0x10000000)",  # CLONE_NEWUSER
    }
    for what, code in attacks.items():
        script = syscall + code + "\nprint('refused' if r < 0 else 'allowed', ctypes.get_errno())"
        value = await bash(pool, python(script))
        assert value["stdout"].startswith("refused") or value["exit_code"] != 0, (what, value)
        assert "allowed" not in value["stdout"], what


@pytest.mark.needs("IPC namespaces")
async def test_sysv_shared_memory_of_the_host_is_out_of_reach(pool: Pool) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    key = 0x5BC0_0000 + os.getpid() % 0xFFFF
    shmid = libc.shmget(key, 4096, 0o1000 | 0o600)  # IPC_CREAT, as the pool's user would
    assert shmid >= 0, os.strerror(ctypes.get_errno())
    try:
        code = f"import ctypes; print(ctypes.CDLL(None).shmget({key}, 0, 0))"
        value = await bash(pool, python(code))
        assert value["stdout"].strip() == "-1", value  # no such segment in the call's namespace
    finally:
        libc.shmctl(shmid, 0, None)  # IPC_RMID


# -- the call's TMPDIR ---------------------------------------------------------------------------


@pytest.mark.needs("private TMPDIR")
async def test_tmpdirs_are_private_and_bounded(workspace: Path) -> None:
    config = marked_config(pool={"workers": 4}, sandbox={"tmp_size_mb": 8})
    async with Pool(workspace, config=config) as pool:
        tag = unique_tag()
        holder = asyncio.ensure_future(
            pool.call("bash", {"command": f"echo mine > $TMPDIR/{tag}; exec -a {tag} sleep 60"})
        )
        try:
            await wait_until(lambda: len(pids_with(tag)) == 1)
            snooper = await bash(pool, f"find $TMPDIR/.. 2>/dev/null | grep -c {tag} || true")
            assert snooper["stdout"].strip() == "0", snooper
            wiper = await bash(pool, "rm -rf $TMPDIR/../* 2>/dev/null; echo done")
            assert wiper["stdout"].strip() == "done"
            filler = await bash(pool, "head -c 20000000 /dev/zero > $TMPDIR/big; echo rc=$?")
            assert "rc=1" in filler["stdout"], filler  # No space left on device, at 8 MiB
        finally:
            holder.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await holder
        # The holder's file was never touched: it sees its own TMPDIR as it left it.
        again = await bash(pool, "ls $TMPDIR | wc -l")
        assert again["stdout"].strip() == "0"  # and a new call starts with an empty one


# -- protected paths -----------------------------------------------------------------------------


def _git_init(workspace: Path) -> None:
    subprocess.run(["git", "init", "-q", "."], cwd=workspace, check=True)


@pytest.mark.needs("protected paths")
async def test_bash_cannot_change_protected_paths_and_git_still_works(
    pool: Pool, workspace: Path
) -> None:
    git = "git -c user.email=t@example.com -c user.name=t"
    # The user's repository: one a call makes keeps no config or hooks (tests/test_attacks.py).
    _git_init(workspace)
    await bash(pool, f"echo one > a && {git} add a && {git} commit -qm one")
    config = (workspace / ".git" / "config").read_bytes()
    hooks = sorted(os.listdir(workspace / ".git" / "hooks"))
    attacks = [
        "printf '#!/bin/sh\\ntouch /tmp/pwned\\n' > .git/hooks/pre-commit",
        "chmod +x .git/hooks/pre-commit.sample && mv .git/hooks/pre-commit.sample"
        " .git/hooks/pre-commit",
        "git config core.hooksPath /tmp",
        "echo '[core]\\n\\tfsmonitor = touch /tmp/pwned' >> .git/config",
        "rm -f .git/config",
        "mv .git/hooks .git/old-hooks",
        "rm -rf .git/hooks",
    ]
    for command in attacks:
        value = await bash(pool, f"{command}; echo rc=$?")
        if "rc=0" in value["stdout"]:
            # No mount namespace here (root without CAP_SYS_ADMIN, as in a container): the
            # command went through, and is undone once it is over.
            assert value.get("protected_set_aside"), (command, value)
        elif command.startswith("mv .git/hooks"):
            assert not (workspace / ".git" / "old-hooks").exists()
    assert (workspace / ".git" / "config").read_bytes() == config
    assert not (workspace / ".git" / "hooks" / "pre-commit").exists()
    assert sorted(os.listdir(workspace / ".git" / "hooks")) == hooks
    # What git needs for its work is not protected: the next commit goes through.
    value = await bash(pool, f"echo two > a && {git} commit -qam two && git log --oneline | wc -l")
    assert value["stdout"].strip() == "2", value


async def test_protected_paths_can_be_turned_off(workspace: Path) -> None:
    config = marked_config(pool={"workers": 2}, sandbox={"protected": []})
    async with Pool(workspace, config=config) as pool:
        await bash(pool, "git init -q . && echo '# mine' > .git/hooks/pre-commit")
    assert (workspace / ".git" / "hooks" / "pre-commit").read_text() == "# mine\n"


@needs_root
async def test_a_command_run_as_another_user_holds_nothing_either(pool: Pool) -> None:
    command = "grep -E '^(Uid|Cap(Eff|Prm|Bnd|Amb)):' /proc/self/status"
    outcome = await pool.call("bash", {"command": command, "user": "nobody"}, timeout=30)
    assert outcome.status is Status.OK, outcome
    value = outcome.value or {}
    fields = dict(line.split(":\t") for line in value["stdout"].splitlines())
    assert fields.pop("Uid").split()[0] != "0"
    assert all(int(v, 16) == 0 for v in fields.values()), fields
