"""BlockKey and the safetensors serialization."""

from __future__ import annotations

import pytest
import torch

from service.kv.block import KVBlock
from service.store.errors import CorruptBlock
from service.kv.block import LAYOUT_VERSION
from service.store.key import BlockKey
from service.store.serde import decode_block, encode_block, read_metadata
from tests.store.store_helpers import assert_same_block, synthetic_block

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def test_key_round_trip(make_key) -> None:
    k = make_key("abc123", "team-a", "smollm2.135m-9f3e")
    assert k.to_str() == f"v{LAYOUT_VERSION}/team-a/smollm2.135m-9f3e/abc123"
    assert BlockKey.from_str(k.to_str()) == k
    assert {k: 1}[BlockKey.from_str(k.to_str())] == 1  # hashable, equal


@pytest.mark.parametrize("bad", ["", "../x", "a/b", "a b", "{tag}", ".hidden", "x" * 129, "é"])
def test_key_rejects_unsafe_components(bad: str) -> None:
    with pytest.raises(ValueError):
        BlockKey(model_fingerprint="fp", layout_version=1, namespace=bad, content_hash="h")
    with pytest.raises(ValueError):
        BlockKey(model_fingerprint=bad, layout_version=1, namespace="ns", content_hash="h")


@pytest.mark.parametrize("s", ["v1/ns/fp", "1/ns/fp/h", "vx/ns/fp/h", "v1/ns/fp/h/extra"])
def test_key_from_str_rejects(s: str) -> None:
    with pytest.raises(ValueError):
        BlockKey.from_str(s)


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_exact(dtype: torch.dtype, make_key) -> None:
    block = synthetic_block(dtype=dtype, meta={"skill": "demo", "text_sha": "x"})
    data = encode_block(make_key(), block)
    meta = read_metadata(data)
    assert meta["dtype"] == str(dtype) and meta["n_layers"] == "4" and meta["n_tokens"] == "16"
    assert meta["meta.skill"] == "demo" and len(meta["checksum"]) == 64
    assert_same_block(decode_block(data, make_key()), block)


def test_views_of_one_buffer_are_encodable(make_key) -> None:
    """K/V that are slices of one cache buffer share storage: safetensors would refuse them as is."""
    buf = torch.randn(2, 4, 1, 2, 16, 8)  # [k/v, L, 1, H, N, D]
    block = KVBlock(keys=list(buf[0]), values=list(buf[1]), token_ids=list(range(16)), model_fingerprint="fp-test")
    assert_same_block(decode_block(encode_block(make_key(), block), make_key()), block)


def test_key_and_block_must_agree(make_key) -> None:
    with pytest.raises(ValueError):
        encode_block(make_key(fingerprint="other"), synthetic_block())


def _flip_last_byte(data: bytes) -> bytes:
    b = bytearray(data)
    b[-1] ^= 0xFF  # inside the tensor data region (token_ids or a layer)
    return bytes(b)


@pytest.mark.parametrize(
    "mutate,key_kw,reason",
    [
        (_flip_last_byte, {}, "checksum"),
        (lambda d: d, {"fingerprint": "fp-other"}, "fingerprint"),
        (lambda d: d, {"content_hash": "h-other"}, "key"),
        (lambda d: d[: len(d) // 2], {}, "format"),
        (lambda d: b"\x00" * 4, {}, "format"),
        (lambda d: b"\xff" * 64, {}, "format"),
    ],
)
def test_corruption_detected(mutate, key_kw, reason, make_key) -> None:
    data = encode_block(make_key(), synthetic_block())
    with pytest.raises(CorruptBlock) as ei:
        decode_block(mutate(data), make_key(**key_kw))
    assert ei.value.reason == reason and ei.value.error_type == "corrupt_block"


def test_layout_mismatch(make_key) -> None:
    data = encode_block(make_key(), synthetic_block())
    newer = BlockKey(model_fingerprint="fp-test", layout_version=LAYOUT_VERSION + 1, namespace="ns", content_hash="h0")
    with pytest.raises(CorruptBlock) as ei:
        decode_block(data, newer)
    assert ei.value.reason == "layout"


def test_shape_and_dtype_mismatch_detected(make_key) -> None:
    """Payloads that are valid safetensors with consistent checksums-of-nothing but a wrong structure."""
    from safetensors.torch import save

    good = encode_block(make_key(), synthetic_block())
    meta = read_metadata(good)
    from safetensors.torch import load

    tensors = load(good)
    missing_layer = {k: v for k, v in tensors.items() if k != "v.3"}
    with pytest.raises(CorruptBlock) as ei:
        decode_block(save(missing_layer, metadata=meta), make_key())
    assert ei.value.reason == "shape"
    wrong_tokens = dict(tensors, **{"k.0": torch.zeros(1, 2, 15, 8)})
    with pytest.raises(CorruptBlock) as ei:
        decode_block(save(wrong_tokens, metadata=meta), make_key())
    assert ei.value.reason == "shape"
    mixed = dict(tensors, **{"k.1": tensors["k.1"].to(torch.float16)})
    with pytest.raises(CorruptBlock) as ei:
        decode_block(save(mixed, metadata=meta), make_key())
    assert ei.value.reason == "dtype"
