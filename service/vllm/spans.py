"""Saved spans: K/V that vLLM computed for some tokens of some prompt, kept to be copied into later prompts.

A span record is what the connector's save path took out of vLLM's cache for tokens [pos, pos + T) of a request: a
block compiled in its canonical context (`blk-...`: the chat template's opening and the skill, positions from 0), or
the tokens one step of a composition computed (`step-...`: seams and the text between blocks). Its keys carry RoPE
at the positions they were computed at; a load moves them (service/vllm/connector.py).

A rank's files are bounded (max_bytes, the connector's `max_bytes`: 1 GiB by default): the least recently saved or
loaded record goes first (a skill order's steps not seen for long, an old block), and reads as missing after.
One file per record and tensor-parallel rank, safetensors, in the connector's spans dir (a tmpfs by default):
    <dir>/<model key>/<name>.tp<size>r<rank>.safetensors
    k, v    [L, T, H_kv / tp, D] in vLLM's cache dtype (this rank's heads)
    metadata: pos (first position), ids (json), crc (CRC32 of k then v)
Written to a temporary name and renamed: a reader sees a whole record or none. A record whose CRC fails is removed
and reads as missing (vLLM computes its tokens). Only this module reads or writes the files (the `store` rule, for
files the connector shares across processes and ranks). The model key (hash of vLLM's model, dtype and layout) keeps
records of another model or layout apart.

Shared tier (optional: the connector's `redis_url`): several vLLM replicas, on one host or many, share their records
through Redis. A save writes the local file and then the same bytes to Redis (`skillcache:spans:rec:<model key>:
<file name>`) and adds the layout to the record's index (`skillcache:spans:has:<name>`, a set of `<model key>.tp<size>
r<rank>`); a read that misses locally fetches the bytes from Redis and fills the local file first (the same CRC
checks it on load). skillcache asks the index whether a block is saved anywhere before it has vLLM compile it
(SharedIndex, read only). Redis unreachable: the local tier alone, as without it (a miss: vLLM computes), retried
after a few seconds. An index entry whose record Redis no longer holds (evicted, expired) is removed when a read
misses it, so skillcache compiles the block again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
import zlib
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save as save_bytes

NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,160}$")
REDIS_PREFIX = "skillcache:spans:"
REDIS_RETRY_S = 5.0  # after a Redis error, the shared tier is skipped this long (the local tier goes on)
log = logging.getLogger("vllm.skillcache.spans")  # under vLLM's logger (the connector runs inside vLLM)


class SpanError(Exception):
    """A record that is missing, unreadable or fails its check: treat as a miss (vLLM computes)."""


@dataclass(frozen=True)
class Span:
    """One record's tensors for one rank: keys/values [L, T, H, D] at positions [pos, pos + T)."""

    pos: int
    ids: list[int]
    k: torch.Tensor
    v: torch.Tensor
    valid: tuple[int, ...] | None = None  # per layer, the first position it holds (a sliding window's layers were
    # read after vLLM freed their K/V behind the window: zeros before it); None: every layer holds every position

    @property
    def end(self) -> int:
        return self.pos + len(self.ids)

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


def model_key(model: str, dtype: str, n_layers: int, n_kv_heads: int, head_dim: int) -> str:
    raw = json.dumps([model, dtype, n_layers, n_kv_heads, head_dim]).encode()
    return hashlib.sha256(raw).hexdigest()[:16]


def check_name(name: str) -> str:
    if not isinstance(name, str) or not NAME.fullmatch(name) or name.startswith("."):
        raise SpanError(f"bad span name {name!r}")
    return name


def _crc(k: torch.Tensor, v: torch.Tensor) -> int:
    crc = zlib.crc32(k.contiguous().view(torch.uint8).numpy())
    return zlib.crc32(v.contiguous().view(torch.uint8).numpy(), crc)


def record_key(key: str, name: str, tp_size: int, rank: int) -> str:
    """Redis key of one record's file (model key, name, TP size and rank: the local file's name)."""
    return f"{REDIS_PREFIX}rec:{key}:{name}.tp{tp_size}r{rank}"


def index_key(name: str) -> str:
    """Redis set of the layouts a record is saved in (skillcache reads it: it knows names, not model keys)."""
    return f"{REDIS_PREFIX}has:{name}"


def layout(key: str, tp_size: int, rank: int) -> str:
    return f"{key}.tp{tp_size}r{rank}"


def complete(members: Iterable[str | bytes]) -> bool:
    """Some layout in an index has every rank's record (a TP-2 record needs r0 and r1)."""
    ranks: dict[str, set[int]] = {}
    for m in members:
        text = m.decode() if isinstance(m, bytes) else m
        found = re.fullmatch(r"(.+\.tp(\d+))r(\d+)", text)
        if found:
            ranks.setdefault(found.group(1), set()).add(int(found.group(3)))
    return any(got >= set(range(int(lay.rsplit(".tp", 1)[1]))) for lay, got in ranks.items())


class RedisTier:
    """The shared tier of the connector's SpanStore (sync: it runs in vLLM's scheduler and worker processes). Every
    error is a SpanError, after which the tier is skipped for REDIS_RETRY_S: a Redis that is down costs one timeout,
    not one per request."""

    def __init__(self, url: str | None = None, ttl_s: int | None = None, client=None, timeout_s: float = 2.0) -> None:
        if client is None:
            import redis

            client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.r, self.ttl_s = client, ttl_s
        self._down_until = 0.0

    def _call(self, what: str, fn):
        if time.monotonic() < self._down_until:
            raise SpanError(f"Redis skipped after an error ({what})")
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - redis-py's errors and socket errors alike: the local tier goes on
            self._down_until = time.monotonic() + REDIS_RETRY_S
            log.warning("skillcache spans: Redis %s failed (%s: %s); local tier only for %.0f s", what,
                        type(e).__name__, e, REDIS_RETRY_S)
            raise SpanError(f"Redis {what} failed: {e}") from e

    def put(self, key: str, name: str, tp_size: int, rank: int, data: bytes) -> None:
        def run():
            pipe = self.r.pipeline(transaction=False)
            pipe.set(record_key(key, name, tp_size, rank), data, ex=self.ttl_s)
            pipe.sadd(index_key(name), layout(key, tp_size, rank))
            if self.ttl_s:
                pipe.expire(index_key(name), self.ttl_s)
            pipe.execute()

        self._call("write", run)

    def get(self, key: str, name: str, tp_size: int, rank: int) -> bytes | None:
        return self._call("read", lambda: self.r.get(record_key(key, name, tp_size, rank)))

    def forget(self, key: str, name: str, tp_size: int, rank: int, record: bool = False) -> None:
        """Take the layout out of the record's index (its bytes are gone, or are dropped too: `record`)."""
        def run():
            pipe = self.r.pipeline(transaction=False)
            if record:
                pipe.delete(record_key(key, name, tp_size, rank))
            pipe.srem(index_key(name), layout(key, tp_size, rank))
            pipe.execute()

        try:
            self._call("delete", run)
        except SpanError:
            pass


REDIS_URL_ENV = "SPANS_REDIS_URL"


def remote_tier(extra: dict) -> RedisTier | None:
    """The connector's shared tier, from its kv_connector_extra_config: `redis_url` (service/vllm/launch.py), else
    SPANS_REDIS_URL in vLLM's environment (compose, Helm: a URL with a password stays off the command
    line); `redis_ttl_s` expires records. Neither: None, the spans dir alone."""
    url = extra.get("redis_url") or os.environ.get(REDIS_URL_ENV)
    if not url:
        return None
    ttl = extra.get("redis_ttl_s")
    return RedisTier(str(url), int(ttl) if ttl else None)


class SharedIndex:
    """skillcache's side (asyncio): is a record saved in the shared tier, in some layout with every rank?"""

    def __init__(self, url: str, timeout_s: float = 2.0) -> None:
        import redis.asyncio as aioredis

        self.r = aioredis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._down_until = 0.0

    async def has(self, name: str) -> bool:
        """False when Redis does not answer (vLLM compiles it, as without a shared tier)."""
        if time.monotonic() < self._down_until:
            return False
        try:
            return complete(await self.r.smembers(index_key(name)))
        except Exception as e:  # noqa: BLE001 - any Redis or socket error: not known to be saved
            self._down_until = time.monotonic() + REDIS_RETRY_S
            log.warning("shared spans index unreachable (%s: %s); compiling as if not saved", type(e).__name__, e)
            return False

    async def close(self) -> None:
        await self.r.aclose()


class SpanStore:
    """The records of one model key, for one tensor-parallel rank, with a bounded in-memory LRU of loaded ones;
    `remote`: the shared tier behind the local files."""

    def __init__(self, root: Path, key: str, tp_rank: int = 0, tp_size: int = 1, cache_bytes: int = 512 * 1024**2,
                 max_bytes: int | None = None, remote: RedisTier | None = None) -> None:
        self.key, self.remote = key, remote
        self.dir = Path(root) / key
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.cache_bytes = cache_bytes
        self._cache: OrderedDict[str, Span] = OrderedDict()
        self._held = 0
        self.max_bytes = max_bytes  # this rank's files on disk (None: unbounded); least recently used out first
        self._files: OrderedDict[str, int] | None = None  # name -> file bytes, least recently used first

    def _disk(self) -> OrderedDict[str, int]:
        """This rank's records on disk, oldest first (read once from the directory: a restarted vLLM finds them)."""
        if self._files is None:
            suffix = f".tp{self.tp_size}r{self.tp_rank}.safetensors"
            found = []
            for p in self.dir.glob(f"*{suffix}") if self.dir.is_dir() else []:
                try:
                    st = p.stat()
                except OSError:
                    continue
                found.append((st.st_mtime, p.name[:-len(suffix)], st.st_size))
            self._files = OrderedDict((name, size) for _, name, size in sorted(found))
        return self._files

    def _used(self, name: str, size: int | None = None) -> None:
        """Mark a record as just saved (size) or loaded; evict the least recently used past max_bytes."""
        files = self._disk()
        if size is None:
            if name in files:
                files.move_to_end(name)
                return
            try:  # a file this process did not write (filled from the shared tier by the scheduler side)
                size = self.path(name).stat().st_size
            except (OSError, SpanError):
                return
        files.pop(name, None)
        files[name] = size
        total = sum(files.values())
        while self.max_bytes is not None and total > self.max_bytes and len(files) > 1:
            old, n = files.popitem(last=False)
            total -= n
            self._drop(old)
            self.path(old).unlink(missing_ok=True)  # a later request that names it finds it missing: vLLM computes

    def path(self, name: str, rank: int | None = None) -> Path:
        r = self.tp_rank if rank is None else rank
        return self.dir / f"{check_name(name)}.tp{self.tp_size}r{r}.safetensors"

    def exists(self, name: str) -> bool:
        """Every rank's file is there (the scheduler side asks before it promises tokens); ranks missing locally are
        filled from the shared tier when it holds them."""
        try:
            missing = [r for r in range(self.tp_size) if not self.path(name, r).is_file()]
            return all(self._fill(name, r) for r in missing)
        except SpanError:
            return False

    def _fill(self, name: str, rank: int) -> bool:
        """Copy one rank's record from the shared tier into the local file; False when it is not there."""
        if self.remote is None:
            return False
        data = self.remote.get(self.key, name, self.tp_size, rank)
        if data is None:  # an index entry may still name it (evicted, expired): skillcache then compiles it again
            self.remote.forget(self.key, name, self.tp_size, rank)
            return False
        self._write(self.path(name, rank), data)
        if rank == self.tp_rank:
            self._drop(name)
            self._used(name, len(data))
        return True

    @staticmethod
    def _write(path: Path, data: bytes) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)

    def header(self, name: str) -> tuple[int, list[int]]:
        """(pos, ids) of a record, from rank 0's file alone (no tensor read)."""
        try:
            with safe_open(str(self.path(name, 0)), framework="pt") as f:
                meta = f.metadata() or {}
            return int(meta["pos"]), [int(t) for t in json.loads(meta["ids"])]
        except (OSError, KeyError, ValueError, TypeError, SafetensorError) as e:
            raise SpanError(f"span {name!r}: {e}") from e

    def save(self, name: str, pos: int, ids: list[int], k: torch.Tensor, v: torch.Tensor,
             valid: list[int] | None = None) -> None:
        """k, v: [L, T, H, D] of this rank; valid: per layer, the first position it holds (None: all)."""
        path = self.path(name)
        k, v = k.contiguous(), v.contiguous()
        meta = {"pos": str(pos), "ids": json.dumps(list(ids)), "crc": str(_crc(k, v))}
        if valid is not None and any(p > pos for p in valid):
            meta["valid"] = json.dumps([int(p) for p in valid])
        data = save_bytes({"k": k, "v": v}, metadata=meta)
        self._write(path, data)
        self._drop(name)
        self._used(name, len(data))
        if self.remote is not None:
            try:
                self.remote.put(self.key, name, self.tp_size, self.tp_rank, data)
            except SpanError as e:  # saved locally; other replicas compute it
                log.warning("skillcache span %r saved locally only: %s", name, e)

    def load(self, name: str) -> Span:
        span = self._cache.get(name)
        self._used(name)
        if span is not None:
            self._cache.move_to_end(name)
            return span
        path = self.path(name)
        if not path.is_file():
            try:
                self._fill(name, self.tp_rank)
            except SpanError:
                pass  # read as missing below
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                k, v = f.get_tensor("k"), f.get_tensor("v")
            valid = tuple(int(p) for p in json.loads(meta["valid"])) if "valid" in meta else None
            span = Span(int(meta["pos"]), [int(t) for t in json.loads(meta["ids"])], k, v, valid)
        except (OSError, KeyError, ValueError, TypeError, RuntimeError, SafetensorError) as e:
            raise SpanError(f"span {name!r} unreadable: {e}") from e
        if str(_crc(k, v)) != meta.get("crc") or k.shape[1] != len(span.ids) or k.shape != v.shape:
            path.unlink(missing_ok=True)  # gone: the scheduler side now finds it missing, and its owner saves it anew
            if self.remote is not None:  # the shared copy too (it may be the corrupt one)
                self.remote.forget(self.key, name, self.tp_size, self.tp_rank, record=True)
            raise SpanError(f"span {name!r} fails its check (corrupt or cut); removed")
        self._cache[name] = span
        self._held += span.nbytes
        while self._held > self.cache_bytes and len(self._cache) > 1:
            self._held -= self._cache.popitem(last=False)[1].nbytes
        return span

    def _drop(self, name: str) -> None:
        old = self._cache.pop(name, None)
        if old is not None:
            self._held -= old.nbytes
