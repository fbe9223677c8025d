"""What a worker's connection to the coordinator costs: ZMTP spoken by the worker (what the
pool does, workers.zmtp) against a libzmq DEALER with a context of its own (what it did before).

``python -m bench.workerconn COUNT ENDPOINT WORKSPACE {zmtp,libzmq}`` loads what the template
loads (and pyzmq, for ``libzmq``), then forks COUNT workers one after the other, as the
template does. Each connects to the ROUTER at ENDPOINT, sends Ready, runs the Call it gets
(a read, through the worker's own ``run_call``), sends the Result and exits. It prints each
worker's CPU time (ns) and page faults, from ``wait4``, as JSON. ``serve_calls`` is the
ROUTER side, run by the bench process on a thread.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from typing import Any

MODES = ("zmtp", "libzmq")


def _worker(endpoint: str, workspace: str, mode: str, token: str) -> None:
    from sandbx_pool.workers import runtime, zmtp
    from sandbx_pool.workers.protocol import MAX_MESSAGE_BYTES, Ready, call_decoder, encoder

    os.setsid()
    ready = encoder.encode(Ready(token=token))
    if mode == "zmtp":
        connection = zmtp.connect(
            endpoint, token.encode(), max_message_bytes=MAX_MESSAGE_BYTES, timeout_s=10
        )
        connection.handshake(timeout_s=10)
        connection.send(ready, timeout_s=10)
        payload = None
        while payload is None:
            payload = connection.recv(timeout_s=10)
        call = call_decoder.decode(payload)
        connection.send(encoder.encode(runtime.run_call(call)), timeout_s=10)
    else:
        import zmq

        context = zmq.Context(io_threads=1)
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, token.encode())
        sock.setsockopt(zmq.LINGER, 2000)
        sock.connect(endpoint)
        sock.send(ready)
        call = call_decoder.decode(sock.recv())
        sock.send(encoder.encode(runtime.run_call(call)))
        sock.close()
        context.term()
    os._exit(0)


def main(argv: list[str]) -> int:
    count, endpoint, workspace, mode = int(argv[0]), argv[1], argv[2], argv[3]
    import sandbx_pool.workers.template

    if mode == "libzmq":
        import zmq  # noqa: F401 (in the template, as before: its weight is part of the cost)
    sandbx_pool.workers.template.warm_up()
    from sandbx_pool.workers import bare_fork

    costs = []
    for i in range(count):
        pid = bare_fork.fork()
        if pid == 0:
            try:
                _worker(endpoint, workspace, mode, f"{mode}-{i}")
            finally:
                os._exit(70)
        _, status, usage = os.wait4(pid, 0)
        if os.waitstatus_to_exitcode(status) != 0:
            raise RuntimeError(f"a {mode} worker failed ({status})")
        cpu_ns = round((usage.ru_utime + usage.ru_stime) * 1e9)
        costs.append((cpu_ns, usage.ru_minflt))
    json.dump(costs, sys.stdout)
    return 0


def serve_calls(
    endpoint: str, workspace: str, path: str, stop: threading.Event
) -> threading.Thread:
    """A ROUTER answering every Ready with a read of ``path`` (bound before this returns)."""
    import zmq

    from sandbx_pool.workers.protocol import Call, ExecutionContext, encoder

    context = zmq.Context.instance()
    router = context.socket(zmq.ROUTER)
    router.bind(endpoint)
    ctx = ExecutionContext(call_id="bench", workspace=workspace, cwd=workspace, env={})
    call = encoder.encode(Call(tool="read", args={"path": path}, context=ctx))

    def loop() -> None:
        try:
            while not stop.is_set():
                if router.poll(100):
                    identity, payload = router.recv_multipart()
                    if b"ready" in payload[:32]:
                        router.send_multipart([identity, call])
        finally:
            router.close(linger=0)

    thread = threading.Thread(target=loop, name="bench-router", daemon=True)
    thread.start()
    return thread


def measure(endpoint: str, workspace: str, path: str, count: int, rounds: int) -> dict[str, Any]:
    """Per-worker (CPU ns, faults) for each mode, the modes run alternately ``rounds`` times."""
    import subprocess

    stop = threading.Event()
    thread = serve_calls(endpoint, workspace, path, stop)
    costs: dict[str, list[tuple[int, int]]] = {mode: [] for mode in MODES}
    try:
        for _ in range(rounds):
            for mode in MODES:
                command = [sys.executable, "-m", "bench.workerconn", str(count), endpoint]
                done = subprocess.run(
                    [*command, workspace, mode], capture_output=True, text=True, check=True
                )
                costs[mode] += [tuple(c) for c in json.loads(done.stdout)]  # type: ignore[misc]
    finally:
        stop.set()
        thread.join()
    return costs


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
