"""A background forward gives way between decoder layers (service/runtime/preempt.py): live forwards run while it
is parked, and both give what they give uninterrupted; the serving engine serves a request that arrives mid-forward
before that forward ends."""

import asyncio
import threading

import pytest
import torch

from service.kv.cache import new_cache
from service.runtime import preempt
from service.runtime.serving import EngineConfig, ServingLoop
from service.runtime.loader import build_random_model
from tiny import FAMILIES, random_ids, tiny_config, tiny_runtime, tiny_tokenizer


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_gets_a_checkpoint_before_each_decoder_layer(family):
    # a fresh model: tiny_runtime's is shared, and an engine bound to it earlier in the run has installed already
    model = build_random_model(tiny_config(family), tiny_tokenizer()).model
    n_layers = model.config.get_text_config(decoder=True).num_hidden_layers
    assert preempt.install(model) == n_layers
    assert preempt.install(model) == 0  # once only


def test_a_parked_forward_and_a_live_one_between_give_their_uninterrupted_logits():
    rt = tiny_runtime("llama")
    preempt.install(rt.model)
    bg_ids, live_ids = random_ids(40, seed=1), random_ids(7, seed=2)
    with torch.inference_mode():
        want_bg = rt.forward(bg_ids, 0, new_cache(rt.model.config))
        want_live = rt.forward(live_ids, 0, new_cache(rt.model.config))
        seen = []

        def park_at_the_second_layer():
            seen.append(1)
            return len(seen) == 2

        step = preempt.Resumable(lambda: rt.forward(bg_ids, 0, new_cache(rt.model.config)))
        assert step.run(park_at_the_second_layer) == (False, None)
        assert step.started
        live = rt.forward(live_ids, 0, new_cache(rt.model.config))  # no checkpoint parks live code
        done, got = step.run(park_at_the_second_layer)
    assert done and torch.equal(got, want_bg) and torch.equal(live, want_live)
    assert len(seen) == rt.model.config.num_hidden_layers  # one checkpoint a layer; the forward went on where it parked


def test_a_killed_step_unwinds_and_never_resumes():
    rt = tiny_runtime("llama")
    preempt.install(rt.model)
    unwound = []

    def steps():
        try:
            rt.forward(random_ids(20, seed=3), 0, new_cache(rt.model.config))
            yield 20
        finally:
            unwound.append(True)

    gen = steps()
    step = preempt.Resumable(lambda: next(gen))
    with torch.inference_mode():
        assert step.run(lambda: True) == (False, None)
    step.kill()
    assert unwound == [True] and not step.started
    with pytest.raises(StopIteration):
        next(gen)


async def test_a_request_arriving_mid_forward_is_served_before_that_background_forward_ends():
    """The engine's background step parks at the next layer once live work is submitted, serves it, then resumes
    the forward, whose logits are the uninterrupted ones. Without the checkpoints the request waits for it."""
    rt = tiny_runtime("llama")
    eng = ServingLoop(EngineConfig(max_running=4, background_idle_s=0.0))
    await eng.run(lambda c: eng.bind(rt))
    loop, order, ids = asyncio.get_running_loop(), [], random_ids(60, seed=4)
    submitted = []

    async def submit_live():
        submitted.append(eng.submit(lambda cancelled: order.append("live")))

    def arrive(module, args):  # a request comes while the background forward is in its first layer
        if threading.current_thread() is eng.thread and not submitted and order == ["bg-start"]:
            asyncio.run_coroutine_threadsafe(submit_live(), loop).result()

    layers = rt.model.model.layers
    hook = layers[0].register_forward_pre_hook(arrive)

    def bg_steps():
        order.append("bg-start")
        logits = rt.forward(ids, 0, new_cache(rt.model.config))
        order.append("bg-end")
        yield len(ids)
        return logits

    try:
        got = await eng.run_steps(bg_steps(), background=True)
        await submitted[0].result()
        assert order == ["bg-start", "live", "bg-end"], order
        assert eng.bg.parks >= 1
        with torch.inference_mode():
            assert torch.equal(got, rt.forward(ids, 0, new_cache(rt.model.config)))
    finally:
        hook.remove()
        eng.stop()
