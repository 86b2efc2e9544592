"""Opt-in int8 storage of K/V blocks: symmetric, absmax scales along one axis.

A stored tensor x [1, H, T, D] becomes q = round(x / s) in int8 [-127, 127] plus float32 scales s:
- "channel": one scale per (head, channel) over the block's tokens: s [1, H, 1, D]. Suits keys,
  whose outliers sit in fixed channels (KIVI, arXiv 2402.02750); the overhead is per block, not per token.
- "token":   one scale per (head, token) over the channels: s [1, H, T, 1]. Suits values.
Dequantization returns the model dtype; re-rotation and composition then run as usual, from the
dequantized canonical copy. bench/kv_compression.py measures bytes per token and fidelity.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from service.kv.block import KVBlock

Axis = Literal["channel", "token"]
QMAX = 127  # symmetric: -127..127 (no -128, so negation is exact)


@dataclass(frozen=True)
class Int8Scheme:
    """Scale axis for the key slot and the value slot (MLA: latent and k_pe)."""

    k_axis: Axis = "channel"
    v_axis: Axis = "token"


DEFAULT_INT8 = Int8Scheme()
AXES: tuple[Axis, ...] = ("channel", "token")


def _reduce_dims(axis: Axis) -> int:
    if axis == "channel":
        return 2  # over tokens: one scale per channel -> [1, H, 1, D]
    if axis == "token":
        return 3  # over channels: one scale per token -> [1, H, T, 1]
    raise ValueError(f"unknown scale axis {axis!r}")


def quantize(x: torch.Tensor, axis: Axis) -> tuple[torch.Tensor, torch.Tensor]:
    """x [1, H, T, D] -> (q int8 [1, H, T, D], scale float32 [1, H, 1, D] or [1, H, T, 1])."""
    xf = x.detach().float()
    amax = xf.abs().amax(dim=_reduce_dims(axis), keepdim=True)
    scale = (amax / QMAX).clamp_min(torch.finfo(torch.float32).tiny)  # all-zero rows stay zero
    q = torch.round(xf / scale).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(q int8 [1, H, T, D], scale float32, broadcastable) -> x [1, H, T, D] in `dtype`."""
    return (q.float() * scale).to(dtype)


def scale_shape(x_shape: tuple[int, ...], axis: Axis) -> tuple[int, ...]:
    """The scale tensor's shape for a quantized tensor of `x_shape` (for verifying stored payloads)."""
    shape = list(x_shape)
    shape[_reduce_dims(axis)] = 1
    return tuple(shape)


def quantize_block(block: KVBlock, scheme: Int8Scheme = DEFAULT_INT8):
    """Per layer (q_k, s_k, q_v, s_v): L x 4 tensors."""
    return [(*quantize(k, scheme.k_axis), *quantize(v, scheme.v_axis)) for k, v in zip(block.keys, block.values)]


def roundtrip_block(block: KVBlock, scheme: Int8Scheme = DEFAULT_INT8) -> KVBlock:
    """The block as it will read back from int8 storage (dequantized, same dtype and metadata)."""
    keys, values = [], []
    for q_k, s_k, q_v, s_v in quantize_block(block, scheme):
        keys.append(dequantize(q_k, s_k, block.dtype))  # [1, H, T, D]
        values.append(dequantize(q_v, s_v, block.dtype))
    return KVBlock(keys=keys, values=values, token_ids=list(block.token_ids), model_fingerprint=block.model_fingerprint,
                   layout_version=block.layout_version, meta=dict(block.meta), base=block.base)


def stored_bytes(block: KVBlock, compression: str = "none", scheme: Int8Scheme = DEFAULT_INT8) -> int:
    """Bytes of tensor data the store writes for `block` (excluding token ids and the header)."""
    if compression == "none":
        return block.size_bytes
    return sum(t.numel() * t.element_size() for layer in quantize_block(block, scheme) for t in layer)
