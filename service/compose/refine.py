"""PrefixRefiner: exact K/V for prompt heads that repeat.

Composition is exact for the first skill of a prompt and approximate for the ones after it: they were
compiled alone and never attended to the skills before them (docs/BENCHMARKS.md, Fidelity). A client that
sends the same skills in the same order again and again (an agent re-sending its skills every turn through
/v1/compose or /v1/chat/completions) need not live with that. Once a prompt head has been composed
SKILLCACHE_REFINE_AFTER times, the serving engine prefills it in full as background work (its guaranteed share,
in chunks: a live request waits behind one chunk at most), starting from the longest exact prefix already held
(refining `[A, B, C]` after `[A, B]` prefills only C's part), and stores it like a block: memory, disk and Redis
tiers, so every replica serves it. A live `mode=full` request that opens with a wanted head has computed exactly
that prefix: it donates its K/V instead (SKILLCACHE_REFINE_FROM_FULL), and the background prefill stops. Requests
that open with it copy it as an exact prefix (no rotation, no seams) and compose only what follows.

A head is a prefix the prompt shares with others at a boundary: through the second, third... skill, or through
the whole system turn (the skills, the system text and errata lines) up to the first message. Each is counted;
the longest whose count reached REFINE_AFTER is refined, so unique system texts or errata still get their skill
sequence refined. Backlog order: expected benefit (times seen x tokens it would make exact), read each time the
engine picks background work, so a queued order that keeps repeating moves ahead of one-off orders. The key is the
head's token ids, the model fingerprint and the tenant namespace, so a refined prefix is never stale: an edited
skill, system text or field value is a different head. Requests that edit fields inside a block (`in_place`,
`field+erratum`) are left alone: those modes define which tokens are recomputed, and an exact prefix would
silently turn them into a full recompute.
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

from service import metrics
from service.compose import background
from service.kv.layout import LAYOUT_VERSION
from service.store.key import BlockKey

if TYPE_CHECKING:
    from service.compose.guard import FidelityGuard
    from service.kv.block import KVBlock
    from service.runtime.prompt import PromptPlan
    from service.store.tiered import TieredStore

log = logging.getLogger(__name__)
_SEEN_MAX = 4096  # heads whose composition count is remembered (LRU)
_DONATED = object()  # a background refinement's value when a live full prefill gave the prefix first


class PrefixRefiner:
    def __init__(self, after: int, chunk: int, runtime, store: "TieredStore", guard: "FidelityGuard",
                 from_full: bool = True) -> None:
        self.after, self.chunk, self.from_full = after, chunk, from_full  # after 0: off
        self.rt, self.store, self.guard = runtime, store, guard
        self._seen: OrderedDict[str, int] = OrderedDict()  # key -> compositions served
        self._pending: set[str] = set()
        self._donated: OrderedDict[str, None] = OrderedDict()  # keys a full prefill gave (LRU, read by the engine)

    def key(self, namespace: str, ids: list[int]) -> BlockKey:
        digest = hashlib.sha256(b"".join(i.to_bytes(4, "little") for i in ids)).hexdigest()[:32]
        return BlockKey(self.rt.fingerprint, LAYOUT_VERSION, namespace, f"prefix-{digest}")

    def _eligible(self, plan: "PromptPlan") -> bool:
        return bool(self.after) and not any(seg.recompute for seg in plan.segments)

    @staticmethod
    def heads(plan: "PromptPlan") -> list[int]:
        """Where the plan's shareable heads end, longest first: the system turn (up to the first message), then
        each skill from the second on (one skill is exact already: compiled after the template's opening)."""
        ends = plan.skill_ends()
        if len(ends) < 2:
            return []
        out = [e for e in reversed(ends[1:])]
        if plan.head_end is not None and ends[-1] < plan.head_end < plan.n_tokens:
            out.insert(0, plan.head_end)
        return out

    async def _held(self, namespace: str, ids: list[int], ends: list[int]) -> "KVBlock | None":
        for end in ends:
            head = ids[:end]
            block, _ = await self.store.get(self.key(namespace, head), accept=lambda b: b.token_ids == head)
            if block is not None:
                return block
        return None

    async def lookup(self, namespace: str, plan: "PromptPlan") -> "KVBlock | None":
        """The longest refined head the plan opens with, or None."""
        if not self._eligible(plan):
            return None
        return await self._held(namespace, plan.ids, self.heads(plan))

    def note(self, namespace: str, plan: "PromptPlan", n_prefix: int) -> None:
        """A composition of `plan` was served (`n_prefix` tokens of it from a refined prefix): count its heads, and
        refine the longest one composed `after` times in the background."""
        if not self._eligible(plan):
            return
        target: tuple[int, str, int] | None = None
        settled = False  # the longest head due is pending, or held back: nothing is queued now
        for end in self.heads(plan):
            if end <= n_prefix:
                break  # this head and the shorter ones are exact already
            k = str(self.key(namespace, plan.ids[:end]))
            self._seen[k] = self._seen.pop(k, 0) + 1
            if target is None and not settled and self._seen[k] >= self.after:  # a pending one gives the shorter
                settled = k in self._pending  # heads too
                # composed once while other requests are served: most such orders never recur, and each would take
                # the background share from those that do (bench/background.py); a second composition queues it under
                # any load
                settled = settled or (self._seen[k] == 1 and self.guard.engine.serving)
                target = None if settled else (end, k, self._seen[k])
        while len(self._seen) > _SEEN_MAX:
            self._seen.popitem(last=False)
        if target:
            end, k, count = target
            self._pending.add(k)
            shorter = [e for e in self.heads(plan) if e < end]
            if not self.guard.spawn(self._refine(namespace, plan.ids[:end], shorter,
                                                 self._priority(k, end - n_prefix))):
                self._pending.discard(k)  # the background backlog is full: a later request tries again

    def _priority(self, k: str, tokens: int) -> Callable[[], float]:
        """Refining head `k`: ranked by the tokens it would have made exact so far (service/compose/background.py)."""
        return background.refinement(lambda: self._seen.get(k, 1), tokens)

    async def wanted(self, namespace: str, plan: "PromptPlan") -> int:
        """Where the longest head of `plan` that refinement wants and does not hold yet ends (a refinement pending, or
        composed `after` times), for a full prefill of `plan` to donate (0: none, or donation is off)."""
        if not self.from_full or not self._eligible(plan):
            return 0
        for end in self.heads(plan):
            k = str(self.key(namespace, plan.ids[:end]))
            if k in self._pending or self._seen.get(k, 0) >= self.after:
                return 0 if await self._held(namespace, plan.ids, [end]) is not None else end
        return 0

    async def donate(self, namespace: str, plan: "PromptPlan", block: "KVBlock") -> None:
        """A live full prefill's first `block.n_tokens` tokens, a head `wanted` named: keep them as its refined prefix;
        the head's background refinement, queued or under way, stops at its next step."""
        block_key = self.key(namespace, block.token_ids)
        key = str(block_key)
        self._donated[key] = None
        while len(self._donated) > _SEEN_MAX:
            self._donated.popitem(last=False)
        await self.store.put(block_key, block)
        await self._put_skills_level(namespace, block, [e for e in self.heads(plan) if e < block.n_tokens], None)
        self._seen.pop(key, None)
        metrics.REFINED_PREFIXES.inc()
        metrics.REFINE_TOKENS.labels("donated").inc(block.n_tokens)
        log.info("a full prefill donated a %d-token prompt head as its exact prefix", block.n_tokens)

    def _unless_donated(self, key: str, steps):
        """`steps`, stopped between two steps once a full prefill has donated this prefix."""
        while key not in self._donated:
            try:
                n = next(steps)
            except StopIteration as done:
                return done.value
            yield n
        steps.close()
        return _DONATED

    async def _refine(self, namespace: str, ids: list[int], shorter: list[int],
                      priority: Callable[[], float]) -> None:
        key = self.key(namespace, ids)
        try:
            held = await self._held(namespace, ids, shorter)
            steps = self._unless_donated(str(key), self.rt.exact_prefix_steps(ids, self.chunk, held))
            block = await self.guard.run_background(steps, priority=priority)
            if block is None or block is _DONATED:
                return  # the background backlog was full (a later request tries again), or a full prefill gave it
            await self.store.put(key, block)
            await self._put_skills_level(namespace, block, shorter, held)
            n_held = held.n_tokens if held is not None else 0
            self._seen.pop(str(key), None)
            metrics.REFINED_PREFIXES.inc()
            metrics.REFINE_TOKENS.labels("prefilled").inc(len(ids) - n_held)
            metrics.REFINE_TOKENS.labels("copied").inc(n_held)
            log.info("refined a %d-token prompt head into an exact prefix (%d tokens prefilled, %d copied)",
                     len(ids), len(ids) - n_held, n_held)
        finally:
            self._pending.discard(str(key))
            self._donated.pop(str(key), None)

    async def _put_skills_level(self, namespace: str, block: "KVBlock", shorter: list[int],
                                held: "KVBlock | None") -> None:
        """A refined system turn also serves prompts that share only its skills (another system text, errata, or
        more skills after them): keep its prefix through the last skill too (views of the same tensors)."""
        from service.kv.block import KVBlock

        if not shorter or (held is not None and held.n_tokens >= shorter[0]):
            return
        end = shorter[0]
        sub = KVBlock([k[:, :, :end] for k in block.keys], [v[:, :, :end] for v in block.values],
                      block.token_ids[:end], block.model_fingerprint, base=0)
        await self.store.put(self.key(namespace, sub.token_ids), sub)
