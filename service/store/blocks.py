"""Blocks: where a request's blocks come from and where they are kept, as the serving engine answers it
(`Engine.blocks`), so the pipeline, system-prompt sections, memories and start-up never ask which engine runs.

The embedded engine's: service/compose/blocks.py (K/V compiled on this process's model, kept in the store's tiers).
vLLM's: service/engines/vllm_blocks.py (a block is a BlockRef, its token ids; vLLM compiles it, its connector keeps
the K/V)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    from service.store.key import BlockKey

Make = Callable[[], Awaitable[Any]]  # the block's K/V computed on the engine (a compile, an in-place edit)
Behind = Literal["compiled", "dropped", "failed"]


class Blocks(Protocol):
    exact_texts: bool  # a system text sent whole is kept exactly by the engine's prefix cache (vLLM's)
    sections: bool  # system-prompt sections can be held as blocks (service/compose/autoblocks.py)

    async def get(self, key: "BlockKey", ids: Callable[[], list[int]], ephemeral: bool,
                  make: Make | None = None) -> tuple[Any, str]:
        """The block of `ids()` (read only on a miss) and where it came from: a tier's name, "engine" (the engine
        holds it) or "compiled" (by this request). `make`: its K/V when they are not a compile of the ids (an
        in-place edit of a memory block); `ephemeral`: kept in the memory tier only."""
        ...

    async def held(self, key: "BlockKey", ids: list[int]) -> Any | None:
        """The block where it is held now, compiling nothing (None: not yet)."""
        ...

    async def behind(self, key: "BlockKey", ids: list[int], idle_only: Callable[[], bool]) -> Behind:
        """Compile a section's block behind live work (`idle_only()` True: only while nothing live runs)."""
        ...

    async def ahead(self, namespace: str, block: Any) -> None:
        """A registered skill's block (from `get`) made ready on the engine before its first use."""
        ...
