"""What the inbox accepts and drops (Inbox.deliver), with no socket and no process.

``deliver`` is the whole decision: the frames ZeroMQ received and the pid that sent them in,
a Ready handed on, a Result or Output that completes the right call, anything else dropped.
An Inbox that was never bound is enough; its socket I/O (and the vetting of connections by
their peer's pid) is tested through real pools in test_security.py and test_faults.py.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest

from sandbx_pool.call_state import CallState
from sandbx_pool.inbox import Inbox
from sandbx_pool.output import OutputChunk
from sandbx_pool.worker_handle import Worker
from sandbx_pool.workers.protocol import Output, Ready, Result, encoder


class Received:
    """An Inbox that knows one worker, with what it handed on."""

    def __init__(self) -> None:
        self.worker = Worker("1.abc", asyncio.get_running_loop())
        self.call = CallState("c1", "bash", {"command": "true"}, 10.0)
        self.worker.call = self.call
        self.chunks: list[OutputChunk] = []
        self.call.on_output = self.chunks.append
        self.readies: list[tuple[bytes, Ready, Worker | None, int | None]] = []
        known = {self.worker.token: self.worker}

        def on_ready(
            identity: bytes, message: Ready, worker: Worker | None, pid: int | None
        ) -> None:
            self.readies.append((identity, message, worker, pid))

        self.inbox = Inbox(known.get, on_ready)

    def result(self, stdout: str = "") -> Result:
        value = {"stdout": stdout}
        return Result(call_id="c1", status="ok", value=value, secret=self.call.secret)

    def send(self, message: Any, *, identity: bytes | None = None) -> None:
        sender = self.worker.identity if identity is None else identity
        self.inbox.deliver([sender, encoder.encode(message)], 4242)


@pytest.fixture
async def received() -> Received:
    return Received()


async def test_a_ready_is_handed_on_with_its_worker_and_peer_pid(received: Received) -> None:
    ready = Ready(token=received.worker.token)
    received.send(ready)
    received.send(Ready(token="2.def"), identity=b"2.def")
    assert received.readies == [
        (received.worker.identity, ready, received.worker, 4242),
        (b"2.def", Ready(token="2.def"), None, 4242),  # unknown yet: the WorkerSet decides
    ]


async def test_a_result_with_its_calls_secret_completes_the_call(received: Received) -> None:
    right = received.result("ok\n")
    received.send(right)
    assert received.call.result.result() == right
    received.send(received.result("again\n"))
    assert received.call.result.result() == right  # the first one stands


@pytest.mark.parametrize(
    "what",
    [
        "wrong secret",
        "wrong call",
        "unknown status",
        "other protocol version",
        "from another identity",
        "from a worker with no call",
    ],
)
async def test_a_result_that_is_not_the_calls_is_dropped(received: Received, what: str) -> None:
    right = received.result()
    if what == "wrong secret":
        received.send(msgspec.structs.replace(right, secret="0" * 32))
    elif what == "wrong call":
        received.send(msgspec.structs.replace(right, call_id="c2"))
    elif what == "unknown status":
        received.send(msgspec.structs.replace(right, status="pwned"))
    elif what == "other protocol version":
        received.send(msgspec.structs.replace(right, v=2))
    elif what == "from another identity":
        received.send(right, identity=b"2.def")
    else:
        received.worker.call = None
        received.send(right)
    assert not received.call.result.done()


async def test_undecodable_or_misframed_messages_are_dropped(received: Received) -> None:
    identity = received.worker.identity
    payload = encoder.encode(received.result())
    received.inbox.deliver([identity, b"\xc1not msgpack"])
    received.inbox.deliver([identity, payload, b"extra"])
    received.inbox.deliver([payload])
    received.inbox.deliver([identity, encoder.encode({"type": "nope"})])
    assert not received.call.result.done()
    assert received.readies == []


async def test_output_reaches_the_callers_callback_only_with_its_calls_secret(
    received: Received,
) -> None:
    secret = received.call.secret
    received.send(Output(call_id="c1", stream="stdout", data="forged", secret="0" * 32))
    received.send(Output(call_id="c2", stream="stdout", data="other call", secret=secret))
    received.send(Output(call_id="c1", stream="stderr", data="hi\n", dropped=3, secret=secret))
    assert received.chunks == [OutputChunk(call_id="c1", stream="stderr", data="hi\n", dropped=3)]
    assert not received.call.result.done()  # output is not an answer
