"""Disk tier: one safetensors file per block, `<root>/<model_fp>/<namespace>/<content_hash>.safetensors`."""

from __future__ import annotations

import asyncio
import glob
import logging
import os
import threading
import time
from pathlib import Path

from service.kv.block import LAYOUT_VERSION, KVBlock
from service.metrics import STORE_EVICTIONS
from service.store.base import BlockStore
from service.store.errors import CorruptBlock, StoreUnavailable
from service.store.fsutil import TEMP_SUFFIX, atomic_write, sweep_temp, write_error
from service.store.key import BlockKey, check_name
from service.store.serde import decode_block, encode_block, header_length, stored_meta

log = logging.getLogger(__name__)

SUFFIX = ".safetensors"
_RESCAN_SHARE = 0.1  # a process recounts after writing this share of the cap, however fast it writes
_UNCAPPED_SWEEP_S = 600.0  # without a cap a walk only sweeps temp files, which are an hour old at the soonest


class DiskBlockStore(BlockStore):
    """Atomic, crash-safe files; all blocking I/O runs in worker threads.

    The layout version is not part of the path: a block of an older layout is detected on read
    (CorruptBlock "layout"), dropped and rewritten by the caller.

    `max_bytes` > 0 caps the block files plus the temp files of writes in flight or left by a crash: a
    put that takes the total over it deletes the least recently used block files (a read refreshes a
    file's mtime) down to 90% of the cap, never the file just written. Each process adds its own writes
    to the total and recounts it from the directory (seeing the other processes' writes) at a put at
    least `rescan_s` after the last count or after writing 10% of the cap since it, and at each
    eviction. So N processes sharing a directory overshoot the cap by at most the smaller of N x 10% of
    it and what they all write within `rescan_s`. Blocks are derived data: an evicted one is compiled (or
    read from Redis) again on its next use.

    Temp files older than `sweep_temp_age_s` (a crash mid-write) are removed at startup and at every
    recount (every 10 min of puts without a cap); younger ones may be another process's write in flight.
    """

    name = "disk"

    def __init__(self, root: Path | str, *, sweep_temp_age_s: float | None = 3600.0,
                 compression: str = "none", max_bytes: int = 0, rescan_s: float = 2.0) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.rescan_s = rescan_s
        self.sweep_temp_age_s = sweep_temp_age_s
        self._total: int | None = None  # bytes of block and temp files, counted on the first capped put
        self._scanned_at = time.monotonic()  # the startup sweep below counts as the first walk
        self._since_scan = 0  # bytes this process wrote since the last count
        self._size_lock = threading.Lock()
        self.compression = compression  # "none" | "int8" (serde.encode_block); reads follow the payload
        self.last_error: str | None = None
        if sweep_temp_age_s is not None and self.root.is_dir():
            sweep_temp(self.root, sweep_temp_age_s)

    def path_for(self, key: BlockKey) -> Path:
        return self.root / key.model_fingerprint / key.namespace / f"{key.content_hash}{SUFFIX}"

    def list_keys(self, prefix: str) -> list[tuple[BlockKey, float]]:
        """(key, file mtime) of the blocks whose content hash starts with `prefix`, any model and namespace
        (blocking: run it in a thread). The layout version is not part of a path: keys carry the current one."""
        out = []
        for path in self.root.glob(f"*/*/{glob.escape(prefix)}*{SUFFIX}"):  # <fingerprint>/<namespace>/<hash>
            try:
                key = BlockKey(path.parent.parent.name, LAYOUT_VERSION, path.parent.name, path.name[: -len(SUFFIX)])
                out.append((key, path.stat().st_mtime))
            except (ValueError, OSError):
                continue  # not a block file, or deleted meanwhile
        return out

    # -- blocking helpers (run in threads) --

    def _read(self, path: Path) -> tuple[bytes, int] | None:
        try:
            with open(path, "rb") as f:
                return f.read(), os.fstat(f.fileno()).st_ino
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:
            raise StoreUnavailable(f"disk store at {self.root}: cannot read {path.name}: {e}") from e

    def _load(self, key: BlockKey) -> KVBlock | None:
        path = self.path_for(key)
        got = self._read(path)
        if got is None:
            return None
        data, inode = got
        try:
            block = decode_block(data, key)
        except CorruptBlock as e:
            self._corrupt(key, e)
            self._unlink_if_same(path, inode)
            return None
        if self.max_bytes:
            try:
                os.utime(path)  # recently used: the last to be evicted
            except OSError:
                pass  # a read-only volume or a concurrent delete: the read still stands
        return block

    def _read_meta(self, key: BlockKey) -> dict[str, str] | None:
        """The block's meta from its file's header alone; None when there is no file or its header is damaged
        (a read of the block drops such a file)."""
        try:
            with open(self.path_for(key), "rb") as f:
                head = f.read(8)
                try:
                    return stored_meta(head + f.read(header_length(head) - 8))
                except CorruptBlock:
                    return None
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:
            raise StoreUnavailable(f"disk store at {self.root}: cannot read {key.to_str()}: {e}") from e

    def _unlink_if_same(self, path: Path, inode: int) -> None:
        """Delete `path` unless a concurrent put already replaced it with a new file."""
        try:
            if os.stat(path).st_ino == inode:
                os.unlink(path)
        except OSError as e:
            log.warning("disk store: could not remove corrupt %s: %s", path, e)

    def _store(self, key: BlockKey, block: KVBlock) -> None:
        data = encode_block(key, block, self.compression)
        path = self.path_for(key)
        replaced = _size(path) if self.max_bytes else 0
        try:
            atomic_write(path, data)
        except OSError as e:
            raise write_error(e, self.root, "disk store") from e
        with self._size_lock:
            self._account(path, len(data) - replaced)

    def _account(self, path: Path, added: int) -> None:
        """Add a put's bytes to the total, recount it when due, and evict when it is over the cap."""
        files, temp_bytes = None, 0
        self._since_scan += max(added, 0)
        interval = self.rescan_s if self.max_bytes else _UNCAPPED_SWEEP_S
        if (self.max_bytes and (self._total is None or self._since_scan >= self.max_bytes * _RESCAN_SHARE)) \
                or time.monotonic() - self._scanned_at >= interval:
            files, temp_bytes = self._scan()  # other processes' writes and evictions; stale temps swept
            self._total = sum(size for _, size, _ in files) + temp_bytes
        elif self._total is not None:
            self._total += added
        if self.max_bytes and self._total is not None and self._total > self.max_bytes:
            self._evict(path, files, temp_bytes)

    def _scan(self) -> tuple[list[tuple[float, int, Path]], int]:
        """(mtime, size, path) of every block file, and the bytes of temp files young enough to be a write
        in flight; older temp files (a crash mid-write) are deleted on the way."""
        self._scanned_at, self._since_scan = time.monotonic(), 0
        cutoff = time.time() - self.sweep_temp_age_s if self.sweep_temp_age_s is not None else None
        out, temp_bytes, swept = [], 0, 0
        for dirpath, dirs, files in os.walk(self.root):
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            for f in files:
                is_block = f.endswith(SUFFIX) and not f.startswith(".")
                if not is_block and not (f.startswith(".") and f.endswith(TEMP_SUFFIX)):
                    continue
                p = Path(dirpath) / f
                try:
                    st = p.stat()
                    if is_block:
                        out.append((st.st_mtime, st.st_size, p))
                    elif cutoff is not None and st.st_mtime < cutoff:
                        p.unlink()
                        swept += 1
                    else:
                        temp_bytes += st.st_size
                except OSError:
                    continue  # deleted meanwhile (renamed into place, evicted by another process)
        if swept:
            log.info("disk store: removed %d stale temp files under %s", swept, self.root)
        return out, temp_bytes

    def _evict(self, keep: Path, files: list[tuple[float, int, Path]] | None, temp_bytes: int) -> None:
        """Delete the least recently used block files until the total is under 90% of the cap."""
        if files is None:  # the total is this process's estimate: recount before deleting anything
            files, temp_bytes = self._scan()
        files = sorted(files)
        total = sum(size for _, size, _ in files) + temp_bytes
        evicted = 0
        for _, size, p in files:
            if total <= self.max_bytes * 0.9:
                break
            if p == keep:
                continue
            try:
                p.unlink()
            except FileNotFoundError:
                pass  # another replica evicted it first
            except OSError as e:
                log.warning("disk store: could not evict %s: %s", p, e)
                continue
            total -= size
            evicted += 1
        self._total = total
        STORE_EVICTIONS.labels(tier=self.name).inc(evicted)
        log.info("disk store: evicted %d blocks to stay under %d bytes (now %d)", evicted, self.max_bytes, total)

    def _unlink(self, path: Path) -> bool:
        size = _size(path) if self.max_bytes else 0
        try:
            os.unlink(path)
            with self._size_lock:
                if self._total is not None:
                    self._total -= size
            return True
        except (FileNotFoundError, NotADirectoryError):
            return False
        except OSError as e:
            raise write_error(e, self.root, "disk store") from e

    def _delete_namespace_hash(self, namespace: str, content_hash: str) -> int:
        try:
            fp_dirs = [d for d in self.root.iterdir() if d.is_dir() and not d.name.startswith(".")]
        except (FileNotFoundError, NotADirectoryError):
            return 0
        return sum(self._unlink(d / namespace / f"{content_hash}{SUFFIX}") for d in fp_dirs)

    # -- BlockStore --

    async def get(self, key: BlockKey) -> KVBlock | None:
        return await asyncio.to_thread(self._load, key)

    async def put(self, key: BlockKey, block: KVBlock) -> None:
        await asyncio.to_thread(self._store, key, block)

    async def delete(self, key: BlockKey) -> bool:
        return await asyncio.to_thread(self._unlink, self.path_for(key))

    async def contains(self, key: BlockKey) -> bool:
        return await asyncio.to_thread(self.path_for(key).is_file)

    async def read_meta(self, key: BlockKey) -> dict[str, str] | None:
        return await asyncio.to_thread(self._read_meta, key)

    async def delete_namespace_hash(self, namespace: str, content_hash: str) -> int:
        check_name(namespace, "namespace")
        check_name(content_hash, "content_hash")
        return await asyncio.to_thread(self._delete_namespace_hash, namespace, content_hash)

    async def ping(self) -> bool:
        """True if blocks can be read. A root that exists but is not writable sets `last_error`
        (reported as degraded: reads work, puts fail)."""
        def probe() -> bool:
            d = self.root
            while not d.exists() and d.parent != d:
                d = d.parent  # the root is created on first put
            if not d.is_dir() or not os.access(d, os.R_OK | os.X_OK):
                self.last_error = f"disk store root {self.root}: {d} is not a readable directory"
                return False
            writable = os.access(d, os.W_OK) and not os.statvfs(d).f_flag & os.ST_RDONLY
            self.last_error = None if writable else f"disk store root {self.root} is not writable"
            return True
        return await asyncio.to_thread(probe)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
