"""The access log (proxy/accesslog.py): a line a request in the log's format, gathered
and written by time or size, only while the unitproxy.access logger is at info; through
logging or off where the settings say."""

from __future__ import annotations

import asyncio
import io
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy import accesslog
from proxy.accesslog import AccessLog
from proxy.gateway.tenancy import seconds_text
from tests.conftest import GatewayFactory, SidecarFactory

pytestmark = pytest.mark.timeout(20)

LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO unitproxy\.access: (.*)$")


@pytest.fixture
def access_at_info() -> Iterator[None]:
    logger = logging.getLogger(accesslog.ACCESS_LOGGER)
    level = logger.level
    logger.setLevel(logging.INFO)
    yield
    logger.setLevel(level)


async def test_lines_are_gathered_and_written_together_in_the_log_format(
    access_at_info: None,
) -> None:
    out = io.StringIO()
    log = AccessLog("stderr", out)
    assert log.enabled(0.0)
    log.write("tenant=a status=200")
    log.write("tenant=b status=429")
    assert out.getvalue() == ""  # gathered, not written one by one
    await asyncio.sleep(accesslog.FLUSH_S + 0.2)
    lines = out.getvalue().splitlines()
    assert [LINE.match(line).group(1) for line in lines] == [  # type: ignore[union-attr]
        "tenant=a status=200",
        "tenant=b status=429",
    ]


async def test_a_full_buffer_is_written_at_once_and_the_rest_at_flush(
    access_at_info: None,
) -> None:
    out = io.StringIO()
    log = AccessLog("stderr", out)
    fields = "tenant=t " + "x" * 1000
    for _ in range(accesslog.MAX_BUFFERED // 1000 + 5):
        log.write(fields)
    written = out.getvalue().count("\n")
    assert 0 < written < accesslog.MAX_BUFFERED // 1000 + 5  # the full part, not the rest
    log.flush()  # as the gateway does when it stops
    assert out.getvalue().count("\n") == accesslog.MAX_BUFFERED // 1000 + 5


def test_the_level_and_the_sink_decide_whether_a_line_is_written(
    access_at_info: None,
) -> None:
    assert not AccessLog("off").enabled(0.0)
    log = AccessLog("stderr", io.StringIO())
    assert log.enabled(0.0)
    logging.getLogger(accesslog.ACCESS_LOGGER).setLevel(logging.WARNING)
    assert log.enabled(0.5)  # asked again only once a second
    assert not log.enabled(1.5)
    with pytest.raises(ValueError, match="not one of"):
        AccessLog("file")


def test_through_logging_each_line_is_a_record(
    access_at_info: None, caplog: pytest.LogCaptureFixture
) -> None:
    log = AccessLog("logging")
    with caplog.at_level(logging.INFO, logger=accesslog.ACCESS_LOGGER):
        log.write("tenant=a status=200 note=100%s")
    assert [r.getMessage() for r in caplog.records] == ["tenant=a status=200 note=100%s"]


def test_outside_a_loop_a_line_is_written_at_once(access_at_info: None) -> None:
    out = io.StringIO()
    AccessLog("stderr", out).write("tenant=a")
    assert out.getvalue().endswith(" INFO unitproxy.access: tenant=a\n")


async def test_a_gateway_writes_a_line_a_request_to_stderr_by_default(
    start_sidecar: SidecarFactory,
    start_gateway: GatewayFactory,
    tmp_path: Path,
    access_at_info: None,
    capfd: pytest.CaptureFixture[str],
) -> None:
    tenants = tmp_path / "tenants.toml"
    tenants.write_text('[[tenant]]\nname = "alpha"\nkeys = ["sk-alpha"]\n')
    sidecar = await start_sidecar()
    gw = await start_gateway([sidecar], tenants_file=str(tenants))
    body = {"model": "unitproxy-sim", "prompt": "a secret prompt", "max_tokens": 3}
    async with aiohttp.ClientSession(headers={"Authorization": "Bearer sk-alpha"}) as s:
        for _ in range(3):
            async with s.post(f"{gw.http_url}/v1/completions", json=body) as r:
                assert r.status == 200
                await r.read()
    await asyncio.sleep(accesslog.FLUSH_S + 0.3)
    err = capfd.readouterr().err
    lines = [m.group(1) for m in map(LINE.match, err.splitlines()) if m]
    assert len(lines) == 3, err[-2000:]
    assert all(
        line.startswith("tenant=alpha model=unitproxy-sim unit=")
        and " status=200 " in line
        and " completion_tokens=3 " in line
        for line in lines
    ), lines
    assert "secret" not in err


@given(st.floats(min_value=0.0, max_value=1e7, allow_nan=False))
def test_seconds_are_written_as_with_four_decimals(x: float) -> None:
    text = seconds_text(x)
    assert re.fullmatch(r"\d+\.\d{4}", text), text
    assert abs(float(text) - x) <= 0.00005 * (1 + 1e-9) + x * 1e-15
    if abs(x * 10000 - round(x * 10000)) < 0.49:  # not at a tie: as the format spec rounds
        assert text == f"{x:.4f}"


def test_seconds_below_zero_are_zero() -> None:
    assert seconds_text(-0.3) == "0.0000"
    assert (seconds_text(0.0), seconds_text(0.01234), seconds_text(12.5)) == (
        "0.0000", "0.0123", "12.5000")  # fmt: skip
