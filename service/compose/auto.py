"""AutoHeads: automatic exact reuse of repeated prompt heads on the embedded engine (SKILLCACHE_AUTO_REUSE).

Every prompt's exact K/V (a full prefill's whole prompt; a composition's up to where its first re-rotated block copy
starts, PrefillResult.n_exact) is kept in a radix tree (service/kv/radix.py) under the tenant's namespace and the
model fingerprint, within SKILLCACHE_AUTO_CACHE_BYTES. A later prompt of the same tenant that opens with the same
ids, with or without skills, copies the longest such head into its own cache as an exact prefix: a repeated system
prompt costs its tail only, and usage reports the head as cached (`auto_tokens`, part of `prefix_tokens`). Nothing
needs registering. A refined prefix (service/compose/refine.py) that is longer wins.

Both ends run on the model thread: `match` in the request's first prefill step (the copy happens in that same step,
so no eviction can come in between), `keep` when the sequence joins the decode batch (the batch copied the prefill
cache; the tree keeps views of it, no copy, unless it would hold more than twice what it adds).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from service import metrics

if TYPE_CHECKING:
    from service.kv.radix import HeadMatch
    from service.runtime.steps import PrefillResult
    from service.runtime.prompt import PromptPlan


def head_limit(plan: "PromptPlan") -> int:
    """Tokens a head may cover at most: all but the prompt's last (it gives the logits), and nothing from a skill
    with edited spans on (its mode says which tokens are recomputed) or the late blocks (a memory placed late is
    re-rotated there with its seam, by design)."""
    limit, pos = plan.n_tokens - 1, 0
    for seg in plan.segments:
        if seg.kind == "skill" and seg.recompute:
            limit = min(limit, pos)
            break
        pos += len(seg.ids)
    if plan.late_span is not None:
        limit = min(limit, plan.late_span[0])
    return max(0, limit)


def head_clip(plan: "PromptPlan", m: int) -> int:
    """m, or the start of the skill segment m ends inside (a head ends at a block's boundary or inside text)."""
    pos = 0
    for seg in plan.segments:
        end = pos + len(seg.ids)
        if pos < m < end:
            return pos if seg.kind == "skill" else m
        if end >= m:
            return m
        pos = end
    return m


class AutoHeads:
    def __init__(self, settings, fingerprint: str) -> None:
        self.enabled = bool(settings.auto_reuse) and settings.auto_cache_bytes > 0
        # int8 store tiers hand out dequantized blocks and prefixes: then only K/V this process computed is exact
        self.store_exact = getattr(settings, "kv_compression", "none") == "none"
        self.fingerprint = fingerprint
        from service.kv.radix import RadixHeads  # torch: imported once a model is bound (the API imports without it)

        self.tree = RadixHeads(settings.auto_cache_bytes, settings.auto_min_tokens)

    def _key(self, namespace: str) -> tuple[str, str]:
        return namespace, self.fingerprint

    def match(self, namespace: str, plan: "PromptPlan") -> "HeadMatch | None":
        """The longest head of `plan` kept for this tenant (views: copy it, never hand it out), or None."""
        hit, held = self.tree.lookup(self._key(namespace), plan.ids, head_limit(plan), lambda m: head_clip(plan, m))
        metrics.AUTO_LOOKUPS.labels("hit" if hit is not None else "short" if held > 0 else "miss").inc()
        return hit

    def keep(self, namespace: str, plan: "PromptPlan", pre: "PrefillResult", from_store: bool = False) -> int:
        """Keep the exact head of a prefilled prompt (its cache is complete up to where the batch took it over and is
        never written again). `from_store`: its prefill copied K/V from a store block or a refined prefix, which int8
        tiers dequantize: then nothing is kept. Returns the tokens added."""
        if not self.enabled or pre.cache is None or (from_store and not self.store_exact):
            return 0
        n = min(pre.n_exact, plan.n_tokens)
        if n < self.tree.min_tokens:
            return 0
        before = self.tree.n_evicted
        added = self.tree.insert_cache(self._key(namespace), plan.ids[:n], pre.cache)
        metrics.AUTO_EVICTIONS.inc(self.tree.n_evicted - before)
        metrics.AUTO_BYTES.set(self.tree.bytes_used)
        return added
