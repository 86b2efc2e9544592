"""Memory (LRU by bytes) and disk tiers."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from service.store.disk import DiskBlockStore
from service.store.errors import StoreWriteError
from service.store.memory import MemoryBlockStore
from service.store.serde import encode_block
from tests.store.store_helpers import assert_same_block, metric, synthetic_block

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


# -- memory --

@pytest.mark.parametrize("dtype", DTYPES)
async def test_memory_round_trip(dtype, make_key) -> None:
    store, block = MemoryBlockStore(1 << 20), synthetic_block(dtype=dtype)
    assert await store.get(make_key()) is None
    await store.put(make_key(), block)
    assert_same_block(await store.get(make_key()), block)
    assert [b is not None for b in await store.get_many([make_key(), make_key("x")])] == [True, False]
    assert await store.contains(make_key()) and await store.delete(make_key())
    assert not await store.delete(make_key()) and await store.get(make_key()) is None


async def test_memory_lru_evicts_by_bytes(make_key) -> None:
    block = synthetic_block()  # 8 KiB of K/V
    store = MemoryBlockStore(3 * block.size_bytes)
    before = metric("skillcache_memory_tier_bytes")
    for i in range(3):
        await store.put(make_key(f"h{i}"), synthetic_block(seed=i))
    assert store.bytes_used == 3 * block.size_bytes
    assert metric("skillcache_memory_tier_bytes") - before == 3 * block.size_bytes
    await store.get(make_key("h0"))  # h0 is now most recent: h1 is the LRU
    await store.put(make_key("h3"), synthetic_block(seed=3))
    assert [await store.contains(make_key(f"h{i}")) for i in range(4)] == [True, False, True, True]
    big = synthetic_block(tokens=64)  # 4x the capacity / 3: larger than the whole cache
    await store.put(make_key("big"), big)
    assert not await store.contains(make_key("big")) and len(store) == 3
    assert await store.delete_namespace_hash("ns", "h0") == 1 and store.bytes_used == 2 * block.size_bytes
    await store.close()
    assert metric("skillcache_memory_tier_bytes") == before


# -- disk --

@pytest.mark.parametrize("dtype", DTYPES)
async def test_disk_round_trip_and_restart(dtype, tmp_path: Path, make_key) -> None:
    block = synthetic_block(dtype=dtype)
    await DiskBlockStore(tmp_path).put(make_key(), block)
    path = tmp_path / "fp-test" / "ns" / "h0.safetensors"
    assert path.is_file()
    assert [p.name for p in path.parent.iterdir()] == ["h0.safetensors"]  # no temp file left
    restarted = DiskBlockStore(tmp_path)  # a new process over the same directory
    assert await restarted.contains(make_key())
    assert_same_block(await restarted.get(make_key()), block)


async def test_disk_corrupt_file_is_a_miss_counted_and_deleted(tmp_path: Path, make_key) -> None:
    store = DiskBlockStore(tmp_path)
    await store.put(make_key(), synthetic_block())
    path = store.path_for(make_key())
    data = bytearray(path.read_bytes())
    data[-7] ^= 0x01  # one bit in the tensor data
    path.write_bytes(bytes(data))
    before = metric("skillcache_store_corrupt_total", tier="disk", reason="checksum")
    assert await store.get(make_key()) is None
    assert metric("skillcache_store_corrupt_total", tier="disk", reason="checksum") == before + 1
    assert not path.exists()
    path.write_bytes(b"garbage")
    assert await store.get(make_key()) is None and not path.exists()


async def test_disk_temp_files_ignored_and_swept(tmp_path: Path, make_key) -> None:
    store = DiskBlockStore(tmp_path)
    await store.put(make_key(), synthetic_block())
    leftover = store.path_for(make_key()).parent / ".h1.safetensors.abc123.tmp"  # a writer killed mid-write
    leftover.write_bytes(b"half a blo")
    assert await store.get(make_key("h1")) is None
    os.utime(leftover, (0, 0))
    DiskBlockStore(tmp_path)  # startup sweeps temp files older than an hour
    assert not leftover.exists() and store.path_for(make_key()).exists()


async def test_disk_cap_evicts_least_recently_used(tmp_path: Path, make_key) -> None:
    import time

    size = len(encode_block(make_key(), synthetic_block(), "none"))
    store = DiskBlockStore(tmp_path, max_bytes=int(size * 2.5))  # room for two blocks
    before = metric("skillcache_store_evictions_total", tier="disk")
    for h in ("h0", "h1"):
        await store.put(make_key(h), synthetic_block())
        time.sleep(0.05)  # distinct mtimes even on coarse-timestamp filesystems
    assert await store.get(make_key("h0")) is not None  # h0 is now the most recently used
    time.sleep(0.05)
    await store.put(make_key("h2"), synthetic_block())  # over the cap: h1 goes, down to 90% of it
    assert [await store.contains(make_key(h)) for h in ("h0", "h1", "h2")] == [True, False, True]
    assert metric("skillcache_store_evictions_total", tier="disk") == before + 1
    await store.delete(make_key("h0"))
    await store.put(make_key("h3"), synthetic_block())  # the delete freed room: nothing evicted
    assert [await store.contains(make_key(h)) for h in ("h2", "h3")] == [True, True]
    # a new process over the same directory counts what is already there before its first put
    again = DiskBlockStore(tmp_path, max_bytes=int(size * 2.5))
    await again.put(make_key("h4"), synthetic_block())
    assert [await again.contains(make_key(h)) for h in ("h2", "h3", "h4")] == [False, True, True]
    # a block larger than the cap is still written (the tier may be the only copy); the others go
    tiny = DiskBlockStore(tmp_path, max_bytes=size // 2)
    await tiny.put(make_key("h5"), synthetic_block())
    assert sorted(p.name for p in tmp_path.rglob("*.safetensors")) == ["h5.safetensors"]


async def test_disk_delete_namespace_hash_all_fingerprints(tmp_path: Path, make_key) -> None:
    store = DiskBlockStore(tmp_path)
    for fp in ("fp-a", "fp-b"):
        await store.put(make_key("h0", fingerprint=fp), synthetic_block(fingerprint=fp))
    await store.put(make_key("h1"), synthetic_block())
    await store.put(make_key("h0", namespace="other"), synthetic_block())
    assert await store.delete_namespace_hash("ns", "h0") == 2
    assert await store.contains(make_key("h1")) and await store.contains(make_key("h0", namespace="other"))
    with pytest.raises(ValueError):
        await store.delete_namespace_hash("..", "h0")


# -- disk write failures: the store says what to fix and keeps serving reads --

def _sh(*cmd: str) -> bool:
    try:
        return subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0
    except OSError:  # no such binary
        return False


@contextlib.contextmanager
def tiny_tmpfs(path: Path, mode: str, size: str = "256k") -> Iterator[bool]:
    """mode "real": mount a real tmpfs at `path` (skip unless root with CAP_SYS_ADMIN); "simulated": a plain dir.

    Yields whether a real filesystem is mounted (tests as root cannot use chmod to refuse writes).
    """
    path.mkdir(parents=True, exist_ok=True)
    mounted = mode == "real" and os.geteuid() == 0 and _sh("mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs",
                                                          str(path))
    if mode == "real" and not mounted:
        pytest.skip("cannot mount a tmpfs here (needs root with CAP_SYS_ADMIN); the simulated variant ran")
    try:
        yield mounted
    finally:
        if mounted:
            _sh("umount", "-l", str(path))


@pytest.mark.parametrize("mode", ["real", "simulated"])
async def test_disk_full_is_store_write_error_and_reads_work(mode, tmp_path: Path, make_key, monkeypatch) -> None:
    root = tmp_path / "mnt"
    with tiny_tmpfs(root, mode) as real:
        store = DiskBlockStore(root)
        small = synthetic_block()
        await store.put(make_key("small"), small)
        if not real:  # simulated: the kernel's ENOSPC from write(2)
            def enospc(*_a, **_k):
                raise OSError(errno.ENOSPC, "No space left on device")
            monkeypatch.setattr("service.store.fsutil._write", enospc)
        with pytest.raises(StoreWriteError) as ei:
            await store.put(make_key("big"), synthetic_block(layers=8, heads=4, tokens=64, dim=64))  # 1 MiB
        monkeypatch.undo()
        msg = str(ei.value)
        assert ei.value.error_type == "store_write_failed" and "ENOSPC" in msg and "free space" in msg
        assert str(root) in msg
        assert [p.name for p in store.path_for(make_key("small")).parent.iterdir()] == ["small.safetensors"]
        assert_same_block(await store.get(make_key("small")), small)


@pytest.mark.parametrize("mode", ["real", "simulated"])
async def test_disk_read_only_is_store_write_error_and_reads_work(mode, tmp_path: Path, make_key, monkeypatch) -> None:
    root = tmp_path / "mnt"
    with tiny_tmpfs(root, mode, "4m") as real:
        store = DiskBlockStore(root)
        block = synthetic_block()
        await store.put(make_key(), block)
        if real:
            assert _sh("mount", "-o", "remount,ro", str(root))
            assert await store.ping() and "not writable" in (store.last_error or "")  # readable, not writable
        else:  # simulated: the kernel's EROFS at the rename step
            def erofs(*_a, **_k):
                raise OSError(errno.EROFS, "Read-only file system")
            monkeypatch.setattr("service.store.fsutil._replace", erofs)
        with pytest.raises(StoreWriteError) as ei:
            await store.put(make_key("h1"), synthetic_block(seed=1))
        assert "EROFS" in str(ei.value) and "read-only" in str(ei.value)
        assert_same_block(await store.get(make_key()), block)
        assert await store.contains(make_key()) and not await store.contains(make_key("h1"))


async def test_disk_root_under_a_file(tmp_path: Path, make_key) -> None:
    (tmp_path / "file").write_text("not a directory")
    store = DiskBlockStore(tmp_path / "file" / "blocks")
    with pytest.raises(StoreWriteError) as ei:
        await store.put(make_key(), synthetic_block())
    assert "ENOTDIR" in str(ei.value)
    assert await store.get(make_key()) is None  # reads answer "miss", they do not fail
