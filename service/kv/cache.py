"""Building the per-request cache from prefilled text and re-rotated blocks."""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from service.kv.block import KVBlock
from service.kv.rope import KeyRotator

_MIN_CAPACITY = 64  # tokens


class GrowLayer(DynamicLayer):
    """A full per-token cache layer whose K/V live in a buffer with spare room: an append writes in place.

    DynamicLayer.update `torch.cat`s the whole layer on every call (a fresh allocation and a full copy per layer
    per step: for batched CPU decode as costly as reading the weights). Here the buffer grows
    geometrically (or once, to what `reserve` says the request needs) and `keys` / `values` are views of its
    filled part, `[B, H_kv, n, D]`. Views returned earlier keep their contents while later tokens are appended;
    only `crop` followed by an append overwrites what they show.
    """

    def __init__(self, reserve_tokens: int = 0) -> None:
        super().__init__()
        self.n, self.reserve_tokens = 0, reserve_tokens

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.n, cap = 0, self.reserve_tokens
        with torch.inference_mode(False):  # a normal tensor: written in place inside inference mode and outside it
            self._k = key_states.new_zeros((*key_states.shape[:2], cap, key_states.shape[3]))  # [B, H_kv, cap, D]
            # [B, H_kv, cap, Dv]
            self._v = value_states.new_zeros((*value_states.shape[:2], cap, value_states.shape[3]))
        self.keys, self.values = self._k, self._v
        self.is_initialized = True

    @property
    def capacity(self) -> int:
        return self._k.shape[2] if self.is_initialized else 0

    def _grow(self, need: int) -> None:
        cap = max(need, 2 * self.capacity, _MIN_CAPACITY)
        with torch.inference_mode(False):
            k = self._k.new_zeros((*self._k.shape[:2], cap, self._k.shape[3]))
            v = self._v.new_zeros((*self._v.shape[:2], cap, self._v.shape[3]))
        k[:, :, :self.n] = self._k[:, :, :self.n]
        v[:, :, :self.n] = self._v[:, :, :self.n]
        self._k, self._v = k, v

    def reserve(self, n_tokens: int) -> None:
        """Make room for n_tokens in all (only once initialized: the first update fixes B, H and D)."""
        if self.is_initialized and n_tokens > self.capacity:
            self._grow(n_tokens)
            self._views()

    def _views(self) -> None:
        self.keys, self.values = self._k[:, :, :self.n], self._v[:, :, :self.n]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.n + key_states.shape[-2]
        if end > self.capacity:
            self._grow(end)
        self._k[:, :, self.n:end] = key_states
        self._v[:, :, self.n:end] = value_states
        self.n = end
        self._views()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.n if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative count of tokens to remove")
        if self.is_initialized and tokens_to_remove:
            self.n = max(0, self.n + tokens_to_remove)
            self._views()

    def reset(self) -> None:
        self.n = 0
        super().reset()


def new_cache(config, reserve_tokens: int = 0) -> DynamicCache:
    """An empty cache of GrowLayers that keeps every token on every layer, sliding-window layers included.

    transformers' DynamicCache(config=...) gives sliding layers a DynamicSlidingWindowLayer that
    keeps only the last `sliding_window` tokens, so a composed prompt longer than the window could
    not hold a block's tokens. Full layers keep them; the model's sliding mask (built from the config,
    over cache indices) still enforces the window (tests/kv/test_adapters.py checks both).
    `reserve_tokens`: the length the request will reach, so its buffers are allocated once.
    """
    cache = DynamicCache(config=config)
    cache.layers = [GrowLayer(reserve_tokens) for _ in cache.layers]
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
    """Append per-layer K/V (L x [1, H_kv, T, D]) to the cache. GrowLayer copies into its own buffer (and so does
    DynamicLayer's torch.cat), so the cache never aliases the given tensors: no clone or contiguous copy is needed
    first, and one would double the copy (most of a moved 8k block's copy time)."""
    for layer, (k, v) in enumerate(zip(keys, values)):
        cache.update(k, v, layer)


def block_from_cache(cache: DynamicCache, token_ids: list[int], model_fingerprint: str, base: int = 0) -> KVBlock:
    """Snapshot the len(token_ids) tokens a cache holds from position `base` on (prefilled at base..base+N-1) as a
    KVBlock; tokens after them are left out (base 0: a prompt's head)."""
    end = base + len(token_ids)
    keys, values = [], []
    for layer in cache.layers:
        keys.append(layer.keys[:, :, base:end].detach().clone())  # [1, H_kv, N, D]
        values.append(layer.values[:, :, base:end].detach().clone())
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


def cache_bytes(cache: DynamicCache, allocated: bool = False) -> int:
    """Bytes of K/V the cache holds (allocated: with its layers' spare room)."""
    def tensors(layer):
        return (layer._k, layer._v) if allocated and isinstance(layer, GrowLayer) else (layer.keys, layer.values)

    return sum(t.numel() * t.element_size() for layer in cache.layers if layer.is_initialized for t in tensors(layer))


def remove_span(cache: DynamicCache, start: int, end: int, rotator: KeyRotator) -> int:
    """Drop cached tokens [start, end) and move the tokens after them back by n = end - start positions: their keys
    are re-rotated by -n from where they were computed, values are copied (MLA: the rotator moves k_pe, cached in
    the value slot). Returns n.

    What the moved tokens hold afterwards: at layer 0 a token's K/V depend only on its id and position, so there
    they equal a prefill of the same tokens at the shifted positions without the span (tests/kv/test_remove_span.py).
    From layer 1 on they were computed while attending to the span: they keep what they read from it. That is the
    design of a memory placed late in a session (service/memory/turns.py, the paper's section 9): the turn that
    read the memory keeps its notes on it; the memory itself leaves the conversation's cache and is floated again,
    re-rotated, before the next user turn.
    """
    total = cache.get_seq_length()
    n = end - start
    if not 0 <= start <= end <= total:
        raise ValueError(f"span [{start}, {end}) is not inside the cache's {total} tokens")
    if n == 0:
        return 0
    # clones: the moved tail is written back into the same buffers, over the span and its own old place
    tail_k = [layer.keys[:, :, end:].clone() for layer in cache.layers]  # L x [1, H_kv, total - end, D]
    tail_v = [layer.values[:, :, end:].clone() for layer in cache.layers]  # L x [1, H_kv, total - end, D_v]
    truncate(cache, start)
    if total > end:
        keys, values = rotator.move_layers(tail_k, tail_v, -n)
        append_kv(cache, keys, values)
    return n
