"""``python -m bench``: run the sections asked for (all by default) and print the report.

The imports of the sections live inside ``main()``: ProcessPoolExecutor's spawn and forkserver
workers re-import this module, and should not pay for sandbx-pool's imports (see bench.tasks).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any

SECTIONS = (
    "latency",
    "cancel",
    "hung",
    "throughput",
    "soak",
    "streaming",
    "search",
    "cluster",
    "oneshot",
    "changes",
    "layers",
    "images_layer",
    "sessions",
    "network",
    "services",
    "trajectory",
    "images",
    "usage",
)


@dataclass(frozen=True)
class Counts:
    latency_calls: int = 400
    cancels: int = 100
    hung_stops: int = 20
    throughput_calls: int = 2000
    soak_calls: int = 2000
    streaming_calls: int = 400
    cluster_calls: int = 800
    oneshot_runs: int = 20
    changes_calls: int = 300
    layer_samples: int = 100
    sessions_calls: int = 400
    network_calls: int = 300
    network_downloads: int = 10
    services: int = 30
    percall_rounds: int = 8  # issue 40's rows, in the latency section
    percall_per_round: int = 10
    parallel_calls: int = 600  # issue 40's rows, in the throughput section
    trajectory_rounds: int = 5
    usage_calls: int = 600


QUICK = Counts(
    latency_calls=60,
    cancels=20,
    hung_stops=5,
    throughput_calls=300,
    soak_calls=200,
    streaming_calls=60,
    cluster_calls=80,
    oneshot_runs=6,
    changes_calls=60,
    layer_samples=20,
    sessions_calls=60,
    network_calls=60,
    network_downloads=3,
    services=5,
    percall_rounds=2,
    percall_per_round=5,
    parallel_calls=160,
    trajectory_rounds=1,
    usage_calls=100,
)


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description="sandbx-pool against its peers, side by side; prints a Markdown report "
        "and writes it to bench/results/latest.md.",
    )
    parser.add_argument(
        "sections", nargs="*", metavar="SECTION", help=f"any of {', '.join(SECTIONS)} (all)"
    )
    parser.add_argument("--quick", action="store_true", help="small counts, for a smoke run")
    parser.add_argument("--soak-calls", type=int, help="calls in the soak (default 2000)")
    parser.add_argument("--seed", type=int, default=1, help="seed of the soak's plan")
    parser.add_argument(
        "--cold",
        action="store_true",
        help="search: also time grep and find with the page cache dropped before each run "
        "(root; slows the whole machine meanwhile)",
    )
    args = parser.parse_args(argv)
    unknown = [s for s in args.sections if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown section {unknown[0]!r}; choose from {', '.join(SECTIONS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    import os
    import time
    from datetime import datetime

    from loguru import logger

    from bench import (
        cancel,
        changes,
        cluster,
        hung,
        images,
        images_layer,
        latency,
        layers,
        network,
        oneshot,
        parallel,
        percall,
        report,
        search,
        services,
        sessions,
        soak,
        streaming,
        throughput,
        trajectory,
        usage,
    )
    from bench.procs import cpu_snapshot, leftovers, others_share
    from bench.workspace import MARKER, bench_workspace

    argv = sys.argv[1:] if argv is None else argv
    args = _parse(argv)
    sections = [s for s in SECTIONS if s in args.sections] or list(SECTIONS)
    counts = QUICK if args.quick else Counts()

    def progress_or_warning(record: Any) -> bool:
        # Our progress at INFO; the pool's own warnings (a stuck worker...) reach us too.
        name = record["name"] or ""
        return bool(name.startswith("bench") or record["level"].no >= logger.level("WARNING").no)

    logger.remove()
    logger.add(sys.stderr, format="[{elapsed}] {message}", level="INFO", filter=progress_or_warning)
    logger.enable("sandbx_pool")

    result = report.Report(
        started=datetime.now().astimezone(), argv=argv, load_before=os.getloadavg()
    )
    start = time.monotonic()
    with bench_workspace() as ws:
        for section in sections:
            before = cpu_snapshot()
            try:
                if section == "latency":
                    result.percall = percall.run(
                        ws, rounds=counts.percall_rounds, per_round=counts.percall_per_round
                    )
                    result.latency = latency.run(ws, calls=counts.latency_calls)
                elif section == "cancel":
                    result.cancel = cancel.run(ws, count=counts.cancels)
                elif section == "hung":
                    result.hung = hung.run(ws, count=counts.hung_stops)
                elif section == "throughput":
                    result.throughput = throughput.run(ws, calls=counts.throughput_calls)
                    result.parallel = parallel.run(ws, calls=counts.parallel_calls)
                elif section == "soak":
                    calls = args.soak_calls or counts.soak_calls
                    result.soak = soak.run(ws, calls=calls, seed=args.seed)
                elif section == "streaming":
                    result.streaming = streaming.run(ws, calls=counts.streaming_calls)
                elif section == "search":
                    cold_runs = (2 if args.quick else 5) if args.cold else 0
                    result.search = search.run(ws, runs=3 if args.quick else 9, cold_runs=cold_runs)
                elif section == "cluster":
                    result.cluster = cluster.run(ws, calls=counts.cluster_calls)
                elif section == "oneshot":
                    result.oneshot = oneshot.run(ws, runs=counts.oneshot_runs)
                elif section == "changes":
                    result.changes = changes.run(ws, calls=counts.changes_calls)
                elif section == "layers":
                    result.layers = layers.run(ws, samples=counts.layer_samples)
                elif section == "images_layer":
                    result.images_layer = images_layer.run(ws, samples=counts.layer_samples)
                elif section == "sessions":
                    result.sessions = sessions.run(ws, calls=counts.sessions_calls)
                elif section == "images":
                    result.images = images.run(ws)
                elif section == "network":
                    result.network = network.run(
                        ws, calls=counts.network_calls, downloads=counts.network_downloads
                    )
                elif section == "services":
                    result.services = services.run(ws, services=counts.services)
                elif section == "trajectory":
                    result.trajectory = trajectory.run(ws, rounds=counts.trajectory_rounds)
                elif section == "usage":
                    result.usage = usage.run(ws, calls=counts.usage_calls)
            except Exception as exc:  # the other sections still get measured and reported
                logger.exception("section {} failed", section)
                result.failed[section] = f"{type(exc).__name__}: {exc}"
            result.others_cpu[section] = others_share(before, cpu_snapshot())
        result.final_left = leftovers(MARKER, ws.marker)
    result.duration_s = time.monotonic() - start
    result.load_after = os.getloadavg()
    report.emit(result)
    return 1 if result.failed else 0


if __name__ == "__main__":
    sys.exit(main())
