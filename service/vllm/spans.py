"""Saved spans: K/V that vLLM computed for some tokens of some prompt, kept to be copied into later prompts.

A span record is what the connector's save path took out of vLLM's cache for tokens [pos, pos + T) of a request: a
block compiled in its canonical context (`blk-...`: the chat template's opening and the skill, positions from 0), or
the tokens one step of a composition computed (`step-...`: seams and the text between blocks). Its keys carry RoPE
at the positions they were computed at; a load moves them (service/vllm/connector.py).

A rank's files are bounded (max_bytes, the connector's `max_bytes`: 1 GiB by default): the least recently saved or
loaded record goes first (a skill order's steps not seen for long, an old block), and reads as missing after.
One file per record and tensor-parallel rank, safetensors, in the connector's spans dir (a tmpfs by default):
    <dir>/<model key>/<name>.tp<size>r<rank>.safetensors
    k, v    [L, T, H_kv / tp, D] in vLLM's cache dtype (this rank's heads)
    metadata: pos (first position), ids (json), crc (CRC32 of k then v)
Written to a temporary name and renamed: a reader sees a whole record or none. A record whose CRC fails is removed
and reads as missing (vLLM computes its tokens). Only this module reads or writes the files (the `store` rule, for
files the connector shares across processes and ranks). The model key (hash of vLLM's model, dtype and layout) keeps
records of another model or layout apart.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import zlib
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,160}$")


class SpanError(Exception):
    """A record that is missing, unreadable or fails its check: treat as a miss (vLLM computes)."""


@dataclass(frozen=True)
class Span:
    """One record's tensors for one rank: keys/values [L, T, H, D] at positions [pos, pos + T)."""

    pos: int
    ids: list[int]
    k: torch.Tensor
    v: torch.Tensor

    @property
    def end(self) -> int:
        return self.pos + len(self.ids)

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


def model_key(model: str, dtype: str, n_layers: int, n_kv_heads: int, head_dim: int) -> str:
    raw = json.dumps([model, dtype, n_layers, n_kv_heads, head_dim]).encode()
    return hashlib.sha256(raw).hexdigest()[:16]


def check_name(name: str) -> str:
    if not isinstance(name, str) or not NAME.fullmatch(name) or name.startswith("."):
        raise SpanError(f"bad span name {name!r}")
    return name


def _crc(k: torch.Tensor, v: torch.Tensor) -> int:
    crc = zlib.crc32(k.contiguous().view(torch.uint8).numpy())
    return zlib.crc32(v.contiguous().view(torch.uint8).numpy(), crc)


class SpanStore:
    """The records of one model key, for one tensor-parallel rank, with a bounded in-memory LRU of loaded ones."""

    def __init__(self, root: Path, key: str, tp_rank: int = 0, tp_size: int = 1, cache_bytes: int = 512 * 1024**2,
                 max_bytes: int | None = None) -> None:
        self.dir = Path(root) / key
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.cache_bytes = cache_bytes
        self._cache: OrderedDict[str, Span] = OrderedDict()
        self._held = 0
        self.max_bytes = max_bytes  # this rank's files on disk (None: unbounded); least recently used out first
        self._files: OrderedDict[str, int] | None = None  # name -> file bytes, least recently used first

    def _disk(self) -> OrderedDict[str, int]:
        """This rank's records on disk, oldest first (read once from the directory: a restarted vLLM finds them)."""
        if self._files is None:
            suffix = f".tp{self.tp_size}r{self.tp_rank}.safetensors"
            found = []
            for p in self.dir.glob(f"*{suffix}") if self.dir.is_dir() else []:
                try:
                    st = p.stat()
                except OSError:
                    continue
                found.append((st.st_mtime, p.name[:-len(suffix)], st.st_size))
            self._files = OrderedDict((name, size) for _, name, size in sorted(found))
        return self._files

    def _used(self, name: str, size: int | None = None) -> None:
        """Mark a record as just saved (size) or loaded; evict the least recently used past max_bytes."""
        files = self._disk()
        if size is None:
            if name in files:
                files.move_to_end(name)
            return
        files.pop(name, None)
        files[name] = size
        total = sum(files.values())
        while self.max_bytes is not None and total > self.max_bytes and len(files) > 1:
            old, n = files.popitem(last=False)
            total -= n
            self._drop(old)
            self.path(old).unlink(missing_ok=True)  # a later request that names it finds it missing: vLLM computes

    def path(self, name: str, rank: int | None = None) -> Path:
        r = self.tp_rank if rank is None else rank
        return self.dir / f"{check_name(name)}.tp{self.tp_size}r{r}.safetensors"

    def exists(self, name: str) -> bool:
        """Every rank's file is there (the scheduler side asks before it promises tokens)."""
        try:
            return all(self.path(name, r).is_file() for r in range(self.tp_size))
        except SpanError:
            return False

    def header(self, name: str) -> tuple[int, list[int]]:
        """(pos, ids) of a record, from rank 0's file alone (no tensor read)."""
        try:
            with safe_open(str(self.path(name, 0)), framework="pt") as f:
                meta = f.metadata() or {}
            return int(meta["pos"]), [int(t) for t in json.loads(meta["ids"])]
        except (OSError, KeyError, ValueError, TypeError, SafetensorError) as e:
            raise SpanError(f"span {name!r}: {e}") from e

    def save(self, name: str, pos: int, ids: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [L, T, H, D] of this rank."""
        path = self.path(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        k, v = k.contiguous(), v.contiguous()
        meta = {"pos": str(pos), "ids": json.dumps(list(ids)), "crc": str(_crc(k, v))}
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        save_file({"k": k, "v": v}, str(tmp), metadata=meta)
        os.replace(tmp, path)
        self._drop(name)
        self._used(name, path.stat().st_size)

    def load(self, name: str) -> Span:
        span = self._cache.get(name)
        self._used(name)
        if span is not None:
            self._cache.move_to_end(name)
            return span
        path = self.path(name)
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                k, v = f.get_tensor("k"), f.get_tensor("v")
            span = Span(int(meta["pos"]), [int(t) for t in json.loads(meta["ids"])], k, v)
        except (OSError, KeyError, ValueError, TypeError, RuntimeError, SafetensorError) as e:
            raise SpanError(f"span {name!r} unreadable: {e}") from e
        if str(_crc(k, v)) != meta.get("crc") or k.shape[1] != len(span.ids) or k.shape != v.shape:
            path.unlink(missing_ok=True)  # gone: the scheduler side now finds it missing, and its owner saves it anew
            raise SpanError(f"span {name!r} fails its check (corrupt or cut); removed")
        self._cache[name] = span
        self._held += span.nbytes
        while self._held > self.cache_bytes and len(self._cache) > 1:
            self._held -= self._cache.popitem(last=False)[1].nbytes
        return span

    def _drop(self, name: str) -> None:
        old = self._cache.pop(name, None)
        if old is not None:
            self._held -= old.nbytes
