"""build_store picks tiers and the definition store from settings."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.config import Settings
from service.store.factory import build_store
from tests.store.store_helpers import assert_same_block, synthetic_block


async def test_memory_store(tmp_path: Path, make_key) -> None:
    store, defs = build_store(Settings(store="memory", home=tmp_path, memory_cache_bytes=1 << 20))
    assert [t.name for t in store.tiers] == ["memory"] and defs.name == "memory"
    await store.put(make_key(), synthetic_block())
    assert (await store.get(make_key()))[1] == "memory"
    assert list(tmp_path.iterdir()) == []  # touches no disk
    await store.close()


async def test_disk_store_default(tmp_path: Path, make_key) -> None:
    store, defs = build_store(Settings(home=tmp_path))
    assert [t.name for t in store.tiers] == ["memory", "disk"] and defs.name == "disk"
    await store.put(make_key(), synthetic_block())
    await defs.put("ns", "pirate", 1, {"text": "arr"})
    assert (tmp_path / "store" / "blocks" / "fp-test" / "ns" / "h0.safetensors").is_file()
    assert (tmp_path / "store" / "skills" / "ns" / "pirate" / "1.json").is_file()
    await store.close()
    assert store.tiers[1].max_bytes == 0  # no cap unless asked
    capped, _ = build_store(Settings(home=tmp_path, disk_cache_bytes=10 << 30))
    assert capped.tiers[1].max_bytes == 10 << 30
    await capped.close()


@pytest.mark.redis
async def test_redis_store(tmp_path: Path, redis_url, make_key) -> None:
    settings = Settings(store="redis", home=tmp_path, redis_url=redis_url, redis_chunk_bytes=4096, redis_ttl_s=60)
    store, defs = build_store(settings)
    other, other_defs = build_store(settings.model_copy(update={"home": tmp_path / "replica2"}))
    try:
        assert [t.name for t in store.tiers] == ["memory", "disk", "redis"] and defs.name == "redis"
        assert store.tiers[2].chunk_bytes == 4096 and store.tiers[2].ttl_s == 60
        await store.put(make_key(), synthetic_block())
        await defs.put("ns", "pirate", 1, {"text": "arr"})
        block, src = await other.get(make_key())
        assert src == "redis"
        assert_same_block(block, synthetic_block())
        assert await other_defs.get("ns", "pirate") == {"text": "arr"}
    finally:
        for s, d in ((store, defs), (other, other_defs)):
            await s.close()
            await d.close()
