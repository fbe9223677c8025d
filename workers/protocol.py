"""The wire protocol between the coordinator, the template process and the workers.

Two channels, one message family:

* coordinator <-> worker: ZeroMQ (libzmq's ROUTER in the coordinator, one DEALER per worker,
  workers.zmtp) on an ipc:// endpoint in the pool's private runtime directory. A worker
  announces itself with ``Ready``, receives exactly one ``Call`` and answers with exactly
  one ``Result``.
* coordinator <-> template: a SOCK_SEQPACKET socketpair. The template must stay
  single-threaded so that forking it is safe, and a libzmq context starts I/O threads, so this
  channel is a plain socket. The coordinator asks for ``Spawn``; the template reports each
  ``Spawned`` worker (with its pid as the coordinator sees it) and each ``Exited`` one.

Every message is a tagged msgspec Struct carrying ``v``, the protocol version. Rules from
msgspec's schema-evolution guide: new fields get defaults and go last; a field's type never
changes. Encoders and decoders are built once per process (module level below).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

PROTOCOL_VERSION = 1

#: Largest message either side accepts; anything bigger is dropped by ZeroMQ before decoding.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


class Limits(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Resource limits applied to one call's worker with setrlimit (None: inherit),
    ``processes``, the pids.max of the worker's cgroup (None: no limit; workers.cgroups), and
    ``memory_bytes``, the memory the call's whole process tree may hold: the memory cgroup's
    limit where the pool has one, else RLIMIT_DATA in each process (workers.usage)."""

    address_space_bytes: int | None = None
    cpu_seconds: int | None = None
    open_files: int | None = None
    file_size_bytes: int | None = None
    processes: int | None = None
    memory_bytes: int | None = None


class Sandbox(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """How a worker confines itself before the tool runs (applied by workers.sandbox)."""

    filesystem: Literal["workspace", "host"] = "workspace"  # "host": no filesystem rules
    read_only: tuple[str, ...] = ()  # extra paths, beyond the system's and Python's
    writable: tuple[str, ...] = ()  # extra paths, beyond the workspace and the call's TMPDIR
    network: bool = True  # False: no TCP bind/connect, and a network namespace of its own
    tmp_root: str | None = None  # where the call's private TMPDIR is made (None: no TMPDIR)
    hidden: tuple[str, ...] = ()  # covered by an empty mount: the coordinator's socket dir
    uid: int | None = None  # run_as: drop to this user (and gid, groups) before the tool runs
    gid: int | None = None
    groups: tuple[int, ...] = ()
    #: Globs relative to the workspace that no call may change: write and edit are denied,
    #: bash sees them read-only (a hook or a git config planted would run later, unsandboxed).
    protected: tuple[str, ...] = ()
    #: Size of the call's private TMPDIR (a tmpfs of its own where the worker may mount one).
    tmp_size_mb: int = 512
    #: bash and the file tools keep a container's default capabilities, bash sees root's
    #: secrets (False: no capability, and masked): for users who need the host's root, such as
    #: Inspect's local-provider view.
    keep_root: bool = False
    #: The pool's directory of write locks (workers.tools.atomic), out of every call's reach:
    #: the file tools' Landlock rules grant it, bash's never do. None: lock the directory.
    lock_dir: str | None = None
    #: A directory the call sees as its ``/`` (workers.view): the system read-only, the
    #: directories it holds read-write, nothing else of the host; the call's workspace and cwd
    #: are then paths inside it. Every tool, file tools included, is confined this way, and
    #: capless whatever ``keep_root`` says. None: the host's tree, as the rules above allow.
    view: str | None = None
    #: An allow-list (``network`` true then): a network namespace holding only loopback, whose
    #: one way out is the pool's proxy (workers.netns, sandbx_pool.proxy), which lets through
    #: these host patterns (sandbx_pool.allow_list) and nothing else. None: ``network`` alone.
    network_allow: tuple[str, ...] | None = None
    #: The proxy's unix socket, where the worker registers its call's listening socket.
    proxy_socket: str | None = None
    #: A network namespace to join instead of making one (``/proc/PID/ns/net`` of a session's
    #: service, sandbx_pool.services): the call reaches that service's ports on loopback.
    join_network: str | None = None
    #: With ``network`` false and a network namespace of the call's own (or joined): TCP on its
    #: loopback is allowed (Landlock's network rules are left out), so a service can listen
    #: and its session's calls connect. Where no namespace can be made the rules still apply.
    loopback: bool = False
    #: The view is a layer over a container image (workers.image_root): its root is the
    #: overlay of the image's layers, entered with nothing of the host's bound in and left
    #: writable (the layer takes the writes). With ``view`` only.
    image: bool = False
    #: The image config's User (``USER[:GROUP]``, names or numbers), looked up in the image's
    #: own /etc/passwd and /etc/group once entered (workers.image_user). "": uid 0. With
    #: ``image`` only.
    image_user: str = ""


class ExecutionContext(msgspec.Struct, frozen=True, kw_only=True):
    """Everything a call runs with. Each call gets its own: parallel calls never share one."""

    call_id: str
    workspace: str
    cwd: str
    env: dict[str, str]
    limits: Limits = Limits()
    max_output_bytes: int = 1024 * 1024
    sandbox: Sandbox = Sandbox()
    #: bash keeps this many bytes of each stream: the first half and the last half, the middle
    #: replaced by one line saying how much was omitted (``max_output_bytes`` is the flood kill).
    keep_output_bytes: int = 1024 * 1024
    #: The coordinator's SIGTERM grace (CallSettings.grace_s): a stopped bash call answers with
    #: the output it has before the SIGKILL that follows (workers.stopping).
    grace_s: float = 1.0
    #: The pool's own workspace. A call's ``workspace`` or view below it is reached from it one
    #: name at a time, never through a symlink an earlier call planted (workers.paths.reach).
    workspace_root: str | None = None
    #: Tracked and transactional mode: the call's own directory beside the journal, holding
    #: ``upper`` and ``work``; the worker mounts an overlay on the workspace with them
    #: (workers.overlay), so the call changes only ``upper``. None: the workspace itself.
    changes_dir: str | None = None
    #: Tracked mode: where no overlay can be mounted, list the workspace before and after the
    #: tool instead (workers.changes.listing) and answer with the difference.
    changes_scan: bool = False
    #: A call in a layer (sandbx_pool.layers): the layer's directory in the pool's layer store,
    #: holding ``upper`` and ``work``. The worker mounts an overlay, lower = ``layer_base``
    #: (read only), on the call's workspace (the layer's empty ``root``) before it confines
    #: itself (workers.overlay.enter_layer). None: not in a layer.
    layer_dir: str | None = None
    #: The layer's base, as recorded when it was made (its real path).
    layer_base: str | None = None
    #: Where the layer is mounted, on the host: a directory inside the call's view (an
    #: Inspect sample's working directory). None: on the workspace, the layer's root.
    layer_mount: str | None = None
    #: A shell session's call (sandbx_pool.sessions): the variables the session exported so
    #: far, applied by bash on top of ``env`` once the worker is confined (never used to build
    #: the confinement itself), and bash reports the state it leaves (``Result.session``).
    #: None: no session.
    session_env: dict[str, str] | None = None
    #: A layer over a container image (sandbx_pool.layers): the image's unpacked layers in the
    #: image store, bottom first, the overlay's lowers in place of ``layer_base`` (None then).
    layer_image: tuple[str, ...] | None = None


#: Most bytes of exported variables a shell session keeps (names and values, UTF-8); a call
#: that leaves more keeps the session's previous variables and says so (ShellState.note).
SESSION_ENV_BYTES = 256 * 1024


class ShellState(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What a session's bash call left (workers.tools.shell_state): ``cwd`` relative to the
    workspace (``"."``: its root), None when the shell did not say; ``env`` the variables it
    exported beyond the pool's environment, None when not kept; ``note`` why something was
    not kept as the shell left it."""

    cwd: str | None = None
    env: dict[str, str] | None = None
    note: str | None = None


#: The file a tracked call's worker makes in its ``changes_dir`` when it lists the workspace
#: instead of mounting an overlay (ExecutionContext.changes_scan).
CHANGES_LISTED = "listed"


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    """What one call's whole process tree (its worker included) cost: CPU seconds in user and
    kernel mode, the peak of its memory, the bytes it read from and wrote to storage (not the
    page cache), and how many processes it ran (None: not known here). ``source``: "cgroup"
    when the figures are the worker's cgroup's (memory is then what the tree held at once),
    "rusage" when they are the kernel's accounts of the reaped processes (memory is then the
    largest single process's peak). workers.usage measures it."""

    cpu_user_s: float
    cpu_system_s: float
    max_rss_bytes: int
    read_bytes: int
    write_bytes: int
    processes: int | None = None
    source: Literal["cgroup", "rusage"] = "rusage"


class ChangeReport(msgspec.Struct, frozen=True):
    """What a change set's apply did, path by path, written by its worker to a file in J.d
    (out of band: 60,000 paths are past what a Result may carry, and an answer the output
    limit cut would leave applied paths no outcome names): the change list as the outcome
    carries it, and the paths not applied because they are protected. An undo's: the paths
    it put back (``undone``), those it left because they are protected."""

    changes: list[dict[str, Any]]
    protected: list[str] = []
    undone: list[str] = []


change_report_decoder = msgspec.json.Decoder(ChangeReport)


class Message(msgspec.Struct, tag=True, kw_only=True):
    v: int = PROTOCOL_VERSION


# -- coordinator <-> worker ----------------------------------------------------------------


class Ready(Message, tag="ready"):
    """A freshly forked worker has connected and waits for its one call."""

    token: str


class Call(Message, tag="call"):
    tool: str
    args: dict[str, Any]
    context: ExecutionContext
    #: Made by the coordinator for this call only; the Result must carry it back. The worker
    #: keeps it in its own (non-dumpable) memory: never in the tool's environment or files.
    secret: str = ""
    #: Send the command's output as it comes (``Output`` messages), for a caller's on_output.
    stream_output: bool = False


class Result(Message, tag="result"):
    """The call is over. ``status`` is one of ok, error, denied, output_limit, or crashed (the
    tool was stopped in the middle by its CPU limit, which the worker caught: runtime.py)."""

    call_id: str
    status: str
    value: dict[str, Any] | None = None
    error: str | None = None
    limit: str | None = None
    secret: str = ""
    #: The errno name (``"ENOENT"``) behind an ``error``, when an OS error was its cause.
    error_code: str | None = None
    #: The worker answered after the coordinator's SIGTERM: ``value`` holds what the command
    #: printed until it was stopped, and the coordinator's kill decides the status.
    stopped: bool = False
    #: Tracked mode without an overlay (ExecutionContext.changes_scan): what the listings
    #: before and after the tool differ by, applied already.
    changes: list[dict[str, Any]] | None = None
    #: A session's bash call (ExecutionContext.session_env): the state its shell left.
    session: ShellState | None = None
    #: What the call cost, measured by the worker once what it started is reaped.
    usage: Usage | None = None


class Output(Message, tag="output"):
    """Output of a running command (Call.stream_output): ``data`` as it came, after
    ``dropped`` bytes of the same stream that a fast writer produced past the stream's
    bound (workers.streaming) and that were not sent."""

    call_id: str
    stream: Literal["stdout", "stderr"]
    data: str
    dropped: int = 0
    secret: str = ""


class ServiceInput(Message, tag="service_input"):
    """Bytes for a running service's stdin (or its terminal's input), after its Call; ``eof``
    closes its stdin once ``data`` is written (sandbx_pool.services, workers.tools.service)."""

    call_id: str
    data: bytes = b""
    eof: bool = False


class ServiceResize(Message, tag="service_resize"):
    """A service's terminal is now ``cols`` x ``rows`` (TIOCSWINSZ); ignored without one."""

    call_id: str
    cols: int
    rows: int


WorkerMessage = Ready | Result | Output
CoordinatorMessage = Call
#: What the coordinator may send a service's worker after its Call.
ServiceMessage = ServiceInput | ServiceResize


# -- coordinator <-> template ----------------------------------------------------------------


class Attach(Message, tag="attach"):
    """Where workers connect: the coordinator's first message (the template may be started
    before the pool's directories exist, sandbx_pool.template_launch). The template answers it
    with TemplateReady, once it knows how its workers will be contained."""

    endpoint: str
    #: ``[sandbox] user_namespaces``: whether a pool without CAP_SYS_ADMIN makes each worker in
    #: a user namespace of its own (workers.containment.UserNamespaces).
    user_namespaces: bool = True


class Spawn(Message, tag="spawn"):
    count: int


class Shutdown(Message, tag="shutdown"):
    pass


class PrebuildFileRules(Message, tag="prebuild_file_rules"):
    """Build the file tools' Landlock rules for this pool once (workers.rules)."""

    workspace: str
    sandbox: Sandbox


class Spawned(Message, tag="spawned"):
    token: str
    pid: int


class Exited(Message, tag="exited"):
    """A worker was reaped. ``returncode`` follows subprocess: negative means killed by -N."""

    pid: int
    returncode: int
    #: What the worker's tree cost, as the template found it when it reaped the worker: for a
    #: call killed before it could answer. ``memory_killed``: the kernel's OOM killer ended a
    #: process of it for the memory limit.
    usage: Usage | None = None
    memory_killed: bool = False


class SpawnFailed(Message, tag="spawn_failed"):
    """``count`` of the workers asked for were not forked: the kernel refused the fork
    (``error``) even after the template's backoff. The template goes on serving."""

    count: int
    error: str


class TemplateReady(Message, tag="template_ready"):
    pid: int
    containment: str
    #: Where the template keeps its workers' pids cgroups. None: the per-call process limit is
    #: not enforced, and ``process_limit_why`` says why, or (``process_limit_why`` None too) it
    #: is RLIMIT_NPROC in each worker's own user namespace.
    pids_cgroup: str | None = None
    process_limit_why: str | None = None
    #: Each worker is made in a user namespace of its own (containment "pidns" without root).
    user_namespaces: bool = False
    #: Where ``Limits.memory_bytes`` binds through a memory cgroup per worker (the pool's
    #: cgroup, with the v2 memory controller, or a pool of the v1 memory hierarchy); None:
    #: RLIMIT_DATA in each process instead, ``memory_limit_why`` says why.
    memory_cgroup: str | None = None
    memory_limit_why: str | None = None


ToTemplate = Attach | Spawn | Shutdown | PrebuildFileRules
FromTemplate = Spawned | Exited | SpawnFailed | TemplateReady

encoder = msgspec.msgpack.Encoder()
worker_decoder = msgspec.msgpack.Decoder(WorkerMessage)
call_decoder = msgspec.msgpack.Decoder(CoordinatorMessage)
service_decoder = msgspec.msgpack.Decoder(ServiceMessage)
to_template_decoder = msgspec.msgpack.Decoder(ToTemplate)
from_template_decoder = msgspec.msgpack.Decoder(FromTemplate)
