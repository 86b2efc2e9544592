"""AutoBlocks: a system prompt's sections as content-addressed blocks, with nothing registered (issue 41).

A request's system text is cut into parts (service/compose/sections.py). A section whose block this tenant's
memory tier holds is composed like a skill, wherever it now stands: after another preamble, in another order. One
not held yet is computed as text this time, and its block is compiled as background work (not on the request's
clock), on its SKILLCACHE_AUTO_BLOCKS_AFTER-th sighting: while it has been seen once, only when the engine is idle
(a guess takes nothing from live requests); from its second sighting, in the background share. It is kept in the
memory tier only (no record owns it, so it lives least recently used first out, as a tools block does) and
calibrated like a skill's once it is first composed. The guard applies as to skills: a section whose block failed a
shadow check is computed as text (demoted), not the whole request in full. The refiner sees sections as blocks, so
a repeated arrangement is refined into an exact head.

A section's key is its text's block key under the request's namespace: one tenant's sections never serve another.

Where a section's block is held and how it is compiled is the engine's (`Blocks`, service/store/blocks.py): on
vLLM a BlockRef, held where vLLM saved it, compiled by vLLM at background priority. Where the engine's prefix cache
keeps a system text sent whole (`blocks.exact_texts`: vLLM's), a system text this tenant has sent before as plain
text, with nothing composed before it, stays text: vLLM's exact prefix cache serves that prompt exactly, and
composing it would move it to an approximate head. Sections compose there where the exact cache misses: the same
sections after another preamble or in another order.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from service import metrics
from service.compose.sections import Part, split_parts
from service.registry.skill import TextBlock

if TYPE_CHECKING:
    from service.store.blocks import Blocks
    from service.compose.guard import FidelityGuard
    from service.registry.registry import SkillRegistry
    from service.store.key import BlockKey

_SEEN_MAX = 4096  # sections whose sightings are remembered (LRU)


@dataclass
class SystemParts:
    """The system text as the prompt builder lays it out, and the blocks it composes (indexed after `first`)."""

    parts: list[str | int] = field(default_factory=list)  # text, or the index of a block among the request's
    records: list[TextBlock] = field(default_factory=list)
    blocks: list = field(default_factory=list)
    keys: list[str] = field(default_factory=list)
    seams: list[tuple] = field(default_factory=list)
    scheduled_tokens: int = 0  # tokens of the sections this request queued for compiling


class AutoBlocks:
    def __init__(self, settings, runtime, registry: "SkillRegistry", guard: "FidelityGuard") -> None:
        self.s, self.rt, self.registry, self.guard = settings, runtime, registry, guard
        self.blocks: "Blocks | None" = None  # the engine's (ComposePipeline.use_engine)
        self._seen: OrderedDict[str, int] = OrderedDict()
        self._exact: OrderedDict[str, None] = OrderedDict()  # system texts sent as plain text (engine-kept blocks)
        self._pending: set[str] = set()

    @property
    def _exact_texts(self) -> bool:
        return self.blocks is not None and self.blocks.exact_texts

    @property
    def enabled(self) -> bool:
        return (bool(self.s.auto_reuse) and self.s.auto_sections != "off" and self.blocks is not None
                and self.blocks.sections)

    async def resolve(self, namespace: str, marked: list[str], text: str, taken: list[str], room: int,
                      compose: bool, seam_tokens: int | None) -> SystemParts:
        """`marked`: blocks the client marked (cache_control), before the system text; `taken`: the names of the
        blocks the request has before these (a part that is one of them stays text); `room`: how many more it may
        compose; compose False (mode=full): the same parts, all text, nothing looked up or queued. A system text
        that is one part (no cut point) stays text: it only recurs where it stands, and the automatic head serves
        it there."""
        first, out, names = len(taken), SystemParts(), set(taken)
        encode = self.rt.prompts.encode_content
        whole = f"{namespace}\x00{marked}\x00{text}"  # taken is empty where this counts
        exact = self._exact_texts and not taken and whole in self._exact  # vLLM's exact prefix cache has it
        split = split_parts(text, self.s.auto_sections, encode, self.s.auto_section_min_tokens,
                            self.s.max_skill_tokens) if text else []
        items = [(Part(t, ids := encode(t), 0 < len(ids) <= self.s.max_skill_tokens), True) for t in marked]
        items += [(part, len(split) > 1) for part in split]
        for part, movable in items:
            record = TextBlock.of(namespace, part.text)
            if not (part.section and movable and compose) or record.name in names:
                out.parts.append(part.text)
                continue
            names.add(record.name)
            key = self.registry.block_key(namespace, part.text)
            block = await self._held(key, part.ids)
            if exact:  # stays text where it is cached exactly; compiled for where it is not
                if block is None:
                    self._schedule(key, part.ids)
                out.parts.append(part.text)
                continue
            if block is not None and len(out.blocks) < room:
                seam, path = self.guard.seam_for(str(key), block, seam_tokens)
                if path == "compose":
                    metrics.AUTO_BLOCKS.labels("composed").inc()
                    # calibrated once it is used, not when compiled: a section never seen again costs no calibration
                    self.guard.schedule_calibration(key, block, ephemeral=True)
                    out.parts.append(first + len(out.blocks))
                    out.records.append(record)
                    out.blocks.append(block)
                    out.keys.append(str(key))
                    out.seams.append((seam, path))
                    continue
                metrics.AUTO_BLOCKS.labels("demoted").inc()
            elif block is None:
                metrics.AUTO_BLOCKS.labels("text").inc()
                out.scheduled_tokens += len(part.ids) if self._schedule(key, part.ids) else 0
            out.parts.append(part.text)
        if self._exact_texts and compose and not taken and not out.blocks:  # sent whole as text: exact in vLLM's cache
            self._exact.pop(whole, None)
            self._exact[whole] = None
            while len(self._exact) > _SEEN_MAX:
                self._exact.popitem(last=False)
        return out

    async def _held(self, key: "BlockKey", ids: list[int]):
        """The section's block where the engine holds it (None: not yet)."""
        assert self.blocks is not None  # enabled
        return await self.blocks.held(key, ids)

    def _schedule(self, key: "BlockKey", ids: list[int]) -> bool:
        """Count a sighting; queue the compile once it has been seen often enough (True: queued now)."""
        k = str(key)
        seen = self._seen.pop(k, 0) + 1
        self._seen[k] = seen
        while len(self._seen) > _SEEN_MAX:
            self._seen.popitem(last=False)
        if seen < self.s.auto_blocks_after or k in self._pending:
            return False
        self._pending.add(k)
        if not self.guard.spawn(self._compile(key, ids)):
            self._pending.discard(k)
            metrics.AUTO_BLOCKS.labels("dropped").inc()
            return False
        metrics.AUTO_BLOCKS.labels("scheduled").inc()
        return True

    async def _compile(self, key: "BlockKey", ids: list[int]) -> None:
        """Seen once, the compile is a guess: it runs only while the engine is idle; seen again, in the share."""
        assert self.blocks is not None  # enabled
        try:
            out = await self.blocks.behind(key, ids, idle_only=lambda: self._seen.get(str(key), 0) < 2)
            if out != "failed":  # dropped (the engine's background backlog was full): a later sighting queues it again
                metrics.AUTO_BLOCKS.labels(out).inc()
        finally:
            self._pending.discard(str(key))
