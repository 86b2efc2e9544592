"""Taking a span out of a cache (a memory leaving a session's cache after the turn that read it)."""

import pytest
import torch

from service.kv.cache import new_cache, remove_span
from tiny import random_ids, tiny_runtime

ATOL = 2e-4

# every kind of cache layout the rotator knows: plain RoPE, partial rotary, per-layer RoPE with sliding windows,
# MLA (k_pe in the value slot), NoPE layers, M-RoPE
FAMILIES = ["llama", "qwen3", "phi-partial", "gemma3", "mistral-sliding", "deepseek_v3", "smollm3", "qwen2_vl"]


def _prefill(rt, ids):
    cache = new_cache(rt.model.config)
    rt.forward(ids, 0, cache)
    return cache


@pytest.mark.parametrize("family", FAMILIES)
def test_removing_a_span_gives_layer0_of_a_prefill_without_it(family):
    rt = tiny_runtime(family)
    before, span, after = random_ids(11, seed=1), random_ids(23, seed=2), random_ids(9, seed=3)
    cache = _prefill(rt, before + span + after)
    assert remove_span(cache, len(before), len(before) + len(span), rt.rotator) == len(span)
    ref = _prefill(rt, before + after)
    assert cache.get_seq_length() == len(before) + len(after)
    n = len(before)
    for layer, (got, want) in enumerate(zip(cache.layers, ref.layers)):  # [1, H_kv, T, D]
        # tokens before the span never saw it: equal on every layer
        torch.testing.assert_close(got.keys[:, :, :n], want.keys[:, :, :n], atol=ATOL, rtol=1e-4)
        torch.testing.assert_close(got.values[:, :, :n], want.values[:, :, :n], atol=ATOL, rtol=1e-4)
    # the moved tokens: layer 0 depends only on token and position, so it equals the prefill at the new positions
    got, want = cache.layers[0], ref.layers[0]
    torch.testing.assert_close(got.keys[:, :, n:], want.keys[:, :, n:], atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(got.values[:, :, n:], want.values[:, :, n:], atol=ATOL, rtol=1e-4)
    # deeper layers read the span when they were computed, and keep what they read (the design, not a bug)
    deep = cache.layers[-1]
    assert not torch.allclose(deep.values[:, :, n:], ref.layers[-1].values[:, :, n:], atol=1e-3)


def test_without_moving_the_tail_layer0_keys_differ():
    """Control: the moved keys must be re-rotated; left where they were computed they are wrong."""
    rt = tiny_runtime("llama")
    before, span, after = random_ids(5, seed=4), random_ids(30, seed=5), random_ids(8, seed=6)
    cache = _prefill(rt, before + span + after)
    ref = _prefill(rt, before + after)
    stale = cache.layers[0].keys[:, :, len(before) + len(span):]  # [1, H_kv, 8, D], at the old positions
    assert not torch.allclose(stale, ref.layers[0].keys[:, :, len(before):], atol=1e-2)


def test_remove_span_edges_and_later_appends():
    rt = tiny_runtime("llama")
    ids = random_ids(20, seed=7)
    cache = _prefill(rt, ids)
    assert remove_span(cache, 4, 4, rt.rotator) == 0 and cache.get_seq_length() == 20
    remove_span(cache, 12, 20, rt.rotator)  # a span at the end: nothing moves
    assert cache.get_seq_length() == 12
    with pytest.raises(ValueError):
        remove_span(cache, 10, 13, rt.rotator)
    # the cache keeps working: appending after a removal equals a prefill of what it now holds plus the new ids
    more = random_ids(6, seed=8)
    logits = rt.forward(more, 12, cache)
    ref = _prefill(rt, ids[:12] + more)
    torch.testing.assert_close(cache.layers[-1].keys, ref.layers[-1].keys, atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(logits, rt.forward(more, 12, _prefill(rt, ids[:12])), atol=ATOL, rtol=1e-4)
