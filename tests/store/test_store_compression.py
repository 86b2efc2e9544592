"""Opt-in int8 storage of K/V (Settings.kv_compression): payload, verification, tiers."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from service.config import Settings
from service.kv.quant import roundtrip_block
from service.store.disk import DiskBlockStore
from service.store.errors import REASON_CHECKSUM, REASON_FORMAT, REASON_SHAPE, CorruptBlock, StaleBlock
from service.store.factory import build_store
from service.store.serde import decode_block, encode_block, read_metadata
from tests.store.store_helpers import assert_same_block, synthetic_block, v1_payload


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_int8_round_trip_is_close_and_smaller(dtype, make_key) -> None:
    block = synthetic_block(dtype=dtype, tokens=64, dim=16, meta={"skill": "demo"})
    plain, packed = encode_block(make_key(), block), encode_block(make_key(), block, "int8")
    meta = read_metadata(packed)
    assert meta["kv_compression"] == "int8" and meta["k_scale_axis"] == "channel" and meta["v_scale_axis"] == "token"
    assert read_metadata(plain)["kv_compression"] == "none"
    assert len(packed) < len(plain) / (3.0 if dtype == torch.float32 else 1.6)
    back = decode_block(packed, make_key())
    assert back.dtype == dtype and back.token_ids == block.token_ids and back.meta == block.meta
    for x, y in zip((*block.keys, *block.values), (*back.keys, *back.values)):  # [1, H, T, D]
        err = (x.float() - y.float()).abs().max()
        assert err <= x.float().abs().max() / 127 * 0.51 + 1e-2 * (dtype != torch.float32)
    assert_same_block(back, roundtrip_block(block))  # what the tiers serve == what a read returns


def test_payload_from_before_compression_is_stale(make_key) -> None:
    """Blocks written before kv_compression existed are format version 1: a clean miss, recompiled."""
    data = v1_payload(encode_block(make_key(), synthetic_block()), drop=("kv_compression",))
    with pytest.raises(StaleBlock):
        decode_block(data, make_key())


def _tamper(data: bytes, fn) -> bytes:
    tensors, meta = st_load(data), read_metadata(data)
    fn(tensors, meta)
    return st_save(tensors, metadata=meta)


@pytest.mark.parametrize("change, reason", [
    (lambda t, m: t["k.1"].view(-1).__setitem__(0, t["k.1"].view(-1)[0] ^ 1), REASON_CHECKSUM),
    (lambda t, m: t["vs.0"].mul_(2), REASON_CHECKSUM),
    (lambda t, m: t.__setitem__("ks.0", t["ks.0"][..., :1].contiguous()), REASON_SHAPE),
    (lambda t, m: m.__setitem__("k_scale_axis", "row"), REASON_FORMAT),
    (lambda t, m: m.__setitem__("kv_compression", "int4"), REASON_FORMAT),
    (lambda t, m: t.pop("vs.2"), REASON_SHAPE),
])
def test_int8_payload_is_verified(change, reason, make_key) -> None:
    data = _tamper(encode_block(make_key(), synthetic_block(), "int8"), change)
    with pytest.raises(CorruptBlock) as e:
        decode_block(data, make_key())
    assert e.value.reason == reason


def test_unknown_compression_refused_on_write(make_key) -> None:
    with pytest.raises(ValueError, match="kv compression"):
        encode_block(make_key(), synthetic_block(), "fp4")


async def test_settings_flag_reaches_the_tiers(tmp_path, make_key) -> None:
    settings = Settings(home=tmp_path, kv_compression="int8", memory_cache_bytes=1 << 22)
    store, _ = build_store(settings)
    block = synthetic_block(tokens=32)

    async def compile_fn():
        return block

    served, source = await store.get_or_compile(make_key(), compile_fn)
    assert source == "compiled"
    disk = DiskBlockStore(settings.store_dir / "blocks")  # a reader needs no flag: the payload says int8
    assert read_metadata(disk.path_for(make_key()).read_bytes())["kv_compression"] == "int8"
    on_disk = await disk.get(make_key())
    assert_same_block(served, on_disk)  # compiled, memory and disk all serve the dequantized block
    assert_same_block((await store.get(make_key()))[0], on_disk)
    assert not torch.equal(served.keys[0], block.keys[0])
    await store.close()


def test_default_is_uncompressed(tmp_path) -> None:
    store, _ = build_store(Settings(home=tmp_path))
    assert store.canonicalize is None and store.tiers[1].compression == "none"
