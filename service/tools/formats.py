"""The ways a model writes a tool call, and the opening of a call the service can force.

- `hermes`: Hermes / Qwen chat templates. Each call is `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`.
- `fallback`: the service's own convention for templates without tools support (service/tools/fallback.py): one
  `<tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call>` holding a JSON list of calls, the shape
  SmolLM2's function-calling data uses.
- `llama3_json`: Llama-3.1/3.2 templates. The whole reply is `{"name": ..., "parameters": {...}}` (the
  `<|python_tag|>` before it is a special token, gone from the decoded text); several calls are separated by `;`.

A forced opening is text appended to the prompt after the assistant turn's opening: the model continues a call
that has already begun, so a named tool_choice is always a call of that function. It ends at the arguments' key; the
arguments are then decoded under the tool's parameters schema (GenParams.json_schema, ToolsPrep.gen), so they always
parse and validate.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from service.tools.spec import ToolCall, ToolChoice, ToolsParams


@dataclass(frozen=True)
class CallFormat:
    name: str
    start: str | None  # the tag a call opens with; None: the whole reply is the call (JSON)
    end: str | None
    opener: str  # what a forced call starts with, before the call object
    list_body: bool  # a JSON list of calls inside one tag
    args_key: str  # "arguments" or "parameters"

    def forced_opening(self, params: ToolsParams) -> str:
        """The text that begins a forced call ("" when the choice forces nothing)."""
        choice = params.choice
        if not choice.forced:
            return ""
        head = self.opener + ("[" if self.list_body else "") + '{"name": "'
        tool = params.get(choice.name) if choice.mode == "named" else None
        if tool is None and choice.mode == "required" and len(params.tools) == 1:
            tool = params.tools[0]  # one tool to choose from: the call is that one
        if tool is None:
            return head
        return head + tool.name + '", ' + json.dumps(self.args_key) + ": "

    def call_text(self, calls: list[ToolCall]) -> str:
        """Past calls written back the way the model writes them (prompts rendered without template tools)."""
        objs = [{"name": c.name, self.args_key: c.arguments_value()} for c in calls]
        dump = lambda o: json.dumps(o, ensure_ascii=False)  # noqa: E731
        if self.start is None:
            return "; ".join(dump(o) for o in objs)
        if self.list_body:
            return f"{self.start}{dump(objs)}{self.end}"
        return "\n".join(f"{self.start}\n{dump(o)}\n{self.end}" for o in objs)

    def stop_strings(self, choice: ToolChoice, parallel: bool) -> list[str]:
        """Stop strings that end generation once the calls the request may get are written: after the first call
        when only one may be made, and after the one tag of a list format (it holds every call)."""
        if self.end is None or choice.mode == "none":
            return []
        return [self.end] if choice.mode == "named" or not parallel or self.list_body else []


HERMES = CallFormat("hermes", "<tool_call>", "</tool_call>", "<tool_call>\n", False, "arguments")
FALLBACK = CallFormat("fallback", "<tool_call>", "</tool_call>", "<tool_call>", True, "arguments")
LLAMA3_JSON = CallFormat("llama3_json", None, None, "", False, "parameters")
FORMATS = {f.name: f for f in (HERMES, FALLBACK, LLAMA3_JSON)}


def template_format(template: str) -> CallFormat | None:
    """The call format a chat template that renders `tools` teaches its model; None when it is none we parse."""
    if "tools" not in template:
        return None
    if "<tool_call>" in template:
        return HERMES
    if "<|python_tag|>" in template or '"parameters": dictionary of argument name' in template:
        return LLAMA3_JSON
    return None
