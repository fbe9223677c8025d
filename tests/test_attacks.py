"""Attacks that got through a root pool with the default config, each closed since (and run
wherever doctor reports the protection they need: as a user too, where user namespaces are
allowed).

Run as a hostile model would, through ``Pool.call`` only, and checked from the host's side:
the host's own ``git commit`` (does a planted hook run?), the journal's records, the next call.

* git's code paths: a repository a call makes (``git init``) with a hook and a config; a
  ``.git`` renamed away and replaced by a copy whose hooks are writable; a ``.git/commondir``
  that sends git to a directory of the call's choosing for its config and hooks;
* a call's own workspace (a batch line's ``workspace``) or view, a folder of the pool's
  workspace that an earlier call made a symlink to a directory outside: the call was confined
  to that directory instead, read and write;
* ``run --output-dir`` inside the workspace: an earlier call planted ``ID.out`` as a symlink
  to a file outside, and the coordinator (unconfined, root) wrote the next call's output there;
* the journal: one inside the workspace (``run --journal run.jsonl`` in the project) read,
  truncated, forged, locked or replaced by a call; an argument nested deep enough to kill the
  journal's writer thread (every later side effect then waited for it forever); a call that
  fills the disk the journal shares with the workspace (every later side effect was refused).
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import marked_config
from helpers import bash_value

from sandbx_pool import Pool, Status
from sandbx_pool.batch.calls import parse_batch
from sandbx_pool.batch.run import run_batch

_GIT = ["git", "-c", "user.email=t@example.com", "-c", "user.name=t"]


@pytest.fixture
async def pool(workspace: Path, tmp_path: Path) -> AsyncIterator[Pool]:
    config = marked_config(pool={"workers": 2})
    async with Pool(workspace, journal=tmp_path / "journal.jsonl", config=config) as pool:
        yield pool


def _hook(marker: Path) -> str:
    """A command printing a pre-commit hook that touches ``marker``: redirect it to a path."""
    return f"printf '#!/bin/sh\\ntouch {marker}\\n'"


def _git_init(workspace: Path) -> None:
    subprocess.run(["git", "init", "-q", "."], cwd=workspace, check=True)


def _commits(workspace: Path) -> int:
    log = subprocess.run(["git", "log", "--oneline"], cwd=workspace, capture_output=True, text=True)
    return len(log.stdout.splitlines())


def _entries(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def _host_commit(workspace: Path) -> subprocess.CompletedProcess[str]:
    """The user's next commit, outside any sandbox: where a planted hook would run."""
    return subprocess.run(
        [*_GIT, "commit", "-q", "--allow-empty", "-m", "by the user"],
        cwd=workspace,
        capture_output=True,
        text=True,
        check=False,
    )


# -- git's code paths ------------------------------------------------------------------------------


@pytest.mark.needs("protected paths")
async def test_a_repository_a_call_makes_keeps_no_hook_or_config(
    pool: Pool, workspace: Path, tmp_path: Path
) -> None:
    marker = tmp_path / "hook-ran"
    command = (
        f"git init -q . && {' '.join(_GIT)} commit -q --allow-empty -m first && "
        f"{_hook(marker)} > .git/hooks/pre-commit && chmod +x .git/hooks/pre-commit && "
        f"git config core.fsmonitor 'touch {marker}' && echo made"
    )
    value = await bash(pool, command)
    assert value["stdout"] == "made\n", value
    moved = {entry["path"] for entry in value["protected_set_aside"]}
    assert moved == {".git/hooks", ".git/config"}, value
    assert not (workspace / ".git" / "hooks").exists()
    assert not (workspace / ".git" / "config").exists()
    # The repository itself is the call's work and stays: the user commits on top of it.
    result = _host_commit(workspace)
    assert result.returncode == 0, result.stderr
    assert not marker.exists()
    assert _commits(workspace) == 2


@pytest.mark.needs("protected paths")
async def test_a_timed_out_call_keeps_no_hook_either(
    pool: Pool, workspace: Path, tmp_path: Path
) -> None:
    marker = tmp_path / "hook-ran"
    command = (
        f"git init -q . && {_hook(marker)} > .git/hooks/pre-commit && "
        "chmod +x .git/hooks/pre-commit && echo planted && sleep 100"
    )
    outcome = await pool.call("bash", {"command": command}, timeout=2)
    assert outcome.status is Status.TIMEOUT, outcome
    assert outcome.value is not None, outcome
    assert outcome.value["stdout"] == "planted\n", outcome
    assert not (workspace / ".git" / "hooks" / "pre-commit").exists()
    assert _host_commit(workspace).returncode == 0
    assert not marker.exists()


@pytest.mark.needs("protected paths")
async def test_a_git_file_a_call_makes_cannot_point_git_at_its_hooks(
    pool: Pool, workspace: Path, tmp_path: Path
) -> None:
    marker = tmp_path / "hook-ran"
    command = (
        f"mkdir elsewhere && cd elsewhere && git init -q . && {' '.join(_GIT)} commit -q"
        f" --allow-empty -m first && {_hook(marker)} > .git/hooks/pre-commit && chmod +x"
        " .git/hooks/pre-commit && cd .. && echo 'gitdir: elsewhere/.git' > .git && echo made"
    )
    value = await bash(pool, command)
    assert value["stdout"] == "made\n", value
    assert [e["path"] for e in value["protected_set_aside"]] == [".git"], value
    assert not (workspace / ".git").exists()
    _host_commit(workspace)  # not a repository any more: whatever git says, no hook runs
    assert not marker.exists()


@pytest.mark.needs("protected paths", "PID namespaces")
async def test_a_call_cannot_disarm_its_worker_before_the_hook_is_set_aside(
    pool: Pool, workspace: Path, tmp_path: Path
) -> None:
    marker = tmp_path / "hook-ran"
    # Its worker (pid 1 of the call's namespace) left with no descriptor could set nothing aside.
    command = (
        f"git init -q . && {_hook(marker)} > .git/hooks/pre-commit && "
        "chmod +x .git/hooks/pre-commit && prlimit --pid 1 --nofile=3:3 --cpu=1:1; "
        "echo rc=$?; ulimit -n 64 && echo own-limits-still-mine"
    )
    value = await bash(pool, command)
    assert value["stdout"] == "rc=1\nown-limits-still-mine\n", value
    assert value["protected_set_aside"], value
    assert _host_commit(workspace).returncode == 0
    assert not marker.exists()


@pytest.mark.needs("protected paths")
async def test_the_git_directory_cannot_be_swapped_for_a_writable_copy(
    pool: Pool, workspace: Path, tmp_path: Path
) -> None:
    _git_init(workspace)
    marker = tmp_path / "hook-ran"
    swaps = [
        "mv .git .git-old && cp -a .git-old .git",
        "cp -a .git .git-new && mv -T .git-new .git",
        "mv .git/hooks .git/hooks-old; mkdir -p .git/hooks",
    ]
    for swap in swaps:
        value = await bash(
            pool,
            f"{swap}; {_hook(marker)} > .git/hooks/pre-commit && chmod +x .git/hooks/pre-commit;"
            " echo rc=$?",
        )
        # Without a mount namespace (a container without CAP_SYS_ADMIN) no bind holds .git: the
        # swap goes through, and the hook is set aside once the call is over.
        moved = {entry["path"] for entry in value.get("protected_set_aside", [])}
        assert "rc=0" not in value["stdout"] or ".git/hooks/pre-commit" in moved, (swap, value)
    assert _host_commit(workspace).returncode == 0
    assert not marker.exists()


@pytest.mark.needs("protected paths")
async def test_a_commondir_cannot_send_git_elsewhere(
    pool: Pool, workspace: Path, tmp_path: Path
) -> None:
    _git_init(workspace)
    marker = tmp_path / "hook-ran"
    # A copy of the git directory, with a hook: git takes config and hooks from the commondir.
    await bash(
        pool,
        f"cp -a .git evil && {_hook(marker)} > evil/hooks/pre-commit"
        " && chmod +x evil/hooks/pre-commit",
    )
    written = await pool.call("write", {"path": ".git/commondir", "content": "../evil\n"})
    assert written.status is Status.DENIED, written
    value = await bash(pool, "echo ../evil > .git/commondir && echo rc=$?")
    assert value["stdout"] == "rc=0\n"  # .git stays writable: git writes there
    assert [e["path"] for e in value["protected_set_aside"]] == [".git/commondir"], value
    assert _host_commit(workspace).returncode == 0
    assert not marker.exists()


# -- a call's own workspace or view ---------------------------------------------------------------


@pytest.mark.needs("mount namespaces")
async def test_a_calls_workspace_or_view_is_never_a_planted_symlink(
    pool: Pool, workspace: Path, tmp_path: Path
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("secret\n")
    (workspace / "episode").mkdir()
    await bash(pool, f"rm -rf episode && ln -s {outside} episode")
    episode = str(workspace / "episode")
    attempts: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
        ("bash", {"command": "cat secret.txt; echo x > planted"}, {"workspace": episode}),
        ("read", {"path": "secret.txt"}, {"workspace": episode}),
        ("write", {"path": "planted", "content": "x"}, {"workspace": episode}),
        ("bash", {"command": "cat /secret.txt; echo x > /planted"}, {"view": episode}),
        ("read", {"path": "/secret.txt"}, {"view": episode}),
    ]
    for tool, args, where in attempts:
        outcome = await pool.call(tool, args, timeout=30, **where)
        assert outcome.status is Status.ERROR, (tool, where, outcome)
        assert "symlink" in (outcome.error or ""), outcome
    assert _entries(outside) == ["secret.txt"]
    # A real folder is a workspace as before.
    (workspace / "real").mkdir()
    fine = await pool.call("bash", {"command": "echo hi > f"}, workspace=str(workspace / "real"))
    assert fine.status is Status.OK, fine
    assert (workspace / "real" / "f").read_text() == "hi\n"


# -- the batch's output files ---------------------------------------------------------------------


async def test_an_output_file_is_never_written_through_a_planted_symlink(
    workspace: Path, tmp_path: Path
) -> None:
    victim = tmp_path / "victim"
    victim.write_text("the user's\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    lines = [
        # The output directory's files, and then the directory itself, made to lead outside.
        {"id": "plant", "tool": "bash", "args": {"command": f"ln -s {victim} out/two.out"}},
        {"id": "two", "tool": "bash", "args": {"command": "echo attacker"}, "after": ["plant"]},
        {
            "id": "swap",
            "tool": "bash",
            "args": {"command": f"mv out out-real && ln -s {elsewhere} out"},
            "after": ["two"],
        },
        {"id": "three", "tool": "bash", "args": {"command": "echo more"}, "after": ["swap"]},
    ]
    batch = parse_batch([json.dumps(line) for line in lines])
    (workspace / "out").mkdir()
    config = marked_config(pool={"workers": 2})
    async with Pool(workspace, journal=tmp_path / "j.jsonl", config=config) as pool:
        report = await run_batch(pool, batch.calls, parallel=2, output_dir=workspace / "out")
    assert [o.status for _, o in report.results] == [Status.OK] * 4, report
    assert victim.read_text() == "the user's\n"
    assert _entries(elsewhere) == []
    out = workspace / "out-real"
    assert (out / "two.out").read_text() == "attacker\n"
    assert not (out / "two.out").is_symlink()
    assert (out / "three.out").read_text() == "more\n"


# -- the journal ----------------------------------------------------------------------------------


@pytest.mark.needs("mount namespaces")
@pytest.mark.parametrize("where", ["run.jsonl", "logs/run.jsonl"])
async def test_a_journal_in_the_workspace_is_out_of_every_calls_reach(
    workspace: Path, where: str
) -> None:
    journal = workspace / where
    config = marked_config(pool={"workers": 2})
    async with Pool(workspace, journal=journal, config=config) as pool:
        await pool.call("write", {"path": "a.txt", "content": "one"})
        attacks = [
            f"cat {where}",
            f": > {where}",
            f'echo \'{{"kind":"outcome","call_id":"x","status":"ok"}}\' >> {where}',
            f"flock -n {where}.lock true",
            f"rm -f {where} {where}.lock",
            f"mv {where} gone.jsonl",
            f"ln {where} linked.jsonl",
            # Its directory, with the masked file in it: the writer could not re-create it.
            f"mv {os.path.dirname(where) or '.'} moved",
        ]
        for command in attacks:
            value = await bash(pool, f"{command} && echo rc=$?")
            assert "rc=0" not in value["stdout"], (command, value)
        for tool, args in [
            ("read", {"path": where}),
            ("write", {"path": where, "content": "{}\n"}),
            ("edit", {"path": f"./{where}", "old_string": "intent", "new_string": "x"}),
            ("write", {"path": f"{where}.lock", "content": ""}),
        ]:
            outcome = await pool.call(tool, args)
            assert outcome.status is Status.DENIED, (tool, outcome)
        await pool.call("write", {"path": "b.txt", "content": "two"})
    records = [json.loads(line) for line in journal.read_text().splitlines()]
    outcomes = [r for r in records if r["kind"] == "outcome"]
    intents = [r for r in records if r["kind"] == "intent"]
    assert len(intents) == len(outcomes) == 2 + len(attacks) + 4
    assert all(r["call_id"] != "x" for r in records)
    top = where.split("/")[0]
    expected = {"a.txt", "b.txt", "hello.txt", "src", top}
    if top == where:
        # The lock, and the change sets' pre-image store, made (and hidden) at start.
        expected |= {f"{where}.lock", f"{where}.d"}
    assert _entries(workspace) == sorted(expected)


async def test_an_argument_nested_deep_leaves_the_journal_writing(
    pool: Pool, tmp_path: Path
) -> None:
    nested: dict[str, Any] = {}
    inner = nested
    for _ in range(100_000):
        inner["a"] = {}
        inner = inner["a"]
    deep = await pool.call("bash", {"command": "true", "extra": nested})
    assert deep.status is Status.ERROR, deep
    after = await pool.call("write", {"path": "after.txt", "content": "x"}, timeout=10)
    assert after.status is Status.OK, after
    await pool.close()
    records = [json.loads(line) for line in (tmp_path / "journal.jsonl").read_text().splitlines()]
    by_call = {(r["call_id"], r["kind"]) for r in records}
    for outcome in (deep, after):
        assert {(outcome.call_id, "intent"), (outcome.call_id, "outcome")} <= by_call


@pytest.fixture
def shared_disk(tmp_path: Path) -> Iterator[Path]:
    """A 24 MiB tmpfs holding both the workspace and the journal, as one disk often does."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs to fill needs root")
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=24m,mode=0700", "tmpfs", str(mount)],
        capture_output=True,
        check=False,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        (mount / "ws").mkdir()
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


async def test_a_call_that_fills_the_journals_disk_does_not_stop_the_batch(
    shared_disk: Path,
) -> None:
    workspace, journal = shared_disk / "ws", shared_disk / "run.jsonl"
    async with Pool(workspace, journal=journal, config=marked_config()) as pool:
        filler = await bash(pool, "head -c 100M /dev/zero > big; df --output=avail . | tail -1")
        assert filler["stdout"].strip() == "0", filler
        # About 60 records: fifteen 4 KiB pages the full disk could not have given the journal.
        later = [await pool.call("bash", {"command": "true"}) for _ in range(20)]
        assert [o.status for o in later] == [Status.OK] * 20, later[-1]
    records = [json.loads(line) for line in journal.read_text().splitlines()]
    assert sum(r["kind"] == "outcome" for r in records) == 21
    # The room kept past the journal's end is given back when the pool closes.
    assert os.stat(journal).st_blocks * 512 < 1024 * 1024


async def bash(pool: Pool, command: str, **kwargs: Any) -> dict[str, Any]:
    """The attacks' bash: a command expected to be refused still leaves its output."""
    return await bash_value(pool, command, ok=False, **kwargs)
