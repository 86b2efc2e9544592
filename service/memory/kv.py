"""The K/V of memory blocks: compiled once per text, in-place edits applied on top, kept in the block store.

Keys are content hashes (service/memory/record.py, MemoryBlock.recipes): a block's compiled text, then one per
in-place edit. The compiled block and the block as it is now are kept in every tier (memory, disk, Redis), like
skill blocks; the steps between (a block edited in place several times) only in the memory tier, and are made
again from the compiled one should they be gone. All model work runs on the serving engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from service.kv.layout import LAYOUT_VERSION
from service.memory.edits import inplace_layout
from service.memory.record import MemoryBlock
from service.store.key import BlockKey

if TYPE_CHECKING:
    from service.store.blocks import Blocks


class MemoryKV:
    def __init__(self, runtime, engine, store, chunk: int, blocks: "Blocks") -> None:
        """`blocks`: the engine's (service/store/blocks.py): on vLLM a block is its ids, compiled there."""
        self.rt, self.engine, self.store, self.chunk, self.blocks = runtime, engine, store, chunk, blocks

    def key(self, namespace: str, content_hash: str) -> BlockKey:
        return BlockKey(self.rt.fingerprint, LAYOUT_VERSION, namespace, content_hash)

    def count_tokens(self, text: str) -> int:
        return len(self.rt.prompts.encode_content(text))

    async def block(self, namespace: str, b: MemoryBlock, upto: int | None = None):
        """(block, source) of `b` after its first `upto` in-place edits (None: all of them); source is a tier's
        name, "engine" or "compiled" (made now)."""
        n = len(b.patches) if upto is None else upto
        text = b.patches[n - 1]["text"] if n else b.base
        kept = n == 0 or upto is None  # the compiled block and the current one; not the steps between

        async def edited():  # this process's K/V: the block before the edit, the edited span recomputed in place
            prev, _ = await self.block(namespace, b, n - 1)
            patch = b.patches[n - 1]
            old_text = b.patches[n - 2]["text"] if n > 1 else b.base
            layout = inplace_layout(self.rt.prompts, old_text, patch["text"], patch["label"])
            if isinstance(layout, str):  # checked when the edit was made: only a changed tokenizer gets here
                raise RuntimeError(f"in-place edit of {patch['label']!r} no longer applies: {layout}")
            from service.runtime.late import inplace_block_steps  # torch: the API imports this module

            return await self.engine.run_steps(inplace_block_steps(self.rt, prev, *layout, chunk=self.chunk))

        # vLLM compiles the block as its text is now: an in-place edit is a compile there
        return await self.blocks.get(self.key(namespace, b.recipes()[n]), lambda: self.rt.prompts.encode_content(text),
                                     ephemeral=not kept, make=edited if n else None)

    async def forget(self, namespace: str, hashes: set[str]) -> None:
        """Delete blocks no revision of this memory uses any more, in every tier."""
        for h in sorted(hashes):
            await self.store.delete_namespace_hash(namespace, h)
