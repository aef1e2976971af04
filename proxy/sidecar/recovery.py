"""The recovery hook: run a command (or POST a URL) when the unit stays NOT_SERVING.

After the unit has been NOT_SERVING for the grace period, the hook runs with the unit
id and the failed nodes in its environment (``UNITPROXY_UNIT_ID``,
``UNITPROXY_FAILED_NODES``, comma-separated). While the unit stays NOT_SERVING it runs
again after a backoff that doubles each time up to a limit; a unit that serves again
resets the backoff. Runs are sequential: never two at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
from collections.abc import Callable

import aiohttp

from proxy.load import UnitState
from proxy.settings import RecoverySettings
from proxy.sidecar.health import UnitHealth

log = logging.getLogger(__name__)


class RecoveryHook:
    def __init__(
        self, settings: RecoverySettings, health: UnitHealth, session: aiohttp.ClientSession
    ):
        self._settings = settings
        self._health = health
        self._session = session
        self.runs = 0

    async def run(self) -> None:
        s = self._settings
        backoff = s.backoff_initial_s
        while True:
            await self._until(lambda: self._health.state is UnitState.NOT_SERVING)
            if not await self._stays_not_serving(s.grace_s):
                backoff = s.backoff_initial_s
                continue
            while self._health.state is UnitState.NOT_SERVING:
                await self._run_once()
                if not await self._stays_not_serving(backoff):
                    break
                backoff = min(backoff * 2, s.backoff_max_s)
            backoff = s.backoff_initial_s

    async def _until(self, condition: Callable[[], bool]) -> None:
        while not condition():
            seen = self._health.state_changes.version
            await self._health.state_changes.wait(seen)

    async def _stays_not_serving(self, seconds: float) -> bool:
        """Wait ``seconds``; False as soon as the unit leaves NOT_SERVING."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while self._health.state is UnitState.NOT_SERVING:
            left = deadline - loop.time()
            if left <= 0:
                return True
            seen = self._health.state_changes.version
            await self._health.state_changes.wait(seen, left)
        return False

    async def _run_once(self) -> None:
        self.runs += 1
        failed = self._health.failed_nodes()
        unit_id = self._health.unit_id
        log.warning("unit %s NOT_SERVING (failed: %s): running recovery hook, run %d",
                    unit_id, ",".join(failed) or "-", self.runs)  # fmt: skip
        try:
            async with asyncio.timeout(self._settings.timeout_s):
                if self._settings.command:
                    await self._run_command(self._settings.command, unit_id, failed)
                if self._settings.url:
                    await self._post(self._settings.url, unit_id, failed)
        except TimeoutError:
            log.error("recovery hook of unit %s did not finish within %g s",
                      unit_id, self._settings.timeout_s)  # fmt: skip
        except (OSError, aiohttp.ClientError) as exc:
            log.error("recovery hook of unit %s failed: %s", unit_id, exc)

    async def _run_command(self, command: str, unit_id: str, failed: list[str]) -> None:
        env = dict(os.environ, UNITPROXY_UNIT_ID=unit_id, UNITPROXY_FAILED_NODES=",".join(failed))
        proc = await asyncio.create_subprocess_shell(
            command, env=env, stdin=asyncio.subprocess.DEVNULL, start_new_session=True
        )
        try:
            code = await proc.wait()
        except asyncio.CancelledError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
            raise
        if code != 0:
            log.error("recovery command of unit %s exited with status %d", unit_id, code)

    async def _post(self, url: str, unit_id: str, failed: list[str]) -> None:
        body = json.dumps({"unit_id": unit_id, "failed_nodes": failed})
        headers = {"Content-Type": "application/json"}
        async with self._session.post(url, data=body, headers=headers) as resp:
            if resp.status >= 300:
                log.error("recovery URL of unit %s answered %d", unit_id, resp.status)
