"""fork() without Python's after-fork callbacks: the template's way of making a worker.

``os.fork()`` runs, in every child, the callbacks registered with ``os.register_at_fork``:
``threading`` rebuilds its thread table and ``random`` reseeds itself. They are Python code, so
in a child of the template they write to a few hundred of the template's shared pages, and each
first write copies a page. Measured on this kind of machine (2 vCPUs, VM): 160-200 page faults
and 1.0-1.4 ms of CPU per worker, a tenth of what a whole worker costs, spent on state a worker
never uses. (`make bench` shows both fork floors side by side.)

Calling libc's fork() through ``ctypes.PyDLL`` (which keeps the GIL held across the call) skips
them, and is sound here because of what the template guarantees:

* it is single-threaded, so no lock (the GIL's, the import lock, a ``threading.Lock``) can be
  held by a thread that does not exist in the child, which is what the skipped re-inits repair;
* a worker never starts a Python thread, never uses ``random`` (tokens and temp names come from
  ``os.urandom``, which reads the kernel), and never returns into the template's code: it
  leaves with ``os._exit``;
* glibc's own pthread_atfork handlers (malloc's locks) still run: only Python's are skipped.

Python's after-fork work also clears signals that were pending in the template. Skipping it
means such a signal's handler may run once in the child, before the child resets it: the
template's handlers only wake its loop (they are no-ops in Python), so that run is harmless.

``clone(flags)`` is the same fork with namespace flags, as the raw system call (libc's
``clone()`` wants a function and a stack to run it on; with a null stack and every other argument
0 the kernel copies the caller's, as fork does, and the argument order, which differs between
architectures, does not matter). A pool without root uses it to make each worker in a user and
PID namespace of its own in one step (workers.containment.UserNamespaces). It also skips glibc's
own fork handlers, which is sound for the reasons above: with one thread, none of the locks they
reset can be held; the one thing glibc's ``_Fork`` sets that this child lacks is its cached thread
id (its copy still holds the template's), which only recursive and error-checking pthread mutexes
read, and which ``raise()`` and ``pthread_kill`` on oneself no longer use (glibc 2.34: gettid).
"""

from __future__ import annotations

import ctypes
import errno
import os
import signal

_pylibc = ctypes.PyDLL(None, use_errno=True)
_fork = _pylibc.fork
_fork.restype = ctypes.c_int
_fork.argtypes = []


def fork() -> int:
    """Like ``os.fork()`` (0 in the child, the child's pid in the parent), minus the callbacks."""
    pid = int(_fork())
    if pid < 0:
        code = ctypes.get_errno()
        raise OSError(code, f"fork: {os.strerror(code)}")
    return pid


#: clone(2)'s number where it takes (flags, stack, ...) in the first two places: with a null
#: stack and null pointers the rest, the orders of x86_64 and aarch64 agree.
_SYS_CLONE = {"x86_64": 56, "aarch64": 220}
_CLONE = _SYS_CLONE.get(os.uname().machine)
_syscall = _pylibc.syscall
_syscall.restype = ctypes.c_long


def clone_supported() -> bool:
    return _CLONE is not None


def clone(flags: int) -> int:
    """fork() with ``flags`` (CLONE_NEW*) added; SIGCHLD is its exit signal, as a fork's."""
    if _CLONE is None:
        raise OSError(errno.ENOSYS, f"clone: unknown on {os.uname().machine}")
    zero = ctypes.c_long(0)
    pid = int(_syscall(ctypes.c_long(_CLONE), ctypes.c_long(flags | signal.SIGCHLD), *[zero] * 4))
    if pid < 0:
        code = ctypes.get_errno()
        raise OSError(code, f"clone: {os.strerror(code)}")
    return pid


__all__ = ["clone", "clone_supported", "fork"]
