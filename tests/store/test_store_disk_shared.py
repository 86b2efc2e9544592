"""Disk tier: a cap shared by processes over one directory, and temp files left by a crash."""

from __future__ import annotations

import os
import time
from pathlib import Path

from service.store import disk as disk_mod
from service.store.disk import DiskBlockStore
from service.store.serde import encode_block
from tests.store.store_helpers import synthetic_block

HOUR = 3600


def block_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*.safetensors"))


def temp_in(store: DiskBlockStore, key, name: str, size: int, age_s: float = 0) -> Path:
    """A temp file as atomic_write names it, `age_s` old: a crash mid-write, or a write in flight."""
    path = store.path_for(key).parent / f".{name}.safetensors.0123456789ab.tmp"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\0" * size)
    if age_s:
        os.utime(path, (time.time() - age_s, time.time() - age_s))
    return path


async def test_processes_sharing_a_directory_stay_near_the_cap(tmp_path: Path, make_key) -> None:
    """Three replicas writing fast (well within rescan_s): each recounts after 10% of the cap."""
    size = len(encode_block(make_key(), synthetic_block()))
    cap = size * 10 + 10
    replicas = [DiskBlockStore(tmp_path, max_bytes=cap) for _ in range(3)]
    peak = 0
    for i in range(60):
        await replicas[i % 3].put(make_key(f"h{i}"), synthetic_block())
        peak = max(peak, block_bytes(tmp_path))
    assert peak <= cap + 3 * size  # at most one unseen block per replica (10% of this cap); was 24 blocks


async def test_other_processes_writes_seen_after_rescan_s(tmp_path: Path, make_key) -> None:
    size = len(encode_block(make_key(), synthetic_block()))
    cap = size * 100  # our own writes stay far below the 10% recount share
    mine = DiskBlockStore(tmp_path, max_bytes=cap, rescan_s=0.05)
    await mine.put(make_key("mine0"), synthetic_block())
    other = DiskBlockStore(tmp_path)  # another process, filling the shared directory past the cap
    for i in range(105):
        await other.put(make_key(f"o{i}"), synthetic_block())
    time.sleep(0.06)
    await mine.put(make_key("mine1"), synthetic_block())
    assert block_bytes(tmp_path) <= cap * 0.9 + size
    assert await mine.contains(make_key("mine1"))


async def test_crash_temp_files_swept_at_recount_young_ones_kept_and_counted(tmp_path: Path, make_key) -> None:
    size = len(encode_block(make_key(), synthetic_block()))
    store = DiskBlockStore(tmp_path, max_bytes=size * 5, rescan_s=0.0)  # startup sweep: nothing there yet
    stale = temp_in(store, make_key(), "dead", size * 50, age_s=2 * HOUR)  # a kill -9 mid-write, long ago
    young = temp_in(store, make_key(), "busy", size * 2)  # another process writing right now
    for h in ("h0", "h1", "h2"):
        await store.put(make_key(h), synthetic_block())
    assert not stale.exists()  # swept while the service runs, not only at the next start
    assert young.exists()  # the age guard: never a write in flight
    assert store._total == block_bytes(tmp_path) + size * 2  # the young temp counts against the cap
    await store.put(make_key("h3"), synthetic_block())  # 4 blocks + 2 in flight > 5: the oldest goes
    assert block_bytes(tmp_path) + size * 2 <= size * 5


async def test_uncapped_store_sweeps_crash_temp_files_too(tmp_path: Path, make_key, monkeypatch) -> None:
    store = DiskBlockStore(tmp_path)
    stale = temp_in(store, make_key(), "dead", 100, age_s=2 * HOUR)
    monkeypatch.setattr(disk_mod, "_UNCAPPED_SWEEP_S", 0.0)  # as if ten minutes of puts had passed
    await store.put(make_key(), synthetic_block())
    assert not stale.exists()
