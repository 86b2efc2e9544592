"""SkillRegistry: durable skill definitions, versions, and the block keys they compile to."""

from __future__ import annotations

import asyncio
import builtins
from collections.abc import Callable

from service.errors import LimitExceeded, SkillNotFound
from service.kv.layout import LAYOUT_VERSION
from service.registry.skill import SkillRecord, check_fields, check_skill_name, content_hash, render, text_hash
from service.store.definitions import DefinitionStore
from service.store.key import BlockKey


class SkillRegistry:
    def __init__(
        self,
        definitions: DefinitionStore,
        count_tokens: Callable[[str], int],
        model_fingerprint: str,
        max_skill_tokens: int,
        context_tokens: int | None = None,
    ) -> None:
        self.definitions = definitions
        self.count_tokens = count_tokens
        self.model_fingerprint = model_fingerprint
        self.max_skill_tokens = max_skill_tokens
        self.context_tokens = context_tokens  # the model's context: a longer skill could never be composed
        self._lock = asyncio.Lock()  # versions are assigned one registration at a time per process

    async def register(
        self, namespace: str, name: str, text: str, description: str | None = None,
        fields: dict[str, str] | None = None,
    ) -> tuple[SkillRecord, bool]:
        """Store a definition. Returns (record, created); the same text and fields keep their version."""
        check_skill_name(name)
        fields = dict(fields or {})
        check_fields(text, fields)
        n_tokens = self.count_tokens(render(text, fields))
        if n_tokens == 0:
            raise LimitExceeded("a skill's text must contain at least one token")
        if n_tokens > self.max_skill_tokens:
            raise LimitExceeded(
                f"skill {name!r} is {n_tokens} tokens; the limit is {self.max_skill_tokens} "
                "(SKILLCACHE_MAX_SKILL_TOKENS): split it into smaller skills"
            )
        if self.context_tokens and n_tokens >= self.context_tokens:
            raise LimitExceeded(
                f"skill {name!r} is {n_tokens} tokens; the model's context is {self.context_tokens} tokens, which "
                "must also hold the prompt around it and the answer: split it into smaller skills"
            )
        digest = content_hash(text, fields)
        async with self._lock:
            latest = await self.definitions.get(namespace, name)
            if latest is not None and latest["content_hash"] == digest:
                return SkillRecord.from_doc(latest), False
            for v in reversed(await self.definitions.versions(namespace, name)):
                doc = await self.definitions.get(namespace, name, v)
                if doc is not None and doc["content_hash"] == digest:
                    return SkillRecord.from_doc(doc), False
            version = (latest["version"] + 1) if latest else 1
            rec = SkillRecord(namespace, name, version, text, digest, n_tokens, description, fields)
            await self.definitions.put(namespace, name, version, rec.to_doc())
            return rec, True

    async def get(self, namespace: str, name: str, version: int | None = None) -> SkillRecord:
        check_skill_name(name)
        doc = await self.definitions.get(namespace, name, version)
        if doc is None:
            which = f"version {version} of skill" if version is not None else "skill"
            raise SkillNotFound(f"{which} {name!r} is not registered; POST it to /v1/skills first")
        return SkillRecord.from_doc(doc)

    async def list(self, namespace: str) -> "builtins.list[SkillRecord]":
        docs = await self.definitions.list(namespace)
        return sorted((SkillRecord.from_doc(d) for d in docs), key=lambda r: r.name)

    async def versions(self, namespace: str, name: str) -> "builtins.list[int]":
        return await self.definitions.versions(namespace, name)

    async def delete(self, namespace: str, name: str) -> "builtins.list[SkillRecord]":
        check_skill_name(name)
        docs = await self.definitions.delete(namespace, name)
        if not docs:
            raise SkillNotFound(f"skill {name!r} is not registered")
        return [SkillRecord.from_doc(d) for d in docs]

    def block_key(self, namespace: str, text: str) -> BlockKey:
        """The key of the block compiled from exactly `text` on this model."""
        return BlockKey(self.model_fingerprint, LAYOUT_VERSION, namespace, text_hash(text))
