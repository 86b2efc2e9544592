"""Building the per-request cache from prefilled text and re-rotated blocks."""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from service.kv.block import KVBlock
from service.kv.rope import KeyRotator


def new_cache(config) -> DynamicCache:
    """An empty cache that keeps every token on every layer, sliding-window layers included.

    transformers' DynamicCache(config=...) gives sliding layers a DynamicSlidingWindowLayer that
    keeps only the last `sliding_window` tokens, so a composed prompt longer than the window could
    not hold a block's tokens. Full layers keep them; the model's sliding mask (built from the config,
    over cache indices) still enforces the window (tests/kv/test_adapters.py checks both).
    """
    cache = DynamicCache(config=config)
    cache.layers = [DynamicLayer() if isinstance(layer, DynamicSlidingWindowLayer) else layer
                    for layer in cache.layers]
    return cache


def append_block(cache: DynamicCache, block: KVBlock, start: int, end: int, offset: int, rotator: KeyRotator) -> int:
    """Append block tokens [start, end) to the cache, moved from canonical position base + i to offset + i.

    Keys are re-rotated by `offset - base` from the stored copy (no rotation at all for a block that
    sits where it was compiled); values are position-free and copied
    (MLA: the rotator moves k_pe, which transformers caches in the value slot).
    Returns the number of tokens appended.
    """
    if end <= start:
        return 0
    rotator.check_tokens(block.token_ids)
    keys = [k[:, :, start:end] for k in block.keys]  # L x [1, H_kv, end - start, D]
    values = [v[:, :, start:end] for v in block.values]  # L x [1, H_kv, end - start, D_v]
    keys, values = rotator.move_layers(keys, values, offset - block.base)
    append_kv(cache, keys, values)
    return end - start


def append_kv(cache: DynamicCache, keys: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    """Append per-layer K/V (L x [1, H_kv, T, D]) to the cache. DynamicLayer.update concatenates (torch.cat
    allocates), so the cache never aliases the given tensors: no clone or contiguous copy is needed first,
    and one would double the copy (most of a moved 8k block's copy time)."""
    for layer, (k, v) in enumerate(zip(keys, values)):
        cache.update(k, v, layer)


def block_from_cache(cache: DynamicCache, token_ids: list[int], model_fingerprint: str, base: int = 0) -> KVBlock:
    """Snapshot the last len(token_ids) tokens of a cache (prefilled at base..base+N-1) as a KVBlock."""
    keys, values = [], []
    for layer in cache.layers:
        keys.append(layer.keys[:, :, base:].detach().clone())  # [1, H_kv, N, D]
        values.append(layer.values[:, :, base:].detach().clone())
    return KVBlock(keys=keys, values=values, token_ids=list(token_ids), model_fingerprint=model_fingerprint,
                   base=base)


def layer_kv(cache: DynamicCache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    return cache.layers[layer].keys, cache.layers[layer].values


def truncate(cache: DynamicCache, n_tokens: int) -> None:
    """Drop cached tokens beyond the first n_tokens (keeps the longest common prefix of a session)."""
    extra = cache.get_seq_length() - n_tokens
    if extra > 0:
        cache.crop(-extra)


def cache_from_block(config, block: KVBlock) -> DynamicCache:
    """A fresh cache holding a block's tensors as they are (no re-rotation; a base-0 block: positions 0..N-1)."""
    cache = new_cache(config)
    append_kv(cache, block.keys, block.values)
    return cache


def cache_bytes(cache: DynamicCache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers if layer.is_initialized
               for t in (layer.keys, layer.values))
