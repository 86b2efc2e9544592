"""The model runner of the decode batch: one forward for every running sequence, each at its own position.

Rows are right-padded in a BatchKV (service/kv/batch.py: why that layout); the step passes per-row positions and
its own 4-D masks, so a row never attends to padding or to another row, sliding-window layers see their window
counted from the row's own position, and every family's own attention code (sdpa or eager, MLA, M-RoPE, per-layer
RoPE) runs unchanged.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from service.kv.batch import SHARE_CHUNK, BatchKV
from service.kv.batch_tail import TailCache
from service.runtime import attention


class DecodeBatch:
    def __init__(self, rt, kernel_attention: bool | None = None, share_chunks: bool = True) -> None:
        """kernel_attention: steps run attention on service/runtime/attention.py's kernel (None: as the runtime does,
        SKILLCACHE_ATTENTION_KERNEL where it fits the model); share_chunks: rows holding the same K/V chunks read
        them from one row there (False: each its own, for A/B)."""
        self.rt, self.model = rt, rt.model
        cfg = rt.config  # the text config
        self.layer_types = getattr(cfg, "layer_types", None)  # models that list them take masks by layer type
        self.sliding_window = getattr(cfg, "sliding_window", None)
        eager = getattr(self.model.config, "_attn_implementation", "sdpa") == "eager"
        self.additive_dtype = self.model.dtype if eager else None  # eager adds the mask; sdpa takes bool
        self.kernel_attention = rt.kernel_attention if kernel_attention is None else kernel_attention
        self.kv = BatchKV(share_chunks=share_chunks and self.kernel_attention)  # only the kernel reads them
        self._shared_reads: attention.Shared | None = None  # for the sources table it was made from

    @property
    def n_rows(self) -> int:
        return self.kv.n_rows

    @property
    def size_bytes(self) -> int:
        return self.kv.size_bytes

    def join(self, cache: DynamicCache, reserve_tokens: int, rows: int = 1) -> int:
        """A new row for the prefilled cache (rows: how many the batch is about to hold, BatchKV.add)."""
        return self.kv.add(cache, reserve_tokens, rows)

    def leave(self, row: int, keep_cache: bool = False) -> DynamicCache | None:
        """Free a row (the last row moves into it); keep_cache: its K/V as a cache of its own first."""
        cache = self.kv.extract(row, self.model.config) if keep_cache else None
        self.kv.remove(row)
        return cache

    @torch.inference_mode()
    def step(self, tokens: list[int]) -> torch.Tensor:
        """Run row b's token at its position -> next-token logits [B, V] float32; every row holds one more token."""
        step_cache = self.kv.step_cache()
        masks = step_cache.masks(self.layer_types, self.sliding_window, self.additive_dtype)
        input_ids = torch.tensor(tokens, device=self.kv.device)[:, None]  # [B, 1]
        with attention.kernel_attention(self.rt.config, self.kernel_attention, self._shared()):
            out = self.model(input_ids=input_ids, position_ids=step_cache.positions[:, None], attention_mask=masks,
                             cache=step_cache, use_cache=True, logits_to_keep=1)
        self.kv.advance()
        return out.logits[:, -1].float()  # [B, V]

    @torch.inference_mode()
    def prefill_tails(self, tails: list[list[int]]) -> torch.Tensor:
        """Run tails[i] after the K/V of row n_rows - len(tails) + i (the rows that just joined), as one forward
        (service/kv/batch_tail.py) -> each row's next-token logits [B', V] float32; each row holds its tail."""
        cache = TailCache(self.kv, self.kv.n_rows - len(tails), [len(t) for t in tails])
        masks = cache.masks(self.layer_types, self.sliding_window, self.additive_dtype)
        ids = torch.tensor([[t[0]] * (cache.q - len(t)) + t for t in tails], device=self.kv.device)  # [B', Q]
        with attention.kernel_attention(self.rt.config, self.kernel_attention):
            out = self.model(input_ids=ids, position_ids=cache.positions, attention_mask=masks, cache=cache,
                             use_cache=True, logits_to_keep=1)
        cache.advance()
        return out.logits[:, -1].float()  # [B', V]

    @property
    def shared_rows(self) -> int:
        """Rows that read some chunk from another row (0 with sharing off)."""
        return self.kv.shared_rows

    def _shared(self) -> attention.Shared | None:
        """Rows that hold the same chunks of K/V read them from one row (service/kv/batch.py); none shared: None.
        Made again only when the table changes (a join or a leave, which are also what move the buffers)."""
        sources = self.kv.sources()
        if sources is None:
            return None
        if self._shared_reads is None or self._shared_reads.sources is not sources:
            storages = frozenset(t.untyped_storage().data_ptr() for t in (*self.kv.keys, *self.kv.values))
            self._shared_reads = attention.Shared(sources, SHARE_CHUNK, storages)
        return self._shared_reads
