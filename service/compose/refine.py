"""PrefixRefiner: exact K/V for skill sequences that repeat.

Composition is exact for the first skill of a prompt and approximate for the ones after it: they were
compiled alone and never attended to the skills before them (docs/BENCHMARKS.md, Fidelity). A client that
sends the same skills in the same order again and again (an agent re-sending its skills every turn through
/v1/compose or /v1/chat/completions) need not live with that. Once a sequence has been composed
SKILLCACHE_REFINE_AFTER times, the serving engine prefills it in full as background work, in chunks (a live
request waits behind one chunk at most), and the result stays in the memory tier. Requests that open with
that sequence then copy it as an exact prefix (no rotation, no seams) and compose only what follows.

The key is the prompt's token ids through the last skill (the template's opening, the skill texts and the
separators), the model fingerprint and the tenant namespace, so a refined prefix is never stale: an edited
skill or field value is a different sequence. Requests that edit fields inside a block (`in_place`,
`field+erratum`) are left alone: those modes define which tokens are recomputed, and an exact prefix would
silently turn them into a full recompute.
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from typing import TYPE_CHECKING

from service import metrics
from service.kv.block import LAYOUT_VERSION
from service.store.key import BlockKey

if TYPE_CHECKING:
    from service.compose.guard import FidelityGuard
    from service.kv.block import KVBlock
    from service.runtime.prompt import PromptPlan
    from service.store.tiered import TieredStore

log = logging.getLogger(__name__)
_SEEN_MAX = 4096  # sequences whose composition count is remembered (LRU)


class PrefixRefiner:
    def __init__(self, after: int, chunk: int, runtime, store: "TieredStore", guard: "FidelityGuard") -> None:
        self.after, self.chunk = after, chunk  # after 0: off
        self.rt, self.store, self.guard = runtime, store, guard
        self._seen: OrderedDict[str, int] = OrderedDict()  # key -> compositions served
        self._pending: set[str] = set()

    def key(self, namespace: str, ids: list[int]) -> BlockKey:
        digest = hashlib.sha256(b"".join(i.to_bytes(4, "little") for i in ids)).hexdigest()[:32]
        return BlockKey(self.rt.fingerprint, LAYOUT_VERSION, namespace, f"prefix-{digest}")

    def _eligible(self, plan: "PromptPlan") -> bool:
        return bool(self.after) and not any(seg.recompute for seg in plan.segments)

    async def lookup(self, namespace: str, plan: "PromptPlan") -> "KVBlock | None":
        """The longest refined prefix the plan opens with (two skills or more), or None."""
        if not self._eligible(plan):
            return None
        ids = plan.ids
        for end in reversed(plan.skill_ends()[1:]):  # one skill: already exact (compiled after the anchor)
            block, _ = await self.store.get(self.key(namespace, ids[:end]), ephemeral=True)
            if block is not None and block.token_ids == ids[:end]:
                return block
        return None

    def note(self, namespace: str, plan: "PromptPlan", n_prefix: int) -> None:
        """A composition of `plan` was served (`n_prefix` tokens of it from a refined prefix): count its skill
        sequence, and refine it in the background once it has been composed `after` times."""
        ends = plan.skill_ends()
        if not self._eligible(plan) or len(ends) < 2 or n_prefix >= ends[-1]:
            return
        ids = plan.ids[:ends[-1]]
        key = self.key(namespace, ids)
        k = str(key)
        self._seen[k] = self._seen.pop(k, 0) + 1
        while len(self._seen) > _SEEN_MAX:
            self._seen.popitem(last=False)
        if self._seen[k] >= self.after and k not in self._pending:
            self._pending.add(k)
            if not self.guard.spawn(self._refine(key, ids)):
                self._pending.discard(k)  # the background backlog is full: a later request tries again

    async def _refine(self, key: BlockKey, ids: list[int]) -> None:
        try:
            block = await self.guard.run_background(self.rt.exact_prefix_steps(ids, self.chunk))
            if block is None:
                return  # the engine's background backlog was full: a later request tries again
            await self.store.put(key, block, ephemeral=True)
            self._seen.pop(str(key), None)
            metrics.REFINED_PREFIXES.inc()
            log.info("refined a %d-token skill sequence into an exact prefix", len(ids))
        finally:
            self._pending.discard(str(key))
