"""KVBlock <-> safetensors bytes, with a checksum and the key's identity in the metadata.

Compression (opt-in, Settings.kv_compression): "none" stores K/V as they are (k.i, v.i in the model
dtype); "int8" stores k.i, v.i as int8 with float32 scales ks.i, vs.i (service.kv.quant; the scale
axes are recorded in the metadata) and decodes back to the model dtype.

The checksum covers every metadata field (base_position, meta.*, n_tokens, ...) and each stored tensor's
dtype, shape and bytes: a flipped digit in the header changes behaviour as much as a flipped tensor byte.
Payloads of format version 1 (no `format_version` field; their checksum covered the tensors only) raise
StaleBlock: a clean miss, recompiled and rewritten in the current format.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterable

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from service.kv.block import KVBlock
from service.kv.quant import AXES, DEFAULT_INT8, Int8Scheme, dequantize, quantize_block, scale_shape
from service.store.errors import (
    REASON_CHECKSUM, REASON_DTYPE, REASON_FINGERPRINT, REASON_FORMAT, REASON_KEY, REASON_LAYOUT,
    REASON_SHAPE, CorruptBlock, StaleBlock,
)
from service.store.key import BlockKey

FORMAT = "skillcache-kv"
FORMAT_VERSION = "2"  # 2: the checksum covers the header too
_DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16)}  # "torch.float32" -> dtype
_HEADER_LIMIT = 100 * 1024 * 1024  # safetensors' own cap on the JSON header
COMPRESSIONS = ("none", "int8")


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


def _checksum(metadata: dict[str, str], tensors: Iterable[torch.Tensor]) -> str:
    """sha256 over every metadata field but `checksum`, then each (contiguous, CPU) tensor's dtype, shape
    and raw bytes, in order."""
    h = hashlib.sha256()
    fields = {name: val for name, val in metadata.items() if name != "checksum"}
    h.update(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode())
    for t in tensors:
        h.update(f"\n{t.dtype}{tuple(t.shape)}\n".encode())  # a reinterpreted shape is a different block
        h.update(t.reshape(-1).view(torch.uint8).numpy())  # no copy: numpy exposes the buffer
    return h.hexdigest()


def _names(n_layers: int, compression: str) -> list[str]:
    """Stored tensor names in checksum order: k.0, v.0, k.1, ... (int8: k.0, ks.0, v.0, vs.0, ...)."""
    per = ("k", "v") if compression == "none" else ("k", "ks", "v", "vs")
    return [f"{p}.{i}" for i in range(n_layers) for p in per]


def _ordered(tensors: dict[str, torch.Tensor], n_layers: int, compression: str):
    """Checksum order: the stored K/V tensors (see _names), then token_ids."""
    for name in _names(n_layers, compression):
        yield tensors[name]
    yield tensors["token_ids"]


def encode_block(key: BlockKey, block: KVBlock, compression: str = "none", scheme: Int8Scheme = DEFAULT_INT8) -> bytes:
    """Serialize `block` (stored under `key`) to safetensors bytes; `compression` is "none" or "int8"."""
    if compression not in COMPRESSIONS:
        raise ValueError(f"unknown kv compression {compression!r}; expected one of {COMPRESSIONS}")
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
    metadata = {f"meta.{name}": str(val) for name, val in block.meta.items()}
    if compression == "none":
        stored = [t for kv in zip(keys, values) for t in kv]  # L x ([1, H_kv, N, D], [1, H_kv, N, D])
    else:  # L x (q_k int8 [1, H_kv, N, D], s_k fp32, q_v int8, s_v fp32)
        stored = _owned([t for layer in quantize_block(block, scheme) for t in layer])
        metadata.update(k_scale_axis=scheme.k_axis, v_scale_axis=scheme.v_axis)
    tensors.update(zip(_names(block.n_layers, compression), stored))
    metadata.update(
        format=FORMAT,
        format_version=FORMAT_VERSION,
        layout_version=str(key.layout_version),
        model_fingerprint=key.model_fingerprint,
        namespace=key.namespace,
        content_hash=key.content_hash,
        n_tokens=str(block.n_tokens),
        n_layers=str(block.n_layers),
        base_position=str(block.base),
        dtype=str(block.dtype),
        kv_compression=compression,
    )
    metadata["checksum"] = _checksum(metadata, _ordered(tensors, block.n_layers, compression))
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
    # safetensors metadata is str -> str; anything else (null, a number) is damage, not a TypeError later
    bad = next((name for name, val in meta.items() if not isinstance(val, str)), None)
    if bad is not None:
        raise CorruptBlock(REASON_FORMAT, f"metadata field {bad!r} is not a string")
    return meta


def header_length(prefix: bytes) -> int:
    """Bytes of a payload's safetensors header (the 8-byte length and the JSON), from its first 8 bytes."""
    if len(prefix) < 8:
        raise CorruptBlock(REASON_FORMAT, "payload shorter than the header length")
    (n,) = struct.unpack("<Q", prefix[:8])
    if n > _HEADER_LIMIT:
        raise CorruptBlock(REASON_FORMAT, "bad header length")
    return 8 + n


def stored_meta(header: bytes) -> dict[str, str]:
    """The block's own `meta` (calibration, ...) from a payload's header alone: no tensors read, nothing verified
    (the checksum covers the tensors too; a read of the whole block checks it)."""
    return {name[5:]: val for name, val in read_metadata(header).items() if name.startswith("meta.")}


def decode_block(data: bytes, expected_key: BlockKey) -> KVBlock:
    """Parse and verify a payload written by encode_block for `expected_key`. Raises CorruptBlock."""
    meta = read_metadata(data)
    if meta.get("format") != FORMAT:
        raise CorruptBlock(REASON_FORMAT, f"format {meta.get('format')!r}")
    if "format_version" not in meta:  # version 1: its checksum does not cover the header, so not trusted
        raise StaleBlock("format version 1 (checksum without the header)")
    if meta["format_version"] != FORMAT_VERSION:
        raise CorruptBlock(REASON_FORMAT, f"format_version {meta['format_version']!r}")
    try:
        layout, n_tokens, n_layers = int(meta["layout_version"]), int(meta["n_tokens"]), int(meta["n_layers"])
        base = int(meta["base_position"])
        fingerprint, namespace, content_hash = meta["model_fingerprint"], meta["namespace"], meta["content_hash"]
        dtype_name, checksum = meta["dtype"], meta["checksum"]
        compression = meta["kv_compression"]
        axes = (meta["k_scale_axis"], meta["v_scale_axis"]) if compression == "int8" else ("", "")
    except (KeyError, ValueError, TypeError) as e:
        raise CorruptBlock(REASON_FORMAT, f"metadata field {e}") from None
    if compression not in COMPRESSIONS or (compression == "int8" and not set(axes) <= set(AXES)):
        raise CorruptBlock(REASON_FORMAT, f"kv_compression {compression!r} with scale axes {axes}")
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

    # n_layers is checked against the tensor count before _names builds a list that long
    per_layer = 2 if compression == "none" else 4
    if n_layers < 1 or n_layers * per_layer + 1 != len(tensors) \
            or set(tensors) != {"token_ids", *_names(n_layers, compression)}:
        raise CorruptBlock(REASON_SHAPE, f"tensor names {sorted(tensors)[:6]}... for {n_layers} layers")
    token_ids = tensors["token_ids"]  # [N]
    if token_ids.dtype != torch.int64 or tuple(token_ids.shape) != (n_tokens,):
        raise CorruptBlock(REASON_SHAPE, f"token_ids {token_ids.dtype} {tuple(token_ids.shape)}")
    keys = [tensors[f"k.{i}"] for i in range(n_layers)]  # L x [1, H_kv, N, D] (int8 when compressed)
    values = [tensors[f"v.{i}"] for i in range(n_layers)]  # L x [1, H_kv, N, D]
    stored_dtype = dtype if compression == "none" else torch.int8
    for i, (k, v) in enumerate(zip(keys, values)):
        if k.dtype != stored_dtype or v.dtype != stored_dtype:
            raise CorruptBlock(REASON_DTYPE, f"layer {i}: {k.dtype}/{v.dtype}, expected {stored_dtype}")
        if k.dim() != 4 or k.shape[0] != 1 or k.shape[2] != n_tokens or v.dim() != 4 \
                or v.shape[:3] != k.shape[:3]:
            raise CorruptBlock(REASON_SHAPE, f"layer {i}: k {tuple(k.shape)} v {tuple(v.shape)}")
        if compression == "int8":
            _check_scales(i, tensors[f"ks.{i}"], scale_shape(tuple(k.shape), axes[0]),
                          tensors[f"vs.{i}"], scale_shape(tuple(v.shape), axes[1]))
    if _checksum(meta, _ordered(tensors, n_layers, compression)) != checksum:
        raise CorruptBlock(REASON_CHECKSUM)
    if compression == "int8":  # the memory tier and the engine see model-dtype tensors
        keys = [dequantize(q, tensors[f"ks.{i}"], dtype) for i, q in enumerate(keys)]
        values = [dequantize(q, tensors[f"vs.{i}"], dtype) for i, q in enumerate(values)]
    user_meta = {name[5:]: val for name, val in meta.items() if name.startswith("meta.")}
    try:
        return KVBlock(keys=keys, values=values, token_ids=token_ids.tolist(),
                       model_fingerprint=fingerprint, layout_version=layout, meta=user_meta, base=base)
    except ValueError as e:
        raise CorruptBlock(REASON_SHAPE, str(e)) from None


def _check_scales(layer: int, s_k: torch.Tensor, k_shape: tuple, s_v: torch.Tensor, v_shape: tuple) -> None:
    for name, s, shape in (("ks", s_k, k_shape), ("vs", s_v, v_shape)):
        if s.dtype != torch.float32:
            raise CorruptBlock(REASON_DTYPE, f"layer {layer}: {name} is {s.dtype}, expected float32")
        if tuple(s.shape) != shape:
            raise CorruptBlock(REASON_SHAPE, f"layer {layer}: {name} {tuple(s.shape)}, expected {shape}")
