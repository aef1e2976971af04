"""API keys, TLS on every server and on gateway-to-unit calls, secrets kept out of sight."""

from __future__ import annotations

import asyncio
import logging
import ssl
import subprocess
from pathlib import Path

import aiohttp
import grpc
import openai
import pytest

from proxy.pb.unitproxy.v1 import inference_pb2, inference_pb2_grpc
from tests.conftest import GatewayFactory, SidecarFactory

pytestmark = pytest.mark.timeout(30)

KEY = "sk-test-4f1c9a"
GENERATE = inference_pb2.GenerateRequest(
    prompt="x", sampling=inference_pb2.SamplingParams(max_tokens=2)
)


@pytest.fixture(scope="session")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A throwaway CA and a server certificate for 127.0.0.1, made with openssl."""
    d = tmp_path_factory.mktemp("tls")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=30)

    run(
        "req",
        "-x509",
        *ec,
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=unitproxy test CA",
    )
    run("req", *ec, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1")
    (d / "ext.cnf").write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n"
    )
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "server.pem", "-days", "2", "-extfile", "ext.cnf")  # fmt: skip
    return {"ca": d / "ca.pem", "cert": d / "server.pem", "key": d / "server.key"}


async def test_api_keys_guard_inference_only(
    start_sidecar: SidecarFactory, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    sidecar = await start_sidecar(server={"api_keys": ["other-key", KEY]})
    url = f"{sidecar.http_url}/v1/completions"
    async with http.post(url, json={"prompt": "x", "max_tokens": 1}) as resp:
        assert resp.status == 401
        assert (await resp.json())["error"]["code"] == "missing_api_key"
    async with http.post(
        url, json={"prompt": "x"}, headers={"Authorization": "Bearer nope"}
    ) as resp:
        assert resp.status == 401
        assert (await resp.json())["error"]["code"] == "invalid_api_key"
    for path in ("/health", "/ready", "/metrics", "/load"):
        async with http.get(f"{sidecar.http_url}{path}") as resp:
            assert resp.status == 200, path
            assert KEY not in await resp.text()

    async with openai.AsyncOpenAI(
        base_url=f"{sidecar.http_url}/v1", api_key=KEY, max_retries=0
    ) as oa:
        reply = await oa.completions.create(model="unitproxy-sim", prompt="x", max_tokens=2)
        assert reply.choices[0].text
    async with openai.AsyncOpenAI(
        base_url=f"{sidecar.http_url}/v1", api_key="bad", max_retries=0
    ) as oa:
        with pytest.raises(openai.AuthenticationError):
            await oa.completions.create(model="unitproxy-sim", prompt="x", max_tokens=2)

    async with grpc.aio.insecure_channel(sidecar.grpc_target) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in stub.Generate(GENERATE, timeout=5):
                pass
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        chunks = [
            c
            async for c in stub.Generate(
                GENERATE, timeout=5, metadata=(("authorization", f"Bearer {KEY}"),)
            )
        ]
        assert sum(len(c.token_ids) for c in chunks) == 2
    assert KEY not in caplog.text
    assert sidecar.core.outstanding == 0


async def test_api_keys_from_a_file(
    start_sidecar: SidecarFactory, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    keys = tmp_path / "keys"
    keys.write_text(f"# keys for the test\n\n{KEY}\n")
    sidecar = await start_sidecar(server={"api_keys_file": str(keys)})
    headers = {"Authorization": f"Bearer {KEY}"}
    async with http.post(f"{sidecar.http_url}/v1/completions", json={"prompt": "x", "max_tokens": 1},
                         headers=headers) as resp:  # fmt: skip
        assert resp.status == 200


async def test_gateway_checks_keys_and_passes_them_on(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory, http: aiohttp.ClientSession
) -> None:
    unit = await start_sidecar(server={"api_keys": [KEY]})
    passing = await start_gateway([unit])  # keeps no keys itself: the unit decides
    body = {"prompt": "x", "max_tokens": 1}
    async with http.post(f"{passing.http_url}/v1/completions", json=body) as resp:
        assert resp.status == 401, "the unit's refusal reaches the client, not retried"
    async with http.post(f"{passing.http_url}/v1/completions", json=body,
                         headers={"Authorization": f"Bearer {KEY}"}) as resp:  # fmt: skip
        assert resp.status == 200

    own = await start_gateway([unit], unit_api_key=KEY)
    async with http.post(f"{own.http_url}/v1/completions", json=body) as resp:
        assert resp.status == 200, "the gateway presents its own unit key"
    async with grpc.aio.insecure_channel(own.grpc_target) as channel:
        chunks = [
            c async for c in inference_pb2_grpc.InferenceStub(channel).Generate(GENERATE, timeout=5)
        ]
        assert sum(len(c.token_ids) for c in chunks) == 2


async def test_tls_on_sidecar_and_gateway_to_unit(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory, certs: dict[str, Path]
) -> None:
    tls = {"tls_cert_file": str(certs["cert"]), "tls_key_file": str(certs["key"])}
    unit = await start_sidecar(server=tls)
    assert unit.http_url.startswith("https://")
    trust = ssl.create_default_context(cafile=certs["ca"])
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{unit.http_url}/ready", ssl=trust) as resp:
            assert resp.status == 200
        with pytest.raises(aiohttp.ClientConnectorError):
            async with http.get(f"{unit.http_url}/ready"):  # the system CAs do not know ours
                pass
        plain = unit.http_url.replace("https://", "http://")
        with pytest.raises(aiohttp.ClientError):
            async with http.get(f"{plain}/ready") as resp:
                await resp.read()

    credentials = grpc.ssl_channel_credentials(root_certificates=certs["ca"].read_bytes())
    async with grpc.aio.secure_channel(unit.grpc_target, credentials) as channel:
        chunks = [
            c async for c in inference_pb2_grpc.InferenceStub(channel).Generate(GENERATE, timeout=5)
        ]
        assert sum(len(c.token_ids) for c in chunks) == 2

    # The gateway reaches the unit over TLS: HTTPS, and gRPC for load reports and Generate.
    gateway = await start_gateway([unit], tls_ca_file=str(certs["ca"]))
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            f"{gateway.http_url}/v1/completions", json={"prompt": "x", "max_tokens": 2}
        ) as resp,
    ):
        assert resp.status == 200
    async with grpc.aio.insecure_channel(gateway.grpc_target) as channel:
        chunks = [
            c async for c in inference_pb2_grpc.InferenceStub(channel).Generate(GENERATE, timeout=5)
        ]
        assert sum(len(c.token_ids) for c in chunks) == 2


def test_tls_needs_both_files() -> None:
    from proxy.settings import ConfigError, load

    with pytest.raises(ConfigError) as info:
        load({"server": {"tls_cert_file": "/some/cert.pem"}})
    assert "tls_key_file" in info.value.problems[0]


async def test_an_https_unit_never_gets_plaintext_grpc(
    start_sidecar: SidecarFactory, start_gateway: GatewayFactory, certs: dict[str, Path]
) -> None:
    # A unit given as https:// but whose gRPC is plain: the gateway speaks TLS to it and
    # fails, so the unit never reports SERVING (load reports, Generate and the client's
    # key would otherwise go in clear). And one whose TLS the system's CAs do not trust.
    plain = await start_sidecar(sidecar={"unit_id": "plain"})
    tls = {"tls_cert_file": str(certs["cert"]), "tls_key_file": str(certs["key"])}
    untrusted = await start_sidecar(sidecar={"unit_id": "untrusted"}, server=tls)
    plain.http_url = plain.http_url.replace("http://", "https://")
    gateway = await start_gateway([plain, untrusted], wait=False)
    await asyncio.sleep(1.5)  # reports come within 0.1 s when the channel works
    assert gateway.router.units["plain"].report is None
    assert gateway.router.units["untrusted"].report is None


def test_tls_ca_file_with_a_plain_unit_is_a_startup_error(certs: dict[str, Path]) -> None:
    from proxy.settings import ConfigError, load

    with pytest.raises(ConfigError) as info:
        load({"gateway": {"units": ["a=http://127.0.0.1:1,127.0.0.1:2"],
                          "tls_ca_file": str(certs["ca"])}})  # fmt: skip
    assert "https://" in str(info.value)
