"""KVBlock <-> safetensors bytes, with a checksum and the key's identity in the metadata."""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterable

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from service.kv.block import KVBlock
from service.store.errors import (
    REASON_CHECKSUM, REASON_DTYPE, REASON_FINGERPRINT, REASON_FORMAT, REASON_KEY, REASON_LAYOUT,
    REASON_SHAPE, CorruptBlock,
)
from service.store.key import BlockKey

FORMAT = "skillcache-kv"
_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16)}  # "torch.float32" -> dtype
_HEADER_LIMIT = 100 * 1024 * 1024  # safetensors' own cap on the JSON header


def _owned(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Dense CPU tensors that share storage with no other one (safetensors refuses shared storage).

    Copies only what needs it (GPU, non-contiguous, or a view into a storage another tensor uses):
    safetensors copies the bytes anyway, and a 190 MB clone is not free.
    """
    seen: dict[int, int] = {}
    for t in tensors:
        ptr = t.untyped_storage().data_ptr()
        seen[ptr] = seen.get(ptr, 0) + 1
    out = []
    for t in tensors:
        t = t.detach()
        if t.device.type != "cpu":
            t = t.to("cpu").contiguous()
        elif not t.is_contiguous() or seen[t.untyped_storage().data_ptr()] > 1 \
                or t.untyped_storage().nbytes() != t.numel() * t.element_size():
            t = t.clone(memory_format=torch.contiguous_format)
        out.append(t)
    return out


def _checksum(tensors: Iterable[torch.Tensor]) -> str:
    """sha256 over the raw bytes of the given (contiguous, CPU) tensors, in order."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.reshape(-1).view(torch.uint8).numpy())  # no copy: numpy exposes the buffer
    return h.hexdigest()


def _ordered(keys: list[torch.Tensor], values: list[torch.Tensor], token_ids: torch.Tensor):
    """Checksum order: k.0, v.0, k.1, v.1, ..., token_ids."""
    for k, v in zip(keys, values):
        yield k
        yield v
    yield token_ids


def encode_block(key: BlockKey, block: KVBlock) -> bytes:
    """Serialize `block` (stored under `key`) to safetensors bytes."""
    if block.model_fingerprint != key.model_fingerprint:
        raise ValueError(f"block fingerprint {block.model_fingerprint!r} != key's {key.model_fingerprint!r}")
    if block.layout_version != key.layout_version:
        raise ValueError(f"block layout {block.layout_version} != key's {key.layout_version}")
    if block.n_layers == 0:
        raise ValueError("block has no layers")
    if str(block.dtype) not in _DTYPES:
        raise ValueError(f"unsupported dtype {block.dtype}")
    owned = _owned([*block.keys, *block.values])
    keys, values = owned[: block.n_layers], owned[block.n_layers:]  # L x [1, H_kv, N, D] each
    if any(t.dtype != block.dtype for t in (*keys, *values)):
        raise ValueError("all K/V tensors of a block must share one dtype")
    token_ids = torch.tensor(block.token_ids, dtype=torch.int64)  # [N]
    tensors: dict[str, torch.Tensor] = {"token_ids": token_ids}
    for i, (k, v) in enumerate(zip(keys, values)):
        tensors[f"k.{i}"] = k
        tensors[f"v.{i}"] = v
    metadata = {f"meta.{name}": str(val) for name, val in block.meta.items()}
    metadata.update(
        format=FORMAT,
        layout_version=str(key.layout_version),
        model_fingerprint=key.model_fingerprint,
        namespace=key.namespace,
        content_hash=key.content_hash,
        n_tokens=str(block.n_tokens),
        n_layers=str(block.n_layers),
        dtype=str(block.dtype),
        checksum=_checksum(_ordered(keys, values, token_ids)),
    )
    return st_save(tensors, metadata=metadata)


def read_metadata(data: bytes) -> dict[str, str]:
    """The `__metadata__` of a safetensors payload, without loading tensors."""
    if len(data) < 8:
        raise CorruptBlock(REASON_FORMAT, "payload shorter than the header length")
    (n,) = struct.unpack("<Q", data[:8])
    if n > _HEADER_LIMIT or 8 + n > len(data):
        raise CorruptBlock(REASON_FORMAT, "bad header length")
    try:
        header = json.loads(bytes(data[8:8 + n]))
        meta = header.get("__metadata__") or {}
    except (ValueError, AttributeError) as e:
        raise CorruptBlock(REASON_FORMAT, f"bad header: {e}") from None
    if not isinstance(meta, dict):
        raise CorruptBlock(REASON_FORMAT, "metadata is not a dict")
    return meta


def decode_block(data: bytes, expected_key: BlockKey) -> KVBlock:
    """Parse and verify a payload written by encode_block for `expected_key`. Raises CorruptBlock."""
    meta = read_metadata(data)
    try:
        if meta["format"] != FORMAT:
            raise CorruptBlock(REASON_FORMAT, f"format {meta['format']!r}")
        layout, n_tokens, n_layers = int(meta["layout_version"]), int(meta["n_tokens"]), int(meta["n_layers"])
        fingerprint, namespace, content_hash = meta["model_fingerprint"], meta["namespace"], meta["content_hash"]
        dtype_name, checksum = meta["dtype"], meta["checksum"]
    except (KeyError, ValueError) as e:
        raise CorruptBlock(REASON_FORMAT, f"metadata field {e}") from None
    if layout != expected_key.layout_version:
        raise CorruptBlock(REASON_LAYOUT, f"stored {layout}, expected {expected_key.layout_version}")
    if fingerprint != expected_key.model_fingerprint:
        raise CorruptBlock(REASON_FINGERPRINT, f"stored {fingerprint!r}")
    if namespace != expected_key.namespace or content_hash != expected_key.content_hash:
        raise CorruptBlock(REASON_KEY, f"stored {namespace}/{content_hash}")
    dtype = _DTYPES.get(dtype_name)
    if dtype is None:
        raise CorruptBlock(REASON_DTYPE, f"unsupported dtype {dtype_name!r}")
    try:
        tensors = st_load(bytes(data))
    except Exception as e:  # safetensors raises its own SafetensorError / ValueError
        raise CorruptBlock(REASON_FORMAT, f"safetensors: {e}") from None

    expected_names = {"token_ids"} | {f"{p}.{i}" for p in "kv" for i in range(n_layers)}
    if set(tensors) != expected_names or n_layers < 1:
        raise CorruptBlock(REASON_SHAPE, f"tensor names {sorted(tensors)[:6]}... for {n_layers} layers")
    token_ids = tensors["token_ids"]  # [N]
    if token_ids.dtype != torch.int64 or tuple(token_ids.shape) != (n_tokens,):
        raise CorruptBlock(REASON_SHAPE, f"token_ids {token_ids.dtype} {tuple(token_ids.shape)}")
    keys = [tensors[f"k.{i}"] for i in range(n_layers)]  # L x [1, H_kv, N, D]
    values = [tensors[f"v.{i}"] for i in range(n_layers)]  # L x [1, H_kv, N, D]
    for i, (k, v) in enumerate(zip(keys, values)):
        if k.dtype != dtype or v.dtype != dtype:
            raise CorruptBlock(REASON_DTYPE, f"layer {i}: {k.dtype}/{v.dtype}, metadata says {dtype}")
        if k.dim() != 4 or k.shape[0] != 1 or k.shape[2] != n_tokens or v.dim() != 4 \
                or v.shape[:3] != k.shape[:3]:
            raise CorruptBlock(REASON_SHAPE, f"layer {i}: k {tuple(k.shape)} v {tuple(v.shape)}")
    if _checksum(_ordered(keys, values, token_ids)) != checksum:
        raise CorruptBlock(REASON_CHECKSUM)
    user_meta = {name[5:]: val for name, val in meta.items() if name.startswith("meta.")}
    try:
        return KVBlock(keys=keys, values=values, token_ids=token_ids.tolist(),
                       model_fingerprint=fingerprint, layout_version=layout, meta=user_meta)
    except ValueError as e:
        raise CorruptBlock(REASON_SHAPE, str(e)) from None
