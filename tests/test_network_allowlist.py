"""network = [hosts]: a namespace per call whose only way out is the pool's proxy.

Real sockets, real network namespaces, the real proxy process; the servers are the test's
own, on the host's loopback, which the proxy (in the host's namespace) reaches and the call (in
its own) cannot. Names are pinned with ``network_hosts``: no DNS is asked.
"""

from __future__ import annotations

import asyncio
import http.server
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import marked_config
from test_cli import cli

from sandbx_pool import ConfigError, Pool
from sandbx_pool import proxy as proxy_module
from sandbx_pool.allow_list import parse_network, permits
from sandbx_pool.batch.calls import BatchFileError, parse_batch
from sandbx_pool.proxy import MAX_CONNECTIONS_PER_CALL, CallLink, Proxy, reachable
from sandbx_pool.proxy_requests import BadRequest, parse_head

PYTHON = "/usr/bin/python3"

needs_allow_list = pytest.mark.needs("network allow-list")


class _Index(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.server.seen.append((self.path, self.headers.get("Host")))  # type: ignore[attr-defined]
        body = b"index says hello\n"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


class Server:
    """An HTTP server on the host's loopback, and a raw TCP one (a tunnel's far end) that
    answers each connection's first bytes with ``echo:`` and them; both record who came."""

    def __init__(self) -> None:
        self.http = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Index)
        self.http.seen = []  # type: ignore[attr-defined]
        self.port = self.http.server_address[1]
        self.raw = socket.create_server(("127.0.0.1", 0))
        self.raw_port = self.raw.getsockname()[1]
        self.raw_connections = 0
        self.threads = [
            threading.Thread(target=self.http.serve_forever, daemon=True),
            threading.Thread(target=self._echo, daemon=True),
        ]
        for thread in self.threads:
            thread.start()

    @property
    def seen(self) -> list[tuple[str, str]]:
        return self.http.seen  # type: ignore[attr-defined,no-any-return]

    def _echo(self) -> None:
        while True:
            try:
                conn, _ = self.raw.accept()
            except OSError:
                return
            self.raw_connections += 1
            with conn:
                data = conn.recv(1024)
                conn.sendall(b"echo:" + data)

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()
        self.raw.close()


@pytest.fixture
def server() -> Iterator[Server]:
    found = Server()
    yield found
    found.close()


def allow_config(network: object, **hosts: str) -> Any:
    pinned = {"index.test": "127.0.0.1", "evil.test": "127.0.0.1", **hosts}
    return marked_config(sandbox={"network": network, "network_hosts": pinned})


# The call's client: stdlib only, run by the system's python3 inside the call.
CLIENT = textwrap.dedent(
    """
    import json, os, select, socket, sys, time
    proxy = ("127.0.0.1", int(os.environ["HTTPS_PROXY"].rsplit(":", 1)[1]))
    def ask(head, then=b""):
        s = socket.create_connection(proxy, timeout=10)
        s.sendall(head)
        answer = s.recv(4096)
        if then and answer.startswith(b"HTTP/1.1 200"):
            s.sendall(then)
            answer += s.recv(4096)
        s.close()
        return answer.decode("latin-1")
    def status(head, then=b""):
        answer = ask(head, then)
        return answer.split(" ", 2)[1] if answer else "closed", answer
    out = {}
    for name, head, then in json.loads(sys.argv[1]):
        out[name] = status(head.encode("latin-1"), then.encode())
    print(json.dumps(out))
    """
)


async def run_client(pool: Pool, workspace: Path, asks: list[tuple[str, str, str]]) -> Any:
    (workspace / "client.py").write_text(CLIENT)
    arg = json.dumps(asks).replace("'", "'\\''")
    outcome = await pool.call("bash", {"command": f"{PYTHON} client.py '{arg}'"}, timeout=60)
    assert outcome.status == "ok", outcome
    assert outcome.value is not None
    assert outcome.value["exit_code"] == 0, outcome.value["stderr"]
    return outcome.value, json.loads(outcome.value["stdout"])


# -- the list and its checks (no privilege needed) -------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        "http://x",
        "*.",
        "a b",
        "10.0.0.1",
        "[::1]:443",
        "",
        "x" * 300,
        "a.*.b",
        "h:0",
        "h:99999",
        "h:08",
        "-a.org",
        "*",
        "a..b",
        "a.org:\u00b2",
    ],
)
def test_a_pattern_that_is_not_a_host_name_is_a_config_error_naming_it(bad: str) -> None:
    with pytest.raises(ConfigError, match=r"sandbox\.network") as caught:
        marked_config(sandbox={"network": ["ok.example.org", bad]})
    assert repr(bad)[:60] in str(caught.value)


def test_patterns_are_canonical_and_match_as_documented() -> None:
    allow = parse_network(["Index.Example.org.", "*.files.example.org", "mirror.test:8080"])
    assert allow == ("index.example.org", "*.files.example.org", "mirror.test:8080")
    assert isinstance(allow, tuple)
    assert permits(allow, "index.example.org", 443, tunnel=True)
    assert permits(allow, "index.example.org", 80, tunnel=False)
    assert not permits(allow, "index.example.org", 80, tunnel=True)  # a tunnel is 443
    assert not permits(allow, "index.example.org", 22, tunnel=True)
    assert permits(allow, "a.b.files.example.org", 443, tunnel=True)
    assert not permits(allow, "files.example.org", 443, tunnel=True)  # *. is a suffix only
    assert not permits(allow, "evilfiles.example.org", 443, tunnel=True)
    assert permits(allow, "mirror.test", 8080, tunnel=True)
    assert not permits(allow, "mirror.test", 443, tunnel=True)


def test_network_hosts_pin_names_to_addresses_only() -> None:
    with pytest.raises(ConfigError, match=r"network_hosts.*not an IP address"):
        marked_config(sandbox={"network_hosts": {"mirror.test": "mirror.example.org"}})
    with pytest.raises(ConfigError, match=r"network_hosts.*not a host name"):
        marked_config(sandbox={"network_hosts": {"a b": "127.0.0.1"}})


def test_the_proxy_reads_heads_strictly() -> None:
    assert parse_head(b"CONNECT Index.Test:443 HTTP/1.1\r\nHost: x\r\n\r\n").host == "index.test"
    plain = parse_head(
        b"GET http://index.test:81/simple/ HTTP/1.1\r\nConnection: keep-alive\r\n\r\n"
    )
    assert (plain.host, plain.port, plain.tunnel) == ("index.test", 81, False)
    assert plain.upstream_head.startswith(b"GET /simple/ HTTP/1.1\r\nHost: index.test:81\r\n")
    assert b"keep-alive" not in plain.upstream_head
    assert b"Connection: close" in plain.upstream_head
    by_host = parse_head(b"GET /x HTTP/1.1\r\nHost: index.test\r\n\r\n")
    assert (by_host.host, by_host.port) == ("index.test", 80)
    for head, status in [
        (b"CONNECT index.test HTTP/1.1\r\n\r\n", 400),  # no port
        (b"CONNECT 127.0.0.1:443 HTTP/1.1\r\n\r\n", 403),  # an address: never on the list
        (b"CONNECT [::1]:443 HTTP/1.1\r\n\r\n", 403),
        (b"GET https://index.test/ HTTP/1.1\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\n\r\n", 400),  # no Host
        (b"\x16\x03\x01garbage\r\n\r\n", 400),
        (b"GET http://user@index.test/ HTTP/1.1\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nno colon here\r\n\r\n", 400),
        (b"GET http://index.test/ HTTP/1.1\r\nX: a\nHost: evil.test\r\n\r\n", 400),
        # A latin-1 superscript is a digit to isdigit(), not to int(): a refusal, not a crash
        # of the connection's task (a traceback on the pool's stderr per connection).
        (b"CONNECT index.test:\xb2 HTTP/1.1\r\n\r\n", 400),
        (b"GET http://index.test:\xb9/ HTTP/1.1\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nHost: index.test:\xb3\r\n\r\n", 400),
    ]:
        with pytest.raises(BadRequest) as caught:
            parse_head(head)
        assert caught.value.status == status, head


def test_internal_addresses_are_not_reachable_by_a_listed_name() -> None:
    for address in [
        "127.0.0.1",
        "::1",
        "169.254.169.254",
        "10.1.2.3",
        "192.168.0.1",
        "100.64.0.1",
        "0.0.0.0",
        "::ffff:127.0.0.1",
        "fe80::1",
        "224.0.0.1",
        # IPv6 that a translator on the way turns into an internal IPv4 address (a cloud's
        # DNS64/NAT64 gateway reaches the VPC's private hosts): judged by what it carries.
        "64:ff9b::a00:5",  # NAT64: 10.0.0.5
        "64:ff9b::a9fe:a9fe",  # NAT64: 169.254.169.254
        "64:ff9b:1::a00:5",  # local-use NAT64: anywhere its operator routes
        "2002:a9fe:a9fe::1",  # 6to4 of 169.254.169.254
        "::7f00:1",  # IPv4-compatible 127.0.0.1
    ]:
        assert not reachable(address), address
    assert reachable("93.184.215.14")
    assert reachable("64:ff9b::5db8:d70e")  # NAT64 of a public address: what NAT64 is for


async def test_a_bad_per_call_network_is_a_value_error(workspace: Path, tmp_path: Path) -> None:
    async with Pool(workspace, journal=tmp_path / "j.jsonl", config=marked_config()) as pool:
        for bad in (["http://x"], "index.test", 3):
            with pytest.raises(ValueError, match="network"):
                await pool.call("bash", {"command": "true"}, network=bad)  # type: ignore[arg-type]
        assert pool.journal is not None
    assert "intent" not in (tmp_path / "j.jsonl").read_text()


def test_a_batch_line_carries_its_network() -> None:
    text = (
        '{"tool": "bash", "args": {"command": "true"}, "network": ["index.test"]}\n'
        '{"tool": "bash", "args": {"command": "true"}, "network": false}\n'
    )
    specs = parse_batch(text.splitlines()).calls
    assert [spec.network for spec in specs] == [("index.test",), False]
    with pytest.raises(BatchFileError) as caught:
        parse_batch(['{"tool": "bash", "args": {"command": "true"}, "network": ["a b"]}'])
    assert "'a b'" in caught.value.problems[0].message


# -- through the proxy ---------------------------------------------------------------------------


@needs_allow_list
async def test_a_listed_host_is_reached_and_an_unlisted_one_gets_403(
    workspace: Path, server: Server
) -> None:
    allow = [f"index.test:{server.port}", f"index.test:{server.raw_port}"]
    async with Pool(workspace, config=allow_config(allow), workers=2) as pool:
        command = (
            f"curl -sS -m 10 http://index.test:{server.port}/simple/ && env | sort | grep -i proxy"
            f"; curl -sS -m 10 -o /dev/null -w '%{{http_code}}' http://evil.test:{server.port}/"
        )
        outcome = await pool.call("bash", {"command": command}, timeout=60)
        assert outcome.status == "ok", outcome
        assert outcome.value is not None
        stdout = outcome.value["stdout"]
        assert stdout.startswith("index says hello\n")
        assert stdout.endswith("403")
        for name in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY"):
            assert f"{name}=http://127.0.0.1:" in stdout
        assert "NO_PROXY=localhost,127.0.0.1,::1" in stdout
        assert outcome.value["network_denied"] == ["evil.test"]
        # The server saw the allowed request only, by its name.
        assert server.seen == [("/simple/", f"index.test:{server.port}")]

        value, answers = await run_client(
            pool,
            workspace,
            [
                ("tunnel", f"CONNECT index.test:{server.raw_port} HTTP/1.1\r\n\r\n", "ping"),
                ("unlisted", f"CONNECT evil.test:{server.raw_port} HTTP/1.1\r\n\r\n", "ping"),
                ("port", "CONNECT index.test:22 HTTP/1.1\r\n\r\n", "ping"),
                ("address", f"CONNECT 127.0.0.1:{server.raw_port} HTTP/1.1\r\n\r\n", "ping"),
            ],
        )
        assert answers["tunnel"][0] == "200"
        assert answers["tunnel"][1].endswith("echo:ping")
        assert [answers[k][0] for k in ("unlisted", "port", "address")] == ["403"] * 3
        assert value["network_denied"] == ["evil.test", "index.test", "127.0.0.1"]
        assert server.raw_connections == 1  # nothing was sent upstream for the refused ones


@needs_allow_list
async def test_nothing_leaves_the_call_but_through_the_proxy(
    workspace: Path, server: Server
) -> None:
    (workspace / "direct.py").write_text(
        textwrap.dedent(f"""
        import socket
        def tcp(address):
            try:
                socket.create_connection(address, timeout=5).close()
                return "connected"
            except OSError as exc:
                return exc.__class__.__name__
        def udp(address):
            try:
                socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"x", address)
                return "sent"
            except OSError as exc:
                return exc.__class__.__name__
        def lookup(name):
            try:
                socket.getaddrinfo(name, 80)
                return "resolved"
            except OSError as exc:
                return exc.__class__.__name__
        print(tcp(("127.0.0.1", {server.port})), tcp(("192.0.2.1", 80)), tcp(("10.1.2.3", 80)),
              udp(("192.0.2.1", 53)), lookup("index.test"))
    """)
    )
    async with Pool(workspace, config=allow_config(["index.test"]), workers=2) as pool:
        outcome = await pool.call("bash", {"command": f"{PYTHON} direct.py"}, timeout=60)
        assert outcome.status == "ok", outcome
        assert outcome.value is not None
        assert outcome.value["stdout"].split() == [
            "ConnectionRefusedError",  # the call's own loopback: the host's server is not there
            "OSError",  # ENETUNREACH: no route but loopback
            "OSError",
            "OSError",
            "gaierror",  # names are the proxy's to resolve
        ], outcome.value["stderr"]
        assert "network_denied" not in outcome.value
        # The control: the same with the host's network reaches the host's loopback server.
        outcome = await pool.call("bash", {"command": f"{PYTHON} direct.py"}, network=True)
        assert outcome.value is not None
        assert outcome.value["stdout"].split()[0] == "connected"


@needs_allow_list
async def test_a_name_resolving_to_loopback_is_refused_unless_pinned(
    workspace: Path, server: Server
) -> None:
    # localhost resolves (from /etc/hosts, no DNS) to 127.0.0.1: as a rebound DNS name would.
    allow = [f"localhost:{server.port}", f"index.test:{server.port}"]
    async with Pool(workspace, config=allow_config(allow), workers=2) as pool:
        command = (
            f"curl -sS -m 10 -w ' %{{http_code}}' http://localhost:{server.port}/ --proxy"
            ' "$HTTP_PROXY" --noproxy ""'
        )
        outcome = await pool.call("bash", {"command": command}, timeout=60)
        assert outcome.value is not None
        assert outcome.value["stdout"].endswith(" 403"), outcome.value
        assert "not a public address" in outcome.value["stdout"]
        assert outcome.value["network_denied"] == ["localhost"]
        assert server.seen == []


@needs_allow_list
async def test_per_call_network_replaces_the_pools(workspace: Path, server: Server) -> None:
    url = f"http://index.test:{server.port}/"
    curl = f"curl -sS -m 10 -o /dev/null -w '%{{http_code}}' {url}"
    async with Pool(workspace, config=allow_config([f"index.test:{server.port}"])) as pool:
        cut = await pool.call("bash", {"command": curl}, network=False, timeout=60)
        assert cut.value is not None
        assert cut.value["exit_code"] != 0  # no proxy, no network: not even a listed host
        other = await pool.call(
            "bash", {"command": curl}, network=["other.example.org"], timeout=60
        )
        assert other.value is not None
        assert other.value["stdout"] == "403"
        assert other.value["network_denied"] == ["index.test"]
        assert server.seen == []
    async with Pool(
        workspace, config=marked_config(sandbox={"network_hosts": {"index.test": "127.0.0.1"}})
    ) as pool:
        # A pool with the host's network: one call of it allow-listed (the proxy starts then).
        listed = await pool.call(
            "bash", {"command": curl}, network=[f"index.test:{server.port}"], timeout=60
        )
        assert listed.value is not None, listed
        assert listed.value["stdout"] == "200", listed
    assert len(server.seen) == 1


@needs_allow_list
async def test_the_proxy_survives_garbage_half_open_and_huge_heads(
    workspace: Path, server: Server
) -> None:
    good = f"GET http://index.test:{server.port}/after HTTP/1.1\r\n\r\n"
    async with Pool(workspace, config=allow_config([f"index.test:{server.port}"])) as pool:
        (workspace / "rude.py").write_text(
            CLIENT.replace(
                "out = {}",
                textwrap.dedent("""
            out = {}
            for junk in (b"\\x00" * 3000 + b"\\r\\n\\r\\n", b"GET\\r\\n\\r\\n", b"X" * 20000):
                s = socket.create_connection(proxy, timeout=10)
                try:
                    s.sendall(junk)
                    out.setdefault("junk", []).append(s.recv(100).split(b" ")[1].decode())
                except OSError as exc:
                    out.setdefault("junk", []).append(type(exc).__name__)
                s.close()
            half = socket.create_connection(proxy, timeout=10)
            half.sendall(b"CONNECT index.test:%d HTTP/1.1\\r\\n" % int(sys.argv[2]))
            half.shutdown(socket.SHUT_WR)  # half-open, the head never finished
            out["half"] = half.recv(100).decode() or "closed"
            slow = socket.create_connection(proxy, timeout=10)
            slow.sendall(b"GET http://index.te")  # and then nothing, while others are served
        """),
            )
        )
        command = f"{PYTHON} rude.py '{json.dumps([('good', good, '')])}' {server.raw_port}"
        outcome = await pool.call("bash", {"command": command}, timeout=60)
        assert outcome.value is not None, outcome
        assert outcome.value["exit_code"] == 0, outcome
        answers = json.loads(outcome.value["stdout"])
        assert answers["junk"] == ["400", "400", "431"]
        assert answers["half"] == "closed"
        assert answers["good"][0] == "200"
    assert server.seen == [("/after", f"index.test:{server.port}")]


@needs_allow_list
async def test_a_flood_from_one_call_does_not_starve_another(
    workspace: Path, server: Server
) -> None:
    flood = 3 * MAX_CONNECTIONS_PER_CALL
    (workspace / "flood.py").write_text(
        textwrap.dedent(f"""
        import os, select, socket, time
        proxy = ("127.0.0.1", int(os.environ["HTTP_PROXY"].rsplit(":", 1)[1]))
        held = [socket.create_connection(proxy, timeout=10) for _ in range({flood})]
        refused, deadline = set(), time.monotonic() + 20
        while len(refused) < {flood - MAX_CONNECTIONS_PER_CALL} and time.monotonic() < deadline:
            ready, _, _ = select.select([s for s in held if s not in refused], [], [], 1)
            for s in ready:
                assert s.recv(100).startswith(b"HTTP/1.1 503"), "not a 503"
                refused.add(s)
        open("flooding", "w").write(str(len(refused)))
        while not os.path.exists("stop"):
            time.sleep(0.05)  # the test's signal: it comes from outside this call
        print(len(refused))
    """)
    )
    curl = f"curl -sS -m 10 http://index.test:{server.port}/other"
    async with Pool(workspace, config=allow_config([f"index.test:{server.port}"])) as pool:
        flooding = asyncio.create_task(
            pool.call("bash", {"command": f"{PYTHON} flood.py"}, timeout=60)
        )
        deadline = time.monotonic() + 30
        while not (workspace / "flooding").exists():
            assert time.monotonic() < deadline, "the flooding call never got going"
            assert not flooding.done(), flooding
            await asyncio.sleep(0.05)
        started = time.monotonic()
        other = await pool.call("bash", {"command": curl}, timeout=60)
        took = time.monotonic() - started
        (workspace / "stop").write_text("")
        flooded = await flooding
        assert other.value is not None, other
        assert other.value["stdout"] == "index says hello\n", other
        assert took < 5.0  # served at once, not after the flood's heads time out (10 s)
        assert flooded.value is not None, flooded
        assert flooded.value["stdout"].strip() == str(flood - MAX_CONNECTIONS_PER_CALL)


@needs_allow_list
def test_the_proxy_ends_with_a_killed_pool(tmp_path: Path) -> None:
    workspace = tmp_path / "ws"
    workspace.mkdir()
    script = textwrap.dedent(f"""
        import asyncio, os, sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from conftest import marked_config
        from sandbx_pool import Pool
        async def main():
            config = marked_config(sandbox={{"network": ["index.test"]}})
            pool = Pool({str(workspace)!r}, config=config, workers=1)
            await pool.start()
            await pool.call("bash", {{"command": "true"}})
            print(pool._network.handle.process.pid, flush=True)  # the test's only look inside
            await asyncio.sleep(600)
        asyncio.run(main())
    """)
    process = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, env={**os.environ}
    )
    try:
        assert process.stdout is not None
        proxy_pid = int(process.stdout.readline())
        os.kill(proxy_pid, 0)
        process.send_signal(signal.SIGKILL)
        process.wait()
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{proxy_pid}") and _state(proxy_pid) != "Z":
            assert time.monotonic() < deadline, "the proxy outlived its pool"
            time.sleep(0.02)  # the outside world: a process exiting
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        if process.stdout is not None:
            process.stdout.close()


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/usr/bin/setpriv"), reason="root")
def test_no_namespace_refuses_the_call_never_runs_it_online(tmp_path: Path) -> None:
    """A container's root (no CAP_SYS_ADMIN): the list cannot be enforced, so the call is
    refused, never run with the host's network."""
    workspace = tmp_path / "ws"
    workspace.mkdir()
    script = textwrap.dedent(f"""
        import asyncio, sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from conftest import marked_config
        from sandbx_pool import Pool
        async def main():
            config = marked_config(sandbox={{"network": ["index.test"]}})
            async with Pool({str(workspace)!r}, config=config, workers=1) as pool:
                o = await pool.call("bash", {{"command": "touch ran"}})
                print(o.status, o.error)
        asyncio.run(main())
    """)
    caps = "+chown,+dac_override,+fowner,+fsetid,+kill,+setgid,+setuid,+setpcap,"
    caps += "+net_bind_service,+net_raw,+sys_chroot,+mknod,+audit_write,+setfcap"
    done = subprocess.run(
        ["setpriv", f"--bounding-set=-all,{caps}", "--inh-caps=-all", sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.stdout.startswith("error "), done.stderr
    assert "network namespace" in done.stdout
    assert not (workspace / "ran").exists()


async def test_where_doctor_says_no_an_allow_listed_call_is_refused(
    workspace: Path, tmp_path: Path
) -> None:
    """The environment's own answer: run the call if the doctor says the list holds here,
    else the call must be refused, never run with the host's network."""
    from conftest import doctor_checks

    enforced = doctor_checks()["network allow-list"].ok
    async with Pool(workspace, config=allow_config(["index.test"]), workers=1) as pool:
        outcome = await pool.call("bash", {"command": "touch ran"}, timeout=60)
        grep = await pool.call("grep", {"pattern": "hello"}, timeout=60)
    if enforced:
        assert outcome.status == "ok", outcome
        assert (workspace / "ran").exists()
    else:
        assert outcome.status == "error", outcome
        assert outcome.error is not None
        assert "namespace" in outcome.error
        assert not (workspace / "ran").exists()
    # grep needs no network: under a list it gets none, and runs wherever network = false does.
    assert grep.status == "ok", grep
    assert grep.value is not None
    assert grep.value["matches"][0]["path"] == "hello.txt"


@needs_allow_list
async def test_a_call_cannot_reach_the_proxys_own_socket(workspace: Path, server: Server) -> None:
    """Registering a listener of its own would give a call any list it liked: the socket lies
    in the runtime directory every call's mount namespace covers."""
    async with Pool(workspace, config=allow_config([f"index.test:{server.port}"])) as pool:
        first = await pool.call("bash", {"command": "true"}, timeout=60)
        assert first.ok, first
        proxy = pool._network.handle  # its socket and process: the test's only look inside
        assert proxy is not None
        path = proxy.path
        assert Path(path).is_socket()  # noqa: ASYNC240 (a stat of our own runtime directory)
        probe = (
            f"{PYTHON} -c 'import socket; s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)"
            f'; s.connect("{path}")\'; echo "rc=$?"; ls -l /proc/self/fd/ | grep -c socket'
        )
        outcome = await pool.call("bash", {"command": probe}, timeout=60)
        assert outcome.value is not None
        stdout = outcome.value["stdout"]
        assert "rc=1" in stdout, outcome.value
        assert "Error" in outcome.value["stderr"]  # ENOENT or EACCES: the directory is covered
        assert stdout.split()[-1] == "0"  # no socket of the worker's leaked into the command
        # And the proxy itself holds no capability, whoever runs the pool.
        assert proxy.process is not None
        status = Path(f"/proc/{proxy.process.pid}/status").read_text()  # noqa: ASYNC240
        assert "CapEff:\t0000000000000000" in status
        assert "NoNewPrivs:\t1" in status


@needs_allow_list
async def test_the_journal_keeps_the_calls_network_and_what_was_refused(
    workspace: Path, tmp_path: Path, server: Server
) -> None:
    journal = tmp_path / "journal.jsonl"
    curl = f"curl -sS -m 10 -o /dev/null http://evil.test:{server.port}/"
    config = allow_config([f"index.test:{server.port}"])
    async with Pool(workspace, journal=journal, config=config) as pool:
        await pool.call("bash", {"command": curl}, call_id="pool-list", timeout=60)
        await pool.call("bash", {"command": curl}, call_id="own", network=["a.test"], timeout=60)
    records = [json.loads(line) for line in journal.read_text().splitlines()]
    intents = {r["call_id"]: r for r in records if r["kind"] == "intent"}
    outcomes = {r["call_id"]: r for r in records if r["kind"] == "outcome"}
    assert intents["pool-list"].get("network") is None  # the pool's config says it
    assert intents["own"]["network"] == ["a.test"]
    assert outcomes["pool-list"]["network_denied"] == ["evil.test"]
    assert outcomes["own"]["network_denied"] == ["evil.test"]


@needs_allow_list
def test_a_batch_lines_network_is_the_calls(tmp_path: Path, server: Server) -> None:
    # The command in a process of its own, as users run it: in this one, asyncio.run may be
    # what an earlier test's import (Inspect's nest_asyncio) made of it, and leak its loop.
    workspace = tmp_path / "ws"
    workspace.mkdir()
    config = tmp_path / "config.toml"
    config.write_text(
        '[sandbox]\nnetwork = false\nnetwork_hosts = { "index.test" = "127.0.0.1" }\n'
    )
    curl = f"curl -sS -m 10 http://index.test:{server.port}/batch"
    lines = [
        {
            "id": "listed",
            "tool": "bash",
            "args": {"command": curl},
            "network": [f"index.test:{server.port}"],
        },
        {"id": "offline", "tool": "bash", "args": {"command": curl}},
    ]
    calls = tmp_path / "calls.jsonl"
    calls.write_text("".join(json.dumps(line) + "\n" for line in lines))
    journal = tmp_path / "journal.jsonl"
    args = ["-q", "run", str(calls), "--workspace", str(workspace), "--config", str(config)]
    ran = cli(*args, "--journal", str(journal), cwd=tmp_path)
    assert ran.returncode in (0, 1), ran.stderr
    outcomes = {
        r["call_id"]: r
        for r in map(json.loads, journal.read_text().splitlines())
        if r["kind"] == "outcome"
    }
    assert outcomes["listed"]["status"] == "ok"
    assert outcomes["offline"]["status"] == "ok"  # bash ran; curl failed, offline
    assert server.seen == [("/batch", f"index.test:{server.port}")]
    # With --ray a line's network is refused, never ignored: the nodes' pools take the config's.
    refused = cli(*args, "--ray", "auto", cwd=tmp_path)
    assert refused.returncode == 2, refused.stderr
    assert "network" in refused.stderr


def test_inspects_config_carries_the_samples_network() -> None:
    provider = pytest.importorskip("sandbx_pool.integrations.inspect_provider")
    settings = provider.SandbxConfig(network=("index.example.org", "*.files.example.org"))
    assert hash(settings)  # Inspect keys its tasks by the config
    assert provider.SandbxConfig.model_validate_json(settings.model_dump_json()) == settings
    assert provider.SandbxConfig(network=False).network is False


@needs_allow_list
async def test_a_call_in_a_view_goes_through_the_proxy_too(workspace: Path, server: Server) -> None:
    """Inspect's samples run in a view: its mounts come first, the list must hold there too."""
    (workspace / "sample" / "work").mkdir(parents=True)
    command = (
        f"curl -sS -m 10 http://index.test:{server.port}/view; curl -sS -m 10 -o /dev/null"
        f" -w '%{{http_code}}' http://evil.test:{server.port}/"
    )
    async with Pool(workspace, config=allow_config([f"index.test:{server.port}"])) as pool:
        if not pool.views:
            pytest.skip("no views here")
        outcome = await pool.call(
            "bash", {"command": command}, view=str(workspace / "sample"), cwd="/work", timeout=60
        )
    assert outcome.value is not None, outcome
    assert outcome.value["stdout"] == "index says hello\n403", outcome.value
    assert outcome.value["network_denied"] == ["evil.test"]
    assert server.seen == [("/view", f"index.test:{server.port}")]


async def test_a_connection_accepted_as_its_call_ends_is_never_served(server: Server) -> None:
    """The call's end cancels its connections' tasks; one accepted in the same turn of the
    loop, whose task had not run yet, is not among them: it must not tunnel past its call."""
    proxy = Proxy({"index.test": "127.0.0.1"})
    link = CallLink("c1", (f"index.test:{server.raw_port}",))
    ours, theirs = socket.socketpair()
    with ours:
        ours.sendall(f"CONNECT index.test:{server.raw_port} HTTP/1.1\r\n\r\nping".encode())
        reader, writer = await asyncio.open_connection(sock=theirs)
        link.ended = True  # the call ended before this connection's task first ran
        await asyncio.wait_for(proxy._client(link, reader, writer), 5)
        ours.setblocking(False)
        loop = asyncio.get_running_loop()
        try:  # closed unanswered: an EOF, or a reset (what it sent was never read)
            answer = await asyncio.wait_for(loop.sock_recv(ours, 4096), 5)
        except ConnectionResetError:
            answer = b""
        assert answer == b""
    assert server.raw_connections == 0
    assert not link.tasks


# A call's forged registration: a unix listener of its own (autobound, abstract), handed to the
# proxy at argv[1] with a list of its own, then a request through it. Prints what came back.
FORGER = textwrap.dedent(
    """
    import json, socket, sys
    path, port = sys.argv[1], int(sys.argv[2])
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("")
    listener.listen(8)
    control = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    control.connect(path)
    forged = json.dumps({"call_id": "forged", "allow": [f"evil.test:{port}"]}).encode()
    socket.send_fds(control, [forged], [listener.fileno()])
    control.settimeout(5)
    try:
        print("refused" if control.recv(16) == b"" else "answered")
    except TimeoutError:
        print("kept")  # the proxy took the registration: try it
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(5)
        s.connect(listener.getsockname())
        s.sendall(f"GET http://evil.test:{port}/secret HTTP/1.1\\r\\n\\r\\n".encode())
        print(s.recv(64))
    """
)


@needs_allow_list
async def test_another_pools_call_cannot_register_with_this_pools_proxy(
    workspace: Path, server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Pools of one user whose runtime directories differ ($XDG_RUNTIME_DIR set for one):
    each call's mount namespace covers its own pool's, so the other's proxy socket is reachable
    by path (Landlock does not mediate a unix connect). A network = false call must not get
    out through it with a listener and a list of its own."""
    xdg = tempfile.mkdtemp(prefix="xdg-")  # short: a unix socket's path has 107 bytes
    monkeypatch.setenv("XDG_RUNTIME_DIR", xdg)
    try:
        async with Pool(workspace, config=allow_config([f"index.test:{server.port}"])) as other:
            monkeypatch.delenv("XDG_RUNTIME_DIR")
            assert (await other.call("bash", {"command": "true"}, timeout=60)).ok
            proxy = other._network.handle  # where its socket is: the test's only look inside
            assert proxy is not None
            (workspace / "forger.py").write_text(FORGER)
            async with Pool(workspace, config=allow_config(False)) as pool:
                command = f"{PYTHON} forger.py {proxy.path} {server.port}"
                outcome = await pool.call("bash", {"command": command}, timeout=60)
    finally:
        shutil.rmtree(xdg, ignore_errors=True)
    assert outcome.value is not None
    assert outcome.value["stdout"].split() == ["refused"], outcome.value
    assert server.seen == []


class Holder:
    """A tunnel's far end that never answers nor closes: it only notes each connection's EOF."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.opened = 0
        self.closed = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.opened += 1
            threading.Thread(target=self._until_eof, args=(conn,), daemon=True).start()

    def _until_eof(self, conn: socket.socket) -> None:
        with conn:
            while conn.recv(4096):
                pass
        self.closed += 1


HOLD = textwrap.dedent(
    """
    import os, socket, sys, time
    proxy = ("127.0.0.1", int(os.environ["HTTPS_PROXY"].rsplit(":", 1)[1]))
    s = socket.create_connection(proxy, timeout=10)
    s.sendall(f"CONNECT index.test:{sys.argv[1]} HTTP/1.1\\r\\n\\r\\n".encode())
    print(s.recv(4096).split(b" ")[1].decode(), flush=True)
    time.sleep(600)
    """
)


@needs_allow_list
async def test_no_tunnel_outlives_its_call(workspace: Path) -> None:
    """A call killed at its timeout with a tunnel open, and one that ends leaving a process
    holding one: the upstream connection is closed with the call, not left to the far end."""
    holder = Holder()
    (workspace / "hold.py").write_text(HOLD)
    try:
        config = allow_config([f"index.test:{holder.port}"])
        async with Pool(workspace, config=config, workers=2) as pool:
            command = f"{PYTHON} hold.py {holder.port}"
            killed = await pool.call("bash", {"command": command}, timeout=3)
            assert killed.status == "timeout", killed
            background = f"({command} > held.txt &); until [ -s held.txt ]; do sleep 0.05; done"
            ended = await pool.call("bash", {"command": background}, timeout=60)
            assert ended.ok, ended
            assert (workspace / "held.txt").read_text().strip() == "200"
            assert holder.opened == 2
            deadline = time.monotonic() + 10
            while holder.closed < 2:  # the outside world: the proxy closing its connections
                assert time.monotonic() < deadline, f"{holder.closed} of 2 tunnels closed"
                await asyncio.sleep(0.05)
    finally:
        holder.sock.close()


class SlowNames(Proxy):
    """The proxy with a resolver that answers after ``seconds`` on a thread, as getaddrinfo
    does against a name server that is slow (the outside world this test cannot arrange)."""

    seconds = 1.0

    async def _resolve(self, host: str, port: int) -> str:
        await asyncio.get_running_loop().run_in_executor(None, time.sleep, self.seconds)
        return "127.0.0.1"


async def test_a_lookup_given_up_on_holds_its_slot_until_its_thread_is_done(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A name that times out answers 504, but its thread runs on: the call's slot stays
    taken until it ends, so one call's slow names never hold more than its share of threads."""
    monkeypatch.setattr(proxy_module, "RESOLVE_TIMEOUT_S", 0.2)
    proxy = SlowNames({})
    link = CallLink("c1", ("slow.test",))

    async def ask() -> bytes:
        ours, theirs = socket.socketpair()
        with ours:
            ours.sendall(b"CONNECT slow.test:443 HTTP/1.1\r\n\r\n")
            reader, writer = await asyncio.open_connection(sock=theirs)
            await asyncio.wait_for(proxy._client(link, reader, writer), 5)
            ours.setblocking(False)
            return await asyncio.wait_for(asyncio.get_running_loop().sock_recv(ours, 4096), 5)

    answers = await asyncio.gather(*(ask() for _ in range(proxy_module.RESOLVING_PER_CALL)))
    assert all(answer.startswith(b"HTTP/1.1 504") for answer in answers), answers
    assert link.resolving.locked()  # the threads still run: the slots are still theirs
    deadline = time.monotonic() + 10
    while link.resolving.locked():  # freed when the threads end
        assert time.monotonic() < deadline, "a lookup's slot was never freed"
        await asyncio.sleep(0.05)


@needs_allow_list
async def test_huge_refused_targets_cannot_hide_what_was_refused(
    workspace: Path, server: Server
) -> None:
    """A refused target is kept in network_denied as written; a dozen of 6,000 bytes made the
    proxy's answer larger than the worker reads, and the whole list was lost."""
    huge = [(f"junk{n}", f"CONNECT [{n}{'x' * 6000}]:443 HTTP/1.1\r\n\r\n", "") for n in range(12)]
    async with Pool(workspace, config=allow_config([f"index.test:{server.port}"])) as pool:
        asks = [("evil", "CONNECT evil.test:443 HTTP/1.1\r\n\r\n", ""), *huge]
        value, answers = await run_client(pool, workspace, asks)
    assert {answer[0] for answer in answers.values()} == {"403"}
    denied = value["network_denied"]
    assert denied[0] == "evil.test"
    assert len(denied) == 13
    assert all(len(host) <= proxy_module.MAX_DENIED_CHARS for host in denied)


@needs_allow_list
async def test_the_proxy_starts_with_the_first_listed_call_and_stops_with_the_pool(
    workspace: Path,
) -> None:
    async with Pool(workspace, config=allow_config(True)) as pool:
        assert (await pool.call("bash", {"command": "true"}, timeout=60)).ok
        assert (await pool.call("bash", {"command": "true"}, network=False, timeout=60)).ok
        assert pool._network.handle is None  # no call asked for a list: nothing started
        listed = await pool.call("bash", {"command": "true"}, network=["index.test"], timeout=60)
        assert listed.ok, listed
        handle = pool._network.handle  # started now, stopped with the pool: a look inside
        assert handle is not None
        assert handle.process is not None
        process = handle.process
        assert process.poll() is None
    assert process.poll() is not None  # waited for by close, not left to anyone
    assert not Path(handle.path).exists()  # noqa: ASYNC240 (a stat, after the pool)


# -- with sessions and layers ------------------------------------------------------------------


@needs_allow_list
async def test_a_session_does_not_carry_one_calls_proxy_port_into_the_next(
    workspace: Path, server: Server
) -> None:
    # Each allow-listed call listens on a port of its own: a session that kept the first
    # call's HTTP_PROXY would send the next call's requests to a port nobody listens on.
    allow = [f"index.test:{server.port}"]
    fetch = f"curl -sS -m 10 -o /dev/null -w '%{{http_code}}' http://index.test:{server.port}/a"
    async with Pool(workspace, config=allow_config(allow), workers=2) as pool:
        outcomes = [
            await pool.call("bash", {"command": f"export KEEP=1; {fetch}"}, session="net")
            for _ in range(3)
        ]
        state = await pool.session("net")
    for outcome in outcomes:
        assert outcome.status == "ok", outcome
        assert outcome.value is not None
        assert outcome.value["stdout"] == "200", outcome.value
    assert state["env"] == {"KEEP": "1"}, "the proxy variables are the call's, not the session's"


@needs_allow_list
@pytest.mark.needs("overlayfs layers (pool.layer)")
async def test_an_allow_listed_call_in_a_layer_reaches_only_its_hosts(
    tmp_path: Path, server: Server
) -> None:
    base = tmp_path / "base"
    base.mkdir()
    allow = [f"index.test:{server.port}"]
    config = allow_config(allow).override(workspace={"layers": str(tmp_path / "layers")})
    async with Pool(tmp_path, config=config, workers=2) as pool:
        ws = await pool.layer("net", base=str(base))
        outcome = await pool.call(
            "bash",
            {
                "command": f"curl -sS -m 10 http://index.test:{server.port}/b > got; "
                f"curl -sS -m 10 -o /dev/null -w '%{{http_code}}' http://evil.test:{server.port}/"
            },
            workspace=ws,
        )
        changed = await ws.diff()
    assert outcome.status == "ok", outcome
    assert outcome.value is not None
    assert outcome.value["stdout"] == "403"
    assert outcome.value["network_denied"] == ["evil.test"]
    assert [c["path"] for c in changed] == ["got"]
    assert not (base / "got").exists()
