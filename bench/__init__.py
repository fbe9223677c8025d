"""The benchmark: sandbx-pool against its peers, side by side in one process run.

    python -m bench                  every section, then the bars (make bench)
    python -m bench soak             the soak alone, 2,000 calls
    python -m bench latency cancel   some sections only; --quick for a smoke run

Sections, one module each: ``latency`` (a read, one call at a time), ``cancel`` (cancel to
outcome), ``throughput`` (8 in parallel, CPU per call, memory), ``soak`` (mixed calls with
cancels, timeouts and escape attempts, then what is left). Around them: ``peers`` (the
contenders), ``tasks`` (what the peers' workers run), ``forkfloor`` (the fork floor in a fresh
interpreter), ``workerconn`` (a worker's connection: ZMTP against a libzmq context),
``workspace`` (the files and the run's process marker), ``procs`` (processes, fds, memory and
CPU from /proc), ``stats`` (percentiles, budgets), ``report`` (the Markdown).

Issue 40's comparisons with the command executors agent frameworks ship (``executors``: a bare
subprocess, bubblewrap per command, mini-swe-agent's LocalEnvironment): ``percall`` (bash and
read one at a time, in the latency section), ``parallel`` (8 in flight, in the throughput
section) and ``trajectory`` (a section of its own: 40 calls of a coding agent over attrs's
source, fetched and given a test venv by ``attrs_repo``), reported by ``executors_report``.
"""
