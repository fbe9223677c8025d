"""The ``sandbx-pool`` command line: one module a command family.

* ``main``: the parser, ``call``, ``tools``, ``schema`` and ``mcp``; the entry point.
* ``batch``: ``run`` (the batch runner) and ``demo``; ``demo`` builds its data.
* ``journal``: ``journal in-doubt | stats | show``.
* ``doctor``: what this machine enforces, probed in a child interpreter.
* ``arguments`` and ``checks``: the argument types and the workspace check the commands share.

Each command imports what it needs when it runs, so ``sandbx-pool tools`` does not pay for the
pool, and ``mcp`` alone loads the MCP SDK.
"""
