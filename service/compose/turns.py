"""A session's turn as the engine runs it. Where a conversation's K/V is kept is the engine's business: this
process's engine keeps each session's cache and extends it (service/engines/embedded_turns.py); vLLM keeps the
conversation in its prefix cache and gets it whole each turn (service/engines/vllm_turns.py). The session manager
(service/sessions/manager.py) runs every turn the same way through the engine's `session_turns`."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from service.runtime.params import GenParams

# (done, usage, timings, memory report) -> the session's Final
Ended = Callable[[Any, dict, dict, "dict | None"], Any]
# the session's head as /v1/compose finds it: its blocks (skills, then the tools block), their seams, the mode
Head = Callable[[], Awaitable[tuple[list, list[int], str]]]


@dataclass
class Turn:
    plan: Any  # PromptPlan: the whole conversation, this turn's messages last
    gen: GenParams
    tools: Any  # ToolsPrep | None
    late: Any  # LateMemory | None: a memory floated before the user turn
    t0: float  # the turn's clock (perf_counter): finding a memory's blocks is part of its first token
    head: Head
    ended: Ended
    release: Callable[[], None]  # once the turn ends, however it ends (the session's lock)


class Turns(Protocol):
    async def open(self, s: Any, prep: Any) -> dict:
        """Turn 0: the session's head (a Prepared, head_only) made ready on the engine; its usage."""
        ...

    async def start(self, s: Any, turn: Turn) -> AsyncIterator:
        """Start the turn (errors before its first event raise here): an iterator whose first item is None (the turn
        has started), then Delta..., then `turn.ended(...)`'s Final."""
        ...


def late_index(plan, late) -> int:
    """The index of the first late block: they are the plan's last skill segments, after the skills and tools."""
    return [seg for seg in plan.segments if seg.kind == "skill"][-len(late.blocks)].skill_index
