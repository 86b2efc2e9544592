"""One error taxonomy. Each error has an HTTP status and a stable `error_type`; the API maps them once."""

from __future__ import annotations


class ServiceError(Exception):
    status: int = 500
    error_type: str = "internal_error"
    headers: dict[str, str] | None = None

    def __init__(self, message: str, **details: object) -> None:
        super().__init__(message)
        self.message = message
        self.details = details


class InternalError(ServiceError):
    """Our own invariant failed: a bug here, not the client's fault (500, with the request id to find it in the log)."""

    status, error_type = 500, "internal_error"


class InvalidRequest(ServiceError):
    status, error_type = 422, "invalid_request"


class InvalidField(ServiceError):
    status, error_type = 422, "invalid_field"


class InvalidSkillName(ServiceError):
    status, error_type = 422, "invalid_skill_name"


class SkillNotFound(ServiceError):
    status, error_type = 404, "skill_not_found"


class SessionNotFound(ServiceError):
    status, error_type = 404, "session_not_found"


class ResponseNotFound(ServiceError):
    """A stored response (GET/DELETE /v1/responses/{id}, previous_response_id) that is not there: never stored
    (store: false), deleted, expired, or another tenant's."""

    status, error_type = 404, "response_not_found"


class ConversationNotFound(ServiceError):
    status, error_type = 404, "conversation_not_found"


class MemoryNotFound(ServiceError):
    status, error_type = 404, "memory_not_found"


class InvalidMemory(ServiceError):
    """A memory text or edit that cannot apply: a label given twice, an unknown label, a value on several lines."""

    status, error_type = 422, "invalid_memory"


class MemoryConflict(ServiceError):
    status, error_type = 409, "memory_conflict"


class SessionBusy(ServiceError):
    status, error_type = 409, "session_busy"


class SkillConflict(ServiceError):
    status, error_type = 409, "skill_conflict"


class LimitExceeded(ServiceError):
    status, error_type = 413, "limit_exceeded"


class ContextTooLong(ServiceError):
    status, error_type = 422, "context_too_long"


class UnsupportedModel(ServiceError):
    """The model's attention or RoPE variant cannot be re-rotated exactly."""

    status, error_type = 422, "unsupported_model"


class Overloaded(ServiceError):
    status, error_type = 429, "overloaded"

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.headers = {"Retry-After": str(retry_after_s)}


class RateLimited(ServiceError):
    """This caller's (API key's) request rate is over SKILLCACHE_RATE_LIMIT_RPS."""

    status, error_type = 429, "rate_limited"

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.headers = {"Retry-After": str(retry_after_s)}


class Unauthorized(ServiceError):
    status, error_type = 401, "unauthorized"

    def __init__(self, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.headers = headers or {"WWW-Authenticate": "Bearer"}


class Forbidden(ServiceError):
    status, error_type = 403, "forbidden"


class NotReady(ServiceError):
    status, error_type = 503, "not_ready"


class ModelLoadError(ServiceError):
    status, error_type = 500, "model_load_failed"


class EngineUnavailable(ServiceError):
    """The engine that runs the model (a vLLM server, SKILLCACHE_ENGINE=vllm) cannot be reached or broke off."""

    status, error_type = 503, "engine_unavailable"

    def __init__(self, message: str, retry_after_s: int = 5) -> None:
        super().__init__(message)
        self.headers = {"Retry-After": str(retry_after_s)}

