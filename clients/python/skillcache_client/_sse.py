"""Server-sent events, without I/O: an incremental parser and the /v1/compose event protocol."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from typing import Any

from ._protocol import error_from_response
from .errors import SkillcacheError

DONE_SENTINEL = "[DONE]"


class SSEParser:
    """Incremental `text/event-stream` parser: feed decoded text in any chunking, get `data` payloads.

    Follows the WHATWG rules that matter here: CR, LF or CRLF line ends (also split across chunks),
    `:` comments, one optional space after the colon, multi-line `data` joined with a newline, and
    an event dispatched on a blank line. Fields other than `data` are ignored.
    """

    def __init__(self) -> None:
        self._buf = ""
        self._data: list[str] = []

    def feed(self, chunk: str) -> Iterator[str]:
        """Yield the data of each event completed by this chunk."""
        self._buf += chunk
        while True:
            i = _line_end(self._buf)
            if i < 0:
                return
            line = self._buf[:i]
            step = 2 if self._buf.startswith("\r\n", i) else 1
            self._buf = self._buf[i + step:]
            data = self._line(line)
            if data is not None:
                yield data

    def flush(self) -> Iterator[str]:
        """End of stream: dispatch a last event that lacks its closing blank line."""
        if self._buf:
            data = self._line(self._buf.rstrip("\r"))
            self._buf = ""
            if data is not None:
                yield data
        if self._data:
            yield "\n".join(self._data)
            self._data = []

    def _line(self, line: str) -> str | None:
        if not line:
            if not self._data:
                return None
            data, self._data = "\n".join(self._data), []
            return data
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value[1:] if value.startswith(" ") else value)
        return None


_EOL = re.compile(r"[\r\n]")


def _line_end(buf: str) -> int:
    """Index of the first complete line end; a trailing CR waits for a possible LF."""
    m = _EOL.search(buf)
    if m is None or (m.start() == len(buf) - 1 and buf[-1] == "\r"):
        return -1
    return m.start()


class ComposeStream:
    """The reply to a streamed /v1/compose, fed chunk by chunk, as client events.

    Yields `{"type": "delta", "text": ...}` events and one `{"type": "done", ...}`; raises
    SkillcacheError for an error reply, an error event, or a stream that ends before `done`.
    A JSON (non-stream) 2xx reply is accepted too and turned into one delta and a done event.
    """

    def __init__(self, status: int, headers: Mapping[str, str]) -> None:
        self.status = status
        self.headers = headers
        content_type = headers.get("content-type", "")
        self._kind = "error" if status >= 400 else "sse" if "text/event-stream" in content_type else "json"
        self._parser = SSEParser()
        self._body: list[str] = []
        self.saw_done = False
        self.finished = False  # nothing more to read: [DONE] arrived

    def feed(self, chunk: str) -> Iterator[dict[str, Any]]:
        """Yield the events this chunk completes (iterate it fully: it is lazy)."""
        if self._kind != "sse":
            self._body.append(chunk)
            return
        for data in self._parser.feed(chunk):
            if self.finished:
                return
            yield from self._event(data)

    def close(self) -> Iterator[dict[str, Any]]:
        """End of the reply: flush, and check the stream ended properly."""
        if self._kind == "error":
            raise error_from_response(self.status, "".join(self._body), self.headers)
        if self._kind == "json":
            yield from _events_from_json(self.status, "".join(self._body))
            return
        for data in self._parser.flush():
            if self.finished:
                break
            yield from self._event(data)
        if not self.saw_done:
            raise SkillcacheError(self.status, "incomplete_stream", "the stream ended before its done event")

    def _event(self, data: str) -> Iterator[dict[str, Any]]:
        if not data.strip():  # an empty event (e.g. a bare keep-alive `data:`)
            return
        if data.strip() == DONE_SENTINEL:
            self.finished = True
            return
        try:
            event = json.loads(data)
        except ValueError:
            raise SkillcacheError(self.status, "bad_stream", f"event data is not JSON: {data[:200]!r}") from None
        if not isinstance(event, dict):
            raise SkillcacheError(self.status, "bad_stream", f"event data is not an object: {data[:200]!r}")
        if event.get("type") == "error":
            err = event.get("error") if isinstance(event.get("error"), dict) else {}
            details = {k: v for k, v in err.items() if k not in ("type", "message")} or None
            raise SkillcacheError(
                self.status, str(err.get("type") or "stream_error"), str(err.get("message") or ""),
                details=details, streamed=True,
            )
        if event.get("type") == "done":
            self.saw_done = True
        yield event


def _events_from_json(status: int, text: str) -> Iterator[dict[str, Any]]:
    try:
        body = json.loads(text)
    except ValueError:
        raise SkillcacheError(status, "bad_response", f"expected an event stream, got: {text[:200]!r}") from None
    if not isinstance(body, dict):
        raise SkillcacheError(status, "bad_response", "expected a JSON object")
    rest = {k: v for k, v in body.items() if k != "text"}
    yield {"type": "delta", "text": str(body.get("text", ""))}
    yield {"type": "done", **rest}
