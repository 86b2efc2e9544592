"""Engines: who runs a prepared request. `compose/` and `sessions/` hand one a Prepared and get events back.

embedded  service/engines/embedded.py: this process's serving engine (make run)
vllm      service/engines/vllm.py: a vLLM server computes every token; its KV connector (service/vllm/connector.py)
          saves compiled blocks and loads composed heads, re-rotated

Both implement Engine, the one interface the pipeline, sessions and the app state use.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from service.compose.guard import Checks, FidelityGuard


class Engine(Protocol):
    keeps_conversations: bool  # True: sessions send each turn whole, the engine's prefix cache keeps the conversation
    compiles_blocks: bool  # True: the engine compiles and keeps blocks itself; the pipeline hands it BlockRefs

    @property
    def checks(self) -> "Checks":
        """The guard's calibrations and shadow checks, computed where the model runs."""
        ...

    guard: "FidelityGuard | None"  # set by ComposePipeline.use_engine: samples shadow checks after responses

    async def start(self, prep: Any, finish: Callable) -> AsyncIterator[Any]:
        """Run `prep`; the first event is awaited here (errors before it raise), then Delta... and one Final, built
        by `finish(prep, done, pre, ttft_ms)`."""
        ...

    async def health(self) -> bool:
        """The engine answers (readiness)."""
        ...

    async def close(self) -> None: ...

    def holds(self, namespace: str, block: Any) -> bool:
        """compiles_blocks: the engine has this block (a request using it compiles nothing)."""
        ...

    async def compile_block(self, namespace: str, block: Any) -> None:
        """compiles_blocks: compile `block` ahead of use, at background priority (no-op otherwise)."""
        ...
