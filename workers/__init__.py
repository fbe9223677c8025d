"""What runs inside sandbx-pool's disposable workers: the template, the runtime and the tools.

Installed as ``sandbx_pool.workers`` (the repository keeps it as the top-level ``workers/``
folder, mapped by pyproject.toml's ``package-dir``). The boundary between the two sides is the
rule below, stated here and nowhere else, and checked by tests/test_layering.py: nothing here
imports the coordinator; the coordinator imports from here only ``COORDINATOR_MAY_IMPORT``,
the contract (``protocol``, the messages; ``schemas``, the tools' arguments; ``errors``, the
tools' failures) and leaf helpers that import nothing else of the package's; ``doctor``, the
one command that runs no pool, also asks ``DOCTOR_MAY_IMPORT``, the worker side's own probes of
the kernel, what this machine enforces. The tools (``tools/``), the runtime and the template
are loaded by the template process alone.

    template  (template.py)   preloads everything, forks a worker per call
      worker  (runtime.py)    connects (zmtp.py), confines itself (sandbox.py, landlock.py,
                              rules.py, containment.py), runs one tool (tools/), answers, exits
"""

#: What any coordinator module may import from this package (see above).
COORDINATOR_MAY_IMPORT = frozenset(
    {"protocol", "schemas", "errors", "globs", "procfs", "_libc", "rg_binary", "hooks_path"}
)
#: What ``sandbx_pool.cli.doctor`` (and its probes, ``doctor_probes``) may import besides: the
#: worker side's probes of what the kernel gives.
DOCTOR_MAY_IMPORT = frozenset(
    {
        "cgroups",
        "containment",
        "immortal",
        "landlock",
        "lockdown",
        "memory_cgroup",
        "overlay",
        "rules",
        "seccomp",
        "zmtp",
    }
)
