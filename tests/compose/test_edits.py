"""Field edits on cached skills: exactness of the in-place path, fallbacks, and the API report."""

import torch

from service.config import Settings
from service.compose.edits import plan_edit
from service.registry.skill import SkillRecord, content_hash
from tiny import tiny_runtime

TEMPLATE = Settings().erratum_template
TEXT = "Refunds are allowed within 30 days. The order status is {{status}}. Check the status before you answer."


def _record(fields):
    return SkillRecord("default", "r", 1, TEXT, content_hash(TEXT, fields), 10, None, fields)


def _compose(rt, rec, values, mode, seam=2):
    edit = plan_edit(rt.prompts, rec, values, mode, TEMPLATE)
    block = rt.compile_block(rt.prompts.encode_content(edit.text))
    msgs = [{"role": "system", "content": "Decide."}, {"role": "user", "content": "Refund?"}]
    plan = rt.prompts.build(msgs, [edit.ids or block.token_ids], errata=edit.errata)
    for seg in plan.segments:
        if seg.kind == "skill":
            seg.recompute = list(edit.recompute)
    return edit, plan, block, rt.prefill(plan, [block], mode="compose", seam_tokens=seam)


def test_in_place_field_span_equals_oracle_at_layer0():
    rt = tiny_runtime("llama")
    rec = _record({"status": "A"})
    edit, plan, block, comp = _compose(rt, rec, {"status": "B"}, "in_place")
    assert edit.report[0]["mode"] == "in_place" and edit.recompute and not edit.errata
    oracle = rt.prefill(plan, [block], mode="full")  # full prefill of the new text's ids
    off = plan.skill_offsets()[0]
    for s, e in edit.recompute:
        span = slice(off + s, off + e)
        for t_c, t_o in ((comp.cache.layers[0].keys, oracle.cache.layers[0].keys),
                         (comp.cache.layers[0].values, oracle.cache.layers[0].values)):
            torch.testing.assert_close(t_c[:, :, span], t_o[:, :, span], atol=2e-4, rtol=1e-4)
    # and the stale block really held the old value there (the edit did something)
    stale = rt.prefill(rt.prompts.build([{"role": "system", "content": "Decide."},
                                         {"role": "user", "content": "Refund?"}],
                                        [block.token_ids]), [block], mode="full")
    s, e = edit.recompute[0]
    assert not torch.allclose(stale.cache.layers[0].keys[:, :, off + s:off + e],
                              oracle.cache.layers[0].keys[:, :, off + s:off + e])


def test_field_plus_erratum_with_whole_seam_equals_full_prefill():
    rt = tiny_runtime("qwen3")
    rec = _record({"status": "A"})
    edit, plan, block, comp = _compose(rt, rec, {"status": "B"}, "field+erratum", seam=10_000)
    assert edit.errata and edit.recompute
    full = rt.prefill(plan, [block], mode="full")
    torch.testing.assert_close(comp.logits, full.logits, atol=1e-4, rtol=1e-4)


def test_token_layout_change_falls_back_to_erratum():
    rt = tiny_runtime("llama")
    rec = _record({"status": "A"})
    edit = plan_edit(rt.prompts, rec, {"status": "a much longer status value"}, "field+erratum", TEMPLATE)
    assert edit.report[0]["mode"] == "erratum" and "fallback" in edit.report[0]
    assert edit.errata == [TEMPLATE.format(field="status", value="a much longer status value")]
    assert edit.recompute == []


def test_unchanged_values_and_recompile():
    rt = tiny_runtime("llama")
    rec = _record({"status": "A"})
    assert plan_edit(rt.prompts, rec, {"status": "A"}, "erratum", TEMPLATE).report == []
    edit = plan_edit(rt.prompts, rec, {"status": "B"}, "recompile", TEMPLATE)
    assert "status is B." in edit.text and not edit.errata


def test_edit_modes_over_the_api(client):
    client.post("/v1/skills", json={"name": "r", "text": TEXT, "fields": {"status": "A"}})
    base = {"skills": ["r"], "user": "Refund?", "max_tokens": 2, "fields": {"status": "B"}}
    for mode, expect in [("erratum", "erratum"), ("field+erratum", "field+erratum"), ("in_place", "in_place"),
                         ("recompile", "recompile")]:
        r = client.post("/v1/compose", json={**base, "edit_mode": mode})
        assert r.status_code == 200, r.text
        assert r.json()["edits"][0]["mode"] == expect
    rc = client.post("/v1/compose", json={**base, "edit_mode": "recompile"}).json()
    assert rc["skills"][0]["source"] == "memory"  # the variant was compiled once, then cached
    home = client.app.state.skillcache.settings.home
    assert len(list((home / "store" / "blocks").rglob("*.safetensors"))) == 1  # the skill's; not the variant's
    ip = client.post("/v1/compose", json={**base, "edit_mode": "in_place"}).json()
    er = client.post("/v1/compose", json={**base, "edit_mode": "erratum"}).json()
    assert ip["usage"]["prompt_tokens"] < er["usage"]["prompt_tokens"]  # no appended line
    assert ip["usage"]["recomputed_tokens"] > 0


def test_a_declared_field_the_text_never_uses_is_applied_as_an_erratum_in_every_mode(client):
    """It has no tokens to recompute in place (this was a 500: KeyError on its spans)."""
    client.post("/v1/skills", json={"name": "u", "text": TEXT, "fields": {"status": "A", "tier": "basic"}})
    line = TEMPLATE.format(field="tier", value="gold")
    base = {"skills": ["u"], "user": "Refund?", "max_tokens": 2, "fields": {"tier": "gold"}}
    for mode in ("erratum", "field+erratum", "in_place", "recompile"):
        r = client.post("/v1/compose", json={**base, "edit_mode": mode})
        assert r.status_code == 200, (mode, r.text)
        lines = [x for e in r.json()["edits"] for x in e.get("lines", [])]
        assert lines == [line], (mode, r.json()["edits"])
    both = client.post("/v1/compose", json={**base, "edit_mode": "in_place", "fields": {"tier": "gold", "status": "B"}})
    edits = both.json()["edits"]
    assert [e["mode"] for e in edits] == ["in_place", "erratum"] and edits[1]["fallback"]
    assert both.json()["usage"]["recomputed_tokens"] > 0
