"""Adapters that plug sandbx-pool into evaluation frameworks, without changing their evals.

* ``inspect_provider``: the Inspect AI sandbox provider ``sandbx`` (entry point group
  ``inspect_ai``), so ``Task(..., sandbox="sandbx")`` runs every exec, read and write through a
  Pool. Needs the ``inspect`` extra.
* ``mini_swe_agent``: ``SandbxEnvironment`` for mini-swe-agent's ``environment_class``. Needs
  the ``mini-swe-agent`` extra.
* ``ray``: a pool per node of a Ray cluster (``node_pool``) and ``RayPool``, the Pool API across
  the cluster (``run --ray``). Needs the ``ray`` extra.

No module is imported here: each pulls in its framework, which the core does not need.
"""
