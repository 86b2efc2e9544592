"""RadixHeads (service/kv/radix.py): token-exact longest match, tenants apart, the byte budget, LRU eviction."""

import random

import torch

from service.kv.cache import new_cache
from service.kv.radix import RadixHeads
from tiny import tiny_config

L, H, D = 2, 2, 4
A, B = ("acme", "fp"), ("globex", "fp")


def kv_of(ids: list[int], spare: int = 0):
    """A request's cache buffers for `ids` (each token's K/V encode its id, position and layer), as views of
    buffers with `spare` tokens of room, like GrowLayer's: L x [1, H, n, D]."""
    n = len(ids)
    keys, values = [], []
    for layer in range(L):
        buf_k = torch.zeros(1, H, n + spare, D)
        buf_v = torch.zeros(1, H, n + spare, D)
        for t, tok in enumerate(ids):
            buf_k[0, :, t] = tok * 1000 + t + layer / 10
            buf_v[0, :, t] = -(tok * 1000 + t + layer / 10)
        keys.append(buf_k[:, :, :n])
        values.append(buf_v[:, :, :n])
    return keys, values


def per_token_bytes() -> int:
    return 2 * L * H * D * 4


def served(hit) -> tuple[torch.Tensor, torch.Tensor]:
    """The hit's K/V of layer 0 and 1, concatenated over its spans: [1, H, N, D] each, both layers stacked."""
    ks = torch.cat([torch.cat([k[layer] for k, _ in hit.spans], dim=2) for layer in range(L)])
    vs = torch.cat([torch.cat([v[layer] for _, v in hit.spans], dim=2) for layer in range(L)])
    return ks, vs


def expected(ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    keys, values = kv_of(ids)
    return torch.cat(keys), torch.cat(values)


def test_longest_token_match_and_a_split_keeps_both_branches():
    tree = RadixHeads(1 << 30, min_tokens=4)
    common = list(range(10, 50))
    a, b = common + [1, 2, 3, 4, 5], common + [7, 8, 9]
    tree.insert(A, a, *kv_of(a))
    tree.insert(A, b, *kv_of(b))
    for ids in (a, b):
        hit = tree.match(A, ids + [99], limit=len(ids) + 1)
        assert hit is not None and hit.token_ids == ids
        k, v = served(hit)
        ek, ev = expected(ids)
        assert torch.equal(k, ek) and torch.equal(v, ev)
    hit = tree.match(A, common + [1, 2, 42, 43], limit=100)  # token-exact: ends inside a branch
    assert hit is not None and hit.n_tokens == len(common) + 2
    assert torch.equal(served(hit)[0], expected(common + [1, 2])[0])


def test_limit_clip_and_min_tokens():
    tree = RadixHeads(1 << 30, min_tokens=8)
    ids = list(range(3, 40))
    tree.insert(A, ids, *kv_of(ids))
    assert tree.match(A, ids, limit=len(ids) - 1).n_tokens == len(ids) - 1  # the last token stays to run
    assert tree.match(A, ids, limit=30, clip=lambda m: 20).n_tokens == 20
    assert tree.match(A, ids, limit=30, clip=lambda m: 5) is None  # shorter than min_tokens
    assert tree.match(A, ids[:5] + [1] * 10, limit=15) is None
    assert tree.lookup(A, ids[:5] + [1] * 10, limit=15) == (None, 5)  # held, too few to serve: a short miss
    assert tree.lookup(A, [1] * 10, limit=10) == (None, 0) and tree.lookup(B, ids, limit=9) == (None, 0)
    short = [300, 301, 302]
    assert tree.insert(A, short, *kv_of(short)) == 0 and tree.longest(A, short) == 0


def test_another_namespace_or_fingerprint_matches_nothing():
    tree = RadixHeads(1 << 30, min_tokens=4)
    ids = list(range(5, 60))
    tree.insert(A, ids, *kv_of(ids))
    assert tree.match(A, ids, limit=len(ids)) is not None
    assert tree.match(B, ids, limit=len(ids)) is None
    assert tree.match(("acme", "other-model"), ids, limit=len(ids)) is None
    assert tree.longest(B, ids) == 0


def test_a_stream_of_distinct_prompts_stays_within_the_budget():
    cap = 40_000
    tree = RadixHeads(cap, min_tokens=4)
    rng = random.Random(0)
    shared = [rng.randrange(3, 400) for _ in range(30)]
    for i in range(300):
        n = rng.randrange(8, 120)
        head = shared if i % 3 == 0 else []  # some share a head, most do not
        ids = head + [rng.randrange(3, 400) for _ in range(n)]
        tree.insert(A if i % 2 else B, ids, *kv_of(ids, spare=rng.randrange(0, 16)))
        assert tree.bytes_used <= cap
        live = {id(g): g.nbytes for g in _groups(tree)}
        assert tree.bytes_used == sum(live.values())  # the ledger is the storage the nodes keep alive
    assert tree.n_evicted > 0


def _groups(tree):
    stack = [c for r in tree._roots.values() for c in r.children.values()]
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        yield node.group


def test_least_recently_used_leaf_goes_first_and_a_touched_head_survives():
    n = 50
    tree = RadixHeads(3 * n * per_token_bytes(), min_tokens=4)
    heads = [[k * 7 + 3] + list(range(100 + k * n, 100 + k * n + n - 1)) for k in range(4)]
    for ids in heads[:3]:
        tree.insert(A, ids, *kv_of(ids))
    assert tree.match(A, heads[0], limit=n) is not None  # touched: now newer than heads[1]
    tree.insert(A, heads[3], *kv_of(heads[3]))
    assert tree.bytes_used <= tree.capacity_bytes
    assert tree.longest(A, heads[1]) == 0  # least recently used
    assert tree.longest(A, heads[0]) == n and tree.longest(A, heads[3]) == n


def test_views_of_one_buffer_are_counted_once_and_a_child_alone_frees_nothing():
    tree = RadixHeads(1 << 30, min_tokens=4)
    a = list(range(10, 110))  # 100 tokens, viewed in place
    tree.insert(A, a, *kv_of(a))
    assert tree.bytes_used == 100 * per_token_bytes()
    b = a[:90] + [7] * 10  # shares 90: its 10 new tokens are cloned, the split keeps a's halves on one buffer
    assert tree.insert(A, b, *kv_of(b)) == 10
    assert tree.bytes_used == 110 * per_token_bytes()
    tree.match(A, b, limit=100)  # b's branch is newer: a's rest is the LRU leaf
    # dropping a's 10-token rest frees nothing (its parent views the same buffer), so b's clone goes too
    assert tree.evict_until(tree.bytes_used - 1) == 2
    assert tree.bytes_used == 100 * per_token_bytes()
    assert tree.longest(A, a) == 90 and tree.longest(A, b) == 90


def test_a_head_larger_than_the_budget_is_not_kept_and_a_hit_is_copied_out():
    tree = RadixHeads(10 * per_token_bytes(), min_tokens=4)
    big = list(range(5, 25))
    assert tree.insert(A, big, *kv_of(big)) == 0 and tree.bytes_used == 0
    tree = RadixHeads(1 << 20, min_tokens=4)
    ids = list(range(5, 25))
    tree.insert(A, ids, *kv_of(ids))
    hit = tree.match(A, ids, limit=len(ids))
    cache = new_cache(tiny_config("llama", num_hidden_layers=L))
    hit.append_to(cache)
    cache.layers[0].keys.fill_(0.0)  # the request's own copy: the tree is untouched
    assert torch.equal(served(tree.match(A, ids, limit=len(ids)))[0], expected(ids)[0])
