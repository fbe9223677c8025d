"""Section 11: what the network allow-list costs (sandbx_pool.proxy, workers.netns).

Rows, all on one pool, in alternating rounds so that a shared machine's noise falls on every
mode alike:

* bash ``true`` with ``network = true`` (the host's network), ``false`` (a namespace of its
  own, nothing in it) and an allow-list (a namespace, loopback brought up, a listening socket
  handed to the proxy and taken back after the call): the per-call cost of the namespace and
  the registration, which every allow-listed bash call pays whether it uses the network or not.
* ``pip download`` of a small wheel from a local index (a simple index and a wheel built here,
  served on the host's loopback by a thread of this process; no internet), direct
  (``network = true``, by address) against through the proxy (by a name pinned in
  ``network_hosts``): pip's own start-up dominates both, the difference is the proxy's.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import http.server
import shutil
import sys
import tempfile
import threading
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loguru import logger

from bench.stats import Samples
from bench.workspace import BenchWorkspace
from sandbx_pool import Pool

MODES = ("true", "false", "allow-list")
ROUNDS = 6
PACKAGE = "sbxbench_tiny"
VERSION = "1.0"
INDEX_NAME = "index.bench.test"
#: pip runs in the call: the interpreter this bench runs under (its installation is readable
#: by the call; the system's may have no pip).
PIP = f"{sys.executable} -m pip download --no-deps --no-cache-dir --disable-pip-version-check -q"


@dataclass
class NetworkResult:
    true_by_mode: dict[str, Samples] = field(default_factory=lambda: {m: Samples() for m in MODES})
    pip_direct: Samples = field(default_factory=Samples)
    pip_proxied: Samples = field(default_factory=Samples)

    def extra_ms(self, mode: str) -> float:
        return self.true_by_mode[mode].p50 - self.true_by_mode["true"].p50


def build_wheel(directory: Path) -> Path:
    """A pure-Python wheel of one module, made by hand (a wheel is a zip with a RECORD)."""
    name = f"{PACKAGE}-{VERSION}-py3-none-any.whl"
    info = f"{PACKAGE}-{VERSION}.dist-info"
    files = {
        f"{PACKAGE}.py": b"VALUE = 1\n",
        f"{info}/METADATA": (
            f"Metadata-Version: 2.1\nName: {PACKAGE}\nVersion: {VERSION}\n".encode()
        ),
        f"{info}/WHEEL": (
            b"Wheel-Version: 1.0\nGenerator: bench\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    record = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{info}/RECORD,,")
    files[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    wheel = directory / name
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, data in files.items():
            archive.writestr(path, data)
    return wheel


class LocalIndex:
    """A PEP 503 simple index of one project, on the host's loopback."""

    def __init__(self, wheel: Path) -> None:
        data = wheel.read_bytes()
        sha = hashlib.sha256(data).hexdigest()
        page = f'<a href="/files/{wheel.name}#sha256={sha}">{wheel.name}</a>\n'.encode()
        routes = {f"/simple/{PACKAGE.replace('_', '-')}/": page, f"/files/{wheel.name}": data}

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = routes.get(self.path)
                if body is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                kind = "text/html" if self.path.startswith("/simple/") else "application/zip"
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def run(ws: BenchWorkspace, *, calls: int, downloads: int) -> NetworkResult:
    scratch = Path(tempfile.mkdtemp(prefix="sandbx-bench-index-"))
    index = LocalIndex(build_wheel(scratch))
    try:
        return asyncio.run(_run(ws, calls, downloads, index.port))
    finally:
        index.close()
        shutil.rmtree(scratch, ignore_errors=True)


def _network(mode: str, port: int) -> bool | list[str]:
    return {"true": True, "false": False}.get(mode, [f"{INDEX_NAME}:{port}"])


async def _pip(pool: Pool, host: str, port: int, network: bool | list[str]) -> int:
    command = (
        f"{PIP} --index-url http://{host}:{port}/simple/ --trusted-host {host}"
        f' -d "$TMPDIR/dl" {PACKAGE} && test -f "$TMPDIR/dl/{PACKAGE}-{VERSION}-py3-none-any.whl"'
    )
    start = time.perf_counter_ns()
    outcome = await pool.call("bash", {"command": command}, network=network, timeout=120)
    elapsed = time.perf_counter_ns() - start
    assert outcome.value is not None, outcome
    assert outcome.value["exit_code"] == 0, outcome.value["stderr"]
    return elapsed


async def _run(ws: BenchWorkspace, calls: int, downloads: int, port: int) -> NetworkResult:
    result = NetworkResult()
    config = ws.config(
        pool={"workers": 2},
        journal={"policy": "off"},
        sandbox={"network_hosts": {INDEX_NAME: "127.0.0.1"}},
    )
    area = ws.workspace / "network-bench"
    area.mkdir(exist_ok=True)
    async with Pool(area, config=config) as pool:
        for mode in MODES:  # warm up (the allow-list's first call starts the proxy)
            await pool.call("bash", {"command": "true"}, network=_network(mode, port))
        per_round = max(1, calls // ROUNDS)
        for round_number in range(ROUNDS):
            order = MODES if round_number % 2 == 0 else tuple(reversed(MODES))
            for mode in order:
                network = _network(mode, port)
                for _ in range(per_round):
                    start = time.perf_counter_ns()
                    outcome = await pool.call("bash", {"command": "true"}, network=network)
                    result.true_by_mode[mode].add(time.perf_counter_ns() - start)
                    assert outcome.ok, outcome
        await _pip(pool, "127.0.0.1", port, True)  # warm pip's pages
        for number in range(downloads):
            direct = _pip(pool, "127.0.0.1", port, True)
            proxied = _pip(pool, INDEX_NAME, port, _network("allow-list", port))
            if number % 2:
                result.pip_proxied.add(await proxied)
                result.pip_direct.add(await direct)
            else:
                result.pip_direct.add(await direct)
                result.pip_proxied.add(await proxied)
    logger.info(
        "network: {} bash calls a mode, {} downloads each way",
        result.true_by_mode["true"].count,
        result.pip_direct.count,
    )
    return result


def main() -> None:
    """``python -m bench.network``: this section alone, printed as its report table."""
    from bench import report
    from bench.workspace import bench_workspace

    with bench_workspace() as ws:
        print(report.network_table(run(ws, calls=120, downloads=8)))


if __name__ == "__main__":
    main()
