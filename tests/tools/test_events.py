"""parsed(): a request's decode events with the calls taken out, ending in a ToolDone."""

from __future__ import annotations

from service.runtime.params import Delta, Done
from service.tools.events import ToolDone, parsed, tool_calls_of
from service.tools.formats import HERMES
from service.tools.parser import CallEvent, ToolCallParser
from service.tools.spec import Tool, ToolsParams


async def test_deltas_become_content_and_calls_and_done_becomes_a_tool_done():
    closed = []

    async def raw():
        try:
            for piece in ["Checking. <tool", '_call>{"name": "ping", "arguments": {}}', "</tool_call>"]:
                yield Delta(piece)
            yield Done("stop", "(raw text)", [1, 2, 3])
        finally:
            closed.append(True)

    parser = ToolCallParser(HERMES, ToolsParams([Tool("ping")]))
    out = [ev async for ev in parsed(raw(), parser)]
    assert out[0] == Delta("Checking. ")
    assert isinstance(out[1], CallEvent) and out[1].call.name == "ping" and out[1].call.arguments == "{}"
    done = out[-1]
    assert isinstance(done, ToolDone) and done.finish_reason == "tool_calls" and done.text == "Checking. "
    assert done.token_ids == [1, 2, 3] and tool_calls_of(done) == [out[1].call]
    assert closed == [True]
    assert tool_calls_of(Done("stop", "x", [])) == []
