"""The head pool: composed K/V heads that skillcache publishes and the connector inside vLLM reads.

One file (`SKILLCACHE_VLLM_HEADS_DIR`/pool-<writer>.bin, on a tmpfs such as /dev/shm or an emptyDir) mapped by both
processes. The writer (skillcache) allocates records in it as a ring; the reader (service/vllm/connector.py) maps it
read-only. A fresh page costs ~4 ms a MB to fault in on this project's VMs (a 110 MB head: 0.4 s), so the pool is
allocated once and rewritten in place (27 ms for the same head).

A record at `offset`:
    header  HEADER_BYTES of JSON, zero-padded: magic, gen, fingerprint, n_tokens, layout, dtype, ids_crc, chunk crcs
    ids     int32 [N]
    keys    [L, N, H_kv, D]   post-RoPE, as vLLM's own attention writes them (one [N, H_kv, D] slab per layer)
    values  [L, N, H_kv, D]
A reference ({"pool", "offset", "gen", "n_tokens"}) travels with the request to vLLM (kv_transfer_params). The reader
believes a record only when the header's gen, fingerprint, layout and ids match the reference and the request, and
the CRC32 of every CHUNK_TOKENS-token chunk it loads matches; anything else reads as no record (vLLM computes).
The writer never reuses the space of a record still in flight (published, first token not yet back).

Only this module reads or writes the pool (the `store` rule, for a file the connector shares across processes).
"""

from __future__ import annotations

import json
import mmap
import os
import threading
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

MAGIC = "skillcache-head/1"
HEADER_BYTES = 16384
CHUNK_TOKENS = 128  # one CRC per chunk of tokens (over every layer's keys then values): a load checks what it reads
ALIGN = 4096
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class HeadError(Exception):
    """A record that does not check out: treat as a miss."""


@dataclass(frozen=True)
class Layout:
    n_layers: int
    n_kv_heads: int
    head_dim: int
    dtype: str  # a key of DTYPES

    @property
    def bytes_per_token(self) -> int:  # keys and values, every layer
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * DTYPES[self.dtype].itemsize


@dataclass(frozen=True)
class HeadRef:
    pool: str  # the pool file's name in the heads dir
    offset: int
    gen: int
    n_tokens: int

    def to_dict(self) -> dict:
        return {"pool": self.pool, "offset": self.offset, "gen": self.gen, "n_tokens": self.n_tokens}

    @classmethod
    def from_dict(cls, d: dict) -> "HeadRef":
        try:
            return cls(str(d["pool"]), int(d["offset"]), int(d["gen"]), int(d["n_tokens"]))
        except (KeyError, TypeError, ValueError) as e:
            raise HeadError(f"bad head reference {d!r}") from e


def _ids_crc(ids) -> int:
    return zlib.crc32(torch.as_tensor(ids, dtype=torch.int32).numpy().tobytes())


def _sizes(layout: Layout, n: int) -> tuple[int, int]:
    """(ids bytes padded, one of keys/values in bytes)."""
    ids = -(-4 * n // 64) * 64
    return ids, layout.n_layers * n * layout.n_kv_heads * layout.head_dim * DTYPES[layout.dtype].itemsize


def record_bytes(layout: Layout, n: int) -> int:
    ids, kv = _sizes(layout, n)
    return -(-(HEADER_BYTES + ids + 2 * kv) // ALIGN) * ALIGN


class _Mapped:
    """A record's tensors over the mapped file: ids [N], keys/values [L, N, H_kv, D] (views, no copy)."""

    def __init__(self, buf, offset: int, layout: Layout, n: int) -> None:
        ids_b, kv_b = _sizes(layout, n)
        shape = (layout.n_layers, n, layout.n_kv_heads, layout.head_dim)
        dt = DTYPES[layout.dtype]
        base = offset + HEADER_BYTES
        warnings.filterwarnings("ignore", "The given buffer is not writable")  # the reader's map is read-only: so be it
        self.ids = torch.frombuffer(buf, dtype=torch.int32, count=n, offset=base)
        self.keys = torch.frombuffer(buf, dtype=dt, count=kv_b // dt.itemsize, offset=base + ids_b).view(shape)
        self.values = torch.frombuffer(buf, dtype=dt, count=kv_b // dt.itemsize, offset=base + ids_b + kv_b).view(shape)

    def chunk_crc(self, c: int) -> int:
        lo, crc = c * CHUNK_TOKENS, 0
        hi = min(lo + CHUNK_TOKENS, self.ids.numel())
        for t in (self.keys, self.values):
            for layer in range(t.shape[0]):
                crc = zlib.crc32(t[layer, lo:hi].contiguous().view(torch.uint8).numpy(), crc)
        return crc


class HeadWriter:
    """skillcache's side: one pool file, records allocated as a ring, a digest index for reuse."""

    def __init__(self, heads_dir: Path, size_bytes: int, fingerprint: str, layout: Layout, name: str | None = None
                 ) -> None:
        heads_dir.mkdir(parents=True, exist_ok=True)
        self.name = name or f"pool-{os.uname().nodename}-{os.getpid()}.bin"
        self.path = heads_dir / self.name
        self.size = size_bytes
        self.fingerprint, self.layout = fingerprint, layout
        with open(self.path, "wb") as f:  # written through once: its pages are faulted in now, not per request
            chunk = bytes(1 << 20)
            for _ in range(-(-size_bytes // len(chunk))):
                f.write(chunk)
        self._file = open(self.path, "r+b")
        self.buf = mmap.mmap(self._file.fileno(), size_bytes)
        self._lock = threading.Lock()
        self._cursor = 0
        self._gen = int.from_bytes(os.urandom(6), "little")  # a restarted writer never repeats a live gen
        self._records: dict[int, tuple[int, int, str | None]] = {}  # offset -> (size, gen, digest), in the ring
        self._index: dict[str, HeadRef] = {}  # digest -> its record, while not overwritten
        self._in_flight: dict[int, int] = {}  # offset -> requests that may still load it

    def lookup(self, digest: str) -> HeadRef | None:
        with self._lock:
            return self._index.get(digest)

    def acquire(self, ref: HeadRef) -> bool:
        """Hold a record until release(): its space is not reused. False when it is already gone."""
        with self._lock:
            rec = self._records.get(ref.offset)
            if rec is None or rec[1] != ref.gen:
                return False
            self._in_flight[ref.offset] = self._in_flight.get(ref.offset, 0) + 1
            return True

    def release(self, ref: HeadRef) -> None:
        with self._lock:
            n = self._in_flight.get(ref.offset, 0) - 1
            if n > 0:
                self._in_flight[ref.offset] = n
            else:
                self._in_flight.pop(ref.offset, None)

    def _allocate(self, size: int) -> int | None:
        """Space for `size` bytes at the ring's cursor (wrapping once), evicting the records it covers; None when a
        record in flight is in the way or the pool is too small."""
        for start in (self._cursor, 0):
            if start + size > self.size:
                continue
            hit = [o for o, (s, _, _) in self._records.items() if o < start + size and start < o + s]
            if any(o in self._in_flight for o in hit):
                continue
            for o in hit:
                _, _, digest = self._records.pop(o)
                if digest is not None:
                    self._index.pop(digest, None)
            self._cursor = start + size
            return start
        return None

    def publish(self, ids: list[int], keys: list[torch.Tensor], values: list[torch.Tensor], digest: str | None = None
                ) -> HeadRef | None:
        """Write one head (keys/values: per layer [1, H_kv, >=N, D], the first N tokens taken) and hold it in
        flight (release() when its request has its first token). None: no room now (send the request without it)."""
        n, lay = len(ids), self.layout
        size = record_bytes(lay, n)
        with self._lock:
            offset = self._allocate(size)
            if offset is None:
                return None
            self._gen += 1
            gen = self._gen
            self._records[offset] = (size, gen, None)
            self._in_flight[offset] = 1
        self.buf[offset:offset + 8] = bytes(8)  # the header is written last: a reader never sees a half record
        m = _Mapped(self.buf, offset, lay, n)
        m.ids.copy_(torch.as_tensor(ids, dtype=torch.int32))
        dt = DTYPES[lay.dtype]
        for layer, (k, v) in enumerate(zip(keys, values)):
            m.keys[layer].copy_(k[0, :, :n].transpose(0, 1).to(dt))  # [H_kv, N, D] -> [N, H_kv, D]
            m.values[layer].copy_(v[0, :, :n].transpose(0, 1).to(dt))
        header = {"magic": MAGIC, "gen": gen, "fingerprint": self.fingerprint, "n_tokens": n,
                  "layout": [lay.n_layers, lay.n_kv_heads, lay.head_dim, lay.dtype], "ids_crc": _ids_crc(ids),
                  "crcs": [m.chunk_crc(c) for c in range(-(-n // CHUNK_TOKENS))]}
        raw = json.dumps(header).encode()
        if len(raw) > HEADER_BYTES:
            raise HeadError(f"a head of {n} tokens needs a header over {HEADER_BYTES} bytes")
        self.buf[offset:offset + HEADER_BYTES] = raw.ljust(HEADER_BYTES, b"\0")
        ref = HeadRef(self.name, offset, gen, n)
        with self._lock:
            if self._records.get(offset, (0, None))[1] == gen:
                self._records[offset] = (size, gen, digest)
                if digest is not None:
                    self._index[digest] = ref
        return ref

    def close(self) -> None:
        self.buf.close()
        self._file.close()
        self.path.unlink(missing_ok=True)


class HeadReader:
    """The connector's side: maps pool files read-only and checks a record before anything is loaded from it."""

    def __init__(self, heads_dir: Path, fingerprint: str | None = None) -> None:
        self.dir = Path(heads_dir)
        self.fingerprint = fingerprint  # None: not checked (the model's own is not known to the connector)
        self._maps: dict[str, tuple[int, mmap.mmap]] = {}

    def _map(self, pool: str) -> mmap.mmap:
        if "/" in pool or pool.startswith("."):
            raise HeadError(f"bad pool name {pool!r}")
        path = self.dir / pool
        try:
            ino = path.stat().st_ino
            cached = self._maps.get(pool)
            if cached is None or cached[0] != ino:  # a restarted writer made a new file under the same name
                with open(path, "rb") as f:
                    self._maps[pool] = (ino, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
        except (OSError, ValueError) as e:
            raise HeadError(f"cannot map {path}: {e}") from e
        return self._maps[pool][1]

    def header(self, ref: HeadRef) -> dict:
        buf = self._map(ref.pool)
        if ref.offset < 0 or ref.offset % ALIGN or ref.offset + HEADER_BYTES > len(buf):
            raise HeadError("offset outside the pool")
        raw = bytes(buf[ref.offset:ref.offset + HEADER_BYTES]).rstrip(b"\0")
        try:
            h = json.loads(raw)
        except ValueError as e:
            raise HeadError("unreadable header") from e
        if not isinstance(h, dict) or h.get("magic") != MAGIC or h.get("gen") != ref.gen \
                or h.get("n_tokens") != ref.n_tokens:
            raise HeadError("the record was overwritten or is not a head")
        if self.fingerprint is not None and h.get("fingerprint") != self.fingerprint:
            raise HeadError("the head belongs to another model")
        return h

    def map_checked(self, ref: HeadRef, layout: Layout, h: dict | None = None) -> _Mapped:
        """The record of `ref` when its header (`h`, read here when not given) and layout check out (no CRC: open()
        checked the data)."""
        h = self.header(ref) if h is None else h
        if h.get("layout") != [layout.n_layers, layout.n_kv_heads, layout.head_dim, layout.dtype]:
            raise HeadError(f"layout {h.get('layout')} differs from this engine's {layout}")
        buf = self._map(ref.pool)
        if ref.offset + record_bytes(layout, ref.n_tokens) > len(buf):
            raise HeadError("record runs past the pool's end")
        return _Mapped(buf, ref.offset, layout, ref.n_tokens)

    def open(self, ref: HeadRef, prompt_ids, layout: Layout, lo: int = 0, hi: int | None = None) -> _Mapped:
        """The record of `ref` once it checks out for a request whose prompt starts with its ids, and the chunks
        covering tokens [lo, hi) match their CRCs. Raises HeadError otherwise."""
        h = self.header(ref)
        m = self.map_checked(ref, layout, h)
        n = ref.n_tokens
        ids = m.ids.tolist()
        if len(prompt_ids) <= n or list(prompt_ids[:n]) != ids or _ids_crc(ids) != h.get("ids_crc"):
            raise HeadError("the head's ids are not the prompt's")
        hi = n if hi is None else hi
        crcs = h.get("crcs") or []
        for c in range(lo // CHUNK_TOKENS, -(-hi // CHUNK_TOKENS)):
            if c >= len(crcs) or m.chunk_crc(c) != crcs[c]:
                raise HeadError(f"chunk {c} fails its CRC")
        return m
