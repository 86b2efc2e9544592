"""A request's decode events with its tool calls parsed out: content deltas, complete calls, and a last event whose
Done says what the reply was (content, calls, OpenAI's finish_reason)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

from service.runtime.params import Delta, Done
from service.tools.parser import CallEvent, ContentEvent, ToolCallParser
from service.tools.spec import ToolCall


@dataclass
class ToolDone(Done):
    """Done of a request that offered tools: `text` is the content without the calls; `finish_reason` is
    `tool_calls` when the reply made some."""

    tool_calls: list[ToolCall] = field(default_factory=list)


def tool_calls_of(done: Done) -> list[ToolCall]:
    return done.tool_calls if isinstance(done, ToolDone) else []


async def parsed(events: AsyncIterator[Any], parser: ToolCallParser) -> AsyncIterator[Any]:
    """`events` (Delta..., then a Done, or a Final that holds one) with content Deltas and CallEvents in place of
    the raw text, and the Done replaced by a ToolDone. Closing it closes `events`."""
    try:
        async for ev in events:
            if isinstance(ev, Delta):
                for out in parser.feed(ev.text):
                    yield _event(out)
                continue
            for out in parser.finish():
                yield _event(out)
            done = ev if isinstance(ev, Done) else ev.done
            tool_done = ToolDone(parser.finish_reason(done.finish_reason), parser.text, done.token_ids,
                                 done.top_logprobs, list(parser.calls))
            yield tool_done if isinstance(ev, Done) else replace(ev, done=tool_done)
    finally:
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()


def _event(out: ContentEvent | CallEvent) -> Delta | CallEvent:
    return Delta(out.text) if isinstance(out, ContentEvent) else out
