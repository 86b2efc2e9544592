"""Disk tier: one safetensors file per block, `<root>/<model_fp>/<namespace>/<content_hash>.safetensors`."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

from service.kv.block import KVBlock
from service.store.base import BlockStore
from service.store.errors import CorruptBlock, StoreUnavailable
from service.store.fsutil import atomic_write, sweep_temp, write_error
from service.store.key import BlockKey, check_name
from service.store.serde import decode_block, encode_block

log = logging.getLogger(__name__)

SUFFIX = ".safetensors"


class DiskBlockStore(BlockStore):
    """Atomic, crash-safe files; all blocking I/O runs in worker threads.

    The layout version is not part of the path: a block of an older layout is detected on read
    (CorruptBlock "layout"), dropped and rewritten by the caller.
    """

    name = "disk"

    def __init__(self, root: Path | str, *, sweep_temp_age_s: float | None = 3600.0,
                 compression: str = "none") -> None:
        self.root = Path(root)
        self.compression = compression  # "none" | "int8" (serde.encode_block); reads follow the payload
        self.last_error: str | None = None
        if sweep_temp_age_s is not None and self.root.is_dir():
            sweep_temp(self.root, sweep_temp_age_s)

    def path_for(self, key: BlockKey) -> Path:
        return self.root / key.model_fingerprint / key.namespace / f"{key.content_hash}{SUFFIX}"

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
            return decode_block(data, key)
        except CorruptBlock as e:
            self._corrupt(key, e)
            self._unlink_if_same(path, inode)
            return None

    def _unlink_if_same(self, path: Path, inode: int) -> None:
        """Delete `path` unless a concurrent put already replaced it with a new file."""
        try:
            if os.stat(path).st_ino == inode:
                os.unlink(path)
        except OSError as e:
            log.warning("disk store: could not remove corrupt %s: %s", path, e)

    def _store(self, key: BlockKey, block: KVBlock) -> None:
        data = encode_block(key, block, self.compression)
        try:
            atomic_write(self.path_for(key), data)
        except OSError as e:
            raise write_error(e, self.root, "disk store") from e

    def _unlink(self, path: Path) -> bool:
        try:
            os.unlink(path)
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
