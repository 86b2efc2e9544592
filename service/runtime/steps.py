"""What a prefill in steps returns and how steps run: shared by the model runtime (service/runtime/model.py) and the
Composer that builds a request's cache (service/runtime/composer.py)."""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from transformers import DynamicCache

Mode = Literal["compose", "full"]
BACKGROUND_CHUNK_TOKENS = 128  # tokens per background prefill step: Settings.background_chunk_tokens's default
DEFERRED_TAIL_TOKENS = 64  # prefill_steps(defer_tail=True) leaves a text tail of at most this many to the caller


@dataclass
class PrefillResult:
    cache: DynamicCache | None  # holds every prompt token; owned by this request only (None: the engine keeps it, vLLM)
    logits: torch.Tensor | None  # [V] float32, the next-token logits after the prompt (None: `tail` still to run)
    n_prompt: int
    n_reused: int  # block tokens copied (re-rotated) instead of recomputed
    n_recomputed: int  # tokens run through the model
    timings_ms: dict[str, float] = field(default_factory=dict)
    n_prefix: int = 0  # tokens copied from an exact prefix (a refined skill sequence), not composed
    seams: dict[int, int] = field(default_factory=dict)  # skill index -> seam tokens recomputed (composed skills)
    tail: list[int] | None = None  # defer_tail: the prompt's last text, not yet in `cache`; it starts at tail_start
    tail_start: int = 0
    n_exact: int = 0  # the cache's first n_exact tokens are exactly what a full prefill computes (automatic reuse
    # keeps only those: service/compose/auto.py)
    n_auto: int = 0  # of n_prefix, tokens from an automatic head (service/compose/auto.py; vLLM: its prefix cache)

    def tail_done(self, logits: torch.Tensor, ms: float) -> None:
        """The deferred tail ran (its K/V went wherever the caller keeps the cache now): the prompt's logits."""
        self.logits, self.tail = logits, None
        self.timings_ms["tail_ms"] = ms
        self.timings_ms["prefill_ms"] = self.timings_ms.get("prefill_ms", 0.0) + ms


Steps = Generator[int, None, Any]  # work in steps: yields the tokens each step ran through the model


def run_steps(steps: Steps) -> Any:
    """Run a step generator (prefill_steps, full_prefill_steps, calibration_steps...) to its end, inline; returns
    its value. The serving engine instead advances one step at a time between decode steps, within a token budget
    (service/runtime/serving)."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value
