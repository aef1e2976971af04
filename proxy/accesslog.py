"""The gateway's access log: one line a request of a tenant, written where the settings
say (``gateway.access_log``):

- ``stderr`` (the default): in the processes' log format (``proxy.cli.LOG_FORMAT``:
  time, ``INFO``, ``unitproxy.access``, the fields), gathered and written at most every
  ``FLUSH_S`` or ``MAX_BUFFERED`` characters, with the time's text made once a second.
  A line through ``logging`` costs about 70,000 instructions (a record, its caller,
  the handler's lock, formatting, a flush a line), a third of what a short request's
  whole handling costs; this costs a few thousand.
- ``logging``: a record of the ``unitproxy.access`` logger a line, for an application
  that embeds the gateway and gives that logger handlers of its own.
- ``off``: none.

In every case a line is written only while the ``unitproxy.access`` logger is enabled
for INFO (``--log-level warning`` turns it off), as asked of ``logging`` at most once a
second.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from typing import Final, TextIO

ACCESS_LOGGER: Final = "unitproxy.access"
access_log: Final = logging.getLogger(ACCESS_LOGGER)
FLUSH_S: Final = 0.25  # the longest a line waits to be written
MAX_BUFFERED: Final = 64 * 1024  # characters gathered that are written at once
LEVEL_CHECK_S: Final = 1.0  # how often the logger's level is asked again
SINKS: Final = ("stderr", "logging", "off")
# ",000" to ",999": a line's milliseconds without a format spec (compiled, one costs a
# str.format call and a join, most of what writing a line costs).
_MILLIS: Final = [f",{ms:03d} " for ms in range(1000)]


class AccessLog:
    """Where the access lines go (``sink``: one of ``SINKS``). ``stream``: the stream
    for ``stderr`` (None: ``sys.stderr`` as it is when a batch is written)."""

    def __init__(self, sink: str = "stderr", stream: TextIO | None = None) -> None:
        if sink not in SINKS:
            raise ValueError(f"access log: {sink!r} is not one of {', '.join(SINKS)}")
        self.sink = sink
        self._stream = stream
        self._lines: list[str] = []
        self._size = 0
        self._timer: asyncio.TimerHandle | None = None
        self._on = False
        self._checked_until = -1.0
        self._second = -1  # the whole second whose text is kept
        self._stamp = ""  # "YYYY-MM-DD HH:MM:SS" of it, local time as logging's asctime

    def enabled(self, now: float) -> bool:
        """Whether a line is written (``now``: time.monotonic(), for the level's check)."""
        if now >= self._checked_until:
            self._on = self.sink != "off" and access_log.isEnabledFor(logging.INFO)
            self._checked_until = now + LEVEL_CHECK_S
        return self._on

    def write(self, fields: str) -> None:
        """One request's line: ``fields`` (``key=value`` pairs, no line break). Only
        where ``enabled`` said so."""
        if self.sink == "logging":
            access_log.info("%s", fields)
            return
        wall = time.time()
        second = int(wall)
        if second != self._second:
            self._second = second
            self._stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(wall))
        ms = min(int((wall - second) * 1000), 999)
        line = f"{self._stamp}{_MILLIS[ms]}INFO {ACCESS_LOGGER}: {fields}\n"
        self._lines.append(line)
        self._size += len(line)
        if self._size >= MAX_BUFFERED:
            self.flush()
        elif self._timer is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no loop (a caller outside one): at once
                self.flush()
                return
            self._timer = loop.call_later(FLUSH_S, self.flush)

    def flush(self) -> None:
        """Write what is gathered (at shutdown too)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if not self._lines:
            return
        text = "".join(self._lines)
        self._lines.clear()
        self._size = 0
        stream = self._stream if self._stream is not None else sys.stderr
        try:
            stream.write(text)
            stream.flush()
        except (OSError, ValueError) as exc:  # a closed or broken stream: say so, go on
            logging.getLogger(__name__).warning("access log: could not write: %s", exc)
