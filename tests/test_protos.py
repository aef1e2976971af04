"""The committed gRPC stubs in proxy/pb match what scripts/gen_protos.py makes now."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parent.parent
COMMITTED = ROOT / "proxy" / "pb"
REGENERATE = "stubs in proxy/pb are stale: run `python scripts/gen_protos.py` and commit the result"


def _gen_protos() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _stubs(pb: Path) -> dict[str, bytes]:
    """Every file under a proxy/pb tree, by relative path; bytecode caches left out."""
    return {
        path.relative_to(pb).as_posix(): path.read_bytes()
        for path in sorted(pb.rglob("*"))
        if path.is_file() and "__pycache__" not in path.parts
    }


def test_committed_stubs_are_what_the_generator_makes(tmp_path: Path) -> None:
    made = _gen_protos().generate(tmp_path)
    assert made, "gen_protos.generate() made no files"
    fresh = _stubs(tmp_path / "proxy" / "pb")
    committed = _stubs(COMMITTED)

    missing = sorted(fresh.keys() - committed.keys())
    extra = sorted(committed.keys() - fresh.keys())
    differ = sorted(
        name for name in fresh.keys() & committed.keys() if fresh[name] != committed[name]
    )
    assert not missing, f"{REGENERATE} (not committed: {missing})"
    assert not extra, f"{REGENERATE} (committed but no longer generated: {extra})"
    assert not differ, f"{REGENERATE} (differ: {differ})"


def test_every_proto_has_its_stubs() -> None:
    for proto in (ROOT / "protos").rglob("*.proto"):
        package = COMMITTED / proto.relative_to(ROOT / "protos").parent
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            stub = package / f"{proto.stem}{suffix}"
            assert stub.is_file(), f"{stub} is missing: run `python scripts/gen_protos.py`"


@pytest.mark.parametrize(
    "name",
    [
        "proxy.pb.unitproxy.v1.inference_pb2",
        "proxy.pb.unitproxy.v1.inference_pb2_grpc",
        "proxy.pb.unitproxy.v1.load_pb2",
        "proxy.pb.unitproxy.v1.load_pb2_grpc",
    ],
)
def test_stub_modules_import(name: str) -> None:
    assert importlib.import_module(name) is not None


def test_generate_request_round_trips() -> None:
    from proxy.pb.unitproxy.v1 import inference_pb2 as pb

    request = pb.GenerateRequest(
        request_id="r-1",
        model="m",
        chat=pb.ChatMessages(
            messages=[pb.ChatMessage(role="user", content='say "hi"\nin \u00e9\U0001f600')]
        ),
        sampling=pb.SamplingParams(max_tokens=16, temperature=0.5, top_k=-1, stop=["\n"], seed=7),
        metadata={"tenant": "a"},
    )
    back = pb.GenerateRequest.FromString(request.SerializeToString())
    assert back == request
    assert back.WhichOneof("input") == "chat"
    assert back.chat.messages[0].content == 'say "hi"\nin \u00e9\U0001f600'
    assert back.sampling.HasField("max_tokens") and back.sampling.max_tokens == 16
    assert not back.sampling.HasField("top_p")
    assert back.metadata["tenant"] == "a"

    ids = pb.GenerateRequest(request_id="r-2", prompt_token_ids=pb.PromptTokenIds(ids=[1, 2, 3]))
    back = pb.GenerateRequest.FromString(ids.SerializeToString())
    assert back.WhichOneof("input") == "prompt_token_ids"
    assert list(back.prompt_token_ids.ids) == [1, 2, 3]


def test_load_report_round_trips() -> None:
    from proxy.pb.unitproxy.v1 import load_pb2 as pb

    report = pb.LoadReport(
        unit_id="unit-0",
        state=pb.SERVING,
        outstanding=3,
        capacity=64,
        running=2,
        waiting=1,
        kv_cache_usage=-1.0,
        nodes=[
            pb.NodeStatus(name="leader", role="leader", address="127.0.0.1:1", healthy=True),
            pb.NodeStatus(
                name="f0", role="follower", address="127.0.0.1:2", healthy=False, reason="down"
            ),
        ],
        seq=2**40,
        timestamp_ms=1_700_000_000_000,
        http_url="http://127.0.0.1:8080",
        grpc_target="127.0.0.1:50051",
    )
    back = pb.LoadReport.FromString(report.SerializeToString())
    assert back == report
    assert back.state == pb.SERVING
    assert pb.UnitState.Name(back.state) == "SERVING"
    assert back.kv_cache_usage == -1.0
    assert [n.name for n in back.nodes] == ["leader", "f0"]
    assert back.nodes[1].reason == "down"
