"""The decode batch's K/V: one buffer per layer, a row per running sequence, each row its own length.

Why this layout (measured, docs/BENCHMARKS.md "Engine"): a batched decode forward needs every running sequence's
K/V as one `[B, H_kv, T, D]` tensor. Stacking the requests' own caches every step copies all of them per layer per
step (what DynamicCache's torch.cat already costs for one row); transformers' continuous batching (5.24)
cannot start a request from spliced K/V: its requests begin from token ids. So the rows live here, right-padded:
row b holds its sequence at columns 0..len_b-1, column == position (a composed cache is positional), and the
step's new token goes to column len_b. A sequence's K/V is copied in once when it joins (after its prefill) and a
row is moved once when another leaves (the last row fills the hole), never per step. The buffers grow (to a power-of-two
number of rows, a multiple of 256 columns) and are kept when the batch empties, until `release()`: the next burst
of requests writes into memory already mapped. A live row's columns past its
length hold zeros (or the finite numbers of a row that left), never attended (the mask), so no NaN from
uninitialised memory can reach P.V (sdpa multiplies a masked column's value by 0). Buffers are allocated empty and
only live rows are written, so growing the batch does not zero-fill (and fault in) the slots no row uses yet.

Shared chunks: concurrent requests on the same skills hold the same K/V up to where their texts part (a skill
copied after the anchor, the same seams, a refined prefix: bitwise the same, service/runtime/model.py). Each row
still holds its own copy, but when a row joins, its whole chunks of SHARE_CHUNK columns are compared with the rows
already here, and `sources()` tells the attention kernel which row to read each chunk from, so a skill's K/V comes
from memory once a step for every row on it. At eight rows of a ~1k-token skill the rows' K/V reads were half of a
step (docs/BENCHMARKS.md, "Serving engine"). A shared chunk lies before both rows' lengths when they join, so no
step writes to it: it stays shared until a row leaves.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache

from service.kv.cache import new_cache

_ROUND = 256  # capacity grows to a multiple of this many tokens
SHARE_CHUNK = 256  # columns a shared chunk spans: the attention kernel's chunk (decode_attention.cpp)


class BatchKV:
    """Per-layer buffers `[S, H_kv, cap, D]`; rows 0..n_rows-1 are live. All methods run on the model thread."""

    def __init__(self, share_chunks: bool = True) -> None:
        self.share_chunks = share_chunks  # compare a joining row's chunks with the others' (sources())
        self.keys: list[torch.Tensor] = []  # L x [S, H_kv, cap, D]
        self.values: list[torch.Tensor] = []  # L x [S, H_kv, cap, Dv]
        self.lengths: list[int] = []  # per live row: tokens held
        self.chunk_ids: list[list[int]] = []  # per live row: an id per whole chunk it held when it joined
        self.device: torch.device | None = None
        self._next_id = 0
        self._table: tuple[torch.Tensor | None, int] | None = None  # (sources(), shared_rows) until rows change

    @property
    def n_rows(self) -> int:
        return len(self.lengths)

    @property
    def slots(self) -> int:
        return self.keys[0].shape[0] if self.keys else 0

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    @property
    def size_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def _realloc(self, slots: int, cap: int) -> None:
        """New buffers of `slots` rows x `cap` tokens, live rows copied over (zeros past the longest)."""
        n, t = self.n_rows, max(self.lengths, default=0)
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            with torch.inference_mode(False):  # normal tensors, written in place in and outside inference mode
                k2 = k.new_empty((slots, k.shape[1], cap, k.shape[3]))
                v2 = v.new_empty((slots, v.shape[1], cap, v.shape[3]))
            for new, old in ((k2, k), (v2, v)):
                new[:n, :, :t] = old[:n, :, :t]
                new[:n, :, t:].zero_()
            self.keys[i], self.values[i] = k2, v2

    @staticmethod
    def padded(n_tokens: int) -> int:
        """The capacity a row of n_tokens makes the batch allocate."""
        return -(-n_tokens // _ROUND) * _ROUND

    @staticmethod
    def slots_for(rows: int) -> int:
        """The rows the batch allocates to hold `rows` rows: the next power of two."""
        return 1 << (rows - 1).bit_length()

    def add(self, cache: DynamicCache, reserve_tokens: int, rows: int = 1) -> int:
        """Copy a prefilled batch-1 cache into a new row with room for `reserve_tokens` in all; returns the row.
        `rows`: how many rows the batch is about to hold (the engine's admitted sequences): buffers that grow get
        slots for all of them at once, not one doubling per join."""
        layers = cache.layers
        n = layers[0].get_seq_length()
        need = self.padded(max(reserve_tokens, n + 1))
        slots = self.slots_for(max(rows, self.n_rows + 1))
        if not self.keys:  # first row: shapes, dtype and device from the sequence
            self.device = layers[0].keys.device
            with torch.inference_mode(False):
                self.keys = [lay.keys.new_empty((slots, lay.keys.shape[1], need, lay.keys.shape[3]))
                             for lay in layers]
                self.values = [lay.values.new_empty((slots, lay.values.shape[1], need, lay.values.shape[3]))
                               for lay in layers]
        elif self.n_rows == self.slots or need > self.capacity:
            self._realloc(max(slots, self.slots), max(self.capacity, need))
        row = self.n_rows
        for lay, k, v in zip(layers, self.keys, self.values):
            k[row, :, :n] = lay.keys[0]
            v[row, :, :n] = lay.values[0]
            k[row, :, n:].zero_()
            v[row, :, n:].zero_()
        self.lengths.append(n)
        self.chunk_ids.append(self._chunk_ids(row, n // SHARE_CHUNK) if self.share_chunks else [])
        self._table = None
        return row

    def _chunk_ids(self, row: int, n_chunks: int) -> list[int]:
        """Ids for the new row's first n_chunks chunks: a chunk that holds bitwise what another row holds there, and
        follows chunks it shares with that row, takes that row's id; the rest new ones."""
        ids: list[int] = []
        peers = list(range(row))  # rows that share every chunk so far
        for c in range(n_chunks):
            cols = slice(c * SHARE_CHUNK, (c + 1) * SHARE_CHUNK)
            tried, match = set(), None
            for r in peers:
                cid = self.chunk_ids[r][c] if c < len(self.chunk_ids[r]) else None
                if cid is None or cid in tried:
                    continue
                tried.add(cid)
                if all(torch.equal(k[r, :, cols], k[row, :, cols]) and torch.equal(v[r, :, cols], v[row, :, cols])
                       for k, v in zip(self.keys, self.values)):
                    match = cid
                    break
            if match is None:
                break
            ids.append(match)
            peers = [r for r in peers if c < len(self.chunk_ids[r]) and self.chunk_ids[r][c] == match]
        while len(ids) < n_chunks:
            ids.append(self._next_id)
            self._next_id += 1
        return ids

    def sources(self) -> torch.Tensor | None:
        """[B, C] int64: the row whose copy of chunk c row b's attention reads (the first row with that chunk's id;
        a row past its own chunks reads itself); None when no chunk is shared. The same tensor until rows change."""
        return self._sources_table()[0]

    @property
    def shared_rows(self) -> int:
        """Rows that read some chunk from another row."""
        return self._sources_table()[1]

    def _sources_table(self) -> tuple[torch.Tensor | None, int]:
        if self._table is None:
            first: dict[int, int] = {}
            width = max(map(len, self.chunk_ids), default=0)
            table = [[first.setdefault(cid, b) for cid in ids] + [b] * (width - len(ids))
                     for b, ids in enumerate(self.chunk_ids)]
            shared = sum(any(src != b for src in srcs) for b, srcs in enumerate(table))
            self._table = (torch.tensor(table, dtype=torch.int64) if shared else None, shared)
        return self._table

    def remove(self, row: int) -> None:
        """Drop a row; the last row moves into its place (the caller renumbers it)."""
        last = self.n_rows - 1
        if row != last:
            t = self.lengths[last]
            for k, v in zip(self.keys, self.values):
                k[row, :, :t] = k[last, :, :t]
                v[row, :, :t] = v[last, :, :t]
            self.lengths[row] = t
            self.chunk_ids[row] = self.chunk_ids[last]
        self.lengths.pop()
        self.chunk_ids.pop()
        self._table = None

    def release(self) -> None:
        """Give the buffers back (no live rows). Until then they stay allocated when the last row leaves, so the next
        rows are written to pages already mapped: fresh buffers for eight rows of ~1k tokens take ~80k page faults
        on first write, ~300 ms of a burst's joins on a 2-core CPU (docs/BENCHMARKS.md, "Serving engine")."""
        assert not self.lengths, "release() with live rows"
        self.keys, self.values = [], []

    def extract(self, row: int, config) -> DynamicCache:
        """The row as a batch-1 cache of its own (a session keeps its K/V between turns)."""
        n = self.lengths[row]
        cache = new_cache(config, reserve_tokens=n)
        for layer, (k, v) in enumerate(zip(self.keys, self.values)):
            cache.update(k[row:row + 1, :, :n], v[row:row + 1, :, :n], layer)
        return cache

    def step_cache(self) -> "BatchCache":
        """The transformers Cache one decode forward over every live row writes its new token through."""
        return BatchCache(self)

    def advance(self) -> None:
        """After a decode forward: every row holds one more token."""
        self.lengths = [n + 1 for n in self.lengths]


class _BatchLayer(CacheLayerMixin):
    """One layer of a decode step: writes row b's new K/V at column len_b, returns the live rows' views."""

    is_sliding = False

    def __init__(self, batch: BatchKV, index: int, rows: torch.Tensor, cols: torch.Tensor, span: int) -> None:
        super().__init__()
        self.batch, self.index, self.rows, self.cols, self.span = batch, index, rows, cols, span
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:  # buffers exist already
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        k, v = self.batch.keys[self.index], self.batch.values[self.index]
        k[self.rows, :, self.cols] = key_states[:, :, 0]  # [B, H_kv, D] at (row b, column len_b)
        v[self.rows, :, self.cols] = value_states[:, :, 0]
        b = self.rows.shape[0]
        return k[:b, :, :self.span], v[:b, :, :self.span]  # [B, H_kv, T, D], T = longest row + 1

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.span, 0

    def get_seq_length(self) -> int:
        return self.span - 1

    def get_max_length(self) -> int:
        return -1


class BatchCache(Cache):
    """A decode step's view of the BatchKV (q = 1 token per row). The caller passes its own 4-D mask."""

    def __init__(self, batch: BatchKV) -> None:
        device = batch.device
        self.positions = torch.tensor(batch.lengths, device=device)  # [B]: each row's new token's position
        rows = torch.arange(batch.n_rows, device=device)
        span = max(batch.lengths) + 1
        super().__init__(layers=[_BatchLayer(batch, i, rows, self.positions, span) for i in range(len(batch.keys))])
        self.span = span

    def masks(self, layer_types: list[str] | None, sliding_window: int | None, additive_dtype: torch.dtype | None):
        """The 4-D masks `[B, 1, 1, T]` for this step: a dict by layer type for models that take one (those whose
        config lists `layer_types`), else the one mask every layer uses (sliding when the config has a window).
        bool (True = attend) for sdpa; additive float (0 / dtype min) for eager attention."""
        cols = torch.arange(self.span, device=self.positions.device)[None, :]  # [1, T]
        pos = self.positions[:, None]  # [B, 1]
        full = cols <= pos  # [B, T]
        sliding = full & (cols > pos - sliding_window) if sliding_window else full  # as masking_utils' overlay
        return model_masks(full[:, None, None, :], sliding[:, None, None, :], layer_types, additive_dtype)


def model_masks(full: torch.Tensor, sliding: torch.Tensor, layer_types: list[str] | None,
                additive_dtype: torch.dtype | None):
    """Bool masks [B, 1, Q, T] (True = attend) as the model takes them: a dict by layer type for models whose config
    lists `layer_types`, else the sliding one (`full` where there is no window); additive float (0 / dtype min) for
    eager attention."""

    def shape(m: torch.Tensor) -> torch.Tensor:
        if additive_dtype is None:
            return m
        return torch.zeros(m.shape, dtype=additive_dtype, device=m.device).masked_fill(
            ~m, torch.finfo(additive_dtype).min)

    if layer_types is not None:
        return {"full_attention": shape(full), "sliding_attention": shape(sliding)}
    return shape(sliding)
