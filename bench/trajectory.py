"""``python -m bench trajectory``: a 40-call coding trajectory over a real repository, per executor.

What an agent does when asked to touch up a library's docstrings: look around (ls, find, read
the README and the build files), search for a function and read it and its tests, make three
edits, check them (read back, grep, parse and compile), then run the tests of what it changed.
39 small calls and one that runs the tests, over attrs 24.2.0's source (bench.attrs_repo).

Every executor runs the same steps, each checked (the text expected in its answer, exit code
0), on a fresh copy of the source:

* sandbx-pool, plain: its tools (read, grep, find, edit, bash), the pool over the copy;
* sandbx-pool, in a layer: the same, in a layer over a pristine tree (each run its own layer);
* mini-swe-agent's ``LocalEnvironment`` and bubblewrap per command (the copy bound writable):
  shell commands, as their agents issue them (``cat``, ``sed -n``, ``grep -rn``, ``find``,
  ``sed -i``).

In each round every executor gets its copy (the pools are opened) and makes one untimed
``true``: what is timed is an agent's calls, not a pool's start. Then the executors take turns
step by step, the order rotated at each step, so that the load of a shared machine falls on all
alike; a run's time is the sum of its calls' durations, and a figure the median over rounds.
"""

from __future__ import annotations

import asyncio
import math
import shlex
import statistics
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any

from loguru import logger

from bench.attrs_repo import Repository, repository
from bench.executors import Bwrap, MiniSweLocal
from bench.stats import ratio
from bench.workspace import BenchWorkspace
from sandbx_pool import Layer, LayerUnavailable, Pool

PLAIN, LAYER, MINI, BWRAP = "pool-plain", "pool-layer", MiniSweLocal.key, Bwrap.key
NAMES = {
    PLAIN: "sandbx-pool, plain workspace (its tools)",
    LAYER: "sandbx-pool, in a layer (its tools)",
    MINI: "mini-swe-agent `LocalEnvironment` (shell commands)",
    BWRAP: "bubblewrap per command (shell commands)",
}
TESTS = "tests/test_filters.py tests/test_validators.py"
CALL_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Step:
    tool: str  # the pool's tool
    args: dict[str, Any]
    shell: str  # the same, as a command line
    expect: str  # text the answer must hold ("" for an edit: a later read checks it)


def _read(path: str, expect: str, lines: tuple[int, int] | None = None) -> Step:
    if lines is None:
        return Step("read", {"path": path}, f"cat {path}", expect)
    first, last = lines
    args = {"path": path, "offset": first - 1, "limit": last - first + 1}
    return Step("read", args, f"sed -n '{first},{last}p' {path}", expect)


def _grep(pattern: str, path: str, expect: str) -> Step:
    args = {"pattern": pattern, "path": path}
    return Step("grep", args, f"grep -rn {shlex.quote(pattern)} {path}", expect)


def _find(glob: str, path: str, name: str, expect: str) -> Step:
    args = {"pattern": glob, "path": path}
    return Step("find", args, f"find {path} -name {shlex.quote(name)}", expect)


def _edit(path: str, old: str, new: str) -> Step:
    # sed's pattern and replacement escaped: the strings are meant literally.
    pattern = "".join("\\" + c if c in "\\/.*[]^$" else c for c in old)
    replacement = "".join("\\" + c if c in "\\/&" else c for c in new)
    script = shlex.quote(f"s/{pattern}/{replacement}/")
    args = {"path": path, "old_string": old, "new_string": new}
    return Step("edit", args, f"sed -i {script} {path}", "")


def _bash(command: str, expect: str) -> Step:
    return Step("bash", {"command": command}, command, expect)


def steps(python: str) -> list[Step]:
    """The trajectory; ``python``: the tests' interpreter."""
    return [
        _bash("ls", "pyproject.toml"),
        _read("README.md", "attrs"),
        _find("**/*.py", "src", "*.py", "filters.py"),
        _read("pyproject.toml", "[project]"),
        _read("tox.ini", "[tox]"),
        _grep("def include", "src", "filters.py"),
        _read("src/attr/filters.py", "_split_what"),
        _grep("_split_what", ".", "filters.py"),
        _find("**/test_*.py", "tests", "test_*.py", "test_filters.py"),
        _read("tests/test_filters.py", "class TestInclude"),
        _bash("wc -l src/attr/*.py", "total"),
        _read("src/attr/__init__.py", "from ._make"),
        _grep("def instance_of", "src", "validators.py"),
        _read("src/attr/validators.py", "def instance_of", (100, 160)),
        _grep("class _InstanceOfValidator", "src/attr", "validators.py"),
        _read("tests/test_validators.py", "class TestInstanceOf", (95, 160)),
        _bash("head -n 40 src/attr/_make.py", "import"),
        _grep("def attrs", "src/attr", "_make.py"),
        _read("src/attr/_make.py", "import", (1, 200)),
        _grep("def asdict", "src", "_funcs.py"),
        _read("src/attr/_funcs.py", "def asdict"),
        _find("**/*.pyi", "src", "*.pyi", "filters.pyi"),
        _read("src/attr/filters.pyi", "def include"),
        _grep("versionchanged", "src/attr/filters.py", "23.1.0"),
        _bash(
            f"{python} -c 'import ast; ast.parse(open(\"src/attr/filters.py\").read())'"
            " && echo parsed",
            "parsed",
        ),
        _edit("src/attr/filters.py", "Commonly useful filters for", "Commonly used filters for"),
        _read("src/attr/filters.py", "Commonly used filters for"),
        _edit(
            "src/attr/filters.py", "of classes and attributes.", "of classes, names and attributes."
        ),
        _grep("classes, names and attributes", "src", "filters.py"),
        _edit(
            "src/attr/validators.py", "The type to check for.", "The type (or types) to check for."
        ),
        _read("src/attr/validators.py", "The type (or types) to check for.", (110, 130)),
        _bash("ls -la src/attr", "filters.py"),
        _grep("class TestExclude", "tests", "test_filters.py"),
        _read("tests/test_filters.py", "class TestExclude", (80, 140)),
        _find("**/conftest.py", ".", "conftest.py", "conftest.py"),
        _read("conftest.py", "hypothesis"),
        _grep("def exclude", "src", "filters.py"),
        _bash(
            f"{python} -m py_compile src/attr/filters.py src/attr/validators.py && echo compiled",
            "compiled",
        ),
        _bash("grep -c def src/attr/filters.py", ""),
        _bash(f"PYTHONPATH=src {python} -m pytest -q -p no:cacheprovider {TESTS}", " passed"),
    ]


@dataclass(frozen=True)
class Run:
    executor: str
    number: int  # the round
    durations_ns: list[int]  # one per step


@dataclass
class TrajectoryResult:
    runs: list[Run] = field(default_factory=list)
    steps: int = 0
    source: str = ""
    tests: str = ""
    executors: list[str] = field(default_factory=list)
    layer_unavailable: str | None = None

    def _median(self, executor: str, measure: Callable[[Run], float]) -> float:
        values = [measure(run) for run in self.runs if run.executor == executor]
        return statistics.median(values) if values else math.nan

    def total_s(self, executor: str) -> float:
        """The whole trajectory: its 40 calls' durations, summed."""
        return self._median(executor, lambda run: sum(run.durations_ns) / 1e9)

    def small_ms(self, executor: str) -> float:
        """The small calls (all but the last, the test run), summed."""
        return self._median(executor, lambda run: sum(run.durations_ns[:-1]) / 1e6)

    def tests_ms(self, executor: str) -> float:
        return self._median(executor, lambda run: run.durations_ns[-1] / 1e6)

    def small_ratio(self, executor: str, peer: str) -> float:
        return ratio(self.small_ms(executor), self.small_ms(peer))

    def small_ratio_range(self, executor: str, peer: str) -> tuple[float, float]:
        """The lowest and highest small-call ratio of one round's two runs: how much the
        machine moved it."""
        mine = {
            run.number: sum(run.durations_ns[:-1]) for run in self.runs if run.executor == executor
        }
        theirs = {
            run.number: sum(run.durations_ns[:-1]) for run in self.runs if run.executor == peer
        }
        ratios = [ratio(mine[n], theirs[n]) for n in mine if n in theirs]
        return (min(ratios), max(ratios)) if ratios else (math.nan, math.nan)

    def rounds(self, executor: str) -> int:
        return sum(1 for run in self.runs if run.executor == executor)


Call = Callable[[Step], Awaitable[None]]


def _answer(tool: str, value: dict[str, Any]) -> str:
    """A tool's answer as the text a command would have printed, to look for ``expect``."""
    if tool == "read":
        return str(value["content"])
    if tool == "grep":
        return "\n".join(f"{m['path']}:{m['line']}:{m['text']}" for m in value["matches"])
    if tool == "find":
        return "\n".join(value["paths"])
    if tool == "bash":
        if value["exit_code"] != 0:
            raise RuntimeError(f"bash exited {value['exit_code']}: {value['stderr'][-500:]}")
        return str(value["stdout"])
    if value.get("replacements") != 1:  # edit
        raise RuntimeError(f"edit: {value}")
    return ""


def _pool_call(pool: Pool, where: Layer | None) -> Call:
    async def call(step: Step) -> None:
        outcome = await pool.call(step.tool, step.args, workspace=where, timeout=CALL_TIMEOUT_S)
        if not outcome.ok or outcome.value is None:
            raise RuntimeError(f"{step.tool} {step.args}: {outcome}")
        text = _answer(step.tool, outcome.value)
        if step.expect not in text:
            raise RuntimeError(f"{step.tool} {step.args}: no {step.expect!r} in {text[:300]!r}")

    return call


def _shell_call(executor: MiniSweLocal | Bwrap) -> Call:
    async def call(step: Step) -> None:
        ran = await asyncio.to_thread(executor.run, step.shell)
        if ran.exit_code != 0 or step.expect not in ran.output:
            output = (ran.output + ran.errors)[-500:]
            raise RuntimeError(f"{step.shell}: exit {ran.exit_code}, {output!r}")

    return call


async def _open(
    stack: AsyncExitStack,
    ws: BenchWorkspace,
    repo: Repository,
    executor: str,
    number: int,
    result: TrajectoryResult,
) -> Call | None:
    """The executor's call on a fresh copy of the source; None if it cannot run here."""
    area = ws.root / "trajectory" / f"{executor}-{number}"
    area.mkdir(parents=True)
    tree = await asyncio.to_thread(repo.extract, area)
    if executor == MINI:
        return _shell_call(MiniSweLocal(str(tree)))
    if executor == BWRAP:
        return _shell_call(Bwrap(str(tree), writable=True))
    config = ws.config(
        sandbox={"read_only": list(repo.readable)}, workspace={"layers": str(area / "store")}
    )
    journal = ws.journal(f"trajectory-{executor}")
    pool = await stack.enter_async_context(Pool(tree, config=config, journal=journal))
    if executor == PLAIN:
        return _pool_call(pool, None)
    try:
        layer = await pool.layer(f"run{number}", base=tree)
    except LayerUnavailable as exc:
        result.layer_unavailable = str(exc)
        return None
    stack.push_async_callback(layer.remove)  # before the pool closes: a stack unwinds backwards
    return _pool_call(pool, layer)


def run(ws: BenchWorkspace, *, rounds: int = 5) -> TrajectoryResult:
    return asyncio.run(_run(ws, rounds))


async def _run(ws: BenchWorkspace, rounds: int) -> TrajectoryResult:
    repo = await asyncio.to_thread(repository)
    plan = steps(str(repo.python))
    result = TrajectoryResult(
        steps=len(plan), source=repo.sdist.name, tests=TESTS, executors=[PLAIN, LAYER, MINI, BWRAP]
    )
    logger.info("trajectory: {} calls over {}, {} rounds", len(plan), repo.sdist.name, rounds)
    for number in range(rounds):
        async with AsyncExitStack() as stack:
            calls: dict[str, Call] = {}
            for executor in result.executors:
                call = await _open(stack, ws, repo, executor, number, result)
                if call is not None:
                    await call(_bash("true", ""))  # untimed: a first call's own costs
                    calls[executor] = call
            durations: dict[str, list[int]] = {executor: [] for executor in calls}
            order = list(calls)
            # Step by step, the executors taking turns (rotated at each step): a burst of the
            # machine's other load then falls on all of them, not on one executor's whole run.
            for index, step in enumerate(plan):
                shift = (number + index) % len(order)
                for executor in order[shift:] + order[:shift]:
                    before = time.perf_counter_ns()
                    await calls[executor](step)
                    durations[executor].append(time.perf_counter_ns() - before)
            result.runs += [Run(key, number, values) for key, values in durations.items()]
    return result
