"""Background work on vLLM: what runs behind live traffic and how (compiles ahead, calibrations, shadow checks).
The one place that picks a vLLM request's priority and when background work may send it: in a quiet moment, no live
request in flight nor ended within SKILLCACHE_BACKGROUND_IDLE_MS (measured: a one-request prefill sent between two
back-to-back requests of one client held the second's first token 2.2 s; docs/BENCHMARKS.md)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine

from service.vllm.transfer import Save, Transfer

LIVE, BACKGROUND = 0, 10  # vLLM's request priority (lower runs first; the server runs --scheduling-policy priority)
# A background prefill (a compile ahead, a calibration's or a shadow check's full prefill) is sent only while no live
# request is in flight, and in requests of at most SKILLCACHE_VLLM_BACKGROUND_CHUNK new tokens (each under one salt
# hits vLLM's prefix cache for what the earlier ones computed): vLLM's priority orders its queue, but a step it has
# begun runs to its end, so a live request that arrives during a background prefill waits for one step of it (bf16,
# 2.4k tokens in one request: 2.2 s, 9x an idle first token; in steps of 256: 1.5x; docs/BENCHMARKS.md). Refinement
# sends no background prefill: the order's next request goes out exact (service/engines/vllm.py), since K/V computed
# against a cached prefix round differently from vLLM's own prefill of the whole prompt (a head refined in chunks of
# 256: greedy-32 identical to vLLM alone's in 3/8 cases, in one request 7/8).
IDLE_WAIT_S = 30.0  # at most this long behind live traffic; then it goes anyway (a live count that never drains)


def exact_salt(namespace: str) -> str:
    """vLLM's prefix cache entries of exact prompts (full prefills, refined heads) of one tenant."""
    return f"exact:{namespace}"


def refined_salt(namespace: str, digest: str) -> str:
    """One refined order's exact prompts: its prefix cache holds only vLLM's own whole-prompt prefills of that order
    (the refining request, then its repeats), so a refined head is vLLM's prefill of the cold prompt, never K/V another
    request computed against a prefix (in bfloat16 those round differently: docs/BENCHMARKS.md, fidelity)."""
    return f"exact:{namespace}:{digest}"


def check_salt(namespace: str) -> str:
    """The fidelity checks' reference prefills (background, in chunks): apart, so that their K/V never serve a live
    exact request."""
    return f"check:{namespace}"


def approx_salt(namespace: str, digest: str) -> str:
    """Composed K/V of one composition: a repeat of it reads them, nothing else does."""
    return f"approx:{namespace}:{digest}"


class Background:
    """Counts live requests in flight and sends background work only in a quiet moment: none in flight, and none
    ended within `idle_s` (a client's next request comes right after a response: it must not find vLLM busy with a
    background prefill it cannot interrupt)."""

    def __init__(self, chunk: int = 256, idle_s: float = 0.0) -> None:
        self.chunk = chunk  # new tokens per background request (0: the whole prefill in one)
        self.idle_s = idle_s  # SKILLCACHE_BACKGROUND_IDLE_MS, as on the embedded engine
        self.live = 0  # live requests in flight (their composition started, their stream not yet closed)
        self.t_end = float("-inf")  # when the last live request ended (monotonic)
        self._tasks: set[asyncio.Task] = set()

    def started(self) -> None:
        self.live += 1

    def ended(self) -> None:
        self.live -= 1
        self.t_end = time.monotonic()

    def priority(self, background: bool) -> int:
        return BACKGROUND if background else LIVE

    def quiet(self) -> bool:
        return self.live == 0 and time.monotonic() - self.t_end >= self.idle_s

    async def idle(self) -> None:
        """Returns in a quiet moment (at most IDLE_WAIT_S later: a live count that never drains)."""
        deadline = time.monotonic() + IDLE_WAIT_S
        while not self.quiet() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    async def prefill(self, client, ids: list[int], salt: str, save: Save | None = None) -> None:
        """vLLM prefills `ids` behind live traffic, at background priority, while nothing live is in flight: in one
        request, or in chunks of `chunk` new tokens; `save` goes with the last (the connector saves the span from the
        request's blocks, prefix-cache hits included)."""
        ends = (list(range(self.chunk, len(ids), self.chunk)) if self.chunk > 0 else []) + [len(ids)]
        for end in ends:
            await self.idle()
            last = end == len(ids)
            await client.prefill(ids[:end], salt, Transfer(save=save) if last and save else None, BACKGROUND)

    def spawn(self, work: Coroutine) -> None:
        """Runs `work` as a task this object keeps until it ends (cancelled by close)."""
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
