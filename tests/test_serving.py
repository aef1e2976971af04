"""proxy.serving's shutdown helpers."""

from __future__ import annotations

import asyncio

import pytest

from proxy import serving


async def test_cancel_tasks_cancels_again_a_task_that_let_a_cancel_go(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(serving, "CANCEL_AGAIN_S", 0.05)
    cancels = 0

    async def stubborn() -> None:
        nonlocal cancels
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancels += 1
                if cancels == 1:
                    continue  # taken for something else: the task goes on
                raise

    async def plain() -> None:
        await asyncio.sleep(3600)

    tasks = [asyncio.create_task(stubborn(), name="stubborn"), asyncio.create_task(plain())]
    await asyncio.sleep(0)
    async with asyncio.timeout(5):
        await serving.cancel_tasks(tasks)
    assert all(t.cancelled() for t in tasks)
    assert cancels == 2
    assert "task stubborn still runs" in caplog.text


async def test_cancel_tasks_raises_what_a_task_raised() -> None:
    async def broken() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            raise RuntimeError("cleanup failed") from None

    task = asyncio.create_task(broken())
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="cleanup failed"):
        await serving.cancel_tasks([task])
    done = asyncio.create_task(asyncio.sleep(0))
    await done
    await serving.cancel_tasks([done])  # a finished task is left as it is
    assert done.done() and not done.cancelled()
