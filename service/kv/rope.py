"""RoPE re-rotation of cached keys, using the model's own rotary embedding and apply function.

Hugging Face caches keys after RoPE. RoPE rotations compose, so a key computed at position i
and moved to position i + delta is one more rotation by delta: R(theta*(i+delta)) = R(theta*delta) R(theta*i).
We get cos/sin of delta from the model's `rotary_emb` (so default/linear/llama3/yarn and partial
rotary come for free), divide out yarn's `attention_scaling` (it must be applied exactly once, and
the stored key already carries it), and apply them with the model's own `apply_rotary_pos_emb`
(so the half-split vs interleaved pair convention is the model's). Math in float32.

Which cached tensor carries the rotated dims, where they start, and which layers have RoPE at all
is model-family knowledge: `service.runtime.adapters` works it out and passes it in here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from service.errors import UnsupportedModel

EXACT_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn", "proportional"})
# Frequencies depend on the sequence length: exact only while the length stays on one side
# of original_max_position_embeddings (dynamic: below it; longrope: same side as at compile).
LENGTH_DEPENDENT_ROPE_TYPES = frozenset({"dynamic", "longrope"})

ApplyRotary = Callable[..., tuple[torch.Tensor, torch.Tensor]]
NO_ROPE = -1  # layer_rope entry of a layer without positional encoding (NoPE): its KV is copied
Slot = Literal["keys", "values"]


@dataclass(frozen=True)
class RopeInfo:
    rope_type: str
    attention_scaling: float
    rotary_dims: int  # R: how many of the D head dims rotate
    original_max_positions: int | None  # for the length-dependent types


class KeyRotator:
    """Moves post-RoPE keys by a position delta. One rotary module per distinct RoPE (per-layer aware).

    `slot`: which cached tensor holds the rotated part ("keys" for ordinary attention; "values" for
    MLA as transformers caches it: keys = the position-free latent, values = the shared k_pe).
    `rot_start`: the first rotated dim of that tensor's last axis (R = 2 * len(inv_freq) dims rotate).
    `refused_tokens`: token id -> reason; blocks containing them cannot be moved (M-RoPE vision tokens).
    """

    def __init__(
        self,
        rotary_embs: list[nn.Module],
        layer_rope: list[int],  # layer index -> index into rotary_embs, or NO_ROPE
        apply_rotary: ApplyRotary,
        original_max_positions: int | None = None,
        *,
        slot: Slot = "keys",
        rot_start: int = 0,
        refused_tokens: dict[int, str] | None = None,
    ) -> None:
        self.rotary_embs = rotary_embs
        self.layer_rope = layer_rope
        self.apply_rotary = apply_rotary
        self.slot = slot
        self.rot_start = rot_start
        self.refused_tokens = dict(refused_tokens or {})
        self.infos = [self._info(r, original_max_positions) for r in rotary_embs]
        for info in self.infos:
            if info.rope_type not in EXACT_ROPE_TYPES | LENGTH_DEPENDENT_ROPE_TYPES:
                raise UnsupportedModel(
                    f"RoPE type {info.rope_type!r} is not supported for re-rotation; "
                    f"supported: {sorted(EXACT_ROPE_TYPES)} (and {sorted(LENGTH_DEPENDENT_ROPE_TYPES)} "
                    "within original_max_position_embeddings)"
                )

    @staticmethod
    def _info(rotary: nn.Module, original_max_positions: int | None) -> RopeInfo:
        inv_freq = rotary.inv_freq  # [R/2]
        return RopeInfo(
            rope_type=str(getattr(rotary, "rope_type", "default")),
            attention_scaling=float(getattr(rotary, "attention_scaling", 1.0)),
            rotary_dims=int(inv_freq.numel()) * 2,
            original_max_positions=original_max_positions or getattr(rotary, "original_max_seq_len", None),
        )

    @property
    def rope_types(self) -> list[str]:
        return sorted({i.rope_type for i in self.infos})

    def check_tokens(self, token_ids: list[int]) -> None:
        """Refuse a block holding tokens whose positions are not a plain 1-D sequence (e.g. image patches)."""
        for t in set(token_ids) & self.refused_tokens.keys():
            raise UnsupportedModel(f"this block contains token {t} ({self.refused_tokens[t]}); {_REFUSED_WHY}")

    def check_positions(self, max_position: int) -> None:
        """Refuse a composition whose positions would make a length-dependent RoPE inexact.

        `max_position`: the largest position the request can reach (prompt + generated tokens).
        """
        for info in self.infos:
            if info.rope_type not in LENGTH_DEPENDENT_ROPE_TYPES:
                continue
            limit = info.original_max_positions
            if limit is None or max_position + 1 > limit:
                raise UnsupportedModel(
                    f"RoPE type {info.rope_type!r} changes its frequencies with sequence length; "
                    f"composition is exact only up to {limit} positions and this request reaches "
                    f"{max_position + 1}. Shorten the prompt or max_tokens, or use mode='full'."
                )

    def delta_cos_sin(self, delta: int, rope_idx: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin of a rotation by `delta` positions, without attention scaling: [1, 1, R] float32."""
        rotary = self.rotary_embs[rope_idx]
        dummy = torch.zeros(1, device=device, dtype=torch.float32)
        pos = torch.tensor([[delta]], device=device, dtype=torch.long)  # [1, 1]
        cos, sin = rotary(dummy, position_ids=pos)  # [1, 1, R], scaled by attention_scaling
        scale = self.infos[rope_idx].attention_scaling
        if scale != 1.0:
            cos, sin = cos / scale, sin / scale
        return cos.float(), sin.float()

    def rotate(
        self, k: torch.Tensor, delta: int, layer: int, cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> torch.Tensor:
        """k: [1, H_kv, T, D] post-RoPE at positions i -> the same keys at positions i + delta.

        Only dims [rot_start, rot_start + R) rotate (partial rotary: the first R; MLA: all of k_pe);
        the rest are copied.
        """
        if delta == 0 or self.layer_rope[layer] == NO_ROPE:
            return k
        cos, sin = cos_sin or self.delta_cos_sin(delta, self.layer_rope[layer], k.device)
        a, b = self.rot_start, self.rot_start + cos.shape[-1]  # the R rotated dims
        k_rot = k[..., a:b].float()  # [1, H_kv, T, R]
        _, out = self.apply_rotary(k_rot[:, :1, :1], k_rot, cos, sin)  # q: a throwaway 1-element slice
        if a > 0 or b < k.shape[-1]:
            out = torch.cat([k[..., :a].float(), out, k[..., b:].float()], dim=-1)  # [1, H_kv, T, D]
        return out.to(k.dtype)

    def rotate_layers(self, keys: list[torch.Tensor], delta: int) -> list[torch.Tensor]:
        """Rotate every layer's keys by one delta; cos/sin computed once per distinct RoPE."""
        if delta == 0:
            return list(keys)
        tables = {
            idx: self.delta_cos_sin(delta, idx, keys[0].device) for idx in sorted(set(self.layer_rope)) if idx >= 0
        }
        return [self.rotate(k, delta, layer, tables.get(self.layer_rope[layer])) for layer, k in enumerate(keys)]

    def move_layers(
        self, keys: list[torch.Tensor], values: list[torch.Tensor], delta: int
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Move a block's cached tensors (L x [1, H, T, D] each) by `delta` positions.

        The slot that carries RoPE is rotated (`rotate_layers`), the other is position-free and
        returned as is.
        """
        if self.slot == "values":
            return list(keys), self.rotate_layers(values, delta)
        return self.rotate_layers(keys, delta), list(values)


_REFUSED_WHY = (
    "vision tokens carry 3-D M-RoPE positions (temporal/height/width) that a text block cannot be "
    "moved to; skills must be text only"
)
