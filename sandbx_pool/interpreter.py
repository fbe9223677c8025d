"""How the coordinator starts an interpreter of its own: this installation's code, nothing else.

The template (and ``doctor``'s probe) used to be ``python -m workers.template``, run in the
caller's working directory. ``-m`` puts that directory first on ``sys.path``, so a pool whose
workspace was the caller's directory let a call *write* the template it would run next, as
root and unconfined. Now:

* ``-I`` (isolated mode): neither the current directory nor the script's is on ``sys.path``,
  ``PYTHON*`` variables (``PYTHONPATH``, ``PYTHONSTARTUP``...) are ignored, and so is the user's
  site-packages (a ``.pth`` or ``usercustomize`` a call could plant under ``HOME``);
* the one directory added is the one *this* ``sandbx_pool`` package was imported from, so the
  child runs the same code as the coordinator, whatever the environment says;
* the child starts in ``/``, not the caller's directory.

A ``.pth`` file in the interpreter's own site-packages still runs at start-up, as it does for
every program of that installation: protecting it is the installation's business. An editable
install (``pip install -e``) runs the checkout's files: a pool whose workspace is that checkout
can change the code its next pool runs (docs/security.md says so).
"""

from __future__ import annotations

import os
import sys

import sandbx_pool

#: Where ``import sandbx_pool`` found the package: the child imports it from there and nowhere else.
PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(sandbx_pool.__file__)))

#: Run as ``python -I -c BOOTSTRAP PACKAGE_PARENT MODULE ARGS...``: MODULE runs as ``__main__``
#: with ``sys.argv`` = [its file, ARGS...], as ``python -m MODULE ARGS...`` would.
_BOOTSTRAP = (
    "import runpy, sys; sys.path.insert(0, sys.argv.pop(1)); "
    "runpy.run_module(sys.argv.pop(1), run_name='__main__', alter_sys=True)"
)

#: The working directory of every interpreter started here: nothing of the caller's.
CHILD_CWD = "/"


def python_command(module: str, *args: str) -> list[str]:
    """The command line that runs ``module`` as ``__main__`` from this installation only."""
    return [sys.executable, "-I", "-c", _BOOTSTRAP, PACKAGE_PARENT, module, *args]
