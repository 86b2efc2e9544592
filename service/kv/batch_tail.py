"""Tails prefilled in the decode batch: several requests' last text runs as one forward over their rows.

A composed request's prefill ends with its text tail (the user turn and the assistant header, ~20 tokens) run
through the model on its own cache. When several requests finish composing in the same engine step (a burst of
arrivals), their tails run here instead as one forward over their new rows of the BatchKV: the linears multiply
one [B x Q]-row matrix instead of B matrices of ~Q rows, which on a CPU reads the float32 weights once, not B times
(8 tails of 22 tokens: the linears 1.4 s one by one, 0.6 s as one matrix; docs/BENCHMARKS.md, "Serving engine").

The rows are the last `len(counts)` rows of the batch (they joined with the K/V before their tails). Tails are
left-padded to the longest, so every row's last query is its last real token and the forward keeps one logit row
each. A row's real tokens go to columns len_b.. (column == position, as in a decode step); a padding query writes
nothing, sits at the row's first tail position and attends column 0 only (a finite, unused output).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from service.kv.batch import model_masks


class _TailLayer(CacheLayerMixin):
    """One layer of a tail forward: writes each row's real tail K/V at its columns, returns the rows' views."""

    is_sliding = False

    def __init__(self, cache: "TailCache", index: int) -> None:
        super().__init__()
        self.cache, self.index = cache, index
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:  # buffers exist already
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        c = self.cache
        k, v = c.batch.keys[self.index], c.batch.values[self.index]
        for i, t in enumerate(c.counts):  # key_states [B', H_kv, Q, D]: row i's real tokens are its last t
            r, n = c.first + i, c.lengths[i]
            k[r, :, n:n + t] = key_states[i, :, c.q - t:]
            v[r, :, n:n + t] = value_states[i, :, c.q - t:]
        rows = slice(c.first, c.first + len(c.counts))
        return k[rows, :, :c.span], v[rows, :, :c.span]  # [B', H_kv, T, D], T = the longest row after its tail

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cache.span, 0

    def get_seq_length(self) -> int:
        return self.cache.span - self.cache.q

    def get_max_length(self) -> int:
        return -1


class TailCache(Cache):
    """The view of rows first.. of a BatchKV that one tail forward writes through; `counts`: each row's tail length.
    The caller passes `positions` and `masks()` to the model."""

    def __init__(self, batch, first: int, counts: list[int]) -> None:
        self.batch, self.first, self.counts = batch, first, counts
        self.lengths = batch.lengths[first:first + len(counts)]
        self.q = max(counts)
        self.span = max(n + t for n, t in zip(self.lengths, counts))
        if self.span > batch.capacity:
            raise ValueError(f"tails reach column {self.span}, past the batch's capacity {batch.capacity}")
        device = batch.device
        j = torch.arange(self.q, device=device)[None, :]  # [1, Q]
        pad = torch.tensor([self.q - t for t in counts], device=device)[:, None]  # [B', 1] padding queries
        start = torch.tensor(self.lengths, device=device)[:, None]  # [B', 1]
        self.real = j >= pad  # [B', Q]
        self.positions = start + (j - pad).clamp(min=0)  # [B', Q]; a padding query: the first tail position
        super().__init__(layers=[_TailLayer(self, i) for i in range(len(batch.keys))])

    def masks(self, layer_types: list[str] | None, sliding_window: int | None, additive_dtype: torch.dtype | None):
        """[B', 1, Q, T] masks, as BatchCache.masks: causal from each row's own positions (sliding: within the
        window), a padding query on column 0 alone."""
        cols = torch.arange(self.span, device=self.positions.device)[None, None, :]  # [1, 1, T]
        pos = self.positions[:, :, None]  # [B', Q, 1]
        first_col = (cols == 0) & ~self.real[:, :, None]
        full = (cols <= pos) & self.real[:, :, None] | first_col  # [B', Q, T]
        sliding = ((cols <= pos) & (cols > pos - sliding_window) & self.real[:, :, None] | first_col
                   if sliding_window else full)
        return model_masks(full[:, None], sliding[:, None], layer_types, additive_dtype)  # [B', 1, Q, T]

    def advance(self) -> None:
        """After the forward: each row holds its tail."""
        for i, t in enumerate(self.counts):
            self.batch.lengths[self.first + i] += t
