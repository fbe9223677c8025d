"""Protected paths hold in every environment: what bash makes of one is set aside, what it changes
or removes is put back as it was, wherever the pool runs.

Each test runs through ``Pool.call`` and checks from the host's side: the files themselves, and
the user's next ``git commit`` (does a planted hook run?). Two ways of holding, by ``hold``:

* ``mounts``: the default. As root on a host, protected paths that exist are read-only binds in
  bash's mount namespace, and the snapshot covers what no mount can hold (paths that do not exist
  yet). As an unprivileged user or in a container without CAP_SYS_ADMIN there is no mount
  namespace, and this is the snapshot's fallback as well;
* ``restore``: ``HOLD_ENV=restore`` makes no bind, so the snapshot holds everything, as it does
  where no mount namespace can be made; tested as root too.

A command reports each step as ``NAME:RC``; a step that succeeded (rc 0: the fallback) must be
undone and listed in ``protected_set_aside``, one that failed (EROFS: a mount held it) must not.
"""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest
from conftest import MakePool, marked_config

from sandbx_pool import CancelToken, OutputChunk, Pool, Status
from sandbx_pool.workers import protected, protected_snapshot
from sandbx_pool.workers.hooks_path import hooks_path

_GIT = ["git", "-c", "user.email=t@example.com", "-c", "user.name=t"]


@pytest.fixture(params=["mounts", "restore"])
def hold(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    mode: str = request.param
    if mode == "restore":
        monkeypatch.setenv(protected.HOLD_ENV, "restore")
    else:
        monkeypatch.delenv(protected.HOLD_ENV, raising=False)
    return mode


@pytest.fixture
async def pool(hold: str, make_pool: MakePool) -> Pool:
    return await make_pool(pool={"workers": 2})


@pytest.fixture
def repository(workspace: Path) -> Path:
    """The user's repository, made outside any sandbox, with one commit."""
    subprocess.run(["git", "init", "-q", "."], cwd=workspace, check=True)
    subprocess.run(
        [*_GIT, "commit", "-q", "--allow-empty", "-m", "first"], cwd=workspace, check=True
    )
    return workspace


async def bash(pool: Pool, command: str, **kwargs: Any) -> dict[str, Any]:
    outcome = await pool.call("bash", {"command": command}, **{"timeout": 30, **kwargs})
    assert outcome.status is Status.OK, outcome
    assert outcome.value is not None, outcome
    return outcome.value


def _steps(value: dict[str, Any]) -> dict[str, bool]:
    """Each ``NAME:RC`` line the command printed: whether that step succeeded."""
    lines = (line.split(":") for line in value["stdout"].splitlines() if ":" in line)
    return {name: rc == "0" for name, rc in lines}


def _listed(value: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {entry["path"]: entry for entry in value.get("protected_set_aside", [])}


def _tree(path: Path) -> dict[str, tuple[int, bytes | str]]:
    """Every name below ``path`` (and ``path``): its mode and its content or symlink target."""
    found: dict[str, tuple[int, bytes | str]] = {}
    for item in [path, *sorted(path.rglob("*"))] if path.is_dir() else [path]:
        info = item.lstat()
        if stat.S_ISLNK(info.st_mode):
            content: bytes | str = os.readlink(item)
        elif stat.S_ISREG(info.st_mode):
            content = item.read_bytes()
        else:
            content = b""
        found[str(item.relative_to(path.parent))] = (info.st_mode, content)
    return found


def _hook(marker: Path) -> str:
    return f"#!/bin/sh\ntouch {marker}\n"


def _user_hook(path: Path, marker: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(_hook(marker))
    path.chmod(0o755)


def _set_hooks_path(repository: Path, value: str) -> None:
    subprocess.run(["git", "config", "core.hooksPath", value], cwd=repository, check=True)


def _move_git_directory(repository: Path, name: str) -> None:
    """``.git`` becomes a symlink to ``name``, where the git directory now lies."""
    (repository / ".git").rename(repository / name)
    (repository / ".git").symlink_to(name)


def _set_aside_in(directory: Path) -> list[Path]:
    return list(directory.glob("*.sandbx-removed-*"))


def _host_commit(workspace: Path) -> subprocess.CompletedProcess[str]:
    """The user's next commit, outside any sandbox: where a planted hook would run."""
    return subprocess.run(
        [*_GIT, "commit", "-q", "--allow-empty", "-m", "by the user"],
        cwd=workspace,
        capture_output=True,
        text=True,
        check=False,
    )


def _write_hook(path: str, marker: Path) -> str:
    return f"printf '#!/bin/sh\\ntouch {marker}\\n' > {path} && chmod +x {path}"


# -- .git/hooks and .git/config of a repository that exists ----------------------------------


async def test_what_bash_does_to_an_existing_repository_is_undone(
    pool: Pool, hold: str, repository: Path, tmp_path: Path
) -> None:
    marker = tmp_path / "hook-ran"
    hooks, config = repository / ".git" / "hooks", repository / ".git" / "config"
    before = {**_tree(hooks), **_tree(config)}
    steps = {
        "write": (".git/hooks/pre-commit", f"echo 'touch {marker}' > .git/hooks/pre-commit"),
        "exec": (".git/hooks/pre-push", _write_hook(".git/hooks/pre-push", marker)),
        "append": (
            ".git/config",
            f"printf '[core]\\n\\tfsmonitor = touch {marker}\\n' >> .git/config",
        ),
        "chmod": (".git/hooks/update.sample", "chmod -x .git/hooks/update.sample"),
        "dirmode": (".git/hooks", "chmod 777 .git/hooks"),
        "rm": (".git/hooks/pre-rebase.sample", "rm .git/hooks/pre-rebase.sample"),
        "link": (
            ".git/hooks/commit-msg.sample",
            "rm .git/hooks/commit-msg.sample && ln -s /bin/true .git/hooks/commit-msg.sample",
        ),
    }
    value = await bash(
        pool, "; ".join(f"{cmd}; echo {name}:$?" for name, (_, cmd) in steps.items())
    )
    done = _steps(value)
    if hold == "restore":
        assert all(done.values()), value  # nothing held them: the snapshot must undo it all
    assert {**_tree(hooks), **_tree(config)} == before
    listed = _listed(value)
    assert set(listed) == {path for name, (path, _) in steps.items() if done[name]}, value
    for entry in listed.values():
        # Made by the call: set aside only; changed or removed: put back as it was.
        assert entry["restored"] is (
            entry["path"] not in (".git/hooks/pre-commit", ".git/hooks/pre-push")
        )
        if entry["to"] is not None:
            assert (repository / entry["to"]).exists() or (repository / entry["to"]).is_symlink()
    assert _host_commit(repository).returncode == 0
    assert not marker.exists()


async def test_a_git_directory_swapped_for_a_copy_keeps_no_hook(
    pool: Pool, hold: str, repository: Path, tmp_path: Path
) -> None:
    marker = tmp_path / "hook-ran"
    config = (repository / ".git" / "config").read_bytes()
    command = (
        "mv .git .git-old; cp -a .git-old .git; echo swap:$?; "
        f"{_write_hook('.git/hooks/pre-commit', marker)}; echo hook:$?"
    )
    value = await bash(pool, command)
    if hold == "restore":
        assert all(_steps(value).values()), value
    assert not (repository / ".git" / "hooks" / "pre-commit").exists()
    assert (repository / ".git" / "config").read_bytes() == config
    assert _host_commit(repository).returncode == 0
    assert not marker.exists()


async def test_a_git_directory_reached_through_a_symlink_is_guarded_where_it_lies(
    pool: Pool, hold: str, repository: Path, tmp_path: Path
) -> None:
    _move_git_directory(repository, "gitdir")
    marker = tmp_path / "hook-ran"
    value = await bash(pool, f"{_write_hook('gitdir/hooks/pre-commit', marker)}; echo hook:$?")
    if hold == "restore":
        assert _steps(value)["hook"], value
    assert set(_listed(value)) == ({"gitdir/hooks/pre-commit"} if _steps(value)["hook"] else set())
    assert not (repository / "gitdir" / "hooks" / "pre-commit").exists()
    assert _host_commit(repository).returncode == 0
    assert not marker.exists()


# -- core.hooksPath, husky, pre-commit -------------------------------------------------------


async def test_a_hook_in_the_directory_core_hooks_path_names_is_undone(
    pool: Pool, hold: str, repository: Path, tmp_path: Path
) -> None:
    _set_hooks_path(repository, ".githooks")
    mine, planted = tmp_path / "my-hook-ran", tmp_path / "hook-ran"
    _user_hook(repository / ".githooks" / "pre-commit", mine)
    before = _tree(repository / ".githooks")
    command = (
        f"{_write_hook('.githooks/pre-commit', planted)}; echo change:$?; "
        f"{_write_hook('.githooks/pre-push', planted)}; echo add:$?"
    )
    value = await bash(pool, command)
    done = _steps(value)
    if hold == "restore":
        assert all(done.values()), value
    assert _tree(repository / ".githooks") == before
    assert set(_listed(value)) == {
        path
        for name, path in (("change", ".githooks/pre-commit"), ("add", ".githooks/pre-push"))
        if done[name]
    }
    assert _host_commit(repository).returncode == 0
    assert mine.exists()  # the user's own hook still runs
    assert not planted.exists()


@pytest.mark.parametrize("hooks_path", [".husky", ".husky/_"])
async def test_a_husky_hook_a_call_makes_is_set_aside(
    pool: Pool, repository: Path, tmp_path: Path, hooks_path: str
) -> None:
    _set_hooks_path(repository, hooks_path)
    marker = tmp_path / "hook-ran"
    value = await bash(
        pool, f"mkdir -p {hooks_path} && {_write_hook(f'{hooks_path}/pre-commit', marker)}"
    )
    assert set(_listed(value)) == {".husky"}, value  # it did not exist: set aside whole
    assert not (repository / ".husky").exists()
    assert _host_commit(repository).returncode == 0
    assert not marker.exists()


async def test_a_pre_commit_configuration_is_put_back(
    pool: Pool, hold: str, repository: Path, tmp_path: Path
) -> None:
    marker = tmp_path / "hook-ran"
    path = repository / ".pre-commit-config.yaml"
    mine = "repos:\n- repo: https://github.com/psf/black\n  rev: 24.1.0\n  hooks: [{id: black}]\n"
    path.write_text(mine)
    local = (
        "repos:\n- repo: local\n  hooks:\n  - id: x\n    name: x\n"
        f"    entry: touch {marker}\n    language: system\n"
    )
    value = await bash(pool, f"printf '{local}' > .pre-commit-config.yaml; echo change:$?")
    if hold == "restore" or _steps(value)["change"]:
        assert _listed(value)[".pre-commit-config.yaml"]["restored"] is True, value
    assert path.read_text() == mine
    # One the repository does not have yet: set aside.
    path.unlink()
    value = await bash(pool, f"printf '{local}' > .pre-commit-config.yaml")
    assert set(_listed(value)) == {".pre-commit-config.yaml"}, value
    assert not path.exists()


async def test_write_and_edit_refuse_the_new_protected_paths(pool: Pool, repository: Path) -> None:
    _set_hooks_path(repository, "tools/hooks")
    (repository / ".pre-commit-config.yaml").write_text("repos: []\n")
    for path in ("tools/hooks/pre-commit", ".husky/pre-commit", ".pre-commit-config.yaml"):
        written = await pool.call("write", {"path": path, "content": "#!/bin/sh\n"})
        assert written.status is Status.DENIED, written
    edited = await pool.call(
        "edit",
        {"path": ".pre-commit-config.yaml", "old_string": "[]", "new_string": "[{repo: local}]"},
    )
    assert edited.status is Status.DENIED, edited
    # Beside them the workspace is the call's, tools/ included.
    written = await pool.call("write", {"path": "tools/build.sh", "content": "make\n"})
    assert written.status is Status.OK, written


@pytest.mark.parametrize("where", ["..", "outside", "./", "back-inside"])
async def test_core_hooks_path_outside_the_workspace_guards_nothing_there(
    pool: Pool, repository: Path, tmp_path: Path, where: str
) -> None:
    outside = tmp_path / "outside-hooks"
    outside.mkdir()
    value_of = {
        "..": "..",
        "outside": str(outside),
        "./": "./",  # the workspace itself: git's hook names in it are guarded, nothing else
        "back-inside": f"../{repository.name}/.githooks",
    }
    _set_hooks_path(repository, value_of[where])
    command = (
        "mkdir -p .githooks && echo x > notes.txt && echo y > .githooks/pre-commit &&"
        " echo z > pre-commit && echo done"
    )
    value = await bash(pool, command)
    assert value["stdout"] == "done\n", value
    assert "protected_unguarded" not in value, value
    listed = set(_listed(value))
    expected = {"..": set(), "outside": set(), "./": {"pre-commit"}, "back-inside": {".githooks"}}
    assert listed == expected[where], value
    assert (repository / "notes.txt").read_text() == "x\n"
    assert list(outside.iterdir()) == []
    assert not _set_aside_in(tmp_path)  # nothing of the workspace's parent moved


# -- hostile shapes --------------------------------------------------------------------------


async def test_symlinks_planted_at_protected_paths_are_set_aside_never_followed(
    hold: str, repository: Path, tmp_path: Path
) -> None:
    outside = tmp_path / "outside"
    (outside / "hooks").mkdir(parents=True)
    (outside / "victim").write_text("victim\n")
    (repository / "evil-hooks").mkdir()
    before = {**_tree(repository / ".git" / "hooks"), **_tree(repository / ".git" / "config")}
    marker = tmp_path / "hook-ran"
    command = (
        f"rm -f .git/config && ln -s {outside}/victim .git/config; echo config:$?; "
        f"ln -s {outside}/elsewhere .git/commondir; echo commondir:$?; "
        f"rm -rf .git/hooks && ln -s {outside}/hooks .git/hooks; echo hooks:$?"
    )
    # The outside directory is writable to the call, and so to its worker: a restore that
    # followed a symlink would write there.
    config = marked_config(pool={"workers": 2}, sandbox={"writable": [str(outside)]})
    async with Pool(repository, journal=tmp_path / "journal.jsonl", config=config) as pool:
        value = await bash(pool, command)
        done = _steps(value)
        if hold == "restore":
            assert all(done.values()), value
        # A hooks directory swapped for a symlink into the workspace, holding a hook.
        command = (
            f"rm -rf .git/hooks; ln -s ../evil-hooks .git/hooks; echo link:$?; "
            f"{_write_hook('evil-hooks/pre-commit', marker)}"
        )
        second = await bash(pool, command)
    assert (outside / "victim").read_text() == "victim\n"
    assert list((outside / "hooks").iterdir()) == []
    assert not (outside / "elsewhere").exists()
    assert not (repository / ".git" / "commondir").is_symlink()
    assert {
        **_tree(repository / ".git" / "hooks"),
        **_tree(repository / ".git" / "config"),
    } == before
    listed = _listed(value)
    for path, step in (
        (".git/commondir", "commondir"),
        (".git/config", "config"),
        (".git/hooks", "hooks"),
    ):
        assert (path in listed) is done[step], value
    assert (".git/hooks" in _listed(second)) is _steps(second)["link"], second
    assert _host_commit(repository).returncode == 0
    assert not marker.exists()


async def test_a_protected_file_past_the_budget_is_named_and_its_change_set_aside(
    pool: Pool, hold: str, repository: Path
) -> None:
    big = repository / ".git" / "hooks" / "big-tool"
    big.write_bytes(b"#" * (protected_snapshot.MAX_BYTES + 1))
    sample = repository / ".git" / "hooks" / "pre-commit.sample"
    original = sample.read_bytes()
    command = (
        "echo more >> .git/hooks/big-tool; echo big:$?; echo x >> .git/hooks/pre-commit.sample"
    )
    value = await bash(pool, command)
    assert sample.read_bytes() == original  # within the budget: put back
    if hold == "mounts" and not _steps(value)["big"]:
        assert "protected_unguarded" not in value, value  # a mount held it: nothing to say
        return
    reasons = [n["reason"] for n in value["protected_unguarded"] if n["path"].endswith("big-tool")]
    budget = protected_snapshot.MAX_BYTES
    assert reasons == [f"past the snapshot's {budget} bytes: a change is set aside, not undone"]
    entry = _listed(value)[".git/hooks/big-tool"]
    assert entry["restored"] is False, value
    assert not big.exists()  # the call's version is not left where git would run it
    assert (repository / entry["to"]).read_bytes().endswith(b"more\n")


async def test_a_prefix_of_too_many_names_is_named_not_silently_skipped(
    pool: Pool, hold: str, repository: Path
) -> None:
    hooks = repository / ".git" / "hooks"
    for i in range(protected_snapshot.MAX_ENTRIES + 1):
        (hooks / f"h{i}").touch()
    value = await bash(pool, "touch .git/hooks/probe; echo probe:$?")
    if hold == "restore":
        assert _steps(value)["probe"], value
    if not _steps(value)["probe"]:
        assert "protected_unguarded" not in value, value  # a mount held it: nothing to say
        return
    reasons = [n["reason"] for n in value["protected_unguarded"] if n["path"] == ".git/hooks"]
    assert reasons == [f"more than {protected_snapshot.MAX_ENTRIES} names to snapshot: not guarded"]


@pytest.mark.parametrize("stop", ["timeout", "cancel"])
async def test_a_call_stopped_midway_is_undone_before_it_answers(
    pool: Pool, repository: Path, tmp_path: Path, stop: str
) -> None:
    marker = tmp_path / "hook-ran"
    config = (repository / ".git" / "config").read_bytes()
    command = (
        f"{_write_hook('.git/hooks/pre-commit', marker)}; echo 'x' >> .git/config; "
        f"mkdir .husky; {_write_hook('.husky/pre-commit', marker)}; echo planted; sleep 100"
    )
    seen = asyncio.Event()

    def on_output(chunk: OutputChunk) -> None:
        if chunk.stream == "stdout":
            seen.set()

    token = CancelToken()
    call = asyncio.create_task(
        pool.call(
            "bash",
            {"command": command},
            timeout=2 if stop == "timeout" else 60,
            cancel=token,
            on_output=on_output,
        )
    )
    await seen.wait()
    if stop == "cancel":
        token.cancel("user pressed stop")
    outcome = await call
    assert outcome.status is (Status.TIMEOUT if stop == "timeout" else Status.CANCELLED), outcome
    assert outcome.value is not None, outcome
    assert outcome.value["stdout"] == "planted\n", outcome
    assert ".husky" in _listed(outcome.value), outcome
    assert not (repository / ".git" / "hooks" / "pre-commit").exists()
    assert not (repository / ".husky").exists()
    assert (repository / ".git" / "config").read_bytes() == config
    assert _host_commit(repository).returncode == 0
    assert not marker.exists()


# -- reading core.hooksPath ------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "[core]\n\thooksPath = .husky\n",
        '[CORE]\nHooksPath = " spaced out "  # a comment\n',
        "[core] hooksPath = one\n[user]\nname = x\n[core]\nhooksPath = two\n",
        '[core "sub"]\nhooksPath = not-core\n[core.sub]\nhooksPath = nor-this\n',
        "[core]\nhooksPath = con\\\ntinued\n",
        '[core]\nhooksPath = "a;b"#c\n',
        "[core]\r\nhooksPath = crlf\r\n",
        '[core "a]b"]\nx = 1\n[core]\nhooksPath = after-a-bracket\n',
        "[core]\n; hooksPath = commented\n# hooksPath = out\n",
        "[core]\nhooksPath = at-the-end",
    ],
)
def test_core_hooks_path_is_read_as_git_reads_it(tmp_path: Path, text: str) -> None:
    path = tmp_path / "config"
    path.write_bytes(text.encode())
    git = subprocess.run(
        ["git", "config", "--file", str(path), "--get", "core.hooksPath"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert git.returncode in (0, 1), git.stderr
    assert hooks_path(text) == (git.stdout[:-1] if git.returncode == 0 else None)
