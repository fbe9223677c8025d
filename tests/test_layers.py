"""Layers: copy-on-write workspaces over a base, on a real pool with real overlays (each call
in a layer mounts one in its own mount namespace: a root pool, or a user namespace per worker
where the kernel allows them; doctor's check decides)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import marked_config
from helpers import journal_records, marked_pool_toml, wait_until

from sandbx_pool import Config, Layer, Pool, Status

pytestmark = pytest.mark.needs("overlayfs layers (pool.layer)")


def _config(tmp_path: Path, **sections: dict[str, object]) -> Config:
    return marked_config(
        pool={"workers": 4}, workspace={"layers": str(tmp_path / "layers")}, **sections
    )


def _base(tmp_path: Path) -> Path:
    base = tmp_path / "base"
    (base / "src").mkdir(parents=True)
    (base / "README").write_text("read me\n")
    (base / "src" / "a.py").write_text("print('a')\n")
    (base / "src" / "b.py").write_text("print('b')\n")
    (base / "ro").write_text("ro\n")
    os.chmod(base / "ro", 0o444)
    os.symlink("README", base / "link")
    return base


def _snapshot(root: Path) -> dict[str, tuple[Any, ...]]:
    """Every path under ``root`` with its type, mode, owner, content hash or target, inode."""
    found: dict[str, tuple[Any, ...]] = {}
    for directory, dirs, files in os.walk(root):
        for name in [*dirs, *files]:
            path = os.path.join(directory, name)
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode):
                what: object = hashlib.sha256(Path(path).read_bytes()).hexdigest()
            elif stat.S_ISLNK(st.st_mode):
                what = os.readlink(path)
            else:
                what = None
            rel = os.path.relpath(path, root)
            found[rel] = (st.st_mode, st.st_uid, st.st_gid, st.st_ino, st.st_mtime_ns, what)
    top = os.lstat(root)
    found["."] = (top.st_mode, top.st_uid, top.st_gid, top.st_ino, top.st_mtime_ns, None)
    return found


async def _bash(pool: Pool, ws: Layer | str, command: str) -> dict[str, Any]:
    outcome = await pool.call("bash", {"command": command}, workspace=ws)
    assert outcome.status is Status.OK, (outcome.error, outcome.value)
    assert outcome.value is not None
    return outcome.value


async def _read(pool: Pool, ws: Layer | str, path: str) -> str | None:
    outcome = await pool.call("read", {"path": path}, workspace=ws)
    if outcome.status is not Status.OK:
        return None
    assert outcome.value is not None
    return str(outcome.value["content"])


async def test_a_layer_sees_its_base_and_keeps_every_change_apart(tmp_path: Path) -> None:
    base = _base(tmp_path)
    before = _snapshot(base)
    async with Pool(base, config=_config(tmp_path)) as pool:
        ws = await pool.layer("one", base=base)
        assert await _read(pool, ws, "src/a.py") == "print('a')\n"
        write = await pool.call("write", {"path": "new.txt", "content": "new\n"}, workspace=ws)
        edit = await pool.call(
            "edit", {"path": "README", "old_string": "read", "new_string": "READ"}, workspace=ws
        )
        assert (write.status, edit.status) == (Status.OK, Status.OK)
        await _bash(
            pool,
            ws,
            "rm src/b.py && mv src/a.py src/c.py && chmod 600 ro && chmod 700 src"
            " && rm link && ln -s new.txt link && mkdir -p d/e && echo x > d/e/f",
        )
        seen = await _bash(pool, ws.path, "cat README; ls src; stat -c %a ro; readlink link")
        assert seen["stdout"] == "READ me\nc.py\n600\nnew.txt\n"
        changes = {c["path"]: (c["kind"], c["type"]) for c in await ws.diff()}
        assert changes == {
            "README": ("modified", "file"),
            "d": ("created", "dir"),
            "d/e": ("created", "dir"),
            "d/e/f": ("created", "file"),
            "link": ("modified", "symlink"),
            "new.txt": ("created", "file"),
            "ro": ("modified", "file"),
            "src": ("modified", "dir"),
            "src/a.py": ("deleted", "file"),
            "src/b.py": ("deleted", "file"),
            "src/c.py": ("created", "file"),
        }
        # The same dicts as an outcome's changes.
        one = next(c for c in await ws.diff() if c["path"] == "new.txt")
        assert one == {
            "path": "new.txt",
            "kind": "created",
            "type": "file",
            "size": 4,
            "applied": False,
        }
        # A plain call in the base still sees the base.
        assert (await pool.call("read", {"path": "README"})).value["content"] == "read me\n"  # type: ignore[index]
    assert _snapshot(base) == before


async def test_two_layers_over_one_base_are_independent_and_fork_copies(tmp_path: Path) -> None:
    base = _base(tmp_path)
    async with Pool(base, config=_config(tmp_path)) as pool:
        a = await pool.layer("a", base=base)
        b = await pool.layer("b", base=base)
        await _bash(pool, a, "echo A > README; rm src/a.py")
        await _bash(pool, b, "echo B > README")
        assert await _read(pool, a, "README") == "A\n"
        assert await _read(pool, b, "README") == "B\n"
        assert await _read(pool, b, "src/a.py") == "print('a')\n"
        fork = await a.fork("a2")
        assert await _read(pool, fork, "README") == "A\n"
        assert await _read(pool, fork, "src/a.py") is None  # the whiteout was copied
        await _bash(pool, fork, "echo F > README")
        assert await _read(pool, a, "README") == "A\n"
        await a.reset()
        assert await a.diff() == []
        assert await _read(pool, a, "README") == "read me\n"
        assert await _read(pool, fork, "README") == "F\n"
        await fork.remove()
        assert not (tmp_path / "layers" / "a2").exists()
        with pytest.raises(ValueError, match="removed"):
            await fork.diff()
        with pytest.raises(ValueError, match="not a layer this pool has open"):
            await pool.call("ls", {}, workspace=fork)
    assert (base / "README").read_text() == "read me\n"


async def test_layers_outlive_the_pool_and_keep_their_base(tmp_path: Path) -> None:
    base = _base(tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    journal = tmp_path / "j.jsonl"
    async with Pool(base, config=_config(tmp_path)) as pool:
        ws = await pool.layer("kept", base=base)
        await _bash(pool, ws, "echo kept > kept.txt")
        path = ws.path
    async with Pool(tmp_path, config=_config(tmp_path), journal=journal) as pool:
        # By name, by path (a batch line's or Ray's workspace), and with its own base.
        reopened = await pool.layer("kept")
        assert reopened.path == path
        assert await _read(pool, path, "kept.txt") == "kept\n"
        assert await pool.layer("kept", base=base) is reopened
        with pytest.raises(ValueError, match=r"not .*other"):
            await pool.layer("kept", base=other)
        with pytest.raises(ValueError, match="no layer 'never'"):
            await pool.layer("never")
        with pytest.raises(ValueError, match=r"tracked.*a layer keeps its changes apart"):
            await pool.call("ls", {}, workspace=reopened, changes="tracked")
    intents = [r for r in journal_records(journal) if r["kind"] == "intent"]
    assert intents
    assert all(r["layer"] == "kept" for r in intents)
    assert all(r["workspace"] == path for r in intents)


async def test_what_a_killed_pool_left_in_the_store_goes_and_a_live_ones_stays(
    tmp_path: Path,
) -> None:
    from sandbx_pool.runtime_dir import owner_tag

    base = _base(tmp_path)
    store = tmp_path / "layers"
    dead = [store / ".new-999999999-5-aa", store / ".trash-999999999-5-bb"]
    live = [store / f".new-{owner_tag()}-cc", store / f".trash-{owner_tag()}-dd"]
    for path in [*dead, *live]:
        (path / "upper" / "deep").mkdir(parents=True)
        (path / "upper" / "deep" / "f").write_text("x")
        os.chmod(path / "upper" / "deep", 0)
    async with Pool(base, config=_config(tmp_path)) as pool:
        await pool.layer("fresh", base=base)
    assert sorted(os.listdir(store)) == sorted(["fresh", *(p.name for p in live)])


async def test_a_layer_is_open_in_one_pool_at_a_time(tmp_path: Path) -> None:
    base = _base(tmp_path)
    async with Pool(base, config=_config(tmp_path)) as first:
        await first.layer("solo", base=base)
        async with Pool(base, config=_config(tmp_path)) as second:
            with pytest.raises(ValueError, match="'solo' is open in another pool"):
                await second.layer("solo")
    async with Pool(base, config=_config(tmp_path)) as third:
        await third.layer("solo")


@pytest.mark.parametrize(
    "name", ["", ".", "..", "a/b", "/abs", "x\x00y", "n" * 129, ".hidden", "tab\tname", 7]
)
async def test_a_name_that_is_not_plain_is_refused(tmp_path: Path, name: Any) -> None:
    base = _base(tmp_path)
    async with Pool(base, config=_config(tmp_path)) as pool:
        with pytest.raises(ValueError, match="plain name"):
            await pool.layer(name, base=base)
        layer = await pool.layer("ok", base=base)
        with pytest.raises(ValueError, match="plain name"):
            await layer.fork(name)
    assert os.listdir(tmp_path / "layers") == ["ok"]


async def test_a_bad_base_or_a_taken_fork_name_is_refused_and_nothing_made(
    tmp_path: Path,
) -> None:
    base = _base(tmp_path)
    store = tmp_path / "layers"
    async with Pool(base, config=_config(tmp_path)) as pool:
        with pytest.raises(ValueError, match="not a directory"):
            await pool.layer("f", base=base / "README")
        with pytest.raises(ValueError, match="not a directory"):
            await pool.layer("g", base=tmp_path / "missing")
        with pytest.raises(ValueError, match="inside the layer store"):
            await pool.layer("h", base=tmp_path)  # holds the store
        store.mkdir(exist_ok=True)
        (store / "inner").mkdir()
        with pytest.raises(ValueError, match="inside the layer store"):
            await pool.layer("i", base=store / "inner")
        os.symlink(store, tmp_path / "to-store")
        with pytest.raises(ValueError, match="inside the layer store"):
            await pool.layer("j", base=tmp_path / "to-store")  # resolved by the worker
        (store / "inner").rmdir()
        a = await pool.layer("a", base=base)
        await pool.layer("b", base=base)
        with pytest.raises(ValueError, match="'b'"):
            await a.fork("b")
        with pytest.raises(ValueError, match="only a layer's root"):
            await pool.call("ls", {}, workspace=str(store / "a" / "upper"))
    assert sorted(os.listdir(store)) == ["a", "b"]


async def test_parallel_calls_in_one_layer_all_land(tmp_path: Path) -> None:
    base = _base(tmp_path)
    async with Pool(base, config=_config(tmp_path)) as pool:
        ws = await pool.layer("busy", base=base)
        commands = [f"echo {i} >> shared; echo {i} > own-{i}" for i in range(12)]
        outcomes = await asyncio.gather(
            *(pool.call("bash", {"command": c}, workspace=ws) for c in commands),
            *(
                pool.call("write", {"path": f"w-{i}", "content": str(i)}, workspace=ws)
                for i in range(6)
            ),
        )
        assert all(o.status is Status.OK for o in outcomes), [o.error for o in outcomes]
        shared = await _read(pool, ws, "shared")
        assert shared is not None
        assert sorted(shared.split()) == sorted(str(i) for i in range(12))
        paths = {c["path"] for c in await ws.diff()}
        assert paths == {"shared", *(f"own-{i}" for i in range(12)), *(f"w-{i}" for i in range(6))}


async def test_a_cancelled_call_waiting_for_its_turn_takes_none(tmp_path: Path) -> None:
    base = _base(tmp_path)
    fifo = tmp_path / "sync" / "go"
    fifo.parent.mkdir()
    os.mkfifo(fifo)
    config = _config(tmp_path, sandbox={"writable": [str(fifo.parent)]})
    async with Pool(base, config=config) as pool:
        ws = await pool.layer("turns", base=base)
        first = asyncio.create_task(
            pool.call("bash", {"command": f"cat {fifo} > got"}, workspace=ws)
        )
        await wait_until(lambda: bool(pool.running()), what="the first call running")
        second = asyncio.create_task(pool.call("bash", {"command": "touch late"}, workspace=ws))
        await wait_until(lambda: ws.waiting == 1, what="the second call waiting for its turn")
        second.cancel()
        with pytest.raises(asyncio.CancelledError):
            await second
        assert ws.waiting == 0
        await asyncio.to_thread(fifo.write_text, "go\n")
        assert (await first).status is Status.OK
        assert {c["path"] for c in await ws.diff()} == {"got"}


async def test_a_call_waiting_in_a_removed_layer_ends_as_error(tmp_path: Path) -> None:
    base = _base(tmp_path)
    fifo = tmp_path / "sync" / "go"
    fifo.parent.mkdir()
    os.mkfifo(fifo)
    config = _config(tmp_path, sandbox={"writable": [str(fifo.parent)]})
    async with Pool(base, config=config) as pool:
        ws = await pool.layer("gone", base=base)
        first = asyncio.create_task(pool.call("bash", {"command": f"cat {fifo}"}, workspace=ws))
        await wait_until(lambda: bool(pool.running()), what="the first call running")
        removing = asyncio.create_task(ws.remove())
        late = asyncio.create_task(pool.call("bash", {"command": "touch late"}, workspace=ws))
        await wait_until(lambda: ws.waiting == 1, what="the late call waiting for its turn")
        await asyncio.to_thread(fifo.write_text, "go\n")
        assert (await first).status is Status.OK
        await removing
        outcome = await late
        assert outcome.status is Status.ERROR
        assert outcome.error == "layer 'gone' was removed"
        assert outcome.started is False
        with pytest.raises(ValueError, match="removed"):
            await pool.call("ls", {}, workspace=ws)
    assert not (tmp_path / "layers" / "gone").exists()


_ATTACK = r"""
set +e
B={base}
echo pwned > $B/README
echo pwned > /proc/self/root$B/README
echo pwned > /proc/1/root$B/README
ln -s $B/README escape; echo pwned > escape
ln $B/src/a.py hard; echo pwned >> hard
mv $B/src $B/moved; rm -rf $B/src
touch $B/planted; chmod 777 $B
mount -o remount,rw $B; umount $B; umount -l $B
for d in {store}/*/upper {store}/*/work; do echo pwned > $d/planted; done
python3 -c "import os; fd=os.open('$B', os.O_RDONLY); os.mkdir('/proc/self/fd/%d/x' % fd)"
cd /proc/self/cwd && echo pwned > ../../planted
exit 0
"""


async def test_no_call_in_a_layer_can_write_its_base(tmp_path: Path) -> None:
    base = _base(tmp_path)
    before = _snapshot(base)
    store = tmp_path / "layers"
    async with Pool(tmp_path, config=_config(tmp_path)) as pool:
        ws = await pool.layer("attacked", base=base)
        other = await pool.layer("other", base=base)
        command = _ATTACK.format(base=base, store=store.resolve())
        await _bash(pool, ws, command)
        for filesystem in ("host",):
            # Without the filesystem rules (Landlock): the mounts alone must hold.
            host = _config(tmp_path, sandbox={"filesystem": filesystem})
            async with Pool(tmp_path, config=host) as bare:
                exposed = await bare.layer("bare", base=base)
                await _bash(bare, exposed, command)
        assert await other.diff() == []
        assert not list((store / "other" / "upper").iterdir())
    assert _snapshot(base) == before


async def test_a_hostile_tree_is_forked_and_reset_without_leaving_the_store(
    tmp_path: Path,
) -> None:
    base = _base(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("keep\n")
    deep = "/".join(["d"] * 300)
    command = (
        f"mkdir -p locked/inner && echo s > locked/inner/secret && chmod 000 locked/inner locked"
        f" && ln -s {outside} out && ln -s {outside}/keep outfile && ln -s {base} tobase"
        f" && mkfifo fifo && truncate -s 1T sparse && echo x > one && ln one two"
        f" && rm README && mkdir -p {deep} && echo deep > {deep}/f && chmod 000 src"
    )
    async with Pool(tmp_path, config=_config(tmp_path)) as pool:
        ws = await pool.layer("hostile", base=base)
        await _bash(pool, ws, command)
        listed = {c["path"]: c["kind"] for c in await ws.diff()}
        assert listed["locked/inner/secret"] == "created"
        assert listed["README"] == "deleted"
        assert (
            stat.S_IMODE(os.stat(tmp_path / "layers" / "hostile" / "upper" / "locked").st_mode) == 0
        )
        fork = await ws.fork("copy")
        copy = tmp_path / "layers" / "copy" / "upper"
        assert os.stat(copy / "sparse").st_blocks == 0
        assert os.stat(copy / "one").st_ino == os.stat(copy / "two").st_ino
        assert os.readlink(copy / "out") == str(outside)
        assert stat.S_IMODE(os.stat(copy / "locked").st_mode) == 0
        seen = await _bash(
            pool, fork, f"ls README 2>&1; cat {deep}/f; stat -c %a locked src; stat -c %s sparse"
        )
        assert "No such file" in seen["stdout"]
        assert seen["stdout"].split("\n")[1:] == ["deep", "0", "0", str(1 << 40), ""]
        await ws.reset()
        await fork.remove()
        assert await _read(pool, ws, "README") == "read me\n"
    assert (outside / "keep").read_text() == "keep\n"
    assert os.listdir(outside) == ["keep"]
    assert sorted(os.listdir(tmp_path / "layers")) == ["hostile"]


_CONTAINER_ROOT = [
    "setpriv",
    "--bounding-set=-all,+chown,+dac_override,+fowner,+fsetid,+kill,+setgid,+setuid,+setpcap,"
    "+net_bind_service,+net_raw,+sys_chroot,+mknod,+audit_write,+setfcap",
    "--inh-caps=-all",
]

_WITHOUT_OVERLAY = r"""
import asyncio, json, os, sys
from sandbx_pool import LayerUnavailable, Pool
from sandbx_pool.config import load_config

async def main(base, store):
    config = load_config(None).override(workspace={"layers": store})
    async with Pool(base, config=config) as pool:
        try:
            await pool.layer("x", base=base)
        except LayerUnavailable as exc:
            made = os.listdir(store) if os.path.isdir(store) else []
            print(json.dumps({"error": str(exc), "made": made}))

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


def test_without_overlays_a_layer_is_refused_naming_why(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("plays a container's root: needs root")
    if shutil.which("setpriv") is None:
        pytest.skip("needs setpriv (util-linux)")
    base = _base(tmp_path)
    done = subprocess.run(
        [*_CONTAINER_ROOT, sys.executable, "-c", _WITHOUT_OVERLAY, str(base), str(tmp_path / "s")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert "mount namespace" in out["error"]
    assert "doctor" in out["error"]
    assert out["made"] == []


# -- where layers are used --------------------------------------------------------------------


def _with_store(pool_toml: Path, store: Path) -> Path:
    pool_toml.write_text(pool_toml.read_text() + f'\n[workspace]\nlayers = "{store}"\n')
    return pool_toml


async def test_an_inspect_sample_over_a_base_works_in_its_own_layer(tmp_path: Path) -> None:
    pytest.importorskip("inspect_ai")
    from sandbx_pool.integrations.inspect_provider import SandbxConfig, SandbxSandboxEnvironment

    base = _base(tmp_path)
    before = _snapshot(base)
    store = tmp_path / "layers"
    pool_toml = _with_store(Path(marked_pool_toml(tmp_path)), store)
    config = SandbxConfig(
        journal=str(tmp_path / "journal.jsonl"),
        pool_config=str(pool_toml),
        workers=2,
        base=str(base),
    )
    # A layer an eval killed before its cleanup left (its owner: a pid no process has).
    left = store / "sandbx-inspect-999999999-5-abcdef-sample-ghijkl"
    for part in ("upper", "work", "root"):
        (left / part).mkdir(parents=True)
    (left / "layer.json").write_text(json.dumps({"v": 1, "name": left.name, "base": str(base)}))
    await SandbxSandboxEnvironment.task_init("startup", config)
    assert not left.exists()
    try:
        first = await SandbxSandboxEnvironment.sample_init("test", config, {})
        second = await SandbxSandboxEnvironment.sample_init("test", config, {})
        one, two = first["default"], second["default"]
        try:
            assert await one.read_file("README") == "read me\n"
            await one.write_file("README", "one\n")
            done = await one.exec(["sh", "-c", "rm src/a.py; pwd; ls src; cat README"])
            assert done.stdout == "/work\nb.py\none\n"
            assert await two.read_file("README") == "read me\n"
            assert (await two.exec(["ls", "src"])).stdout == "a.py\nb.py\n"
            assert (await two.exec(["ls", "/"])).success  # the sample's view, as ever
            assert len(os.listdir(store)) == 2
        finally:
            await SandbxSandboxEnvironment.sample_cleanup("test", config, first, False)
            await SandbxSandboxEnvironment.sample_cleanup("test", config, second, False)
    finally:
        await SandbxSandboxEnvironment.task_cleanup("shutdown", config, True)
    assert os.listdir(store) == []
    assert _snapshot(base) == before


def test_a_batch_runs_each_sample_in_its_own_layer_over_one_base(tmp_path: Path) -> None:
    root = tmp_path / "root"
    base = root / "repo"
    base.mkdir(parents=True)
    (base / "code.py").write_text("x = 1\n")
    before = _snapshot(base)
    config = tmp_path / "pool.toml"
    config.write_text(f'[pool]\nprefork = 0\n\n[workspace]\nlayers = "{tmp_path / "layers"}"\n')
    lines = []
    for sample in range(3):
        name = f"s-{sample}"
        edit = f"sed -i 's/1/{sample}/' code.py && cat code.py"
        lines.append({"tool": "bash", "args": {"command": edit}, "base": "repo", "layer": name})
        lines.append({"tool": "read", "args": {"path": "code.py"}, "layer": name, "id": name})
    calls = tmp_path / "calls.jsonl"
    calls.write_text("".join(json.dumps(line) + "\n" for line in lines))
    journal = tmp_path / "j.jsonl"
    done = subprocess.run(
        [
            *(sys.executable, "-m", "sandbx_pool.cli", "run", str(calls)),
            *("--workspace", str(root), "--config", str(config)),
            *("--journal", str(journal), "--parallel", "4"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert done.returncode == 0, done.stderr
    records = journal_records(str(journal))
    outcomes = {r["call_id"]: r for r in records if r["kind"] == "outcome"}
    assert len(outcomes) == 6
    assert all(r["status"] == "ok" for r in outcomes.values())
    layers = {r["call_id"]: r["layer"] for r in records if r["kind"] == "intent"}
    assert sorted(set(layers.values())) == ["s-0", "s-1", "s-2"]
    assert sorted(os.listdir(tmp_path / "layers")) == ["s-0", "s-1", "s-2"]
    for sample in range(3):
        upper = tmp_path / "layers" / f"s-{sample}" / "upper" / "code.py"
        assert upper.read_text() == f"x = {sample}\n"
    assert _snapshot(base) == before
    # Resumed: nothing left to run, and the layers' paths do not pass for the workspace root.
    again = subprocess.run(
        [
            *(sys.executable, "-m", "sandbx_pool.cli", "run", str(calls), "--resume"),
            *("--workspace", str(root), "--config", str(config), "--journal", str(journal)),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert again.returncode == 0, again.stderr
    assert len([r for r in journal_records(str(journal)) if r["kind"] == "outcome"]) == 6


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ({"tool": "ls", "base": "repo"}, '"base" needs "layer"'),
        ({"tool": "ls", "layer": "../x"}, "plain name"),
        ({"tool": "ls", "layer": "a", "workspace": "w"}, "do not go together"),
        ({"tool": "ls", "layer": "a", "changes": "tracked"}, "its calls are direct"),
        ({"tool": "ls", "layer": "a", "base": ""}, "non-empty path"),
    ],
)
def test_a_batch_line_with_a_bad_layer_is_a_file_error(
    tmp_path: Path, line: dict[str, Any], problem: str
) -> None:
    from sandbx_pool.batch.calls import BatchFileError, load_batch

    calls = tmp_path / "calls.jsonl"
    calls.write_text(json.dumps(line) + "\n")
    with pytest.raises(BatchFileError, match=problem):
        load_batch(calls)


def test_two_bases_for_one_layer_are_a_file_error(tmp_path: Path) -> None:
    from sandbx_pool.batch.calls import BatchFileError, load_batch

    calls = tmp_path / "calls.jsonl"
    lines = [{"tool": "ls", "layer": "a", "base": "x"}, {"tool": "ls", "layer": "a", "base": "y"}]
    calls.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with pytest.raises(BatchFileError, match=r"layer 'a' is over 'x' \(line 1\), not 'y'"):
        load_batch(calls)
