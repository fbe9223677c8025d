"""What a bash command prints reaches its caller: in order on request, head and tail of a
flood, the output so far when it is stopped, and streamed while it runs (API, CLI, batch)."""

from __future__ import annotations

import asyncio
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import MARKER, marked_config

from sandbx_pool import CancelToken, OutputChunk, Pool, Status
from sandbx_pool.outcome import KilledBy

MiB = 1024 * 1024


async def test_merge_stderr_keeps_the_order_of_both_streams(pool: Pool) -> None:
    args = {"command": "echo a; echo b >&2; echo c", "merge_stderr": True}
    outcome = await pool.call("bash", args)
    assert outcome.value is not None
    assert (outcome.value["stdout"], outcome.value["stderr"]) == ("a\nb\nc\n", "")
    apart = await pool.call("bash", {"command": "echo a; echo b >&2; echo c"})
    assert apart.value is not None
    assert (apart.value["stdout"], apart.value["stderr"]) == ("a\nc\n", "b\n")


@pytest.mark.parametrize(
    ("command", "first", "last"),
    [
        # 5 MB in long lines, and 2,000,000 short ones.
        (
            "for i in 1 2 3 4 5; do echo start $i; head -c 1000000 /dev/zero | tr '\\0' x; echo;"
            " done; echo end",
            "start 1\nxxx",
            "xxx\nend\n",
        ),
        ("seq 1 2000000", "1\n2\n3\n", "1999999\n2000000\n"),
    ],
)
async def test_a_large_output_keeps_its_head_and_tail(
    pool: Pool, command: str, first: str, last: str
) -> None:
    outcome = await pool.call("bash", {"command": command})
    assert outcome.status is Status.OK  # not output_limit: the command ran to its end
    assert outcome.value is not None
    stdout = outcome.value["stdout"]
    assert stdout.startswith(first)
    assert stdout.endswith(last)
    omitted = outcome.value["omitted_bytes"]
    assert omitted > 3 * MiB
    assert f"[... {omitted} bytes omitted ...]\n" in stdout
    assert len(stdout) <= 1 * MiB + 100  # keep_output_bytes, and the marker line


async def test_partial_output_on_timeout(pool: Pool) -> None:
    outcome = await pool.call("bash", {"command": "echo partial; sleep 100"}, timeout=1)
    assert outcome.status is Status.TIMEOUT
    assert outcome.value is not None
    assert outcome.value["stdout"] == "partial\n"


async def test_partial_output_when_the_command_ignores_sigterm(pool: Pool) -> None:
    command = "trap '' TERM; echo partial; echo oops >&2; sleep 100"
    outcome = await pool.call("bash", {"command": command}, timeout=1)
    assert outcome.status is Status.TIMEOUT
    assert outcome.value is not None
    assert (outcome.value["stdout"], outcome.value["stderr"]) == ("partial\n", "oops\n")


async def test_partial_output_on_cancel(pool: Pool) -> None:
    token = CancelToken()
    seen = asyncio.Event()

    def on_output(chunk: OutputChunk) -> None:
        seen.set()

    call = asyncio.create_task(
        pool.call(
            "bash", {"command": "echo before-cancel; sleep 100"}, cancel=token, on_output=on_output
        )
    )
    await seen.wait()
    token.cancel("user pressed stop")
    outcome = await call
    assert outcome.status is Status.CANCELLED
    assert outcome.value is not None
    assert outcome.value["stdout"] == "before-cancel\n"


async def test_partial_output_on_output_limit(workspace: Path, tmp_path: Path) -> None:
    config = marked_config(calls={"max_output_bytes": 4 * MiB})
    async with Pool(workspace, config=config, journal=tmp_path / "j.jsonl") as pool:
        outcome = await pool.call("bash", {"command": "echo start; yes flood"}, timeout=60)
    assert outcome.status is Status.OUTPUT_LIMIT
    assert outcome.killed_by is KilledBy.OUTPUT_LIMIT
    assert outcome.value is not None
    assert outcome.value["stdout"].startswith("start\nflood\n")
    assert outcome.value["omitted_bytes"] > 2 * MiB
    assert len(outcome.value["stdout"]) <= 1 * MiB + 100


async def test_output_is_streamed_while_the_command_runs(pool: Pool, tmp_path: Path) -> None:
    chunks: list[tuple[float, OutputChunk]] = []
    command = "echo first; sleep 2; echo second"
    outcome = await pool.call(
        "bash", {"command": command}, on_output=lambda c: chunks.append((time.monotonic(), c))
    )
    ended = time.monotonic()
    assert outcome.status is Status.OK
    assert [c.data for _, c in chunks] == ["first\n", "second\n"]
    assert all(c.stream == "stdout" and c.call_id == outcome.call_id for _, c in chunks)
    assert ended - chunks[0][0] >= 1.0
    # Streaming adds nothing to the journal: the call's records are its intent, the worker
    # that took it and its outcome (whose value summary is what it always was).
    assert pool.journal is not None
    await pool.journal.flush()
    journal = (tmp_path / "journal.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in journal]
    assert [r["kind"] for r in records if r["call_id"] == outcome.call_id] == [
        "intent",
        "started",
        "outcome",
    ]


async def test_a_chunk_arrives_within_50_ms(pool: Pool) -> None:
    lags: list[float] = []

    def on_output(chunk: OutputChunk) -> None:
        for line in chunk.data.splitlines():
            lags.append(time.time() - float(line))

    command = "for i in $(seq 10); do date +%s.%N; sleep 0.1; done"
    await pool.call("bash", {"command": command}, on_output=on_output)
    assert len(lags) == 10
    assert sorted(lags)[5] < 0.05


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


async def test_a_fast_writer_does_not_grow_the_coordinator(workspace: Path, tmp_path: Path) -> None:
    """`yes` writes far more than 100 MB/s here; what reaches the callback is paced and
    bounded, and the coordinator keeps none of it."""
    config = marked_config(calls={"max_output_bytes": 1 << 40})
    received = 0
    dropped = 0

    def on_output(chunk: OutputChunk) -> None:
        nonlocal received, dropped
        received += len(chunk.data)
        dropped += chunk.dropped

    async with Pool(workspace, config=config, journal=tmp_path / "j.jsonl") as pool:
        before = _rss_kib()
        outcome = await pool.call("bash", {"command": "yes"}, timeout=3, on_output=on_output)
        grown_kib = _rss_kib() - before
    assert outcome.status is Status.TIMEOUT
    assert outcome.value is not None
    assert dropped > 100 * MiB  # the writer did outpace the stream
    assert received < 3.5 * 3 * MiB  # about 1.3 MB/s of it was streamed
    assert grown_kib < 32 * 1024, f"coordinator grew by {grown_kib} KiB"
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss < 1024 * 1024  # KiB: < 1 GiB


def test_the_cli_prints_output_as_it_comes(workspace: Path, tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text(f'[env]\nset = {{ {MARKER} = "{os.environ[MARKER]}" }}\n')
    argv = [sys.executable, "-m", "sandbx_pool.cli", "-q", "call", "bash"]
    argv += ["command=echo first; sleep 2; echo second", f"--workspace={workspace}"]
    argv += [f"--config={config}", f"--journal={tmp_path / 'j.jsonl'}"]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as cli:
        assert cli.stderr is not None
        assert cli.stdout is not None
        first = cli.stderr.readline()
        first_at = time.monotonic()
        out, rest = cli.communicate(timeout=60)
        ended = time.monotonic()
    assert first == "first\n"
    assert "second\n" in rest
    assert ended - first_at >= 1.0
    assert json.loads(out)["value"]["stdout"] == "first\nsecond\n"  # stdout: the outcome alone


def test_run_writes_each_calls_output_to_a_file(workspace: Path, tmp_path: Path) -> None:
    calls = tmp_path / "calls.jsonl"
    lines = [
        {"id": "one", "tool": "bash", "args": {"command": "echo hello; echo there >&2"}},
        {"id": "two", "tool": "read", "args": {"path": "hello.txt"}},
    ]
    calls.write_text("".join(json.dumps(line) + "\n" for line in lines))
    config = tmp_path / "c.toml"
    config.write_text(f'[env]\nset = {{ {MARKER} = "{os.environ[MARKER]}" }}\n')
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "sandbx_pool.cli", "-q", "run", str(calls)]
    argv += [f"--workspace={workspace}", f"--config={config}", f"--output-dir={out}"]
    argv += [f"--journal={tmp_path / 'j.jsonl'}"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert sorted(os.listdir(out)) == ["one.out"]
    assert sorted((out / "one.out").read_text().splitlines()) == ["hello", "there"]
