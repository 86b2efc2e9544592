"""Engine: what serves a prepared request, as the pipeline, sessions and the app state see it. Implemented by
service/engines/ (embedded: this process's model; vllm: a vLLM server); defined here, where it is used, so the
layers below the engines never import them."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from service.store.blocks import Blocks
    from service.compose.guard import Checks, FidelityGuard
    from service.compose.turns import Turns


class Engine(Protocol):
    @property
    def blocks(self) -> "Blocks":
        """Where blocks come from and where they are kept (service/store/blocks.py)."""
        ...

    @property
    def checks(self) -> "Checks":
        """The guard's calibrations and shadow checks, computed where the model runs."""
        ...

    guard: "FidelityGuard | None"  # set by ComposePipeline.use_engine: samples shadow checks after responses

    async def start(self, prep: Any, finish: Callable) -> AsyncIterator[Any]:
        """Run `prep`; the first event is awaited here (errors before it raise), then Delta... and one Final, built
        by `finish(prep, done, pre, ttft_ms)`."""
        ...

    def session_turns(self, pipeline: Any, memories: Any) -> "Turns":
        """How a session's turns run here (service/compose/turns.py): the engine keeps the conversation its way."""
        ...

    async def health(self) -> bool:
        """The engine answers (readiness)."""
        ...

    async def close(self) -> None: ...
