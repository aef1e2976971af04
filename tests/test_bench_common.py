"""bench/common's readings from /proc: a process's run-queue wait (schedstat)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.common import run_queue_wait_s, tree

# Spin for 0.4 s of wall time on one given core, say so, then wait for stdin to close.
SPIN = """
import os, sys, time
os.sched_setaffinity(0, {int(sys.argv[1])})
end = time.monotonic() + 0.4
while time.monotonic() < end:
    pass
print("spun", flush=True)
sys.stdin.read()
"""


@pytest.mark.skipif(
    not Path("/proc/self/schedstat").exists(), reason="this kernel keeps no schedstat"
)
def test_two_spinners_on_one_core_each_wait_for_it() -> None:
    core = min(os.sched_getaffinity(0))
    spinners = [
        subprocess.Popen(
            [sys.executable, "-c", SPIN, str(core)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    try:
        for p in spinners:
            assert p.stdout is not None
            assert p.stdout.readline().strip() == "spun"
        waits = [run_queue_wait_s([p.pid]) for p in spinners]
        whole = run_queue_wait_s(tree(os.getpid()))  # this process and, below it, the spinners
    finally:
        for p in spinners:
            p.communicate(timeout=10)
    # Sharing one core for 0.4 s, each had it about half the time and waited the rest.
    assert all(w is not None and w > 0.05 for w in waits), waits
    assert whole is not None and whole >= sum(w for w in waits if w is not None)
