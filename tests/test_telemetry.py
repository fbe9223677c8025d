"""OpenTelemetry spans, sent to a real OTLP/HTTP collector on loopback, and never in a call's way.

The collector is an ``http.server`` in this process that decodes each POST to ``/v1/traces`` as
the protobuf ``ExportTraceServiceRequest`` (opentelemetry-proto). The dead collectors are real
sockets too: a port nobody listens on, and a server that accepts and never answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from conftest import marked_config
from helpers import wait_until
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from sandbx_pool.batch.calls import CallSpec
from sandbx_pool.batch.run import run_batch
from sandbx_pool.config import Config
from sandbx_pool.errors import ConfigError
from sandbx_pool.pool import Pool
from sandbx_pool.telemetry import open_telemetry

REPO = Path(__file__).resolve().parents[1]


class Collector:
    """An OTLP/HTTP receiver: every span it was sent, attributes decoded to Python values."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.paths: list[str] = []
        self.changed = threading.Condition()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = ExportTraceServiceRequest.FromString(body)
                found = [
                    decode_span(span, resource)
                    for resource in request.resource_spans
                    for scope in resource.scope_spans
                    for span in scope.spans
                ]
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)
                with collector.changed:
                    collector.paths.append(self.path)
                    collector.spans += found
                    collector.changed.notify_all()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def named(self, name: str) -> list[dict[str, Any]]:
        return [span for span in self.spans if span["name"] == name]


def decode_span(span: Any, resource: Any) -> dict[str, Any]:
    def value(any_value: Any) -> Any:
        return getattr(any_value, any_value.WhichOneof("value"))

    return {
        "name": span.name,
        "trace_id": span.trace_id.hex(),
        "span_id": span.span_id.hex(),
        "parent": span.parent_span_id.hex(),
        "start_ns": span.start_time_unix_nano,
        "end_ns": span.end_time_unix_nano,
        "status": span.status.code,
        "attributes": {kv.key: value(kv.value) for kv in span.attributes},
        "service": {kv.key: value(kv.value) for kv in resource.resource.attributes}.get(
            "service.name"
        ),
    }


@pytest.fixture
def collector() -> Iterator[Collector]:
    found = Collector()
    found.thread.start()
    yield found
    found.server.shutdown()
    found.server.server_close()


@pytest.fixture
def black_hole() -> Iterator[str]:
    """A collector that accepts every connection, reads, and never answers."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.05)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError, OSError):
                held.append(listener.accept()[0])

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    stop.set()
    thread.join()
    for connection in held:
        connection.close()
    listener.close()


def closed_port() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}"  # closed when this returns


def telemetry_config(endpoint: str | None, timeout_s: float = 2.0) -> Config:
    config = marked_config(pool={"workers": 4})
    if endpoint is None:
        return config
    return config.override(telemetry={"otlp_endpoint": endpoint, "export_timeout_s": timeout_s})


async def test_a_span_per_call_with_its_facts_under_the_batch_span(
    workspace: Path, tmp_path: Path, collector: Collector
) -> None:
    (workspace / "a.txt").write_text("hello\n")
    calls = [
        CallSpec(line=1, call_id="r1", tool="read", args={"path": "a.txt"}),
        CallSpec(line=2, call_id="b1", tool="bash", args={"command": "exit 3"}),
        CallSpec(line=3, call_id="slow", tool="bash", args={"command": "sleep 30"}, timeout_s=0.2),
        CallSpec(line=4, call_id="out", tool="read", args={"path": "../x"}),
    ]
    config = telemetry_config(collector.url)
    async with Pool(workspace, journal=tmp_path / "j.jsonl", config=config) as pool:
        report = await run_batch(pool, calls, parallel=4)
    # close() flushed: every span is there now, without waiting for the export schedule.
    assert report.by_status() == {"ok": 2, "timeout": 1, "denied": 1}
    assert set(collector.paths) == {"/v1/traces"}
    [batch] = collector.named("sandbx-pool run")
    spans = {s["attributes"]["sandbx.call_id"]: s for s in collector.spans if s is not batch}
    assert set(spans) == {"r1", "b1", "slow", "out"}
    for span in spans.values():
        assert span["parent"] == batch["span_id"]
        assert span["trace_id"] == batch["trace_id"]
        assert span["service"] == "sandbx-pool"
        assert batch["start_ns"] <= span["start_ns"] <= span["end_ns"] <= batch["end_ns"]
        took = span["attributes"]["sandbx.duration_s"]
        assert abs((span["end_ns"] - span["start_ns"]) / 1e9 - took) < 0.05
    assert spans["b1"]["name"] == "call bash"
    assert spans["b1"]["attributes"]["sandbx.exit_code"] == 3
    assert spans["b1"]["attributes"]["sandbx.status"] == "ok"
    assert spans["b1"]["attributes"]["sandbx.worker_pid"] > 0
    assert "sandbx.killed_by" not in spans["b1"]["attributes"]
    slow = spans["slow"]["attributes"]
    assert (slow["sandbx.status"], slow["sandbx.killed_by"]) == ("timeout", "timeout")
    assert slow["sandbx.tool"] == "bash"
    assert slow["sandbx.duration_s"] >= 0.2
    assert spans["out"]["attributes"]["sandbx.status"] == "denied"
    assert spans["slow"]["status"] == 2  # STATUS_CODE_ERROR: anything but ok
    assert spans["r1"]["status"] != 2
    assert batch["attributes"]["sandbx.calls"] == 4


async def test_a_call_outside_a_batch_has_its_own_trace(
    workspace: Path, collector: Collector
) -> None:
    async with Pool(workspace, config=telemetry_config(collector.url)) as pool:
        outcome = await pool.call("ls", {})
    [span] = collector.spans
    assert span["attributes"]["sandbx.call_id"] == outcome.call_id
    assert span["parent"] == ""  # no batch span: a root


def import_check(config: dict[str, Any], workspace: Path) -> dict[str, Any]:
    """Which OpenTelemetry modules a pool that ran one call loaded, in a fresh interpreter."""
    code = f"""
import asyncio, json, sys
from sandbx_pool.config import Config
from sandbx_pool.pool import Pool

async def main():
    config = Config().override(**{json.dumps(config)})
    async with Pool({str(workspace)!r}, config=config) as pool:
        outcome = await pool.call("ls", {{}})
    return outcome.status

status = asyncio.run(main())
otel = sorted(m for m in sys.modules if m.startswith("opentelemetry"))
print(json.dumps({{"status": status, "otel": otel}}))
"""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": path},
        check=True,
    )
    result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
    return result


def test_without_an_endpoint_nothing_of_opentelemetry_is_even_imported(
    workspace: Path, collector: Collector
) -> None:
    quiet = import_check({}, workspace)
    assert quiet == {"status": "ok", "otel": []}
    # The control: the same program with an endpoint loads the SDK and sends the span.
    loud = import_check({"telemetry": {"otlp_endpoint": collector.url}}, workspace)
    assert loud["status"] == "ok"
    assert "opentelemetry.sdk.trace" in loud["otel"]
    assert len(collector.spans) == 1


#: Long enough for several export rounds (one a second) to meet the dead collector.
WINDOW_S = 2.5


async def call_rate(workspace: Path, config: Config) -> tuple[float, float]:
    """Calls a second (8 at a time, for WINDOW_S), and the seconds the pool's close took."""
    pool = Pool(workspace, config=config)
    await pool.start()
    try:
        calls, started = 0, time.monotonic()
        while time.monotonic() - started < WINDOW_S:
            outcomes = await asyncio.gather(*(pool.call("ls", {}) for _ in range(8)))
            assert {o.status for o in outcomes} == {"ok"}
            calls += len(outcomes)
        rate = calls / (time.monotonic() - started)
    finally:
        started = time.monotonic()
        await pool.close()
    return rate, time.monotonic() - started


@pytest.mark.parametrize("dead", ["black hole", "closed port"])
async def test_a_dead_collector_never_slows_or_fails_a_call(
    workspace: Path, black_hole: str, dead: str
) -> None:
    endpoint = black_hole if dead == "black hole" else closed_port()
    base_rate, _ = await call_rate(workspace, telemetry_config(None))
    dead_rate, close_s = await call_rate(workspace, telemetry_config(endpoint, timeout_s=0.5))
    # A ratio, generous for a shared machine's noise: a call that waited on an export would
    # lose 0.5 s each time, far below a third of the rate.
    assert dead_rate > base_rate / 3, (dead_rate, base_rate)
    assert close_s < 0.5 + 1.0 + 2.0, close_s  # bounded: export timeout + grace + slack


async def test_close_is_bounded_by_the_export_timeout_on_a_black_hole(
    workspace: Path, black_hole: str
) -> None:
    pool = Pool(workspace, config=telemetry_config(black_hole, timeout_s=1.0))
    await pool.start()
    await pool.call("ls", {})
    started = time.monotonic()
    await pool.close()
    assert time.monotonic() - started < 1.0 + 1.0 + 2.0


@pytest.mark.parametrize(
    ("endpoint", "words"),
    [
        ("ftp://127.0.0.1:4318", "not an http(s)://host:port URL"),
        ("127.0.0.1:4318", "not an http(s)://host:port URL"),
        ("http://127.0.0.1:99999", "not a valid port"),
        ("http://127.0.0.1:4318/?x=1", "without ? or #"),
    ],
)
def test_a_bad_endpoint_is_a_config_error_naming_it(endpoint: str, words: str) -> None:
    with pytest.raises(ConfigError, match=r"telemetry\.otlp_endpoint") as caught:
        Config().override(telemetry={"otlp_endpoint": endpoint})
    assert words in str(caught.value)


async def test_an_endpoint_without_the_extra_installed_says_which_extra(
    workspace: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    exporter = "opentelemetry.exporter.otlp.proto.http.trace_exporter"
    monkeypatch.setitem(sys.modules, exporter, None)  # as if it were not installed
    config = telemetry_config("http://127.0.0.1:4318")
    with pytest.raises(ConfigError, match=r"pip install 'sandbx-pool\[otel\]'"):
        open_telemetry(config.telemetry)
    pool = Pool(workspace, config=config)
    with pytest.raises(ConfigError, match="otel"):
        await pool.start()  # before anything is made: nothing to close, nothing left behind
    await pool.close()


async def test_spans_go_to_the_base_url_plus_v1_traces(
    workspace: Path, collector: Collector
) -> None:
    config = telemetry_config(collector.url + "/")  # a trailing slash is the same base
    async with Pool(workspace, config=config) as pool:
        await pool.call("ls", {})
        # Exported on its schedule while the pool is open, not only at close.
        await wait_until(lambda: len(collector.spans) == 1, within_s=10, what="the span")
    assert collector.paths == ["/v1/traces"]


def test_run_against_a_black_hole_says_so_once_and_finishes(
    tmp_path: Path, black_hole: str
) -> None:
    from conftest import MARKER

    config = tmp_path / "c.toml"
    config.write_text(
        f'[env]\nset = {{ {MARKER} = "{os.environ[MARKER]}" }}\n'
        f'[telemetry]\notlp_endpoint = "{black_hole}"\nexport_timeout_s = 0.3\n'
    )
    calls = tmp_path / "calls.jsonl"
    calls.write_text('{"tool": "bash", "args": {"command": "sleep 2.5"}}\n{"tool": "ls"}\n')
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    argv = ["run", str(calls), "--workspace", str(tmp_path), "--config", str(config)]
    argv += ["--journal", str(tmp_path / "j.jsonl")]
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "sandbx_pool.cli", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": path},
        check=False,
    )
    took = time.monotonic() - started
    assert done.returncode == 0, done.stderr
    assert "2 call(s) run" in done.stdout
    # Exports failed every second; the SDK's warning is shown once, through our logger.
    warnings = [line for line in done.stderr.splitlines() if "export" in line.lower()]
    assert len(warnings) == 1, done.stderr
    assert "telemetry:" in warnings[0]
    assert took < 2.5 + 0.3 + 1.0 + 8.0, took  # the calls, the bounded close, a start
