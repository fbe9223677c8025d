"""The template process ("zygote"): preloads everything, then forks one worker per call.

Started by the coordinator (sandbx_pool.template_launch) from a thread that lives as long as
the pool. It stays single-threaded (no libzmq here: a context starts I/O threads, and forking
a threaded process is unsafe; workers speak ZMTP themselves, workers.zmtp), so each worker is
a cheap fork of an interpreter that has already imported the runtime and every tool.

    coordinator --Attach--> template (probes namespaces) --TemplateReady--> coordinator
    coordinator --Spawn(n)--> template --fork--> worker (setsid, PDEATHSIG, own PID namespace:
                                                 in a user namespace of its own without root)
    coordinator <--Spawned(token, pid) / Exited(pid, returncode)-- template (reaps on SIGCHLD)

Process limit: where a pids cgroup hierarchy is writable, each worker joins a cgroup of its own
while idle, the call's pids.max is set on it before the tool runs, and the template removes it
(killing what is left in it) once the worker is reaped (workers.cgroups). Where it is not, or
where a fork bomb fills whatever else bounds pids, a fork the kernel refuses (EAGAIN, ENOMEM) is
retried with a backoff and then reported as ``SpawnFailed``: the template never dies of it.

Death chain: the template dies with the coordinator's forking thread (PDEATHSIG, as SIGTERM: it
first kills every worker and sweeps what they leave); each worker dies with the template
(PDEATHSIG); everything a worker started dies with the worker (its PID namespace, or, without
one, the subreaper sweeps). Exits are observed on SIGCHLD, through the
signal wakeup fd, never by polling.
"""

from __future__ import annotations

import _signal
import contextlib
import ctypes
import gc
import os
import resource
import select
import selectors
import signal
import socket
import sys
import time
import traceback

import msgspec

# runtime, and through it every tool, is imported here so that each fork starts warm.
from sandbx_pool.workers import (
    bare_fork,
    cgroups,
    containment,
    immortal,
    lockdown,
    memory_cgroup,
    prepared_mounts,
    rules,
    runtime,
    sandbox,
    seccomp,
    usage,
    zmtp,
)
from sandbx_pool.workers.procfs import children
from sandbx_pool.workers.protocol import (
    Attach,
    Exited,
    PrebuildFileRules,
    Result,
    Shutdown,
    Spawn,
    Spawned,
    SpawnFailed,
    TemplateReady,
    encoder,
    to_template_decoder,
)
from sandbx_pool.workers.schemas import parse_args

#: How long shutdown waits, in all, to reap the workers it killed and remove their cgroups
#: before leaving the stuck ones behind. A killed worker that is not stuck dies in milliseconds;
#: the pool's close() promises to wait at most 2 s for one that is (docs/design.md), and this is
#: most of that.
SHUTDOWN_WAIT_S = 1.5
#: The part of it kept for the cgroups (a stuck worker's cannot be removed anyway).
SHUTDOWN_CGROUP_S = 0.25

#: How many times the template walks a worker's path before its first fork. CPython 3.11
#: specializes a function's bytecode after its 8th call, and its inline caches settle over the
#: next few; each of those writes, made in a worker, would copy a page of the template. Measured
#: (tests' pool, reads at 8 in flight): 70 fewer page faults per worker, about 0.5 ms of CPU.
REHEARSALS = 16

#: How many forks pass between two explicit collections of the template's garbage.
COLLECT_EVERY_FORKS = 1024

#: How often the template retries removing the cgroup of a reaped worker whose leftovers were
#: still exiting (or are stuck in the kernel) when it first tried.
CGROUP_RETRY_S = 0.25

#: Exit status of a worker that could not leave the template's cgroup.
EXIT_NO_CGROUP = 71

#: The directory the prepared mounts' masks are made in, covered in their namespace only.
SCRATCH = "/tmp"


#: Set to "subreaper" in the template's environment to use the subreaper fallback even where
#: PID namespaces are available.
CONTAINMENT_ENV = "SANDBX_POOL_CONTAINMENT"

#: Set to "off" in the template's environment to measure no call (outcome.usage None): for
#: the benchmark that weighs what measuring costs (bench.usage), not for users.
USAGE_ENV = "SANDBX_POOL_USAGE"


class Template:
    def __init__(self, control: socket.socket, *, rehearsed: bool = True) -> None:
        self.control = control
        #: Whether warm_up rehearsed a worker's path (full): then each worker rehearses its own
        #: while idle too; a light template's workers (one-shot pools) go straight to their call.
        self.rehearsed = rehearsed
        #: Where workers connect: the coordinator's Attach says, first thing.
        self.endpoint: str | None = None
        self.workers: set[int] = set()
        # CONTAINMENT_ENV (tests, or a host whose namespaces misbehave) skips the probe, so the
        # fallback is exercised deterministically even where namespaces are permitted.
        self.forced_subreaper = os.environ.get(CONTAINMENT_ENV) == "subreaper"
        # Without CAP_SYS_ADMIN, user namespaces may still give each worker its PID namespace:
        # probed once Attach says whether the pool's config allows them ([sandbox]
        # user_namespaces), so that an opt-out never makes even the probe's.
        self.namespaces: containment.Namespaces | None = (
            None if self.forced_subreaper else containment.probe_pid_namespaces()
        )
        self.next_token = 0
        # A pidfd of ourselves, inherited by each worker: it reads as ready once we have exited,
        # so a worker learns, race-free, that we died before it could arm PDEATHSIG (or while it
        # waits for its call). A pipe whose write end siblings briefly share cannot promise that.
        self.own_pidfd = os.pidfd_open(os.getpid())
        self.wakeup_read, self.wakeup_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        #: Every worker's stdin, stdout and stderr (containment.release_standard_streams).
        self.devnull = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
        self.selector = selectors.DefaultSelector()
        # The file tools' Landlock ruleset, once the coordinator has said for which workspace.
        self.file_rules: rules.FileRules | None = None
        self.pids_cgroup, self.process_limit_why, pids_version = _make_pids_cgroup()
        memory_pool, self.memory_limit_why = memory_cgroup.find(self.pids_cgroup, pids_version)
        self.memories = memory_cgroup.WorkerMemories(memory_pool)
        self.worker_cgroups: dict[int, str] = {}  # worker pid -> its cgroup's name
        self.unremoved: set[str] = set()  # cgroups of reaped workers still to be removed
        self.measure = os.environ.get(USAGE_ENV) != "off"
        #: The bash calls' prepared mount namespace (workers.prepared_mounts), made at Attach.
        self.mounts: prepared_mounts.Refresher | None = None

    @property
    def containment(self) -> str:
        return "pidns" if self.namespaces is not None else "subreaper"

    def send(self, message: msgspec.Struct) -> None:
        # If the coordinator is gone there is nobody to tell; PDEATHSIG is about to end us.
        with contextlib.suppress(OSError):
            self.control.send(encoder.encode(message))

    def run(self) -> None:
        signal.set_wakeup_fd(self.wakeup_write, warn_on_full_buffer=False)
        signal.signal(signal.SIGCHLD, _wake_loop)
        # SIGTERM is our parent-death signal (see main): it arrives here, as a byte on the
        # wakeup fd, and ends the loop like a Shutdown.
        signal.signal(signal.SIGTERM, _wake_loop)
        self.selector.register(self.control, selectors.EVENT_READ, "control")
        self.selector.register(self.wakeup_read, selectors.EVENT_READ, "signals")
        while True:
            unremoved = self.unremoved or self.memories.unremoved
            ready = self.selector.select(CGROUP_RETRY_S if unremoved else None)
            if unremoved:
                self.remove_worker_cgroups()
            for key, _ in ready:
                if key.data == "signals":
                    received = b""
                    with contextlib.suppress(BlockingIOError):
                        received = os.read(self.wakeup_read, 4096)
                    if signal.SIGTERM in received:
                        self.shutdown()
                        return
                    self.reap()
                elif not self.on_control():
                    self.shutdown()
                    return

    def on_control(self) -> bool:
        """Handle one control message; False means stop (Shutdown, or the coordinator is gone)."""
        try:
            data = self.control.recv(65536)
        except OSError:  # the coordinator died mid-message; PDEATHSIG is on its way
            data = b""
        if not data:
            return False
        message = to_template_decoder.decode(data)
        if isinstance(message, Shutdown):
            return False
        if isinstance(message, Attach):
            self.attach(message)
            return True
        if isinstance(message, PrebuildFileRules):
            if self.file_rules is not None:
                self.file_rules.close()
            timeout_s = rules.FILE_RULES_TIMEOUT_S
            self.file_rules = rules.build_file_rules(message.workspace, message.sandbox, timeout_s)
            return True
        assert isinstance(message, Spawn)
        if self.endpoint is None:  # the coordinator's bug, not a reason to die
            self.send(SpawnFailed(count=message.count, error="Spawn before Attach"))
            return True
        for done in range(message.count):
            try:
                self.fork_worker()
            except OSError as exc:
                # Even after the backoff: the rest of this request would meet the same refusal.
                # The coordinator fails the calls that waited for these workers; a later
                # request tries again.
                self.send(SpawnFailed(count=message.count - done, error=str(exc)))
                break
        return True

    def attach(self, message: Attach) -> None:
        """The coordinator's first message: where workers connect, and whether user namespaces
        may stand in for the PID namespaces root makes. Answered with TemplateReady."""
        self.endpoint = message.endpoint
        if self.namespaces is None and message.user_namespaces and not self.forced_subreaper:
            self.namespaces = containment.probe_user_namespaces()
        user_namespace = self.namespaces is not None and self.namespaces.user_namespace
        if self.mounts is None and not user_namespace:
            # Root's: what every bash call's mount namespace shares, made once (a user
            # namespace's worker could not join it, and builds its own).
            self.mounts = prepared_mounts.Refresher(SCRATCH)
        if (
            self.pids_cgroup is None
            and user_namespace
            and containment.nproc_counts_per_user_namespace()
        ):
            self.process_limit_why = None  # RLIMIT_NPROC in each worker's user namespace
        self.send(
            TemplateReady(
                pid=os.getpid(),
                containment=self.containment,
                pids_cgroup=self.pids_cgroup.path if self.pids_cgroup is not None else None,
                process_limit_why=self.process_limit_why,
                user_namespaces=self.namespaces is not None and self.namespaces.user_namespace,
                memory_cgroup=None if self.memories.pool is None else self.memories.pool.path,
                memory_limit_why=self.memory_limit_why or None,
            )
        )

    def fork_worker(self) -> None:
        # Unguessable, so that nobody can connect first under a future worker's identity.
        token = f"{self.next_token}.{os.urandom(8).hex()}"
        cgroup = f"w{self.next_token}"
        self.next_token += 1
        if self.next_token % COLLECT_EVERY_FORKS == 0:
            gc.collect()  # automatic collection is off (see warm_up)
        # A few stats: a worker whose secrets layer is out of date would build its own.
        rules.preload().refresh_secrets_layer()
        # The prepared mounts, made again if stale, and the worker's watch on the host's table.
        mounts = self.mounts.for_fork() if self.mounts is not None else None
        # Reaping between tries: a pid comes back only when its zombie is reaped.
        pid = cgroups.fork_with_backoff(self.fork_once, on_retry=self.reap)
        if pid == 0:
            prepared_mounts.current = mounts
            self.become_worker(token, cgroup)
        if mounts is not None:
            mounts.forked()
        self.workers.add(pid)
        if self.pids_cgroup is not None:
            self.worker_cgroups[pid] = cgroup
        self.memories.forked(pid, cgroup)
        self.send(Spawned(token=token, pid=pid))

    def fork_once(self) -> int:
        """One fork, into new namespaces where there are (a new one each try: see
        workers.containment)."""
        if self.namespaces is None:
            return bare_fork.fork()
        return self.namespaces.fork()

    def become_worker(self, token: str, cgroup: str) -> None:
        """In the child: cut every tie to the template except its pidfd, then serve.

        Every line here runs once per worker, in code the template never ran, so each costs
        copy-on-write faults on the template's pages; these are the cheap forms. Measured
        in a forked child of the template: ``signal.signal`` (its Python wrapper converts to
        and from enums) takes 90 page faults where ``_signal.signal`` takes 14; closing the
        selector's and the socket's descriptors rather than the objects (which free what
        they hold) saves about 10 more. The objects are never used again: the worker leaves
        with os._exit.
        """
        try:
            if self.namespaces is not None:
                self.namespaces.enter_child()  # a user namespace's worker maps its ids
            signal.set_wakeup_fd(-1)
            _signal.signal(signal.SIGCHLD, _signal.SIG_DFL)
            for fd in (self.selector.fileno(), self.control.fileno()):
                os.close(fd)
            for fd in (self.wakeup_read, self.wakeup_write):
                os.close(fd)
            # Own session and process group: a cancel is one killpg, and a Ctrl-C at the
            # coordinator's terminal never reaches a worker directly.
            os.setsid()
            containment.set_parent_death_signal()
            lifeline = select.poll()
            lifeline.register(self.own_pidfd, select.POLLIN)
            if lifeline.poll(0):  # the template died before PDEATHSIG was armed
                os._exit(1)
            if not containment.in_own_pid_namespace():
                containment.set_child_subreaper()
            cgroup_path = None
            if self.pids_cgroup is not None:
                # Out of the template's cgroup at once (its pids.max is the template's), into
                # the idle workers' one: a single write. A cgroup of its own once idle a while,
                # or for a call that runs programs (runtime.serve): a busy file tool's starts
                # nothing and never needs one.
                cgroup_path = self.pids_cgroup.worker_path(cgroup)
                try:
                    cgroups.join(self.pids_cgroup.idle_path)
                except OSError as exc:
                    print(f"worker cannot join the idle cgroup: {exc}", file=sys.stderr)
                    os._exit(EXIT_NO_CGROUP)
            containment.release_standard_streams(self.devnull)
            assert self.endpoint is not None  # on_control forks only once Attach came
            runtime.serve(
                token,
                self.endpoint,
                self.own_pidfd,
                self.file_rules,
                pids_cgroup=cgroup_path,
                memory=self.memories.for_worker(cgroup, cgroup_path),
                measure=self.measure,
                rehearse=self.rehearsed,
            )
        except BaseException:
            # Nobody else can report a worker that broke before it could connect. Whatever
            # happens to the report, never unwind into the template's code.
            try:
                traceback.print_exc()
            finally:
                os._exit(70)
        os._exit(0)

    def reap(self) -> None:
        exited: list[Exited] = []
        reaped_any = False
        while True:
            try:
                # wait4: the worker's rusage, with its reaped tree's, for a call it could not
                # answer (workers.usage).
                pid, status, rusage = os.wait4(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            reaped_any = True
            if pid in self.workers:
                self.workers.discard(pid)
                exited.append(self.exited(pid, status, rusage))
        # Kill what the worker left in its cgroup (subreaper mode: what setsid() or a double fork
        # took out of its group) before the coordinator hears of the exit.
        if self.unremoved or self.memories.unremoved:
            self.remove_worker_cgroups()
        # Subreaper mode: sweep after every reap, an orphan's included. Killing an orphan
        # reparents its own children to us, and its death (this SIGCHLD) is when to catch them;
        # a double fork racing the previous sweep is caught by the next. Sweep before telling the
        # coordinator, so that a call's outcome never precedes the kill of what it left.
        if reaped_any and self.namespaces is None:
            self.sweep_orphans()
        for message in exited:
            self.send(message)

    def exited(self, pid: int, status: int, rusage: resource.struct_rusage) -> Exited:
        """The notice of worker ``pid``'s exit, with what its tree cost and whether its memory
        limit killed in it, read from its cgroups before they are removed."""
        measured = usage.from_wait4(rusage) if self.measure else None
        path = None
        if (cgroup := self.worker_cgroups.pop(pid, None)) is not None:
            assert self.pids_cgroup is not None
            self.unremoved.add(cgroup)
            path = self.pids_cgroup.worker_path(cgroup)
            if not os.path.isdir(path):  # the worker never made it (a busy file tool's)
                path = None
        killed = self.memories.reaped(pid, path)
        if measured is not None and path is not None and self.memories.in_pids_cgroups:
            measured = usage.from_cgroup(path, measured)  # v2, with memory accounting
        returncode = os.waitstatus_to_exitcode(status)
        return Exited(pid=pid, returncode=returncode, usage=measured, memory_killed=killed)

    def remove_worker_cgroups(self) -> None:
        """Kill what is left in each reaped worker's cgroups and remove them; one try each,
        the rest on the loop's next turn (a member still exiting keeps it busy)."""
        for cgroup in list(self.unremoved):
            assert self.pids_cgroup is not None
            if self.pids_cgroup.end_worker(cgroup):
                self.unremoved.discard(cgroup)
        self.memories.remove()

    def sweep_orphans(self) -> None:
        """Subreaper mode: kill what a dead worker's descendants left reparented to us."""
        for pid in children():
            if pid not in self.workers:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def shutdown(self) -> None:
        """Kill every worker and what it left, and reap them all, bounded: a process stuck in
        the kernel is left behind."""
        for pid in self.workers:
            # The pid too: a worker forked a moment ago may not have called setsid() yet.
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
        deadline = time.monotonic() + SHUTDOWN_WAIT_S - SHUTDOWN_CGROUP_S
        # Until we have no child at all, not just no worker: in subreaper mode the orphans a
        # dying worker leaves come to us, and leaving before sweeping them would hand them to
        # init, alive.
        self.reap()
        while children() and (remaining := deadline - time.monotonic()) > 0:
            if select.select([self.wakeup_read], [], [], remaining)[0]:
                with contextlib.suppress(BlockingIOError):
                    os.read(self.wakeup_read, 4096)
            self.reap()
        # Whoever is left is stuck in the kernel; once we exit it is reparented to init and
        # dies (its PDEATHSIG fires with us) when the kernel lets it go. Its cgroup stays: the
        # next template's cleanup_stale removes it.
        if self.pids_cgroup is not None:
            self.pids_cgroup.close(SHUTDOWN_CGROUP_S)
        self.memories.close()


def _make_pids_cgroup() -> tuple[cgroups.PoolCgroup | None, str | None, int | None]:
    """The template's pool of worker cgroups, after removing those of dead templates, and its
    cgroup version; or None and why the process limit cannot be enforced here."""
    reasons: list[str] = []
    hierarchy = cgroups.find_pids_hierarchy(reasons)
    if hierarchy is None:
        return None, "; ".join(reasons), None
    try:
        hierarchy.cleanup_stale()
        return hierarchy.create_pool(), None, hierarchy.version
    except OSError as exc:
        return None, f"cannot make the pool's cgroup in {hierarchy.base}: {exc}", None


def _wake_loop(signum: int, frame: object) -> None:
    """SIGCHLD's and SIGTERM's handler: nothing. The byte each signal writes to the wakeup fd
    is what wakes the loop; a Python handler must be set for Python to write it. A function
    of the module, so that a worker replacing it frees nothing of the template's."""


def _return_free_heap() -> None:
    """Hand back to the kernel the heap memory that importing and rehearsing freed (glibc's
    malloc_trim; elsewhere nothing). Left mapped, every fork copies its page-table entries and
    every exit unmaps them: measured in a loop of forks of the warmed-up template, 1.3 MB less
    anonymous memory and fork + exit 1.30 -> 1.17 ms."""
    malloc_trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if malloc_trim is not None:
        malloc_trim(0)


def warm_up(*, full: bool = True) -> None:
    """Do once, here, the work every worker would otherwise repeat after its fork.

    ``full=False`` (``[pool] warm_up = false``: a pool that expects a call or two, such as
    the one-shot ``sandbx-pool call``) skips the rehearsals and immortal objects: they save
    each worker a fraction of a millisecond, and cost the template's start about 0.2 s.

    msgspec builds a type's validation info on first use (annotation evaluation, a few ms);
    doing it before forking means each worker inherits it, as it inherits the confinement's
    fixed Landlock rules, opened once here (workers.rules.preload), and the bytecode of its
    path specialized by the rehearsals (REHEARSALS says why). gc.freeze() then moves
    every object to a generation the collector never scans, so a worker's collections do not
    touch (and copy-on-write) the template's pages.
    """
    samples: dict[str, dict[str, object]] = {
        "read": {"path": "x"},
        "write": {"path": "x", "content": ""},
        "edit": {"path": "x", "old_string": "a", "new_string": "b"},
        "ls": {},
        "grep": {"pattern": "x"},
        "find": {"pattern": "*"},
        "bash": {"command": "true"},
    }
    for tool, args in samples.items():
        parse_args(tool, args)
    encoder.encode(Result(call_id="", status="ok", value={}))
    rules.preload()
    lockdown.prepare()
    seccomp.prepare()
    if full:
        for _ in range(REHEARSALS):
            runtime.rehearse_call()
            sandbox.rehearse()
            zmtp.rehearse()
        immortal.immortalize()
    gc.collect()
    gc.freeze()
    _return_free_heap()
    # And no automatic collections from here on: each would walk the young objects, writing
    # to pages the workers share with us (so copying them), a few times per fork. What the
    # loop allocates per worker holds no cycle; Template.fork_worker collects now and then
    # all the same, so that a cycle nobody expected stays bounded.
    gc.disable()


#: The flags sandbx_pool.template_launch passes, each as ``--name=value``.
OPTIONS = ("control-fd", "parent-pid", "warm-up")


def parse_options(argv: list[str]) -> dict[str, str]:
    """Every one of OPTIONS, and nothing else. Not argparse: every worker inherits what the
    template imports, and pays for its pages."""
    options: dict[str, str] = {}
    for arg in argv:
        name, _, value = arg.removeprefix("--").partition("=")
        options[name] = value
    if sorted(options) != sorted(OPTIONS) or not all(options.values()):
        flags = " ".join(f"--{name}=..." for name in OPTIONS)
        raise SystemExit(f"usage: python -m sandbx_pool.workers.template {flags}")
    return options


def main(argv: list[str] | None = None) -> int:
    """Serve until told to stop; returns only when the start is refused (else exits)."""
    options = parse_options(sys.argv[1:] if argv is None else argv)
    # SIGTERM, not SIGKILL: when the coordinator dies we must outlive it by a moment, to kill
    # the workers and (subreaper mode) sweep what they leave; dying at once would hand those
    # orphans to init. Until run() handles it, SIGTERM's default action ends us, which is right:
    # there is no worker yet.
    containment.set_parent_death_signal(signal.SIGTERM)
    if os.getppid() != int(options["parent-pid"]):  # the coordinator died before PDEATHSIG
        return 1
    containment.set_child_subreaper()
    full = options["warm-up"] == "full"
    warm_up(full=full)
    control = socket.socket(fileno=int(options["control-fd"]))
    Template(control, rehearsed=full).run()
    # Every worker is reaped and reported, and the pool's close waits for our exit: the
    # interpreter's teardown (freeing every object, ~30 ms, measured with strace) would only
    # delay it. Nothing is buffered but what stderr holds.
    with contextlib.suppress(OSError):
        sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
