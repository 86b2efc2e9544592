"""ToolCallParser: a reply's text, streamed in as it is generated, split into content and tool calls.

One parser serves the streaming and the non-streaming responses (the latter feeds the whole text at once), so both
read the same calls. A call is reported once it is complete; text that may still become one (an open tag, or a
Llama-3 reply that starts with `{`) is held back until it is. What does not parse as a call of an offered tool
comes back as content, never as an error. A forced call (tool_choice `required` or named: the service wrote its
opening, `forced`) is read leniently: the first JSON object after its arguments key, closed if it was cut.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from service.tools import jsonfix
from service.tools.formats import CallFormat
from service.tools.spec import ToolCall, ToolsParams, new_call_id

_NAME = re.compile(r'^\s*\[?\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"(?:arguments|parameters)"\s*:')


@dataclass
class CallEvent:
    """A complete tool call, in the order the model made them (`index`)."""

    index: int
    call: ToolCall


@dataclass
class ContentEvent:
    text: str


class ToolCallParser:
    def __init__(self, fmt: CallFormat, params: ToolsParams, forced: str = "") -> None:
        self.fmt, self.params = fmt, params
        self.names = params.names()
        self.max_calls = 1 if params.choice.mode == "named" or not params.parallel else None
        self.lenient = bool(forced)  # the first call was forced: read it leniently
        self.buf = ""
        self.in_call = False
        self.decided = fmt.start is not None  # Llama-3: undecided until the reply's first character
        self.content: list[str] = []
        self.calls: list[ToolCall] = []
        self.cut = False  # a call was read from text that ended before the call did
        self._pending: list[ContentEvent | CallEvent] = []
        if forced:
            self.feed(forced)

    # ---- input ---------------------------------------------------------------------------------
    def feed(self, text: str) -> list[ContentEvent | CallEvent]:
        self.buf += text
        if self.fmt.start is None:
            self._feed_whole()
        else:
            self._feed_tags()
        out, self._pending = self._pending, []
        return out

    def finish(self) -> list[ContentEvent | CallEvent]:
        """The end of the reply: a call still open is read if it is complete JSON (or forced), else it is text."""
        if self.in_call or (self.fmt.start is None and self.buf.strip()):
            body = self.buf[len(self.fmt.start):] if self.fmt.start else self.buf
            if not self._read(body, at_end=True):
                self._text(self.buf)
        elif self.buf:
            self._text(self.buf)
        self.buf, self.in_call = "", False
        out, self._pending = self._pending, []
        return out

    # ---- results -------------------------------------------------------------------------------
    @property
    def text(self) -> str:
        """The content: the reply without its calls (whitespace alone, around calls, is no content)."""
        text = "".join(self.content)
        return "" if self.calls and not text.strip() else text

    def finish_reason(self, reason: str) -> str:
        """OpenAI's finish_reason for a reply that ended with `reason` (stop, length, cancelled)."""
        if self.calls and reason != "cancelled" and not (reason == "length" and self.cut):
            return "tool_calls"
        return reason

    # ---- tags (hermes, fallback) ---------------------------------------------------------------
    def _feed_tags(self) -> None:
        start, end = self.fmt.start, self.fmt.end
        while True:
            if not self.in_call:
                i = self.buf.find(start)
                if i < 0:
                    keep = _partial_suffix(self.buf, start)
                    self._text(self.buf[: len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep:]
                    return
                self._text(self.buf[:i])
                self.buf, self.in_call = self.buf[i:], True
            j = self.buf.find(end, len(start))
            if j < 0:
                return
            whole = self.buf[: j + len(end)]
            if not self._read(self.buf[len(start):j], at_end=False):
                self._text(whole)
            self.buf, self.in_call = self.buf[j + len(end):], False

    # ---- the whole reply (llama3_json) ---------------------------------------------------------
    def _feed_whole(self) -> None:
        if not self.decided:
            head = self.buf.lstrip()
            if not head:
                return
            self.decided, self.in_call = True, head[0] in "{["
        if not self.in_call:
            self._text(self.buf)
            self.buf = ""

    # ---- reading calls -------------------------------------------------------------------------
    def _read(self, body: str, at_end: bool) -> bool:
        """Read the calls in `body`; False (nothing recorded) when it is not a call we can report."""
        objs = self._strict(body)
        if objs is None and self.lenient and not self.calls:
            objs = self._forced(body)
            self.cut = objs is not None and at_end
        self.lenient = False
        if objs is None:
            return False
        for name, args in objs:
            if self.max_calls is not None and len(self.calls) >= self.max_calls:
                break  # one call only (named tool_choice, parallel_tool_calls false)
            call = ToolCall(new_call_id(), name, args)
            self._pending.append(CallEvent(len(self.calls), call))
            self.calls.append(call)
        return True

    def _strict(self, body: str) -> list[tuple[str, str]] | None:
        values = [jsonfix.loads(body)] if self.fmt.start else jsonfix.values(body)
        if values is None or values == [None]:
            return None
        items = [x for v in values for x in (v if isinstance(v, list) else [v])]
        out = []
        for item in items:
            if not isinstance(item, dict) or item.get("name") not in self.names:
                return None
            args = item.get(self.fmt.args_key, item.get("arguments", item.get("parameters", {})))
            if isinstance(args, str):
                args = jsonfix.loads(args)
            if not isinstance(args, dict):
                return None
            out.append((item["name"], json.dumps(args, ensure_ascii=False)))
        return out or None

    def _forced(self, body: str) -> list[tuple[str, str]] | None:
        """The forced call: its name (written by the service, or the model's choice), then the first object after
        the arguments key; the raw text of the arguments when no object can be read from it."""
        m = _NAME.match(body)
        if m is None or m.group(1) not in self.names:
            return None
        rest = body[m.end():]
        args = jsonfix.first_object(rest)
        text = json.dumps(args, ensure_ascii=False) if args is not None else rest.strip()
        return [(m.group(1), text)]

    def _text(self, text: str) -> None:
        if text:
            self.content.append(text)
            self._pending.append(ContentEvent(text))


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a beginning of `tag` (it may be a tag still arriving)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
