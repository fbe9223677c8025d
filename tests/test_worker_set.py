"""The scheduling rules (worker_set.py), with no process, no socket and no clock.

A WorkerSet is fed what the template and the workers would say (Spawned, Ready, Exited,
SpawnFailed) and calls, and each test asserts the actions it returns (nothing is performed:
no fork, no signal, no future resolved) and the state its ``repr`` shows. The pids are made up:
no action is ever carried out. Time is the test's: a RetryAfter is answered by calling
``retry()``, as the pool's timer would.
"""

from __future__ import annotations

import signal

from sandbx_pool.call_state import CallState
from sandbx_pool.errors import WorkersFailToStart
from sandbx_pool.scheduling_actions import (
    Action,
    Assign,
    CancelRetry,
    Fail,
    Fork,
    Gone,
    RetryAfter,
    Signal,
    Watch,
)
from sandbx_pool.worker_handle import Worker, WorkerState
from sandbx_pool.worker_set import (
    MAX_FAILED_STARTS,
    MAX_STARVED_TRIES,
    STARVED_RETRY_S,
    WorkerSet,
)
from sandbx_pool.workers.protocol import Exited, Ready, Spawned, SpawnFailed

KILL = signal.SIGKILL


def opened(*, max_workers: int, prefork: int, room: list[int] | None = None) -> WorkerSet:
    """A WorkerSet as an open pool has it; ``room[0]``: workers the descriptors can pay for."""
    if room is None:
        workers = WorkerSet(max_workers=max_workers, prefork=prefork)
    else:
        workers = WorkerSet(max_workers=max_workers, prefork=prefork, room=lambda: room[0])
    workers.forking = True
    return workers


def a_call(name: str) -> CallState:
    return CallState(name, "read", {"path": "notes.txt"}, 10.0)


def spawned(workers: WorkerSet, token: str, pid: int) -> tuple[Worker, list[Action]]:
    """The template says it forked ``pid`` for ``token``."""
    actions = workers.on_spawned(Spawned(token=token, pid=pid))
    worker = workers.get(token)
    assert worker is not None
    return worker, actions


def ready(workers: WorkerSet, worker: Worker, *, from_pid: int | None = None) -> list[Action]:
    """The worker connects and says Ready (from its own pid unless told otherwise)."""
    pid = worker.pid if from_pid is None else from_pid
    return workers.on_ready(worker.identity, Ready(token=worker.token), worker, pid)


def connected(workers: WorkerSet, token: str, pid: int) -> tuple[Worker, list[Action]]:
    """Spawned, then Ready: the worker can take a call."""
    worker, actions = spawned(workers, token, pid)
    return worker, actions + ready(workers, worker)


def shown(workers: WorkerSet) -> str:
    return repr(workers)


def state(active: int, queued: int, idle: int, starting: int, stuck: int = 0) -> str:
    return (
        f"Calls: {active} active, {queued} queued | Workers: "
        f"{idle} idle, {starting} starting, {stuck} stuck"
    )


# -- how many to fork --------------------------------------------------------------------------


async def test_an_opened_pool_forks_its_spares_once() -> None:
    workers = opened(max_workers=4, prefork=2)
    assert workers.replenish() == [Fork(2)]
    assert workers.replenish() == []  # those two are starting: nothing more
    connected(workers, "t1", 1001)
    connected(workers, "t2", 1002)
    assert shown(workers) == state(active=0, queued=0, idle=2, starting=0)
    # Never more spares than workers may run at once.
    assert opened(max_workers=3, prefork=8).replenish() == [Fork(3)]


async def test_nothing_is_forked_before_the_pool_opens() -> None:
    workers = WorkerSet(max_workers=4, prefork=2)
    assert workers.replenish() == []
    assert workers.enqueue(a_call("c1")) == []
    assert shown(workers) == state(active=0, queued=1, idle=0, starting=0)


async def test_a_dispatched_call_forks_one_spare_a_finished_one_all_of_them() -> None:
    workers = opened(max_workers=4, prefork=3)
    call = a_call("c1")
    # Not eager: a worker for the call and one spare; the other two would compete with the
    # call for the cores.
    assert workers.enqueue(call) == [Fork(2)]
    worker, actions = connected(workers, "t1", 1001)
    assert actions == [Watch(worker, 1001), Assign(call, worker)]
    assert shown(workers) == state(active=1, queued=0, idle=0, starting=1)
    # Eager once the call is over: three spares, one of them already starting. The worker
    # that served it is not given another call.
    assert workers.release(worker) == [Fork(2)]
    assert shown(workers) == state(active=0, queued=0, idle=0, starting=3)


async def test_max_workers_bounds_the_forks_for_a_queue() -> None:
    workers = opened(max_workers=2, prefork=0)
    assert workers.enqueue(a_call("c1")) == [Fork(1)]
    assert workers.enqueue(a_call("c2")) == [Fork(1)]
    assert workers.enqueue(a_call("c3")) == []
    assert shown(workers) == state(active=0, queued=3, idle=0, starting=2)


async def test_a_queue_behind_busy_workers_forks_nothing() -> None:
    workers = opened(max_workers=2, prefork=0)
    first, second = a_call("c1"), a_call("c2")
    workers.enqueue(first)
    workers.enqueue(second)
    one, _ = connected(workers, "t1", 1001)
    connected(workers, "t2", 1002)
    queued = [a_call(f"q{n}") for n in range(5)]
    for call in queued:
        assert workers.enqueue(call) == []
    assert shown(workers) == state(active=2, queued=5, idle=0, starting=0)
    # A slot frees: one worker for the next in the queue, none for the rest.
    assert workers.release(one) == [Fork(1)]
    assert shown(workers) == state(active=1, queued=5, idle=0, starting=1)


async def test_widen_lets_waiting_calls_take_the_new_slots() -> None:
    workers = opened(max_workers=1, prefork=0)
    workers.enqueue(a_call("c1"))
    connected(workers, "t1", 1001)
    assert workers.enqueue(a_call("c2")) == []
    assert workers.widen(1) == []  # never fewer, and the same is no change
    assert workers.widen(2) == [Fork(1)]
    assert workers.max_workers == 2


# -- workers that do not come ------------------------------------------------------------------


def failed_start(workers: WorkerSet, token: str, pid: int) -> tuple[Worker, list[Action]]:
    """A worker forked, reported, and exited with status 1 before it connected."""
    worker, _ = spawned(workers, token, pid)
    return worker, workers.on_exited(Exited(pid=pid, returncode=1))


async def test_workers_that_never_connect_fail_the_waiting_call_after_max_failed_starts() -> None:
    workers = opened(max_workers=4, prefork=2)
    call = a_call("c1")
    assert workers.enqueue(call) == [Fork(2)]
    # The first to fail: the other is still starting, and no spare is forked while they fail.
    worker, actions = failed_start(workers, "t1", 1001)
    assert actions == [Gone(worker, 1)]
    for n in range(2, MAX_FAILED_STARTS):
        worker, actions = failed_start(workers, f"t{n}", 1000 + n)
        assert actions == [Gone(worker, 1), Fork(1)], n  # one more try for the waiting call
    worker, actions = failed_start(workers, "last", 1999)
    match actions:
        case [Fail(failed, error), Gone(gone, 1)]:
            assert failed is call
            assert gone is worker
            assert isinstance(error, WorkersFailToStart)
            assert f"{MAX_FAILED_STARTS} in a row" in str(error)
            assert "exit status 1" in str(error)
        case _:
            raise AssertionError(actions)
    assert shown(workers) == state(active=0, queued=0, idle=0, starting=0)
    assert workers.replenish() == []  # no spares while starts fail
    # A later call gets its own MAX_FAILED_STARTS tries, one fork at a time.
    again = a_call("c2")
    assert workers.enqueue(again) == [Fork(1)]
    for n in range(1, MAX_FAILED_STARTS):
        worker, actions = failed_start(workers, f"again{n}", 2000 + n)
        assert actions == [Gone(worker, 1), Fork(1)], n
    worker, actions = failed_start(workers, "again-last", 2999)
    assert [type(action) for action in actions] == [Fail, Gone]


async def test_a_spawn_failure_fails_the_calls_it_leaves_unserved() -> None:
    workers = opened(max_workers=4, prefork=0)
    calls = [a_call(f"c{n}") for n in range(3)]
    for call in calls:
        assert workers.enqueue(call) == [Fork(1)]
    # Two of the three forks failed: the first two waiting calls fail, the third keeps the
    # worker still starting.
    actions = workers.on_spawn_failed(
        SpawnFailed(count=2, error="Resource temporarily unavailable")
    )
    match actions:
        case [Fail(first, error), Fail(second, same)]:
            assert (first, second) == (calls[0], calls[1])
            assert same is error
            assert str(error) == "no worker could be forked: Resource temporarily unavailable"
        case _:
            raise AssertionError(actions)
    assert shown(workers) == state(active=0, queued=1, idle=0, starting=1)
    worker, actions = connected(workers, "t1", 1001)
    assert actions == [Watch(worker, 1001), Assign(calls[2], worker)]


async def test_a_spawn_failure_with_every_call_served_fails_none() -> None:
    workers = opened(max_workers=4, prefork=2)
    assert workers.replenish() == [Fork(2)]
    assert workers.on_spawn_failed(SpawnFailed(count=2, error="EAGAIN")) == []
    # While forks fail, no spares: only a waiting call is worth another try.
    assert workers.replenish() == []
    assert workers.enqueue(a_call("c1")) == [Fork(1)]


# -- out of descriptors ------------------------------------------------------------------------


async def test_descriptor_starvation_retries_then_fails_the_waiting_calls() -> None:
    room = [0]
    workers = opened(max_workers=4, prefork=0, room=room)
    call = a_call("c1")
    assert workers.enqueue(call) == [RetryAfter(STARVED_RETRY_S)]
    # No worker is alive to free a descriptor: a bounded number of looks, then the call fails.
    for n in range(1, MAX_STARVED_TRIES):
        assert workers.retry() == [RetryAfter(STARVED_RETRY_S)], n
    match workers.retry():
        case [Fail(failed, error)]:
            assert failed is call
            assert "out of file descriptors" in str(error)
        case actions:
            raise AssertionError(actions)
    assert shown(workers) == state(active=0, queued=0, idle=0, starting=0)
    assert workers.stop_retrying() == []  # no retry is outstanding any more


async def test_descriptor_starvation_waits_as_long_as_a_worker_may_free_some() -> None:
    room = [1]
    workers = opened(max_workers=2, prefork=0, room=room)
    assert workers.enqueue(a_call("c1")) == [Fork(1)]
    busy, _ = connected(workers, "t1", 1001)
    room[0] = 0
    assert workers.enqueue(a_call("c2")) == [RetryAfter(STARVED_RETRY_S)]
    assert workers.enqueue(a_call("c3")) == []  # one retry outstanding at a time
    for _ in range(3 * MAX_STARVED_TRIES):
        assert workers.retry() == [RetryAfter(STARVED_RETRY_S)]
    # The busy worker's descriptors come back: the waiting call gets its worker forked.
    room[0] = 1
    assert workers.release(busy) == [Fork(1)]
    assert workers.stop_retrying() == [CancelRetry()]
    assert workers.stop_retrying() == []


# -- calls killed while waiting -----------------------------------------------------------------


async def test_withdrawing_an_assigned_call_gives_its_worker_to_the_next() -> None:
    workers = opened(max_workers=1, prefork=0)
    killed, next_call = a_call("c1"), a_call("c2")
    workers.enqueue(killed)
    worker, actions = connected(workers, "t1", 1001)
    assert actions[-1] == Assign(killed, worker)
    assert workers.enqueue(next_call) == []
    # The worker never saw the killed call: it serves the next one.
    assert workers.withdraw(killed, worker) == [Assign(next_call, worker)]
    assert shown(workers) == state(active=1, queued=0, idle=0, starting=0)
    # With no one waiting, it goes back to the idle ones.
    assert workers.withdraw(next_call, worker) == []
    assert shown(workers) == state(active=0, queued=0, idle=1, starting=0)
    assert worker.state is WorkerState.IDLE


async def test_withdrawing_a_waiting_call_leaves_the_queue() -> None:
    workers = opened(max_workers=2, prefork=0)
    call = a_call("c1")
    assert workers.enqueue(call) == [Fork(1)]
    assert workers.withdraw(call, None) == []
    assert shown(workers) == state(active=0, queued=0, idle=0, starting=1)
    worker, actions = connected(workers, "t1", 1001)
    assert actions == [Watch(worker, 1001)]  # no one to assign it to: it stays idle
    # A call a Fail answered was already out of the queue: nothing to give back.
    assert workers.withdraw(call, None) == []


# -- what a Ready means ------------------------------------------------------------------------


async def test_a_ready_before_its_spawned_is_kept_until_spawned_comes() -> None:
    workers = opened(max_workers=2, prefork=0)
    call = a_call("c1")
    workers.enqueue(call)
    assert workers.on_ready(b"t1", Ready(token="t1"), None, 1001) == []
    assert shown(workers) == state(active=0, queued=1, idle=0, starting=1)
    worker, actions = spawned(workers, "t1", 1001)
    assert actions == [Watch(worker, 1001), Assign(call, worker)]


async def test_a_ready_from_another_pid_than_the_one_forked_is_dropped() -> None:
    workers = opened(max_workers=2, prefork=0)
    call = a_call("c1")
    workers.enqueue(call)
    worker, _ = spawned(workers, "t1", 1001)
    assert ready(workers, worker, from_pid=6666) == []
    # Nor one whose token is not the identity it came under.
    assert workers.on_ready(b"t1", Ready(token="t9"), worker, 1001) == []
    assert shown(workers) == state(active=0, queued=1, idle=0, starting=1)
    assert worker.state is WorkerState.STARTING
    assert ready(workers, worker) == [Assign(call, worker)]
    # Early, from a stranger: when Spawned comes the worker is still waited for.
    assert workers.on_ready(b"t2", Ready(token="t2"), None, 6666) == []
    other, actions = spawned(workers, "t2", 1002)
    assert actions == [Watch(other, 1002)]
    assert other.state is WorkerState.STARTING


# -- exits, and killing them all ---------------------------------------------------------------


async def test_a_worker_that_exits_with_a_call_in_flight_is_kept_until_released() -> None:
    workers = opened(max_workers=2, prefork=1)
    assert workers.replenish() == [Fork(1)]
    call = a_call("c1")
    worker, _ = connected(workers, "t1", 1001)
    assert workers.enqueue(call) == [Assign(call, worker), Fork(1)]
    worker.call = call  # what execution does when it sends the call
    assert workers.on_exited(Exited(pid=1001, returncode=-9)) == [Gone(worker, -9)]
    assert workers.get("t1") is worker  # its Result may still be on its way
    assert worker.state is WorkerState.EXITED
    workers.release(worker)
    assert workers.get("t1") is None
    assert workers.kill_all() == []  # a reaped pid is never signalled


async def test_an_idle_worker_that_exits_is_replaced() -> None:
    workers = opened(max_workers=2, prefork=1)
    workers.replenish()
    worker, _ = connected(workers, "t1", 1001)
    assert workers.on_exited(Exited(pid=1001, returncode=0)) == [Gone(worker, 0), Fork(1)]
    assert shown(workers) == state(active=0, queued=0, idle=0, starting=1)
    assert workers.on_exited(Exited(pid=1001, returncode=0)) == []  # said twice: once is enough


async def test_a_lost_template_signals_every_worker_whose_pid_is_still_its_own() -> None:
    workers = opened(max_workers=4, prefork=3)
    assert workers.replenish() == [Fork(3)]
    reaped, _ = connected(workers, "t1", 1001)
    idle, _ = connected(workers, "t2", 1002)
    starting, _ = spawned(workers, "t3", 1003)
    call = a_call("c1")
    assert workers.enqueue(call) == [Assign(call, reaped)]
    reaped.call = call
    workers.on_exited(Exited(pid=1001, returncode=-9))
    assert workers.on_template_lost() == [
        Gone(reaped, -KILL),
        Signal(1002, KILL),
        Gone(idle, -KILL),
        Signal(1003, KILL, starting=True),  # its group may not be made yet: its pid too
        Gone(starting, -KILL),
    ]
    assert {w.state for w in (reaped, idle, starting)} == {WorkerState.EXITED}
    # Nothing is forked any more (the pool enqueues no call once it lost its template), and
    # no pid of theirs is signalled again.
    assert workers.replenish() == []
    assert workers.kill_all() == []


async def test_kill_all_skips_workers_stuck_in_the_kernel() -> None:
    workers = opened(max_workers=3, prefork=3)
    assert workers.replenish() == [Fork(3)]
    stuck, _ = connected(workers, "t1", 1001)
    connected(workers, "t2", 1002)
    spawned(workers, "t3", 1003)
    call = a_call("c1")
    workers.enqueue(call)
    stuck.state = WorkerState.QUARANTINED  # what Worker.stop leaves of one that would not die
    assert shown(workers) == state(active=1, queued=0, idle=1, starting=1, stuck=1)
    assert workers.kill_all() == [Signal(1002, KILL), Signal(1003, KILL, starting=True)]


async def test_a_withdrawn_call_whose_worker_died_meanwhile_gives_nobody_a_dead_worker() -> None:
    workers = opened(max_workers=1, prefork=0)
    killed, next_call = a_call("c1"), a_call("c2")
    workers.enqueue(killed)
    worker, actions = connected(workers, "t1", 1001)
    assert actions[-1] == Assign(killed, worker)
    assert workers.enqueue(next_call) == []
    # The assigned worker exits before the killed call's driver withdraws it...
    assert Gone(worker, -KILL) in workers.on_exited(Exited(pid=1001, returncode=-KILL))
    # ...so the next call is not handed the dead worker: a new one is forked for it.
    assert workers.withdraw(killed, worker) == [Fork(1)]
    assert shown(workers) == state(active=0, queued=1, idle=0, starting=1)
