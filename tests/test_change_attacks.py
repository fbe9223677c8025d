"""The red team's attacks on change sets (issue 38), each as a hostile model would make it: a
directory swapped for a symlink under an apply or an undo, J.d forged before the pool needed it,
pre-images read through a symlink to outside the workspace, a change set too large for the apply
worker's answer, a protected path in a change set. Each planted a git hook, copied a file from
outside the workspace into J.d, or left files written that no outcome named; each must hold.

Run as root and as an unprivileged user (.ci/environments): the overlay needs a mount namespace,
which a user gets in a user namespace of its own where the kernel allows it.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import json
import os
from pathlib import Path

import pytest
from conftest import marked_config
from helpers import wait_until

from sandbx_pool import Config, Pool, Status, UndoConflict
from sandbx_pool.config import DEFAULT_PROTECTED
from sandbx_pool.workers import beneath

pytestmark = pytest.mark.needs("overlayfs (tracked, transactional changes)")

HOOK = "#!/bin/sh\necho planted > /tmp/sbx-planted\n"


def _config(**sandbox: object) -> Config:
    return (
        marked_config(pool={"workers": 4}, sandbox=sandbox)
        if sandbox
        else marked_config(pool={"workers": 4})
    )


def _git(workspace: Path) -> Path:
    hooks = workspace / ".git" / "hooks"
    hooks.mkdir(parents=True)
    (workspace / ".git" / "config").write_text("[core]\n\tbare = false\n")
    return hooks


def _objects(journal: Path) -> dict[str, bytes]:
    objects = Path(f"{journal}.d") / "objects"
    return {p.name: p.read_bytes() for p in objects.iterdir()} if objects.is_dir() else {}


def _exactly_applied(workspace: Path, changes: list[dict[str, object]] | None) -> None:
    """The outcome says exactly what landed: each path created is in the workspace if and
    only if it is listed applied; each path deleted and listed applied is gone."""
    assert changes is not None
    for change in changes:
        path = workspace / str(change["path"])
        there = path.exists() or path.is_symlink()
        if change["kind"] == "created":
            assert there is change["applied"], change
        elif change["kind"] == "deleted" and change["applied"]:
            assert not there, change


async def test_undo_never_writes_through_a_directory_swapped_for_a_symlink(
    workspace: Path, tmp_path: Path
) -> None:
    hooks = _git(workspace)
    (workspace / "d").mkdir()
    (workspace / "d" / "pre-commit").write_text(HOOK)
    journal = tmp_path / "j.jsonl"
    async with Pool(workspace, journal=journal, config=_config(), changes="tracked") as pool:
        removed = await pool.call("bash", {"command": "rm d/pre-commit"})
        assert removed.ok, removed.error
        # A later direct call: d is now the hooks directory, and d/pre-commit still absent.
        swap = await pool.call(
            "bash", {"command": "rmdir d && ln -s .git/hooks d"}, changes="direct"
        )
        assert swap.value is not None, swap
        assert swap.value["exit_code"] == 0, swap
        with pytest.raises(UndoConflict, match=r"\bd was changed") as refused:
            await pool.undo(removed.call_id)
        assert refused.value.path == "d"
    assert not (hooks / "pre-commit").exists()
    assert os.readlink(workspace / "d") == ".git/hooks"


async def test_a_tracked_apply_never_writes_through_a_directory_a_direct_call_swaps(
    workspace: Path, tmp_path: Path
) -> None:
    hooks = _git(workspace)
    (workspace / "d").mkdir()
    (workspace / "d" / "keep").write_text("keep\n")
    journal = tmp_path / "j.jsonl"
    # The tracked call writes 10,000 files under big/ and then d/pre-commit: the apply stages
    # them in that order, so the direct call, which swaps d for a symlink to the hooks once the
    # first of big/'s temps appears, swaps it after the scan and before d/pre-commit is written.
    tracked = (
        "mkdir big && seq 1 100000 | split -l 10 -a 5 - big/f"
        f" && printf '%s' '{HOOK}' > d/pre-commit"
    )
    swapper = (
        "for i in $(seq 1 6000); do"
        "  if compgen -G 'big/.f*.sbx-tmp-*' > /dev/null; then"
        "    rm -rf d && ln -s .git/hooks d && echo swapped && exit 0;"
        "  fi; sleep 0.01;"
        " done; exit 1"
    )
    async with Pool(workspace, journal=journal, config=_config(), changes="tracked") as pool:
        swap = asyncio.create_task(
            pool.call("bash", {"command": swapper}, changes="direct", timeout=120)
        )
        applied = await pool.call("bash", {"command": tracked}, timeout=120)
        swapped = await swap
    assert swapped.value is not None, swapped
    assert swapped.value["stdout"] == "swapped\n", swapped
    assert not (hooks / "pre-commit").exists()
    assert applied.status is Status.ERROR, applied
    assert applied.error_code == "CONFLICT"
    assert "d is no longer a directory" in (applied.error or "")
    by_path = {c["path"]: c for c in applied.changes or []}
    assert by_path["d/pre-commit"]["applied"] is False
    _exactly_applied(workspace, applied.changes)


async def test_a_forged_j_d_is_out_of_reach_from_the_first_call_and_undo_refuses_it(
    workspace: Path, tmp_path: Path
) -> None:
    hooks = _git(workspace)
    (workspace / "f").write_text("original\n")
    logs = workspace / "logs"
    logs.mkdir()
    journal = logs / "j.jsonl"
    async with Pool(workspace, journal=journal, config=_config(), changes="tracked") as pool:
        made = await pool.call("bash", {"command": "echo new > f"})
        assert made.ok, made.error
    store = Path(f"{journal}.d")
    images = store / "changes" / made.call_id / "images.json"
    original = hashlib.sha256(b"original\n").hexdigest()
    evil = hashlib.sha256(HOOK.encode()).hexdigest()
    forged = json.loads(images.read_text())
    forged["paths"][".git/hooks/pre-commit"] = {
        "pre": {"type": "file", "mode": 0o755, "sha256": evil},
        "post": {"type": "absent"},
    }
    forge = (
        f"printf '%s' '{HOOK}' > {store}/objects/{evil} &&"
        f" printf '%s' '{json.dumps(forged)}' > {images} &&"
        f" printf '%s' '{HOOK}' > {store}/objects/{original}; ls {store}"
    )
    # A reopened pool's first call, direct: J.d is hidden from it already.
    async with Pool(workspace, journal=journal, config=_config()) as pool:
        tried = await pool.call("bash", {"command": forge}, call_id="forger")
        assert tried.value is not None, tried
        assert tried.value["exit_code"] != 0, tried
        assert (store / "objects" / original).read_text() == "original\n"
        assert (await pool.undo(made.call_id)) == ["f"]
    assert (workspace / "f").read_text() == "original\n"
    assert not (hooks / "pre-commit").exists()


async def test_undo_refuses_forged_pre_images_and_writes_nothing(
    workspace: Path, tmp_path: Path
) -> None:
    hooks = _git(workspace)
    (workspace / "f").write_text("original\n")
    journal = tmp_path / "j.jsonl"
    store = Path(f"{journal}.d")
    original = hashlib.sha256(b"original\n").hexdigest()
    evil = hashlib.sha256(HOOK.encode()).hexdigest()
    async with Pool(workspace, journal=journal, config=_config(), changes="tracked") as pool:
        first = await pool.call("bash", {"command": "echo new > f"})
        second = await pool.call("bash", {"command": "echo g > g"})
        assert first.ok
        assert second.ok
        # An object's content replaced (images.json intact): the pre-image would be the hook.
        (store / "objects" / original).write_text(HOOK)
        with pytest.raises(UndoConflict, match="not what was journaled") as refused:
            await pool.undo(first.call_id)
        assert refused.value.path == "f"
        # images.json rewritten to name a hook, its object planted.
        images = store / "changes" / second.call_id / "images.json"
        forged = json.loads(images.read_text())
        forged["paths"][".git/hooks/pre-commit"] = {
            "pre": {"type": "file", "mode": 0o755, "sha256": evil},
            "post": {"type": "absent"},
        }
        images.write_text(json.dumps(forged))
        (store / "objects" / evil).write_text(HOOK)
        with pytest.raises(UndoConflict, match=r"images\.json"):
            await pool.undo(second.call_id)
    assert (workspace / "f").read_text() == "new\n"
    assert (workspace / "g").read_text() == "g\n"
    assert not (hooks / "pre-commit").exists()


async def test_pre_images_are_never_read_through_a_symlink_to_outside(
    workspace: Path, tmp_path: Path
) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    secret = b"the operator's secret\n"
    (outside / "secret").write_bytes(secret)
    (workspace / "lnk").symlink_to(outside)
    (workspace / "f").write_text("original\n")
    (workspace / "logs").mkdir()
    journal = workspace / "logs" / "j.jsonl"  # J.d in the workspace, as `run --journal` has it
    secrets = {hashlib.sha256(secret).hexdigest()}
    commands: dict[str, str] = {}
    if os.access("/etc/shadow", os.R_OK):  # root: root's own secret, as the red team took it
        with open("/etc/shadow", "rb") as shadow:  # noqa: ASYNC230 (before the pool)
            secrets.add(hashlib.sha256(shadow.read()).hexdigest())
        (workspace / "etc").symlink_to("/etc")
        commands["etc/shadow"] = "rm etc && mkdir etc && echo mine > etc/shadow"
    commands["lnk/secret"] = "rm lnk && mkdir lnk && echo mine > lnk/secret"
    # A direct call started before the pool's first tracked call, to read back what J.d keeps.
    reader = (
        "while [ ! -e go ]; do sleep 0.01; done;"
        " cat logs/j.jsonl.d/objects/* 2>/dev/null; ls logs/j.jsonl.d/objects"
    )
    async with Pool(workspace, journal=journal, config=_config(), changes="tracked") as pool:
        reading = asyncio.create_task(
            pool.call("bash", {"command": reader}, changes="direct", timeout=60)
        )
        # The reader runs (a worker took it) before the first tracked call is made.
        await wait_until(lambda: len(pool.running()) == 1, what="the reader running")
        for path, command in commands.items():
            outcome = await pool.call("bash", {"command": command})
            assert outcome.ok, outcome.error
            by_path = {c["path"]: c for c in outcome.changes or []}
            # Below a symlink is not in the workspace: the call created the file.
            assert by_path[path]["kind"] == "created"
            assert (workspace / path).read_text() == "mine\n"
        kept = await pool.call("bash", {"command": "echo new > f && touch go"})
        assert kept.ok, kept.error
        read = await reading
    assert hashlib.sha256(b"original\n").hexdigest() in _objects(journal)
    assert read.value is not None, read
    assert "original" not in read.value["stdout"], read.value
    assert not secrets & set(_objects(journal)), "a file from outside the workspace is in J.d"
    assert secret not in _objects(journal).values()
    assert (outside / "secret").read_bytes() == secret


async def test_a_change_set_past_the_output_limit_is_applied_and_listed_whole(
    workspace: Path, tmp_path: Path
) -> None:
    journal = tmp_path / "j.jsonl"
    # The apply worker's answer is bounded as a file tool's (keep_output_bytes): 2,000 paths
    # are far past 1 KiB.
    config = _config().override(calls={"keep_output_bytes": 1024})
    async with Pool(workspace, journal=journal, config=config, changes="transactional") as pool:
        outcome = await pool.call(
            "bash", {"command": "mkdir many && cd many && seq 1 2000 | split -l 1 -a 4"}
        )
    assert outcome.ok, outcome.error
    assert outcome.changes is not None
    assert len(outcome.changes) == 2001
    assert all(change["applied"] for change in outcome.changes)
    assert len(os.listdir(workspace / "many")) == 2000


@pytest.mark.parametrize("mode", ["transactional", "tracked"])
async def test_a_change_set_too_large_is_not_applied(
    workspace: Path, tmp_path: Path, mode: str
) -> None:
    journal = tmp_path / "j.jsonl"
    config = _config().override(workspace={"max_change_paths": 50})
    async with Pool(workspace, journal=journal, config=config, changes=mode) as pool:
        many = await pool.call(
            "bash", {"command": "mkdir many && cd many && seq 1 60 | split -l 1 -a 2"}
        )
        few = await pool.call("bash", {"command": "mkdir few && cd few && seq 1 10 | split -l 1"})
    assert many.status is Status.ERROR
    assert many.error_code == "CHANGE_SET_TOO_LARGE"
    assert "max_change_paths" in (many.error or "")
    assert many.changes == []
    assert not (workspace / "many").exists()
    assert few.ok, few.error
    assert len(os.listdir(workspace / "few")) == 10
    # A call that would not be applied anyway (transactional, timed out) keeps its status.
    async with Pool(workspace, journal=journal, config=config, changes=mode) as pool:
        timed = await pool.call(
            "bash", {"command": "mkdir t && cd t && seq 1 60 | split -l 1 -a 2 && sleep 60"},
            timeout=2,
        )  # fmt: skip
    assert timed.status is (Status.TIMEOUT if mode == "transactional" else Status.ERROR)
    assert (timed.error_code == "CHANGE_SET_TOO_LARGE") is (mode == "tracked")
    assert timed.changes == []
    assert not (workspace / "t").exists()
    config = _config().override(workspace={"max_change_bytes": 1000})
    async with Pool(workspace, journal=journal, config=config, changes=mode) as pool:
        big = await pool.call("bash", {"command": "head -c 2000 /dev/zero > big"})
    assert big.error_code == "CHANGE_SET_TOO_LARGE"
    assert "max_change_bytes" in (big.error or "")
    assert not (workspace / "big").exists()


async def test_protected_paths_hold_in_apply_and_undo(workspace: Path, tmp_path: Path) -> None:
    journal = tmp_path / "j.jsonl"
    # A pattern with no fixed prefix: bash alone cannot hold it (no walk after each call); a
    # change set lists every path, so the apply holds it.
    protected = [*DEFAULT_PROTECTED, "**/*.pem"]
    config = _config(protected=protected)
    async with Pool(workspace, journal=journal, config=config, changes="tracked") as pool:
        made = await pool.call("bash", {"command": "echo key > id.pem && echo ok > ok.txt"})
        ci = await pool.call("bash", {"command": "mkdir ci && echo hook > ci/pre-push"})
    assert made.ok, made.error
    by_path = {c["path"]: c for c in made.changes or []}
    assert by_path["id.pem"]["applied"] is False
    assert by_path["ok.txt"]["applied"] is True
    assert made.value is not None
    assert [e["path"] for e in made.value["protected_set_aside"]] == ["id.pem"]
    assert not (workspace / "id.pem").exists()
    assert (workspace / "ok.txt").exists()
    # ci/ becomes protected after the call that made it: its undo leaves ci/pre-push be.
    config = _config(protected=[*protected, "ci/**"])
    async with Pool(workspace, journal=journal, config=config) as pool:
        undone = await pool.undo(ci.call_id)
    assert "ci/pre-push" not in undone
    assert (workspace / "ci" / "pre-push").read_text() == "hook\n"


async def test_a_second_undo_says_the_call_was_already_undone(
    workspace: Path, tmp_path: Path
) -> None:
    journal = tmp_path / "j.jsonl"
    async with Pool(workspace, journal=journal, config=_config(), changes="tracked") as pool:
        made = await pool.call("write", {"path": "n.txt", "content": "n\n"})
        assert await pool.undo(made.call_id) == ["n.txt"]
        with pytest.raises(ValueError, match=f"call {made.call_id} was already undone"):
            await pool.undo(made.call_id)
    assert not (workspace / "n.txt").exists()


async def test_a_change_set_journaled_without_its_hash_is_not_undone(
    workspace: Path, tmp_path: Path
) -> None:
    journal = tmp_path / "j.jsonl"
    async with Pool(workspace, journal=journal, config=_config(), changes="tracked") as pool:
        made = await pool.call("write", {"path": "n.txt", "content": "n\n"})
        assert made.images_sha256 is not None
    # As an older sandbx-pool journaled it: no images_sha256 in the outcome record.
    lines = [json.loads(line) for line in journal.read_text().splitlines()]
    for line in lines:
        line.pop("images_sha256", None)
    journal.write_text("".join(json.dumps(line) + "\n" for line in lines))
    async with Pool(workspace, journal=journal, config=_config()) as pool:
        with pytest.raises(ValueError, match="no hash of its pre-images was journaled"):
            await pool.undo(made.call_id)
    assert (workspace / "n.txt").read_text() == "n\n"


@pytest.mark.parametrize("openat2", [True, False])
def test_paths_beneath_follow_no_symlink_with_openat2_or_the_walk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, openat2: bool
) -> None:
    """What apply and undo reach their paths through (workers.beneath): openat2, or where the
    kernel has none, the O_NOFOLLOW walk, which must refuse the same."""
    if not openat2:
        monkeypatch.setattr(beneath, "_openat2_works", False)
    root = tmp_path / "root"
    (root / "d").mkdir(parents=True)
    (root / "d" / "f").write_text("f\n")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret").write_text("s\n")
    (root / "lnk").symlink_to(tmp_path / "outside")
    (root / "file").write_text("x\n")
    with beneath.Beneath(str(root)) as tree:
        assert tree.lstat("d/f") is not None
        assert tree.lstat("lnk/secret") is None  # below a symlink: not in the tree
        assert tree.lstat("lnk") is not None
        fd = tree.read_file("d/f")
        os.close(fd)
        for path in ("lnk/secret", "lnk", "../root/d/f"):
            with pytest.raises(OSError, match=r"symbolic links|climbs") as raised:
                os.close(tree.read_file(path))
            assert raised.value.errno == errno.ELOOP, path
        with pytest.raises(beneath.Swapped) as swapped:
            tree.parent("lnk/secret")
        assert swapped.value.path == "lnk"
        with pytest.raises(beneath.Swapped) as swapped:
            tree.parent("file/x")
        assert swapped.value.path == "file"
        dir_fd, name = tree.parent("d/f")
        try:
            assert name == "f"
            assert os.stat(name, dir_fd=dir_fd).st_size == 2
        finally:
            os.close(dir_fd)
