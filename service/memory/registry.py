"""MemoryRegistry: a tenant's memories, stored durably beside skill definitions, and the blocks a turn floats.

A memory is one document in the definition store (disk: written atomically, fsynced, so a kill -9 keeps every
acknowledged write; Redis: its own durability), in the namespace `<tenant>.memories` (tenant namespaces have no
dots, so it never meets one), rewritten whole on every change with its revision counted up. Writes to one memory
are serialized in this process; two replicas editing one memory at the same moment: the later write wins.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import defaultdict
from dataclasses import dataclass, field

from service.errors import InvalidMemory, LimitExceeded, MemoryConflict, MemoryNotFound, Overloaded
from service.memory.document import parse_facts, split_blocks
from service.memory.edits import FactEdit, apply_edits
from service.memory.kv import MemoryKV
from service.memory.record import MemoryBlock, MemoryRecord
from service.registry.skill import NAME_PATTERN
from service.store.definitions import DefinitionStore

log = logging.getLogger(__name__)
_SUFFIX = ".memories"
_NAME_RE = re.compile(NAME_PATTERN)


@dataclass
class LateMemory:
    """A memory as one turn floats it: its blocks (KVBlock), the erratum lines after them, the seams."""

    name: str
    revision: int
    blocks: list
    sources: list[str]
    lines: list[str]
    seams: list[int]
    ids: list[list[int]] = field(default_factory=list)

    def report(self, seams: dict[int, int] | None = None, first_index: int = 0) -> dict:
        """What the response says: the revision, and per block its tokens, where it came from, its seam."""
        used = seams or {}
        blocks = [{"index": j, "n_tokens": b.n_tokens, "source": s, "seam": used.get(first_index + j, seam)}
                  for j, (b, s, seam) in enumerate(zip(self.blocks, self.sources, self.seams))]
        return {"name": self.name, "revision": self.revision, "n_tokens": sum(b.n_tokens for b in self.blocks),
                "blocks": blocks, "lines": self.lines}


def check_memory_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise InvalidMemory(f"invalid memory name {name!r}: use 1-64 characters of lowercase letters, digits, '.', "
                            f"'_' or '-', starting with a letter or digit (pattern {NAME_PATTERN})")
    return name


class MemoryRegistry:
    def __init__(self, definitions: DefinitionStore, kv: MemoryKV, settings) -> None:
        self.definitions, self.kv, self.s = definitions, kv, settings
        self._locks: defaultdict[tuple[str, str], asyncio.Lock] = defaultdict(asyncio.Lock)

    # ---- documents ------------------------------------------------------------------------
    async def get(self, ns: str, name: str) -> MemoryRecord:
        doc = await self.definitions.get(ns + _SUFFIX, check_memory_name(name))
        if doc is None:
            raise MemoryNotFound(f"memory {name!r} not found; create it with POST /v1/memories")
        return MemoryRecord.from_doc(doc)

    async def list(self, ns: str) -> list[MemoryRecord]:
        return [MemoryRecord.from_doc(d) for d in await self.definitions.list(ns + _SUFFIX)]

    def _build(self, ns: str, name: str, text: str, max_block_tokens: int | None) -> MemoryRecord:
        parse_facts(text)  # labels unique
        blocks = [MemoryBlock(base=t) for t in split_blocks(text, self.kv.count_tokens, max_block_tokens)]
        self._count(blocks)
        return MemoryRecord(ns, name, blocks, max_block_tokens=max_block_tokens)

    def _count(self, blocks: list[MemoryBlock]) -> None:
        for b in blocks:
            b.n_tokens = self.kv.count_tokens(b.kv_text)
            if b.n_tokens == 0:
                raise InvalidMemory("every block of a memory needs some text")
        total = sum(b.n_tokens for b in blocks)
        if total > self.s.max_memory_tokens:
            raise LimitExceeded(f"the memory is {total} tokens; the limit is {self.s.max_memory_tokens} "
                                "(SKILLCACHE_MAX_MEMORY_TOKENS)")

    async def _write(self, rec: MemoryRecord, old: MemoryRecord | None, compile: bool) -> None:
        """Compile what the new revision needs (before it is stored: a turn that reads it finds its blocks), store
        it, then drop the blocks only the old revision used."""
        if compile:
            for b in rec.blocks:
                await self.kv.block(rec.namespace, b)
        rec.updated_at = time.time()
        await self.definitions.put(rec.namespace + _SUFFIX, rec.name, 1, rec.to_doc())
        if old is not None:
            keep = {h for b in rec.blocks for h in b.recipes()}
            await self.kv.forget(rec.namespace, {h for b in old.blocks for h in b.recipes()} - keep)

    async def _current(self, ns: str, name: str) -> MemoryRecord | None:
        try:
            return await self.get(ns, name)
        except MemoryNotFound:
            return None

    async def create(self, ns: str, name: str, text: str, max_block_tokens: int | None = None,
                     compile: bool = True) -> tuple[MemoryRecord, bool]:
        """(record, created). The same text and split again: the memory as it is (not created)."""
        check_memory_name(name)
        async with self._locks[(ns, name)]:
            old = await self._current(ns, name)
            if old is not None:
                if old.text == text and old.max_block_tokens == max_block_tokens:
                    return old, False
                raise MemoryConflict(f"memory {name!r} exists with other content; PUT replaces it, PATCH edits facts")
            rec = self._build(ns, name, text, max_block_tokens)
            await self._write(rec, None, compile)
            return rec, True

    async def replace(self, ns: str, name: str, text: str, max_block_tokens: int | None = None,
                      compile: bool = True) -> tuple[MemoryRecord, bool]:
        """(record, created): the memory with this text as its next revision, every block compiled from it."""
        check_memory_name(name)
        async with self._locks[(ns, name)]:
            old = await self._current(ns, name)
            rec = self._build(ns, name, text, max_block_tokens)
            if old is not None:
                rec.revision, rec.created_at = old.revision + 1, old.created_at
            await self._write(rec, old, compile)
            return rec, old is None

    async def edit(self, ns: str, name: str, edits: list[FactEdit], compile: bool = True
                   ) -> tuple[MemoryRecord, list[dict]]:
        """Apply fact edits as the next revision; the K/V work (recompiles, in-place recomputes) is done before
        this returns unless `compile` is false (then the next turn does it)."""
        async with self._locks[(ns, name)]:
            old = await self.get(ns, name)
            rec, reports = apply_edits(self.kv.rt.prompts, old, edits, self.s.memory_erratum_template)
            self._count(rec.blocks)
            for r in reports:
                if r["mode"] == "recompile":
                    r["recomputed_tokens"] = rec.blocks[r["block"]].n_tokens
            rec.revision = old.revision + 1
            await self._write(rec, old, compile)
            return rec, reports

    async def delete(self, ns: str, name: str) -> None:
        async with self._locks[(ns, name)]:
            rec = await self.get(ns, name)
            await self.definitions.delete(ns + _SUFFIX, name)
            await self.kv.forget(ns, {h for b in rec.blocks for h in b.recipes()})
        self._locks.pop((ns, name), None)

    # ---- turns ----------------------------------------------------------------------------
    async def resolve(self, ns: str, name: str, seam_tokens: int | None = None) -> LateMemory:
        """The memory as a turn floats it now: every block's K/V (from a tier, or made now) and its errata."""
        rec = await self.get(ns, name)
        found = [await self.kv.block(ns, b) for b in rec.blocks]
        seam = self.s.memory_seam_tokens if seam_tokens is None else seam_tokens
        lines = [line for b in rec.blocks for line in b.erratum_lines(self.s.memory_erratum_template)]
        blocks = [blk for blk, _ in found]
        return LateMemory(rec.name, rec.revision, blocks, [src for _, src in found], lines, [seam] * len(blocks),
                          [blk.token_ids for blk in blocks])

    async def leave(self, cache, ids: list[int], span: tuple[int, int]) -> list[int]:
        """After a turn: take the memory span out of the session's cache (on the engine), so the conversation's
        K/V holds no memory and the next turn floats it again; returns the ids the cache holds then. The turn's
        own tokens after the span keep what they read from it (service.kv.cache.remove_span)."""
        from service.kv.cache import remove_span  # torch: on the engine's side only

        start, end = span
        try:
            await self.kv.engine.run(lambda cancelled: remove_span(cache, start, end, self.kv.rt.rotator))
        except Overloaded:  # the cache still holds the span: the next turn keeps it only up to the span's start
            log.warning("engine queue full: the memory stays in this session's cache until the next turn")
            return ids
        return ids[:start] + ids[end:]


def build_memories(settings, runtime, definitions: DefinitionStore, store, engine, blocks) -> MemoryRegistry:
    """`blocks`: the serving engine's (service/store/blocks.py): where memory blocks are made and kept."""
    kv = MemoryKV(runtime, engine, store, settings.prefill_chunk_tokens, blocks)
    return MemoryRegistry(definitions, kv, settings)
