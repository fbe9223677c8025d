"""Stopping a command cleanly on TERM, INT, HUP or QUIT sent to its pid.

The first signal cancels every call in flight with killer ``shutdown`` (by closing the pools,
which waits, bounded, until their workers are gone and journals their outcomes), lets the
command finish its bookkeeping, and exits 128 + the signal number. A second INT exits at once,
still killing every worker group first. A SIGKILL cannot be caught: PDEATHSIG covers it.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar

from sandbx_pool.logs import logger


class Stoppable(Protocol):
    """What a signal stops: a Pool, or a RayPool (integrations.ray)."""

    async def close(self) -> None: ...

    def kill_now(self) -> None: ...


P = TypeVar("P", bound=Stoppable)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


class Stopper:
    """What a command registers so that a signal can stop it."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.stopping = asyncio.Event()
        self.pools: list[Stoppable] = []
        self._closing: list[asyncio.Task[None]] = []

    def watch(self, pool: P) -> P:
        self.pools.append(pool)
        return pool

    def on_signal(self, signum: int) -> None:
        if self.signum is None:
            self.signum = signum
            logger.warning(
                "{}: stopping; calls in flight are cancelled", signal.Signals(signum).name
            )
            self.stopping.set()
            for pool in self.pools:
                self._closing.append(asyncio.create_task(pool.close()))
        elif signum == signal.SIGINT:
            logger.error("second SIGINT: exiting now")
            for pool in self.pools:
                pool.kill_now()
            os._exit(128 + signum)


def run_until_signalled(main: Callable[[Stopper], Awaitable[int]]) -> int:
    """Run ``main(stopper)``; its exit code, or 128 + N when signal N stopped it."""

    async def runner() -> int:
        loop = asyncio.get_running_loop()
        stopper = Stopper()
        for signum in STOP_SIGNALS:
            loop.add_signal_handler(signum, stopper.on_signal, signum)
        try:
            code = await main(stopper)
            if stopper._closing:
                await asyncio.gather(*stopper._closing)
        finally:
            for signum in STOP_SIGNALS:
                loop.remove_signal_handler(signum)
        return 128 + stopper.signum if stopper.signum is not None else code

    return asyncio.run(runner())
