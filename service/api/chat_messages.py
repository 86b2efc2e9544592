"""Chat Completions messages: the fields this service refuses, and the conversation the messages make.

Messages become the pipeline's OpenAI-shaped dicts: `{"role", "content"}`, plus `tool_calls` (OpenAI's objects) on
an assistant message and `tool_call_id` and `name` (the function it answers) on a `tool` message. The checks are
OpenAI's: a tool message answers a call of the assistant message before it, and every call is answered before
the conversation moves on.
"""

from __future__ import annotations

from typing import Any

from service.api.schemas.chat import ChatMessage
from service.errors import InvalidRequest
from service.tools.conversation import link_results


# Fields of OpenAI's request this service does not honour: refused (422 naming the field) rather than dropped, so a
# client never believes it got what it asked for. What is ignored on purpose is listed in docs/API.md.
def refuse_unsupported(body: Any) -> None:
    checks = [
        ("n", body.n != 1, "only one choice per request is generated"),
        ("logit_bias", bool(body.logit_bias), "token biases are not applied"),
        ("frequency_penalty", bool(body.frequency_penalty), "repetition penalties are not applied"),
        ("presence_penalty", bool(body.presence_penalty), "repetition penalties are not applied"),
        ("functions", body.functions is not None, "the legacy functions API is not served; use tools"),
        ("function_call", body.function_call is not None, "the legacy functions API is not served; use tool_choice"),
        ("audio", body.audio is not None, "the model produces text only"),
        ("modalities", body.modalities not in (None, ["text"]), "the model produces text only"),
        ("prediction", body.prediction is not None, "predicted outputs are not used"),
        ("web_search_options", body.web_search_options is not None, "there is no web search"),
    ]
    for name, bad, why in checks:
        if bad:
            raise InvalidRequest(f"{name}: not supported by this service ({why}); leave it out")


def conversation(messages: list[ChatMessage]) -> list[dict]:
    """The messages as the pipeline's dicts; 422 naming the message for one out of place."""
    out: list[dict] = []
    for i, m in enumerate(messages):
        role = "system" if m.role == "developer" else m.role
        if role == "system" and i > 0:
            raise InvalidRequest("only the first message may be a system (or developer) message")
        if m.tool_calls and role != "assistant":
            raise InvalidRequest(f"messages.{i}.tool_calls: only an assistant message makes tool calls")
        if role == "tool" and m.tool_call_id is None:
            raise InvalidRequest(f"messages.{i}.tool_call_id: required for a tool message")
        if m.content is None and not (role == "assistant" and m.tool_calls):
            raise InvalidRequest(f"messages.{i}.content: required (only an assistant message with tool_calls may "
                                 "omit it)")
        msg: dict = {"role": role, "content": m.text()}
        if m.tool_calls:
            msg["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        if role == "tool":
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    if out[-1]["role"] not in ("user", "tool"):
        raise InvalidRequest("the last message must be from the user, or a tool result")
    link_results(out)
    return out
