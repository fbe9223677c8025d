"""The batch runner: a CALLS.jsonl file through one pool, resumable from its journal.

    CALLS.jsonl --calls.parse_batch--> [CallSpec] --run.run_batch--> Pool.call ... --> BatchReport
                                                        |                                |
                                          progress.Progress (live line)   progress.format_summary

* ``calls``: parsing and validating the lines, and each call's stable id (so a resumed run
  recognises the calls it already finished).
* ``run``: the scheduler: dependencies (``after``), parallelism, what a resume skips.
* ``progress``: the progress line and the summary by status.

The ``sandbx-pool run`` command that drives them is ``sandbx_pool.cli.batch``.
"""
