"""Usage and timings of a reply, as every API and session turn reports them: one builder, one set of counters."""

from __future__ import annotations

from service import metrics


def usage_of(n_prompt: int, composed: int, prefix: int, auto: int, recomputed: int, n_completion: int) -> dict:
    """`composed`: tokens copied from precompiled blocks (re-rotated); `prefix`: tokens of an exact cached prefix (a
    session's conversation, a refined skill sequence, an automatic head), `auto` of them from an automatic head;
    `recomputed`: tokens the model ran."""
    return {"prompt_tokens": n_prompt, "reused_tokens": composed + prefix, "composed_tokens": composed,
            "prefix_tokens": prefix, "auto_tokens": auto, "recomputed_tokens": recomputed,
            "completion_tokens": n_completion}


def timings_of(ttft_ms: float, compose_ms: float, store_ms: float, total_ms: float) -> dict:
    """`compose_ms`: building the prompt's cache (the engine's prefill); `store_ms`: finding its blocks."""
    return {"ttft_ms": round(ttft_ms, 2), "compose_ms": round(compose_ms, 2), "store_ms": round(store_ms, 2),
            "total_ms": round(total_ms, 2)}


def count(usage: dict) -> None:
    """The reply's prompt tokens on skillcache_tokens_total, by how they were obtained."""
    metrics.TOKENS.labels("composed").inc(usage["composed_tokens"])
    metrics.TOKENS.labels("prefix").inc(usage["prefix_tokens"] - usage["auto_tokens"])
    metrics.TOKENS.labels("auto").inc(usage["auto_tokens"])
    metrics.TOKENS.labels("recomputed").inc(usage["recomputed_tokens"])
