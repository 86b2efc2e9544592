"""Generation parameters and decode events: plain data, importable without torch."""

from __future__ import annotations

from dataclasses import dataclass, field


# How a reply under GenParams.json_schema is laid out: compact, no whitespace between JSON tokens (a model that may
# put any whitespace anywhere can fill max_tokens with it). llguidance's JSON options; on vLLM,
# structured outputs' disable_any_whitespace.
JSON_LAYOUT = {"whitespace_flexible": False}


@dataclass
class GenParams:
    max_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None  # top-k of the first generated position
    top_k: int = 0  # sample among the k most likely tokens only (0: all)
    json_schema: str | None = None  # the reply is JSON valid under this schema (JSON text; service/api/structured.py)
    ignore_eos: bool = False  # run to max_tokens (or a stop string) past end-of-sequence; not under a json_schema


@dataclass
class Delta:
    text: str


@dataclass
class Done:
    finish_reason: str  # "stop" | "length" | "cancelled"
    text: str
    token_ids: list[int]
    top_logprobs: list[tuple[str, float]] | None = None
