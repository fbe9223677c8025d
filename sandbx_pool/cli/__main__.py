"""``python -m sandbx_pool.cli``: the same as the ``sandbx-pool`` command."""

from sandbx_pool.cli.main import entry

entry()
