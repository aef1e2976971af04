"""Tenants from a TOML file and from Redis (proxy/tenants.py): validation, key lookup,
priority, reload on change and on SIGHUP, the last good set kept on a bad file."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import uuid
from pathlib import Path

import pytest
from redis.asyncio import Redis

from proxy.errors import Forbidden, InvalidRequest, Unauthenticated
from proxy.tenants import (
    MAX_KNOWN_KEYS,
    TENANT_FIELDS,
    Tenant,
    Tenants,
    TenantsError,
    TenantSource,
    key_hash,
    parse_file,
)
from tests.conftest import wait_until
from tests.redisenv import REDIS_URL

pytestmark = pytest.mark.timeout(20)

FILE = """
[[tenant]]
name = "search"
keys = ["sk-search-1", "sk-search-2"]
priority = "interactive"
requests_per_minute = 600
tokens_per_minute = 200000
max_concurrent = 64
tokens_per_day = 50000000
models = ["llama-3-70b"]

[[tenant]]
name = "nightly"
key_sha256 = ["{}"]
priority = "batch"
""".format(hashlib.sha256(b"sk-nightly").hexdigest())


def test_a_file_gives_tenants_with_every_field() -> None:
    search, nightly = parse_file(FILE, "t.toml")
    assert (search.name, search.priority, search.requests_per_minute) == (
        "search",
        "interactive",
        600,
    )
    assert (search.tokens_per_minute, search.max_concurrent, search.tokens_per_day) == (
        200000, 64, 50000000,
    )  # fmt: skip
    assert search.models == frozenset({"llama-3-70b"})
    assert (nightly.priority, nightly.limited, nightly.models) == ("batch", False, None)


def test_keys_and_hashed_keys_identify_their_tenant() -> None:
    tenants = Tenants(parse_file(FILE, "t.toml"))
    assert tenants.identify("Bearer sk-search-2").name == "search"
    assert tenants.identify("Bearer sk-nightly").name == "nightly"  # only its sha256 is on disk
    assert tenants.identify_metadata([("authorization", b"Bearer sk-nightly")]).name == "nightly"
    with pytest.raises(Unauthenticated) as bad:
        tenants.identify("Bearer sk-other")
    assert bad.value.code == "invalid_api_key"
    with pytest.raises(Unauthenticated) as missing:
        tenants.identify(None)
    assert missing.value.code == "missing_api_key"


def test_a_key_identified_once_is_found_again_and_only_known_keys_are_kept() -> None:
    tenants = Tenants(parse_file(FILE, "t.toml"))
    search = tenants.identify("Bearer sk-search-1")
    assert tenants.identify("Bearer sk-search-1") is search  # from the kept lookup
    for _ in range(3):  # an unknown key stays unknown, and is not kept
        with pytest.raises(Unauthenticated):
            tenants.identify("Bearer sk-other")
    with pytest.raises(Unauthenticated):
        tenants.identify("sk-search-1")  # the same key without its scheme
    assert set(tenants._known) == {"Bearer sk-search-1"}
    # As many known keys as there are: the kept lookup stays bounded.
    many = Tenants([Tenant("many", [key_hash(f"k{i}") for i in range(MAX_KNOWN_KEYS + 10)])])
    for i in range(MAX_KNOWN_KEYS + 10):
        assert many.identify(f"Bearer k{i}").name == "many"
    assert 0 < len(many._known) <= MAX_KNOWN_KEYS
    assert many.identify("Bearer k0").name == "many"


def test_a_tenants_flags_follow_its_limits() -> None:
    assert not Tenant("a").limited and not Tenant("a").counts_tokens
    assert Tenant("b", max_concurrent=2).limited and not Tenant("b", max_concurrent=2).counts_tokens
    assert Tenant("c", tokens_per_day=5).limited and Tenant("c", tokens_per_day=5).counts_tokens
    assert Tenant("d", requests_per_minute=1).same_as(Tenant("d", requests_per_minute=1))
    assert not Tenant("d", requests_per_minute=1).same_as(Tenant("d", tokens_per_minute=1))
    # same_as compares every field (a compiled class has no __slots__ to read them from)
    assert set(getattr(Tenant, "__slots__", TENANT_FIELDS)) == set(TENANT_FIELDS)


def test_flat_api_keys_are_tenant_default() -> None:
    alone = Tenants.build(parse_file(FILE, "t.toml"), ["sk-flat"])
    assert alone.identify("Bearer sk-flat").name == "default"
    assert not alone.by_name["default"].limited
    with_limits = FILE + '[[tenant]]\nname = "default"\nkeys = ["sk-d"]\nrequests_per_minute = 5\n'
    merged = Tenants.build(parse_file(with_limits, "t.toml"), ["sk-flat"])
    assert merged.identify("Bearer sk-flat").requests_per_minute == 5  # the file's default


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ('[[tenant]]\nname = "Bad Name"\nkeys = ["k"]\n', "name must match"),
        ('[[tenant]]\nname = "a"\n', "tenant a: keys or key_sha256"),
        ('[[tenant]]\nname = "a"\nkeys = ["k"]\npriority = "urgent"\n', "tenant a: priority"),
        ('[[tenant]]\nname = "a"\nkeys = ["k"]\ntokens_per_minute = -1\n', "tenant a: tokens_per_minute"),
        ('[[tenant]]\nname = "a"\nkeys = ["k"]\nmax_concurent = 3\n', "tenant a: unknown field max_concurent"),
        ('[[tenant]]\nname = "a"\nkey_sha256 = ["abc"]\n', "tenant a: key_sha256 must be 64 hex"),
        ('[[tenant]]\nname = "a"\nkeys = ["k"]\nmodels = "m"\n[[tenant]]\nname = "a"\nkeys = ["j"]\n', "tenant a: the name is given twice"),
        ('[[tenant]]\nname = "a"\nkeys = ["k"]\n[[tenant]]\nname = "b"\nkeys = ["k"]\n', "tenant b: a key of it is also tenant a's"),
        ("[[tenant]\n", "not valid TOML"),
        ('[tenants]\nname = "a"\n', "unknown table tenants"),
    ],
)  # fmt: skip
def test_a_bad_file_says_which_tenant_and_field(text: str, says: str) -> None:
    with pytest.raises(TenantsError, match=says):
        Tenants(parse_file(text, "t.toml"))


def test_a_request_may_lower_its_priority_never_raise_it() -> None:
    standard = Tenant("s", ["x"], "standard")
    assert standard.priority_for(None) == "standard"
    assert standard.priority_for("batch") == "batch"
    assert standard.priority_for("interactive") == "standard"
    with pytest.raises(InvalidRequest):
        standard.priority_for("urgent")


def test_the_model_allow_list() -> None:
    tenant = Tenant("s", ["x"], models=frozenset({"m1"}))
    tenant.check_model("m1")
    with pytest.raises(Forbidden):
        tenant.check_model("m2")
    with pytest.raises(Forbidden, match="must name its model: one of m1"):
        tenant.check_model("")  # the unit's default model may be any
    Tenant("open", ["y"]).check_model("anything")


def _write(path: Path, text: str) -> None:
    path.write_text(text)
    st = path.stat()  # a new mtime even within the file system's time granularity
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


async def test_the_file_is_reloaded_when_it_changes_and_a_bad_one_keeps_the_last_good(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "tenants.toml"
    _write(path, FILE)
    source = TenantSource(path, poll_s=0.02)
    await source.load()
    task = asyncio.create_task(source.run())
    try:
        _write(path, FILE.replace("sk-search-1", "sk-search-new"))
        await wait_until(lambda: source.reloads == 1)
        assert source.current.identify("Bearer sk-search-new").name == "search"
        with pytest.raises(Unauthenticated):
            source.current.identify("Bearer sk-search-1")

        _write(path, FILE + '[[tenant]]\nname = "x"\npriority = "urgent"\nkeys = ["k"]\n')
        await wait_until(lambda: source.rejected >= 1)
        assert "keeping the last good set" in caplog.text and "tenant x: priority" in caplog.text
        assert source.current.identify("Bearer sk-search-new").name == "search"

        path.unlink()  # a missing file is a bad one too
        await wait_until(lambda: source.rejected >= 2)
        assert source.current.identify("Bearer sk-nightly").name == "nightly"
        _write(path, FILE)
        await wait_until(lambda: source.reloads == 2)
        assert source.last_error is None
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_file_written_in_place_is_read_once_whole(tmp_path: Path) -> None:
    """An editor or ``write_text`` truncates the file, then writes it: a look between the
    two finds it empty, which parses (no tenants). A change is put in force only once two
    looks in a row find the file the same."""
    path = tmp_path / "tenants.toml"
    _write(path, FILE)
    source = TenantSource(path, poll_s=3600)  # looks made by the test alone
    await source.load()
    _write(path, "")  # truncated: the new text not written yet
    assert await source.look() is False
    assert source.current.identify("Bearer sk-search-1").name == "search"
    _write(path, FILE.replace("sk-search-1", "sk-search-new"))  # written
    assert await source.look() is False  # first seen: it may still be being written
    assert source.current.identify("Bearer sk-search-1").name == "search"
    assert await source.look() is True  # the same at the next look: whole
    assert source.reloads == 1 and source.rejected == 0
    assert source.current.identify("Bearer sk-search-new").name == "search"
    assert await source.look() is False  # unchanged since it was read

    _write(path, "")  # emptied on purpose, and left so: no tenants but the flat keys
    assert await source.look() is False
    assert await source.look() is True
    with pytest.raises(Unauthenticated):
        source.current.identify("Bearer sk-search-new")


async def test_sighup_reloads_at_once(tmp_path: Path) -> None:
    path = tmp_path / "tenants.toml"
    _write(path, FILE)
    source = TenantSource(path, poll_s=3600)  # only the signal can make it look
    await source.load()
    task = asyncio.create_task(source.run())
    try:
        await asyncio.sleep(0)  # the handler is installed when run() starts
        _write(path, FILE.replace("sk-search-1", "sk-hup"))
        os.kill(os.getpid(), signal.SIGHUP)
        await wait_until(lambda: source.reloads == 1)
        assert source.current.identify("Bearer sk-hup").name == "search"
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    # the handler is gone with the task: SIGHUP is back to its default
    assert asyncio.get_running_loop().remove_signal_handler(signal.SIGHUP) is False


async def test_a_bad_first_file_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "tenants.toml"
    _write(path, '[[tenant]]\nname = "a"\n')
    with pytest.raises(TenantsError, match="tenant a"):
        await TenantSource(path).load()


async def test_tenants_from_redis_join_and_override_the_file(tmp_path: Path, redis: Redis) -> None:
    cluster = f"t{uuid.uuid4().hex[:10]}"
    path = tmp_path / "tenants.toml"
    _write(path, FILE)
    key = f"unitproxy:{cluster}:tenant:"
    try:
        await redis.set(key + "team", json.dumps({"name": "team", "keys": ["sk-team"]}))
        await redis.set(
            key + "search",
            json.dumps({"name": "search", "keys": ["sk-search-r"], "priority": "batch"}),
        )
        source = TenantSource(path, redis=redis, cluster=cluster, poll_s=0.02)
        await source.load()
        assert source.current.identify("Bearer sk-team").name == "team"
        search = source.current.identify("Bearer sk-search-r")
        assert search.priority == "batch"  # Redis's entry replaces the file's

        await redis.set(key + "bad", json.dumps({"name": "bad"}))
        assert not await source.check()
        assert source.last_error is not None and "tenant bad" in source.last_error
        assert source.current.identify("Bearer sk-team").name == "team"

        await redis.delete(key + "bad", key + "team")
        assert await source.check()
        with pytest.raises(Unauthenticated):
            source.current.identify("Bearer sk-team")
    finally:
        await redis.delete(key + "team", key + "search", key + "bad")


def test_the_gateway_refuses_to_start_on_a_bad_tenants_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from proxy import cli

    path = tmp_path / "tenants.toml"
    path.write_text('[[tenant]]\nname = "a"\nkeys = ["k"]\nrequests_per_minute = "many"\n')
    argv = ["gateway", "--unit", "a=http://127.0.0.1:9,127.0.0.1:9", "--tenants-file", str(path)]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "gateway.tenants_file" in err and "tenant a: requests_per_minute" in err


def test_tenants_from_redis_need_a_redis_url() -> None:
    from proxy import settings as config

    gateway = {"units": ["a=http://127.0.0.1:9,127.0.0.1:9"], "tenants_redis": True}
    with pytest.raises(config.ConfigError) as info:
        config.check_role("gateway", config.load({"gateway": gateway}))
    assert info.value.problems[0].startswith("gateway.tenants_redis needs redis.url")
    config.check_role("gateway", config.load({"gateway": gateway, "redis": {"url": REDIS_URL}}))


async def test_a_look_for_redis_changes_does_not_read_an_unchanged_file(
    tmp_path: Path, redis: Redis
) -> None:
    cluster = f"t{uuid.uuid4().hex[:10]}"
    path = tmp_path / "tenants.toml"
    _write(path, FILE)
    source = TenantSource(path, redis=redis, cluster=cluster)
    await source.load()
    st = path.stat()
    # the same size, inode and mtime: to the poll, the file did not change
    path.write_text(FILE.replace("sk-search-1", "sk-search-9"))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert not await source.check(reread=False)
    assert source.current.identify("Bearer sk-search-1").name == "search"
    assert await source.check()  # SIGHUP's look reads it whatever its signature
    assert source.current.identify("Bearer sk-search-9").name == "search"
