"""A gateway counts its own requests on a unit from its own books: the unit's reports to
it count them apart (``watcher_outstanding``), so a report that was sent before one of
its requests ended, and arrives after, does not show that request still running."""

from __future__ import annotations

import aiohttp
import grpc
import pytest

from proxy.gateway.units import Unit
from proxy.load import MAX_GATEWAY_NAME, LoadReport, UnitState, gateway_name
from proxy.pb.unitproxy.v1 import inference_pb2, inference_pb2_grpc
from proxy.sidecar.core import STANDARD
from tests.conftest import GatewayFactory, SidecarFactory, wait_until


async def test_a_sidecar_counts_each_gateways_requests_apart(
    start_sidecar: SidecarFactory,
) -> None:
    core = (await start_sidecar()).core
    leases = [core.admit(STANDARD, None, "g1"), core.admit(STANDARD, None, "g1")]
    leases += [core.admit(STANDARD, None, "g2"), core.admit(STANDARD)]
    assert core.report(None, "g1").watcher_outstanding == 2
    assert core.report(None, "g2").watcher_outstanding == 1
    assert core.report(None, "g3").watcher_outstanding == 0
    assert core.report().watcher_outstanding == -1
    assert core.report().outstanding == 4
    for lease in leases:
        lease.release()
        lease.release()  # once only
    assert core.report(None, "g1").watcher_outstanding == 0
    assert core._by_gateway == {}  # nothing kept for gateways with none outstanding


def test_the_count_travels_on_both_wires_and_absent_means_unknown() -> None:
    report = LoadReport("u", UnitState.SERVING, outstanding=3, capacity=8, watcher_outstanding=2)
    assert LoadReport.from_pb(report.to_pb()).watcher_outstanding == 2
    assert LoadReport.from_dict(report.to_dict()).watcher_outstanding == 2
    zero = LoadReport("u", UnitState.SERVING, outstanding=3, capacity=8, watcher_outstanding=0)
    assert LoadReport.from_pb(zero.to_pb()).watcher_outstanding == 0  # zero is not absent
    unknown = LoadReport("u", UnitState.SERVING, outstanding=3, capacity=8)
    assert not unknown.to_pb().HasField("watcher_outstanding")
    assert LoadReport.from_pb(unknown.to_pb()).watcher_outstanding == -1
    older = unknown.to_dict()
    del older["watcher_outstanding"]  # a sidecar from before the field
    assert LoadReport.from_dict(older).watcher_outstanding == -1


@pytest.mark.parametrize(
    ("value", "name"),
    [("g1", "g1"), ("", None), (None, None), (7, None), ("x" * MAX_GATEWAY_NAME, "x" * 64),
     ("x" * (MAX_GATEWAY_NAME + 1), None)],
)  # fmt: skip
def test_gateway_names(value: object, name: str | None) -> None:
    assert gateway_name(value) == name


def test_the_estimate_takes_the_gateways_own_in_flight_where_the_report_counts_them() -> None:
    unit = Unit("a", "http://a", "a:1")
    # A report sent while this gateway's request ran there, arriving after it ended.
    unit.apply(
        LoadReport("a", UnitState.SERVING, outstanding=3, capacity=8, watcher_outstanding=1), 0.0
    )
    assert unit.estimate() == 2  # the other gateways' two; none of this one's
    unit.inflight = 2
    unit.started_since_report = 2
    assert unit.estimate() == 4
    # A report that does not count them apart: corrected as before.
    unit.apply(LoadReport("a", UnitState.SERVING, outstanding=3, capacity=8), 0.0)
    unit.inflight = 0
    assert unit.estimate() == 3


async def _complete(gw_url: str, gw_grpc: str, client: str, http: aiohttp.ClientSession) -> None:
    if client == "http":
        body = {"model": "unitproxy-sim", "prompt": "hello", "max_tokens": 40}
        async with http.post(f"{gw_url}/v1/completions", json=body) as response:
            assert response.status == 200, await response.text()
            await response.read()
        return
    async with grpc.aio.insecure_channel(gw_grpc) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        request = inference_pb2.GenerateRequest(
            prompt="hello", sampling=inference_pb2.SamplingParams(max_tokens=40)
        )
        chunks = [c async for c in stub.Generate(request, timeout=10)]
        assert sum(len(c.token_ids) for c in chunks) == 40


@pytest.mark.parametrize(
    ("load_source", "client", "wire"),
    [("watch", "http", "http"), ("watch-http", "http", "http"), ("poll", "http", "http"),
     ("watch", "grpc", "http"), ("watch", "grpc", "grpc")],
)  # fmt: skip
async def test_a_report_sent_before_the_request_ended_does_not_count_it(
    start_sidecar: SidecarFactory,
    start_gateway: GatewayFactory,
    http: aiohttp.ClientSession,
    load_source: str,
    client: str,
    wire: str,
) -> None:
    """Reports reach the router 0.3 s after they were sent (``report_delay_s``), so
    those sent while the request ran arrive after it ended: the unit's count includes
    the request, and the gateway, whose in-flight count has none, counts none."""
    sidecar = await start_sidecar(sim={"decode_step_ms": 5.0})
    gw = await start_gateway(
        [sidecar],
        load_source=load_source,
        poll_interval_s=0.02,
        report_delay_s=0.3,
        grpc_unit_wire=wire,
    )
    unit = gw.router.units[sidecar.core.unit_id]
    await _complete(gw.http_url, gw.grpc_target, client, http)
    assert unit.inflight == 0
    # Wait for a report that was sent while the request ran (the unit's count has it,
    # and counts it as this gateway's).
    await wait_until(
        lambda: unit.report is not None and unit.report.outstanding == 1,
        timeout_s=3.0,
        what="a report sent while the request ran",
    )
    assert unit.report is not None and unit.report.watcher_outstanding == 1
    assert gw.router.view.estimate(unit) == 0
    await wait_until(
        lambda: unit.report is not None and unit.report.outstanding == 0, timeout_s=3.0
    )
    assert gw.router.view.estimate(unit) == 0
