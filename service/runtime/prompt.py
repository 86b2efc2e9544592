"""Prompt segments: the chat template rendered around skill blocks, tokenized segment by segment.

A skill's ids in the composed prompt are exactly its precompiled ids (it is tokenized alone), and
the full-recompute reference runs over the identical id sequence, so the two modes always compare
like with like. Skills come first in the system turn, before the request's own system text and
errata: the static part of the prompt leads, so the first skill always follows the same template
opening (`skill_anchor`) and is compiled after it exactly as a full prefill would compute it.
User-supplied text (system, skills, turns) is tokenized with special tokens split, so text that
spells `<|im_start|>` cannot forge prompt structure; only the template emits specials.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_SENTINEL = "\x00{}\x00"
_SENTINEL_RE = re.compile("\x00(\\d+)\x00")
BLOCK_JOINER = "\n\n"  # between the system text, skill blocks and errata in the system turn
_TOOL_KEYS = ("tool_calls", "tool_call_id", "name")  # message keys a template with tools support reads
LATE_JOINER = "\n"  # between late blocks (a memory split into blocks of whole lines reads as one document)


@dataclass
class Segment:
    kind: Literal["text", "skill"]
    ids: list[int]
    skill_index: int | None = None  # index into the request's skill list
    recompute: list[tuple[int, int]] = field(default_factory=list)  # skill spans [s, e) to run, not copy


@dataclass
class TemplateTools:
    """Tool specs for a chat template that renders `tools` itself, and the text it renders them as: that text is cut
    out of the prompt as a block of its own (ids: its token ids) at index `index` of the request's blocks."""

    specs: list[dict]
    text: str
    ids: list[int]
    index: int


@dataclass
class PromptPlan:
    segments: list[Segment] = field(default_factory=list)
    head_end: int | None = None  # where the conversation's first message starts: ids[:head_end] is the head
    # (template opening, skills, system text, errata), the same for every request that shares them
    late_span: tuple[int, int] | None = None  # [start, end): late blocks (a memory) and their lines at the head of
    # the last user turn; ids[end:] is that turn's own content on (build(late_ids=...))

    @property
    def ids(self) -> list[int]:
        return [t for s in self.segments for t in s.ids]

    @property
    def n_tokens(self) -> int:
        return sum(len(s.ids) for s in self.segments)

    def skill_ends(self) -> list[int]:
        """Where each skill segment ends (the token after it), in segment order: plan.ids[:end] is the prompt
        through that skill, the same for every request that opens with the same skills."""
        out, pos = [], 0
        for s in self.segments:
            pos += len(s.ids)
            if s.kind == "skill":
                out.append(pos)
        return out

    def skill_offsets(self) -> list[int]:
        """Position of the first token of each skill segment, in segment order."""
        out, pos = [], 0
        for s in self.segments:
            if s.kind == "skill":
                out.append(pos)
            pos += len(s.ids)
        return out


class PromptBuilder:
    def __init__(self, tokenizer: "PreTrainedTokenizerBase") -> None:
        self.tok = tokenizer
        self.has_template = bool(getattr(tokenizer, "chat_template", None))

    def encode_content(self, text: str) -> list[int]:
        """User-supplied text -> ids, with special-token spellings kept as plain text."""
        return self.tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]

    def encode_spans(self, text: str, char_spans: list[tuple[int, int]]) -> tuple[list[int], list[tuple[int, int]]]:
        """ids of `text` (as encode_content) and the token span [s, e) covering each character span."""
        enc = self.tok(text, add_special_tokens=False, split_special_tokens=True, return_offsets_mapping=True)
        offsets = enc["offset_mapping"]
        spans = []
        for cs, ce in char_spans:
            hit = [i for i, (a, b) in enumerate(offsets) if a < ce and b > cs]
            spans.append((hit[0], hit[-1] + 1) if hit else (0, 0))
        return enc["input_ids"], spans

    def _encode_template_text(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def build(
        self,
        messages: list[dict[str, str]],
        skill_ids: list[list[int]],
        errata: list[str] | None = None,
        add_generation_prompt: bool = True,
        tools: TemplateTools | None = None,
        late_ids: list[list[int]] | None = None,
        late_lines: list[str] | None = None,
        system_parts: list[str | int] | None = None,
    ) -> PromptPlan:
        """Lay skills, then the system text, then errata lines into the system turn and render the conversation.

        `messages`: OpenAI-style [{"role", "content", "ids"?}], an optional leading system message.
        `skill_ids`: each skill's precompiled token ids, in request order.
        `tools`: rendered by the template (its own `tools` support); messages may then carry `tool_calls`,
        `tool_call_id` and `name`, which reach the template as given.
        `late_ids`: blocks placed late, at the head of the last user message: each block's ids (segments of kind
        "skill", skill_index n + j, n the blocks before them: the skills, then the tools block when the prompt holds
        it), joined by LATE_JOINER, then `late_lines` (one a line), then BLOCK_JOINER and the message's own content.
        Only tool calls and their results ("tool" messages, or "tool_turn" ones: service/tools/render.py) may follow it.
        plan.late_span covers them, so the turn's content and what follows render to the same ids as without them
        (a session's memory, service/memory/).
        `system_parts`: the system text as parts (service/compose/sections.py), in place of the system message's
        content: a str is text, tokenized alone; an int i places skill i there instead of before the system text.
        """
        pieces: list[tuple[str, object]] = []  # sentinel index -> ("content", text) | ("skill", i)

        def sentinel(kind: str, value: object) -> str:
            pieces.append((kind, value))
            return _SENTINEL.format(len(pieces) - 1)

        msgs = [dict(m) for m in messages]
        system_text = msgs.pop(0)["content"] if msgs and msgs[0]["role"] == "system" else None
        parts: list[str | int] = ([system_text] if system_text else []) if system_parts is None else system_parts
        placed = {v for v in parts if isinstance(v, int)}
        sys_parts = [sentinel("skill", i) for i in range(len(skill_ids)) if i not in placed]
        sys_parts += [sentinel("skill", v) if isinstance(v, int) else sentinel("content", v) for v in parts if v != ""]
        sys_parts += [sentinel("content", line) for line in errata or []]
        # a message may carry "ids": its content's exact token ids (a session's generated replies),
        # so the transcript re-renders to the very tokens already cached
        body = [{**{k: m[k] for k in _TOOL_KEYS if k in m}, "role": m["role"],
                 "content": sentinel("ids", m["ids"]) if m.get("ids") is not None
                 else "" if m.get("tool_calls") and not m["content"] else sentinel("content", m["content"])}
                for m in msgs]
        late_first = late_own = None  # sentinel indexes: the first late block, the late turn's own content
        if late_ids:
            at = _late_turn(msgs)
            late_own = int(_SENTINEL_RE.findall(body[at]["content"])[0])
            late_first = len(pieces)
            late = [sentinel("late", j) for j in range(len(late_ids))]
            lines = [sentinel("content", "\n".join(late_lines))] if late_lines else []
            body[at]["content"] = BLOCK_JOINER.join([LATE_JOINER.join(late), *lines, body[at]["content"]])
        rendered = self._render(BLOCK_JOINER.join(sys_parts) if sys_parts else None, body, add_generation_prompt,
                                tools=tools.specs if tools else None)
        n_blocks = len(skill_ids)  # late blocks are indexed after the skills' and the tools block, if rendered
        if tools is not None and tools.text in rendered:
            rendered = rendered.replace(tools.text, sentinel("block", tools), 1)
            n_blocks = max(n_blocks, tools.index + 1)

        plan = PromptPlan()
        cursor, n_head = 0, len(sys_parts)  # pieces before n_head are the system turn's
        for match in _SENTINEL_RE.finditer(rendered):
            self._add_text(plan, rendered[cursor : match.start()])
            if int(match.group(1)) == n_head and plan.head_end is None:
                plan.head_end = plan.n_tokens
            if int(match.group(1)) == late_first:
                late_start = plan.n_tokens
            if int(match.group(1)) == late_own:
                plan.late_span = (late_start, plan.n_tokens)
            kind, value = pieces[int(match.group(1))]
            if kind == "skill":
                plan.segments.append(Segment("skill", list(skill_ids[value]), skill_index=value))
            elif kind == "late":
                plan.segments.append(Segment("skill", list(late_ids[value]), skill_index=n_blocks + value))
            elif kind == "ids":
                self._add_ids(plan, value)
            elif kind == "block":
                plan.segments.append(Segment("skill", list(value.ids), skill_index=value.index))
            else:
                self._add_text(plan, value, content=True)
            cursor = match.end()
        self._add_text(plan, rendered[cursor:])
        return plan

    def skill_anchor(self) -> list[int]:
        """The ids every prompt carries before its first skill (the system turn's opening; BOS without a
        template). Skills are compiled after it (ModelRuntime.compile_block)."""
        plan = self.build([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}], [[0]])
        first = plan.segments[0]
        return list(first.ids) if first.kind == "text" else []

    def _add_text(self, plan: PromptPlan, text: str, content: bool = False) -> None:
        if text:
            self._add_ids(plan, self.encode_content(text) if content else self._encode_template_text(text))

    def _add_ids(self, plan: PromptPlan, ids: list[int]) -> None:
        if plan.segments and plan.segments[-1].kind == "text":
            plan.segments[-1].ids.extend(ids)
        else:
            plan.segments.append(Segment("text", ids))

    def render(self, system: str | None, body: list[dict], add_generation_prompt: bool = True,
               tools: list[dict] | None = None) -> str:
        """The conversation as the chat template renders it, `system` leading (service/tools probes it)."""
        return self._render(system, body, add_generation_prompt, tools=tools)

    def _render(self, system: str | None, body: list[dict[str, str]], add_generation_prompt: bool,
                tools: list[dict] | None = None) -> str:
        if not self.has_template:
            bos = self.tok.bos_token or ""
            turns = ([system] if system else []) + [m["content"] for m in body]
            return bos + BLOCK_JOINER.join(turns) + ("\n" if add_generation_prompt else "")
        conv = ([{"role": "system", "content": system}] if system else []) + body
        try:
            rendered = self.tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                    tools=tools)
            # some templates without a system role raise (Gemma), others drop the system turn silently (the first
            # Phi-3-mini): it holds the skills, so a render without all of them is no render
            if not system or set(_SENTINEL_RE.findall(system)) <= set(_SENTINEL_RE.findall(rendered)):
                return rendered
            error: Exception = ValueError("the chat template drops the system turn, and there is no user turn "
                                          "to carry the skills")
        except Exception as e:
            if not system:
                raise
            error = e
        # Templates without a system role: the system text leads the first user turn.
        first = next((i for i, m in enumerate(body) if m["role"] == "user"), None)
        if first is None:
            raise error
        body = [dict(m) for m in body]
        body[first]["content"] = system + BLOCK_JOINER + body[first]["content"]
        return self.tok.apply_chat_template(body, tokenize=False, add_generation_prompt=add_generation_prompt,
                                            tools=tools)


def _late_turn(msgs: list[dict]) -> int:
    """The message late blocks lead: the last user turn. Only tool calls and their results may follow it (an agent
    loop's turn that brings results: the memory stays before the question they answer)."""
    for i in range(len(msgs) - 1, -1, -1):
        m = msgs[i]
        if m["role"] == "user" and not m.get("tool_turn"):
            return i
        if not (m["role"] == "tool" or m.get("tool_calls") or m.get("tool_turn")):
            break
    raise ValueError("late blocks go at the head of the last user turn, which only tool calls and results may follow")
