"""Helpers shared by the store tests (import as tests.store.store_helpers)."""

from __future__ import annotations

import torch
from prometheus_client import REGISTRY

from service.kv.block import KVBlock


def synthetic_block(*, layers: int = 4, heads: int = 2, tokens: int = 16, dim: int = 8,
                    dtype: torch.dtype = torch.float32, fingerprint: str = "fp-test", seed: int = 0,
                    meta: dict[str, str] | None = None, base: int = 3) -> KVBlock:
    """Random K/V, L x [1, heads, tokens, dim]."""
    g = torch.Generator().manual_seed(seed)
    keys = [torch.randn(1, heads, tokens, dim, generator=g).to(dtype) for _ in range(layers)]
    values = [torch.randn(1, heads, tokens, dim, generator=g).to(dtype) for _ in range(layers)]
    token_ids = torch.randint(0, 50_000, (tokens,), generator=g).tolist()
    return KVBlock(keys=keys, values=values, token_ids=token_ids, model_fingerprint=fingerprint,
                   meta=meta or {"skill": "demo"}, base=base)


def assert_same_block(a: KVBlock, b: KVBlock) -> None:
    assert a.n_layers == b.n_layers and a.token_ids == b.token_ids
    assert a.model_fingerprint == b.model_fingerprint and a.layout_version == b.layout_version
    assert a.meta == b.meta and a.base == b.base
    for x, y in zip((*a.keys, *a.values), (*b.keys, *b.values)):
        assert x.dtype == y.dtype and torch.equal(x, y)


def metric(name: str, **labels: str) -> float:
    """Current value of a Prometheus sample (0 if never set)."""
    return REGISTRY.get_sample_value(name, labels) or 0.0


def v1_payload(data: bytes, drop: tuple[str, ...] = ()) -> bytes:
    """`data` (an encode_block payload) rewritten as format version 1 wrote it: no format_version, and a
    checksum over the tensor bytes only (k.0, v.0, ..., token_ids). `drop` removes further fields."""
    import hashlib

    from safetensors.torch import load, save

    from service.store.serde import read_metadata

    tensors, meta = load(data), read_metadata(data)
    for name in ("format_version", *drop):
        meta.pop(name, None)
    h = hashlib.sha256()
    for i in range(int(meta["n_layers"])):
        for p in ("k", "v"):
            h.update(tensors[f"{p}.{i}"].reshape(-1).view(torch.uint8).numpy())
    h.update(tensors["token_ids"].reshape(-1).view(torch.uint8).numpy())
    meta["checksum"] = h.hexdigest()
    return save(tensors, metadata=meta)
