"""The approval gate, through the Pool: config rules and the Python callback.

Every denial is checked the same way: status ``denied``, the error names what refused it,
``started`` is False, no worker took the call (the idle workers are the same processes before
and after, and the journal has no ``started`` record for it), the tool's effect did not happen,
and the journal's outcome record says ``denied`` with the same error.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import MARKER, marked_config
from helpers import wait_until

from sandbx_pool import Config, ConfigError, Outcome, Pool, Status, load_config
from sandbx_pool.gate import Gate
from sandbx_pool.journal.reader import read_journal
from sandbx_pool.journal.records import OutcomeRecord, StartedRecord
from sandbx_pool.workers.schemas import ToolArgs, WriteArgs, parse_args

RULES_TOML = r"""
[[gate.rules]]
name = "echo is harmless"
action = "allow"
tool = "bash"
command = '^echo '

[[gate.rules]]
name = "no rm -rf"
action = "deny"
tool = "bash"
command = '\brm\s+-(rf|fr)\b'

[[gate.rules]]
action = "deny"
tool = "write"
path = "secrets/**"
"""

WORKERS = 2


def children_of(pid: int) -> set[int]:
    """Live processes whose parent is ``pid``."""
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[1]) == pid:
            found.add(int(entry))
    return found


class Watched:
    """A pool whose forked processes (the template's children) the test can compare."""

    def __init__(self, pool: Pool, journal: Path) -> None:
        self.pool = pool
        self.journal = journal

    def workers(self) -> set[int]:
        template = children_of(os.getpid()) - {os.getpid()}
        return {pid for parent in template for pid in children_of(parent)}

    async def settled(self) -> set[int]:
        """The idle workers, once every pre-forked one is up and every used one gone."""
        await wait_until(
            lambda: (
                f"Workers: {WORKERS} idle, 0 starting" in repr(self.pool)
                and len(self.workers()) == WORKERS
            )
        )
        return self.workers()

    async def denied(self, tool: str, args: dict[str, Any], names: str, **kw: Any) -> Outcome:
        before = await self.settled()
        outcome = await self.pool.call(tool, args, **kw)
        assert outcome.status is Status.DENIED, outcome
        assert outcome.error is not None
        assert names in outcome.error
        assert not outcome.started
        assert outcome.worker_pid is None
        assert self.pool.running() == []
        assert self.workers() == before  # no worker was taken, so none was replaced
        return outcome

    def check_journal(self, denied: list[Outcome]) -> None:
        """After close: each denial's outcome record, and no worker ever started it."""
        records = read_journal(self.journal).records
        for outcome in denied:
            (record,) = [
                r for r in records if isinstance(r, OutcomeRecord) and r.call_id == outcome.call_id
            ]
            assert record.status == "denied"
            assert record.error == outcome.error
            assert not record.started
            assert not any(
                isinstance(r, StartedRecord) and r.call_id == outcome.call_id for r in records
            )


@contextlib.asynccontextmanager
async def watched_pool(
    workspace: Path, tmp_path: Path, config: Config, approve: Any = None
) -> AsyncIterator[Watched]:
    journal = tmp_path / "journal.jsonl"
    async with Pool(workspace, config=config, journal=journal, approve=approve) as pool:
        yield Watched(pool, journal)


def rules_config(tmp_path: Path, toml: str = RULES_TOML) -> Config:
    path = tmp_path / "gate.toml"
    path.write_text(toml)
    return load_config(path).override(
        pool={"workers": WORKERS}, env={"set": {MARKER: os.environ[MARKER]}}
    )


# -- rules from the config ---------------------------------------------------------------------


async def test_config_rules_deny_before_anything_forks(workspace: Path, tmp_path: Path) -> None:
    (workspace / "victim").mkdir()
    (workspace / "victim" / "precious.txt").write_text("keep me\n")
    denied: list[Outcome] = []
    async with watched_pool(workspace, tmp_path, rules_config(tmp_path)) as watched:
        denied.append(
            await watched.denied(
                "bash",
                {"command": "cd victim && rm -rf ."},
                "gate rule 'no rm -rf' (gate.rules[1])",
            )
        )
        for path in ["secrets/key.pem", "./secrets/a/b.txt", "src/../secrets/key.pem"]:
            denied.append(
                await watched.denied("write", {"path": path, "content": "x"}, "gate.rules[2]")
            )
        # Outside the rules' reach: a write elsewhere, a read of secrets, other bash.
        allowed = [
            await watched.pool.call("write", {"path": "notes/secrets.txt", "content": "x"}),
            await watched.pool.call("read", {"path": "hello.txt"}),
            await watched.pool.call("bash", {"command": "rm -r victim/nothing-here || true"}),
        ]
        assert [o.status for o in allowed] == [Status.OK] * 3
    assert (workspace / "victim" / "precious.txt").read_text() == "keep me\n"
    assert not (workspace / "secrets").exists()
    watched.check_journal(denied)


async def test_an_allow_rule_stops_the_evaluation(workspace: Path, tmp_path: Path) -> None:
    async with watched_pool(workspace, tmp_path, rules_config(tmp_path)) as watched:
        # "no rm -rf" would match, but "echo is harmless" comes first and decides.
        echoed = await watched.pool.call("bash", {"command": "echo rm -rf /"})
        assert echoed.status is Status.OK, echoed
        assert echoed.value is not None
        assert echoed.value["stdout"] == "rm -rf /\n"
        assert echoed.started


def test_an_invalid_regex_is_a_config_error_naming_the_rule(
    workspace: Path, tmp_path: Path
) -> None:
    bad = RULES_TOML.replace(r"'\brm\s+-(rf|fr)\b'", r"'\brm\s+-(rf|fr\b'")
    path = tmp_path / "bad.toml"
    path.write_text(bad)
    with pytest.raises(ConfigError, match=r"bad\.toml: gate\.rules\[1\]: invalid command regex"):
        Pool(workspace, config=path)
    with pytest.raises(ConfigError, match="in rule 'no rm -rf'"):
        Pool(workspace, config=path)
    with pytest.raises(ConfigError, match=r"<override>: gate\.rules\[0\]"):
        marked_config(gate={"rules": [{"action": "deny", "command": "("}]})


@pytest.mark.parametrize(
    ("cwd", "path"),
    [("secrets", "key.pem"), (None, "{workspace}/secrets/key.pem")],
)
def test_path_rules_see_the_path_relative_to_the_workspace(
    workspace: Path, tmp_path: Path, cwd: str | None, path: str
) -> None:
    gate = Gate(rules_config(tmp_path).gate.rules)
    args = parse_args("write", {"path": path.format(workspace=workspace), "content": "x"})
    call_cwd = str(workspace / cwd) if cwd else str(workspace)
    assert gate.denial("write", args, workspace=str(workspace), cwd=call_cwd) == (
        "denied by gate.rules[2]"
    )


async def test_a_cwd_or_an_absolute_path_does_not_slip_past_a_path_rule(
    workspace: Path, tmp_path: Path
) -> None:
    async with watched_pool(workspace, tmp_path, rules_config(tmp_path)) as watched:
        (workspace / "secrets").mkdir()
        await watched.denied(
            "write", {"path": "k.pem", "content": "x"}, "gate.rules[2]", cwd="secrets"
        )
        await watched.denied(
            "write", {"path": str(workspace / "secrets/k.pem"), "content": "x"}, "gate.rules[2]"
        )


# -- the callback ------------------------------------------------------------------------------


async def test_the_callback_refuses_with_its_reason(workspace: Path, tmp_path: Path) -> None:
    asked: list[tuple[str, ToolArgs]] = []

    def approve(tool: str, args: ToolArgs) -> bool | str | None:
        asked.append((tool, args))
        if isinstance(args, WriteArgs) and args.path.endswith(".env"):
            return "no writing environment files"
        if tool == "bash" and "curl" in getattr(args, "command", ""):
            return False
        return None

    config = marked_config(pool={"workers": WORKERS})
    denied: list[Outcome] = []
    async with watched_pool(workspace, tmp_path, config, approve) as watched:
        denied.append(
            await watched.denied(
                "write",
                {"path": "prod.env", "content": "KEY=1"},
                "denied by the approval callback: no writing environment files",
            )
        )
        denied.append(
            await watched.denied(
                "bash",
                {"command": "curl http://example.com > got"},
                "denied by the approval callback",
            )
        )
        assert (await watched.pool.call("write", {"path": "a.txt", "content": "x"})).ok
        # Refused before the gate (lexically): the callback is never asked.
        assert (await watched.pool.call("read", {"path": "../x"})).status is Status.DENIED
    assert not (workspace / "prod.env").exists()
    assert not (workspace / "got").exists()
    # It saw the validated arguments, not the raw dict.
    assert [(tool, type(args).__name__) for tool, args in asked] == [
        ("write", "WriteArgs"),
        ("bash", "BashArgs"),
        ("write", "WriteArgs"),
    ]
    watched.check_journal(denied)


@pytest.mark.parametrize(
    ("approve", "names"),
    [
        (lambda tool, args: 1 / 0, "the approval callback raised ZeroDivisionError"),
        (lambda tool, args: False, "denied by the approval callback"),
    ],
)
async def test_a_callback_that_fails_or_says_no_denies(
    workspace: Path, tmp_path: Path, approve: Callable[[str, ToolArgs], Any], names: str
) -> None:
    config = marked_config(pool={"workers": WORKERS})
    async with watched_pool(workspace, tmp_path, config, approve) as watched:
        outcome = await watched.denied("write", {"path": "x.txt", "content": "x"}, names)
    assert not (workspace / "x.txt").exists()
    watched.check_journal([outcome])


async def test_rules_and_callback_must_both_allow(workspace: Path, tmp_path: Path) -> None:
    def approve(tool: str, args: ToolArgs) -> str | None:
        return "only reads today" if tool != "read" else None

    async with watched_pool(workspace, tmp_path, rules_config(tmp_path), approve) as watched:
        # Allowed by the "echo is harmless" rule, refused by the callback.
        await watched.denied("bash", {"command": "echo hi"}, "only reads today")
        # Refused by a rule: the callback is not needed to refuse it.
        await watched.denied("write", {"path": "secrets/k", "content": "x"}, "gate.rules[2]")
        assert (await watched.pool.call("read", {"path": "hello.txt"})).ok
