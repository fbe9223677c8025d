"""What runs inside sandbx-pool's disposable workers: the template, the runtime and the tools.

The coordinator (``sandbx_pool``) uses only ``workers.protocol`` and ``workers.schemas`` from
here; nothing here imports the coordinator.
"""
