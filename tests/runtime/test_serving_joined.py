"""The serving engine's on_joined hook (automatic heads keep views of the prefill cache there): it runs once per
request on every way a sequence starts (a full prefill, a deferred tail alone, tails together, a request that ends
at its first token), sees the whole cache the batch took over, and nothing writes to that cache afterwards."""

import asyncio
import time

import pytest
import torch

from service.kv.cache import append_kv, new_cache
from service.runtime.steps import PrefillResult
from service.runtime.params import GenParams
from service.runtime.prompt import PromptPlan, Segment
from service.runtime.serving import EngineConfig, ServingLoop
from tiny import random_ids, tiny_runtime


@pytest.fixture
def rt(monkeypatch):
    rt = tiny_runtime("llama")
    monkeypatch.setattr(rt, "eos_ids", set())  # random weights: generate to max_tokens
    return rt


async def _engine(rt) -> ServingLoop:
    eng = ServingLoop(EngineConfig(max_running=8, torch_threads=1))
    await eng.run(lambda c: eng.bind(rt))
    return eng


class Seen:
    """What the hook saw: the cache's length and a copy of its K/V then (to compare with the views afterwards)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, list[torch.Tensor], list[torch.Tensor]]] = []

    def __call__(self, pre) -> None:
        layers = pre.cache.layers
        self.calls.append((layers[0].get_seq_length(), [la.keys for la in layers],
                           [la.keys.clone() for la in layers]))

    def unchanged(self) -> bool:
        return all(torch.equal(v, c) for _, views, copies in self.calls for v, c in zip(views, copies))


async def _collect(job):
    return [e async for e in job.stream()]


async def test_a_full_prefill_and_a_request_ending_at_its_first_token_are_seen_whole(rt):
    eng = await _engine(rt)
    try:
        for max_tokens in (6, 1):
            ids = random_ids(40, seed=max_tokens)
            seen = Seen()
            steps = rt.prefill_steps(PromptPlan([Segment("text", ids)]), [], mode="full")
            await _collect(eng.submit_sequence(steps, GenParams(max_tokens=max_tokens), len(ids), on_joined=seen))
            assert [n for n, _, _ in seen.calls] == [40] and seen.unchanged()
    finally:
        eng.stop()


async def test_deferred_tails_alone_and_together_are_seen_up_to_the_tail(rt, monkeypatch):
    from service.runtime.serving.runner import DecodeBatch

    together: list[int] = []
    real = DecodeBatch.prefill_tails
    monkeypatch.setattr(DecodeBatch, "prefill_tails", lambda self, tails: together.append(len(tails))
                        or real(self, tails))
    prefix = new_cache(rt.model.config)
    rt.forward(random_ids(100, seed=5), 0, prefix)

    def steps(tail):
        cache = new_cache(rt.model.config)
        append_kv(cache, [la.keys for la in prefix.layers], [la.values for la in prefix.layers])
        yield 0
        return PrefillResult(cache, None, 100 + len(tail), 100, len(tail), tail=tail, tail_start=100)

    eng = await _engine(rt)
    try:
        alone = Seen()
        await _collect(eng.submit_sequence(steps(random_ids(7, seed=1)), GenParams(max_tokens=4), 107,
                                           on_joined=alone))
        assert [n for n, _, _ in alone.calls] == [107] and alone.unchanged()  # the tail ran on its own cache
        eng.submit(lambda c: time.sleep(0.3))  # they arrive while the engine is busy: their tails run together
        seen = [Seen() for _ in range(3)]
        tails = [random_ids(n, seed=n) for n in (3, 9, 5)]
        await asyncio.gather(*(_collect(eng.submit_sequence(steps(t), GenParams(max_tokens=m), 100 + len(t),
                                                            on_joined=s))
                               for t, m, s in zip(tails, (5, 1, 8), seen)))
        assert together == [3]
        for s in seen:
            assert [n for n, _, _ in s.calls] == [100] and s.unchanged()  # the tail went to the batch row only
    finally:
        eng.stop()
