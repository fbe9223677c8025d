"""workers.immortal: a template whose objects are immortal shares more pages with its forks.

Each case runs in a fresh interpreter: immortalizing cannot be undone, and the test process's
own objects must stay as they are.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from sandbx_pool.workers import immortal

#: A stand-in for a template: objects made before the fork, touched by the child after it.
#: The child only reads them, as a worker reads the template's functions and constants, yet
#: without immortality each reference it takes writes the object's count, and copies its page.
_FORK_AND_TOUCH = textwrap.dedent(
    """
    import os, resource, sys
    from sandbx_pool.workers import immortal

    objects = [[i] for i in range(50_000)]  # ~4 MB of small containers over ~1,000 pages
    marked = immortal.immortalize() if sys.argv[1] == "immortal" else 0
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        kept = [obj for obj in objects]  # one new reference to each
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
        os.write(write, str(faults).encode())
        os._exit(0)
    os.waitpid(pid, 0)
    print(marked, os.read(read, 100).decode())
    """
)


def _fork_and_touch(mode: str) -> tuple[int, int]:
    """(objects marked, page faults of the forked child) in a fresh interpreter."""
    done = subprocess.run(
        [sys.executable, "-c", _FORK_AND_TOUCH, mode],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    marked, faults = done.stdout.split()
    return int(marked), int(faults)


@pytest.mark.skipif(not immortal.supported(), reason="needs CPython 3.12 or 3.13 with the GIL")
def test_a_fork_of_an_immortalized_process_reads_its_objects_without_copying_them() -> None:
    marked, faults = _fork_and_touch("immortal")
    _, mortal_faults = _fork_and_touch("mortal")
    assert marked > 50_000
    # The mortal child copies every page of the list's objects; the immortal one only the
    # pages of its own new list.
    assert mortal_faults > 800
    assert faults < mortal_faults / 4


@pytest.mark.skipif(not immortal.supported(), reason="needs CPython 3.12 or 3.13 with the GIL")
def test_objects_made_afterwards_stay_mortal() -> None:
    script = textwrap.dedent(
        """
        import sys
        from sandbx_pool.workers import immortal
        before = object.__new__(type("Before", (), {}))
        keep = [before]
        immortal.immortalize()
        after = [1, 2]
        print(sys.getrefcount(before), sys.getrefcount(after))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60
    )
    before, after = map(int, done.stdout.split())
    assert before == 0xFFFFFFFF
    assert after == 2  # the name, and getrefcount's argument


@pytest.mark.skipif(immortal.supported(), reason="this interpreter is supported")
def test_elsewhere_nothing_is_marked() -> None:
    marked, _ = _fork_and_touch("immortal")
    assert marked == 0
