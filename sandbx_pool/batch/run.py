"""Running a batch through one Pool: bounded lanes, ordering by ``after``, stop, resume.

    CallSpecs (file order) --_ReadyLines--> ``parallel`` lanes, each: take the next ready
        spec, await pool.call(...), record the Outcome, release what comes after it --> BatchReport

A fixed set of lanes, not one task per line: a 20,000-line batch must not put 20,000 tasks
(and 20,000 journal intents) in front of ``workers`` busy workers. A lane takes only a line
whose ``after`` calls (and its session's previous line) have ended, the first such in file
order: a line still waiting holds no lane, so ``parallel`` calls are in flight whenever that
many are ready. Every ``after`` dependency is an earlier line, so some line is always ready
while any is left and none is in flight: it cannot deadlock.

Stopping: when ``stop`` is set (the command's Stopper saw a signal and is closing the pool)
lanes take no more specs; the calls in flight end as ``cancelled`` with killer ``shutdown``
and are journaled like any outcome. A call refused because the pool closed under it
(PoolClosed) was never journaled and simply counts as not run.

Resume: ``resume_plan`` reads the journal of the earlier run and says what to skip, from
``journal.reader.call_ledger`` (the one definition of finished and in doubt, which ``journal
in-doubt`` and ``journal stats`` use too). A call with an outcome other than a shutdown cancel,
a loss with its Ray node or a refusal by the journal (reason ``JOURNAL_REFUSED``) is finished.
The rest run again, unless running them again could repeat a side effect that may already
have happened: an edit or bash call (see ``IDEMPOTENT_TOOLS``) that was stopped after a worker
took it, or that has an intent and no outcome at all (the coordinator was SIGKILLed, or a
second SIGINT exited at once). Such a call is *in doubt*: listed and skipped, unless
``rerun_started``; so are the calls that come ``after`` it (held back: not run, and counted
so).

The pool is a ``Pool`` or an ``integrations.ray.RayPool`` (``run --ray``): a line's
``workspace`` is then given by name, and each outcome carries the node it ran on.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import os
import re
import time
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING, Any, Final

import msgspec

from sandbx_pool.batch.calls import CallSpec
from sandbx_pool.cancel import CancelToken
from sandbx_pool.errors import PoolClosed, SandbxPoolError
from sandbx_pool.images.image import Image
from sandbx_pool.journal.reader import (
    call_ledger,
    is_node_lost,
    is_shutdown_cancel,
    read_journal,
)
from sandbx_pool.logs import logger
from sandbx_pool.outcome import Outcome
from sandbx_pool.output import OutputChunk
from sandbx_pool.pool import Pool

if TYPE_CHECKING:
    from sandbx_pool.integrations.ray import RayPool

#: How many of the slowest calls the report keeps.
SLOWEST: Final = 5

# What the callbacks return is ignored (a lambda may return a TimerHandle, a print None).
OutcomeCallback = Callable[[CallSpec, Outcome], object]
SubmitCallback = Callable[[CallSpec], object]


def reruns(outcome: Outcome) -> bool:
    """Whether ``--resume`` runs this outcome's call again: it did not run to an end."""
    return is_shutdown_cancel(outcome.status, outcome.killed_by) or is_node_lost(
        outcome.status, outcome.reason
    )


def finished_call_ids(path: str | os.PathLike[str]) -> set[str]:
    """Call ids with an outcome that says they ran (see ``journal.reader.ran_to_an_end``)."""
    return resume_plan(path).finished


class ResumePlan(msgspec.Struct, frozen=True, kw_only=True):
    """What ``run --resume`` skips: ``finished`` calls, and ``in_doubt`` ones (id -> tool)
    whose side effect may have happened, unless they are re-run on purpose (``doubts``: why,
    id -> text). ``seen``: every id the journal holds; ``workspaces``: each id's workspace as
    its latest intent recorded it, the latest intent last."""

    finished: set[str]
    in_doubt: dict[str, str]
    seen: set[str] = msgspec.field(default_factory=set)
    workspaces: dict[str, str] = msgspec.field(default_factory=dict)
    #: Why each call in doubt is (``journal.reader.Doubt``): id -> its text.
    doubts: dict[str, str] = msgspec.field(default_factory=dict)

    def skip(self, *, rerun_started: bool) -> set[str]:
        return self.finished if rerun_started else self.finished | set(self.in_doubt)

    def workspace_root(self, calls: list[CallSpec]) -> str | None:
        """The workspace root (``--workspace``) that the latest journaled call of ``calls``
        ran under, or None if the journal recorded none.

        A line with its own ``workspace`` ran in ROOT/NAME: the root is what precedes NAME
        (a call whose recorded path does not end so is passed over: its line changed).
        Lexical, like what the pool recorded."""
        by_id = {spec.call_id: spec for spec in calls}
        for call_id, recorded in reversed(self.workspaces.items()):
            spec = by_id.get(call_id)
            if spec is None or spec.layer is not None:
                continue  # gone from the file, or ran in a layer (its path is the store's)
            if spec.workspace is None:
                return recorded
            suffix = os.sep + spec.workspace
            if recorded.endswith(suffix):
                return recorded[: -len(suffix)] or os.sep
        return None


def resume_plan(path: str | os.PathLike[str]) -> ResumePlan:
    """Read the journal at ``path`` into a ResumePlan (see the module's docstring)."""
    ledger = call_ledger(read_journal(path))
    return ResumePlan(
        finished=ledger.finished,
        in_doubt={call.call_id: call.tool for call in ledger.in_doubt},
        seen=ledger.seen,
        workspaces=ledger.workspaces,
        doubts={call.call_id: str(call.why) for call in ledger.in_doubt},
    )


class BatchReport:
    """What a run did: every outcome, in the order they finished, and what did not run."""

    def __init__(self, total: int, skipped: int, in_doubt: Collection[str] = ()) -> None:
        self.total = total  # calls in the file
        self.skipped = skipped  # finished by an earlier run, or in doubt (--resume)
        # Skipped because an earlier run may have done their side effect (--resume): in file
        # order. They have not run to an end, so a run that skips any is not complete.
        self.in_doubt: list[str] = list(in_doubt)
        # Not run because they come ``after`` a call in doubt (directly or not).
        self.held: list[str] = []
        self.results: list[tuple[CallSpec, Outcome]] = []
        self.started_at = time.monotonic()
        self.wall_s = 0.0
        self.stopped = False  # a stop request ended the run early
        self.failure: str | None = None  # infrastructure failure that ended the run early
        self.journal: str | None = None

    @property
    def to_run(self) -> int:
        return self.total - self.skipped

    @property
    def ran(self) -> int:
        """Calls that have an outcome which is not a shutdown cancel, nor lost with a node."""
        return sum(not reruns(outcome) for _, outcome in self.results)

    @property
    def not_run(self) -> int:
        return self.to_run - self.ran

    @property
    def complete(self) -> bool:
        """Every call of the file ran (now or in an earlier run), whatever its outcome."""
        return self.not_run == 0 and not self.in_doubt

    def by_status(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for _, outcome in self.results:
            counts[outcome.status] = counts.get(outcome.status, 0) + 1
        return counts

    def by_node(self) -> dict[str, int]:
        """Outcomes per Ray node (empty on one machine)."""
        counts: dict[str, int] = {}
        for _, outcome in self.results:
            if outcome.node is not None:
                counts[outcome.node] = counts.get(outcome.node, 0) + 1
        return counts

    def slowest(self, n: int = SLOWEST) -> list[tuple[CallSpec, Outcome]]:
        return sorted(self.results, key=lambda item: item[1].duration_s, reverse=True)[:n]

    def __repr__(self) -> str:
        return (
            f"<BatchReport [{len(self.results)} outcomes | {self.skipped} skipped | "
            f"{len(self.in_doubt)} in doubt | "
            f"{self.not_run} not run{' | stopped' if self.stopped else ''}]>"
        )


async def run_batch(
    pool: Pool | RayPool,
    calls: list[CallSpec],
    *,
    parallel: int,
    skip: Collection[str] = frozenset(),
    in_doubt: Collection[str] = frozenset(),
    stop: asyncio.Event | None = None,
    on_submit: SubmitCallback | None = None,
    on_outcome: OutcomeCallback | None = None,
    tokens: Mapping[str, CancelToken] | None = None,
    output_dir: str | os.PathLike[str] | None = None,
) -> BatchReport:
    """Run ``calls`` (minus ``skip``) through ``pool``, at most ``parallel`` at a time.

    ``in_doubt`` are the ids among ``skip`` that are skipped because they may have run
    (reported, not counted as finished). ``on_submit`` is called just before a call is handed
    to the pool, ``on_outcome`` when it ends; ``tokens`` gives some calls a CancelToken.
    ``output_dir``: each bash call's output is written to ``CALL_ID.out`` there as it comes.
    Returns when every call has run, or when ``stop`` was set and the calls in flight have
    ended.
    """
    if parallel < 1:
        raise ValueError("parallel must be at least 1")
    todo = [spec for spec in calls if spec.call_id not in skip]
    doubtful = [spec.call_id for spec in calls if spec.call_id in skip and spec.call_id in in_doubt]
    report = BatchReport(total=len(calls), skipped=len(calls) - len(todo), in_doubt=doubtful)
    report.journal = pool.journal.path if pool.journal is not None else None
    ready = _ReadyLines(todo)
    held = set(doubtful)  # in doubt, or after a call in doubt: not run
    halt = asyncio.Event()  # our own reason to stop: the pool failed under us
    # Opened once: each output file is made relative to it (_output_file says why).
    pulls = _Pulls(pool) if isinstance(pool, Pool) else None
    outputs = None
    if output_dir is not None:
        outputs = os.open(output_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)

    def stopping() -> bool:
        return halt.is_set() or (stop is not None and stop.is_set())

    async def lane() -> None:
        # Each spec is taken by exactly one lane, once what it comes after has ended: a line
        # still waiting holds no lane, so ``parallel`` calls run whenever that many are ready.
        while (spec := await ready.take(stopping)) is not None:
            sink: _OutputFile | None = None
            try:
                if held.intersection(spec.after):
                    # What it comes after may or may not have happened: so may not this one.
                    held.add(spec.call_id)
                    report.held.append(spec.call_id)
                    continue
                if on_submit is not None:
                    on_submit(spec)
                sink = _output_file(outputs, spec)
                extra: dict[str, Any] = {}
                if spec.layer is not None:
                    try:
                        extra["workspace"] = await _layer(pool, spec, pulls)
                    except PoolClosed:
                        return  # closed by a stop while the layer was being made
                    except (ValueError, SandbxPoolError) as exc:
                        if report.failure is None:
                            report.failure = f"line {spec.line}: {exc}"
                            logger.error("batch stopped at line {}: {}", spec.line, exc)
                        halt.set()
                        return
                elif isinstance(pool, Pool):
                    extra["on_output"] = sink.write if sink is not None else None
                    if spec.workspace is not None:
                        extra["workspace"] = os.path.join(pool.workspace, spec.workspace)
                    if spec.changes is not None:
                        extra["changes"] = spec.changes
                    if spec.session is not None:
                        extra["session"] = spec.session
                    if spec.network is not None:
                        extra["network"] = spec.network
                else:  # a RayPool: workspaces by name, output only in the outcome
                    extra["workspace"] = spec.workspace
                if isinstance(pool, Pool):
                    extra["on_output"] = sink.write if sink is not None else None
                try:
                    outcome = await pool.call(
                        spec.tool,
                        spec.args,
                        timeout=spec.timeout_s,
                        cwd=spec.cwd,
                        call_id=spec.call_id,
                        cancel=tokens.get(spec.call_id) if tokens else None,
                        **extra,
                    )
                except PoolClosed:
                    return  # closed by a stop: this call was refused before its intent
                except SandbxPoolError as exc:  # template lost, journal failed: nothing more runs
                    if report.failure is None:
                        report.failure = f"{type(exc).__name__}: {exc}"
                        logger.error("batch stopped at line {}: {}", spec.line, report.failure)
                    halt.set()
                    return
                report.results.append((spec, outcome))
                if on_outcome is not None:
                    on_outcome(spec, outcome)
            finally:
                if sink is not None:
                    sink.close()
                # Whatever happened, so a call waiting on this one never waits forever.
                ready.ended(spec)

    # The batch's span (when the pool sends spans): each call's span is its child.
    span = (
        contextlib.nullcontext()
        if pool.telemetry is None
        else pool.telemetry.batch(
            "sandbx-pool run", **{"sandbx.calls": len(todo), "sandbx.skipped": report.skipped}
        )
    )
    # A lane waiting for a line to be ready must see a stop too.
    watch = None if stop is None else asyncio.create_task(ready.wake_on(stop))
    try:
        with span:
            async with asyncio.TaskGroup() as lanes:
                for number in range(min(parallel, len(todo))):
                    lanes.create_task(lane(), name=f"batch-lane-{number}")
    finally:
        if watch is not None:
            watch.cancel()
        if outputs is not None:
            os.close(outputs)
        if pulls is not None:
            pulls.close()
        report.wall_s = time.monotonic() - report.started_at
        report.stopped = stop is not None and stop.is_set()
    return report


class _ReadyLines:
    """The lines not yet taken, handed out in file order as they become ready: once each line
    they come ``after`` (an explicit ``after``, or their session's previous line) has ended.
    A line that depends on a skipped one (finished earlier, in doubt) waits for nothing."""

    def __init__(self, todo: list[CallSpec]) -> None:
        ids = {spec.call_id for spec in todo}
        self._waiting: dict[str, int] = {}
        self._dependents: dict[str, list[tuple[int, CallSpec]]] = {}
        self._ready: list[tuple[int, CallSpec]] = []
        for index, spec in enumerate(todo):
            after = {dependency for dependency in spec.after if dependency in ids}
            for dependency in after:
                self._dependents.setdefault(dependency, []).append((index, spec))
            if after:
                self._waiting[spec.call_id] = len(after)
            else:
                self._ready.append((index, spec))
        self._untaken = len(todo)
        #: Set when a line ended or a stop came: the lanes waiting look again.
        self._changed = asyncio.Event()

    async def take(self, stopping: Callable[[], bool]) -> CallSpec | None:
        """The next ready line in file order, waiting for one; None once every line is
        taken, or on a stop."""
        while not stopping() and self._untaken > 0:
            if self._ready:
                self._untaken -= 1
                return heapq.heappop(self._ready)[1]
            self._changed.clear()  # no await since the look: no wake-up lost
            await self._changed.wait()
        return None

    def ended(self, spec: CallSpec) -> None:
        """``spec`` ended (ran, was held, or its lane gave up): the lines after it may run."""
        for index, dependent in self._dependents.pop(spec.call_id, []):
            self._waiting[dependent.call_id] -= 1
            if self._waiting[dependent.call_id] == 0:
                heapq.heappush(self._ready, (index, dependent))
        self._changed.set()

    async def wake_on(self, event: asyncio.Event) -> None:
        await event.wait()
        self._changed.set()


class _OutputFile:
    """One call's output as it comes, in a file a person can follow with ``tail -f``.

    Written from the loop: a local append of a paced stream (workers.streaming) is brief, and
    this is the user's own directory, not the workspace the coordinator must never touch."""

    def __init__(self, fd: int) -> None:
        self._file = open(fd, "w", encoding="utf-8")  # noqa: SIM115 (closed by close())

    def write(self, chunk: OutputChunk) -> None:
        self._file.write(chunk.display())
        self._file.flush()

    def close(self) -> None:
        self._file.close()


#: How an output file is made: a new file, never through a symlink or into a FIFO.
_OUTPUT_FLAGS: Final = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class _Pulls:
    """The run's images, each found in the store or pulled once: the first line that needs
    one starts it, and the lines that need it meanwhile wait for the same (an image ingested
    by one lane is not looked up again by the next line, nor pulled twice by two lanes)."""

    def __init__(self, pool: Pool) -> None:
        self._pool = pool
        self._images: dict[str, asyncio.Task[Image]] = {}

    async def image(self, ref: str) -> Image:
        task = self._images.get(ref)
        if task is None:
            task = asyncio.create_task(self._pool.image(ref), name=f"batch-image {ref}")
            self._images[ref] = task
        # Shielded: a lane stopped while it waits does not cancel the others' pull.
        return await asyncio.shield(task)

    def close(self) -> None:
        """The run is over: a pull no lane waits for any more is not waited for either (its
        thread ends with the pull; the store leaves nothing half-made)."""
        for task in self._images.values():
            task.cancel()


async def _layer(pool: Pool | RayPool, spec: CallSpec, pulls: _Pulls | None) -> Any:
    """The layer a line runs in (its path on a RayPool's node), made over its base or its
    image by the first line that needs it; a relative base is under the workspace root
    (batch.calls). On a RayPool the image's reference goes to the layer's node, whose pool
    pulls it into that node's store (once per node)."""
    assert spec.layer is not None
    if spec.image is not None:
        if isinstance(pool, Pool):
            assert pulls is not None  # made for every local pool
            return await pool.layer(spec.layer, image=await pulls.image(spec.image))
        return await pool.layer(spec.layer, image=spec.image)
    root = pool.workspace if isinstance(pool, Pool) else pool.workspace_root
    # Lexical: the base is a workspace, which only a worker touches.
    joined = None if spec.base is None else os.path.join(root, spec.base)
    base = None if joined is None else os.path.normpath(joined)  # noqa: ASYNC240
    return await pool.layer(spec.layer, base=base)


def _output_file(directory: int | None, spec: CallSpec) -> _OutputFile | None:
    """``CALL_ID.out`` made afresh in the output directory (its descriptor, opened once).

    The directory may lie in the workspace, where an earlier call can plant ``CALL_ID.out``
    as a symlink to any file the coordinator's user may write (its content would then be the
    next call's output): whatever is there is removed, never opened, and the file made with
    O_EXCL relative to the directory's descriptor, so neither a symlink there nor the directory
    swapped for one redirects it. A file that cannot be made costs the call its file (logged),
    not its run."""
    if directory is None or spec.tool != "bash":
        return None
    # A call id is the user's text: keep it to one harmless file name.
    name = re.sub(r"[^A-Za-z0-9._-]", "_", spec.call_id).lstrip(".") or "call"
    name = f"{name}.out"
    for _ in range(3):  # a call still planting in parallel gets a few tries, not a loop
        try:
            return _OutputFile(os.open(name, _OUTPUT_FLAGS, 0o644, dir_fd=directory))
        except FileExistsError:
            try:
                os.unlink(name, dir_fd=directory)  # the entry itself, symlink or file
            except FileNotFoundError:
                continue
            except OSError as exc:  # a directory planted there
                logger.warning("output of {}: cannot replace {}: {}", spec.call_id, name, exc)
                return None
        except OSError as exc:
            logger.warning("output of {}: cannot make {}: {}", spec.call_id, name, exc)
            return None
    logger.warning("output of {}: {} keeps being re-made; no output file", spec.call_id, name)
    return None
