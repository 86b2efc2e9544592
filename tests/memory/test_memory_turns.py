"""Late blocks in a session turn (service/runtime/late.py) on tiny random-weight models: what is exact, what is
copied, what is recomputed, and the in-place edit of a block's K/V."""

import pytest
import torch

from service.kv.cache import new_cache, remove_span
from service.runtime.steps import run_steps
from service.runtime.late import inplace_block_steps, late_turn_steps
from tiny import random_ids, tiny_runtime

ATOL = 2e-4
SYSTEM = [{"role": "system", "content": "Answer politely and briefly."}]


def _turn(rt, history, user, mem_ids, lines=None):
    return rt.prompts.build(SYSTEM + history + [{"role": "user", "content": user}], [], late_ids=mem_ids,
                            late_lines=lines)


def _head_cache(rt):
    """A session's cache after creation: its head (the system turn) prefilled in full."""
    head = rt.prompts.build(SYSTEM, [], add_generation_prompt=False)
    cache = new_cache(rt.model.config)
    rt.forward(head.ids, 0, cache)
    return cache, head.ids


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3", "deepseek_v3"])
def test_first_turn_with_the_whole_block_as_seam_is_the_full_prefill(family):
    """Before the memory sits only text computed without it, exactly as in the full recompute: recomputing every
    memory token (seam = the block) must give the full prefill's logits."""
    rt = tiny_runtime(family)
    mem = [random_ids(40, seed=1)]
    plan = _turn(rt, [], "Refund?", mem, ["[MEMORY UPDATE] status has changed to shipped."])
    cache, cached = _head_cache(rt)
    pre = run_steps(late_turn_steps(rt, cache, cached, plan, [rt.compile_block(mem[0])], [40]))
    full = rt.prefill(plan, [], mode="full")
    torch.testing.assert_close(pre.logits, full.logits, atol=ATOL, rtol=1e-4)
    assert pre.n_prefix == len(cached) and pre.n_reused == 0


@pytest.mark.parametrize("family", ["llama", "gemma3", "smollm3"])
def test_rotated_memory_has_the_full_prefills_layer0_and_counts_what_it_copies(family):
    rt = tiny_runtime(family)
    mem = [random_ids(30, seed=2), random_ids(17, seed=3)]
    plan = _turn(rt, [], "Is the order shipped?", mem)
    cache, cached = _head_cache(rt)
    blocks = [rt.compile_block(m) for m in mem]
    pre = run_steps(late_turn_steps(rt, cache, cached, plan, blocks, [1, 2]))
    full = rt.prefill(plan, [], mode="full")
    a, _ = plan.late_span
    n_mem = 30 + 1 + 17  # the two blocks and the joiner between them (one token here)
    k_c, k_f = pre.cache.layers[0].keys, full.cache.layers[0].keys  # [1, H_kv, T, D]
    torch.testing.assert_close(k_c[:, :, a:a + n_mem], k_f[:, :, a:a + n_mem], atol=ATOL, rtol=1e-4)
    assert pre.n_reused == (30 - 1) + (17 - 2) and pre.seams == {0: 1, 1: 2}
    assert pre.n_recomputed == plan.n_tokens - len(cached) - pre.n_reused
    assert not torch.allclose(pre.logits, full.logits, atol=1e-3)  # composed, so not exact past layer 0


def test_the_memory_leaves_the_cache_and_turns_recompute_only_their_own_tokens():
    """After each turn the span goes; the cache then holds exactly the transcript's ids (layer 0 equal to their
    prefill), and each turn recomputes the same few tokens however long the conversation has grown."""
    rt = tiny_runtime("llama")
    mem_ids = random_ids(60, seed=4)
    block = rt.compile_block(mem_ids)
    cache, cached = _head_cache(rt)
    history, recomputed = [], []
    for turn in range(4):
        plan = _turn(rt, history, "Same question again?", [mem_ids])
        pre = run_steps(late_turn_steps(rt, cache, cached, plan, [block], [1]))
        recomputed.append(pre.n_recomputed)
        assert pre.n_prefix == len(cached)  # every cached token kept
        reply = random_ids(7, seed=10 + turn)
        rt.forward(reply, plan.n_tokens, cache)  # the reply, as decoding appends it
        a, b = plan.late_span
        remove_span(cache, a, b, rt.rotator)
        cached = plan.ids[:a] + plan.ids[b:] + reply
        history = history + [{"role": "user", "content": "Same question again?"},
                             {"role": "assistant", "content": "", "ids": reply}]
        transcript = rt.prompts.build(SYSTEM + history, [], add_generation_prompt=False).ids
        assert cached == transcript[:len(cached)]  # the cache holds the transcript, no memory in it
        ref = new_cache(rt.model.config)
        rt.forward(cached, 0, ref)
        torch.testing.assert_close(cache.layers[0].keys, ref.layers[0].keys, atol=ATOL, rtol=1e-4)
    assert len(set(recomputed[1:])) == 1, recomputed  # the conversation grew; what each turn recomputes did not
    assert recomputed[-1] < len(mem_ids) and recomputed[-1] < len(cached) / 3  # neither the memory nor the talk


def test_without_rotation_the_memory_keys_are_wrong():
    class Still:  # the no-rotation control of bench/memory.py
        def check_tokens(self, ids):
            pass

        def move_layers(self, keys, values, delta):
            return list(keys), list(values)

    rt = tiny_runtime("llama")
    mem = [random_ids(30, seed=5)]
    plan = _turn(rt, [], "Refund?", mem)
    cache, cached = _head_cache(rt)
    pre = run_steps(late_turn_steps(rt, cache, cached, plan, [rt.compile_block(mem[0])], [1], rotator=Still()))
    full = rt.prefill(plan, [], mode="full")
    a, _ = plan.late_span
    assert not torch.allclose(pre.cache.layers[0].keys[:, :, a + 1:a + 30],
                              full.cache.layers[0].keys[:, :, a + 1:a + 30], atol=1e-2)


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
@pytest.mark.parametrize("grow", [0, 3, -2])
def test_in_place_edit_recomputes_the_span_and_moves_the_stale_rest(family, grow):
    rt = tiny_runtime(family)
    old = random_ids(40, seed=6)
    s, e_old = 12, 16
    new_span = random_ids(4 + grow, seed=7)
    new = old[:s] + new_span + old[e_old:]
    e_new = s + len(new_span)
    block = rt.compile_block(old)
    edited = run_steps(inplace_block_steps(rt, block, new, s, e_old, e_new))
    fresh = rt.compile_block(new)  # what a recompile would give
    assert edited.token_ids == new and edited.base == block.base == len(rt.anchor)
    for layer in range(len(fresh.keys)):  # up to the span's end: exactly the recompile (nothing stale before it)
        torch.testing.assert_close(edited.keys[layer][:, :, :e_new], fresh.keys[layer][:, :, :e_new], atol=ATOL,
                                   rtol=1e-4)
        torch.testing.assert_close(edited.values[layer][:, :, :e_new], fresh.values[layer][:, :, :e_new],
                                   atol=ATOL, rtol=1e-4)
    # after it: moved to the new positions (layer 0 equal), stale deeper (it read the old value)
    torch.testing.assert_close(edited.keys[0][:, :, e_new:], fresh.keys[0][:, :, e_new:], atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(edited.values[0][:, :, e_new:], fresh.values[0][:, :, e_new:], atol=ATOL, rtol=1e-4)
    assert not torch.allclose(edited.values[-1][:, :, e_new:], fresh.values[-1][:, :, e_new:], atol=1e-3)
