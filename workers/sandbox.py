"""What a call's commands can reach: the worker confines itself before its tool runs.

The tools run what a language model wrote, usually as root. The boundary is therefore the
kernel's, set up by the worker itself in two stages::

    fork --> prepare()      while idle, before Ready (off the call's clock): the part of the
    |                       Landlock ruleset that is the same for every call (all of it for a
    |                       file tool: the template's, see workers.rules)
    connect --> Ready --> Call
    |
    confine(call)           after the Call arrived (the connection is up), before the tool:
    |   TMPDIR *            a private directory for this call, set in bash's environment
    |   no_new_privs        nothing exec'd gains privileges (setuid bits, file capabilities)
    |   mounts *            a mount namespace of its own: a /proc that shows only the call's
    |                       processes, an empty mount over the coordinator's socket directory
    |   network = false *   a network namespace of its own
    |   capabilities *      programs exec'd get a container's default set: no ptrace, no
    |                       mount, no module loading, no device nodes
    |   run_as              setgroups, setgid, setuid
    |   non-dumpable        the worker's memory (the call's secret) is closed to its commands
    |   Landlock            filesystem rules, TCP rules, signal and abstract socket scoping
    v
    tool --> Result --> release(): remove TMPDIR

    * only for a tool that runs programs (bash): see confine()

The mount namespace is made per call, not while idle: a copy of the mount table taken before
the call would hide whatever was mounted since (the NFS share, the FUSE mount the call is about).

Each step applies where the machine permits it and is skipped where it does not
(``sandbx-pool doctor`` shows which); ``network = false`` alone refuses the call when nothing
can enforce it, since the caller asked for it explicitly.

Landlock restricts only the calling thread and what it starts afterwards (a worker has no
other thread), and descriptors opened before keep their access: the worker's connection to
the coordinator, made before, keeps working, and bash, forked from this thread, is confined
with everything it starts. A confined process can neither ptrace nor signal a process outside
its domain.
"""

from __future__ import annotations

import contextlib
import errno
import os

import msgspec

from sandbx_pool.workers import _libc, landlock
from sandbx_pool.workers.containment import in_own_pid_namespace
from sandbx_pool.workers.errors import ToolError
from sandbx_pool.workers.protocol import Call, ExecutionContext, Sandbox
from sandbx_pool.workers.rules import (
    PROC,
    READ,
    SCOPES,
    WRITE,
    FileRules,
    add_file_rules,
    add_lock_rule,
    fixed_ruleset,
    preload,
    within,
)

#: Capabilities that programs exec'd by a root worker keep: Docker's default set without MKNOD
#: (a device node in the workspace would be a door around the filesystem rules), so no
#: SYS_PTRACE, SYS_ADMIN, SYS_MODULE, NET_ADMIN... NET_RAW (13) only while the network is on.
_KEPT_CAPS = frozenset({0, 1, 3, 4, 5, 6, 7, 8, 10, 18, 29, 31})
_CAP_NET_RAW = 13


class SandboxError(ToolError):
    """The call cannot be confined as configured: it is refused (status ``error``)."""


class Prepared:
    """What ``prepare`` did while idle: the capability count, and either the file tools'
    complete ruleset (inherited from the template) or a ruleset holding the fixed rules."""

    def __init__(
        self,
        ruleset: landlock.Ruleset | None,
        last_cap: int,
        file_rules: FileRules | None = None,
    ) -> None:
        self.ruleset = ruleset
        self.last_cap = last_cap
        self.file_rules = file_rules


class Confinement:
    """The call as its tool must see it (TMPDIR in its environment), and what to undo after."""

    def __init__(self, call: Call, tmpdir: str | None) -> None:
        self.call = call
        self.tmpdir = tmpdir

    def release(self) -> None:
        """Remove the call's TMPDIR (what a killed worker leaves, the pool removes on close)."""
        if self.tmpdir is not None:
            remove_tree(self.tmpdir)


def prepare(file_rules: FileRules | None = None) -> Prepared:
    """Build what every call's confinement shares, so that the call does not wait for it.

    With ``file_rules`` (the template's, workers.rules) a file tool's domain is ready as it
    is, and no ruleset is built here: bash, whose rules depend on its call (TMPDIR, PATH,
    /proc), builds its own from the fixed rules when it comes.
    """
    preloaded = preload()
    rehearse()
    if landlock.abi_version() == 0:
        return Prepared(None, preloaded.last_cap)
    if file_rules is not None:
        return Prepared(None, preloaded.last_cap, file_rules)
    try:
        ruleset = fixed_ruleset()
    except OSError:
        return Prepared(None, preloaded.last_cap)  # confine() tries again, reports the failure
    return Prepared(ruleset, preloaded.last_cap)


def rehearse() -> None:
    """Walk confine()'s Python paths with no effect, so that their first-use costs (ctypes
    conversions, copy-on-write faults on the template's pages) are paid while idle; the
    template rehearses too, before forking (workers.runtime.rehearse_call says why)."""
    ctx = ExecutionContext(call_id="", workspace="/", cwd="/", env={"PATH": os.defpath})
    msgspec.structs.replace(ctx, env={**ctx.env, "TMPDIR": os.urandom(8).hex()})
    within("/", _readable(ctx))
    _libc.try_prctl(
        _libc.PR_CAPBSET_READ, 0
    )  # one call warms the path; the loop itself costs nothing more
    _libc.try_prctl(_libc.PR_GET_NO_NEW_PRIVS, 0)
    os.path.realpath("/")
    rule = landlock.PathBeneath.open("/", WRITE)
    if rule is not None:
        rule.close()


def confine(call: Call, prepared: Prepared, *, runs_programs: bool) -> Confinement:
    """Restrict this process, and everything it starts, for ``call``. Irreversible.

    ``runs_programs`` (bash) gets every step. A file tool runs only our own code, which checks
    each path it opens (workers.paths), starts nothing and opens no socket, so the steps that
    only bound what an exec'd program can do (TMPDIR, the mount namespace, the network, the
    capability bounding set) would cost it a millisecond of a call for nothing: it gets
    no_new_privs, run_as, non-dumpable and the Landlock filesystem rules, a second line behind
    its own checks.

    Raises SandboxError when the configuration asks for something this machine cannot enforce
    or a step fails; the tool must then not run.
    """
    ctx = call.context
    box = ctx.sandbox
    tmpdir = _make_tmpdir(box, ctx.call_id) if runs_programs else None
    try:
        if tmpdir is not None:
            env = {**ctx.env, "TMPDIR": tmpdir}
            home = env.get("HOME")
            if box.filesystem == "workspace" and home and not within(home, _readable(ctx)):
                # A HOME the rules make unreadable breaks tools that treat EACCES on their
                # config as fatal (git does); an empty, private one they handle.
                env["HOME"] = tmpdir
            call = msgspec.structs.replace(call, context=msgspec.structs.replace(ctx, env=env))
        _libc.prctl(_libc.PR_SET_NO_NEW_PRIVS, 1, what="prctl(PR_SET_NO_NEW_PRIVS)")
        network_namespace = False
        if runs_programs:
            _private_mounts(box.hidden, [ctx.workspace, ctx.cwd, tmpdir, *box.writable])
            network_namespace = not box.network and _libc.try_unshare(_libc.CLONE_NEWNET) == 0
        rulesets = _rulesets(call.context, tmpdir, prepared, network_namespace, runs_programs)
        if runs_programs:
            _drop_capabilities(prepared.last_cap, keep_net_raw=box.network)
        if box.uid is not None:
            os.setgroups(list(box.groups))
            os.setgid(box.gid if box.gid is not None else box.uid)
            os.setuid(box.uid)
        # After setuid, which resets it. Same-user processes lacking CAP_SYS_PTRACE (bash, once
        # the bounding set is dropped) may then neither ptrace us nor open /proc/<us>/mem.
        _libc.prctl(_libc.PR_SET_DUMPABLE, 0, what="prctl(PR_SET_DUMPABLE)")
        for ruleset in rulesets:
            ruleset.restrict_self()
    except (OSError, SandboxError) as exc:
        if tmpdir is not None:
            remove_tree(tmpdir)
        if isinstance(exc, SandboxError):
            raise
        raise SandboxError(f"cannot confine the call: {exc}") from exc
    return Confinement(call, tmpdir)


# -- the steps ---------------------------------------------------------------------------------


_DIRECTORY_ONLY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def remove_tree(path: str) -> None:
    """``shutil.rmtree(path, ignore_errors=True)``, descriptor-based like it: a symlink the call
    left is removed, never followed. Not shutil itself: importing it loads zlib, bz2 and lzma
    into the template, and every worker pays for their pages."""
    try:
        fd = os.open(path, _DIRECTORY_ONLY)
    except OSError:
        return
    try:
        _remove_contents(fd)
    finally:
        os.close(fd)
    with contextlib.suppress(OSError):
        os.rmdir(path)


def _remove_contents(dir_fd: int) -> None:
    children: list[tuple[str, bool]] = []
    with contextlib.suppress(OSError), os.scandir(dir_fd) as entries:
        children = [(entry.name, entry.is_dir(follow_symlinks=False)) for entry in entries]
    for name, is_dir in children:
        with contextlib.suppress(OSError):
            if not is_dir:
                os.unlink(name, dir_fd=dir_fd)
                continue
            fd = os.open(name, _DIRECTORY_ONLY, dir_fd=dir_fd)
            try:
                _remove_contents(fd)
            finally:
                os.close(fd)
            os.rmdir(name, dir_fd=dir_fd)


def _make_tmpdir(box: Sandbox, call_id: str) -> str | None:
    if box.tmp_root is None:
        return None
    safe_id = "".join(c if c.isalnum() or c in "-_." else "_" for c in call_id)[:64]
    # A random part, so that a call cannot guess (and remove) another call's TMPDIR.
    path = os.path.join(box.tmp_root, f"{safe_id}-{os.urandom(8).hex()}")
    try:
        os.mkdir(path, 0o700)
        if box.uid is not None:
            os.chown(path, box.uid, box.gid if box.gid is not None else box.uid)
    except OSError as exc:
        raise SandboxError(f"cannot make the call's TMPDIR in {box.tmp_root}: {exc}") from exc
    return path


def _private_mounts(hidden: tuple[str, ...], needed: list[str | None]) -> None:
    """A mount namespace of our own, with a private /proc and the hidden directories covered.

    The host's /proc shows every process, and a root command may read a same-user process's
    /proc/PID/environ even from a Landlock domain (Landlock refuses /proc/PID/mem outside the
    domain, not that): the coordinator's environment is where API keys live. Landlock (up to
    ABI 7) does not mediate connect() on a unix socket path either, so the coordinator's socket
    directory must be out of the namespace, not just out of the rules. Our own ZeroMQ connection
    is up already and does not go through the path again. Skipped where not permitted.
    """
    if _libc.try_unshare(_libc.CLONE_NEWNS) != 0:
        return  # not root: the doctor reports it
    try:
        # Slave, recursively, first: nothing mounted here may propagate back to the host.
        _libc.mount("none", "/", None, _libc.MS_REC | _libc.MS_SLAVE, None)
    except OSError:
        return  # so we mount nothing at all
    flags = _libc.MS_NOSUID | _libc.MS_NODEV | _libc.MS_NOEXEC
    if in_own_pid_namespace():
        # Refused in some containers (a masked /proc): the host's /proc it is, then.
        with contextlib.suppress(OSError):
            _libc.mount("proc", "/proc", "proc", flags, None)
    for path in hidden:
        real = os.path.realpath(path)
        if not os.path.isdir(real) or any(n and within(n, [real]) for n in needed):
            continue  # never hide what the call must use
        with contextlib.suppress(OSError):  # the secret and the pid check still hold
            _libc.mount("sandbx-hidden", real, "tmpfs", flags | _libc.MS_RDONLY, "size=4k,mode=000")


def _drop_capabilities(last_cap: int, *, keep_net_raw: bool) -> None:
    """Shrink the bounding set: what exec'd programs can ever hold. Ours are unchanged."""
    kept = _KEPT_CAPS | ({_CAP_NET_RAW} if keep_net_raw else set())
    for cap in range(last_cap + 1):
        if cap not in kept and (code := _libc.try_prctl(_libc.PR_CAPBSET_DROP, cap)) != 0:
            if code == errno.EPERM:  # no CAP_SETPCAP, so not root: nothing to drop
                return
            raise OSError(code, f"prctl(PR_CAPBSET_DROP): {os.strerror(code)}")


def _program_dirs(env: dict[str, str]) -> list[str]:
    """The PATH's directories, each with its installation root when it is a bin or shims
    directory (pyenv's shims run ``$PYENV_ROOT/libexec``), except / and HOME themselves."""
    home = env.get("HOME", "").rstrip("/")
    dirs = []
    for entry in env.get("PATH", "").split(":"):
        if not entry.startswith("/"):
            continue  # a relative PATH entry means the cwd, which is the workspace
        entry = entry.rstrip("/") or "/"
        dirs.append(entry)
        parent = os.path.dirname(entry)
        if os.path.basename(entry) in ("bin", "shims") and parent not in ("/", home):
            dirs.append(parent)
    return dirs


def _readable(ctx: ExecutionContext) -> list[str]:
    """What a call may read, as the caller spelled it (to tell whether HOME is among it)."""
    box = ctx.sandbox
    return [ctx.workspace, *box.writable, *box.read_only, *_program_dirs(ctx.env)]


def _rulesets(
    ctx: ExecutionContext,
    tmpdir: str | None,
    prepared: Prepared,
    network_namespace: bool,
    runs_programs: bool,
) -> list[landlock.Ruleset]:
    """The Landlock domains to enter, rules added; none where Landlock is absent."""
    box = ctx.sandbox
    abi = landlock.abi_version()
    offline = not box.network and runs_programs  # a file tool opens no socket
    if offline and not network_namespace and not landlock.has_net_rules(abi):
        raise SandboxError(
            "network = false cannot be enforced here: no Landlock network rules "
            f"(ABI {abi}, need 4) and no network namespace (unshare refused)"
        )
    if abi == 0:
        return []  # the file tools' own path checks are all that is left (see the doctor)
    rulesets = []
    file_rules, prepared.file_rules = prepared.file_rules, None
    if not runs_programs and file_rules is not None and file_rules.fits(ctx):
        # The template's complete ruleset, entered as it is: the fixed rules' descriptors
        # are not needed.
        preload().drop_rules()
        rulesets.append(file_rules.take())
    elif box.filesystem == "workspace":
        ruleset = prepared.ruleset or fixed_ruleset()
        prepared.ruleset = None
        rulesets.append(ruleset)
        if runs_programs:
            roots = preload().read_only_roots
            for path in dict.fromkeys(_program_dirs(ctx.env)):
                if not within(path, roots):  # /usr/bin is granted with /usr already
                    ruleset.allow_path(path, READ)
            ruleset.allow_path("/proc", PROC)  # after the mounts: the private /proc, if any
        add_file_rules(ruleset, ctx.workspace, box)
        if not runs_programs:
            add_lock_rule(ruleset, box)
        if tmpdir is not None:
            ruleset.allow_path(tmpdir, WRITE)
            if box.tmp_root is not None:
                # Only to remove the TMPDIR itself at the end; the root is not listable.
                ruleset.allow_path(box.tmp_root, landlock.REMOVE_DIR)
    else:
        preload().drop_rules()
        # No filesystem rules, but a domain still (for the ptrace and scope rules): it handles
        # device-node creation, which nobody is granted.
        handled = landlock.MAKE_CHAR | landlock.MAKE_BLOCK
        rulesets.append(landlock.Ruleset(handled_fs=handled, scoped=SCOPES))
    # What was prepared and not used: descriptors that would count against the call's limit.
    if prepared.ruleset is not None:
        prepared.ruleset.close()
        prepared.ruleset = None
    if file_rules is not None:
        file_rules.close()  # nothing left to close once taken
    if offline and landlock.has_net_rules(abi):
        # A domain of its own, stacked: the fixed rules above were built before we knew.
        handled_net = landlock.NET_BIND_TCP | landlock.NET_CONNECT_TCP
        rulesets.append(landlock.Ruleset(handled_net=handled_net))
    return rulesets


__all__ = ["Confinement", "Prepared", "SandboxError", "confine", "prepare"]
