"""The one exception type the client raises."""

from __future__ import annotations

from typing import Any


class SkillcacheError(Exception):
    """An error reported by the server, or a transport failure (then `status` is 0).

    `error_type` is the server's stable error type (e.g. `skill_not_found`), or one of the client's
    own: `connection_error`, `timeout`, `http_error` (a non-standard error body), `bad_response`,
    `bad_stream`, `incomplete_stream`. For an error event that arrives after a stream started,
    `status` is the HTTP status of the stream (200) and `streamed` is True.
    """

    def __init__(
        self,
        status: int,
        error_type: str,
        message: str,
        *,
        details: Any = None,
        retry_after: float | None = None,
        streamed: bool = False,
    ) -> None:
        super().__init__(status, error_type, message)
        self.status = status
        self.error_type = error_type
        self.message = message
        self.details = details
        self.retry_after = retry_after
        self.streamed = streamed

    def __str__(self) -> str:
        return f"{self.error_type}: {self.message}"
