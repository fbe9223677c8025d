"""What a call's Landlock domain grants, and the parts of it that are built before the call.

Every domain starts from the same fixed rules (the system's directories and Python's read-only,
a few devices), whose paths the template opens once (``preload``) for every worker to inherit.
A file tool's domain adds only the pool's own paths (the workspace, the configured extras, the
pool's lock directory, which bash's domain never grants: workers.tools.atomic), so
it is the same for every file tool call of a pool: ``build_file_rules`` builds it once, in a
helper the template forks, and each worker enters it with one system call::

    template --fork--> helper: open the workspace, build the ruleset --fd--> template
    template --fork--> worker: restrict_self(inherited ruleset)      (a file tool's call)
                               build its own from the fixed rules     (bash: TMPDIR, PATH, /proc)

A helper, not the template itself: opening the workspace walks its path, and a hung mount
would hang whoever does it. The template waits for the helper a bounded time; without its
answer each worker builds the file tools' rules itself, as bash does.

Root's secrets (/etc/shadow, sudoers, ssh host keys, block devices: workers.lockdown.masks())
are covered by a mount in bash's mount namespace. A call without one (a root pool without
CAP_SYS_ADMIN, as in a container; a file tool anywhere) would read them: it is uid 0, it owns
them. Landlock only grants, so a domain of its own leaves them out (``SecretsLayer``): it
handles reading files (and moves, ``SECRETS_LAYER``), and grants it on every entry of ``/``,
except that a directory on the way to a secret (``/etc``, ``/dev``, ``/etc/ssh``) is split into
its entries, the secrets left out. Stacked on the call's other domains, it takes from them the
reading of the secrets and nothing else. The template builds it once (about 170 rules on a
Debian host, 2 ms), and again before a fork when a directory it listed has changed; a worker
enters it with one system call, after a few stats (``SecretsLayer.fresh``)::

    layer 1, the call's rules    /usr /etc /opt... read, the workspace and TMPDIR read-write
    layer 2, secrets (D)         read: /usr /home /tmp /proc..., /etc/passwd /etc/ssl...,
                                 /dev/null /dev/pts...; not /etc/shadow, /dev/sda...
"""

from __future__ import annotations

import contextlib
import glob
import os
import select
import signal
import socket
import stat
import sys
from collections.abc import Iterator

import msgspec

from sandbx_pool.workers import _libc, landlock, lockdown
from sandbx_pool.workers.containment import release_standard_streams, set_parent_death_signal
from sandbx_pool.workers.protocol import ExecutionContext, Sandbox

SYSTEM_READ_ONLY = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/opt")
#: Devices any command may open: reading and writing them reaches no file.
DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom", "/dev/tty")

READ = landlock.EXECUTE | landlock.READ_FILE | landlock.READ_DIR
PROC = landlock.READ_FILE | landlock.READ_DIR
DEVICE = landlock.READ_FILE | landlock.WRITE_FILE | landlock.TRUNCATE | landlock.IOCTL_DEV
WRITE = landlock.fs_rights(99) & ~(landlock.MAKE_CHAR | landlock.MAKE_BLOCK | landlock.IOCTL_DEV)
SCOPES = landlock.SCOPE_SIGNAL | landlock.SCOPE_ABSTRACT_UNIX_SOCKET
#: In the lock directory a file tool opens and makes lock files, and does nothing else.
LOCKS = landlock.READ_FILE | landlock.MAKE_REG

#: How long the template waits for the helper that builds the file tools' rules.
FILE_RULES_TIMEOUT_S = 2.0
_CAP_SYS_ADMIN = 21


class Preloaded:
    """What every domain shares and no call changes: the capability count, and the fixed
    rules' paths opened (O_PATH, close-on-exec, so bash never holds them). Computed once, in
    the template (``preload``), and inherited by every worker through the fork: a worker then
    adds each fixed rule with one system call instead of opening its path again."""

    def __init__(self, last_cap: int, read_only_roots: list[str]) -> None:
        self.last_cap = last_cap
        #: Read-only for every call (the system's directories and Python's): a PATH entry
        #: beneath one of them needs no rule of its own.
        self.read_only_roots = read_only_roots
        # Not /proc: bash's is its own, mounted by confine(), which grants it then; a file tool
        # needs none (readlink of /proc/self/fd, its check of what it opened, is not a read).
        self._fixed = [(path, READ) for path in read_only_roots]
        self._fixed += [("/sys", PROC)]
        self._fixed += [(device, DEVICE) for device in DEVICES]
        self._opened: list[landlock.PathBeneath] | None = None
        if landlock.abi_version() > 0:
            self._opened = self._open()
        #: Root's secrets, in a root pool (elsewhere file modes keep them from its calls), as a
        #: tree and as real paths.
        self.secrets: SecretTree = {}
        self.secret_paths: list[str] = []
        #: Whether bash can cover them with mounts: it needs CAP_SYS_ADMIN for a mount
        #: namespace. Where it cannot (a container's root), the file tools take the layer too.
        self.can_mask = bool(_libc.capget()[0] >> _CAP_SYS_ADMIN & 1)
        self._layer: SecretsLayer | None = None
        if os.geteuid() == 0 and landlock.abi_version() > 0:
            self.secrets = secret_tree(lockdown.masks())
            self.secret_paths = list(_tree_paths(self.secrets, "/"))
            with contextlib.suppress(OSError):  # a worker tries again, and reports it
                self._layer = SecretsLayer.build(self.secrets) if self.secrets else None

    def holds_secrets(self, path: str) -> bool:
        """Whether one of root's secrets lies beneath the real path ``path`` (a workspace of
        ``/``: a file tool, which reads only in its workspace, then needs the layer too)."""
        return any(within(secret, [path]) for secret in self.secret_paths)

    def refresh_secrets_layer(self) -> None:
        """In the template, before a fork: a new layer if its directories changed, so that
        not every worker forked from now on builds its own."""
        if self._layer is not None and not self._layer.fresh():
            self._layer.ruleset.close()
            self._layer = None
            with contextlib.suppress(OSError):
                self._layer = SecretsLayer.build(self.secrets)

    def secrets_layer_fresh(self) -> bool:
        """Whether the inherited secrets layer is there and still covers its directories."""
        return self._layer is not None and self._layer.fresh()

    def take_secrets_layer(self) -> landlock.Ruleset | None:
        """The secrets layer, to enter (which closes it); None in a pool not run as root.
        The inherited one while its directories are unchanged, else one built now (a few
        milliseconds: once per worker forked before /etc, /dev or / changed)."""
        fresh = self.secrets_layer_fresh()
        layer, self._layer = self._layer, None
        if not self.secrets:
            return None
        if layer is not None and fresh:
            return layer.ruleset
        if layer is not None:
            layer.ruleset.close()
        return SecretsLayer.build(self.secrets).ruleset

    def drop_secrets_layer(self) -> None:
        """Close the inherited layer unused (the call's mounts cover the secrets)."""
        layer, self._layer = self._layer, None
        if layer is not None:
            layer.ruleset.close()

    def take_rules(self) -> list[landlock.PathBeneath]:
        """The fixed rules, opened, for the caller to close: the inherited descriptors the
        first time (so that they do not count against the call's open-files limit), freshly
        opened ones after that."""
        rules, self._opened = self._opened, None
        return rules if rules is not None else self._open()

    def drop_rules(self) -> None:
        """Close the inherited descriptors unused (the call needs no rules of its own)."""
        rules, self._opened = self._opened, None
        for rule in rules or ():
            rule.close()

    def forget_rules(self) -> None:
        """Forget the inherited descriptors (the secrets layer's too), closed already by other
        means."""
        self._opened = None
        self._layer = None

    def _open(self) -> list[landlock.PathBeneath]:
        return [r for path, rights in self._fixed if (r := landlock.PathBeneath.open(path, rights))]


_preloaded: Preloaded | None = None


def preload() -> Preloaded:
    """Compute (once per process) what every domain shares; the template calls it first."""
    global _preloaded
    if _preloaded is None:
        try:
            with open("/proc/sys/kernel/cap_last_cap") as f:
                last_cap = int(f.read())
        except OSError:
            last_cap = 40
        roots = list(dict.fromkeys([*SYSTEM_READ_ONLY, *_python_dirs()]))
        _preloaded = Preloaded(last_cap, roots)
    return _preloaded


#: What a directory was when listed for the secrets layer: path, device, inode, modification time.
Listed = tuple[str, int, int, int]
#: Below the root, a tree of names: a directory on the way to a secret (a dict), or a secret.
SecretTree = dict[str, "SecretTree | None"]
#: What the secrets layer handles: reading a file, and linking or renaming one into another
#: directory (REFER), which any layer refuses where it does not grant it; granted here beside
#: reading, since Landlock refuses a move that would gain a right (a secret moved to /tmp).
SECRETS_LAYER = landlock.READ_FILE | landlock.REFER


class SecretsLayer:
    """A ruleset that grants reading every file but root's secrets (see the module docstring),
    and the directories listed to build it: an entry made there since has no rule, so a layer
    is used only while they are unchanged (``fresh``)."""

    def __init__(self, ruleset: landlock.Ruleset, listed: list[Listed]) -> None:
        self.ruleset = ruleset
        self.listed = listed

    @classmethod
    def build(cls, tree: SecretTree) -> SecretsLayer:
        ruleset = landlock.Ruleset(handled_fs=SECRETS_LAYER)
        rules = _Batch(ruleset)
        listed: list[Listed] = []
        try:
            root = os.open("/", os.O_PATH | os.O_CLOEXEC)
            _grant_beneath(root, "/", tree, rules, listed)
            rules.flush()
        except OSError:
            ruleset.close()
            raise
        finally:
            rules.close()
        return cls(ruleset, listed)

    def fresh(self) -> bool:
        """Whether each directory listed is still the one listed, holding the same names (an
        entry made, removed or renamed changes its modification time). A few stat calls."""
        for path, *then in self.listed:
            try:
                found = os.stat(path)
            except OSError:
                return False
            if [found.st_dev, found.st_ino, found.st_mtime_ns] != then:
                return False
        return True


def secret_tree(patterns: list[str]) -> SecretTree:
    """The existing secrets among ``patterns`` (globs), by their real paths, as a tree."""
    tree: SecretTree = {}
    for path in sorted(path for pattern in patterns for path in glob.glob(pattern)):
        real = os.path.realpath(path)
        if not os.path.lexists(real) or real == "/":
            continue
        *above, name = real.strip("/").split("/")
        node: SecretTree | None = tree
        for part in above:
            if node is None:
                break  # beneath a secret already
            node = node.setdefault(part, {})
        if node is not None:
            node[name] = None
    return tree


def _tree_paths(tree: SecretTree, above: str) -> Iterator[str]:
    for name, subtree in tree.items():
        path = os.path.join(above, name)
        if subtree is None:
            yield path
        else:
            yield from _tree_paths(subtree, path)


class _Batch:
    """Rules on their way into a ruleset, added a few at a time: each holds a descriptor open
    until it is added, and a directory of a few hundred entries must not need as many (a pool
    under `ulimit -n 64` would otherwise build a layer with entries silently left out)."""

    #: Rules added with one attribute struct at a time (landlock.Ruleset.allow_all).
    SIZE = 16

    def __init__(self, ruleset: landlock.Ruleset) -> None:
        self.ruleset = ruleset
        self.pending: list[landlock.PathBeneath] = []

    def append(self, rule: landlock.PathBeneath) -> None:
        self.pending.append(rule)
        if len(self.pending) >= self.SIZE:
            self.flush()

    def flush(self) -> None:
        try:
            self.ruleset.allow_all(self.pending)
        finally:
            self.close()

    def close(self) -> None:
        while self.pending:
            self.pending.pop().close()


def _grant_beneath(
    dir_fd: int, path: str, tree: SecretTree, rules: _Batch, listed: list[Listed]
) -> None:
    """Rules for what lies beneath the directory ``dir_fd`` (O_PATH, taken over), which holds
    the secrets ``tree`` names: a rule for each entry, the secrets and the symlinks left out."""
    try:
        _grant_entries(dir_fd, path, tree, rules, listed)
        # The directory itself: moving files beneath it (no move may gain a read it lacked),
        # no reading beneath it as a whole. Added last: its descriptor serves the openat()s.
        rules.append(landlock.PathBeneath(os.dup(dir_fd), landlock.REFER, (0, 0)))
    finally:
        os.close(dir_fd)


def _grant_entries(
    dir_fd: int, path: str, tree: SecretTree, rules: _Batch, listed: list[Listed]
) -> None:
    listing = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        found = os.fstat(listing)
        listed.append((path, found.st_dev, found.st_ino, found.st_mtime_ns))
        with os.scandir(listing) as scan:
            entries = [(entry.name, entry.is_symlink()) for entry in scan]  # d_type: no stat
    finally:
        os.close(listing)
    for name, is_link in entries:
        if is_link or (name in tree and tree[name] is None):
            continue  # a symlink: what it leads to is read as its own rules say
        try:
            fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        except FileNotFoundError:
            continue  # gone since it was listed (any other failure fails the layer whole)
        subtree = tree.get(name)
        if subtree is not None:
            _grant_beneath(fd, os.path.join(path, name), subtree, rules, listed)
            continue
        if path != "/":
            # Beside a secret, what only its owner and group may read is left out as well: the
            # new /etc/shadow a password change writes beside the old, /dev's disks and
            # consoles, a keytab. Not in / itself, whose entries are mount points: a stat of a
            # hung one would hang the template (the names and d_type come from the listing).
            mode = os.fstat(fd).st_mode
            if stat.S_ISLNK(mode) or not mode & stat.S_IROTH:
                os.close(fd)
                continue
        rules.append(landlock.PathBeneath(fd, landlock.READ_FILE, (0, 0)))  # file or directory


def fixed_ruleset() -> landlock.Ruleset:
    """A new ruleset holding the fixed rules, for the caller to add its own to."""
    ruleset = landlock.Ruleset(handled_fs=landlock.fs_rights(99), scoped=SCOPES)
    rules = preload().take_rules()
    try:
        for rule in rules:
            ruleset.allow(rule)
    except OSError:
        ruleset.close()
        raise
    finally:
        for rule in rules:
            rule.close()
    return ruleset


#: What a path was when its rule was added: (device, inode), or None if it did not exist.
Identity = tuple[int, int] | None


def add_file_rules(ruleset: landlock.Ruleset, workspace: str, box: Sandbox) -> dict[str, Identity]:
    """What a file tool may reach beyond the fixed rules: the extras read-only, the workspace
    and the extra writable paths read-write. Returns what each path was when granted."""
    roots = preload().read_only_roots
    granted = [(path, READ) for path in dict.fromkeys(box.read_only) if not within(path, roots)]
    granted += [(path, WRITE) for path in (workspace, *box.writable)]
    return {path: ruleset.allow_path(path, rights) for path, rights in granted}


def add_lock_rule(ruleset: landlock.Ruleset, box: Sandbox) -> dict[str, Identity]:
    """The pool's lock directory, for a file tool's domain only: bash's never has it."""
    if box.lock_dir is None:
        return {}
    return {box.lock_dir: ruleset.allow_path(box.lock_dir, LOCKS)}


def identity(path: str) -> Identity:
    try:
        found = os.stat(path)
    except OSError:
        return None
    return (found.st_dev, found.st_ino)


class FileRules:
    """The file tools' complete ruleset for one pool's workspace and sandbox settings. Its
    descriptor is inherited by every worker, and a domain entered from it copies the rules, so
    no worker ever changes it: the rules are only ever added in the helper."""

    def __init__(
        self, workspace: str, box: Sandbox, fd: int, identities: dict[str, Identity]
    ) -> None:
        self.workspace = workspace
        self.read_only = box.read_only
        self.writable = box.writable
        self.lock_dir = box.lock_dir
        self.fd = fd
        self.identities = identities

    def fits(self, ctx: ExecutionContext) -> bool:
        """Whether the call's rules would be these: the same settings, and every path still
        the file it was (a rule holds an inode, not a name: a workspace removed and made
        again since is another directory, which these rules would refuse)."""
        box = ctx.sandbox
        return (
            box.filesystem == "workspace"
            and ctx.workspace == self.workspace
            and box.read_only == self.read_only
            and box.writable == self.writable
            and box.lock_dir == self.lock_dir
            and all(identity(path) == then for path, then in self.identities.items())
        )

    def take(self) -> landlock.Ruleset:
        """This process's copy of the ruleset, to enter (which closes it)."""
        ruleset = landlock.Ruleset.adopt(self.fd)
        self.fd = -1
        return ruleset

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def build_file_rules(workspace: str, box: Sandbox, timeout_s: float) -> FileRules | None:
    """The file tools' ruleset, built by a helper process; None where Landlock is absent, or
    when the helper failed or did not answer within ``timeout_s`` (it is killed, and reaped
    with the template's other children)."""
    if landlock.abi_version() == 0 or box.filesystem != "workspace":
        return None
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    parent = os.getpid()
    pid = os.fork()
    if pid == 0:  # the helper
        _serve_file_rules(theirs, workspace, box, parent)
    theirs.close()
    fds: list[int] = []
    try:
        answer = select.poll()
        answer.register(ours, select.POLLIN)
        if not answer.poll(timeout_s * 1000):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            return None
        # Close-on-exec from the start: nothing we exec may hold a ruleset every worker enters.
        data, fds, _, _ = socket.recv_fds(ours, 1 << 16, 1, socket.MSG_CMSG_CLOEXEC)
        identities = msgspec.msgpack.decode(data, type=dict[str, Identity]) if fds else {}
    except (OSError, msgspec.DecodeError):
        for fd in fds:
            os.close(fd)
        return None
    finally:
        ours.close()
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)
    return FileRules(workspace, box, fds[0], identities) if fds else None


def _serve_file_rules(channel: socket.socket, workspace: str, box: Sandbox, parent: int) -> None:
    """In the helper: build the ruleset and hand its descriptor over, or hang up."""
    code = 1
    try:
        set_parent_death_signal(signal.SIGKILL)
        if os.getppid() != parent:  # the template died before PDEATHSIG was armed
            return
        # Hold nothing of the template's: not its end of the coordinator's socket (whose
        # hang-up tells the coordinator the template is gone, even if we are stuck on a hung
        # mount), not its signal handlers or wakeup fd. The fixed rules are opened afresh.
        signal.set_wakeup_fd(-1)
        for signum in (signal.SIGTERM, signal.SIGCHLD):
            signal.signal(signum, signal.SIG_DFL)
        release_standard_streams(os.open(os.devnull, os.O_RDWR))
        keep = channel.fileno()
        os.closerange(3, keep)
        os.closerange(keep + 1, os.sysconf("SC_OPEN_MAX"))
        preload().forget_rules()
        ruleset = fixed_ruleset()
        identities = add_file_rules(ruleset, workspace, box) | add_lock_rule(ruleset, box)
        socket.send_fds(channel, [msgspec.msgpack.encode(identities)], [ruleset.fd])
        code = 0
    except OSError:
        pass  # no descriptor: the workers build their own rules, and report what fails
    finally:
        os._exit(code)


def within(path: str, roots: list[str]) -> bool:
    return any(path == root or path.startswith(root.rstrip("/") + "/") for root in roots)


def _python_dirs() -> list[str]:
    """The interpreter this worker runs on: it imports lazily and must keep working confined."""
    dirs = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]
    # The worker's own package, wherever it is installed from (an editable install included).
    dirs.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return dirs


__all__ = [
    "FileRules",
    "Preloaded",
    "SecretsLayer",
    "add_lock_rule",
    "build_file_rules",
    "fixed_ruleset",
    "preload",
    "within",
]
