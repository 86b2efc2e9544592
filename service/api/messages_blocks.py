"""The Messages API's blocks <-> the pipeline: what is refused, the system text split at its cache_control
breakpoints into composed blocks, the conversation as the pipeline's OpenAI-shaped dicts, Anthropic's tools and tool
choice as the pipeline's, and the reply's content blocks, stop reason and usage.

cache_control rule: the system blocks are split after each block that carries `cache_control`; the text from the
previous breakpoint (or the start) up to and including the marked block becomes one unregistered block
(ComposeParams.blocks: compiled once, content-addressed, composed at any position like a skill); the text after the
last breakpoint stays the system message. Blocks and the system text are joined by the same "\\n\\n" either way, so a
breakpoint changes where the KV comes from, never the prompt.
"""

from __future__ import annotations

import json

from service.api.schemas.messages import MessageIn, MessagesRequest, TextBlockIn, ToolResultIn, ToolUseIn
from service.api.schemas.tools import FunctionIn, FunctionName, NamedToolChoice, ToolIn as OpenAITool
from service.compose.pipeline import Final
from service.errors import InvalidRequest
from service.tools.conversation import link_results
from service.tools.events import tool_calls_of

JOINER = "\n\n"  # service/runtime/prompt.py BLOCK_JOINER: between the system turn's blocks and its text


def refuse_unsupported(body: MessagesRequest) -> None:
    """Fields that would make the answer a lie: refused (naming the field) rather than dropped. Hints are accepted:
    `thinking` (the model does not think before it answers: no thinking blocks) and `output_config.effort`."""
    output = dict(body.output_config or {})
    output.pop("effort", None)  # a hint
    output.pop("format", None)  # a typed reply (service/api/structured.py)
    checks = [
        ("container", body.container is not None, "there is no code execution container"),
        ("mcp_servers", bool(body.mcp_servers), "MCP servers are not connected"),
        ("context_management", body.context_management is not None, "the context is not edited"),
        ("output_config", bool(output), f"only effort and format are read, not {sorted(output)}"),
        ("diagnostics", body.diagnostics is not None, "there are no cache diagnostics"),
    ]
    for name, bad, why in checks:
        if bad:
            raise InvalidRequest(f"{name}: not supported by this service ({why}); leave it out")
    for i, t in enumerate(body.tools or []):
        if t.type not in (None, "custom"):
            raise InvalidRequest(f"tools.{i}.type: server tool {t.type!r} is not supported; only custom tools "
                                 "(name, description, input_schema)")
        if t.input_schema is None:
            raise InvalidRequest(f"tools.{i}.input_schema: required for a custom tool")


def _unsupported(block, where: str) -> InvalidRequest:
    return InvalidRequest(f"{where}: {block.type} blocks are not supported by this service (it reads text only)")


def _texts(blocks: list, where: str) -> str:
    out = []
    for j, b in enumerate(blocks):
        if not isinstance(b, TextBlockIn):
            raise _unsupported(b, f"{where}.{j}")
        out.append(b.text)
    return JOINER.join(out)


def system_parts(body: MessagesRequest) -> tuple[list[str], str | None]:
    """(the texts of the cache_control blocks, in order; the system text after the last breakpoint, or None)."""
    system = body.system
    if system is None:
        return [], None
    blocks = [TextBlockIn(type="text", text=system)] if isinstance(system, str) else list(system)
    marks = [b.cache_control is not None for b in blocks]
    if body.cache_control is not None and blocks:  # automatic caching: a breakpoint on the last system block
        marks[-1] = True
    cached, pending = [], []
    for i, (b, marked) in enumerate(zip(blocks, marks)):
        if b.text.strip():
            pending.append(b.text)
        if marked:
            if not pending:
                raise InvalidRequest(f"system.{i}.cache_control: the text up to this breakpoint is empty")
            cached.append(JOINER.join(pending))
            pending = []
    return cached, JOINER.join(pending) if pending else None


def conversation(messages: list[MessageIn], system: str | None) -> list[dict]:
    """The messages as the pipeline's dicts: a user turn's tool_result blocks become `tool` messages (before its
    text), an assistant turn's tool_use blocks its `tool_calls`. 422 naming the message or block out of place."""
    out: list[dict] = [{"role": "system", "content": system}] if system else []
    where: list[str] = ["system"] * len(out)
    for i, m in enumerate(messages):
        at = f"messages.{i}"
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            where.append(at)
            continue
        if not m.content:
            raise InvalidRequest(f"{at}.content: at least one content block is required")
        texts, calls, results = [], [], []
        for j, b in enumerate(m.content):
            if isinstance(b, TextBlockIn):
                texts.append(b.text)
            elif isinstance(b, ToolUseIn) and m.role == "assistant":
                calls.append({"id": b.id, "type": "function",
                              "function": {"name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}})
            elif isinstance(b, ToolResultIn) and m.role == "user":
                if texts:
                    raise InvalidRequest(f"{at}.content.{j}: tool_result blocks come first in a user turn, "
                                         "before its text")
                content = b.content if isinstance(b.content, str) or b.content is None else \
                    _texts(b.content, f"{at}.content.{j}.content")
                results.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": content or ""})
            elif isinstance(b, (ToolUseIn, ToolResultIn)):
                raise InvalidRequest(f"{at}.content.{j}: a {b.type} block belongs in "
                                     f"{'an assistant' if b.type == 'tool_use' else 'a user'} turn")
            else:
                raise _unsupported(b, f"{at}.content.{j}")
        out += results
        where += [at] * len(results)
        if texts or calls or not results:
            msg: dict = {"role": m.role, "content": JOINER.join(texts)}
            if calls:
                msg["tool_calls"] = calls
            out.append(msg)
            where.append(at)
    if out[-1]["role"] not in ("user", "tool"):
        raise InvalidRequest(f"messages.{len(messages) - 1}: the last message must be a user turn (a final "
                             "assistant turn to continue is not supported)")
    link_results(out, lambda k: where[k])
    return out


def openai_tools(body: MessagesRequest) -> tuple[list[OpenAITool] | None, object, bool | None]:
    """(tools, tool_choice, parallel) in the OpenAI shapes service/api/params.py maps into the pipeline's."""
    tools = None
    if body.tools:
        seen: set[str] = set()
        for i, t in enumerate(body.tools):
            if t.name in seen:
                raise InvalidRequest(f"tools.{i}.name: {t.name!r} is offered twice; tool names must be unique")
            seen.add(t.name)
        tools = [OpenAITool(type="function", function=FunctionIn(name=t.name, description=t.description,
                                                                 parameters=t.input_schema)) for t in body.tools]
    c = body.tool_choice
    if c is None:
        return tools, None, None
    parallel = None if c.disable_parallel_tool_use is None else not c.disable_parallel_tool_use
    if c.type == "tool":
        return tools, NamedToolChoice(type="function", function=FunctionName(name=c.name)), parallel
    return tools, {"auto": "auto", "any": "required", "none": "none"}[c.type], parallel


# ---- the reply -------------------------------------------------------------------------------------------------------
def tool_input(arguments: str) -> dict:
    """A call's arguments as Anthropic's `input` (an object); arguments that are not a JSON object give {}."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def tool_use(call) -> dict:
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": tool_input(call.arguments)}


def content(final: Final) -> list[dict]:
    calls = tool_calls_of(final.done)
    text = [{"type": "text", "text": final.done.text}] if final.done.text or not calls else []
    return text + [tool_use(c) for c in calls]


def stop(final: Final, stops: list[str], tokenizer) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence). A stop sequence is cut from the text: the one found right where the text
    ends, in the reply's decoded tokens, is the one that stopped it."""
    done = final.done
    if done.finish_reason == "tool_calls":
        return "tool_use", None
    if done.finish_reason == "length":
        return "max_tokens", None
    if done.finish_reason == "stop" and stops and tokenizer is not None:
        decoded = tokenizer.decode(done.token_ids, skip_special_tokens=True)
        hit = next((s for s in stops if decoded.find(s) == len(done.text)), None)
        if hit is not None:
            return "stop_sequence", hit
    return "end_turn", None


def usage(final: Final, block_tokens: list[int]) -> dict:
    """Anthropic's usage; input_tokens + cache_creation_input_tokens + cache_read_input_tokens = the prompt.

    cache_creation: the tokens of the blocks (skills, cache_control blocks, the tools block) this request compiled,
    or queued for compiling in the background (automatic blocks: service/compose/autoblocks.py).
    cache_read: the tokens copied from cache (composed blocks and an exact prefix), less those copied from a block
    compiled by this very request (counted as creation). input: the rest, computed fresh (the messages, the
    system text, the seams recomputed at the blocks' joins). `block_tokens`: per skill or block, its tokens."""
    u = final.usage
    created = fresh_copied = 0
    for s, n in zip(final.skills, block_tokens):
        if s["source"] == "compiled":
            created += n
            fresh_copied += n if s["path"] == "prefix" else n - s["seam"] if s["seam"] is not None else 0
    t = final.tools
    if t is not None and t["source"] == "compiled" and t["path"] != "text":
        created += t["n_tokens"]  # its copied tokens are already counted recomputed by the pipeline
    created += final.scheduled_tokens
    read = max(0, u["reused_tokens"] - fresh_copied)
    # what is written to the cache is what this request computed of the head (blocks live there): the conversation
    # it computed is input, and a head read from an exact prefix (a repeated prompt) is read, not written
    computed = u["prompt_tokens"] - read
    head = u["prompt_tokens"] if final.head_tokens is None else final.head_tokens
    conversation = max(0, u["prompt_tokens"] - max(head, u["prefix_tokens"]))  # computed after the head
    created = min(created, computed - min(computed, conversation))
    return {"input_tokens": u["prompt_tokens"] - read - created, "output_tokens": u["completion_tokens"],
            "cache_creation_input_tokens": created, "cache_read_input_tokens": read}


def report(final: Final) -> dict:
    """skillcache's own report (as chat completions' `skillcache`)."""
    out = {"timings": final.timings, "skills": final.skills, "edits": final.edits}
    if final.memory is not None:
        out["memory"] = final.memory
    return {**out, "tools": final.tools} if final.tools is not None else out
