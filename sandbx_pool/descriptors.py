"""The coordinator's file descriptor budget.

libzmq treats a failed accept() for want of a descriptor (EMFILE) as a broken invariant: it
aborts the process (``Too many open files (src/ipc_listener.cpp)``). So the coordinator must
never run out, whatever the calls do. At pool start the soft RLIMIT_NOFILE is raised to the hard
limit (process-wide: code in the same process that uses select() on descriptors above 1023
would have to cope, but asyncio and libzmq use epoll). Then workers are forked only while the
descriptors they will cost fit in what is left, and calls beyond that wait in the queue (or
end as ``error`` when not even one worker fits).

Each live worker costs the coordinator ``PER_WORKER`` descriptors: its connection to the
ROUTER socket (accepted by libzmq's I/O thread) and the pidfd that tells us of its death,
measured by tests/test_faults.py. ``RESERVE`` is kept for everything else: the journal
(file and fsync thread), the loop's self-pipe, a log sink, connections from strangers that
the inbox has not yet refused, and whatever the process hosting the pool opens meanwhile.
"""

from __future__ import annotations

import os
import resource

#: Descriptors the coordinator holds for each worker it has forked: connection + pidfd.
PER_WORKER = 2

#: Descriptors kept free for everything that is not a worker (see above).
RESERVE = 24


#: RLIMIT_NOFILE as the process had it before the first pool raised it: what the template,
#: and so every worker and command, gets back (a program may loop over every descriptor up to
#: its soft limit; a million of them would make it crawl).
_inherited: list[tuple[int, int]] = []


def raise_soft_limit() -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard limit; return the limits inherited (above)."""
    limits = resource.getrlimit(resource.RLIMIT_NOFILE)
    if not _inherited:
        _inherited.append(limits)
    soft, hard = limits
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return _inherited[0]


def soft_limit() -> int:
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def open_count() -> int:
    """Descriptors this process holds now (listing /proc/self/fd opens one more: not counted)."""
    return len(os.listdir("/proc/self/fd")) - 1


#: Counting /proc/self/fd costs ~40 us, 5% of a call's coordinator time. Far from the limit
#: (room for more than ROOMY workers), a count is reused for RECOUNT_EVERY questions: in that
#: many, at most that many workers are forked, a small part of the room. Near it, every time.
ROOMY = 256
RECOUNT_EVERY = 32


class Budget:
    """How many more workers the descriptors left can pay for, beyond those open now."""

    def __init__(self) -> None:
        self._room = 0
        self._uses_left = 0

    def __call__(self) -> int:
        if self._uses_left <= 0 or self._room <= ROOMY:
            self._room = max(0, (soft_limit() - open_count() - RESERVE) // PER_WORKER)
            self._uses_left = RECOUNT_EVERY
        self._uses_left -= 1
        return self._room


__all__ = [
    "PER_WORKER",
    "RECOUNT_EVERY",
    "RESERVE",
    "ROOMY",
    "Budget",
    "open_count",
    "raise_soft_limit",
    "soft_limit",
]
