"""Services as tools a model calls: bash's ``background``, ``service_output``, ``service_write``
and ``service_stop``, answered by the coordinator (sandbx_pool.services), never a worker.

    Pool.call("bash", {"command": ..., "background": true}, session=S)
        --> handles_service_tool() --> ServiceTools.run(): journaled as any call (call_life)
            arguments checked (workers.schemas: the one source of the tools' schemas)
            bash background --> pool.service("bg-N", command, session=S, cwd, env, network)
                value {"service": "bg-N", "status": "running"}; the service's own call is
                journaled, gated and confined as bash's (its intent, its outcome)
            service_output / service_write / service_stop --> the service named, of S
                value {"service", "status", "exit_code", ...}

A model sees the services of its own session only (or, without one, the pool's own): another
session's are "no service named". A failure is an outcome (``error``, or what refused the
command: ``denied``), never an exception; ``Pool.call``'s misuse rules are unchanged. Every
integration that sends a model's calls through ``Pool.call`` (the MCP server, ``sandbx-pool
call`` and batch lines) gets these tools from the definitions in workers.schemas.
"""

from __future__ import annotations

import itertools
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from sandbx_pool.call_life import CallLife
from sandbx_pool.errors import ServiceNotRunning
from sandbx_pool.gate import Gate
from sandbx_pool.journal.store import Journal
from sandbx_pool.outcome import Outcome, Status
from sandbx_pool.services import Service, Services
from sandbx_pool.workers.schemas import (
    SERVICE_TOOL_ARGS,
    BashArgs,
    ServiceOutputArgs,
    ServiceStopArgs,
    ServiceWriteArgs,
    parse_args,
)

#: Starts a service as Pool.service does (name, command, session, cwd, env, network).
StartService = Callable[..., Awaitable[Service]]

#: Names of the services bash's background calls start: bg-1, bg-2... in the pool.
_BACKGROUND_PREFIX = "bg-"


def handles_service_tool(tool: str, args: object) -> bool:
    """Whether ``Pool.call`` hands this call here rather than to a worker."""
    if tool in SERVICE_TOOL_ARGS:
        return True
    return tool == "bash" and isinstance(args, dict) and args.get("background") is True


class ServiceTools:
    """The pool's side of the service tools: its services, how to start one, its gate."""

    def __init__(self, services: Services, start: StartService, gate: Gate) -> None:
        self._services = services
        self._start = start
        self._gate = gate
        self._numbers = itertools.count(1)

    async def run(
        self,
        call_id: str,
        tool: str,
        args: Any,
        *,
        journal: Journal | None,
        session: str | None,
        cwd: str | None,
        env: dict[str, str] | None,
        network: object,
    ) -> Outcome:
        life = CallLife(call_id, tool, args, None, cwd)
        life.session = session

        async def act() -> Outcome:
            try:
                parsed = parse_args(tool, args)
            except (ValueError, RecursionError) as exc:  # ValidationError, UnknownTool
                return life.outcome(Status.ERROR, error=f"bad arguments: {exc}")
            if isinstance(parsed, BashArgs):
                return await self._background(life, parsed, session, cwd, env, network)
            denial = self._gate.denial(tool, parsed)
            if denial is not None:
                return life.outcome(Status.DENIED, error=denial)
            return await self._on_service(life, parsed, session)

        return await life.drive(journal, act)

    async def _background(
        self,
        life: CallLife,
        args: BashArgs,
        session: str | None,
        cwd: str | None,
        env: dict[str, str] | None,
        network: object,
    ) -> Outcome:
        name = self._fresh_name()
        try:
            service = await self._start(
                name, args.command, session=session, cwd=cwd, env=env, network=network
            )
        except (ValueError, TypeError) as exc:
            return life.outcome(Status.ERROR, error=str(exc))
        ended = service.outcome
        if ended is not None and ended.status in (Status.DENIED, Status.ERROR):
            # Refused before it ran (the gate, its cwd, its confinement): say so as bash would.
            return life.outcome(ended.status, error=ended.error, value=_state(service))
        return life.outcome(Status.OK, value=_state(service))

    def _fresh_name(self) -> str:
        names = {service.name for service in self._services}
        while True:
            name = f"{_BACKGROUND_PREFIX}{next(self._numbers)}"
            if name not in names:
                return name

    async def _on_service(
        self,
        life: CallLife,
        args: ServiceOutputArgs | ServiceWriteArgs | ServiceStopArgs | msgspec.Struct,
        session: str | None,
    ) -> Outcome:
        assert isinstance(args, ServiceOutputArgs | ServiceWriteArgs | ServiceStopArgs)
        service = self._owned(args.service, session)
        if service is None:
            whose = f"session {session!r}" if session is not None else "this pool (no session)"
            return life.outcome(Status.ERROR, error=f"no service named {args.service!r} in {whose}")
        if isinstance(args, ServiceOutputArgs):
            data, following = await service.output(args.since)
            output = data.decode("utf-8", errors="replace")
            return life.outcome(
                Status.OK, value={**_state(service), "output": output, "next": following}
            )
        if isinstance(args, ServiceWriteArgs):
            payload = args.data.encode()
            try:
                await service.write(payload)
            except ServiceNotRunning as exc:
                return life.outcome(Status.ERROR, error=str(exc), value=_state(service))
            return life.outcome(Status.OK, value={**_state(service), "written": len(payload)})
        await service.stop(f"stopped by the service_stop call {life.call_id}")
        return life.outcome(Status.OK, value=_state(service))

    def _owned(self, name: str, session: str | None) -> Service | None:
        for service in self._services:
            if service.name == name and service.session == session:
                return service
        return None


def _state(service: Service) -> dict[str, Any]:
    return {"service": service.name, "status": str(service.status), "exit_code": service.exit_code}


__all__ = ["ServiceTools", "handles_service_tool"]
