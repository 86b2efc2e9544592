"""Generation parameters and decode events: plain data, importable without torch."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class GenParams:
    max_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None  # top-k of the first generated position


@dataclass
class Delta:
    text: str


@dataclass
class Done:
    finish_reason: str  # "stop" | "length" | "cancelled"
    text: str
    token_ids: list[int]
    top_logprobs: list[tuple[str, float]] | None = None
