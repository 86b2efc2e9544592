"""The tool turns of a conversation (OpenAI-shaped dicts), checked the way OpenAI checks them: a `tool` message
answers a call of the assistant message before it (or of the tool messages between), each call is answered once,
and every call is answered before the conversation moves on. Each result gets the `name` of the function it
answers: templates that render tools read it."""

from __future__ import annotations

from collections.abc import Callable

from service.errors import InvalidRequest


def link_results(messages: list[dict], where: Callable[[int], str] = lambda i: f"messages.{i}", start: int = 0
                 ) -> None:
    """Check messages[start:] (those before are known good) and set `name` on their tool messages; 422 naming the
    message (`where(i)`) that is out of place."""
    open_calls: dict[str, str] = {}  # id -> function name, of the last assistant message's calls not yet answered
    for i, m in enumerate(messages):
        if m["role"] == "tool":
            name = open_calls.pop(m.get("tool_call_id"), None)
            if i >= start and name is None:
                raise InvalidRequest(f"{where(i)}.tool_call_id: {m.get('tool_call_id')!r} answers no open tool call "
                                     "of the assistant message before it")
            m["name"] = name
            continue
        if open_calls and i >= start:
            raise InvalidRequest(f"{where(i)}: tool calls {sorted(open_calls)} of the assistant message before it "
                                 "have no tool message answering them")
        calls = m.get("tool_calls") or []
        open_calls = {c["id"]: c["function"]["name"] for c in calls}
        if len(open_calls) != len(calls) and i >= start:
            raise InvalidRequest(f"{where(i)}.tool_calls: call ids must be unique")
    if open_calls:
        raise InvalidRequest(f"tool calls {sorted(open_calls)} have no tool message answering them")
