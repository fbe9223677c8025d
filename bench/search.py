"""grep and find through the pool against ripgrep and GNU grep, on a generated tree.

The tree (``TREE_FILES`` files, about ``TREE_BYTES``, a git repository with a .gitignore) is
generated once, deterministically, and cached under ``bench/results/`` (git-ignored): writing
300 MB takes longer than the whole section. Every tool runs on the same tree, warm (each is
run once before it is timed, so the page cache holds the tree), alternating between tools so
that a burst of load from the machine's other users lands on all of them alike.

What is compared, each line the same question asked two ways:

* ``grep`` (content, default options) against ``rg -n PATTERN`` run alone, and GNU
  ``grep -rn`` (which honours no .gitignore: it searches the ignored folder too);
* ``grep`` with ``output_mode=files_with_matches`` against ``rg -l``;
* ``find **/*.py`` against ``rg --files -g '*.py'`` (find lists what rg lists: .gitignore
  and hidden files honoured alike).

The pool's figure includes everything a caller waits for: the coordinator, the worker's
fork, its confinement and the result's trip back.

Cold (``python -m bench search --cold``, not part of ``make bench``: it empties the whole
machine's page cache, which slows everyone else on it): before each timed run the page cache is
dropped (``sync``, then ``3`` into ``/proc/sys/vm/drop_caches``, which needs root), and the
tools take turns, the order rotating each round, so that none always runs first after the drop.
The ratios asked of it: grep through the pool against ``rg -n``, and ``rg -n`` against GNU grep
(find against ``rg --files`` too). Where the cache cannot be dropped, the section says why and
gives no figures: warm figures passed off as cold would mislead.
"""

from __future__ import annotations

import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from loguru import logger

from bench.workspace import BenchWorkspace

TREE_FILES = 20_000
TREE_BYTES = 300 * 1024 * 1024
#: Bump when the generator changes: a cached tree of another version is generated anew.
TREE_VERSION = "1"
TREE = Path(__file__).resolve().parent / "results" / "search-tree"

#: Where the kernel is told to drop its clean caches (root only).
DROP_CACHES = Path("/proc/sys/vm/drop_caches")

#: A rare identifier (a few hundred matching lines) and a case-insensitive class.
PATTERNS = {"literal": "SBX_NEEDLE_[0-9]+", "regex": r"(?i)def \w+_handler\("}

_WORDS = (
    "import",
    "return",
    "yield",
    "lambda",
    "class",
    "self",
    "value",
    "result",
    "error",
    "config",
    "path",
    "worker",
    "pool",
    "call",
    "cancel",
    "token",
    "journal",
    "outcome",
    "status",
    "timeout",
    "buffer",
    "socket",
    "stream",
    "event",
    "signal",
    "thread",
    "process",
    "template",
    "fork",
    "exec",
    "module",
    "package",
    "record",
    "index",
    "offset",
    "length",
    "header",
    "payload",
)


def _chunk(rng: random.Random, size: int) -> str:
    lines = []
    total = 0
    while total < size:
        indent = "    " * rng.randrange(3)
        words = " ".join(rng.choice(_WORDS) for _ in range(rng.randrange(4, 12)))
        line = f"{indent}{words}\n"
        lines.append(line)
        total += len(line)
    return "".join(lines)


def ensure_tree(root: Path = TREE) -> Path:
    """The cached tree, generated when missing or of another version."""
    stamp = root / ".generated"
    if stamp.exists() and stamp.read_text() == TREE_VERSION:
        return root
    logger.info("bench: generating the search tree ({} files) in {}", TREE_FILES, root)
    shutil.rmtree(root, ignore_errors=True)
    rng = random.Random(17)
    chunks = [_chunk(rng, 2 * TREE_BYTES // TREE_FILES) for _ in range(64)]
    (root / ".git" / "info").mkdir(parents=True)
    (root / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (root / ".gitignore").write_text("build/\n*.log\n")
    for i in range(TREE_FILES):
        top, sub = i % 20, (i // 20) % 10
        ignored = i % 50 == 0  # 2%: a build output .gitignore hides from rg and from us
        folder = root / ("build" if ignored else f"pkg{top:02d}") / f"mod{sub}"
        folder.mkdir(parents=True, exist_ok=True)
        text = chunks[i % len(chunks)]
        # Files of varied length around the mean, and a rare needle in some.
        text = text[: rng.randrange(len(text) // 8, len(text))]
        if i % 40 == 7:
            text += f"SBX_NEEDLE_{i} = 1\ndef on_{i}_handler(event):\n"
        suffix = ".log" if i % 97 == 0 else ".py" if i % 3 else ".txt"
        (folder / f"f{i:05d}{suffix}").write_text(text)
    stamp.write_text(TREE_VERSION)
    return root


@dataclass
class SearchResult:
    tree_files: int
    tree_mb: float
    #: row name -> (pool median ms, peer name, peer median ms)
    rows: dict[str, tuple[float, str, float]] = field(default_factory=dict)
    #: peer name -> median ms, for the peers not paired with a pool row (GNU grep)
    extra: dict[str, float] = field(default_factory=dict)
    #: cold cache: tool -> median ms, over ``cold_runs`` rounds (empty when not measured)
    cold: dict[str, float] = field(default_factory=dict)
    cold_runs: int = 0
    #: why the cold figures are missing although asked for
    cold_unavailable: str | None = None


def _time(fn: Callable[[], object], runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return times


def _run(argv: list[str], cwd: Path) -> Callable[[], object]:
    def go() -> object:
        return subprocess.run(argv, cwd=cwd, stdout=subprocess.DEVNULL, check=False)

    return go


def rg_path() -> str:
    return os.path.join(os.path.dirname(sys.executable), "rg")


def drop_caches() -> str | None:
    """Write back dirty pages, then empty the page cache, dentries and inodes; None when done,
    else why not."""
    os.sync()
    try:
        DROP_CACHES.write_text("3\n")
    except OSError as exc:
        return f"cannot write {DROP_CACHES} ({exc.strerror}): dropping the page cache needs root"
    return None


#: The cold section's rows.
COLD_GREP, COLD_FIND = "grep (pool)", "find **/*.py (pool)"
COLD_RG, COLD_RG_FILES, COLD_GNU = "rg -n", "rg --files -g '*.py'", "GNU grep -rn"

#: The cold section's calls through the pool: (tool, args).
COLD_POOL: dict[str, tuple[str, dict[str, object]]] = {
    COLD_GREP: ("grep", {"pattern": PATTERNS["literal"], "max_results": 100_000}),
    COLD_FIND: ("find", {"pattern": "**/*.py"}),
}


def run(ws: BenchWorkspace, runs: int = 9, cold_runs: int = 0) -> SearchResult:
    import asyncio

    from sandbx_pool import Pool

    tree = ensure_tree()
    size = sum(f.stat().st_size for f in tree.rglob("*") if f.is_file())
    result = SearchResult(tree_files=TREE_FILES, tree_mb=size / 1e6)
    rg = rg_path()
    pool_calls: dict[str, tuple[str, dict[str, object]]] = {
        "grep literal": ("grep", {"pattern": PATTERNS["literal"], "max_results": 100_000}),
        "grep regex": ("grep", {"pattern": PATTERNS["regex"], "max_results": 100_000}),
        "grep -l": (
            "grep",
            {"pattern": PATTERNS["literal"], "output_mode": "files_with_matches"},
        ),
        "find **/*.py": ("find", {"pattern": "**/*.py"}),
    }
    peers: dict[str, tuple[str, list[str]]] = {
        "grep literal": ("rg -n", [rg, "-n", PATTERNS["literal"]]),
        "grep regex": ("rg -n", [rg, "-n", PATTERNS["regex"]]),
        "grep -l": ("rg -l", [rg, "-l", PATTERNS["literal"]]),
        "find **/*.py": ("rg --files", [rg, "--files", "-g", "*.py"]),
    }

    async def measure() -> None:
        async with Pool(tree, workers=2, config=ws.config()) as pool:
            for name, (tool, args) in pool_calls.items():

                async def call(tool: str = tool, args: dict[str, object] = args) -> None:
                    outcome = await pool.call(tool, args, timeout=120)
                    assert outcome.status == "ok", outcome

                await call()  # warm: the page cache, and rg's first exec
                peer_name, argv = peers[name]
                peer = _run(argv, tree)
                peer()
                ours: list[float] = []
                theirs: list[float] = []
                for _ in range(runs):
                    start = time.perf_counter()
                    await call()
                    ours.append((time.perf_counter() - start) * 1000)
                    theirs += _time(peer, 1)
                result.rows[name] = (
                    statistics.median(ours),
                    peer_name,
                    statistics.median(theirs),
                )
                logger.info("bench: search {}: {}", name, result.rows[name])
            if cold_runs:
                await measure_cold(pool)

    async def measure_cold(pool: Pool) -> None:
        grep = shutil.which("grep")
        tools: dict[str, Callable[[], object]] = {
            COLD_RG: _run([rg, "-n", PATTERNS["literal"]], tree),
            COLD_RG_FILES: _run([rg, "--files", "-g", "*.py"], tree),
        }
        if grep is not None:
            argv = [grep, "-rnE", "--exclude-dir=.git", PATTERNS["literal"], "."]
            tools[COLD_GNU] = _run(argv, tree)
        names = [*COLD_POOL, *tools]
        times: dict[str, list[float]] = {name: [] for name in names}
        for round_ in range(cold_runs):
            # Rotate the order: no tool always runs first after the drop, or last.
            shift = round_ % len(names)
            for name in names[shift:] + names[:shift]:
                why = drop_caches()
                if why is not None:
                    result.cold_unavailable = why
                    logger.warning("bench: search cold: {}", why)
                    return
                start = time.perf_counter()
                if name in COLD_POOL:
                    tool, args = COLD_POOL[name]
                    outcome = await pool.call(tool, args, timeout=300)
                    assert outcome.status == "ok", outcome
                else:
                    tools[name]()
                times[name].append((time.perf_counter() - start) * 1000)
        result.cold = {name: statistics.median(values) for name, values in times.items()}
        result.cold_runs = cold_runs
        logger.info("bench: search cold: {}", result.cold)

    asyncio.run(measure())
    grep = shutil.which("grep")
    if grep is not None:
        gnu = _run([grep, "-rnE", "--exclude-dir=.git", PATTERNS["literal"], "."], tree)
        gnu()
        result.extra["GNU grep -rn (literal)"] = statistics.median(_time(gnu, runs))
    return result
