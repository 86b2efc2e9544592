"""The Responses API's side of the pipeline: the fields this service refuses, input items -> the pipeline's
OpenAI-shaped message dicts (after the stored items of a previous response or a conversation), the items a stored
conversation keeps, and the Response object (output items, usage, the echoed request settings) built from the
pipeline's Final.

Items map to messages as chat completions' do (service/api/chat_messages.py): `instructions` and leading
system/developer messages make the system turn; a `function_call` item joins the assistant message before it (or
makes one); a `function_call_output` item is a `tool` message. The tool turns are checked as OpenAI checks them
(service/tools/conversation.py), with errors naming the input item.
"""

from __future__ import annotations

import secrets
import time

from pydantic import TypeAdapter

from service.api.schemas.responses import (
    FunctionCallItem, FunctionCallOutputItem, InputItem, MessageItem, ResponsesRequest,
)
from service.compose.pipeline import Final
from service.errors import InvalidRequest
from service.tools.conversation import link_results
from service.tools.events import tool_calls_of
from service.tools.spec import ToolCall

DEFAULT_MAX_OUTPUT_TOKENS = 256
_ITEMS: TypeAdapter[list[InputItem]] = TypeAdapter(list[InputItem])
_INCLUDABLE = {"reasoning.encrypted_content"}  # no reasoning items are produced: nothing to include, honoured as is


def refuse_unsupported(body: ResponsesRequest) -> None:
    """422 naming the first field set to something that would make the answer a lie (neutral values and defaults
    pass). Hints (verbosity, reasoning effort, service tier, truncation, cache retention, obfuscation) are accepted
    and the Response says what was applied (ResponseHead): docs/API.md, "Fields: honoured, hints, refused"."""
    if body.conversation is not None and body.previous_response_id is not None:
        raise InvalidRequest("conversation: give previous_response_id or conversation, not both (as at OpenAI)")
    checks = [
        ("background", body.background is True, "responses are generated while the request waits"),
        ("max_tokens", body.max_tokens is not None, "this is the Responses API; the length is max_output_tokens"),
        ("include", bool(set(body.include or []) - _INCLUDABLE), "only reasoning.encrypted_content (there is none)"),
        ("top_logprobs", bool(body.top_logprobs), "log probabilities are not returned by this API"),
        ("max_tool_calls", body.max_tool_calls is not None, "tool calls are not capped; parallel_tool_calls false "
                                                            "makes at most one"),
        ("prompt", body.prompt is not None, "there are no stored prompts; send instructions and input"),
        ("context_management", body.context_management is not None, "the context is not compacted"),
        ("moderation", body.moderation is not None, "there is no moderation"),
        ("image", body.image is not None, "the model produces text only"),
        ("access_programs", body.access_programs is not None, "there are no access programs"),
        ("background_options", body.background_options is not None, "responses are not run in the background"),
    ]
    for name, bad, why in checks:
        if bad:
            raise InvalidRequest(f"{name}: not supported by this service ({why})")
    for i, t in enumerate(body.tools or []):
        if t.type != "function":
            raise InvalidRequest(f"tools.{i}.type: {t.type!r} is not supported by this service (function tools only:"
                                 " it runs no built-in tools)")


def conversation(body: ResponsesRequest, prior: list[dict] | None = None, origin: str = "") -> list[dict]:
    """`instructions`, then `prior` (the stored items of `origin`: a previous response's or a conversation's), then
    `input`, as the pipeline's message dicts; 422 naming the item out of place."""
    stored = _ITEMS.validate_python(prior or [])
    items = [*stored, *([] if isinstance(body.input, str) else body.input)]
    name = [f"{origin}.{k}" for k in range(len(stored))] + [f"input.{i}" for i in range(len(items) - len(stored))]
    out: list[dict] = []
    src: list[str] = []  # the item each message comes from
    if body.instructions is not None:
        out.append({"role": "system", "content": body.instructions})
        src.append("instructions")
    for i, item in enumerate(items):
        if isinstance(item, FunctionCallItem):
            fn = {"name": item.name, "arguments": item.arguments}
            call = {"id": item.call_id, "type": "function", "function": fn}
            if out[-1:] and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
                src.append(name[i])
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
            src.append(name[i])
        elif item.role in ("system", "developer"):
            if out and out[-1]["role"] != "system":
                raise InvalidRequest(f"{name[i]}: a {item.role} message must come before the conversation")
            if out:  # instructions and leading system messages make one system turn
                out[0]["content"] += "\n\n" + item.text()
            else:
                out.append({"role": "system", "content": item.text()})
                src.append(name[i])
        else:
            out.append({"role": item.role, "content": item.text()})
            src.append(name[i])
    if isinstance(body.input, str):
        out.append({"role": "user", "content": body.input})
        src.append("input.0")
    if not out or out[-1]["role"] not in ("user", "tool"):
        raise InvalidRequest("input: the last item must be a user message or a function_call_output")
    try:
        link_results(out, where=lambda j: src[j])
    except InvalidRequest as e:  # in the Responses API's words
        raise InvalidRequest(e.message.replace(".tool_call_id:", ".call_id:").replace(
            "tool message", "function_call_output item")) from None
    return out


def items_of(body_items: str | list) -> list[dict]:
    """Input items as a stored conversation and GET .../input_items show them: each with an id, a message's content
    as text parts."""
    items = [MessageItem(role="user", content=body_items)] if isinstance(body_items, str) else body_items
    out: list[dict] = []
    for item in items:
        if isinstance(item, FunctionCallItem):
            out.append({"id": new_id("fc"), "type": "function_call", "call_id": item.call_id, "name": item.name,
                        "arguments": item.arguments, "status": "completed"})
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"id": new_id("fco"), "type": "function_call_output", "call_id": item.call_id,
                        "output": item.text(), "status": "completed"})
        else:
            part = "output_text" if item.role == "assistant" else "input_text"
            out.append({"id": new_id("msg"), "type": "message", "role": item.role, "status": "completed",
                        "content": [{"type": part, "text": item.text()}]})
    return out


def turn_items(inputs: list[dict], output: list[dict]) -> list[dict]:
    """What a response adds to its stored conversation: its input items but system and developer messages
    (instructions are not carried over, as at OpenAI), then its output items."""
    return [i for i in inputs if i.get("role") not in ("system", "developer")] + output


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def usage(final: Final) -> dict:
    u = final.usage
    return {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"],
            "total_tokens": u["prompt_tokens"] + u["completion_tokens"],
            "input_tokens_details": {"cached_tokens": u["reused_tokens"], "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0}}


def extra(final: Final) -> dict:
    """The `skillcache` object: timings, skills, edits (and tools, memory), as chat completions reports them."""
    out = {"timings": final.timings, "skills": final.skills, "edits": final.edits}
    if final.memory is not None:
        out["memory"] = final.memory
    return {**out, "tools": final.tools} if final.tools is not None else out


def message_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": [text_part(text)]}


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(item_id: str, call: ToolCall, status: str = "completed") -> dict:
    args = "" if status == "in_progress" else call.arguments
    return {"id": item_id, "type": "function_call", "call_id": call.id, "name": call.name, "arguments": args,
            "status": status}


def output_items(final: Final) -> list[dict]:
    """The reply as output items: its text as one message (none when the reply is only calls), then its calls."""
    calls = tool_calls_of(final.done)
    status = "incomplete" if final.done.finish_reason == "length" else "completed"
    msg = [message_item(new_id("msg"), final.done.text, status)] if final.done.text or not calls else []
    return msg + [call_item(new_id("fc"), c) for c in calls]


def text_config(body: ResponsesRequest) -> dict:
    """`text` as applied: the format (the reply is kept to it), and the verbosity asked for (a hint: the model is
    not steered by it)."""
    text = body.text
    fmt = text.format.model_dump() if text is not None and text.format is not None else {"type": "text"}
    verbosity = text.verbosity if text is not None and text.verbosity is not None else "medium"
    return {"format": fmt, "verbosity": verbosity}


def reasoning(body: ResponsesRequest) -> dict | None:
    """`reasoning` as applied: the effort asked for is echoed (a hint: the model does not reason before it answers,
    so no reasoning items and no summary are produced)."""
    r = body.reasoning
    return None if r is None else {"effort": r.effort, "summary": None}


class ResponseHead:
    """The Response object's fields that do not depend on the reply: id, model, and the request's settings (store,
    previous_response_id and conversation as applied)."""

    def __init__(self, body: ResponsesRequest, model: str, conversation_id: str | None = None) -> None:
        self.id, self.created_at = new_id("resp"), int(time.time())
        choice = body.tool_choice or "auto"
        self.fields = {
            "id": self.id, "object": "response", "created_at": self.created_at, "model": model,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {}, "parallel_tool_calls": body.parallel_tool_calls is not False,
            "temperature": body.temperature, "top_p": body.top_p,
            "tool_choice": choice if isinstance(choice, str) else choice.model_dump(),
            "tools": [t.model_dump() for t in body.tools or []], "text": text_config(body),
            # hints, as applied: the conversation is never truncated (too long: a 413), one service tier
            "truncation": "disabled", "background": False,
            "store": body.store is not False, "previous_response_id": body.previous_response_id,
            "conversation": None if conversation_id is None else {"id": conversation_id},
            "reasoning": reasoning(body), "service_tier": "default", "top_logprobs": 0, "user": body.user,
            "prompt_cache_retention": body.prompt_cache_retention,
            "safety_identifier": body.safety_identifier, "prompt_cache_key": body.prompt_cache_key,
            "error": None, "incomplete_details": None,
        }

    def response(self, output: list[dict], final: Final | None = None) -> dict:
        """The Response: in progress (no final yet), completed, or incomplete (the output hit max_output_tokens)."""
        if final is None:
            return {**self.fields, "status": "in_progress", "output": output, "usage": None}
        cut = final.done.finish_reason == "length"
        return {**self.fields, "status": "incomplete" if cut else "completed",
                "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
                "completed_at": None if cut else int(time.time()), "output": output, "usage": usage(final)}
