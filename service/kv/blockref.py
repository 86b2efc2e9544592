"""BlockRef: a block as a request names it on an engine that compiles blocks itself (vLLM: its connector saves them).

The pipeline hands the engine the block's token ids and where it starts canonically; no K/V is computed or held in
this process (service/engines/vllm.py compiles it inside vLLM on first use). It answers what callers read of a
KVBlock before the engine runs: token_ids, n_tokens, base, meta (no calibration: the configured seam applies).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class BlockRef:
    token_ids: list[int]
    base: int  # the anchor's length it is compiled after (0: alone)
    meta: dict[str, str] = field(default_factory=dict)

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)
