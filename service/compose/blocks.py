"""StoreBlocks: the embedded engine's blocks (the Blocks seam: service/store/blocks.py). A block is K/V compiled on
this process's model and kept in the store's tiers (memory, disk, Redis); a compile is single-flight through the
store, a section's compile is background work of the serving engine."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from service import metrics
from service.compose import background
from service.store.blocks import Behind, Make

if TYPE_CHECKING:
    from service.compose.guard import FidelityGuard
    from service.store.blocks import Blocks
    from service.store.key import BlockKey
    from service.store.tiered import TieredStore


class StoreBlocks:
    """Blocks compiled on this process's serving engine, kept in the store's tiers."""

    exact_texts = False  # exact repeats are the automatic heads' (service/compose/auto.py)

    def __init__(self, settings, runtime, serving, store: "TieredStore", guard: "FidelityGuard") -> None:
        self.s, self.rt, self.serving, self.store, self.guard = settings, runtime, serving, store, guard
        self.sections = any(t.name == "memory" for t in store.tiers)  # the only tier sections live in

    async def get(self, key: "BlockKey", ids: Callable[[], list[int]], ephemeral: bool,
                  make: Make | None = None) -> tuple[Any, str]:
        async def compile_fn():
            t0 = time.perf_counter()
            if make is not None:
                block = await make()
            else:  # only on a miss: hits never re-tokenize
                block = await self.serving.run_steps(
                    self.rt.compile_block_steps(ids(), chunk=self.s.prefill_chunk_tokens))
            metrics.STAGE.labels("compile").observe(time.perf_counter() - t0)
            return block

        block, source = await self.store.get_or_compile(key, compile_fn, ephemeral=ephemeral)
        metrics.SKILL_HITS.labels(source).inc()
        return block, source

    async def held(self, key: "BlockKey", ids: list[int]) -> Any | None:
        block, _ = await self.store.get(key, ephemeral=True)
        return block if block is not None and block.token_ids == ids else None

    async def behind(self, key: "BlockKey", ids: list[int], idle_only: Callable[[], bool]) -> Behind:
        steps = self.rt.compile_block_steps(ids, chunk=self.s.background_chunk_tokens)
        block = await self.guard.run_background(steps, priority=background.section_compile(len(ids)),
                                                idle_only=idle_only)
        if block is None:  # the engine's background backlog was full
            return "dropped"
        await self.store.put(key, block, ephemeral=True)
        return "compiled"

    async def ahead(self, namespace: str, block: Any) -> None:
        return None  # `get` compiled it into the store's tiers


if TYPE_CHECKING:
    def _is_blocks(b: StoreBlocks) -> Blocks:
        return b  # mypy checks StoreBlocks against the Blocks protocol here
