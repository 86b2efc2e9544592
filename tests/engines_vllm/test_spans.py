"""Saved spans (service/vllm/spans.py): one safetensors file per record and TP rank, CRC-checked, names confined to
the store's directory, a bounded LRU of loaded records. Runs in the service's venv (torch and safetensors only)."""

from __future__ import annotations

import pytest
import torch

from service.vllm.spans import SpanError, SpanStore, model_key

L, H, D = 2, 2, 4


def kv(t: int, seed: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, t, H, D, generator=g).to(dtype), torch.randn(L, t, H, D, generator=g).to(dtype)


def store(root, rank: int = 0, size: int = 1, cache_bytes: int = 1 << 20) -> SpanStore:
    return SpanStore(root, "key", rank, size, cache_bytes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_saved_span_loads_back_exactly_with_its_header(tmp_path, dtype):
    s = store(tmp_path)
    k, v = kv(6, dtype=dtype)
    assert not s.exists("blk-a")
    s.save("blk-a", 12, [5, 6, 7, 8, 9, 10], k, v)
    assert s.exists("blk-a") and s.header("blk-a") == (12, [5, 6, 7, 8, 9, 10])
    span = store(tmp_path).load("blk-a")  # another process's store: read from the file
    assert span.pos == 12 and span.ids == [5, 6, 7, 8, 9, 10] and span.end == 18
    assert span.k.dtype == dtype and torch.equal(span.k, k) and torch.equal(span.v, v)
    assert s.path("blk-a").parent == tmp_path / "key"
    assert [p.name for p in (tmp_path / "key").iterdir()] == [s.path("blk-a").name]  # no temporary file left


def test_a_resave_replaces_the_record_and_the_cached_copy(tmp_path):
    s = store(tmp_path)
    s.save("step-d-0", 0, [1, 2, 3], *kv(3, seed=1))
    assert s.load("step-d-0").ids == [1, 2, 3]
    k, v = kv(2, seed=2)
    s.save("step-d-0", 4, [8, 9], k, v)
    span = s.load("step-d-0")
    assert (span.pos, span.ids) == (4, [8, 9]) and torch.equal(span.k, k)


def test_exists_needs_every_tp_ranks_file_and_each_rank_loads_its_own(tmp_path):
    r0, r1 = store(tmp_path, 0, 2), store(tmp_path, 1, 2)
    k0, v0 = kv(4, seed=3)
    k1, v1 = kv(4, seed=4)
    r0.save("blk-a", 0, [1, 2, 3, 4], k0, v0)
    assert not r0.exists("blk-a") and not r1.exists("blk-a")  # rank 1's heads are not there yet
    r1.save("blk-a", 0, [1, 2, 3, 4], k1, v1)
    assert r0.exists("blk-a") and r1.exists("blk-a")
    assert torch.equal(r0.load("blk-a").k, k0) and torch.equal(r1.load("blk-a").k, k1)
    assert r1.header("blk-a") == (0, [1, 2, 3, 4])
    assert not store(tmp_path, 0, 4).exists("blk-a")  # a record of another TP size is another record
    assert not store(tmp_path, 0, 1).exists("blk-a")


@pytest.mark.parametrize("name", ["../escape", "a/b", "/abs", "..", ".hidden", "", "x" * 161, "sp ace", "a\nb", "blk\n",
                                  "naïve", None, 7])
def test_a_name_that_could_leave_the_directory_or_is_malformed_is_refused(tmp_path, name):
    s = store(tmp_path / "root")
    with pytest.raises(SpanError):
        s.save(name, 0, [1], *kv(1))
    with pytest.raises(SpanError):
        s.load(name)
    with pytest.raises(SpanError):
        s.header(name)
    assert s.exists(name) is False
    assert not tmp_path.joinpath("escape").exists() and not (tmp_path / "root").exists()


def test_a_name_at_the_length_limit_and_with_every_allowed_character_is_kept(tmp_path):
    s = store(tmp_path)
    for name in ["x" * 160, "blk-AZaz09_.:-"]:
        s.save(name, 0, [1], *kv(1))
        assert s.exists(name) and s.load(name).ids == [1]


@pytest.mark.parametrize("damage", ["flip a value byte", "flip a header byte", "cut", "empty", "other tensors"])
def test_a_corrupt_or_cut_record_reads_as_a_span_error(tmp_path, damage):
    s = store(tmp_path)
    s.save("blk-a", 0, [1, 2, 3], *kv(3))
    path = s.path("blk-a")
    raw = bytearray(path.read_bytes())
    if damage == "flip a value byte":
        raw[-3] ^= 0x40
    elif damage == "flip a header byte":
        raw[12] = ord("#")
    elif damage == "cut":
        raw = raw[:-9]
    elif damage == "empty":
        raw = bytearray()
    if damage == "other tensors":  # the record's own metadata (crc included) over other K/V
        from safetensors import safe_open
        from safetensors.torch import save_file

        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata()
        k, v = kv(3, seed=9)
        save_file({"k": k, "v": v}, str(path), metadata=meta)
    else:
        path.write_bytes(bytes(raw))
    with pytest.raises(SpanError):
        store(tmp_path).load("blk-a")
    if damage in ("cut", "empty", "flip a header byte"):  # the header itself is gone: the scheduler's check fails too
        with pytest.raises(SpanError):
            s.header("blk-a")


def test_a_record_whose_ids_do_not_match_its_tokens_is_refused(tmp_path):
    s = store(tmp_path)
    s.save("blk-a", 0, [1, 2, 3, 4], *kv(3))  # 4 ids for 3 tokens
    with pytest.raises(SpanError):
        store(tmp_path).load("blk-a")


def test_the_loaded_records_are_an_lru_bounded_by_bytes(tmp_path):
    one = 2 * L * 4 * H * D * 4  # a 4-token float32 record's k and v
    s = store(tmp_path, cache_bytes=2 * one)  # room for two
    old = {n: kv(4, seed=i) for i, n in enumerate("abc")}
    for n, (k, v) in old.items():
        s.save(n, 0, [1, 2, 3, 4], k, v)
    s.load("a"), s.load("b"), s.load("a"), s.load("c")  # "b" is the least recently used: it goes
    other = store(tmp_path)  # another process rewrites every record
    new = {n: kv(4, seed=10 + i) for i, n in enumerate("abc")}
    for n, (k, v) in new.items():
        other.save(n, 0, [1, 2, 3, 4], k, v)
    assert torch.equal(s.load("a").k, old["a"][0]) and torch.equal(s.load("c").k, old["c"][0])  # held
    assert torch.equal(s.load("b").k, new["b"][0])  # read again from its file


def test_a_record_larger_than_the_bound_is_still_served_alone(tmp_path):
    s = store(tmp_path, cache_bytes=16)
    k, v = kv(4)
    s.save("big", 0, [1, 2, 3, 4], k, v)
    s.save("big2", 0, [1, 2, 3, 4], k, v)
    assert torch.equal(s.load("big").k, k) and torch.equal(s.load("big2").v, v)
    store(tmp_path).save("big", 0, [1, 2, 3, 4], *kv(4, seed=5))
    assert not torch.equal(s.load("big").k, k)  # "big" was evicted when "big2" came in


def test_the_model_key_separates_models_dtypes_and_layouts(tmp_path):
    base = ("org/model", "bfloat16", 24, 8, 64)
    key = model_key(*base)
    assert key == model_key(*base) and len(key) == 16
    others = [("org/other", "bfloat16", 24, 8, 64), ("org/model", "float32", 24, 8, 64),
              ("org/model", "float16", 24, 8, 64), ("org/model", "bfloat16", 12, 8, 64),
              ("org/model", "bfloat16", 24, 4, 64), ("org/model", "bfloat16", 24, 8, 128)]
    assert len({key, *(model_key(*o) for o in others)}) == len(others) + 1
    a, b = SpanStore(tmp_path, key), SpanStore(tmp_path, model_key(*others[1]))
    a.save("blk-a", 0, [1], *kv(1))
    assert a.exists("blk-a") and not b.exists("blk-a")  # a record of another layout is not found


def test_the_files_stay_within_max_bytes_least_recently_used_out_first(tmp_path):
    def kv(n):
        return torch.ones(2, n, 1, 4), torch.ones(2, n, 1, 4)

    probe = SpanStore(tmp_path / "probe", "k")
    probe.save("x", 0, list(range(8)), *kv(8))
    size = probe.path("x").stat().st_size
    store = SpanStore(tmp_path, "k", max_bytes=3 * size)
    for name in ("a", "b", "c"):
        store.save(name, 0, list(range(8)), *kv(8))
    store.load("a")  # used: now b is the least recently used
    store.save("d", 0, list(range(8)), *kv(8))
    assert [store.exists(n) for n in "abcd"] == [True, False, True, True]
    again = SpanStore(tmp_path, "k", max_bytes=3 * size)  # a restarted vLLM: the files on disk count, oldest first
    again.save("e", 0, list(range(8)), *kv(8))
    assert sum(again.exists(n) for n in "acde") == 3 and again.exists("e")


# ---- the shared tier: Redis behind each replica's spans dir (a real redis-server) ---------------------------------
@pytest.fixture(scope="module")
def redis_url():
    from redis_server import RedisServer, redis_or_skip

    redis_or_skip()
    with RedisServer() as srv:
        yield srv.url


@pytest.fixture
def shared(redis_url):
    import redis

    from service.vllm.spans import RedisTier

    r = redis.Redis.from_url(redis_url)
    r.flushdb()
    yield lambda: RedisTier(redis_url)
    r.close()


def test_a_record_saved_through_one_replica_is_read_by_another_from_redis_and_fills_its_local_tier(tmp_path, shared):
    a = SpanStore(tmp_path / "a", "key", remote=shared())
    b = SpanStore(tmp_path / "b", "key", remote=shared())  # another host: its own spans dir
    k, v = kv(5, seed=1)
    a.save("blk-a", 3, [1, 2, 3, 4, 5], k, v)
    assert a.path("blk-a").is_file() and not b.path("blk-a").is_file()
    assert b.exists("blk-a") and b.path("blk-a").is_file()  # the scheduler side's check fills the local tier
    assert b.header("blk-a") == (3, [1, 2, 3, 4, 5])
    span = SpanStore(tmp_path / "b", "key").load("blk-a")  # the worker, local files only: already there
    assert torch.equal(span.k, k) and torch.equal(span.v, v)
    c = SpanStore(tmp_path / "c", "key", remote=shared())
    assert torch.equal(c.load("blk-a").v, v)  # a load that misses locally reads Redis too
    assert not SpanStore(tmp_path / "d", "other", remote=shared()).exists("blk-a")  # another model key: not found


async def test_skillcache_sees_a_block_in_the_shared_index_once_every_rank_saved_it(tmp_path, shared, redis_url):
    from service.vllm.spans import SharedIndex, complete

    index = SharedIndex(redis_url)
    try:
        assert not await index.has("blk-a")
        r0 = SpanStore(tmp_path, "key", 0, 2, remote=shared())
        r1 = SpanStore(tmp_path, "key", 1, 2, remote=shared())
        r0.save("blk-a", 0, [1, 2], *kv(2))
        assert not await index.has("blk-a")  # rank 1's heads are not there yet
        r1.save("blk-a", 0, [1, 2], *kv(2, seed=3))
        assert await index.has("blk-a")
    finally:
        await index.close()
    assert complete([b"k.tp1r0"]) and complete(["k.tp2r1", "k.tp2r0"]) and not complete(["k.tp2r1", "j.tp2r0"])


async def test_a_record_redis_lost_leaves_the_index_when_a_read_misses_it(tmp_path, shared, redis_url):
    import redis

    from service.vllm.spans import SharedIndex, record_key

    SpanStore(tmp_path / "a", "key", remote=shared()).save("blk-a", 0, [1], *kv(1))
    redis.Redis.from_url(redis_url).delete(record_key("key", "blk-a", 1, 0))  # evicted by maxmemory, expired
    index = SharedIndex(redis_url)
    try:
        assert await index.has("blk-a")
        assert not SpanStore(tmp_path / "b", "key", remote=shared()).exists("blk-a")
        assert not await index.has("blk-a")  # skillcache compiles it again
    finally:
        await index.close()


def test_a_corrupt_copy_in_redis_is_dropped_there_too(tmp_path, shared, redis_url):
    import redis

    from service.vllm.spans import record_key

    SpanStore(tmp_path / "a", "key", remote=shared()).save("blk-a", 0, [1, 2, 3], *kv(3))
    r = redis.Redis.from_url(redis_url)
    raw = bytearray(r.get(record_key("key", "blk-a", 1, 0)))
    raw[-3] ^= 0x40
    r.set(record_key("key", "blk-a", 1, 0), bytes(raw))
    b = SpanStore(tmp_path / "b", "key", remote=shared())
    with pytest.raises(SpanError):
        b.load("blk-a")
    assert r.get(record_key("key", "blk-a", 1, 0)) is None and not b.exists("blk-a")


def test_redis_down_leaves_the_local_tier_working_and_a_remote_miss_a_miss(tmp_path):
    from redis_server import RedisServer, redis_or_skip

    from service.vllm.spans import RedisTier, SharedIndex

    redis_or_skip()
    srv = RedisServer().start()
    url = srv.url
    a = SpanStore(tmp_path / "a", "key", remote=RedisTier(url, timeout_s=0.5))
    a.save("blk-a", 0, [1], *kv(1))
    srv.close()  # Redis gone
    a.save("blk-b", 0, [2], *kv(1, seed=2))  # saved locally, the Redis write logged
    assert a.exists("blk-a") and a.exists("blk-b") and a.load("blk-b").ids == [2]
    b = SpanStore(tmp_path / "b", "key", remote=RedisTier(url, timeout_s=0.5))
    assert not b.exists("blk-a")  # a miss: vLLM computes it
    with pytest.raises(SpanError):
        b.load("blk-a")

    async def ask() -> bool:
        index = SharedIndex(url, timeout_s=0.5)
        try:
            return await index.has("blk-a")
        finally:
            await index.close()

    import asyncio

    assert asyncio.run(ask()) is False  # skillcache: not known to be saved, so vLLM compiles it


def test_the_connector_finds_its_redis_in_its_config_or_in_vllms_environment(monkeypatch):
    from service.vllm.spans import REDIS_URL_ENV, RedisTier, remote_tier

    monkeypatch.delenv(REDIS_URL_ENV, raising=False)
    assert remote_tier({"spans_dir": "/x"}) is None  # local tier only, as without Redis
    tier = remote_tier({"redis_url": "redis://a:1/0", "redis_ttl_s": 60})
    assert isinstance(tier, RedisTier) and tier.ttl_s == 60
    assert tier.r.connection_pool.connection_kwargs["host"] == "a"
    monkeypatch.setenv(REDIS_URL_ENV, "redis://b:2/0")
    assert remote_tier({}).r.connection_pool.connection_kwargs["host"] == "b"
    assert remote_tier({"redis_url": "redis://a:1/0"}).r.connection_pool.connection_kwargs["host"] == "a"
