"""What runs inside sandbx-pool's disposable workers: the template, the runtime and the tools.

Installed as ``sandbx_pool.workers`` (the repository keeps it as the top-level ``workers/``
folder). Nothing here imports the coordinator. The coordinator uses only the worker contract
(``protocol``, the messages; ``schemas``, the tools' arguments) and leaf helpers that import
nothing else of the package's (``globs``, ``procfs``, ``_libc``, ``hooks_path``); the tools
(``tools/``) and the template are loaded by the template process alone.

    template  (template.py)   preloads everything, forks a worker per call
      worker  (runtime.py)    connects (zmtp.py), confines itself (sandbox.py, landlock.py,
                              rules.py, containment.py), runs one tool (tools/), answers, exits
"""
