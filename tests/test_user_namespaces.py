"""A pool without CAP_SYS_ADMIN, where the kernel allows user namespaces: each worker is made in
one of its own (workers.containment.UserNamespaces), and what a root pool's worker has in its
mount namespace holds for it too.

* the user namespace: one per call, mapping only the pool's uid and gid to themselves, so what
  a call writes keeps its owner; a call cannot make another;
* what it gives: a private /proc, network = false cutting UDP, SysV IPC of the call's own, a
  TMPDIR on a tmpfs, grep running rg, no capability left to bash (CapBnd included);
* the fallbacks: ``[sandbox] user_namespaces = false``, and a kernel that refuses them, which a
  user namespace whose user.max_user_namespaces is 0 makes real for its processes.

Each protection is marked with the doctor's check it needs (``needs``): it is skipped, with the
doctor's reason, where that is absent, and runs as root too, where it must hold as well. The
tests about the user namespace itself skip as root: root makes the namespaces directly.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from conftest import MakePool, marked_config
from helpers import bash_value as bash
from helpers import wait_until

from sandbx_pool import Limits, Pool, Status
from sandbx_pool.cli.main import main as cli_main
from sandbx_pool.workers import libc

PY = sys.executable
_CAP_SYS_ADMIN = 21

#: Root as a host gives it: the template makes each worker's namespaces itself.
direct = bool(libc.capget()[0] >> _CAP_SYS_ADMIN & 1)
without_root_power = pytest.mark.skipif(
    direct, reason="CAP_SYS_ADMIN: the namespaces are made directly, in no user namespace"
)


@pytest.fixture
async def pool(make_pool: MakePool) -> Pool:
    return await make_pool(pool={"workers": 2})


# -- the user namespace -------------------------------------------------------------------------


@without_root_power
@pytest.mark.needs("user namespaces")
async def test_each_call_gets_a_user_namespace_mapping_only_the_pools_ids(
    pool: Pool, workspace: Path
) -> None:
    assert pool.fleet.template is not None
    assert pool.fleet.template.user_namespaces, "the template made no user namespace"
    assert pool.fleet.template.containment == "pidns"
    uid, gid = os.geteuid(), os.getegid()
    # Two calls at once: a namespace's number can be reused once it is gone.
    first = asyncio.create_task(
        pool.call(
            "bash",
            {"command": "readlink /proc/self/ns/user > ns; while [ ! -e go ]; do sleep 0.01; done"},
            timeout=30,
        )
    )
    await wait_until(lambda: (workspace / "ns").exists() and (workspace / "ns").stat().st_size > 0)
    value = await bash(
        pool, "cat /proc/self/uid_map /proc/self/gid_map; readlink /proc/self/ns/user"
    )
    (workspace / "go").touch()
    assert (await first).status is Status.OK
    uid_map, gid_map, namespace = value["stdout"].splitlines()
    assert uid_map.split() == [str(uid), str(uid), "1"], value
    assert gid_map.split() == [str(gid), str(gid), "1"], value
    assert namespace != os.readlink("/proc/self/ns/user")  # not the host's
    assert namespace != (workspace / "ns").read_text().strip()  # nor the other call's


async def test_what_a_call_writes_keeps_the_pools_owner(pool: Pool, workspace: Path) -> None:
    await bash(pool, "touch made && mkdir dir && echo x > dir/inside && ln -s made link")
    written = await pool.call("write", {"path": "written", "content": "x"})
    assert written.status is Status.OK, written
    edited = await pool.call("edit", {"path": "written", "old_string": "x", "new_string": "y"})
    assert edited.status is Status.OK, edited
    for name in ("made", "dir", "dir/inside", "link", "written"):
        info = os.lstat(workspace / name)
        assert (info.st_uid, info.st_gid) == (os.geteuid(), os.getegid()), name


@pytest.mark.needs("seccomp filter")
async def test_a_call_cannot_make_a_user_namespace(pool: Pool) -> None:
    value = await bash(
        pool,
        "unshare -U true; echo rc=$?; unshare -Ur true; echo rc=$?;"
        f" {PY} -c 'import ctypes; l = ctypes.CDLL(None, use_errno=True);"
        f" print(l.unshare({libc.CLONE_NEWUSER}), ctypes.get_errno())'",
    )
    assert value["stdout"].splitlines() == ["rc=1", "rc=1", "-1 1"], value  # EPERM
    assert value["stderr"].count("Operation not permitted") == 2, value


# -- what it gives ------------------------------------------------------------------------------


@pytest.mark.needs("PID namespaces", "mount namespaces")
async def test_bash_sees_a_proc_of_its_own_processes(pool: Pool) -> None:
    value = await bash(pool, "echo $$; ls /proc | grep -E '^[0-9]+$'")
    shell, *pids = value["stdout"].split()
    assert "1" in pids  # its worker, pid 1 of the call's namespace
    assert str(os.getpid()) not in pids
    assert all(int(pid) < 100 for pid in pids), pids  # nothing of the host's
    assert int(shell) < 100


@pytest.mark.needs("network namespaces")
async def test_network_off_cuts_udp_too(workspace: Path, tmp_path: Path) -> None:
    send = "import socket; socket.socket(type=socket.SOCK_DGRAM).sendto(b'x', ('127.0.0.1', 9))"
    config = marked_config(sandbox={"network": False})
    async with Pool(workspace, journal=tmp_path / "j.jsonl", config=config) as pool:
        value = await bash(pool, f'{PY} -c "{send}"')
    assert "OSError: [Errno 101] Network is unreachable" in value["stderr"], value


def host_segments() -> list[str]:
    """The words of the host's SysV shared memory table (keys in decimal among them)."""
    with open("/proc/sysvipc/shm") as f:
        return f.read().split()


@pytest.mark.needs("IPC namespaces")
async def test_sysv_ipc_is_the_calls_own(pool: Pool) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    key = 0x5BC1_0000 + os.getpid() % 0xFFFF
    shmid = libc.shmget(key, 4096, 0o1000 | 0o600)  # IPC_CREAT: the host's, this user's
    assert shmid >= 0, os.strerror(ctypes.get_errno())
    try:
        assert str(key) in host_segments()  # the control: the host lists it
        value = await bash(pool, "ipcs -m; ipcs -q; ipcs -s; cat /proc/sysvipc/shm")
        assert f"{key:#010x}" not in value["stdout"], value
        assert str(key) not in value["stdout"].split(), value
        assert not [line for line in value["stdout"].splitlines() if line.startswith("0x")]
    finally:
        libc.shmctl(shmid, 0, None)  # IPC_RMID


@pytest.mark.needs("private TMPDIR")
async def test_the_tmpdir_is_a_tmpfs_of_the_calls_own(pool: Pool) -> None:
    value = await bash(pool, 'stat -f -c %T "$TMPDIR"; findmnt -n -o FSTYPE,OPTIONS -T "$TMPDIR"')
    kind, mount = value["stdout"].splitlines()
    assert kind == "tmpfs", value
    assert "size=524288k" in mount, value  # [sandbox] tmp_size_mb, 512 by default


@pytest.mark.needs("grep runs rg")
async def test_grep_runs_rg(pool: Pool) -> None:
    outcome = await pool.call("grep", {"pattern": "world"})
    assert outcome.status is Status.OK, outcome
    assert outcome.value is not None
    assert outcome.value["engine"] == "rg", outcome.value
    assert [(m["path"], m["line"]) for m in outcome.value["matches"]] == [("hello.txt", 2)]


@pytest.mark.needs("no root power")
async def test_bash_holds_no_capability_even_in_its_namespace(pool: Pool) -> None:
    value = await bash(pool, "grep -E '^Cap(Inh|Prm|Eff|Bnd|Amb):' /proc/self/status")
    fields = dict(line.split(":\t") for line in value["stdout"].splitlines())
    assert len(fields) == 5, value
    assert all(int(v, 16) == 0 for v in fields.values()), fields


@pytest.mark.needs("per-call process limit")
async def test_the_process_limit_binds_the_call(pool: Pool) -> None:
    forker = (
        "import os, sys, time\nstarted = 0\nfor _ in range(100):\n    try:\n"
        "        pid = os.fork()\n    except BlockingIOError:\n        break\n"
        "    if pid == 0:\n        time.sleep(30)\n        os._exit(0)\n    started += 1\n"
        "print(started)\n"
    )
    outcome = await pool.call(
        "bash", {"command": f"{PY} -c '{forker}'"}, limits=Limits(processes=20), timeout=60
    )
    assert outcome.status is Status.OK, outcome
    assert outcome.value is not None
    assert 10 <= int(outcome.value["stdout"]) < 20, outcome.value
    assert pool.fleet.template is not None
    if pool.fleet.template.pids_cgroup is not None:
        assert outcome.limit == "processes"  # RLIMIT_NPROC leaves no record of a refused fork


async def test_doctor_says_what_the_template_does(
    pool: Pool, capsys: pytest.CaptureFixture[str]
) -> None:
    assert await asyncio.to_thread(cli_main, ["doctor", "--json"]) == 0
    checks = {c["name"]: c["ok"] for c in msgspec.json.decode(capsys.readouterr().out)}
    assert pool.fleet.template is not None
    assert checks["PID namespaces"] is (pool.fleet.template.containment == "pidns")
    assert checks["user namespaces"] is (direct or pool.fleet.template.user_namespaces)
    assert pool.fleet.template.user_namespaces is (not direct and checks["user namespaces"])


# -- the fallbacks ------------------------------------------------------------------------------


async def test_user_namespaces_can_be_turned_off(
    workspace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``[sandbox] user_namespaces = false``: without CAP_SYS_ADMIN, today's fallback (no
    namespace), and doctor says why; a root pool makes its namespaces as before."""
    path = tmp_path / "off.toml"
    path.write_text("[sandbox]\nuser_namespaces = false\n")
    config = marked_config(pool={"workers": 1}, sandbox={"user_namespaces": False})
    async with Pool(workspace, journal=tmp_path / "j.jsonl", config=config) as pool:
        assert pool.fleet.template is not None
        assert pool.fleet.template.user_namespaces is False
        assert pool.fleet.template.containment == ("pidns" if direct else "subreaper")
        listing = (await bash(pool, "ls /proc"))["stdout"].split()
        assert (str(os.getpid()) in listing) is not direct  # the host's /proc, without
    assert await asyncio.to_thread(cli_main, ["doctor", "--json", "--config", str(path)]) == 0
    checks = {c["name"]: c for c in msgspec.json.decode(capsys.readouterr().out)}
    assert checks["user namespaces"]["ok"] is direct
    assert checks["PID namespaces"]["ok"] is direct
    if not direct and os.geteuid() != 0:  # root without CAP_SYS_ADMIN never makes them
        assert "[sandbox] user_namespaces = false" in checks["user namespaces"]["fallback"]


#: Runs its arguments in a user namespace of its own where the kernel then refuses any further
#: one (user.max_user_namespaces = 0 there: such limits are per namespace), as a process that
#: is not root in it, and holds no capability once it execs: what a pool meets where the kernel
#: refuses them to its user. Root's ids are mapped to 1000 there, any other to itself.
_REFUSING = r"""
import ctypes, os, sys
libc = ctypes.CDLL(None, use_errno=True)
uid, gid = os.geteuid(), os.getegid()
if libc.unshare(0x10000000) != 0:  # CLONE_NEWUSER
    sys.exit(77)
def write(path, data):
    with open(path, "w") as f:
        f.write(data)
write("/proc/self/setgroups", "deny")
write("/proc/self/uid_map", f"{uid or 1000} {uid} 1")
write("/proc/self/gid_map", f"{gid or 1000} {gid} 1")
write("/proc/sys/user/max_user_namespaces", "0")
os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
"""

#: What runs there: doctor's finding, then a pool's containment and what bash sees of /proc.
_PROBE = r"""
import asyncio, json, os, sys
from sandbx_pool import Config, Pool
from sandbx_pool.cli.doctor import diagnose

checks = {c.name: [c.ok, c.fallback] for c in diagnose()}

async def main() -> None:
    config = Config().override(pool={"workers": 1}, env={"set": json.loads(sys.argv[2])})
    async with Pool(sys.argv[1], config=config) as pool:
        outcome = await pool.call("bash", {"command": "ls /proc"}, timeout=30)
        print(json.dumps({
            "checks": checks,
            "containment": pool.fleet.template.containment,
            "user_namespaces": pool.fleet.template.user_namespaces,
            "host_proc": str(os.getpid()) in outcome.value["stdout"].split(),
        }))

asyncio.run(main())
"""


def test_where_the_kernel_refuses_user_namespaces_the_pool_falls_back_and_says_why(
    workspace: Path,
) -> None:
    marker = {k: v for k, v in os.environ.items() if k.startswith("SANDBX_TEST")}
    done = subprocess.run(
        [PY, "-c", _REFUSING, "-c", _PROBE, str(workspace), json.dumps(marker)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if done.returncode == 77:
        pytest.skip("this process may not make a user namespace: the suite runs as N already")
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.splitlines()[-1])
    ok, fallback = found["checks"]["user namespaces"]
    assert ok is False
    assert "user.max_user_namespaces = 0" in fallback, fallback
    assert found["checks"]["PID namespaces"][0] is False
    assert found["checks"]["mount namespaces"][0] is False
    assert (found["containment"], found["user_namespaces"]) == ("subreaper", False)
    assert found["host_proc"] is True  # the fallback: the host's /proc
