"""Redis tier: the safetensors payload split into chunks, committed by a manifest written last."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass

from service.kv.block import KVBlock
from service.store.base import BlockStore
from service.store.errors import REASON_CHUNKS, REASON_FORMAT, CorruptBlock, StoreUnavailable
from service.store.key import BlockKey, check_name
from service.store.redisconn import guard, make_client, redacted
from service.store.serde import decode_block, encode_block, header_length, stored_meta

log = logging.getLogger(__name__)

_BATCH_BYTES = 64 * 1024 * 1024  # bytes per pipeline / MGET round trip, so each stays within the op timeout

# Delete KEYS[1] (and KEYS[2..]) only if KEYS[1] still holds ARGV[1]: never drop a newer manifest / lock.
_COMPARE_AND_DELETE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', unpack(KEYS))
end
return 0
"""

# The commit point of a put, atomic: set the manifest KEYS[1] to ARGV[1] (PX ARGV[2] unless "0"), make this
# put's chunks KEYS[2..] persistent (ARGV[3] == "1": no TTL configured), and return the manifest it
# replaced, so the caller unlinks that one's chunks. Concurrent puts of one key thus each see the manifest
# they overwrote: no committed chunk set is left without a manifest, whichever order they commit in.
_COMMIT = """
local old = redis.call('GET', KEYS[1])
if ARGV[2] == '0' then
  redis.call('SET', KEYS[1], ARGV[1])
else
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
end
if ARGV[3] == '1' then
  for i = 2, #KEYS do redis.call('PERSIST', KEYS[i]) end
end
return old
"""

# GET + DEL in one step (GETDEL needs Redis 6.2): a delete unlinks the chunks of exactly the manifest it
# removed, never a manifest a concurrent put committed between a GET and a DEL.
_TAKE = """
local v = redis.call('GET', KEYS[1])
if v then redis.call('DEL', KEYS[1]) end
return v
"""


@dataclass(frozen=True)
class Manifest:
    """The commit record of one block: written after all its chunks."""

    n_chunks: int
    total_bytes: int
    sha256: str
    created_at: float

    def to_json(self) -> bytes:
        return json.dumps(self.__dict__, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "Manifest":
        try:
            d = json.loads(raw)
            m = cls(int(d["n_chunks"]), int(d["total_bytes"]), str(d["sha256"]), float(d["created_at"]))
        except (ValueError, KeyError, TypeError) as e:
            raise CorruptBlock(REASON_FORMAT, f"manifest: {e}") from None
        if m.n_chunks < 1 or m.total_bytes < 0 or len(m.sha256) != 64:
            raise CorruptBlock(REASON_FORMAT, "manifest fields out of range")
        return m


def _batches(sizes: list[int]) -> list[range]:
    """Split chunk indexes into consecutive runs of at most _BATCH_BYTES (at least one chunk each)."""
    out, start, acc = [], 0, 0
    for i, n in enumerate(sizes):
        if i > start and acc + n > _BATCH_BYTES:
            out.append(range(start, i))
            start, acc = i, 0
        acc += n
    out.append(range(start, len(sizes)))
    return out


class RedisBlockStore(BlockStore):
    """Keys: `<prefix>:{<key.to_str()>}:manifest|chunk:<sha16>:<i>|lock`; the hash tag keeps a block on one slot.

    Chunk keys carry the payload's sha256 prefix, so two writers of one key never mix chunks.
    Without a TTL, chunks are first written with `pending_ttl_s` and made persistent in the same atomic
    step that commits their manifest (_COMMIT), so a writer killed mid-put leaves nothing behind for
    long. That step returns the manifest it replaced, whose chunks the writer then unlinks: of
    concurrent puts to one key, the losers' chunks go too.
    """

    name = "redis"

    def __init__(self, url: str, chunk_bytes: int = 32 * 1024 * 1024, ttl_s: int | None = None,
                 prefix: str = "skillcache", *, connect_timeout_s: float = 2.0, op_timeout_s: float = 5.0,
                 pending_ttl_s: int = 3600, compression: str = "none") -> None:
        if chunk_bytes < 1:
            raise ValueError("chunk_bytes must be >= 1")
        self.url, self.where = url, redacted(url)
        self.chunk_bytes, self.ttl_s, self.prefix = chunk_bytes, ttl_s, check_name(prefix, "prefix")
        self.pending_ttl_s = pending_ttl_s
        self.compression = compression  # "none" | "int8" (serde.encode_block); reads follow the payload
        self._r = make_client(url, connect_timeout_s=connect_timeout_s, op_timeout_s=op_timeout_s)
        self._cad = self._r.register_script(_COMPARE_AND_DELETE)
        self._commit = self._r.register_script(_COMMIT)
        self._take = self._r.register_script(_TAKE)
        self.last_error: str | None = None

    # -- key names --

    def _tag(self, key: BlockKey) -> str:
        return f"{self.prefix}:{{{key.to_str()}}}"

    def manifest_key(self, key: BlockKey) -> str:
        return f"{self._tag(key)}:manifest"

    def chunk_keys(self, key: BlockKey, m: Manifest) -> list[str]:
        return [f"{self._tag(key)}:chunk:{m.sha256[:16]}:{i}" for i in range(m.n_chunks)]

    def lock_key(self, key: BlockKey) -> str:
        return f"{self._tag(key)}:lock"

    def _guard(self, write: bool = False) -> AbstractAsyncContextManager[None]:
        return guard(self.where, self.name, write=write)

    # -- BlockStore --

    async def get(self, key: BlockKey) -> KVBlock | None:
        mkey = self.manifest_key(key)
        async with self._guard():
            raw = await self._r.get(mkey)  # manifest first: no manifest, no block
            for _ in range(2):  # the second pass only after the manifest changed under the first
                if raw is None:
                    return None
                try:
                    m = Manifest.from_json(raw)
                except CorruptBlock as e:
                    await self._drop(key, e, mkey, raw, [])
                    return None
                ckeys = self.chunk_keys(key, m)
                chunks = await self._mget(ckeys, m)
                if None in chunks:
                    again = await self._r.get(mkey)
                    if again != raw:  # a put or delete replaced the block meanwhile: not corruption
                        raw = again
                        continue
                try:
                    return await asyncio.to_thread(self._assemble, key, m, chunks)
                except CorruptBlock as e:
                    await self._drop(key, e, mkey, raw, ckeys)
                    return None
            return None  # replaced again while reading that one: a plain miss, the caller compiles it

    async def _mget(self, ckeys: list[str], m: Manifest) -> list[bytes | None]:
        chunks: list[bytes | None] = []
        for batch in _batches([m.total_bytes // m.n_chunks + 1] * m.n_chunks):
            chunks.extend(await self._r.mget([ckeys[i] for i in batch]))
        return chunks

    @staticmethod
    def _assemble(key: BlockKey, m: Manifest, chunks: list[bytes | None]) -> KVBlock:
        missing = [i for i, c in enumerate(chunks) if c is None]
        if missing:
            raise CorruptBlock(REASON_CHUNKS, f"{len(missing)} of {m.n_chunks} chunks missing (evicted?)")
        data = b"".join(chunks)  # type: ignore[arg-type]
        if len(data) != m.total_bytes:
            raise CorruptBlock(REASON_CHUNKS, f"{len(data)} bytes, manifest says {m.total_bytes}")
        if hashlib.sha256(data).hexdigest() != m.sha256:
            raise CorruptBlock(REASON_CHUNKS, "payload sha256 differs from the manifest")
        return decode_block(data, key)

    async def _drop(self, key: BlockKey, err: CorruptBlock, mkey: str, raw: bytes, ckeys: list[str]) -> None:
        """Count a corrupt entry and delete it, unless a writer has replaced the manifest meanwhile."""
        self._corrupt(key, err)
        await self._cad(keys=[mkey, *ckeys], args=[raw])

    async def put(self, key: BlockKey, block: KVBlock) -> None:
        def encode() -> tuple[bytes, str]:
            data = encode_block(key, block, self.compression)
            return data, hashlib.sha256(data).hexdigest()

        data, sha = await asyncio.to_thread(encode)
        view = memoryview(data)
        sizes = [min(self.chunk_bytes, len(data) - off) for off in range(0, max(len(data), 1), self.chunk_bytes)]
        m = Manifest(len(sizes), len(data), sha, time.time())
        mkey, ckeys = self.manifest_key(key), self.chunk_keys(key, m)
        ttl_ms = int(self.ttl_s * 1000) if self.ttl_s else None
        async with self._guard(write=True):
            for batch in _batches(sizes):
                pipe = self._r.pipeline(transaction=False)
                for i in batch:
                    off = i * self.chunk_bytes
                    pipe.set(ckeys[i], view[off:off + sizes[i]], px=ttl_ms or self.pending_ttl_s * 1000)
                await pipe.execute()
            old_raw = await self._commit(keys=[mkey, *ckeys],
                                         args=[m.to_json(), ttl_ms or 0, "1" if ttl_ms is None else "0"])
            if old_raw is not None:
                await self._unlink_stale_chunks(key, old_raw, m)

    async def _unlink_stale_chunks(self, key: BlockKey, old_raw: bytes, new: Manifest) -> None:
        try:
            old = Manifest.from_json(old_raw)
        except CorruptBlock:
            return
        if old.sha256[:16] != new.sha256[:16]:
            await self._r.unlink(*self.chunk_keys(key, old))

    async def delete(self, key: BlockKey) -> bool:
        mkey = self.manifest_key(key)
        async with self._guard(write=True):
            raw = await self._take(keys=[mkey])  # manifest first: readers see a miss from here on
            if raw is None:
                return False
            try:
                await self._r.unlink(*self.chunk_keys(key, Manifest.from_json(raw)))
            except CorruptBlock:
                pass
            return True

    async def contains(self, key: BlockKey) -> bool:
        async with self._guard():
            return bool(await self._r.exists(self.manifest_key(key)))

    async def read_meta(self, key: BlockKey) -> dict[str, str] | None:
        """The meta from the payload's head (GETRANGE), no tensors; None if absent or its manifest/header is damaged."""
        async with self._guard():
            raw = await self._r.get(self.manifest_key(key))
            if raw is None:
                return None
            try:
                ckeys = self.chunk_keys(key, Manifest.from_json(raw))
                return stored_meta(await self._head(ckeys, header_length(await self._head(ckeys, 8))))
            except CorruptBlock:
                return None

    async def _head(self, ckeys: list[str], n: int) -> bytes:
        """The payload's first `n` bytes, read across chunks (a missing chunk: CorruptBlock)."""
        out = b""
        for ck in ckeys:
            if len(out) >= n:
                break
            part = await self._r.getrange(ck, 0, n - len(out) - 1)
            if not part:
                raise CorruptBlock(REASON_CHUNKS, "a chunk is missing")
            out += part
        return out

    async def delete_namespace_hash(self, namespace: str, content_hash: str) -> int:
        check_name(namespace, "namespace")
        check_name(content_hash, "content_hash")
        pattern = f"{self.prefix}:{{v*/{namespace}/*/{content_hash}}}:*"
        manifests, others = [], []
        async with self._guard(write=True):
            async for k in self._r.scan_iter(match=pattern, count=1000):
                k = k.decode()
                if k.endswith(":manifest"):
                    manifests.append(k)
                elif ":chunk:" in k:
                    others.append(k)
            if manifests:
                await self._r.unlink(*manifests)
            for i in range(0, len(others), 512):
                await self._r.unlink(*others[i:i + 512])
        return len(manifests)

    async def ping(self) -> bool:
        """PING; on failure the reason is kept in `last_error` (health reports it)."""
        try:
            async with self._guard():
                await self._r.ping()
            self.last_error = None
            return True
        except StoreUnavailable as e:
            self.last_error = str(e)
            return False

    async def close(self) -> None:
        await self._r.aclose()

    # -- cross-replica compile lock --

    async def try_lock(self, key: BlockKey, token: str, ttl_s: float) -> bool:
        """SET lock NX PX: True if this caller now holds the compile lock for `key`."""
        async with self._guard(write=True):
            return bool(await self._r.set(self.lock_key(key), token, nx=True, px=max(1, int(ttl_s * 1000))))

    async def unlock(self, key: BlockKey, token: str) -> bool:
        """Release the lock if `token` still holds it (compare-and-delete)."""
        async with self._guard(write=True):
            return bool(await self._cad(keys=[self.lock_key(key)], args=[token]))

    async def lock_held(self, key: BlockKey) -> bool:
        async with self._guard():
            return bool(await self._r.exists(self.lock_key(key)))
