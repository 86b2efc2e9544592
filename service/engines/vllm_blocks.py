"""Blocks on vLLM (service/store/blocks.py): a block is a BlockRef, its token ids and where its canonical context
starts; vLLM compiles it (a request whose K/V the connector saves: service/vllm/heads.py) and the connector keeps the
K/V. Nothing is held in this process; a request that uses a block vLLM has not saved compiles it first."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from service import metrics
from service.store.blocks import Behind
from service.errors import ServiceError
from service.kv.blockref import BlockRef

if TYPE_CHECKING:
    from service.store.blocks import Blocks
    from service.store.key import BlockKey

log = logging.getLogger(__name__)


class VllmBlocks:
    exact_texts = True  # vLLM's prefix cache keeps a system text sent whole: a section seen only so stays text
    sections = True

    def __init__(self, engine, n_anchor: int) -> None:
        """`engine`: the VllmEngine (holds, compile_block); `n_anchor`: the canonical context's length."""
        self.engine, self.n_anchor = engine, n_anchor

    def _ref(self, ids: list[int]) -> BlockRef:
        return BlockRef(list(ids), self.n_anchor)

    async def get(self, key: "BlockKey", ids: Callable[[], list[int]], ephemeral: bool,
                  make: Callable[[], Awaitable[Any]] | None = None) -> tuple[Any, str]:
        """The ids as they read now: an in-place edit is a compile on vLLM (`make` is this process's K/V recipe)."""
        ref = self._ref(ids())
        where = "engine" if self.engine.holds(key.namespace, ref) else "compiled"  # compiled: by the request using it
        metrics.SKILL_HITS.labels(where).inc()
        return ref, where

    async def held(self, key: "BlockKey", ids: list[int]) -> Any | None:
        ref = self._ref(ids)
        return ref if self.engine.holds(key.namespace, ref) else None

    async def behind(self, key: "BlockKey", ids: list[int], idle_only: Callable[[], bool]) -> Behind:
        """At vLLM's background priority, behind live requests (service/vllm/background.py decides when)."""
        return "compiled" if await self._compile(key.namespace, self._ref(ids)) else "failed"

    async def ahead(self, namespace: str, block: Any) -> None:
        """At background priority; vLLM down or failing: the block compiles on first use instead."""
        await self._compile(namespace, block)

    async def _compile(self, namespace: str, block: BlockRef) -> bool:
        try:
            await self.engine.compile_block(namespace, block)
        except ServiceError as e:
            log.warning("block not compiled ahead (it is compiled on first use): %s", e)
            return False
        return True


if TYPE_CHECKING:
    def _is_blocks(b: VllmBlocks) -> Blocks:
        return b  # mypy checks VllmBlocks against the Blocks protocol here
