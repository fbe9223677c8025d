"""Adapters that plug sandbx-pool into evaluation frameworks, without changing their evals.

* ``inspect_provider``: the Inspect AI sandbox provider ``sandbx`` (entry point group
  ``inspect_ai``), so ``Task(..., sandbox="sandbx")`` runs every exec, read and write through a
  Pool. Needs the ``inspect`` extra.
* ``mini_swe_agent``: ``SandbxEnvironment`` for mini-swe-agent's ``environment_class``. Needs
  the ``mini-swe-agent`` extra.

Neither module is imported here: each pulls in its framework, which the core does not need.
"""
