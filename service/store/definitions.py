"""Durable skill definitions (small JSON docs), versioned per (namespace, name)."""

from __future__ import annotations

import builtins

import abc
import asyncio
import copy
import json
import logging
import os
import re
import secrets
import shutil
from pathlib import Path
from typing import Any

from service.metrics import STORE_CORRUPT
from service.store.errors import StoreUnavailable
from service.store.fsutil import atomic_write, fsync_dir, write_error
from service.store.key import check_name

log = logging.getLogger(__name__)

_VERSION_FILE = re.compile(r"^(0|[1-9][0-9]*)\.json$")  # temp files (".3.json.<rand>.tmp") never match


def check_version(version: int) -> int:
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise ValueError(f"invalid version {version!r}: must be an int >= 0")
    return version


def dump_doc(doc: dict[str, Any]) -> str:
    if not isinstance(doc, dict):
        raise ValueError("a definition must be a JSON object (dict)")
    try:
        return json.dumps(doc, ensure_ascii=False, sort_keys=True)
    except (TypeError, ValueError) as e:
        raise ValueError(f"definition is not JSON-serializable: {e}") from None


class DefinitionStore(abc.ABC):
    """Skill definitions are the user's data: unlike blocks they are never evicted."""

    name: str = "abstract"

    @abc.abstractmethod
    async def put(self, namespace: str, name: str, version: int, doc: dict[str, Any]) -> None:
        """Store `doc` as `version` of the skill (replacing that version if present)."""

    @abc.abstractmethod
    async def get(self, namespace: str, name: str, version: int | None = None) -> dict[str, Any] | None:
        """That version, or the latest one when `version` is None; None if absent."""

    @abc.abstractmethod
    async def list(self, namespace: str) -> list[dict[str, Any]]:
        """The latest version of every skill in the namespace, sorted by name."""

    @abc.abstractmethod
    async def versions(self, namespace: str, name: str) -> "builtins.list[int]":
        """The stored versions, ascending."""

    @abc.abstractmethod
    async def delete(self, namespace: str, name: str) -> "builtins.list[dict[str, Any]]":
        """Remove every version; returns the removed docs (ascending version) so blocks can be deleted."""

    @abc.abstractmethod
    async def namespaces(self) -> "builtins.list[str]":
        """Every namespace that holds at least one doc, sorted (a few may be empty after deletes)."""

    async def ping(self) -> bool:
        return True

    async def close(self) -> None:
        """Release resources."""


class MemoryDefinitionStore(DefinitionStore):
    """Process-local, for tests and `store=memory`. Docs are copied in and out."""

    name = "memory"

    def __init__(self) -> None:
        self._docs: dict[tuple[str, str], dict[int, dict[str, Any]]] = {}

    async def put(self, namespace: str, name: str, version: int, doc: dict[str, Any]) -> None:
        check_name(namespace, "namespace"), check_name(name, "name"), check_version(version)
        self._docs.setdefault((namespace, name), {})[version] = json.loads(dump_doc(doc))

    async def get(self, namespace: str, name: str, version: int | None = None) -> dict[str, Any] | None:
        check_name(namespace, "namespace"), check_name(name, "name")
        docs = self._docs.get((namespace, name)) or {}
        v = max(docs, default=None) if version is None else check_version(version)
        return copy.deepcopy(docs.get(v)) if v is not None else None

    async def list(self, namespace: str) -> list[dict[str, Any]]:
        check_name(namespace, "namespace")
        return [copy.deepcopy(d[max(d)]) for (ns, _), d in sorted(self._docs.items()) if ns == namespace and d]

    async def versions(self, namespace: str, name: str) -> "builtins.list[int]":
        check_name(namespace, "namespace"), check_name(name, "name")
        return sorted(self._docs.get((namespace, name)) or {})

    async def delete(self, namespace: str, name: str) -> "builtins.list[dict[str, Any]]":
        check_name(namespace, "namespace"), check_name(name, "name")
        docs = self._docs.pop((namespace, name), {})
        return [docs[v] for v in sorted(docs)]

    async def namespaces(self) -> "builtins.list[str]":
        return sorted({ns for (ns, _), d in self._docs.items() if d})


class DiskDefinitionStore(DefinitionStore):
    """`<root>/<namespace>/<name>/<version>.json`, each written atomically (temp + fsync + rename + dir fsync).

    Deleting renames the skill's directory to a hidden name first (atomic), then removes it; hidden
    entries and temp files are ignored by reads, so a crash at any point leaves a consistent view.
    """

    name = "disk"

    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)

    def _dir(self, namespace: str, name: str) -> Path:
        return self.root / check_name(namespace, "namespace") / check_name(name, "name")

    def _versions(self, d: Path) -> list[int]:
        try:
            return sorted(int(m.group(1)) for f in os.listdir(d) if (m := _VERSION_FILE.match(f)))
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as e:
            raise StoreUnavailable(f"definition store at {self.root}: cannot list {d}: {e}") from e

    def _read(self, d: Path, version: int) -> dict[str, Any] | None:
        path = d / f"{version}.json"
        try:
            doc = json.loads(path.read_bytes())
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:
            raise StoreUnavailable(f"definition store at {self.root}: cannot read {path}: {e}") from e
        except ValueError as e:  # cannot come from our own writes (they are atomic): disk damage or a hand edit
            STORE_CORRUPT.labels(tier="definitions", reason="format").inc()
            log.error("definition %s is not valid JSON, ignoring it: %s", path, e)
            return None
        return doc if isinstance(doc, dict) else None

    def _latest(self, d: Path) -> dict[str, Any] | None:
        for v in reversed(self._versions(d)):
            doc = self._read(d, v)
            if doc is not None:
                return doc
        return None

    def _put(self, namespace: str, name: str, version: int, doc: dict[str, Any]) -> None:
        data = dump_doc(doc).encode()
        try:
            atomic_write(self._dir(namespace, name) / f"{check_version(version)}.json", data)
        except OSError as e:
            raise write_error(e, self.root, "definition store") from e

    def _list(self, namespace: str) -> list[dict[str, Any]]:
        ns_dir = self.root / check_name(namespace, "namespace")
        try:
            names = sorted(n for n in os.listdir(ns_dir) if not n.startswith("."))
        except (FileNotFoundError, NotADirectoryError):
            return []
        return [doc for n in names if (doc := self._latest(ns_dir / n)) is not None]

    def _delete(self, namespace: str, name: str) -> list[dict[str, Any]]:
        d = self._dir(namespace, name)
        docs = [doc for v in self._versions(d) if (doc := self._read(d, v)) is not None]
        if not d.exists():
            return docs
        grave = d.parent / f".{name}.deleted.{secrets.token_hex(6)}"
        try:
            os.rename(d, grave)  # the atomic step: from here on the skill is gone
            fsync_dir(d.parent)
        except OSError as e:
            raise write_error(e, self.root, "definition store") from e
        shutil.rmtree(grave, ignore_errors=True)  # a crash here leaves a hidden dir that reads ignore
        return docs

    def _namespaces(self) -> list[str]:
        try:
            return sorted(e.name for e in os.scandir(self.root) if e.is_dir() and not e.name.startswith("."))
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as e:
            raise StoreUnavailable(f"definition store at {self.root}: cannot list it: {e}") from e

    async def put(self, namespace: str, name: str, version: int, doc: dict[str, Any]) -> None:
        await asyncio.to_thread(self._put, namespace, name, version, doc)

    async def get(self, namespace: str, name: str, version: int | None = None) -> dict[str, Any] | None:
        d = self._dir(namespace, name)
        if version is None:
            return await asyncio.to_thread(self._latest, d)
        return await asyncio.to_thread(self._read, d, check_version(version))

    async def list(self, namespace: str) -> list[dict[str, Any]]:
        return await asyncio.to_thread(self._list, namespace)

    async def versions(self, namespace: str, name: str) -> "builtins.list[int]":
        return await asyncio.to_thread(self._versions, self._dir(namespace, name))

    async def delete(self, namespace: str, name: str) -> "builtins.list[dict[str, Any]]":
        return await asyncio.to_thread(self._delete, namespace, name)

    async def namespaces(self) -> "builtins.list[str]":
        return await asyncio.to_thread(self._namespaces)

    async def ping(self) -> bool:
        """The root, or its nearest existing ancestor on a fresh home (the first write creates the rest), is a
        writable directory."""
        d = self.root
        while not d.exists() and d.parent != d:
            d = d.parent
        return d.is_dir() and os.access(d, os.R_OK | os.W_OK | os.X_OK)
