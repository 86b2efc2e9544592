"""VllmClient: skillcache's side of a vLLM server, over its OpenAI-compatible HTTP API (no torch, no vllm).

A request goes to /v1/completions as token ids (`prompt: [int]`), streamed, with `cache_salt` and, for a composed
head, `kv_transfer_params` naming what the connector loads and saves (service/vllm/transfer.py). Chunks come back
as text deltas with their token ids (`return_token_ids`); the last carries usage, whose
`prompt_tokens_details.cached_tokens` (vLLM started with --enable-prompt-tokens-details) counts the prompt tokens
vLLM did not compute: its own prefix cache hits plus the tokens the connector loaded.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx

from service import metrics
from service.vllm import compat
from service.errors import EngineUnavailable, InvalidRequest
from service.vllm.transfer import Transfer

log = logging.getLogger(__name__)

SOURCES = ("external_kv_transfer", "local_cache_hit", "local_compute")
_BY_SOURCE = re.compile(r'^vllm:prompt_tokens_by_source_total\{[^}]*source="(\w+)"[^}]*\} ([0-9.e+]+)$', re.M)


def prompt_tokens_by_source(metrics_text: str) -> dict[str, float]:
    """Who produced vLLM's prompt tokens, from its /metrics text: `external_kv_transfer` (the connector loaded them),
    `local_cache_hit` (vLLM's prefix cache), `local_compute`; summed over the other labels, 0.0 where absent."""
    out = dict.fromkeys(SOURCES, 0.0)
    for m in _BY_SOURCE.finditer(metrics_text):
        out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


@dataclass
class Chunk:
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    top_logprobs: list[tuple[str, float]] | None = None  # the first generated position's, when asked


@dataclass
class Usage:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    raw: dict = field(default_factory=dict)


class VllmClient:
    def __init__(self, base_url: str, model: str | None = None, timeout_s: float = 300.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.http = httpx.AsyncClient(base_url=self.base_url, timeout=httpx.Timeout(timeout_s, connect=5.0))
        self.version: str | None = None  # vLLM's release, once it has answered /health

    async def served_model(self) -> str:
        if self.model is None:
            r = await self._get("/v1/models")
            self.model = r.json()["data"][0]["id"]
        return self.model

    async def _get(self, path: str) -> httpx.Response:
        try:
            r = await self.http.get(path, timeout=5.0)
            r.raise_for_status()
            return r
        except httpx.HTTPError as e:
            raise EngineUnavailable(f"vLLM at {self.base_url} is not answering ({type(e).__name__}: {e}); "
                                    "check SKILLCACHE_VLLM_URL and that the server is up") from e

    async def health(self) -> bool:
        try:
            await self._get("/health")
        except EngineUnavailable:
            return False
        if self.version is None:
            await self._check_version()
        return True

    async def _check_version(self) -> None:
        """vLLM's release, read once when it first answers: one line in the log when it is not a tested one."""
        try:
            self.version = str((await self._get("/version")).json().get("version", ""))
        except (EngineUnavailable, ValueError, AttributeError):
            self.version = ""  # a server without /version: not asked again
        line = compat.outside(self.version)
        if line:
            log.warning("%s: %s", self.base_url, line)

    async def metrics(self) -> str:
        return (await self._get("/metrics")).text

    async def stream(self, ids: list[int], gen, cache_salt: str | None, transfer: dict | None,
                     usage: Usage) -> AsyncIterator[Chunk]:
        """Generate after `ids`; yields chunks, fills `usage` at the end. Raises EngineUnavailable when vLLM cannot be
        reached or the stream breaks off, InvalidRequest when vLLM refuses the request (400)."""
        body = {"model": await self.served_model(), "prompt": ids, "max_tokens": gen.max_tokens,
                "temperature": gen.temperature, "top_p": gen.top_p, "stream": True, "return_token_ids": True,
                "stream_options": {"include_usage": True}, "skip_special_tokens": True}
        if gen.seed is not None:
            body["seed"] = gen.seed
        if gen.top_k:
            body["top_k"] = gen.top_k
        if gen.json_schema is not None:  # vLLM's structured outputs: the reply is JSON valid under the schema
            body["structured_outputs"] = {"json": json.loads(gen.json_schema), "disable_any_whitespace": True}
        if gen.stop:
            body["stop"] = list(gen.stop)
        if gen.logprobs:
            body["logprobs"] = gen.logprobs
        if gen.ignore_eos and gen.json_schema is None:  # a typed reply ends where its JSON does, as embedded
            body["ignore_eos"] = True
        if cache_salt:
            body["cache_salt"] = cache_salt
        if transfer:
            body["kv_transfer_params"] = transfer
        first = True
        try:
            async with self.http.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code == 400:
                    raise InvalidRequest(f"vLLM refused the request: {(await r.aread()).decode()[:500]}")
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        return
                    obj = json.loads(data)
                    if obj.get("usage"):
                        u = obj["usage"]
                        usage.raw = u
                        usage.prompt_tokens = u.get("prompt_tokens", 0)
                        usage.completion_tokens = u.get("completion_tokens", 0)
                        usage.cached_tokens = (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                    for ch in obj.get("choices") or []:
                        top = None
                        lp = ch.get("logprobs")
                        if first and lp and lp.get("top_logprobs"):
                            top = sorted(lp["top_logprobs"][0].items(), key=lambda kv: -kv[1])
                        first = False
                        yield Chunk(ch.get("text") or "", list(ch.get("token_ids") or []), ch.get("finish_reason"), top)
            raise EngineUnavailable("vLLM's stream ended without [DONE]")
        except httpx.HTTPError as e:
            raise EngineUnavailable(f"vLLM at {self.base_url} failed mid-request ({type(e).__name__}: {e})") from e

    async def prefill(self, ids: list[int], cache_salt: str, transfer: "Transfer | None" = None, priority: int = 0
                      ) -> None:
        """Have vLLM compute `ids` (one token generated): its prefix cache then holds their K/V under `cache_salt`, and
        the connector loads and saves what `transfer` names (service/vllm/transfer.py). `priority`: vLLM's (lower
        runs first; background work goes behind live requests)."""
        body = {"model": await self.served_model(), "prompt": ids, "max_tokens": 1, "temperature": 0.0,
                "cache_salt": cache_salt}
        if transfer is not None:
            body["kv_transfer_params"] = {"skillcache": transfer.to_dict()}
        if priority:
            body["priority"] = priority
        try:
            r = await self.http.post("/v1/completions", json=body)
            if r.status_code == 400:
                raise InvalidRequest(f"vLLM refused a prefill: {r.text[:500]}")
            r.raise_for_status()
        except httpx.HTTPError as e:
            raise EngineUnavailable(f"vLLM at {self.base_url} failed a prefill ({type(e).__name__}: {e})") from e

    async def choose(self, ids: list[int], choices: list[str], cache_salt: str, transfer: dict | None,
                     max_tokens: int) -> str:
        """Which of `choices` vLLM continues `ids` with, decoding greedily under its structured output `choice`."""
        body = {"model": await self.served_model(), "prompt": ids, "max_tokens": max_tokens, "temperature": 0.0,
                "cache_salt": cache_salt, "structured_outputs": {"choice": choices}}
        if transfer:
            body["kv_transfer_params"] = transfer
        try:
            r = await self.http.post("/v1/completions", json=body)
            if r.status_code == 400:
                raise InvalidRequest(f"vLLM refused the request: {r.text[:500]}")
            r.raise_for_status()
        except httpx.HTTPError as e:
            raise EngineUnavailable(f"vLLM at {self.base_url} failed a choice ({type(e).__name__}: {e})") from e
        return r.json()["choices"][0]["text"]

    async def close(self) -> None:
        await self.http.aclose()


class VllmPool:
    """The vLLM replicas behind one skillcache (SKILLCACHE_VLLM_URL, comma-separated). A composition goes to the
    replica that should hold its steps and head in its prefix cache: the first, in the rendezvous-hash order of its
    routing key (highest sha256(url, key) first), that is not marked down. Each skillcache replica computes the same
    order from the same URLs; adding or removing a replica moves only the keys that ranked it first. A replica that
    fails a request (connect error, a broken or refused call: EngineUnavailable) is marked down for DOWN_S and goes to
    the end of every order; a /health answer (readiness polls it) or a request it serves clears the mark."""

    DOWN_S = 10.0

    def __init__(self, clients: list) -> None:
        if not clients:
            raise ValueError("no vLLM URL (SKILLCACHE_VLLM_URL)")
        self.clients = list(clients)
        self._down: dict[str, float] = {}  # replica -> monotonic time its down mark ends

    @classmethod
    def from_urls(cls, urls: list[str], model: str | None = None, timeout_s: float = 300.0) -> "VllmPool":
        return cls([VllmClient(u, model, timeout_s) for u in urls])

    @staticmethod
    def name(client) -> str:
        return str(getattr(client, "base_url", "vllm"))

    @staticmethod
    def score(url: str, key: str) -> bytes:
        return hashlib.sha256(f"{url}\n{key}".encode()).digest()

    def down(self, client) -> bool:
        until = self._down.get(self.name(client))
        return until is not None and time.monotonic() < until

    def order(self, key: str) -> list:
        """Every replica, in the key's rendezvous order; those marked down last (still tried when all are)."""
        ranked = sorted(self.clients, key=lambda c: self.score(self.name(c), key), reverse=True)
        return [c for c in ranked if not self.down(c)] + [c for c in ranked if self.down(c)]

    def failed(self, client) -> None:
        self._down[self.name(client)] = time.monotonic() + self.DOWN_S
        metrics.VLLM_REPLICA_UP.labels(self.name(client)).set(0)

    def ok(self, client) -> None:
        if self._down.pop(self.name(client), None) is not None:
            metrics.VLLM_REPLICA_UP.labels(self.name(client)).set(1)

    async def health(self) -> bool:
        """True while any replica answers /health; each answer sets or clears that replica's down mark."""
        answers = await asyncio.gather(*(c.health() for c in self.clients))
        for c, up in zip(self.clients, answers):
            if up:
                self.ok(c)
            elif not self.down(c):
                self.failed(c)
            metrics.VLLM_REPLICA_UP.labels(self.name(c)).set(1 if up else 0)
        return any(answers)

    async def close(self) -> None:
        for c in self.clients:
            await c.close()
