"""Building the per-request cache from prefilled text and re-rotated blocks."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from service.kv.block import KVBlock
from service.kv.rope import KeyRotator


def new_cache(config) -> DynamicCache:
    """An empty cache with the model's layer types (sliding layers included)."""
    return DynamicCache(config=config)


def append_block(cache: DynamicCache, block: KVBlock, start: int, end: int, offset: int, rotator: KeyRotator) -> int:
    """Append block tokens [start, end) to the cache, moved from canonical position i to offset + i.

    Keys are re-rotated by `offset` from the stored copy; values are position-free and copied.
    Returns the number of tokens appended.
    """
    if end <= start:
        return 0
    keys = [k[:, :, start:end] for k in block.keys]  # L x [1, H_kv, end - start, D]
    rotated = rotator.rotate_layers(keys, offset)
    for layer, (k, v) in enumerate(zip(rotated, block.values)):
        cache.update(k.contiguous(), v[:, :, start:end].contiguous(), layer)
    return end - start


def block_from_cache(cache: DynamicCache, token_ids: list[int], model_fingerprint: str) -> KVBlock:
    """Snapshot a cache holding exactly `token_ids` (prefilled alone at 0..N-1) as a KVBlock."""
    keys, values = [], []
    for layer in cache.layers:
        keys.append(layer.keys.detach().clone())  # [1, H_kv, N, D]
        values.append(layer.values.detach().clone())
    return KVBlock(keys=keys, values=values, token_ids=list(token_ids), model_fingerprint=model_fingerprint)


def layer_kv(cache: DynamicCache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    return cache.layers[layer].keys, cache.layers[layer].values
