"""K/V into and out of vLLM's paged cache, whatever layout the attention backend packs it in.

Writing (`write_piece`): a saved span's K/V, keys re-rotated to their new positions on the cache's device (a GPU
rotates there: only the record crosses the bus), put in place by the backend's own cache write. Reading back:

The connector writes with the backend's own cache write (`impl.do_kv_cache_update`), so it never needs to know the
layout to load. To save (the K/V vLLM computed for a block or a step, service/vllm/connector.py), it must read slots
back: the CPU backend packs keys transposed per block and head (and its AMX and vec16 paths differently again),
CUDA's FlashAttention keeps [2, blocks, block_size, H, D]. Rather than a reader per layout, the layout is learned once
per (shape, dtype, backend) from the write itself: write codes into a one-block scratch cache with the same op, and
see where each (token, head, dim) of keys and of values lands. Codes are small integers (at most 256, exact in
bfloat16 and float16), one pass per coordinate.

Only layouts that keep each block's elements apart along one dimension of size num_blocks are handled (every backend
vLLM ships for decoder attention); a cache this cannot learn (an fp8 cache: codes do not survive) raises LayoutError,
and the connector then saves nothing (vLLM computes, as without a connector).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# write(k [T, H, D], v [T, H, D], cache, slots [T] int64): the backend's own cache write into `cache`
Write = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def write_piece(rotator, layer: int, k: torch.Tensor, v: torch.Tensor, delta: int, cache: torch.Tensor,
                slots: torch.Tensor, write: Write) -> None:
    """One layer of one piece into `cache`: k, v [T, H, D] (post-RoPE at the positions they were saved at) moved by
    `delta` positions (rotator: service/kv/rope.py, KeyRotator) and written to `slots` [T] with `write`."""
    dev, dt = cache.device, cache.dtype
    k = k.to(dev)
    if delta:
        k = rotator.rotate(k.transpose(0, 1)[None], delta, layer)[0].transpose(0, 1)  # via [1, H, T, D]
    write(k.to(dt).contiguous(), v.to(dev, dt), cache, slots.to(dev))


class LayoutError(Exception):
    """A cache layout the slot reader cannot learn."""


@dataclass(frozen=True)
class SlotIndex:
    """Where (token-in-block t, head h, dim d) of keys and of values sit, as flat offsets into the cache."""

    block_dim: int  # the cache's dimension of size num_blocks
    keys: torch.Tensor  # [bs, H, D] int64: offsets within block 0 of the real cache
    values: torch.Tensor  # [bs, H, D] int64
    block_stride: int  # flat elements between block b and b + 1

    def gather(self, cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of `slots` ([T] int64, block * bs + t): ([T, H, D], [T, H, D]), copies in the cache's dtype."""
        bs = self.keys.shape[0]
        base = (slots // bs) * self.block_stride  # [T]
        t = slots % bs
        flat = cache.reshape(-1) if cache.is_contiguous() else cache.contiguous().reshape(-1)
        k = flat[base[:, None, None] + self.keys[t]]  # [T, H, D]
        v = flat[base[:, None, None] + self.values[t]]
        return k, v


def _block_dim(shape: torch.Size, num_blocks: int) -> int:
    dims = [i for i, n in enumerate(shape) if n == num_blocks]
    if not dims:
        raise LayoutError(f"no dimension of {tuple(shape)} is the {num_blocks} blocks")
    return dims[0]  # [blocks, ...] on CPU; [2, blocks, ...] on CUDA: the first of that size is the block axis


def learn(cache: torch.Tensor, num_blocks: int, block_size: int, n_heads: int, head_dim: int, write: Write
          ) -> SlotIndex:
    """The SlotIndex of `cache` (one layer's paged cache) under `write`, learned on a one-block scratch copy."""
    if max(block_size, n_heads, head_dim) > 256 or cache.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise LayoutError(f"cannot learn a {cache.dtype} cache of block {block_size}, {n_heads} heads of {head_dim}")
    bd = _block_dim(cache.shape, num_blocks)
    shape = list(cache.shape)
    shape[bd] = 1
    slots = torch.arange(block_size, dtype=torch.int64)
    grid = torch.meshgrid(torch.arange(block_size), torch.arange(n_heads), torch.arange(head_dim), indexing="ij")
    zero = torch.zeros(block_size, n_heads, head_dim, dtype=cache.dtype)
    where: dict[str, list[torch.Tensor]] = {"keys": [], "values": []}
    for side in ("keys", "values"):
        for coord in grid:  # token, head, dim in turn
            scratch = torch.zeros(shape, dtype=cache.dtype)
            code = (coord + 1).to(cache.dtype)  # 0: not written by this side
            write(code if side == "keys" else zero, zero if side == "keys" else code, scratch, slots)
            where[side].append(scratch.reshape(-1).float())
    index: dict[str, torch.Tensor] = {}
    n = block_size * n_heads * head_dim
    for side, (tc, hc, dc) in where.items():
        hit = (tc > 0).nonzero().squeeze(1)  # scratch offsets this side wrote
        if hit.numel() != n:
            raise LayoutError(f"the write put {hit.numel()} {side} elements in a block of {n}")
        t, h, d = (tc[hit] - 1).long(), (hc[hit] - 1).long(), (dc[hit] - 1).long()
        off = torch.full((block_size, n_heads, head_dim), -1, dtype=torch.int64)
        off[t, h, d] = _real_offset(hit, shape, cache)
        if (off < 0).any():
            raise LayoutError(f"the write did not place every {side} element once")
        index[side] = off
    return SlotIndex(bd, index["keys"], index["values"], _contiguous_strides(cache.shape)[bd])


def _contiguous_strides(shape) -> list[int]:
    strides, acc = [], 1
    for n in reversed(list(shape)):
        strides.append(acc)
        acc *= n
    return strides[::-1]


def _real_offset(scratch_flat: torch.Tensor, scratch_shape: list[int], cache: torch.Tensor) -> torch.Tensor:
    """Flat offsets in the one-block scratch -> flat offsets of block 0 in the (contiguous) real cache."""
    real = _contiguous_strides(cache.shape)
    out = torch.zeros_like(scratch_flat)
    rest = scratch_flat.clone()
    for s_real, s_scr in zip(real, _contiguous_strides(scratch_shape)):
        coord = rest // s_scr
        rest = rest % s_scr
        out += coord * s_real
    return out
