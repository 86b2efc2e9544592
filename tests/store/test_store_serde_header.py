"""The payload header: covered by the checksum, malformed ones are CorruptBlock, version 1 is stale."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from service.store.disk import DiskBlockStore
from service.store.errors import CorruptBlock, StaleBlock
from service.store.serde import decode_block, encode_block, read_metadata
from tests.store.store_helpers import assert_same_block, metric, synthetic_block, v1_payload

REASONS = ("format", "layout", "fingerprint", "key", "shape", "dtype", "checksum", "chunks", "stale")


def corrupt_count(tier: str = "disk") -> float:
    return sum(metric("skillcache_store_corrupt_total", tier=tier, reason=r) for r in REASONS)


def with_meta(data: bytes, change) -> bytes:
    """Re-save `data` with its metadata changed by `change(meta)`; the stored checksum is kept."""
    tensors, meta = st_load(data), read_metadata(data)
    change(meta)
    return st_save(tensors, metadata=meta)


def with_raw_header(data: bytes, change) -> bytes:
    """`data` with its JSON header changed by `change(header)`, written as raw JSON (any types)."""
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    change(header)
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    return struct.pack("<Q", len(h)) + h + data[8 + n:]


@pytest.mark.parametrize("field, value", [
    ("base_position", "4"),  # the seam position the engine re-rotates from
    ("meta.calibration", "0.51"),
    ("meta.skill", "demx"),
    ("meta.added", "1"),  # a field that was not there
])
def test_every_header_field_is_checksummed(field, value, make_key) -> None:
    block = synthetic_block(meta={"skill": "demo", "calibration": "0.5"})
    data = with_meta(encode_block(make_key(), block), lambda m: m.__setitem__(field, value))
    with pytest.raises(CorruptBlock) as e:
        decode_block(data, make_key())
    assert e.value.reason == "checksum"


async def test_flipped_header_digit_on_disk_is_a_counted_miss(tmp_path: Path, make_key) -> None:
    """The audit's case: one bit of base_position flipped in the file ('3' -> '2')."""
    store = DiskBlockStore(tmp_path)
    await store.put(make_key(), synthetic_block(base=3))
    path = store.path_for(make_key())
    raw = bytearray(path.read_bytes())
    i = raw.index(b'"base_position":"3"') + len(b'"base_position":"')
    raw[i] ^= 0x01
    path.write_bytes(bytes(raw))
    before = metric("skillcache_store_corrupt_total", tier="disk", reason="checksum")
    assert await store.get(make_key()) is None
    assert metric("skillcache_store_corrupt_total", tier="disk", reason="checksum") == before + 1
    assert not path.exists()


@pytest.mark.parametrize("change", [
    lambda h: h["__metadata__"].__setitem__("n_layers", None),
    lambda h: h["__metadata__"].__setitem__("n_layers", 4),
    lambda h: h["__metadata__"].__setitem__("base_position", [3]),
    lambda h: h["__metadata__"].__setitem__("meta.skill", {"x": 1}),
    lambda h: h["__metadata__"].__setitem__("format", None),
    lambda h: h.__setitem__("__metadata__", ["format"]),
])
async def test_malformed_header_is_corrupt_counted_and_deleted(change, tmp_path: Path, make_key) -> None:
    store = DiskBlockStore(tmp_path)
    await store.put(make_key(), synthetic_block())
    path = store.path_for(make_key())
    path.write_bytes(with_raw_header(path.read_bytes(), change))
    with pytest.raises(CorruptBlock):
        decode_block(path.read_bytes(), make_key())
    before = corrupt_count()
    assert await store.get(make_key()) is None  # not a TypeError out of the request
    assert corrupt_count() == before + 1 and not path.exists()


async def test_version_1_block_is_a_clean_miss_then_rewritten(tmp_path: Path, make_key) -> None:
    store = DiskBlockStore(tmp_path)
    block = synthetic_block()
    path = store.path_for(make_key())
    await store.put(make_key(), block)
    path.write_bytes(v1_payload(path.read_bytes()))
    with pytest.raises(StaleBlock):
        decode_block(path.read_bytes(), make_key())
    before = corrupt_count()
    assert await store.get(make_key()) is None
    assert corrupt_count() == before and not path.exists()  # dropped, but not counted as damage
    await store.put(make_key(), block)
    assert_same_block(await store.get(make_key()), block)


def test_unknown_format_version_is_corrupt(make_key) -> None:
    data = with_meta(encode_block(make_key(), synthetic_block()), lambda m: m.__setitem__("format_version", "7"))
    with pytest.raises(CorruptBlock) as e:
        decode_block(data, make_key())
    assert e.value.reason == "format" and not isinstance(e.value, StaleBlock)
