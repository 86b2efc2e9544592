"""RadixHeads: the exact K/V of prompt heads seen before, per tenant, within a byte budget (automatic reuse).

A radix tree over token ids, one root per key (tenant namespace, model fingerprint): the same ids under another key
share nothing. A node is a span of tokens at the positions of its depth (keys are post-RoPE: a span is valid only
there) and holds per-layer views `[1, H_kv, t, D]` into a *group*: one request's cache buffers (views, no copy) or a
compact clone of the part of a prompt the tree did not hold yet. Matching is token-exact (no rounding down to a
block) and a head is served as one span per node, copied into the request's own cache (`HeadMatch.append_to`), so a
cache handed to generation never aliases the tree. A hash chain over fixed-size chunks would round every match down
to a chunk and hand out one small tensor per chunk and layer to concatenate; the tree keeps a repeated 2k-token
system prompt as one span per layer.

Bytes are counted by storage: a group's bytes are its buffers' whole storage, counted once while any node views it
(a split keeps both halves on one group). Eviction drops least recently used leaves until the budget holds; a leaf
whose group another node still views frees nothing by itself. Everything runs on the serving engine's model thread
(match and the copy in the same step, insert and eviction at a sequence's join), so no node needs a lock.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from service.kv.cache import append_kv

Key = tuple[str, str]  # (namespace, model fingerprint)


@dataclass(eq=False)
class _Group:
    keys: list[torch.Tensor]  # L x [1, H_kv, n, D]: a request's cache (views of its buffers) or a compact clone
    values: list[torch.Tensor]  # L x [1, H_kv, n, D_v]
    nbytes: int  # the storage these tensors keep alive
    start: int = 0  # the prompt position of index 0 (a clone of tokens [m, n) starts at m)
    refs: int = 0  # nodes that view it


@dataclass(eq=False)
class _Node:
    ids: list[int]
    group: _Group | None
    offset: int  # the span's first token is group.keys[l][:, :, offset]
    parent: "_Node | None"
    children: dict[int, "_Node"] = field(default_factory=dict)
    used: int = 0  # LRU clock

    def kv(self, n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Views of the span's first n tokens: L x [1, H_kv, n, D]."""
        assert self.group is not None
        a, b = self.offset, self.offset + n
        return [k[:, :, a:b] for k in self.group.keys], [v[:, :, a:b] for v in self.group.values]


@dataclass
class HeadMatch:
    """A head the tree holds: the exact K/V of token_ids at positions 0..N-1, as spans of views (tree-owned)."""

    token_ids: list[int]
    spans: list[tuple[list[torch.Tensor], list[torch.Tensor]]]  # per node, in order: L x [1, H_kv, t, D]

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)

    def append_to(self, cache: DynamicCache) -> None:
        """Copy the head into an empty cache (append_kv copies: the cache never aliases the tree)."""
        for keys, values in self.spans:
            append_kv(cache, keys, values)


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def _common(span: list[int], ids: list[int], at: int, limit: int) -> int:
    """Tokens span and ids[at:limit] share from their start."""
    n = min(len(span), limit - at)
    if span[:n] == ids[at:at + n]:
        return n
    return next(i for i in range(n) if span[i] != ids[at + i])


class RadixHeads:
    def __init__(self, capacity_bytes: int, min_tokens: int = 1) -> None:
        self.capacity_bytes, self.min_tokens = capacity_bytes, max(1, min_tokens)
        self._roots: dict[Key, _Node] = {}
        self._clock = itertools.count(1)
        self.bytes_used = 0
        self.n_evicted = 0  # leaves dropped to stay within the budget, since start

    def _walk(self, root: _Node, ids: list[int], limit: int) -> tuple[list[tuple[_Node, int]], int]:
        """The nodes the ids run through (each with the tokens matched in it) and the tokens matched in all."""
        path: list[tuple[_Node, int]] = []
        node, m = root, 0
        while m < limit:
            child = node.children.get(ids[m])
            if child is None:
                break
            c = _common(child.ids, ids, m, limit)
            path.append((child, c))
            m += c
            if c < len(child.ids):
                break
            node = child
        return path, m

    def longest(self, key: Key, ids: list[int], limit: int | None = None) -> int:
        """Tokens of ids[:limit] the tree holds from the start (no LRU touch)."""
        root = self._roots.get(key)
        return self._walk(root, ids, len(ids) if limit is None else limit)[1] if root is not None else 0

    def match(self, key: Key, ids: list[int], limit: int, clip: Callable[[int], int] | None = None
              ) -> HeadMatch | None:
        """The longest head of ids[:limit] the tree holds, cut back by `clip(m) <= m` (where a head may end), or None
        when that is shorter than min_tokens. A hit counts as a use of every node it runs through."""
        return self.lookup(key, ids, limit, clip)[0]

    def lookup(self, key: Key, ids: list[int], limit: int, clip: Callable[[int], int] | None = None
               ) -> tuple[HeadMatch | None, int]:
        """match(), and the tokens held after clip even when too few to serve (one walk: a miss tells short from
        none without walking again)."""
        root = self._roots.get(key)
        if root is None:
            return None, 0
        path, m = self._walk(root, ids, min(limit, len(ids)))
        m = clip(m) if clip is not None else m
        if m < self.min_tokens:
            return None, m
        tick, spans, left = next(self._clock), [], m
        for node, c in path:
            if left <= 0:
                break
            take = min(c, left)
            spans.append(node.kv(take))
            node.used, left = tick, left - take
        return HeadMatch(list(ids[:m]), spans), m

    def insert(self, key: Key, ids: list[int], keys: list[torch.Tensor], values: list[torch.Tensor]) -> int:
        """Keep the exact K/V of ids (keys, values: L x [1, H_kv, >= len(ids), D], positions 0..): the part the tree
        lacks is viewed in place when that holds at most twice its bytes, else cloned. Returns the tokens added."""
        n = len(ids)
        if n < self.min_tokens or not keys:
            return 0
        root = self._roots.setdefault(key, _Node([], None, 0, None))
        path, m = self._walk(root, ids, n)
        tick = next(self._clock)
        for node, _ in path:
            node.used = tick
        if m == n:
            return 0
        group = self._group(keys, values, m, n)
        if group.nbytes > self.capacity_bytes:
            return 0  # larger than the whole budget: not kept
        parent = root
        if path:
            last, c = path[-1]
            parent = self._split(last, c) if c < len(last.ids) else last
        leaf = _Node(list(ids[m:n]), group, m - group.start, parent, used=tick)
        parent.children[ids[m]] = leaf
        self._ref(group)
        self.evict_until(self.capacity_bytes)
        return n - m

    def insert_cache(self, key: Key, ids: list[int], cache: DynamicCache) -> int:
        """insert() from a prompt's cache that holds at least the ids' K/V from position 0 on (views of its layers:
        nothing may write to the cache's buffers again)."""
        layers = cache.layers
        n = min(len(ids), layers[0].get_seq_length() if layers else 0)
        return self.insert(key, ids[:n], [la.keys for la in layers], [la.values for la in layers])

    def _group(self, keys, values, m: int, n: int) -> _Group:
        """The K/V of tokens [m, n): views of the given buffers, or a compact clone when those keep alive more than
        twice the bytes of the new part (an agent's next turn adds a little to a long head it shares)."""
        view_bytes = _storage_bytes([*keys, *values])
        part = [t[:, :, m:n] for t in (*keys, *values)]  # (2L) x [1, H_kv, n - m, D]
        part_bytes = sum(t.numel() * t.element_size() for t in part)
        if view_bytes <= 2 * part_bytes:
            return _Group([k[:, :, :n] for k in keys], [v[:, :, :n] for v in values], view_bytes)
        with torch.inference_mode(False):  # a normal tensor, like the caches'
            clone = [t.clone() for t in part]
        half = len(keys)
        return _Group(clone[:half], clone[half:], part_bytes, start=m)

    def _split(self, node: _Node, c: int) -> _Node:
        """Cut node after its first c tokens; returns the new upper half (both halves view the same group)."""
        assert node.parent is not None and node.group is not None
        upper = _Node(node.ids[:c], node.group, node.offset, node.parent, used=node.used)
        node.parent.children[node.ids[0]] = upper
        node.ids, node.offset, node.parent = node.ids[c:], node.offset + c, upper
        upper.children[node.ids[0]] = node
        node.group.refs += 1
        return upper

    def _ref(self, group: _Group) -> None:
        if group.refs == 0:
            self.bytes_used += group.nbytes
        group.refs += 1

    def _unref(self, group: _Group) -> None:
        group.refs -= 1
        if group.refs == 0:
            self.bytes_used -= group.nbytes

    def _leaves(self) -> list[_Node]:
        out, stack = [], [c for r in self._roots.values() for c in r.children.values()]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                out.append(node)
        return out

    def evict_until(self, cap: int) -> int:
        """Drop least recently used leaves until bytes_used <= cap; returns the leaves dropped."""
        if self.bytes_used <= cap:
            return 0
        heap = [(node.used, id(node), node) for node in self._leaves()]
        heapq.heapify(heap)
        dropped = 0
        while self.bytes_used > cap and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None and leaf.group is not None
            del parent.children[leaf.ids[0]]
            self._unref(leaf.group)
            dropped += 1
            if parent.parent is not None and not parent.children:
                heapq.heappush(heap, (parent.used, id(parent), parent))
        self._roots = {k: r for k, r in self._roots.items() if r.children}
        self.n_evicted += dropped
        return dropped

    def clear(self) -> None:
        self._roots.clear()
        self.bytes_used = 0
