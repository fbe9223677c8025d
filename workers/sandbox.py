"""What a call's commands can reach: the worker confines itself before its tool runs.

The tools run what a language model wrote, usually as root. The boundary is therefore the
kernel's, set up by the worker itself in two stages::

    fork --> prepare()      while idle, before Ready (off the call's clock): the part of the
    |                       Landlock ruleset that is the same for every call (all of it for a
    |                       file tool: the template's, see workers.rules), and the bounding set
    |                       narrowed to what keep_root keeps
    connect --> Ready --> Call
    |
    confine(call)           after the Call arrived (the connection is up), before the tool:
    |   no_new_privs        nothing exec'd gains privileges (setuid bits, file capabilities)
    |   mounts *            a mount namespace of its own: a /proc that shows only the call's
    |                       processes, an empty mount over the coordinator's socket directory,
    |                       root's secrets masked and kernel files read-only (workers.lockdown),
    |                       a private /dev/shm, the TMPDIRs' parent a tmpfs of the call's own,
    |                       the protected paths read-only (workers.protected)
    |   TMPDIR *            a private directory for this call, set in bash's environment
    |   IPC namespace *     SysV and POSIX IPC objects of its own
    |   network = false *   a network namespace of its own
    |   network = [hosts] * one whose only way out is the pool's proxy (workers.netns); made
    |                       first, while the proxy's socket is still in reach of the worker
    |   bounding set *      emptied, securebits locked: nothing exec'd gains a capability
    |   run_as              setgroups, setgid, setuid (a file tool's ``user`` too)
    |   capabilities *      the worker's own emptied too (workers.lockdown): a file tool is
    |                       held to file modes as bash is (keep_root: a container's set, both;
    |                       in a user namespace of its own, a pool without root, never kept)
    |   non-dumpable        the worker's memory (the call's secret) is closed to its commands
    |   Landlock            filesystem rules, TCP rules, signal and abstract socket scoping;
    |                       where no mount masks root's secrets, a layer that leaves them out
    |   seccomp *           the system calls past a capless uid 0 (workers.seccomp)
    v
    tool --> Result --> release(): remove TMPDIR (a tmpfs goes with the namespace anyway)

    * only for a tool that runs programs (bash): see confine()

The mount namespace is entered per call, not while idle: a copy of the mount table taken before
the call would hide whatever was mounted since (the NFS share, the FUSE mount the call is about).
What every call's namespace shares (root's secrets masked, /sys read-only) a root pool's template
prepares once; the call joins a copy of it when it comes, unless the host's mount table or the
masked directories changed since (workers.prepared_mounts), and makes only its own mounts.

A pool without root makes each worker in a user namespace of its own where the kernel allows
(workers.containment.UserNamespaces): the worker then holds the capabilities every step needs,
over its own namespaces, and takes them all, as a root worker does; what needs root itself
(run_as, masks over what the pool's user cannot open anyway) is left out.

Each step applies where the machine permits it and is skipped where it does not
(``sandbx-pool doctor`` shows which); ``network = false`` and an allow-list refuse the call
when nothing can enforce them, since the caller asked for them explicitly (an allow-list needs
a network namespace, and a mount namespace to hide the proxy's socket: never run online).

Landlock restricts only the calling thread and what it starts afterwards (a worker has no
other thread), and descriptors opened before keep their access: the worker's connection to
the coordinator, made before, keeps working, and bash, forked from this thread, is confined
with everything it starts. A confined process can neither ptrace nor signal a process outside
its domain.
"""

from __future__ import annotations

import contextlib
import os

import msgspec

from sandbx_pool.workers import (
    image_root,
    image_user,
    landlock,
    lockdown,
    netns,
    paths,
    prepared_mounts,
    protected,
    seccomp,
    users,
    view,
)
from sandbx_pool.workers import (
    libc as _libc,
)
from sandbx_pool.workers.containment import in_own_pid_namespace, in_own_user_namespace
from sandbx_pool.workers.errors import Denied, ToolError
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
from sandbx_pool.workers.schemas import CHANGE_ACTIONS, FOLLOW_NO_SYMLINKS


class SandboxError(ToolError):
    """The call cannot be confined as configured: it is refused (status ``error``)."""


class Prepared:
    """What ``prepare`` did while idle: the capability count, what is left in the bounding set
    (None: everything, not root), and either the file tools' complete ruleset (inherited from
    the template) or a ruleset holding the fixed rules."""

    def __init__(
        self,
        ruleset: landlock.Ruleset | None,
        last_cap: int,
        file_rules: FileRules | None = None,
        bounding: frozenset[int] | None = None,
    ) -> None:
        self.ruleset = ruleset
        self.last_cap = last_cap
        self.file_rules = file_rules
        self.bounding = bounding


class Confinement:
    """The call as its tool must see it (TMPDIR in its environment), and what to undo after."""

    def __init__(self, call: Call, tmpdir: str | None, link: netns.Link | None = None) -> None:
        self.call = call
        self.tmpdir = tmpdir
        #: The call's registration with the pool's proxy (an allow-list), else None.
        self.link = link

    def network_denied(self) -> list[str] | None:
        """The hosts the proxy refused this call; None without an allow-list."""
        return None if self.link is None else self.link.denied()

    def release(self) -> None:
        """Remove the call's TMPDIR (what a killed worker leaves, the pool removes on close)."""
        if self.link is not None:
            self.link.close()
        if self.tmpdir is not None:
            remove_tree(self.tmpdir)


def prepare(file_rules: FileRules | None = None, *, with_rehearsal: bool = True) -> Prepared:
    """Build what every call's confinement shares, so that the call does not wait for it.

    With ``file_rules`` (the template's, workers.rules) a file tool's domain is ready as it
    is, and no ruleset is built here: bash, whose rules depend on its call (TMPDIR, PATH,
    /proc), builds its own from the fixed rules when it comes.
    """
    preloaded = preload()
    if with_rehearsal:
        rehearse()
    # The part of every call's capability drop that does not depend on the call: 29 of the
    # bounding set's 41 drops off the call's clock (see lockdown.narrow_bounding_set).
    bounding = lockdown.narrow_bounding_set(preloaded.last_cap)
    if landlock.abi_version() == 0:
        return Prepared(None, preloaded.last_cap, bounding=bounding)
    if file_rules is not None:
        return Prepared(None, preloaded.last_cap, file_rules, bounding)
    try:
        ruleset = fixed_ruleset()
    except OSError:
        # confine() tries again, and reports the failure
        return Prepared(None, preloaded.last_cap, bounding=bounding)
    return Prepared(ruleset, preloaded.last_cap, bounding=bounding)


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
    _libc.cap_data(0)
    os.path.realpath("/")
    rule = landlock.PathBeneath.open("/", WRITE)
    if rule is not None:
        rule.close()
    preload().holds_secrets("/")
    preload().secrets_layer_fresh()


def confine(call: Call, prepared: Prepared, *, runs_programs: bool) -> Confinement:
    """Restrict this process, and everything it starts, for ``call``. Irreversible.

    ``runs_programs`` (bash) gets every step. A file tool runs only our own code, which checks
    each path it opens (workers.paths), starts nothing and opens no socket, so the steps that
    only bound what an exec'd program can do (TMPDIR, the mount namespace, the network,
    seccomp) would cost it a millisecond of a call for nothing: it gets no_new_privs, run_as,
    non-dumpable, the Landlock filesystem rules (a second line behind its own checks) and the
    capability drop, so that it never reads or writes what the same call's command could not
    (a mode-000 file, another uid's read-only directory). That drop costs a file tool about
    0.13 ms of CPU (measured in a forked worker; the bounding set mostly dropped while idle).

    Raises SandboxError when the configuration asks for something this machine cannot enforce
    or a step fails; the tool must then not run.
    """
    ctx = call.context
    box = ctx.sandbox
    tmpdir: str | None = None
    owner = _tmp_owner(box, call.args)
    # A view's calls are capless whatever keep_root says: the view is there to hold them. So
    # are a user namespace's: there is no root there to keep, only the namespace's capabilities.
    own_user_namespace = in_own_user_namespace()
    keep_root = box.keep_root and box.view is None and not own_user_namespace
    link: netns.Link | None = None
    try:
        _libc.prctl(_libc.PR_SET_NO_NEW_PRIVS, 1, what="prctl(PR_SET_NO_NEW_PRIVS)")
        network_namespace = private = False
        if runs_programs and box.network_allow is not None:
            # Before the mounts: they cover the runtime directory the proxy's socket is in.
            try:
                link = netns.enter(box.proxy_socket, box.network_allow, ctx.call_id)
            except netns.NetworkUnavailable as exc:
                raise SandboxError(str(exc)) from None
            network_namespace = True
        elif runs_programs and box.join_network is not None:
            # Before the mounts: the private /proc no longer shows the service's worker.
            _join_network(box.join_network)
            network_namespace = True
        # A folder of the pool's workspace, reached without a symlink: what the rules (or the
        # view) are then checked to have been built on, whatever a parallel call swaps meanwhile.
        anchor = paths.reach(ctx.workspace_root, box.view or ctx.workspace)
        image_identity: image_user.ImageUser | None = None
        if box.view is not None:
            image_identity = _enter_view(box, owner, anchor)
        if runs_programs:
            private = box.view is not None or _private_mounts(
                box,
                ctx,
                owner,
                [ctx.workspace, ctx.cwd, *box.writable],
                no_symlinks=call.tool in FOLLOW_NO_SYMLINKS,
            )
            tmpdir = None if box.view is not None else _make_tmpdir(box, ctx.call_id, owner)
            env = {**ctx.env, "TMPDIR": tmpdir} if tmpdir is not None else dict(ctx.env)
            if link is not None:
                if not private:
                    # Without it the call could reach the proxy's socket and register a
                    # listener of its own, with any list: refused, never run online.
                    raise SandboxError(
                        "network = [allow-list] needs a mount namespace of the call's own"
                        " (to hide the proxy's socket), and none could be made"
                    )
                env.update(link.env())
            if box.view is not None:
                env.setdefault("TMPDIR", "/tmp")  # the view's own
            if image_identity is not None:
                env.setdefault("HOME", image_identity.home)  # the image's User's, as docker sets it
            home = env.get("HOME")
            if (
                tmpdir
                and box.filesystem == "workspace"
                and home
                and not within(home, _readable(ctx))
            ):
                # A HOME the rules make unreadable breaks tools that treat EACCES on their
                # config as fatal (git does); an empty, private one they handle.
                env["HOME"] = tmpdir
            call = msgspec.structs.replace(call, context=msgspec.structs.replace(ctx, env=env))
            if private:
                lockdown.new_ipc_namespace()
            if link is None and box.join_network is None:
                network_namespace = not box.network and _libc.try_unshare(_libc.CLONE_NEWNET) == 0
                if network_namespace and box.loopback:
                    netns.loopback_up()  # a new namespace's is down: nothing could connect
        # Every tool, file tools included: a file tool of a root pool is held to file modes as
        # bash is (a capless uid 0 cannot read a file chmod'ed 000), never more powerful than
        # the command the same call could run.
        if keep_root:
            lockdown.shrink_bounding_set(
                prepared.last_cap, lockdown.CONTAINER_CAPS, held=prepared.bounding
            )
        else:
            lockdown.lock_out_root(prepared.last_cap, held=prepared.bounding)
        # The rules open their paths while the worker still holds its capabilities.
        rulesets = _rulesets(
            call.context, tmpdir, prepared, network_namespace, runs_programs, anchor
        )
        # Root's secrets, where no mount of the call's covers them: a Landlock layer of their
        # own leaves them unreadable (workers.rules.SecretsLayer). keep_root reads them, as it
        # does where the masks would apply. A file tool has no mount namespace (but in a view,
        # whose tree is its own, masked) and reaches only its workspace (workers.paths): it
        # takes the layer where bash cannot mask, or when its workspace holds a secret (/).
        preloaded = preload()
        if runs_programs:
            unmasked = not private and not keep_root
        else:
            # A change set's apply or undo (CHANGE_ACTIONS) reads and writes the workspace for
            # the coordinator, with J.d writable: it takes the layer always, so that nothing
            # of root's secrets could ever be copied into J.d, whatever a path leads to.
            unmasked = box.view is None and (
                not preloaded.can_mask
                or call.tool in CHANGE_ACTIONS
                or preloaded.holds_secrets(paths.real_workspace(ctx.workspace))
            )
        layer = preloaded.take_secrets_layer() if rulesets and unmasked else None
        if layer is None:
            preloaded.drop_secrets_layer()
        else:
            rulesets.append(layer)
        if image_identity is not None and os.geteuid() == 0:
            # A root pool: the image's User, with the image's file owners holding against it
            # (a pool without root was mapped to it on entering the image: image_root.become).
            who = image_identity
            _switch_user((who.uid, who.gid, who.groups))
        elif box.uid is not None:
            os.setgroups(list(box.groups))
            os.setgid(box.gid if box.gid is not None else box.uid)
            os.setuid(box.uid)
        elif owner is not None and not runs_programs:
            # A file tool's `user` (read's, write's): the worker itself becomes them, here,
            # while it may; the tool's own switch then finds nothing left to do.
            _switch_user(owner)
        if not runs_programs:
            # After the switch: with securebits locked a setuid keeps the capabilities, and
            # without them (keep_root) it clears them, so a switched worker holds nothing.
            lockdown.keep_only(lockdown.CONTAINER_CAPS if keep_root else frozenset())
        elif not keep_root:
            # bash's `user` switches in the command's child, after the fork: the worker keeps
            # CAP_SETUID and CAP_SETGID for it (the bounding set is empty, so the command,
            # exec'd as that user, holds nothing).
            switches = owner is not None and box.uid is None and owner[0] != os.getuid()
            lockdown.drop_all_capabilities(keep_user_switch=switches)
        # After setuid, which resets it. Same-user processes (bash, capless) may then neither
        # ptrace us nor open /proc/<us>/mem.
        _libc.prctl(_libc.PR_SET_DUMPABLE, 0, what="prctl(PR_SET_DUMPABLE)")
        for ruleset in rulesets:
            ruleset.restrict_self()
        if runs_programs and seccomp.supported():
            # Without an IPC namespace of its own, SysV IPC would reach the host's objects.
            # An allow-list's call needs TCP to its loopback alone: network = false's families.
            offline = not box.network or link is not None
            seccomp.install(offline=offline, shared_ipc=not private)
    except (OSError, SandboxError, Denied) as exc:
        if link is not None:
            link.close()
        if tmpdir is not None:
            remove_tree(tmpdir)
        if isinstance(exc, SandboxError):
            raise
        if isinstance(exc, Denied):
            raise SandboxError(f"not confined: {exc}") from exc
        raise SandboxError(f"cannot confine the call: {exc}") from exc
    finally:
        # A file tool's, or one that did not need them: descriptors the call must not hold.
        prepared_mounts.drop()
    return Confinement(call, tmpdir, link)


# -- the steps ---------------------------------------------------------------------------------


def _join_network(path: str) -> None:
    """Enter the network namespace at ``path`` (a session's service's: sandbx_pool.services),
    or refuse the call: run in a namespace of its own it would not reach the service, and run
    in the host's it would be online."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise SandboxError(
            f"cannot join the session's service network ({path}): {exc.strerror or exc}"
        ) from None
    try:
        _libc.setns(fd, _libc.CLONE_NEWNET, what="setns(the session's service network)")
    except OSError as exc:
        raise SandboxError(
            f"cannot join the session's service network: {exc.strerror or exc} (it takes a"
            " pool with root: workers in user namespaces of their own cannot enter another's)"
        ) from None
    finally:
        os.close(fd)


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


def _make_tmpdir(box: Sandbox, call_id: str, owner: Identity | None) -> str | None:
    if box.tmp_root is None:
        return None
    safe_id = "".join(c if c.isalnum() or c in "-_." else "_" for c in call_id)[:64]
    # A random part, so that a call cannot guess (and remove) another call's TMPDIR.
    path = os.path.join(box.tmp_root, f"{safe_id}-{os.urandom(8).hex()}")
    try:
        os.mkdir(path, 0o700)
        if owner is not None:
            os.chown(path, owner[0], owner[1])
    except OSError as exc:
        raise SandboxError(f"cannot make the call's TMPDIR in {box.tmp_root}: {exc}") from exc
    return path


Identity = tuple[int, int, tuple[int, ...]]  # uid, gid, supplementary groups


def _switch_user(identity: Identity) -> None:
    """Groups, then gid, then uid, unless already them (workers.users.become, for an identity
    looked up already: a pool not root may name its own user)."""
    uid, gid, groups = identity
    if (os.getuid(), os.getgid()) == (uid, gid):
        return
    os.setgroups(list(groups))
    os.setgid(gid)
    os.setuid(uid)


def _tmp_owner(box: Sandbox, args: object) -> Identity | None:
    """Who the call's TMPDIR belongs to: bash's ``user``, else ``run_as``, else None (us).

    Given to it here, while the worker may still chown: the command holds no capability.
    """
    name = args.get("user") if isinstance(args, dict) else None
    if isinstance(name, str | int) and not isinstance(name, bool):
        try:
            user = users.lookup(str(name))
        except ToolError as exc:
            raise SandboxError(str(exc)) from None
        return user.uid, user.gid, tuple(user.groups)
    if box.uid is None:
        return None
    return box.uid, box.gid if box.gid is not None else box.uid, box.groups


def _private_mounts(
    box: Sandbox,
    ctx: ExecutionContext | None,
    owner: Identity | None,
    needed: list[str],
    *,
    no_symlinks: bool = False,
) -> bool:
    """A mount namespace of our own: a private /proc, the hidden directories covered, root's
    secrets masked and the kernel's files read-only (workers.lockdown), a private /dev/shm, the
    call's TMPDIR on a tmpfs of its own, and the protected paths read-only. False where not
    permitted (not root): the doctor reports it, and the call runs without them.

    The host's /proc shows every process, and a root command may read a same-user process's
    /proc/PID/environ even from a Landlock domain (Landlock refuses /proc/PID/mem outside the
    domain, not that): the coordinator's environment is where API keys live. Landlock (up to
    ABI 7) does not mediate connect() on a unix socket path either, so the coordinator's socket
    directory must be out of the namespace, not just out of the rules. Our own ZeroMQ connection
    is up already and does not go through the path again.

    The TMPDIRs' parent (``tmp_root``, the pool's scratch directory) gets a tmpfs of this call's
    own, of ``tmp_size_mb``: the call sees no other call's TMPDIR (nor they its), cannot fill
    the disk the journal is on, and leaves nothing behind when its namespace goes.
    """
    masks_secrets = not box.keep_root or box.view is not None
    # The pool's prepared mounts (workers.prepared_mounts), when fresh and they fit: a copy of
    # its namespace, with root's secrets masked and /sys read-only already.
    prepared = masks_secrets and prepared_mounts.enter()
    if not prepared:
        if _libc.try_unshare(_libc.CLONE_NEWNS) != 0:
            return False
        try:
            # Slave, recursively, first: nothing mounted here may propagate back to the host.
            _libc.mount("none", "/", None, _libc.MS_REC | _libc.MS_SLAVE, None)
        except OSError:
            return False  # so we mount nothing at all
    flags = _libc.MS_NOSUID | _libc.MS_NODEV | _libc.MS_NOEXEC
    if in_own_pid_namespace():
        # Refused in some containers (a masked /proc): the host's /proc it is, then.
        with contextlib.suppress(OSError):
            _libc.mount("proc", "/proc", "proc", flags, None)
    hidden_files = []  # the journal and its lock (which may lie in the workspace)
    for path in box.hidden:
        real = os.path.realpath(path)
        if not os.path.isdir(real):
            hidden_files.append(real)
            continue
        if any(n and within(n, [real]) for n in needed):
            continue  # never hide what the call must use
        with contextlib.suppress(OSError):  # the secret and the pid check still hold
            _libc.mount("sandbx-hidden", real, "tmpfs", flags | _libc.MS_RDONLY, "size=4k,mode=000")
    scratch = box.tmp_root if box.tmp_root and os.path.isdir(box.tmp_root) else "/tmp"
    if prepared:
        if hidden_files:
            lockdown.mask(scratch, hidden_files)
        # On the call's own /proc, which covers whatever was made on the template's.
        lockdown.read_only_kernel_files(prepared_mounts.PER_CALL_READ_ONLY)
        lockdown.private_dev_shm()  # writable: the call's own, never the prepared one's
    else:
        if masks_secrets:
            lockdown.mask_secrets(scratch, also=hidden_files)
        elif hidden_files:
            lockdown.mask(scratch, hidden_files)
        lockdown.read_only_kernel_files()
        lockdown.private_dev_shm()
    if ctx is None:
        return True  # a view: no TMPDIR (its /tmp is its own), its workspace is its own
    if box.tmp_root is not None and os.path.isdir(box.tmp_root):
        uid, gid = owner[:2] if owner is not None else (os.getuid(), os.getgid())
        options = f"size={box.tmp_size_mb}m,mode=0700,uid={uid},gid={gid}"
        _libc.mount("sandbx-tmp", box.tmp_root, "tmpfs", _libc.MS_NOSUID | _libc.MS_NODEV, options)
    protected.protect(ctx.workspace, box.protected)
    protected.pin_directories_above(ctx.workspace, hidden_files)
    if no_symlinks:
        _follow_no_symlinks(ctx.workspace)
    return True


def enter_prepared_mounts(call: Call) -> None:
    """Before a layer's or a change set's overlay is mounted, for a call that runs programs:
    into a copy of the pool's prepared mounts (workers.prepared_mounts), which the overlay's
    namespace then copies, so that its confinement does not mask root's secrets again."""
    box = call.context.sandbox
    if box.view is None and not box.keep_root:
        prepared_mounts.enter()


def _enter_view(
    box: Sandbox, owner: Identity | None, anchor: tuple[int, int] | None
) -> image_user.ImageUser | None:
    """The mount namespace a view needs (workers.sandbox's own steps first: /proc, secrets,
    kernel files), then the view itself (workers.view). A view is never entered without them:
    where no mount namespace can be made (a pool not run as root) the call is refused.

    ``anchor``: the view's directory as reached without a symlink from the pool's workspace
    (workers.paths.reach). The root entered must be that directory: a view swapped for a
    symlink to ``/`` after the walk would otherwise be entered.

    Over an image: who the call is to be (its User, read from the image once entered), or
    None for a view of the host's tree."""
    assert box.view is not None
    if not _private_mounts(box, None, owner, [box.view]):
        raise SandboxError(
            "a view needs a mount namespace of the call's own: run the pool as root, or where"
            " user namespaces are allowed ([sandbox] user_namespaces)"
        )
    user = None
    try:
        if box.image:
            # A layer over an image: its overlay is the whole tree, the host's programs
            # included; the call is the image's User in its namespace, else root
            # (workers.image_root, workers.image_user).
            layer_dir = os.path.dirname(box.view)
            image_root.enter(box.view, layer_dir, network=box.network)
            entered = os.stat("/")
            named = image_user.resolve(box.image_user)
            image_root.become(named.uid, named.gid)
            # An image that names no User leaves the call root, or run_as's where it is set.
            user = named if box.image_user.strip() else None
        else:
            view.enter(box.view)
            entered = os.stat("/")
    except (image_root.ImageMountError, image_user.ImageUserError) as exc:
        raise SandboxError(str(exc)) from None
    except OSError as exc:
        raise SandboxError(f"cannot enter the view {box.view}: {exc}") from exc
    if anchor is not None and (entered.st_dev, entered.st_ino) != anchor:
        raise SandboxError(f"the view {box.view} changed while it was entered")
    return user


def _follow_no_symlinks(workspace: str) -> None:
    """Bind the workspace onto itself, following no symlink (grep's ``rg``).

    rg walks by path, not by descriptor: a parallel call that swaps a directory for a symlink
    to /etc between rg's listing and its open would have rg read /etc, which Landlock lets a
    program read. On this bind the kernel refuses to follow any symlink in the workspace
    (ELOOP), whoever resolves it. The tool checks that the bind holds (statvfs) before it runs
    rg, and walks by descriptor itself where it does not (not root, kernel before 5.10).
    """
    root = os.path.realpath(workspace)
    try:
        _libc.mount(root, root, None, _libc.MS_BIND | _libc.MS_REC, None)
        _libc.set_no_symlinks(root)
    except OSError:
        return


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
    anchor: tuple[int, int] | None = None,
) -> list[landlock.Ruleset]:
    """The Landlock domains to enter, rules added; none where Landlock is absent.

    ``anchor``: what the workspace was when reached without a symlink (workers.paths.reach).
    Its rule must hold that same directory: a rule holds the inode its path named when opened,
    so a folder swapped for a symlink to ``/`` in between would grant ``/``."""
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
    if not runs_programs and not box.view and file_rules is not None and file_rules.fits(ctx):
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
        granted = add_file_rules(ruleset, ctx.workspace, box)
        if anchor is not None and box.view is None and granted.get(ctx.workspace) != anchor:
            raise SandboxError(f"the workspace {ctx.workspace} changed while it was confined")
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
        handled = landlock.MAKE_CHAR | landlock.MAKE_BLOCK | landlock.REFER
        rulesets.append(_moves_anywhere(landlock.Ruleset(handled_fs=handled, scoped=SCOPES)))
    # What was prepared and not used: descriptors that would count against the call's limit.
    if prepared.ruleset is not None:
        prepared.ruleset.close()
        prepared.ruleset = None
    if file_rules is not None:
        file_rules.close()  # nothing left to close once taken
    if offline and landlock.has_net_rules(abi) and not (box.loopback and network_namespace):
        # A domain of its own, stacked: the fixed rules above were built before we knew.
        handled_net = landlock.NET_BIND_TCP | landlock.NET_CONNECT_TCP
        net = landlock.Ruleset(handled_fs=landlock.REFER, handled_net=handled_net)
        rulesets.append(_moves_anywhere(net))
    return rulesets


def _moves_anywhere(ruleset: landlock.Ruleset) -> landlock.Ruleset:
    """Grant linking and renaming into another directory (REFER) everywhere. Every layer that
    handles any filesystem access refuses it where it does not grant it, and the kernel counts
    REFER as handled by every layer, a network-only one too: without this, ``ln a/x b/`` and
    rename(2) across directories failed with EXDEV in bash with ``network = false`` or
    ``filesystem = "host"`` (mv copies instead; a program that renames fails)."""
    ruleset.allow_path("/", landlock.REFER)
    return ruleset


__all__ = ["Confinement", "Prepared", "SandboxError", "confine", "prepare"]
