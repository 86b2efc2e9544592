"""Skill definitions: memory, disk and Redis implementations behave the same."""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from service.store.definitions import DefinitionStore, DiskDefinitionStore, MemoryDefinitionStore
from service.store.definitions_redis import RedisDefinitionStore


@pytest.fixture(params=["memory", "disk", pytest.param("redis", marks=pytest.mark.redis)])
async def defs(request, tmp_path: Path) -> AsyncIterator[DefinitionStore]:
    if request.param == "memory":
        store: DefinitionStore = MemoryDefinitionStore()
    elif request.param == "disk":
        store = DiskDefinitionStore(tmp_path / "skills")
    else:
        store = RedisDefinitionStore(request.getfixturevalue("redis_url"))
    yield store
    await store.close()


def doc(name: str, version: int, text: str = "be helpful") -> dict:
    return {"name": name, "version": version, "text": text, "tags": ["a", "é"]}


async def test_versions_latest_list_delete(defs: DefinitionStore) -> None:
    assert (await defs.get("ns", "pirate") is None and await defs.list("ns") == []
            and await defs.versions("ns", "x") == [])
    for v in (1, 2, 10):
        await defs.put("ns", "pirate", v, doc("pirate", v))
    await defs.put("ns", "chef", 1, doc("chef", 1))
    await defs.put("other", "pirate", 7, doc("pirate", 7))
    assert await defs.versions("ns", "pirate") == [1, 2, 10]  # numeric order, not "1", "10", "2"
    assert await defs.get("ns", "pirate") == doc("pirate", 10)
    assert await defs.get("ns", "pirate", 2) == doc("pirate", 2)
    assert await defs.get("ns", "pirate", 3) is None
    assert await defs.list("ns") == [doc("chef", 1), doc("pirate", 10)]
    await defs.put("ns", "pirate", 2, doc("pirate", 2, "edited"))  # same version: replaced
    assert (await defs.get("ns", "pirate", 2))["text"] == "edited"
    deleted = await defs.delete("ns", "pirate")
    assert [d["version"] for d in deleted] == [1, 2, 10]
    assert await defs.get("ns", "pirate") is None and await defs.versions("ns", "pirate") == []
    assert await defs.list("ns") == [doc("chef", 1)] and await defs.delete("ns", "pirate") == []
    assert await defs.get("other", "pirate") == doc("pirate", 7)
    assert await defs.ping()


async def test_namespaces_lists_every_namespace_with_docs(defs: DefinitionStore) -> None:
    before = set(await defs.namespaces())  # a shared Redis may hold other tests' namespaces
    await defs.put("ns-a", "x", 1, doc("x", 1))
    await defs.put("ns-a.sessions", "s-1", 1, doc("s-1", 1))
    await defs.put("ns-b", "y", 3, doc("y", 3))
    got = await defs.namespaces()
    assert got == sorted(got) and set(got) - before == {"ns-a", "ns-a.sessions", "ns-b"}


@pytest.mark.parametrize("bad", ["../etc", "a/b", "", ".x", "a b", "x" * 200, "{ns}"])
async def test_rejects_unsafe_names(defs: DefinitionStore, bad: str) -> None:
    with pytest.raises(ValueError):
        await defs.put(bad, "ok", 1, doc("ok", 1))
    with pytest.raises(ValueError):
        await defs.put("ns", bad, 1, doc("ok", 1))
    with pytest.raises(ValueError):
        await defs.get("ns", bad)


async def test_rejects_bad_versions_and_docs(defs: DefinitionStore) -> None:
    for v in (-1, True, "1"):
        with pytest.raises(ValueError):
            await defs.put("ns", "x", v, doc("x", 1))  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        await defs.put("ns", "x", 1, ["not", "a", "dict"])  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        await defs.put("ns", "x", 1, {"obj": object()})


async def test_disk_layout_and_crash_leftovers_ignored(tmp_path: Path) -> None:
    root = tmp_path / "skills"
    defs = DiskDefinitionStore(root)
    await defs.put("ns", "pirate", 1, doc("pirate", 1))
    d = root / "ns" / "pirate"
    assert json.loads((d / "1.json").read_text()) == doc("pirate", 1)
    assert sorted(os.listdir(d)) == ["1.json"]  # no temp files left behind
    (d / ".2.json.1a2b3c.tmp").write_text('{"name": "pirate", "vers')  # killed mid-write of version 2
    (root / "ns" / ".chef.deleted.abcd").mkdir()  # killed between rename and rmtree of a delete
    (root / "ns" / ".chef.deleted.abcd" / "1.json").write_text(json.dumps(doc("chef", 1)))
    restarted = DiskDefinitionStore(root)
    assert await restarted.versions("ns", "pirate") == [1]
    assert await restarted.get("ns", "pirate") == doc("pirate", 1)
    assert await restarted.list("ns") == [doc("pirate", 1)]
    await restarted.put("ns", "pirate", 2, doc("pirate", 2))  # a later write of the same version is fine
    assert await restarted.get("ns", "pirate") == doc("pirate", 2)


async def test_disk_damaged_file_skipped(tmp_path: Path) -> None:
    defs = DiskDefinitionStore(tmp_path)
    await defs.put("ns", "pirate", 1, doc("pirate", 1))
    (tmp_path / "ns" / "pirate" / "2.json").write_text("{broken")  # not something our writes produce
    assert await defs.get("ns", "pirate") == doc("pirate", 1) and await defs.get("ns", "pirate", 2) is None


@pytest.mark.redis
async def test_redis_definitions_shared_between_clients(redis_url) -> None:
    a, b = RedisDefinitionStore(redis_url), RedisDefinitionStore(redis_url)
    try:
        await a.put("ns", "pirate", 1, doc("pirate", 1))
        assert await b.get("ns", "pirate") == doc("pirate", 1)
        assert [d["name"] for d in await b.delete("ns", "pirate")] == ["pirate"]
        assert await a.list("ns") == []
    finally:
        await a.close()
        await b.close()


@pytest.mark.redis
async def test_redis_damaged_value_skipped_counted_listing_intact(redis_url, sync_redis) -> None:
    """Like the disk store: a value that is not a JSON object is logged, counted and skipped."""
    from tests.store.store_helpers import metric

    defs = RedisDefinitionStore(redis_url)
    try:
        for name in ("cook", "pirate", "poet"):
            await defs.put("ns", name, 1, doc(name, 1))
        sync_redis.hset("skillcache:def:{ns}:skill:pirate", "2", '{"name": "pirate", "vers')  # truncated
        sync_redis.hset("skillcache:def:{ns}:skill:poet", "1", "[1, 2]")  # JSON, but not a doc
        before = metric("skillcache_store_corrupt_total", tier="definitions", reason="format")
        assert await defs.get("ns", "pirate") == doc("pirate", 1)  # the newest readable version
        assert await defs.get("ns", "pirate", 2) is None and await defs.get("ns", "poet") is None
        assert [d["name"] for d in await defs.list("ns")] == ["cook", "pirate"]
        assert metric("skillcache_store_corrupt_total", tier="definitions", reason="format") > before
        assert await defs.delete("ns", "pirate") == [doc("pirate", 1)]
    finally:
        await defs.close()
