"""grep answers as ripgrep does, whichever engine runs, and its new arguments work.

The reference is the ``rg`` binary the project depends on, run as ``rg -n --no-heading`` with
the options grep always passes (``--no-require-git --no-ignore-parent --crlf``) plus the ones
each case asks for. Both engines are held to it on the same tree: rg through the pool (its
worker binds the workspace with symlinks refused, so rg runs) and the Python walk, called in
this process (no such bind: the fallback answers).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import MakePool

from sandbx_pool import Pool, Status
from sandbx_pool.workers.protocol import ExecutionContext
from sandbx_pool.workers.schemas import parse_args
from sandbx_pool.workers.tools import TOOLS

RG = os.path.join(os.path.dirname(sys.executable), "rg")

TREE: dict[str, bytes] = {
    ".gitignore": b"build/\n*.log\n",
    ".git/config": b"needle in git\n",
    ".git/info/exclude": b"excluded.txt\n",
    ".hidden/secret.txt": b"needle hidden\n",
    ".dotfile": b"needle dot\n",
    "build/out.txt": b"needle built\n",
    "app.log": b"needle logged\n",
    "excluded.txt": b"needle excluded\n",
    "src/main.py": b"def main():\n    print('needle')  # Needle\nNEEDLE = 1\n",
    "src/util.py": b"import re\nfoo = bar\n\tneedle_tab\nend\n",
    "src/crlf.txt": b"first\r\nneedle at end\r\nneedle\r\n",
    "src/latin1.txt": b"caf\xe9 needle\nplain needle line\n",
    "src/blob.bin": b"needle\x00binary\n",
    "src/unicode.txt": "Grüße needle\n\u0391\u03b8\u03ae\u03bd\u03b1\nnaïve café\n".encode(),
    "docs/readme.md": b"# Needle docs\nfoo or bar\n",
}

#: (grep args besides the pattern, the matching rg options)
OPTIONS: list[tuple[dict[str, Any], list[str]]] = [
    ({}, []),
    ({"ignore_case": True}, ["-i"]),
    ({"hidden": True}, ["--hidden", "--glob", "!.git"]),
    ({"respect_gitignore": False}, ["--no-ignore"]),
    ({"glob": "*.py"}, ["--glob", "*.py"]),
    ({"type": "py"}, ["--type", "py"]),
]

PATTERNS = [
    "needle",  # literal
    r"[A-Z]{3,}",  # a class
    r"^needle$",  # anchors (CRLF lines included)
    r"foo|bar",  # alternation
    r"\bneedle\b",
    "café",  # Unicode, which the Latin-1 file does not hold (its é is one invalid byte)
    r"na.ve",  # . matches one character, ï
    r"\p{Greek}+|Grüße",  # Unicode classes and literals
    r"^\s+\w+",
]


@pytest.fixture
def tree(workspace: Path) -> Path:
    for name, data in TREE.items():
        (workspace / name).parent.mkdir(parents=True, exist_ok=True)
        (workspace / name).write_bytes(data)
    return workspace


@pytest.fixture
async def pool(tree: Path, make_pool: MakePool) -> Pool:
    return await make_pool(tree, journal="j.jsonl")


def rg_lines(tree: Path, pattern: str, options: list[str]) -> set[tuple[str, int]]:
    argv = [RG, "-n", "--no-heading", "--null", "--no-config", "--no-require-git"]
    argv += ["--no-ignore-parent", "--crlf", *options, "-e", pattern]
    out = subprocess.run(argv, cwd=tree, capture_output=True, check=False).stdout
    found = set()
    for line in out.splitlines():
        path, _, rest = line.partition(b"\0")
        found.add((os.fsdecode(path).removeprefix("./"), int(rest.split(b":", 1)[0])))
    return found


def python_grep(tree: Path, **args: Any) -> dict[str, Any]:
    ctx = ExecutionContext(
        call_id="t", workspace=str(tree), cwd=str(tree), env={"PATH": os.environ["PATH"]}
    )
    return TOOLS["grep"](parse_args("grep", args), ctx)


def pairs(value: dict[str, Any]) -> set[tuple[str, int]]:
    return {(m["path"], m["line"]) for m in value["matches"]}


def python_pattern(pattern: str) -> str:
    # \p{Greek} is rg's; Python's re spells the same set as a range.
    return pattern.replace(r"\p{Greek}", "[\u0370-\u03ff\u1f00-\u1fff]")


@pytest.mark.parametrize(("args", "options"), OPTIONS)
@pytest.mark.needs("grep runs rg")
async def test_both_engines_answer_as_rg(
    pool: Pool, tree: Path, args: dict[str, Any], options: list[str]
) -> None:
    for pattern in PATTERNS:
        expected = rg_lines(tree, pattern, options)
        outcome = await pool.call("grep", {"pattern": pattern, **args})
        assert outcome.status is Status.OK, outcome
        assert outcome.value is not None
        assert outcome.value["engine"] == "rg"
        assert pairs(outcome.value) == expected, (pattern, args)
        fallback = python_grep(tree, pattern=python_pattern(pattern), **args)
        assert fallback["engine"] == "python"
        assert pairs(fallback) == expected, (pattern, args)
    # Never .git, whatever the options; the case above holds hidden files in.
    assert not any(path.startswith(".git/") for path, _ in rg_lines(tree, ".", options))


@pytest.mark.needs("grep runs rg")
async def test_text_is_the_line_without_its_end(pool: Pool, tree: Path) -> None:
    outcome = await pool.call("grep", {"pattern": "needle", "path": "src/crlf.txt"})
    assert outcome.value is not None
    assert outcome.value["engine"] == "rg"  # rg's lines end in CRLF: the tool strips them
    assert [m["text"] for m in outcome.value["matches"]] == ["needle at end", "needle"]
    latin1 = await pool.call("grep", {"pattern": "plain|caf", "path": "src/latin1.txt"})
    assert latin1.value is not None
    assert [m["text"] for m in latin1.value["matches"]] == ["caf\ufffd needle", "plain needle line"]


async def test_a_pattern_only_python_takes_falls_back(pool: Pool, tree: Path) -> None:
    # rg's regex has no look-around and no backreferences: Python's re answers those.
    outcome = await pool.call("grep", {"pattern": r"needle(?= at)|(o)\1"})
    assert outcome.status is Status.OK, outcome
    assert outcome.value is not None
    assert outcome.value["engine"] == "python"
    assert pairs(outcome.value) == {("src/crlf.txt", 2), ("src/util.py", 2), ("docs/readme.md", 2)}
    bad = await pool.call("grep", {"pattern": "(unclosed"})
    assert bad.status is Status.ERROR
    assert bad.error is not None
    assert "invalid regular expression" in bad.error
    unknown = await pool.call("grep", {"pattern": "x", "type": "no-such-type"})
    assert unknown.status is Status.ERROR
    assert unknown.error is not None
    assert "no-such-type" in unknown.error


@pytest.mark.parametrize("engine", ["rg", "python"])
async def test_output_modes_context_and_multiline(pool: Pool, tree: Path, engine: str) -> None:
    async def grep(**args: Any) -> dict[str, Any]:
        if engine == "python":
            return python_grep(tree, **args)
        outcome = await pool.call("grep", args)
        assert outcome.status is Status.OK, outcome
        assert outcome.value is not None
        return outcome.value

    files = await grep(pattern="needle", output_mode="files_with_matches")
    assert files["files"] == [
        "src/crlf.txt",
        "src/latin1.txt",
        "src/main.py",
        "src/unicode.txt",
        "src/util.py",
    ]
    counts = await grep(pattern="needle", output_mode="count", path="src")
    assert {c["path"]: c["count"] for c in counts["counts"]}["src/crlf.txt"] == 2
    context = await grep(pattern="needle_tab", context=1)
    (match,) = context["matches"]
    assert (match["before"], match["after"]) == (["foo = bar"], ["end"])
    apart = await grep(pattern="needle_tab", context_before=2, context_after=0, context=1)
    assert (apart["matches"][0]["before"], apart["matches"][0]["after"]) == (
        ["import re", "foo = bar"],
        [],
    )
    spanning = await grep(pattern=r"def main\(\):.*print", multiline=True)
    assert [(m["path"], m["line"]) for m in spanning["matches"]] == [("src/main.py", 1)]
    assert spanning["matches"][0]["text"].splitlines()[1].strip().startswith("print")
    assert (await grep(pattern=r"def main\(\):.*print"))["matches"] == []


@pytest.mark.needs("grep runs rg")
async def test_a_huge_match_count_stays_bounded(pool: Pool, tree: Path) -> None:
    (tree / "big.txt").write_bytes(b"needle\n" * 2_000_000)  # 14 MB of matching lines
    outcome = await pool.call("grep", {"pattern": "needle", "max_results": 50}, timeout=60)
    assert outcome.status is Status.OK, outcome
    assert outcome.value is not None
    assert (len(outcome.value["matches"]), outcome.value["truncated"]) == (50, True)
    assert outcome.value["engine"] == "rg"  # killed once full, not read to the end
    default = await pool.call("grep", {"pattern": "needle", "path": "big.txt"}, timeout=60)
    assert default.value is not None
    assert len(default.value["matches"]) == 1000  # the default max_results
    assert default.duration_s < 10


def test_the_schemas_describe_the_new_arguments_for_a_model() -> None:
    from sandbx_pool.workers.schemas import tool_schemas

    schemas = tool_schemas()
    grep = schemas["grep"]["properties"]
    assert sorted(grep["output_mode"]["enum"]) == ["content", "count", "files_with_matches"]
    assert grep["respect_gitignore"]["default"] is True
    for name in ("context_before", "context_after", "context", "type", "multiline", "hidden"):
        assert grep[name].get("description") or grep[name].get("anyOf"), name
    find = schemas["find"]["properties"]
    assert (find["hidden"]["default"], find["respect_gitignore"]["default"]) == (False, True)


async def test_doctor_says_whether_grep_runs_rg(
    pool: Pool, capsys: pytest.CaptureFixture[str]
) -> None:
    """The doctor's verdict is what a grep call does: here, rg from the project's wheel."""
    import msgspec

    from sandbx_pool.cli.main import main as cli_main

    outcome = await pool.call("grep", {"pattern": "needle"})
    assert outcome.value is not None
    # The doctor and rg --version block: off the event loop, as the pool's own work is.
    assert await asyncio.to_thread(cli_main, ["doctor", "--json"]) == 0
    checks = {c["name"]: c for c in msgspec.json.decode(capsys.readouterr().out)}
    check = checks["grep runs rg"]
    assert check["ok"] is (outcome.value["engine"] == "rg")
    version = await asyncio.to_thread(
        subprocess.run, [RG, "--version"], capture_output=True, text=True, check=True
    )
    assert f"{RG} ({version.stdout.splitlines()[0]})" in check["detail"]


def test_doctor_names_greps_fallback_and_why() -> None:
    from sandbx_pool.cli.doctor import rg_check

    missing = rg_check(None, "", symlinks_refused=True)
    assert not missing.ok
    assert missing.fallback.startswith("no rg next to this interpreter nor on PATH")
    assert "grep walks the tree in Python" in missing.fallback
    unbound = rg_check(RG, "ripgrep 14.1.0", symlinks_refused=False)
    assert not unbound.ok
    assert f"{RG} (ripgrep 14.1.0) found, but no workspace bind" in unbound.fallback
    assert "grep walks the tree in Python" in unbound.fallback
    assert rg_check(RG, "ripgrep 14.1.0", symlinks_refused=True).ok
