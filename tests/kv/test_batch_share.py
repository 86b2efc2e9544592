"""The decode batch's shared chunks (service/kv/batch.py): a joining row's whole chunks that hold bitwise what another
row holds there, from the first on, take that row's id; sources() tells the attention kernel where to read them."""

import torch

from service.kv.batch import SHARE_CHUNK, BatchKV
from service.kv.cache import append_kv, new_cache
from tiny import tiny_runtime

CONFIG = tiny_runtime("llama").model.config
LAYERS = CONFIG.num_hidden_layers


def _cache(parts: list[tuple[int, int]]) -> object:
    """A batch-1 cache whose K/V is made of (seed, tokens) pieces of random numbers, one after another."""
    cache = new_cache(CONFIG)
    for seed, n in parts:
        g = torch.Generator().manual_seed(seed)
        append_kv(cache, [torch.randn(1, 2, n, 16, generator=g) for _ in range(LAYERS)],
                  [torch.randn(1, 2, n, 16, generator=g) for _ in range(LAYERS)])
    return cache


def test_rows_share_the_whole_chunks_they_hold_alike_from_the_first_on():
    kv = BatchKV()
    c = SHARE_CHUNK
    rows = [
        kv.add(_cache([(1, c), (11, c), (2, 90)]), 3 * c),  # A: two whole chunks
        kv.add(_cache([(1, c), (11, c), (3, 40)]), 3 * c),  # B: A's two chunks, its own text after them
        kv.add(_cache([(4, 2 * c + 5)]), 3 * c),  # C: nothing alike
        kv.add(_cache([(1, c), (5, c + 7)]), 3 * c),  # D: A's first chunk only
        kv.add(_cache([(6, c), (11, c)]), 3 * c),  # E: A's second chunk's numbers, but after another first chunk
    ]
    assert rows == [0, 1, 2, 3, 4]
    assert kv.sources().tolist() == [[0, 0], [0, 0], [2, 2], [0, 3], [4, 4]]
    kv.remove(0)  # E moves into row 0: D now reads the first chunk from B, B reads itself
    assert kv.sources().tolist() == [[0, 0], [1, 1], [2, 2], [1, 3]]
    for _ in range(2):
        kv.remove(1)
    assert kv.sources() is None  # nothing shared any more


def test_a_partly_filled_chunk_is_never_shared_and_sharing_can_be_off():
    c = SHARE_CHUNK
    kv = BatchKV()
    kv.add(_cache([(1, c - 1)]), c + 8)
    kv.add(_cache([(1, c - 1)]), c + 8)  # the same numbers, but decode steps will write into this chunk
    assert kv.sources() is None
    off = BatchKV(share_chunks=False)
    off.add(_cache([(1, c)]), c + 8)
    off.add(_cache([(1, c)]), c + 8)
    assert off.sources() is None

