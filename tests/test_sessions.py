"""Shell sessions (sandbx_pool.sessions, workers.tools.shell_state): the cwd and exports a bash
call leaves are the next call's in its session, and nothing a hostile command does to its
report moves the session out of the workspace, loses the call's result, or shows in its output.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import pytest
from conftest import marked_config
from helpers import journal_records, wait_until

from sandbx_pool import CancelToken, Pool, Status
from sandbx_pool.workers.protocol import SESSION_ENV_BYTES


async def _bash(pool: Pool, command: str, session: str = "s", **kwargs: Any) -> Any:
    outcome = await pool.call("bash", {"command": command}, session=session, timeout=30, **kwargs)
    assert outcome.value is not None or outcome.status is not Status.OK, outcome
    return outcome


def _stdout(outcome: Any) -> str:
    assert outcome.status is Status.OK, outcome
    text: str = outcome.value["stdout"]
    return text


# -- what a session carries -------------------------------------------------------------------


async def test_cwd_and_exports_carry_to_the_next_call(pool: Pool, workspace: Path) -> None:
    first = await _bash(pool, "cd src && export FOO=bar && BAR=not-exported")
    assert first.session["updated"] is True
    assert first.session["cwd"] == str(workspace / "src")
    second = await _bash(pool, 'pwd; echo "$FOO|${BAR-}"')
    assert _stdout(second) == f"{workspace / 'src'}\nbar|\n"
    assert await pool.session("s") == {"cwd": str(workspace / "src"), "env": {"FOO": "bar"}}
    # Without a session every call starts in the root with the pool's environment.
    plain = await pool.call("bash", {"command": 'pwd; echo "${FOO-unset}"'})
    assert _stdout(plain) == f"{workspace}\nunset\n"
    assert plain.session is None


async def test_values_keep_newlines_and_equals_signs_and_unset_drops(pool: Pool) -> None:
    await _bash(pool, "export A=$'line1\\nline2' B='x=y=z' C=$'\\x01\\x7f'")
    assert (await pool.session("s"))["env"] == {"A": "line1\nline2", "B": "x=y=z", "C": "\x01\x7f"}
    out = await _bash(pool, 'printf "%s|" "$A" "$B"; unset A')
    assert _stdout(out) == "line1\nline2|x=y=z|"
    assert (await pool.session("s"))["env"] == {"B": "x=y=z", "C": "\x01\x7f"}


async def test_a_value_that_is_not_utf8_is_dropped_and_said(pool: Pool) -> None:
    out = await _bash(pool, "export GOOD=1 BIN=$'\\xff\\xfe'")
    assert out.session["env"] == {"GOOD": "1"}
    assert "BIN" in out.session["note"]


async def test_a_non_zero_exit_and_set_e_still_update_the_session(
    pool: Pool, workspace: Path
) -> None:
    out = await _bash(pool, "cd src; export X=1; exit 3")
    assert out.value["exit_code"] == 3
    assert out.session["updated"] is True
    failed = await _bash(pool, "set -e; cd ..; export Y=2; false; echo never")
    assert (failed.value["exit_code"], failed.value["stdout"]) == (1, "")
    assert await pool.session("s") == {"cwd": str(workspace), "env": {"X": "1", "Y": "2"}}


async def test_the_call_env_wins_for_its_call_and_the_session_keeps_its_own(pool: Pool) -> None:
    await _bash(pool, "export V=session")
    out = await _bash(pool, 'echo "$V"', env={"V": "call"})
    assert _stdout(out) == "call\n"
    assert (await pool.session("s"))["env"] == {"V": "session"}
    changed = await _bash(pool, "export V=changed", env={"V": "call"})
    assert changed.session["env"] == {"V": "changed"}


async def test_sessions_are_independent_and_end_session_forgets(
    pool: Pool, workspace: Path
) -> None:
    await _bash(pool, "cd src; export WHO=a", session="a")
    await _bash(pool, "export WHO=b", session="b")
    assert _stdout(await _bash(pool, 'pwd; echo "$WHO"', session="b")) == f"{workspace}\nb\n"
    assert pool.end_session("a") is True
    assert pool.end_session("a") is False
    assert await pool.session("a") == {"cwd": str(workspace), "env": {}}


async def test_file_tools_run_in_the_sessions_cwd(pool: Pool, workspace: Path) -> None:
    await _bash(pool, "cd src")
    read = await pool.call("read", {"path": "a.py"}, session="s")
    assert read.status is Status.OK
    assert "print('a')" in read.value["content"]
    wrote = await pool.call("write", {"path": "new.txt", "content": "x"}, session="s")
    assert wrote.status is Status.OK
    assert (workspace / "src" / "new.txt").read_text() == "x"
    assert wrote.session["updated"] is False
    assert (await pool.session("s"))["cwd"] == str(workspace / "src")
    # An explicit cwd wins for that call, relative to the root as always.
    listed = await pool.call("ls", {}, session="s", cwd=".")
    assert "hello.txt" in {e["name"] for e in listed.value["entries"]}


async def test_argv_runs_in_the_session_and_leaves_it_as_it_was(
    pool: Pool, workspace: Path
) -> None:
    await _bash(pool, "cd src; export Q=1")
    out = await pool.call("bash", {"argv": ["sh", "-c", 'pwd; echo "$Q"; cd /']}, session="s")
    assert _stdout(out) == f"{workspace / 'src'}\n1\n"
    assert out.session["updated"] is False
    assert "argv" in out.session["note"]


# -- confinement -------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["/tmp", "/", "link-out", "../.."])
async def test_a_cd_out_of_the_workspace_keeps_the_previous_cwd(
    pool: Pool, workspace: Path, tmp_path: Path, where: str
) -> None:
    (workspace / "link-out").symlink_to(tmp_path)
    await _bash(pool, "cd src")
    out = await _bash(pool, f"cd {where}; export AFTER=1; pwd -P")
    assert out.status is Status.OK
    assert out.session["cwd"] == str(workspace / "src")
    if out.value["stdout"] != f"{workspace / 'src'}\n":  # the confinement let the cd happen
        assert "outside the workspace" in out.session["note"]
    assert out.session["env"] == {"AFTER": "1"}  # what else it left still counts
    assert _stdout(await _bash(pool, "pwd")) == f"{workspace / 'src'}\n"


async def test_a_symlink_inside_the_workspace_is_kept_resolved(pool: Pool, workspace: Path) -> None:
    (workspace / "alias").symlink_to(workspace / "src")
    out = await _bash(pool, "cd alias")
    assert out.session["cwd"] == str(workspace / "src")


async def test_a_deleted_cwd_falls_back_to_the_nearest_directory_left(
    pool: Pool, workspace: Path
) -> None:
    (workspace / "src" / "deep" / "er").mkdir(parents=True)
    out = await _bash(pool, 'cd src/deep/er && rm -rf "$PWD" ../../deep')
    assert out.session["cwd"] == str(workspace / "src")
    assert "removed" in out.session["note"]
    # Removed by another call between two calls of the session: it starts above it.
    await _bash(pool, "mkdir -p gone/sub && cd gone/sub")
    removed = await pool.call("bash", {"command": "rm -rf src/gone"})
    assert removed.status is Status.OK
    nxt = await _bash(pool, "pwd")
    assert _stdout(nxt) == f"{workspace / 'src'}\n"
    assert "no longer exists" in nxt.session["note"]


async def test_reserved_variables_are_never_carried(pool: Pool, workspace: Path) -> None:
    before = _stdout(await _bash(pool, 'echo "$HOME|$TMPDIR"')).strip()
    out = await _bash(
        pool,
        "export HOME=/ TMPDIR=/ USER=x LOGNAME=x PWD=/ OLDPWD=/ SHLVL=9 KEPT=1",
    )
    assert out.session["env"] == {"KEPT": "1"}
    # Options that would trace the next call's wrapper into its output are not carried either.
    traced = await _bash(pool, "set -x; export SHELLOPTS BASHOPTS BASH_ENV=/dev/null ENV=x")
    assert "SHELLOPTS" not in traced.session["env"]
    assert "BASH_ENV" not in traced.session["env"]
    assert (await _bash(pool, "echo quiet")).value["stderr"] == ""
    home, tmpdir = _stdout(await _bash(pool, 'echo "$HOME|$TMPDIR"')).strip().split("|")
    assert "/" not in (home, tmpdir)
    assert before != "/|/"


async def test_a_sessions_path_is_applied_after_the_confinement(
    pool: Pool, workspace: Path, tmp_path: Path
) -> None:
    # A PATH entry outside the workspace would widen the Landlock rules if the confinement
    # read it: the session's exports are applied only once it is built.
    outside = tmp_path / "tools" / "bin"
    outside.mkdir(parents=True)
    (outside / "secret").write_text("s")
    await _bash(pool, f'export PATH="{outside}:$PATH"')
    out = await _bash(pool, f'echo "$PATH"; cat {outside}/secret')
    assert out.value["stdout"].startswith(f"{outside}:")
    plain = await pool.call(
        "bash", {"command": f"cat {outside}/secret"}, env={"PATH": f"{outside}:/usr/bin:/bin"}
    )
    if plain.status is Status.OK and plain.value["exit_code"] == 0:
        # The pool's own PATH (the caller's env=) is trusted and widens the rules: the
        # session's must not have.
        assert out.value["exit_code"] != 0, out.value


# -- hostile commands ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "command",
    ["exec true", "kill -9 $$", "trap 'echo mine' EXIT; exit 0", "exec {fd}>&-; exec 9>&-"],
)
async def test_a_shell_that_cannot_report_keeps_the_previous_state(
    pool: Pool, workspace: Path, command: str
) -> None:
    await _bash(pool, "cd src; export KEEP=1")
    out = await _bash(pool, f"cd ..; export LOST=1; {command}")
    if out.session["updated"]:
        # Closing some descriptor that is not the report's: the report still came.
        assert command.startswith("exec {fd}")
        return
    assert out.status is Status.OK
    assert "did not report" in out.session["note"]
    assert await pool.session("s") == {"cwd": str(workspace / "src"), "env": {"KEEP": "1"}}


@pytest.mark.parametrize(
    ("parts", "size", "said"),
    [
        # One too large for any program's environment (the kernel's 128 KiB a string): kept,
        # it would make every later exec of bash fail. Then three that are each fine and
        # together over the session's bound.
        (1, 200 * 1024, "too large for a program's environment"),
        (3, (SESSION_ENV_BYTES + 1024) // 3, f"over {SESSION_ENV_BYTES}"),
        # More than the report may carry: the worker stops reading it.
        (4, 100 * 1024, f"passed {SESSION_ENV_BYTES}"),
    ],
)
async def test_a_huge_export_is_not_kept_and_the_result_is(
    pool: Pool, parts: int, size: int, said: str
) -> None:
    await _bash(pool, "export SMALL=1")
    exports = "; ".join(f'export BIG{n}="$x"' for n in range(parts))
    command = f"x=$(head -c {size} /dev/zero | tr '\\0' x); {exports}; echo done; cd src"
    out = await _bash(pool, command)
    assert _stdout(out) == "done\n"
    assert said in out.session["note"]
    state = await pool.session("s")
    assert state["env"] == {"SMALL": "1"}
    assert state["cwd"].endswith("/src")  # the cwd is still taken
    assert _stdout(await _bash(pool, "echo next")) == "next\n"


async def test_a_flood_on_the_report_descriptor_is_cut_off(pool: Pool) -> None:
    # A command that finds the report's descriptor and writes gigabytes into it.
    out = await _bash(
        pool,
        "for fd in /proc/$$/fd/*; do n=${fd##*/}; [ $n -gt 2 ] && "
        "[ -p /proc/$$/fd/$n ] && (head -c 100000000 /dev/zero >&$n) 2>/dev/null; done; echo ok",
    )
    assert _stdout(out) == "ok\n"


async def test_thousands_of_exports_are_kept(pool: Pool) -> None:
    out = await _bash(pool, "for i in $(seq 3000); do export V$i=$i; done")
    assert len(out.session["env"]) == 3000
    check = await _bash(pool, 'echo "$V1 $V3000"')
    assert _stdout(check) == "1 3000\n"


async def test_the_report_never_shows_in_the_output(pool: Pool) -> None:
    chunks: list[str] = []
    args = {"command": "set -x; cd src; export T=1; echo out; echo err >&2", "merge_stderr": True}
    out = await pool.call("bash", args, session="s", on_output=lambda c: chunks.append(c.data))
    text = _stdout(out)
    assert "out\n" in text
    assert "err\n" in text
    for shown in (text, "".join(chunks)):
        assert "sbx" not in shown
        assert "env -0" not in shown
        assert "__" not in shown
    quiet = await _bash(pool, "echo $1; echo x >&2")
    assert (quiet.value["stdout"], quiet.value["stderr"]) == ("\n", "x\n")


async def test_kept_output_bytes_still_apply(workspace: Path, tmp_path: Path) -> None:
    config = marked_config(pool={"workers": 2}, calls={"keep_output_bytes": 4096})
    async with Pool(workspace, journal=tmp_path / "j.jsonl", config=config) as pool:
        out = await _bash(pool, "seq 100000; cd src")
        assert "omitted" in out.value["stdout"]
        assert out.value["omitted_bytes"] > 0
        assert out.session["cwd"].endswith("/src")


# -- calls that do not end ok ------------------------------------------------------------------


async def test_killed_calls_do_not_change_the_session(pool: Pool, workspace: Path) -> None:
    await _bash(pool, "cd src; export K=1")
    timed = await pool.call(
        "bash", {"command": "cd ..; export K=2; sleep 30"}, session="s", timeout=0.5
    )
    assert timed.status is Status.TIMEOUT
    assert timed.session["updated"] is False
    token = CancelToken()
    started = asyncio.Event()

    def on_output(chunk: Any) -> None:
        started.set()

    cancelled = asyncio.create_task(
        pool.call(
            "bash",
            {"command": "cd ..; export K=3; echo go; sleep 30"},
            session="s",
            cancel=token,
            on_output=on_output,
        )
    )
    await asyncio.wait_for(started.wait(), 20)
    token.cancel("stop")
    assert (await cancelled).status is Status.CANCELLED
    config_limit = pool.config.calls.max_output_bytes
    flood = await _bash(pool, f"cd ..; export K=4; head -c {config_limit + 10} /dev/zero")
    assert flood.status is Status.OUTPUT_LIMIT
    assert await pool.session("s") == {"cwd": str(workspace / "src"), "env": {"K": "1"}}


# -- concurrency ---------------------------------------------------------------------------------


async def test_session_state_waits_for_the_calls_in_flight(pool: Pool) -> None:
    running = asyncio.create_task(_bash(pool, "sleep 0.2; export LATE=1"))
    # pool.call takes the session's turn before anything it awaits: the session is there as
    # soon as the call has started, whatever the loop does next.
    await wait_until(lambda: pool.has_session("s"), what="the call's session")
    assert (await pool.session("s"))["env"] == {"LATE": "1"}
    assert (await running).status is Status.OK


async def test_concurrent_calls_of_one_session_run_in_call_order(pool: Pool) -> None:
    await _bash(pool, "export N=")
    outs = await asyncio.gather(
        *(_bash(pool, f'export N="${{N}}{i}"; echo "$N"') for i in range(6))
    )
    assert [_stdout(o) for o in outs] == [f"{''.join(map(str, range(i + 1)))}\n" for i in range(6)]
    assert (await pool.session("s"))["env"] == {"N": "012345"}


async def test_a_call_cancelled_while_waiting_its_turn_never_starts(pool: Pool) -> None:
    token = CancelToken()
    started = asyncio.Event()
    first = asyncio.create_task(
        pool.call(
            "bash",
            {"command": "echo go; sleep 30"},
            session="s",
            cancel=token,
            on_output=lambda c: started.set(),
        )
    )
    await asyncio.wait_for(started.wait(), 20)
    waiting_token = CancelToken()
    waiting = asyncio.create_task(
        pool.call("bash", {"command": "export W=1"}, session="s", cancel=waiting_token, call_id="w")
    )
    # Until its intent is durable: its driver was woken before our flush was, and it went on to
    # wait for the session's turn.
    assert pool.journal is not None
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 20
    while True:
        await pool.journal.flush()
        if any(r["call_id"] == "w" for r in journal_records(pool.journal.path)):
            break
        assert loop.time() < deadline, "the waiting call's intent never came"
    await pool.journal.flush()  # queued after the intent for sure: its waiter wakes after it
    for _ in range(3):
        await asyncio.sleep(0)
    waiting_token.cancel("not wanted")
    waited = await waiting
    assert (waited.status, waited.started) == (Status.CANCELLED, False)
    assert waited.session is not None  # ended in its turn's wait, the session untouched
    assert waited.session["updated"] is False
    token.cancel()
    await first
    assert (await pool.session("s"))["env"] == {}
    assert _stdout(await _bash(pool, "echo next")) == "next\n"


# -- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["", "a/b", "..", "x y", "a\nb", "-x", "s" * 129, 7, None])
async def test_a_bad_session_id_is_a_value_error_and_nothing_is_journaled(
    pool: Pool, bad: Any
) -> None:
    if bad is None:
        return  # None is "no session"
    assert pool.journal is not None
    await pool.journal.flush()
    before = len(journal_records(pool.journal.path))
    with pytest.raises(ValueError, match="session"):
        await pool.call("bash", {"command": "true"}, session=bad)
    with pytest.raises(ValueError, match="session"):
        await pool.session(bad)
    await pool.journal.flush()
    assert len(journal_records(pool.journal.path)) == before


async def test_a_session_belongs_to_its_workspace(pool: Pool, workspace: Path) -> None:
    await _bash(pool, "true")
    with pytest.raises(ValueError, match="belongs to"):
        await pool.call("bash", {"command": "true"}, session="s", workspace=str(workspace / "src"))


# -- the journal -----------------------------------------------------------------------------------


async def test_the_journal_keeps_each_state_and_a_new_pool_restores_it(
    workspace: Path, tmp_path: Path
) -> None:
    journal = tmp_path / "sessions.jsonl"
    config = marked_config(pool={"workers": 2})
    async with Pool(workspace, journal=journal, config=config) as pool:
        await _bash(pool, "cd src; export R=1")
        await pool.call(
            "bash", {"command": "cd ..; export R=2; sleep 30"}, session="s", timeout=0.3
        )
    records = journal_records(str(journal))
    intents = [r for r in records if r["kind"] == "intent"]
    outcomes = [r for r in records if r["kind"] == "outcome"]
    assert [r.get("session") for r in intents] == ["s", "s"]
    assert outcomes[0]["session"]["env"] == {"R": "1"}
    assert outcomes[1]["status"] == "timeout"
    assert outcomes[1]["session"]["updated"] is False
    async with Pool(workspace, journal=journal, config=config) as again:
        assert await again.session("s") == {"cwd": str(workspace / "src"), "env": {"R": "1"}}
        assert _stdout(await _bash(again, 'pwd; echo "$R"')) == f"{workspace / 'src'}\n1\n"


async def test_a_forged_journal_record_is_not_restored(workspace: Path, tmp_path: Path) -> None:
    journal = tmp_path / "forged.jsonl"
    session = {"id": "s", "workspace": str(workspace), "cwd": "/etc", "env": {}, "updated": True}
    record = {"kind": "outcome", "call_id": "x", "time": 1.0, "tool": "bash", "status": "ok"}
    journal.write_text(json.dumps({**record, "session": session}) + "\n")
    async with Pool(workspace, journal=journal, config=marked_config()) as pool:
        assert await pool.session("s") == {"cwd": str(workspace), "env": {}}


# -- a view ----------------------------------------------------------------------------------------


@pytest.mark.needs("mount namespaces")
async def test_in_a_view_the_cwd_is_the_views(tmp_path: Path) -> None:
    root = tmp_path / "v"
    (root / "work" / "sub").mkdir(parents=True)
    (root / "tmp").mkdir(mode=0o1777)
    async with Pool(tmp_path, config=marked_config(pool={"workers": 2})) as pool:
        view = str(root)
        out = await pool.call(
            "bash", {"command": "cd sub; export IN=view"}, cwd="/work", view=view, session="v"
        )
        assert out.status is Status.OK, out
        assert await pool.session("v") == {"cwd": "/work/sub", "env": {"IN": "view"}}
        nxt = await pool.call("bash", {"command": 'pwd; echo "$IN"'}, view=view, session="v")
        assert _stdout(nxt) == "/work/sub\nview\n"
        os.rmdir(root / "work" / "sub")


# -- the report's parser, against bash itself ------------------------------------------------------


def test_declare_px_is_read_back_byte_for_byte() -> None:
    import random
    import subprocess

    from sandbx_pool.workers.tools.shell_state import parse_declare

    rng = random.Random(32)
    values = [bytes(rng.randrange(1, 256) for _ in range(rng.randrange(0, 40))) for _ in range(300)]
    values += [b"\\", b"'", b'"', b"$'x'", b"\\n", b"=", b"a\nb", "héllo".encode()]
    env = {f"V{i}".encode(): value for i, value in enumerate(values)}
    for locale in ("C", "C.UTF-8"):
        printed = subprocess.run(
            ["bash", "-c", "declare -px"],
            env={**env, b"LC_ALL": locale.encode()},
            capture_output=True,
            check=True,
        ).stdout
        parsed = parse_declare(printed)
        assert parsed is not None
        assert {k: v for k, v in parsed if k.startswith(b"V")} == env
    assert parse_declare(b"declare -x A=oops\n") is None
    assert parse_declare(b'declare -x A="unterminated\n') is None


# -- a layer -----------------------------------------------------------------------------------


@pytest.mark.needs("overlayfs layers (pool.layer)")
async def test_a_session_in_a_layer_keeps_its_cwd_there(tmp_path: Path) -> None:
    base = tmp_path / "base"
    (base / "src").mkdir(parents=True)
    (tmp_path / "ws").mkdir()
    config = marked_config(pool={"workers": 2}, workspace={"layers": str(tmp_path / "layers")})
    async with Pool(tmp_path / "ws", config=config) as pool:
        ws = await pool.layer("l1", base=str(base))
        first = await pool.call(
            "bash", {"command": "cd src; export L=1"}, workspace=ws, session="l"
        )
        assert first.status is Status.OK, first
        again = await pool.call("bash", {"command": 'pwd; echo "$L"'}, workspace=ws, session="l")
        assert _stdout(again) == f"{os.path.join(ws.path, 'src')}\n1\n"
        with pytest.raises(ValueError, match="belongs to"):
            await pool.call("bash", {"command": "true"}, session="l")
