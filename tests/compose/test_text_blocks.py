"""Unregistered blocks named by their text (ComposeParams.blocks: the Messages API's cache_control blocks): compiled
once, content-addressed, composed at any position like a skill, in full mode the same prompt."""

from appclient import make_client
from service.compose.pipeline import ComposeParams, SkillRef
from service.runtime.params import GenParams

POLICY = "Refunds are allowed within 30 days of delivery when the item is unused. Braces {{stay}} text."
STYLE = "Answer in two short sentences, politely, and never promise a date you cannot keep."


async def _run(pipeline, **kw):
    p = ComposeParams(messages=[{"role": "user", "content": "Can I return it?"}], gen=GenParams(max_tokens=2), **kw)
    events = await pipeline.start(await pipeline.prepare(p))
    final = None
    async for ev in events:
        final = ev
    return final


def test_a_text_block_composes_at_any_position_and_is_compiled_once(tmp_path):
    with make_client(tmp_path) as c:
        state = c.app.state.skillcache
        c.portal.call(state.wait_ready)
        assert c.post("/v1/skills", json={"name": "style", "text": STYLE}).status_code == 201
        pipe = state.pipeline
        first = c.portal.call(lambda: _run(pipe, skills=[], blocks=[POLICY]))
        assert [s["source"] for s in first.skills] == ["compiled"] and first.skills[0]["name"].startswith("block-")
        # after a registered skill: the same block, from the store, composed at its new position
        moved = c.portal.call(lambda: _run(pipe, skills=[SkillRef("style")], blocks=[POLICY]))
        assert [s["source"] for s in moved.skills] == ["memory", "memory"]
        assert moved.skills[1]["content_hash"] == first.skills[0]["content_hash"]
        assert moved.usage["composed_tokens"] > 0
        full = c.portal.call(lambda: _run(pipe, skills=[SkillRef("style")], blocks=[POLICY], mode="full"))
        assert full.usage["prompt_tokens"] == moved.usage["prompt_tokens"] and full.usage["composed_tokens"] == 0
