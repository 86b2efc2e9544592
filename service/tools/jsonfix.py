"""Reading the JSON of a call: strictly, and leniently for a call the service forced (a small model may add a
stray brace, or run out of max_tokens before it closes the object)."""

from __future__ import annotations

import json
from typing import Any

_DECODER = json.JSONDecoder()
_MAX_REPAIRS = 256  # cut points tried when closing a truncated object


def loads(text: str) -> Any:
    """json.loads, or None when `text` is not one JSON value."""
    try:
        return json.loads(text)
    except ValueError:
        return None


def values(text: str, sep: str = ";") -> list[Any] | None:
    """JSON values one after another, separated by whitespace or `sep` (Llama-3 writes `{...}; {...}`)."""
    out, i, n = [], 0, len(text)
    while True:
        while i < n and (text[i].isspace() or text[i] == sep):
            i += 1
        if i == n:
            return out or None
        try:
            value, i = _DECODER.raw_decode(text, i)
        except ValueError:
            return None
        out.append(value)


def first_object(text: str) -> dict | None:
    """The JSON object `text` starts with (after whitespace), whatever follows it; a truncated one closed at its
    last complete value; None when there is no object to read."""
    s = text.lstrip()
    if not s.startswith("{"):
        return None
    try:
        value, _ = _DECODER.raw_decode(s)
        return value if isinstance(value, dict) else None
    except ValueError:
        pass
    tried = 0
    for end in range(len(s), 0, -1):
        if end < len(s) and s[end - 1] not in '"}]0123456789el':  # cut only after a value could end
            continue
        closed = _close(s[:end])
        if closed is not None:
            value = loads(closed)
            if isinstance(value, dict):
                return value
        tried += 1
        if tried >= _MAX_REPAIRS:
            return None
    return None


def _close(prefix: str) -> str | None:
    """`prefix` with its open string and brackets closed, or None when it is not a JSON prefix we can close."""
    stack: list[str] = []
    in_string = escaped = False
    for ch in prefix:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            stack.append("}" if ch == "{" else "]")
        elif ch in "}]":
            if not stack or stack.pop() != ch:
                return None
    if escaped:
        return None
    return prefix + ('"' if in_string else "") + "".join(reversed(stack))
