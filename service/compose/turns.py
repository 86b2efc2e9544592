"""A session's turn as the engine runs it. Where a conversation's K/V is kept is the engine's business: this
process's engine keeps each session's cache and extends it (service/engines/embedded_turns.py); vLLM keeps the
conversation in its prefix cache and gets it whole each turn (service/engines/vllm_turns.py). The session manager
(service/sessions/manager.py) runs every turn the same way through the engine's `session_turns`."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from service.compose.usage import timings_of, usage_of
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

    def end(self, done: Any, pre: Any, ttft_ms: float, store_ms: float) -> Any:
        """The turn's Final from what the engine did (`pre`, a PrefillResult), the same on every engine. Reused: what
        the engine did not compute; of it, composed: a memory's blocks floated this turn (the session's head was
        composed when it opened), the rest an exact prefix (the conversation so far)."""
        reused = pre.n_reused + pre.n_prefix
        composed = pre.n_reused if self.late is not None else 0
        usage = usage_of(pre.n_prompt, composed, reused - composed, pre.n_auto, pre.n_recomputed,
                         len(done.token_ids))
        timings = timings_of(ttft_ms, pre.timings_ms.get("prefill_ms", 0.0), store_ms,
                             (time.perf_counter() - self.t0) * 1e3)
        memory = self.late.report(pre.seams, late_index(self.plan, self.late)) if self.late is not None else None
        return self.ended(done, usage, timings, memory)


class Turns(Protocol):
    async def open(self, s: Any, prep: Any) -> dict:
        """Turn 0: the session's head (a Prepared, head_only) made ready on the engine; its usage."""
        ...

    async def start(self, s: Any, turn: Turn) -> AsyncIterator:
        """Start the turn (errors before its first event raise here): an iterator whose first item is None (the turn
        has started), then Delta..., then `turn.ended(...)`'s Final."""
        ...


def opened(pre: Any) -> dict:
    """Turn 0's usage: the session's head as the engine made it ready (`pre`, a PrefillResult)."""
    return usage_of(pre.n_prompt, pre.n_reused, pre.n_prefix, pre.n_auto, pre.n_recomputed, 0)


def late_index(plan, late) -> int:
    """The index of the first late block: they are the plan's last skill segments, after the skills and tools."""
    return [seg for seg in plan.segments if seg.kind == "skill"][-len(late.blocks)].skill_index
