"""Refined prefixes: a repeated skill sequence is prefilled in full when idle and then copied as an exact prefix."""

import logging
import re
import time

import pytest
import torch

from appclient import make_client
from service.errors import InternalError
from service.runtime.steps import run_steps
from tests.store.store_helpers import metric
from tiny import tiny_runtime

SKILLS = ["Refunds are allowed within 30 days of delivery when the item is unused.",
          "Tool specs: search(query), lookup(order_id), refund(order_id, amount).",
          "Answer politely and briefly. Use the current value of every field."]
MSGS = [{"role": "system", "content": "You are a support agent."}, {"role": "user", "content": "Can I get a refund?"}]


def _setup(n_skills: int = 3):
    rt = tiny_runtime("llama")
    ids = [rt.prompts.encode_content(s) for s in SKILLS[:n_skills]]
    return rt, ids, [rt.compile_block(i) for i in ids], rt.prompts.build(MSGS, ids)


def _exact_prefix(rt, ids: list[int], chunk: int):
    return run_steps(rt.exact_prefix_steps(ids, chunk))


def test_chunked_prefix_equals_full_prefill_and_composes_exactly():
    rt, ids, blocks, plan = _setup()
    ends = plan.skill_ends()
    prefix = _exact_prefix(rt, plan.ids[:ends[1]], chunk=7)  # the anchor and the first two skills, 7 at a time
    full = rt.prefill(plan, [], mode="full")
    for c, f in zip(prefix.keys + prefix.values, [x.keys for x in full.cache.layers] + [x.values for x in
                                                                                        full.cache.layers]):
        torch.testing.assert_close(c, f[:, :, :ends[1]], atol=1e-5, rtol=1e-5)  # [1, H_kv, N, D]
    # the third skill recomputed whole: then composition with the prefix is the full prefill
    comp = rt.prefill(plan, blocks, mode="compose", seam_tokens=[0, 0, len(ids[2])], prefix=prefix)
    torch.testing.assert_close(comp.logits, full.logits, atol=1e-4, rtol=1e-4)
    assert (comp.n_prefix, comp.n_reused) == (ends[1], 0)
    assert comp.n_recomputed == plan.n_tokens - ends[1]
    # and with the third skill composed (seam 4) it still counts as composed, after the exact prefix
    comp = rt.prefill(plan, blocks, mode="compose", seam_tokens=4, prefix=prefix)
    assert comp.n_reused == len(ids[2]) - 4


def test_prefix_improves_on_composition():
    """Control: the same prompt composed without the prefix is further from the full prefill."""
    rt, ids, blocks, plan = _setup(2)
    full = rt.prefill(plan, [], mode="full").logits
    prefix = _exact_prefix(rt, plan.ids[:plan.skill_ends()[1]], chunk=512)
    with_prefix = rt.prefill(plan, blocks, mode="compose", seam_tokens=4, prefix=prefix).logits
    composed = rt.prefill(plan, blocks, mode="compose", seam_tokens=4).logits
    torch.testing.assert_close(with_prefix, full, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(composed, full, atol=1e-3)


def test_prefix_must_match_and_end_at_a_segment_boundary():
    rt, ids, blocks, plan = _setup(2)
    end = plan.skill_ends()[1]
    with pytest.raises(InternalError):
        rt.prefill(plan, blocks, prefix=_exact_prefix(rt, plan.ids[:end - 1], chunk=512))
    other = list(plan.ids[:end])
    other[-1] = (other[-1] + 1) % 400
    with pytest.raises(InternalError):
        rt.prefill(plan, blocks, prefix=_exact_prefix(rt, other, chunk=512))


def _compose(c, skills, **extra):
    r = c.post("/v1/compose", json={"skills": skills, "user": "Can I get a refund?", "max_tokens": 3,
                                    "logprobs": 5, "seam_tokens": 2, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def test_service_refines_a_repeated_sequence(tmp_path):
    with make_client(tmp_path, refine_after=2, background_chunk_tokens=16) as c:
        state = c.app.state.skillcache
        c.portal.call(state.wait_ready)
        for name, text in zip("abc", SKILLS):
            assert c.post("/v1/skills", json={"name": name, "text": text}).status_code == 201
        guard = state.pipeline.guard
        before = metric("skillcache_refined_prefixes_total")
        first = _compose(c, ["a", "b"])
        c.portal.call(guard.drain)
        assert metric("skillcache_refined_prefixes_total") == before  # seen once: not yet
        assert [s["path"] for s in _compose(c, ["a", "b"])["skills"]] == ["compose", "compose"]
        c.portal.call(guard.drain)  # the second composition refined it when the worker was idle
        assert metric("skillcache_refined_prefixes_total") == before + 1

        refined = _compose(c, ["a", "b"])
        full = _compose(c, ["a", "b"], mode="full")
        assert [(s["path"], s["seam"]) for s in refined["skills"]] == [("prefix", None), ("prefix", None)]
        u = refined["usage"]
        assert u["composed_tokens"] == 0 and u["prefix_tokens"] > 0
        rt = state.runtime  # the prefix is the system turn: the anchor, a, the separator, b, up to the user message
        plan = rt.prompts.build([{"role": "user", "content": "Can I get a refund?"}],
                                [rt.prompts.encode_content(t) for t in SKILLS[:2]])
        assert plan.head_end > plan.skill_ends()[1]
        assert u["reused_tokens"] == u["prefix_tokens"] == plan.head_end > first["usage"]["reused_tokens"]
        assert u["recomputed_tokens"] == u["prompt_tokens"] - u["prefix_tokens"]
        for got, want in zip(refined["logprobs"], full["logprobs"]):
            assert got["logprob"] == pytest.approx(want["logprob"], abs=1e-4)  # exact, as the full prefill
        assert any(abs(x["logprob"] - y["logprob"]) > 1e-4 for x, y in zip(first["logprobs"], full["logprobs"]))

        longer = _compose(c, ["a", "b", "c"])  # opens with the refined skills [a, b]: composes only `c`
        assert [s["path"] for s in longer["skills"]] == ["prefix", "prefix", "compose"]
        assert longer["usage"]["prefix_tokens"] == plan.skill_ends()[1]
        swapped = _compose(c, ["b", "a"])  # another order is another sequence
        assert [s["path"] for s in swapped["skills"]] == ["compose", "compose"]
        c.portal.call(guard.drain)
        assert metric("skillcache_refined_prefixes_total") == before + 1


def test_refinement_off(tmp_path):
    with make_client(tmp_path, refine_after=0) as c:
        c.portal.call(c.app.state.skillcache.wait_ready)
        for name, text in zip("ab", SKILLS):
            c.post("/v1/skills", json={"name": name, "text": text})
        for _ in range(3):
            body = _compose(c, ["a", "b"])
            c.portal.call(c.app.state.skillcache.pipeline.guard.drain)
        assert body["usage"]["prefix_tokens"] == 0


def test_in_block_edits_are_not_refined(tmp_path):
    """in_place and field+erratum define which tokens are recomputed; an exact prefix would silently make them
    a full recompute. Erratum edits keep the skills' text, so they are refined like any other request."""
    with make_client(tmp_path, refine_after=1) as c:
        state = c.app.state.skillcache
        c.portal.call(state.wait_ready)
        c.post("/v1/skills", json={"name": "a", "text": "Order status: {{status}}. " + SKILLS[0],
                                   "fields": {"status": "x"}})
        c.post("/v1/skills", json={"name": "b", "text": SKILLS[1]})
        for mode in ("in_place", "field+erratum"):
            for _ in range(2):
                body = _compose(c, ["a", "b"], fields={"status": "y"}, edit_mode=mode)
                c.portal.call(state.pipeline.guard.drain)
            assert body["usage"]["prefix_tokens"] == 0 and body["edits"][0]["mode"] == mode
        for _ in range(2):
            body = _compose(c, ["a", "b"], fields={"status": "y"}, edit_mode="erratum")
            c.portal.call(state.pipeline.guard.drain)
        assert body["usage"]["prefix_tokens"] > 0


def test_session_created_on_a_refined_sequence_is_exact(tmp_path):
    with make_client(tmp_path, refine_after=1) as c:
        state = c.app.state.skillcache
        c.portal.call(state.wait_ready)
        for name, text in zip("ab", SKILLS):
            c.post("/v1/skills", json={"name": name, "text": text})

        def first_turn(**extra):
            s = c.post("/v1/sessions", json={"skills": ["a", "b"], "seam_tokens": 2, **extra}).json()
            c.portal.call(state.pipeline.guard.drain)
            r = c.post(f"/v1/sessions/{s['id']}/turns", json={"user": "Refund?", "max_tokens": 1, "logprobs": 5})
            return s["usage"], r.json()["logprobs"]

        composed, lp_composed = first_turn()  # composes, then refines [a, b] (refine_after=1)
        refined, lp_refined = first_turn()
        _, lp_full = first_turn(mode="full")
        assert refined["reused_tokens"] > composed["reused_tokens"]  # the separator and b's seam come exact too
        for got, want in zip(lp_refined, lp_full):
            assert got["logprob"] == pytest.approx(want["logprob"], abs=1e-4)
        assert any(abs(x["logprob"] - y["logprob"]) > 1e-4 for x, y in zip(lp_composed, lp_full))


def test_runtime_step_default_is_the_settings_default():
    from service.config import Settings
    from service.runtime.steps import BACKGROUND_CHUNK_TOKENS

    assert Settings().background_chunk_tokens == BACKGROUND_CHUNK_TOKENS


def test_a_prefix_through_the_system_turn_composes_exactly():
    """The head (skills, system text, up to the first message) ends inside a text segment: the rest of that
    segment still runs, and the logits are the full prefill's."""
    rt, ids, blocks, plan = _setup()
    assert plan.skill_ends()[-1] < plan.head_end < plan.n_tokens
    prefix = _exact_prefix(rt, plan.ids[:plan.head_end], chunk=9)
    comp = rt.prefill(plan, blocks, mode="compose", seam_tokens=4, prefix=prefix)
    full = rt.prefill(plan, [], mode="full")
    torch.testing.assert_close(comp.logits, full.logits, atol=1e-4, rtol=1e-4)
    assert (comp.n_prefix, comp.n_reused, comp.n_recomputed) == (plan.head_end, 0, plan.n_tokens - plan.head_end)


def test_incremental_refinement_prefills_only_the_new_part(monkeypatch):
    rt, ids, blocks, plan = _setup()
    ends = plan.skill_ends()
    held = _exact_prefix(rt, plan.ids[:ends[1]], chunk=16)
    steps = rt.exact_prefix_steps(plan.ids[:plan.head_end], 16, held)
    ran = []
    try:
        while True:
            ran.append(next(steps))
    except StopIteration as done:
        longer = done.value
    assert sum(ran) == plan.head_end - ends[1]  # the third skill and the system text, not the held two
    whole = _exact_prefix(rt, plan.ids[:plan.head_end], chunk=16)
    for a, b in zip(longer.keys + longer.values, whole.keys + whole.values):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_service_refines_incrementally_and_per_head(tmp_path):
    """Requests with different system texts share their skills: the skills level is refined (and kept) though
    no whole system turn repeats; a longer sequence is then refined from it, prefilling only its new part."""
    with make_client(tmp_path, refine_after=2, background_chunk_tokens=16) as c:
        state = c.app.state.skillcache
        c.portal.call(state.wait_ready)
        for name, text in zip("abc", SKILLS):
            assert c.post("/v1/skills", json={"name": name, "text": text}).status_code == 201
        guard = state.pipeline.guard
        for i in range(2):  # a unique system text each time
            _compose(c, ["a", "b"], system=f"You are agent number {i}.")
            c.portal.call(guard.drain)
        assert _compose(c, ["a", "b"], system="Yet another agent.")["usage"]["prefix_tokens"] > 0
        prefilled, copied = metric("skillcache_refine_tokens_total", kind="prefilled"), \
            metric("skillcache_refine_tokens_total", kind="copied")
        for _ in range(2):
            _compose(c, ["a", "b", "c"], system="Yet another agent.")
            c.portal.call(guard.drain)
        body = _compose(c, ["a", "b", "c"], system="Yet another agent.")
        assert [s["path"] for s in body["skills"]] == ["prefix"] * 3
        rt = state.runtime
        plan = rt.prompts.build([{"role": "system", "content": "Yet another agent."},
                                 {"role": "user", "content": "Can I get a refund?"}],
                                [rt.prompts.encode_content(t) for t in SKILLS])
        assert body["usage"]["prefix_tokens"] == plan.head_end
        ends = plan.skill_ends()
        assert metric("skillcache_refine_tokens_total", kind="copied") - copied == ends[1]
        assert metric("skillcache_refine_tokens_total", kind="prefilled") - prefilled == plan.head_end - ends[1]


@pytest.mark.parametrize("from_full", [True, False])
def test_a_full_prefill_donates_the_head_refinement_wants(tmp_path, from_full):
    """Background work held: with donation the mode=full request that follows the second composition gives the
    refined prefix (no background prefill); without it the head waits for the background."""
    with make_client(tmp_path, refine_after=2, background_chunk_tokens=16, refine_from_full=from_full) as c:
        state = c.app.state.skillcache
        c.portal.call(state.wait_ready)
        for name, text in zip("ab", SKILLS):
            assert c.post("/v1/skills", json={"name": name, "text": text}).status_code == 201
        guard, engine = state.pipeline.guard, state.engine
        engine.pause_background()
        donated, prefilled = metric("skillcache_refine_tokens_total", kind="donated"), \
            metric("skillcache_refine_tokens_total", kind="prefilled")
        _compose(c, ["a", "b"], mode="full")  # nothing wanted yet: a full request alone is not a repetition
        for _ in range(2):
            _compose(c, ["a", "b"])  # the second composition queues the refinement (held)
        full = _compose(c, ["a", "b"], mode="full")
        deadline = time.monotonic() + 60  # a hang guard: the donation is stored from the loop right after the prefill
        while from_full and metric("skillcache_refine_tokens_total", kind="donated") == donated:
            assert time.monotonic() < deadline, "no donation"
            time.sleep(0.01)
        refined = _compose(c, ["a", "b"])
        if not from_full:
            assert refined["usage"]["prefix_tokens"] == 0  # the refinement is still queued
            engine.resume_background()
            c.portal.call(guard.drain)
            refined = _compose(c, ["a", "b"])
        u = refined["usage"]
        assert [s["path"] for s in refined["skills"]] == ["prefix", "prefix"] and u["composed_tokens"] == 0
        for got, want in zip(refined["logprobs"], full["logprobs"]):
            assert got["logprob"] == pytest.approx(want["logprob"], abs=1e-4)
        got_donated = metric("skillcache_refine_tokens_total", kind="donated") - donated
        got_prefilled = metric("skillcache_refine_tokens_total", kind="prefilled") - prefilled
        assert (got_donated, got_prefilled) == ((u["prefix_tokens"], 0) if from_full else (0, u["prefix_tokens"]))
        engine.resume_background()
        c.portal.call(guard.drain)  # the queued refinement saw the donation and stopped: nothing more prefilled
        assert metric("skillcache_refine_tokens_total", kind="prefilled") - prefilled == got_prefilled


def test_a_queued_refinement_moves_ahead_as_its_order_repeats(tmp_path, caplog):
    """REFINE_AFTER=1, background held: a longer one-off order is queued first, then an order composed three times;
    the repeated one is refined first (its priority, times composed x tokens, is read when the engine picks)."""
    with make_client(tmp_path, refine_after=1, background_chunk_tokens=16) as c:
        state = c.app.state.skillcache
        c.portal.call(state.wait_ready)
        for name, text in zip("abc", SKILLS):
            assert c.post("/v1/skills", json={"name": name, "text": text}).status_code == 201
        guard, engine = state.pipeline.guard, state.engine
        engine.pause_background()
        one_off = _compose(c, ["c", "a", "b"])["usage"]["prompt_tokens"]
        for _ in range(3):
            repeated = _compose(c, ["a", "b"])["usage"]["prompt_tokens"]
        assert one_off > repeated  # so by length alone the one-off order would go first
        caplog.set_level(logging.INFO, logger="service.compose.refine")
        engine.resume_background()
        c.portal.call(guard.drain)
        refined = [int(re.search(r"refined a (\d+)-token", r.getMessage()).group(1)) for r in caplog.records
                   if r.getMessage().startswith("refined a ")]
        assert len(refined) == 2 and refined[0] < refined[1], refined  # the repeated order's shorter head first
        assert _compose(c, ["a", "b"])["usage"]["prefix_tokens"] == refined[0]


def test_a_head_composed_once_under_load_waits_for_its_second_composition():
    """REFINE_AFTER=1: a head composed once is queued when the engine serves nothing else; while other requests are
    served it waits for a second composition (most once-composed orders never recur, bench/background.py)."""
    from types import SimpleNamespace

    from service.compose.refine import PrefixRefiner

    rt, ids, blocks, plan = _setup()
    spawned = []
    guard = SimpleNamespace(engine=SimpleNamespace(serving=True), spawn=lambda coro: spawned.append(coro) or True)
    refiner = PrefixRefiner(after=1, chunk=16, runtime=rt, store=None, guard=guard)
    refiner.note("default", plan, 0)
    assert spawned == []  # once, under load: not queued
    refiner.note("default", plan, 0)
    assert len(spawned) == 1  # twice: queued whatever the load
    guard.engine.serving = False
    other = rt.prompts.build(MSGS, [ids[1], ids[0], ids[2]])
    refiner.note("default", other, 0)
    assert len(spawned) == 2  # once, on an engine serving nothing else: queued
    for coro in spawned:
        coro.close()
