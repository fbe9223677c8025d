"""What a user namespace per call costs: bash ``true`` as root against the same as a user.

``python -m bench.userns [--user NAME] [--calls N] [--rounds R] [--python PATH]``, run as root:
three pools, each in an interpreter of its own, serve bash ``true`` one call after another:

* R: this machine's root (PID, mount, IPC and network namespaces made directly; pids cgroups);
* U: ``NAME`` (``runuser -u NAME``), each worker in a user namespace of its own;
* N: ``NAME`` with ``[sandbox] user_namespaces = false``, the fallback without namespaces.

They take turns, R U N R U N..., a round of N calls each, so that the noise of a shared machine
falls on all alike; the figure is each one's p50 over every round, and U's difference to R (the
bar: at most 1 ms more). The same interpreter serves all three (``--python``: one the user can
read), so the difference is the environment's, not the interpreter's.

Each pool is served by this module itself (``--serve``): it reads "N" on stdin, makes N calls and
answers with their durations in nanoseconds, as one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.stats import Samples

#: The bar: U's p50 at most this much above R's.
BAR_MS = 1.0

#: Calls each pool makes before the rounds start (imports, a first fork, warm caches).
WARM_UP_CALLS = 20

ROOT = Path(__file__).resolve().parent.parent


async def _serve(user_namespaces: bool) -> None:
    from sandbx_pool import Config, Pool

    workspace = tempfile.mkdtemp(prefix="sandbx-bench-userns-")
    config = Config().override(
        pool={"workers": 2}, sandbox={"user_namespaces": user_namespaces}, journal={"policy": "off"}
    )
    try:
        async with Pool(workspace, config=config) as pool:
            for _ in range(WARM_UP_CALLS):
                await pool.call("bash", {"command": "true"})
            assert pool.fleet.template is not None
            ready = {"user_namespaces": pool.fleet.template.user_namespaces}
            print(json.dumps(ready), flush=True)
            for line in sys.stdin:
                durations = []
                for _ in range(int(line)):
                    start = time.perf_counter_ns()
                    outcome = await pool.call("bash", {"command": "true"})
                    durations.append(time.perf_counter_ns() - start)
                    if outcome.status != "ok":
                        raise RuntimeError(f"bash true: {outcome}")
                print(json.dumps(durations), flush=True)
    finally:
        shutil.rmtree(workspace, ignore_errors=True)


@dataclass
class Server:
    name: str
    process: subprocess.Popen[str]
    samples: Samples

    def round(self, calls: int) -> None:
        assert self.process.stdin is not None
        assert self.process.stdout is not None
        self.process.stdin.write(f"{calls}\n")
        self.process.stdin.flush()
        for ns in json.loads(self.process.stdout.readline()):
            self.samples.add(ns)

    def close(self) -> None:
        if self.process.stdin is not None:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _start(name: str, python: str, user: str | None, user_namespaces: bool) -> Server:
    command = [python, "-m", "bench.userns", "--serve"]
    if not user_namespaces:
        command.append("--no-user-namespaces")
    env = {"PATH": os.environ.get("PATH", os.defpath), "PYTHONPATH": str(ROOT)}
    if user is not None:
        home = os.path.expanduser(f"~{user}")
        command = ["runuser", "-u", user, "--", "env", f"HOME={home}", *command]
    process = subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd="/"
    )
    assert process.stdout is not None
    ready = process.stdout.readline()
    if not ready:
        process.wait()
        raise RuntimeError(f"{name}: the pool did not start ({process.returncode})")
    if json.loads(ready)["user_namespaces"] is not (name == "U"):
        process.kill()
        process.wait()
        raise RuntimeError(f"{name}: user namespaces {ready.strip()}, not as this row needs")
    return Server(name, process, Samples())


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.userns", description=__doc__)
    parser.add_argument("--user", default="sbxu", help="the unprivileged user (U and N)")
    parser.add_argument("--calls", type=int, default=50, help="calls per round and pool")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--python", default=sys.executable, help="an interpreter USER can run")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--no-user-namespaces", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        asyncio.run(_serve(not args.no_user_namespaces))
        return 0
    if os.geteuid() != 0:
        parser.error("run as root: it compares root's pool with USER's")
    servers: list[Server] = []
    try:
        servers.append(_start("R", args.python, None, True))
        servers.append(_start("U", args.python, args.user, True))
        servers.append(_start("N", args.python, args.user, False))
        for _ in range(args.rounds):
            for server in servers:
                server.round(args.calls)
    finally:
        for server in servers:
            server.close()
    p50 = {server.name: server.samples.p50 for server in servers}
    print(f"bash true, p50 over {args.rounds} x {args.calls} calls each, alternating rounds:")
    for server in servers:
        s = server.samples
        print(f"  {server.name}  p50 {s.p50:6.2f} ms  p95 {s.p95:6.2f} ms  ({s.count} calls)")
    extra = p50["U"] - p50["R"]
    verdict = "within" if extra <= BAR_MS else "over"
    print(f"U - R: {extra:+.2f} ms at p50 ({verdict} the {BAR_MS:g} ms bar)")
    return 0 if extra <= BAR_MS else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
