"""The K/V of memory blocks: compiled once per text, in-place edits applied on top, kept in the block store.

Keys are content hashes (service/memory/record.py, MemoryBlock.recipes): a block's compiled text, then one per
in-place edit. The compiled block and the block as it is now are kept in every tier (memory, disk, Redis), like
skill blocks; the steps between (a block edited in place several times) only in the memory tier, and are made
again from the compiled one should they be gone. All model work runs on the serving engine.
"""

from __future__ import annotations

import time

from service import metrics
from service.kv.blockref import BlockRef
from service.kv.layout import LAYOUT_VERSION
from service.memory.edits import inplace_layout
from service.memory.record import MemoryBlock
from service.store.key import BlockKey


class MemoryKV:
    def __init__(self, runtime, engine, store, chunk: int, refs: bool = False) -> None:
        self.rt, self.engine, self.store, self.chunk = runtime, engine, store, chunk
        self.refs = refs  # the engine compiles blocks itself (vLLM): blocks are BlockRefs, no K/V here

    def key(self, namespace: str, content_hash: str) -> BlockKey:
        return BlockKey(self.rt.fingerprint, LAYOUT_VERSION, namespace, content_hash)

    def count_tokens(self, text: str) -> int:
        return len(self.rt.prompts.encode_content(text))

    async def block(self, namespace: str, b: MemoryBlock, upto: int | None = None):
        """(KVBlock, source) of `b` after its first `upto` in-place edits (None: all of them); source is a tier's
        name or "compiled" (made now)."""
        n = len(b.patches) if upto is None else upto
        if self.refs:  # vLLM compiles the block as its text is now: an in-place edit is a compile there
            text = b.patches[n - 1]["text"] if n else b.base
            return BlockRef(self.rt.prompts.encode_content(text), len(self.rt.anchor)), "engine"
        kept = n == 0 or upto is None  # the compiled block and the current one; not the steps between

        async def make():
            t0 = time.perf_counter()
            if n == 0:
                ids = self.rt.prompts.encode_content(b.base)
                out = await self.engine.run_steps(self.rt.compile_block_steps(ids, chunk=self.chunk))
            else:
                prev, _ = await self.block(namespace, b, n - 1)
                patch = b.patches[n - 1]
                old_text = b.patches[n - 2]["text"] if n > 1 else b.base
                layout = inplace_layout(self.rt.prompts, old_text, patch["text"], patch["label"])
                if isinstance(layout, str):  # checked when the edit was made: only a changed tokenizer gets here
                    raise RuntimeError(f"in-place edit of {patch['label']!r} no longer applies: {layout}")
                from service.runtime.late import inplace_block_steps  # torch: the API imports this module

                out = await self.engine.run_steps(inplace_block_steps(self.rt, prev, *layout, chunk=self.chunk))
            metrics.STAGE.labels("compile").observe(time.perf_counter() - t0)
            return out

        block, source = await self.store.get_or_compile(self.key(namespace, b.recipes()[n]), make, ephemeral=not kept)
        metrics.SKILL_HITS.labels(source).inc()
        return block, source

    async def forget(self, namespace: str, hashes: set[str]) -> None:
        """Delete blocks no revision of this memory uses any more, in every tier."""
        for h in sorted(hashes):
            await self.store.delete_namespace_hash(namespace, h)
