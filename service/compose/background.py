"""Background work on this process's engine: the one place that ranks it. The serving engine runs the backlog lowest
priority first, in its background share of steps (service/runtime/serving); callers ask here instead of picking
numbers. The vLLM engine's counterpart (request priorities, when background requests go) is
service/vllm/background.py.

Ranking, first to last: a block's calibration (a skill's seam is unknown until it runs: every composition of it waits
on a guess), then the work that saves the most tokens per use (refining a skill sequence: tokens made exact x times
composed; a system-prompt section's compile: its tokens), then shadow checks (a sample: late is fine)."""

from __future__ import annotations

from collections.abc import Callable

CALIBRATION = -1e18
SHADOW_CHECK = 1.0


def refinement(uses: Callable[[], int], tokens: int) -> Callable[[], float]:
    """Refining a head of `tokens` tokens composed `uses()` times so far: read whenever the engine picks work."""
    return lambda: -float(uses() * tokens)


def section_compile(tokens: int) -> float:
    """Compiling a system-prompt section's block of `tokens` tokens (service/compose/autoblocks.py)."""
    return -float(tokens)
