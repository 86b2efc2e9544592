"""Batched decode over sequences of different lengths equals decoding each alone, for every tiny family.

Each prompt is prefilled alone; then the same tokens are run (a) one sequence at a time on its own cache and (b)
as rows of one DecodeBatch, with rows leaving (the last row moves into the hole) and joining mid-way. Every row's
logits must match its solo logits at float32 tolerance, so no row sees padding, another row, or a wrong window.
"""

import pytest
import torch

from service.kv.cache import new_cache
from service.runtime.serving.runner import DecodeBatch
from tiny import FAMILIES, SLIDING_WINDOW, random_ids, tiny_runtime

ATOL = 2e-4
LENGTHS = [5, 3 * SLIDING_WINDOW + 7, 17, 2 * SLIDING_WINDOW]  # past the sliding window, and shorter ones


def _solo(rt, prompt: list[int], tokens: list[int]) -> list[torch.Tensor]:
    """Logits after the prompt, then after each of `tokens`, decoding alone."""
    cache = new_cache(rt.model.config)
    out = [rt.forward(prompt, 0, cache)]
    for i, t in enumerate(tokens):
        out.append(rt.forward([t], len(prompt) + i, cache))
    return out  # [V] each


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_batched_rows_match_solo_decoding(family):
    rt = tiny_runtime(family)
    n_steps = 6
    prompts = [random_ids(n, seed=100 + n) for n in LENGTHS]
    tokens = [random_ids(n_steps, seed=200 + i) for i in range(len(prompts))]
    late = random_ids(9, seed=300)  # joins after step 2
    late_tokens = random_ids(n_steps, seed=301)
    solo = [_solo(rt, p, t) for p, t in zip(prompts, tokens)]
    solo_late = _solo(rt, late, late_tokens)

    batch = DecodeBatch(rt)
    rows = {}  # sequence index -> row
    for i, p in enumerate(prompts):
        cache = new_cache(rt.model.config)
        rt.forward(p, 0, cache)
        rows[i] = batch.join(cache, len(p) + n_steps + 1)
    step_of = {i: 0 for i in rows}
    for step in range(n_steps):
        if step == 2:  # sequence 1 leaves (the last row moves into its place), a new one joins
            gone = rows.pop(1)
            last = max(rows, key=rows.get)  # the highest row left: it moves into the hole if above it
            batch.leave(gone)
            if rows[last] > gone:
                rows[last] = gone
            cache = new_cache(rt.model.config)
            rt.forward(late, 0, cache)
            rows["late"] = batch.join(cache, len(late) + n_steps + 1)
            step_of["late"] = 0
        order = sorted(rows, key=rows.get)
        feed = [late_tokens[step_of[s]] if s == "late" else tokens[s][step_of[s]] for s in order]
        logits = batch.step(feed)  # [B, V]
        for b, s in enumerate(order):
            step_of[s] += 1
            want = solo_late[step_of[s]] if s == "late" else solo[s][step_of[s]]
            torch.testing.assert_close(logits[b], want.float(), atol=ATOL, rtol=1e-4,
                                       msg=f"{family}: sequence {s} at its step {step_of[s]}")
            assert int(logits[b].argmax()) == int(want.argmax())


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tails_prefilled_together_match_each_alone(family):
    """Requests that finish composing in one engine step join with the K/V before their text tails, and the tails
    run as one left-padded forward over their rows: each row's logits, and its next decode step, as alone."""
    rt = tiny_runtime(family)
    prompts = [random_ids(n, seed=400 + n) for n in (9, 3 * SLIDING_WINDOW + 2, 30)]
    tails = [random_ids(n, seed=500 + n) for n in (6, 1, 13)]  # of different lengths: padding on the left
    nxt = random_ids(len(prompts), seed=600)
    solo = []
    for p, t, x in zip(prompts, tails, nxt):
        cache = new_cache(rt.model.config)
        rt.forward(p, 0, cache)
        solo.append((rt.forward(t, len(p), cache), rt.forward([x], len(p) + len(t), cache)))
    batch = DecodeBatch(rt)
    running = new_cache(rt.model.config)  # a row decoding already: the tails' rows are not the first
    rt.forward(random_ids(20, seed=7), 0, running)
    batch.join(running, 40)
    for p, t in zip(prompts, tails):
        cache = new_cache(rt.model.config)
        rt.forward(p, 0, cache)
        batch.join(cache, len(p) + len(t) + 4)
    got = batch.prefill_tails(tails)  # [3, V]
    after = batch.step([1] + nxt)  # every row, the running one too
    for i, (want, want_next) in enumerate(solo):
        torch.testing.assert_close(got[i], want.float(), atol=ATOL, rtol=1e-4, msg=f"{family}: tail {i}")
        torch.testing.assert_close(after[i + 1], want_next.float(), atol=ATOL, rtol=1e-4, msg=f"{family}: step {i}")
        assert int(got[i].argmax()) == int(want.argmax())
    assert batch.kv.lengths[1:] == [len(p) + len(t) + 1 for p, t in zip(prompts, tails)]


def test_a_row_extracted_continues_like_its_solo_cache():
    """keep_cache (sessions): a row taken out of the batch is the sequence's own cache, ready for its next turn."""
    rt = tiny_runtime("gemma3")
    prompt, toks = random_ids(40, seed=7), random_ids(4, seed=8)
    solo = _solo(rt, prompt, toks + [5])
    batch = DecodeBatch(rt)
    other = new_cache(rt.model.config)
    rt.forward(random_ids(11, seed=9), 0, other)
    batch.join(other, 20)
    cache = new_cache(rt.model.config)
    rt.forward(prompt, 0, cache)
    row = batch.join(cache, 60)
    for t in toks:
        batch.step([1, t] if row == 1 else [t, 1])
    mine = batch.leave(row, keep_cache=True)
    assert mine.get_seq_length() == len(prompt) + len(toks) and batch.n_rows == 1
    torch.testing.assert_close(rt.forward([5], len(prompt) + len(toks), mine), solo[-1], atol=ATOL, rtol=1e-4)


def test_batch_memory_grows_once_per_join_and_is_kept_when_idle_until_released():
    rt = tiny_runtime("llama")
    batch = DecodeBatch(rt)
    caches = []
    for n in (10, 30, 20):
        c = new_cache(rt.model.config)
        rt.forward(random_ids(n, seed=n), 0, c)
        caches.append(c)
    batch.join(caches[0], 100)
    size_one = batch.size_bytes
    batch.join(caches[1], 700)  # longer reservation: capacity grows to it (multiple of 256)
    assert batch.kv.capacity == 768 and batch.kv.slots == 2
    batch.join(caches[2], 50)
    assert batch.kv.slots == 4 and batch.size_bytes == size_one // 256 * 768 * 4
    for row in (2, 1, 0):
        batch.leave(row)
    held = [k.data_ptr() for k in batch.kv.keys]
    assert batch.n_rows == 0 and batch.size_bytes == size_one // 256 * 768 * 4  # kept for the next rows
    for c in caches[::-1]:  # rows again, in another order: written into the kept buffers, nothing allocated
        batch.join(c, 100)
    assert [k.data_ptr() for k in batch.kv.keys] == held
    fresh = DecodeBatch(rt)
    for c in caches[::-1]:
        fresh.join(c, 100)
    torch.testing.assert_close(batch.step([1, 2, 3]), fresh.step([1, 2, 3]))  # what the earlier rows left is unread
    for row in (2, 1, 0):
        batch.leave(row)
    batch.kv.release()
    assert batch.size_bytes == 0


def test_a_batch_told_how_many_rows_are_coming_grows_once_for_all():
    """Eight requests admitted together: the first join allocates eight slots, and no later join reallocates."""
    rt = tiny_runtime("llama")
    batch = DecodeBatch(rt)
    buffers = set()
    for i in range(8):
        c = new_cache(rt.model.config)
        rt.forward(random_ids(12 + i, seed=i), 0, c)
        batch.join(c, 40, rows=8)  # the engine counts the running rows and the admitted ones still coming
        buffers.add(batch.kv.keys[0].data_ptr())
    assert batch.kv.slots == 8 and len(buffers) == 1
