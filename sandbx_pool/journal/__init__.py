"""The journal: an append-only JSON Lines record of every call, durable before side effects.

    Pool --intent/started/outcome--> store.Journal --records--> writer (thread: encode, write,
                                                                  group-commit, fsync)
    sandbx-pool journal / --resume --> reader (parse, recover a torn tail, in-doubt calls, stats)

* ``records``: the record types (tagged msgspec Structs) and how large arguments are summarised.
* ``store``: the facade a pool holds: how durable each record must be, the open calls, the lock
  that keeps a second coordinator out, recovery at open.
* ``writer``: the thread that makes records durable without blocking the event loop.
* ``restore``: how the writer puts a journal removed or replaced under the pool back at its
  path, whole.
* ``reader``: everything that reads a journal back, for the pool's recovery and the CLI.
"""
