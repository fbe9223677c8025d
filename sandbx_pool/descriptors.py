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
measured in tests/test_descriptors.py. ``RESERVE`` is kept for everything else: the journal
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


def raise_soft_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit; return the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        return hard
    return soft


def soft_limit() -> int:
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def open_count() -> int:
    """Descriptors this process holds now (listing /proc/self/fd opens one more: not counted)."""
    return len(os.listdir("/proc/self/fd")) - 1


def workers_that_fit() -> int:
    """How many more workers the descriptors left can pay for, beyond those open now."""
    return max(0, (soft_limit() - open_count() - RESERVE) // PER_WORKER)


__all__ = [
    "PER_WORKER",
    "RESERVE",
    "open_count",
    "raise_soft_limit",
    "soft_limit",
    "workers_that_fit",
]
