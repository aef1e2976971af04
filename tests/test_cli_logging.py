"""The processes' log lines (proxy/cli.py, configure_logging): the format printed, and
no record looking up what that format does not print."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(30)

SCRIPT = """
import logging, threading
from proxy.cli import configure_logging
configure_logging("info")
seen = []
class Keep(logging.Handler):
    def emit(self, record):
        seen.append(record)
logging.getLogger("unitproxy.access").addHandler(Keep())
logging.getLogger("unitproxy.access").info("tenant=%s status=%s", "alpha", "200")
logging.getLogger("unitproxy.other").debug("not at info")
(r,) = seen
print(r.funcName, r.lineno, r.thread, r.process, r.processName, r.getMessage())
"""


def test_a_line_carries_its_format_and_no_caller_thread_or_process() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=20, check=True
    )
    # the line, in the format, on stderr; the debug line left out
    (line,) = done.stderr.splitlines()
    assert line.endswith(" INFO unitproxy.access: tenant=alpha status=200"), line
    assert line[:4].isdigit()  # the time first (asctime)
    # what the format does not print was not looked up for the record
    assert done.stdout.split() == ["(unknown", "function)", "0", "None", "None", "None",
                                   "tenant=alpha", "status=200"]  # fmt: skip
