"""The KV block: one skill's keys and values, prefilled once at canonical positions base..base+N-1."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from service.kv.layout import LAYOUT_VERSION  # noqa: F401 - stored blocks carry it


@dataclass
class KVBlock:
    """Per-layer K/V of a token span prefilled once at positions base..base+N-1.

    `base` is the length of the anchor the span was prefilled after (the chat template's fixed
    opening, see PromptBuilder.skill_anchor; 0 when prefilled alone). Keys are stored post-RoPE (as
    Hugging Face caches hold them) at these canonical positions; every use moves them by
    (offset - base) from this copy, never from an already-moved one.
    """

    keys: list[torch.Tensor]  # L x [1, H_kv, N, D]
    values: list[torch.Tensor]  # L x [1, H_kv, N, D]
    token_ids: list[int]  # [N]
    model_fingerprint: str
    layout_version: int = LAYOUT_VERSION
    meta: dict[str, str] = field(default_factory=dict)  # free-form, str -> str (safetensors)
    base: int = 0  # canonical position of the first token

    def __post_init__(self) -> None:
        if not isinstance(self.base, int) or self.base < 0:
            raise ValueError(f"invalid base position {self.base!r}")
        if len(self.keys) != len(self.values):
            raise ValueError("keys and values must have one tensor per layer each")
        for k, v in zip(self.keys, self.values):
            if k.dim() != 4 or k.shape[0] != 1 or k.shape[2] != len(self.token_ids):
                raise ValueError(f"key shape {tuple(k.shape)} does not match {self.n_tokens} tokens")
            if v.shape[:3] != k.shape[:3]:
                raise ValueError(f"value shape {tuple(v.shape)} does not match key {tuple(k.shape)}")

    @property
    def n_layers(self) -> int:
        return len(self.keys)

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def dtype(self) -> torch.dtype:
        return self.keys[0].dtype

    @property
    def size_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    def to(self, device: torch.device | str) -> "KVBlock":
        return KVBlock(
            keys=[k.to(device) for k in self.keys],
            values=[v.to(device) for v in self.values],
            token_ids=self.token_ids,
            model_fingerprint=self.model_fingerprint,
            layout_version=self.layout_version,
            meta=dict(self.meta),
            base=self.base,
        )
