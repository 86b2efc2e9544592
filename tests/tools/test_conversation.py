"""link_results: OpenAI's rules for tool turns, and the function name each result answers."""

from __future__ import annotations

import pytest

from service.errors import InvalidRequest
from service.tools.conversation import link_results


def call(cid: str, name: str = "get_weather") -> dict:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": "{}"}}


def test_results_get_the_name_of_the_call_they_answer():
    msgs = [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": "", "tool_calls": [call("a"), call("b", "get_time")]},
            {"role": "tool", "content": "1", "tool_call_id": "b"},
            {"role": "tool", "content": "2", "tool_call_id": "a"},
            {"role": "user", "content": "thanks"}]
    link_results(msgs)
    assert [m.get("name") for m in msgs if m["role"] == "tool"] == ["get_time", "get_weather"]


@pytest.mark.parametrize("msgs,where", [
    ([{"role": "user", "content": "hi"}, {"role": "tool", "content": "x", "tool_call_id": "a"}],
     "messages.1.tool_call_id"),
    ([{"role": "assistant", "content": "", "tool_calls": [call("a")]},
      {"role": "tool", "content": "x", "tool_call_id": "a"}, {"role": "tool", "content": "x", "tool_call_id": "a"}],
     "messages.2.tool_call_id"),  # answered twice
    ([{"role": "assistant", "content": "", "tool_calls": [call("a"), call("b")]},
      {"role": "tool", "content": "x", "tool_call_id": "a"}, {"role": "user", "content": "?"}],
     "messages.2: tool calls"),
    ([{"role": "assistant", "content": "", "tool_calls": [call("a")]}], "tool calls \\['a'\\] have no tool message"),
    ([{"role": "assistant", "content": "", "tool_calls": [call("a"), call("a")]},
      {"role": "tool", "content": "x", "tool_call_id": "a"}], "messages.0.tool_calls: call ids must be unique"),
])
def test_out_of_place_tool_turns_are_a_422_naming_the_message(msgs, where):
    with pytest.raises(InvalidRequest, match=where):
        link_results(msgs)


def test_only_messages_from_start_on_are_checked_but_names_are_set_throughout():
    old = [{"role": "assistant", "content": "", "tool_calls": [call("a")]},
           {"role": "tool", "content": "x", "tool_call_id": "a"}]
    link_results(old + [{"role": "user", "content": "next"}], start=2)
    assert old[1]["name"] == "get_weather"
    with pytest.raises(InvalidRequest, match="tool_results.0.tool_call_id"):
        link_results(old + [{"role": "tool", "content": "y", "tool_call_id": "zz"}], lambda i: f"tool_results.{i - 2}",
                     start=2)
