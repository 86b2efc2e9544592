"""ToolPrompt: the tools of a request as a block of the prompt, the conversation's tool turns, the forced opening.

Where the chat template renders `tools` itself (and teaches a call format service/tools/formats.py reads), the
block is the text it renders them as: found once per set of tools by rendering a probe conversation with and
without them (the largest insertion), then cut out of every prompt. Otherwise the block is the fallback text
(service/tools/fallback.py), placed in the system turn after the skills. Either way its text depends on the tools
alone, so it is compiled once and reused by content hash (ComposePipeline.tools_block), like a skill's.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from difflib import SequenceMatcher

from service.errors import InvalidRequest
from service.runtime.prompt import PromptBuilder, PromptPlan, TemplateTools
from service.tools.fallback import fallback_text, tool_response
from service.tools.formats import FALLBACK, CallFormat, template_format
from service.tools.spec import ToolCall, ToolsParams

_CACHED = 256  # distinct tool sets whose rendering is remembered
_PROBE_SYSTEM, _PROBE_USER = "\x00system\x00", "\x00user\x00"


@dataclass(frozen=True)
class ToolsBlock:
    fmt: CallFormat
    native: bool  # rendered by the chat template (else the fallback text)
    text: str
    ids: tuple[int, ...]
    specs: tuple  # OpenAI tool objects, for the template


class ToolPrompt:
    def __init__(self, prompts: PromptBuilder) -> None:
        self.prompts = prompts
        self.tok = prompts.tok
        template = getattr(self.tok, "chat_template", None) or ""
        if isinstance(template, dict):  # named templates: the one for tools, else the default
            template = template.get("tool_use") or template.get("default") or ""
        self.native_fmt = template_format(template) if prompts.has_template else None
        self._blocks: OrderedDict[str, ToolsBlock] = OrderedDict()
        self._specials = sorted(t for t in getattr(self.tok, "added_tokens_encoder", {}) if len(t) > 1)

    # ---- the block -----------------------------------------------------------------------------
    def block(self, params: ToolsParams) -> ToolsBlock:
        key = params.digest()
        hit = self._blocks.get(key)
        if hit is not None:
            self._blocks.move_to_end(key)
            return hit
        specs = [t.openai() for t in params.tools]
        text = self._native_text(specs, params) if self.native_fmt is not None else None
        if text is not None:
            self.check_plain(json.dumps(specs, ensure_ascii=False), "tools")
            block = ToolsBlock(self.native_fmt, True, text, tuple(self.encode_template(text)), tuple(specs))
        else:
            text = fallback_text(params.tools)
            block = ToolsBlock(FALLBACK, False, text, tuple(self.prompts.encode_content(text)), tuple(specs))
        self._blocks[key] = block
        while len(self._blocks) > _CACHED:
            self._blocks.popitem(last=False)
        return block

    def _native_text(self, specs: list[dict], params: ToolsParams) -> str | None:
        """What the template adds for `specs`: the largest insertion between a probe rendered without and with
        them. None when the template does more than insert text (nothing to cut out as a block)."""
        probe = [{"role": "user", "content": _PROBE_USER}]
        try:
            without = self.prompts.render(_PROBE_SYSTEM, probe)
            with_tools = self.prompts.render(_PROBE_SYSTEM, probe, tools=specs)
        except Exception:  # noqa: BLE001 - a template that cannot render this probe: the fallback block
            return None
        ops = SequenceMatcher(None, without, with_tools, autojunk=False).get_opcodes()
        if any(op not in ("equal", "insert") for op, *_ in ops):
            return None
        text = max((with_tools[j1:j2] for op, _, _, j1, j2 in ops if op == "insert"), key=len, default="")
        if not text or "\x00" in text or any(t.name not in text for t in params.tools):
            return None
        return text

    def encode_template(self, text: str) -> list[int]:
        """Text the service writes into the prompt (a block of the template's, a forced opening), specials as such."""
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def check_plain(self, text: str, where: str) -> None:
        """Text the template renders as its own (tool specs, past calls) is tokenized with special tokens: it must
        not spell one, or a client could forge prompt structure."""
        bad = next((t for t in self._specials if t in text), None)
        if bad is not None:
            raise InvalidRequest(f"{where}: contains {bad!r}, a special token of this model's tokenizer")

    # ---- the conversation ------------------------------------------------------------------------
    def messages(self, messages: list[dict], native: bool) -> list[dict]:
        """OpenAI-shaped messages (assistant `tool_calls`, `tool` results) as the template gets them: as they are
        for a template that renders tools; otherwise calls written out in the fallback format and results as user
        turns in <tool_response> tags (consecutive results share one turn)."""
        out: list[dict] = []
        for m in messages:
            calls = [ToolCall(c["id"], c["function"]["name"], c["function"]["arguments"])
                     for c in m.get("tool_calls") or []]
            if native and calls:
                for c in calls:
                    self.check_plain(c.name + c.arguments, "messages: tool_calls")
                out.append({"role": "assistant", "content": m.get("content") or "", "tool_calls": [
                    {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments_value()}}
                    for c in calls]})
            elif calls:
                text = FALLBACK.call_text(calls)
                out.append({"role": "assistant", "content": f"{m['content']}\n{text}" if m.get("content") else text,
                            "tool_turn": True})
            elif m["role"] == "tool" and not native:
                if out and out[-1].get("tool_results"):
                    out[-1]["content"] += "\n" + tool_response(m["content"])
                else:
                    out.append({"role": "user", "content": tool_response(m["content"]), "tool_results": True})
            else:
                out.append(dict(m))
        for m in out:  # "tool_turn": a call or results written out as plain turns (late blocks go before them)
            if m.pop("tool_results", None):
                m["tool_turn"] = True
        return out

    def build(self, messages: list[dict], skill_ids: list[list[int]], errata: list[str] | None,
              block: ToolsBlock | None, add_generation_prompt: bool = True, late=None,
              system_parts: list[str | int] | None = None) -> tuple[PromptPlan, int | None]:
        """The prompt plan, and the index of the tools block among its blocks (None: no block in the prompt).

        `late`: blocks floated before the last user turn (a memory: .ids, .lines), indexed after the tools block."""
        native = block.native if block is not None else self.native_fmt is not None
        msgs = self.messages(messages, native)
        more: dict = {"late_ids": late.ids, "late_lines": late.lines} if late is not None else {}
        if system_parts is not None:
            more["system_parts"] = system_parts
        if block is None:
            return self.prompts.build(msgs, skill_ids, errata, add_generation_prompt, **more), None
        index = len(skill_ids)
        if block.native:
            tools = TemplateTools(list(block.specs), block.text, list(block.ids), index)
            plan = self.prompts.build(msgs, skill_ids, errata, add_generation_prompt, tools=tools, **more)
        else:
            plan = self.prompts.build(msgs, [*skill_ids, list(block.ids)], errata, add_generation_prompt, **more)
        skills = [seg for seg in plan.segments if seg.kind == "skill"]
        found = any(seg.skill_index == index for seg in skills[: len(skills) - len(more.get("late_ids", []))])
        return plan, index if found else None

    def force(self, plan: PromptPlan, opening: str) -> None:
        """Append a forced call opening to the prompt: it is the start of the assistant's reply."""
        if opening:
            plan.segments[-1].ids.extend(self.encode_template(opening))
