"""Section ``services``: what a service costs (sandbx_pool.services), on a small HTTP server.

Four rows, on one pool of two workers:

* start to port open: ``pool.service`` of ``python3 -m http.server`` until ``wait_port`` sees it
  listen (the worker, its confinement, bash's exec of Python, the server's import and bind);
* a call reaching it: a bash call that fetches ``/`` with Python (its own interpreter's start
  is most of it; the plain ``python3 -c pass`` call beside it says how much);
* stop: ``svc.stop()`` until its outcome is journaled (SIGTERM to the group, the server exits);
* an idle service's supervision: the worker's memory while its server waits (RSS, and PSS: a
  worker shares the template's pages), the command's own not counted.
"""

from __future__ import annotations

import asyncio
import socket
import time
from dataclasses import dataclass

from loguru import logger

from bench.stats import Samples
from bench.workspace import BenchWorkspace
from sandbx_pool import Pool

FETCH = (
    'python3 -c "import sys, urllib.request as u;'
    " u.urlopen('http://127.0.0.1:' + sys.argv[1] + '/', timeout=5).read()\" {port}"
)


@dataclass
class ServicesResult:
    start_to_port: Samples
    reach: Samples
    python_alone: Samples
    stop: Samples
    #: The idle worker's memory, KiB: (RSS, PSS), one per service measured.
    memory_kib: list[tuple[int, int]]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _memory_kib(pid: int) -> tuple[int, int]:
    fields: dict[str, int] = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in ("Rss", "Pss"):
                fields[name] = int(rest.split()[0])
    return fields["Rss"], fields["Pss"]


def run(ws: BenchWorkspace, *, services: int) -> ServicesResult:
    return asyncio.run(_run(ws, services))


async def _run(ws: BenchWorkspace, services: int) -> ServicesResult:
    result = ServicesResult(Samples(), Samples(), Samples(), Samples(), [])
    config = ws.config(pool={"workers": 2})
    async with Pool(ws.workspace, config=config, journal=ws.journal("services")) as pool:
        for _ in range(3):  # warm up the bash path
            await pool.call("bash", {"command": "python3 -c pass"})
        for number in range(services):
            port = _free_port()
            start = time.perf_counter_ns()
            svc = await pool.service(
                f"web-{number}", f"exec python3 -m http.server {port} --bind 127.0.0.1"
            )
            assert await svc.wait_port(port, timeout=30), svc.outcome
            result.start_to_port.add(time.perf_counter_ns() - start)
            assert svc.pid is not None
            result.memory_kib.append(_memory_kib(svc.pid))
            for samples, command in (
                (result.reach, FETCH.format(port=port)),
                (result.python_alone, "python3 -c pass"),
            ):
                start = time.perf_counter_ns()
                outcome = await pool.call("bash", {"command": command})
                samples.add(time.perf_counter_ns() - start)
                assert outcome.ok, outcome
                assert outcome.value["exit_code"] == 0, outcome
            start = time.perf_counter_ns()
            await svc.stop()
            result.stop.add(time.perf_counter_ns() - start)
    logger.info("services: {} servers started, reached and stopped", services)
    return result


def table(result: ServicesResult) -> str:
    """The section's Markdown, for bench.report."""
    rows = [
        ("start to port open", result.start_to_port),
        ("a bash call reaching it (Python's urllib)", result.reach),
        ("the same bash call's `python3 -c pass` alone", result.python_alone),
        ("stop (SIGTERM, the server exits, journaled)", result.stop),
    ]
    lines = [
        "## Services: `python3 -m http.server` as a service",
        "",
        "| row | runs | p50 | p95 |",
        "|:--|--:|--:|--:|",
        *(
            f"| {name} | {s.count} | {s.percentile_ms(50):.1f} ms | {s.percentile_ms(95):.1f} ms |"
            for name, s in rows
        ),
    ]
    if result.memory_kib:
        rss = sorted(r for r, _ in result.memory_kib)[len(result.memory_kib) // 2]
        pss = sorted(p for _, p in result.memory_kib)[len(result.memory_kib) // 2]
        lines += [
            "",
            f"An idle service's supervision (its worker, the server not counted): {rss} KiB RSS,"
            f" {pss} KiB PSS at the median; the coordinator holds its output's head and tail"
            " (nothing for an idle server) and a Service object.",
        ]
    return "\n".join(lines)


__all__ = ["ServicesResult", "run", "table"]
