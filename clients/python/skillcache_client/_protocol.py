"""The wire protocol, without I/O: request builders and response parsers shared by both clients.

Each API operation is a function returning a `Call` (what to send, how to read the reply). The
sync and async clients only move bytes; every decision about the protocol is made here.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import httpx

from .errors import SkillcacheError

JSON = dict[str, Any]
SkillRef = str | Mapping[str, Any]  # "name" or {"name": ..., "version": N}

DEFAULT_URL = "http://127.0.0.1:8000"
USER_AGENT = "skillcache-client/0.1.0"


def http_kwargs(base_url: str, api_key: str | None, timeout: float | None) -> JSON:
    """Constructor kwargs for httpx.Client / httpx.AsyncClient."""
    headers = {"User-Agent": USER_AGENT, "Accept": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return {"base_url": base_url.rstrip("/"), "headers": headers, "timeout": httpx.Timeout(timeout)}


def _identity(body: Any) -> Any:
    return body


@dataclass(frozen=True)
class Call:
    """One HTTP exchange: the request, and how to turn the reply into a result."""

    method: str
    path: str
    json: JSON | None = None
    params: JSON | None = None
    parse: Callable[[Any], Any] = _identity
    accept: frozenset[int] = frozenset()  # error statuses whose body is still a result
    expect_json: bool = True

    def request_kwargs(self) -> JSON:
        """Kwargs for `httpx.Client.request` / `.stream`."""
        kw: JSON = {"method": self.method, "url": self.path}
        if self.json is not None:
            kw["json"] = self.json
        if self.params:
            kw["params"] = self.params
        return kw

    def result(self, status: int, content: bytes, headers: Mapping[str, str]) -> Any:
        """The parsed result, or raise SkillcacheError for an error status."""
        if status >= 400 and status not in self.accept:
            raise error_from_response(status, content, headers)
        if not self.expect_json:
            return self.parse(content)
        return self.parse(decode_json(status, content))


def decode_json(status: int, content: bytes | str) -> Any:
    try:
        return json.loads(content)
    except ValueError:
        snippet = content[:200] if isinstance(content, str) else content[:200].decode("utf-8", "replace")
        raise SkillcacheError(status, "bad_response", f"expected JSON, got: {snippet!r}") from None


def error_from_response(status: int, content: bytes | str, headers: Mapping[str, str]) -> SkillcacheError:
    """Map an error reply (`{"error": {"type", "message"}}`, or anything else) to SkillcacheError."""
    retry_after = _float_or_none(headers.get("retry-after"))
    text = content.decode("utf-8", "replace") if isinstance(content, bytes) else content
    try:
        body = json.loads(text)
    except ValueError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        err = body["error"]
        details = {k: v for k, v in err.items() if k not in ("type", "message")} or None
        return SkillcacheError(
            status, str(err.get("type") or "http_error"), str(err.get("message") or ""),
            details=details, retry_after=retry_after,
        )
    if isinstance(body, dict) and "detail" in body:  # FastAPI's default error shape
        detail = body["detail"]
        if isinstance(detail, list):
            message = "; ".join(_validation_item(d) for d in detail)
        else:
            message = str(detail)
        error_type = "invalid_request" if status == 422 else "http_error"
        return SkillcacheError(status, error_type, message, details=detail, retry_after=retry_after)
    message = text.strip()[:500] or f"HTTP {status}"
    return SkillcacheError(status, "http_error", message, retry_after=retry_after)


def _validation_item(item: Any) -> str:
    if isinstance(item, dict):
        loc = ".".join(str(p) for p in item.get("loc", []) if p != "body")
        return f"{loc}: {item.get('msg', '')}" if loc else str(item.get("msg", item))
    return str(item)


def _float_or_none(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def transport_error(exc: httpx.HTTPError, base_url: str) -> SkillcacheError:
    """A failure to talk to the server at all, as SkillcacheError with status 0."""
    if isinstance(exc, httpx.TimeoutException):
        return SkillcacheError(0, "timeout", f"request to {base_url} timed out ({type(exc).__name__})")
    return SkillcacheError(0, "connection_error", f"cannot reach {base_url}: {exc or type(exc).__name__}")


# ---- operations -----------------------------------------------------------------------------


def _skill_path(name: str) -> str:
    return f"/v1/skills/{quote(name, safe='')}"


def _drop_none(**kw: Any) -> JSON:
    return {k: v for k, v in kw.items() if v is not None}


def add_skill(name: str, text: str, description: str | None = None, fields: Mapping[str, str] | None = None) -> Call:
    body = _drop_none(name=name, text=text, description=description,
                      fields=dict(fields) if fields is not None else None)
    return Call("POST", "/v1/skills", json=body)


def list_skills() -> Call:
    return Call("GET", "/v1/skills", parse=lambda body: list(body.get("skills", [])))


def get_skill(name: str, version: int | None = None) -> Call:
    return Call("GET", _skill_path(name), params=_drop_none(version=version))


def delete_skill(name: str) -> Call:
    return Call("DELETE", _skill_path(name))


def health() -> Call:
    return Call("GET", "/readyz", accept=frozenset({503}))


def live() -> Call:
    return Call("GET", "/livez", parse=lambda content: True, expect_json=False)


def skill_refs(skills: SkillRef | Iterable[SkillRef]) -> list[str | JSON]:
    """Normalize skill references: a lone name becomes a list; dicts lose None versions."""
    if isinstance(skills, (str, Mapping)):
        skills = [skills]
    out: list[str | JSON] = []
    for s in skills:
        if isinstance(s, str):
            out.append(s)
        elif isinstance(s, Mapping) and "name" in s:
            out.append({k: v for k, v in s.items() if v is not None})
        else:
            raise TypeError(f"a skill reference is a name or a {{'name', 'version'}} mapping, not {s!r}")
    return out


def compose(
    skills: SkillRef | Iterable[SkillRef],
    user: str,
    *,
    stream: bool,
    system: str | None = None,
    fields: Mapping[str, str] | None = None,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    stop: str | list[str] | None = None,
    mode: str | None = None,
    seam_tokens: int | None = None,
    logprobs: int | None = None,
    edit_mode: str | None = None,
) -> Call:
    body: JSON = {"skills": skill_refs(skills), "user": user, "stream": stream}
    body.update(_drop_none(
        system=system, fields=dict(fields) if fields is not None else None, max_tokens=max_tokens,
        temperature=temperature, top_p=top_p, seed=seed, stop=stop, mode=mode, seam_tokens=seam_tokens,
        logprobs=logprobs, edit_mode=edit_mode,
    ))
    return Call("POST", "/v1/compose", json=body)
