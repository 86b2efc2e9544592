"""SkillcacheClient (sync) and AsyncSkillcacheClient: thin I/O shells over `_protocol` and `_sse`."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Iterator, Mapping
from typing import Any

import httpx

from . import _protocol as proto
from ._protocol import DEFAULT_URL, SkillRef
from ._sse import ComposeStream
from .errors import SkillcacheError

Event = dict[str, Any]


class SkillcacheClient:
    """Blocking client. Use as a context manager, or call `close()`.

    Every method raises SkillcacheError on an error reply or a transport failure.
    `transport` is handed to httpx (tests pass an `httpx.MockTransport`).
    """

    def __init__(
        self,
        base_url: str = DEFAULT_URL,
        api_key: str | None = None,
        timeout: float | None = 120,
        *,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.base_url = base_url
        self._http = httpx.Client(**proto.http_kwargs(base_url, api_key, timeout), transport=transport)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> SkillcacheClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, call: proto.Call) -> Any:
        try:
            resp = self._http.request(**call.request_kwargs())
        except httpx.HTTPError as e:
            raise proto.transport_error(e, self.base_url) from e
        return call.result(resp.status_code, resp.content, resp.headers)

    def _stream(self, call: proto.Call) -> Iterator[Event]:
        try:
            with self._http.stream(**call.request_kwargs()) as resp:
                events = ComposeStream(resp.status_code, resp.headers)
                for chunk in resp.iter_text():
                    yield from events.feed(chunk)
                    if events.finished:
                        break
                yield from events.close()
        except httpx.HTTPError as e:
            raise proto.transport_error(e, self.base_url) from e

    # ---- skills ---------------------------------------------------------------------------
    def add_skill(
        self, name: str, text: str, description: str | None = None, fields: Mapping[str, str] | None = None
    ) -> dict[str, Any]:
        """Register (and compile) a skill; the same text again returns the existing version."""
        return self._call(proto.add_skill(name, text, description, fields))

    def list_skills(self) -> list[dict[str, Any]]:
        return self._call(proto.list_skills())

    def get_skill(self, name: str, version: int | None = None) -> dict[str, Any]:
        """The skill's record: its latest version, or `version`."""
        return self._call(proto.get_skill(name, version))

    def delete_skill(self, name: str) -> dict[str, Any]:
        """Delete every version of a skill: `{"deleted": name, "versions": [...]}`."""
        return self._call(proto.delete_skill(name))

    # ---- compose --------------------------------------------------------------------------
    def compose(
        self, skills: SkillRef | Iterable[SkillRef], user: str, *, system: str | None = None,
        fields: Mapping[str, str] | None = None, max_tokens: int | None = None,
        temperature: float | None = None, top_p: float | None = None, seed: int | None = None,
        stop: str | list[str] | None = None, mode: str | None = None, seam_tokens: int | None = None,
        logprobs: int | None = None, edit_mode: str | None = None,
    ) -> dict[str, Any]:
        """Compose the skills' caches with the conversation and generate: `{"text", "usage", ...}`."""
        return self._call(proto.compose(
            skills, user, stream=False, system=system, fields=fields, max_tokens=max_tokens,
            temperature=temperature, top_p=top_p, seed=seed, stop=stop, mode=mode,
            seam_tokens=seam_tokens, logprobs=logprobs, edit_mode=edit_mode,
        ))

    def compose_stream(
        self, skills: SkillRef | Iterable[SkillRef], user: str, *, system: str | None = None,
        fields: Mapping[str, str] | None = None, max_tokens: int | None = None,
        temperature: float | None = None, top_p: float | None = None, seed: int | None = None,
        stop: str | list[str] | None = None, mode: str | None = None, seam_tokens: int | None = None,
        logprobs: int | None = None, edit_mode: str | None = None,
    ) -> Iterator[Event]:
        """Like compose, streamed: `{"type": "delta", "text"}` events, then one `{"type": "done", ...}`.

        The request is sent when iteration starts.
        """
        return self._stream(proto.compose(
            skills, user, stream=True, system=system, fields=fields, max_tokens=max_tokens,
            temperature=temperature, top_p=top_p, seed=seed, stop=stop, mode=mode,
            seam_tokens=seam_tokens, logprobs=logprobs, edit_mode=edit_mode,
        ))

    # ---- health ---------------------------------------------------------------------------
    def health(self) -> dict[str, Any]:
        """GET /readyz: the readiness details, also when the server answers 503."""
        return self._call(proto.health())

    def live(self) -> bool:
        """GET /livez: True when the server answers 200; False otherwise (never raises)."""
        try:
            return bool(self._call(proto.live()))
        except SkillcacheError:
            return False


class AsyncSkillcacheClient:
    """The asyncio twin of SkillcacheClient; same methods, awaited (`compose_stream` is async-iterated)."""

    def __init__(
        self,
        base_url: str = DEFAULT_URL,
        api_key: str | None = None,
        timeout: float | None = 120,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.base_url = base_url
        self._http = httpx.AsyncClient(**proto.http_kwargs(base_url, api_key, timeout), transport=transport)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncSkillcacheClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _call(self, call: proto.Call) -> Any:
        try:
            resp = await self._http.request(**call.request_kwargs())
        except httpx.HTTPError as e:
            raise proto.transport_error(e, self.base_url) from e
        return call.result(resp.status_code, resp.content, resp.headers)

    async def _stream(self, call: proto.Call) -> AsyncIterator[Event]:
        try:
            async with self._http.stream(**call.request_kwargs()) as resp:
                events = ComposeStream(resp.status_code, resp.headers)
                async for chunk in resp.aiter_text():
                    for event in events.feed(chunk):
                        yield event
                    if events.finished:
                        break
                for event in events.close():
                    yield event
        except httpx.HTTPError as e:
            raise proto.transport_error(e, self.base_url) from e

    # ---- skills ---------------------------------------------------------------------------
    async def add_skill(
        self, name: str, text: str, description: str | None = None, fields: Mapping[str, str] | None = None
    ) -> dict[str, Any]:
        return await self._call(proto.add_skill(name, text, description, fields))

    async def list_skills(self) -> list[dict[str, Any]]:
        return await self._call(proto.list_skills())

    async def get_skill(self, name: str, version: int | None = None) -> dict[str, Any]:
        return await self._call(proto.get_skill(name, version))

    async def delete_skill(self, name: str) -> dict[str, Any]:
        return await self._call(proto.delete_skill(name))

    # ---- compose --------------------------------------------------------------------------
    async def compose(
        self, skills: SkillRef | Iterable[SkillRef], user: str, *, system: str | None = None,
        fields: Mapping[str, str] | None = None, max_tokens: int | None = None,
        temperature: float | None = None, top_p: float | None = None, seed: int | None = None,
        stop: str | list[str] | None = None, mode: str | None = None, seam_tokens: int | None = None,
        logprobs: int | None = None, edit_mode: str | None = None,
    ) -> dict[str, Any]:
        return await self._call(proto.compose(
            skills, user, stream=False, system=system, fields=fields, max_tokens=max_tokens,
            temperature=temperature, top_p=top_p, seed=seed, stop=stop, mode=mode,
            seam_tokens=seam_tokens, logprobs=logprobs, edit_mode=edit_mode,
        ))

    def compose_stream(
        self, skills: SkillRef | Iterable[SkillRef], user: str, *, system: str | None = None,
        fields: Mapping[str, str] | None = None, max_tokens: int | None = None,
        temperature: float | None = None, top_p: float | None = None, seed: int | None = None,
        stop: str | list[str] | None = None, mode: str | None = None, seam_tokens: int | None = None,
        logprobs: int | None = None, edit_mode: str | None = None,
    ) -> AsyncIterator[Event]:
        """An async iterator of events (not a coroutine): `async for event in client.compose_stream(...)`."""
        return self._stream(proto.compose(
            skills, user, stream=True, system=system, fields=fields, max_tokens=max_tokens,
            temperature=temperature, top_p=top_p, seed=seed, stop=stop, mode=mode,
            seam_tokens=seam_tokens, logprobs=logprobs, edit_mode=edit_mode,
        ))

    # ---- health ---------------------------------------------------------------------------
    async def health(self) -> dict[str, Any]:
        return await self._call(proto.health())

    async def live(self) -> bool:
        try:
            return bool(await self._call(proto.live()))
        except SkillcacheError:
            return False
