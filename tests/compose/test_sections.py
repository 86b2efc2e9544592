"""System-prompt sections as blocks with nothing registered (SKILLCACHE_AUTO_SECTIONS, service/compose/sections.py
and autoblocks.py): the cut rule, compiled in the background on first sight, composed in another order or after
another preamble, demoted by the guard, refined, per tenant, within the memory tier's budget."""

import pytest

from service import metrics
from service.compose.sections import JOINER, cut_points, split_parts
from service.registry.skill import TextBlock
from tests.compose.test_auto_heads import RULES, _keys, client
from tests.store.store_helpers import metric
from tiny import tiny_runtime

WORDS = lambda s: s.split()  # noqa: E731  a stand-in tokenizer for the rule's tests


def section(name: str, n_tokens: int = 160) -> str:
    """A Markdown section of at least n_tokens tiny-tokenizer tokens, distinct per name."""
    rt = tiny_runtime("llama")
    lines = [f"# {name}"]
    while len(rt.prompts.encode_content("\n".join(lines))) < n_tokens:
        lines.append(f"{name} rule {len(lines)}: {RULES[len(lines) % len(RULES)]}")
    return "\n".join(lines)


A, B, C = section("Refunds"), section("Shipping"), section("Security")


# ---- the rule ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text", [
    "intro\n\n# A\na a\n\n## A1\nx\n\n# B\nb\n\n\n# C\nc",
    "<doc i=\"1\">\nhi\n</doc>\n\n<doc i=\"2\">\nbye\n</doc>\n\n# H\nx",
    "one\n\ntwo\n\n\nthree\n\n",
    "\n\n# leading blank\n\n# B",
])
@pytest.mark.parametrize("mode", ["headings", "paragraphs", "off"])
def test_the_parts_join_back_to_the_text(text, mode):
    assert JOINER.join(p.text for p in split_parts(text, mode, WORDS, 1, 100)) == text


def test_cuts_are_at_the_top_level_headings_or_tags_else_at_blank_lines():
    texts = lambda t, mode="headings": [p.text for p in split_parts(t, mode, WORDS, 1, 100)]  # noqa: E731
    assert texts("intro\n\n# A\na\n\n## A1\nx\n\n# B\nb") == ["intro", "# A\na\n\n## A1\nx", "# B\nb"]
    assert texts("## A\na\n\n### A1\nx\n\n## B\nb") == ["## A\na\n\n### A1\nx", "## B\nb"]
    assert texts("<d i=\"1\">\na\n</d>\n\n# x\ny\n\n<d>\nb\n</d>") == ["<d i=\"1\">\na\n</d>\n\n# x\ny", "<d>\nb\n</d>"]
    # no heading: blank lines; a longer run of newlines cuts at its last blank line, the rest stays before
    assert texts("one\n\ntwo\n\n\nthree") == ["one", "two\n", "three"]
    assert texts("# A\na\n\n\n\n# B\nb\n") == ["# A\na\n\n", "# B\nb\n"]
    assert texts("# A\na\n\nmore a\n\n# B\nb", "paragraphs") == ["# A\na", "more a", "# B\nb"]
    assert cut_points("# A\n\n# B", "off") == []
    assert texts("a\n\n#hashtag is not a heading") == ["a", "#hashtag is not a heading"]  # paragraphs then


def test_sections_are_the_parts_big_enough_and_seen_once():
    parts = split_parts("tiny\n\n# A\none two three\n\n# B\n" + "w " * 200 + "\n\n# A\none two three", "headings",
                        WORDS, 3, 100)
    assert [p.section for p in parts] == [False, True, False, False]  # too small, ok, too big, a repeat


# ---- in the service ----------------------------------------------------------------------------------------------
def compose(c, system: str, headers=None, **kw) -> dict:
    r = c.post("/v1/compose", headers=headers or {},
               json={"system": system, "user": "Can I get a refund?", "max_tokens": 2, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def drain(c) -> None:
    c.portal.call(c.app.state.skillcache.pipeline.guard.drain)


def n_tokens(text: str) -> int:
    return len(tiny_runtime("llama").prompts.encode_content(text))


def test_sections_compile_in_the_background_then_compose_moved_or_after_another_preamble(tmp_path):
    with client(tmp_path) as c:
        scheduled, composed = metric("skillcache_auto_blocks_total", outcome="scheduled"), \
            metric("skillcache_auto_blocks_total", outcome="composed")
        first = compose(c, JOINER.join([A, B, C]))
        assert first["usage"]["composed_tokens"] == 0 and first["skills"] == []  # first sight: text
        assert metric("skillcache_auto_blocks_total", outcome="scheduled") - scheduled == 3
        drain(c)
        moved = compose(c, JOINER.join([C, A, B]))
        assert len(moved["skills"]) == 3 and {s["source"] for s in moved["skills"]} == {"memory"}
        assert moved["usage"]["composed_tokens"] > 0.8 * sum(map(n_tokens, (A, B, C)))
        preamble = compose(c, JOINER.join(["You are the support agent of a new shop.", A, B, C]))
        assert preamble["usage"]["composed_tokens"] > 0.8 * sum(map(n_tokens, (A, B, C)))
        assert metric("skillcache_auto_blocks_total", outcome="composed") - composed == 6
        # the prompt's ids are the same whether its sections are held or not, and the same as mode=full's
        full = compose(c, JOINER.join([C, A, B]), mode="full")
        assert full["usage"]["prompt_tokens"] == moved["usage"]["prompt_tokens"]
        assert full["usage"]["composed_tokens"] == 0


def test_files_that_end_in_a_newline_compose_in_another_order(tmp_path):
    """Files joined by a blank line, each ending in a newline (three newlines between them), are cut at each file's
    heading, so their sections compose in any order (a cut only at a single blank line merged them in pairs)."""
    files = [A + "\n", B + "\n", C + "\n"]
    with client(tmp_path) as c:
        compose(c, JOINER.join(files))
        drain(c)
        moved = compose(c, JOINER.join(files[::-1]))
        assert len(moved["skills"]) == 3 and {s["path"] for s in moved["skills"]} == {"compose"}
        assert moved["usage"]["composed_tokens"] > 0.8 * sum(map(n_tokens, files))


def test_the_plan_ids_do_not_change_when_the_blocks_arrive(tmp_path):
    with client(tmp_path) as c:
        pipe = c.app.state.skillcache.pipeline
        from service.compose.pipeline import ComposeParams

        params = lambda: ComposeParams(skills=[], messages=[  # noqa: E731
            {"role": "system", "content": JOINER.join([B, A])}, {"role": "user", "content": "hi"}])
        before = c.portal.call(pipe.prepare, params())
        drain(c)
        after = c.portal.call(pipe.prepare, params())
        assert before.blocks == [] and len(after.blocks) == 2
        assert after.plan.ids == before.plan.ids


def test_a_degraded_section_is_text_and_the_rest_still_composes(tmp_path):
    with client(tmp_path) as c:
        state = c.app.state.skillcache
        compose(c, JOINER.join([A, B]))
        drain(c)
        key = str(state.registry.block_key("default", A))
        state.pipeline.guard.degraded[key] = {"cosine": 0.5}
        body = compose(c, JOINER.join([B, A]))
        assert [s["name"] for s in body["skills"]] == [TextBlock.of("default", B).name]
        assert body["usage"]["composed_tokens"] == n_tokens(B)  # B first, copied whole
        assert body["usage"]["recomputed_tokens"] > n_tokens(A)  # A computed as text, not the request in full
        assert [s["path"] for s in body["skills"]] == ["compose"]


def test_one_tenants_sections_never_serve_another(tmp_path):
    acme = {"Authorization": "Bearer acme-user-key-0123456789"}
    globex = {"Authorization": "Bearer globex-user-key-0123456789"}
    with client(tmp_path, api_keys_file=_keys(tmp_path)) as c:
        compose(c, JOINER.join([A, B]), acme)
        drain(c)
        assert compose(c, JOINER.join([B, A]), globex)["usage"]["composed_tokens"] == 0
        assert compose(c, JOINER.join([B, A]), acme)["usage"]["composed_tokens"] > 0


def test_a_stream_of_distinct_sections_stays_within_the_memory_tier(tmp_path):
    budget = 2 * 1024**2
    with client(tmp_path, store="memory", memory_cache_bytes=budget) as c:
        for i in range(12):
            compose(c, JOINER.join([section(f"Doc{i}a"), section(f"Doc{i}b")]))
            drain(c)
            assert metrics.MEMORY_BYTES._value.get() <= budget
        assert compose(c, JOINER.join([section("Doc11b"), section("Doc11a")]))["usage"]["composed_tokens"] > 0


def test_switched_off_the_system_text_is_one_part(tmp_path):
    with client(tmp_path, auto_sections="off") as c:
        compose(c, JOINER.join([A, B]))
        drain(c)
        assert compose(c, JOINER.join([B, A]))["usage"]["composed_tokens"] == 0
    with client(tmp_path, auto_reuse=False) as c:
        compose(c, JOINER.join([A, B]))
        drain(c)
        assert compose(c, JOINER.join([B, A]))["usage"]["composed_tokens"] == 0


def test_a_repeated_arrangement_of_sections_is_refined_into_an_exact_head(tmp_path):
    with client(tmp_path, refine_after=1) as c:
        compose(c, JOINER.join([A, B, C]))
        drain(c)
        compose(c, JOINER.join([C, B, A]))  # composed: counted, then refined in the background
        drain(c)
        r = c.post("/v1/compose", json={"system": JOINER.join([C, B, A]), "user": "Another question?",
                                        "max_tokens": 2})
        again = r.json()
        assert again["usage"]["prefix_tokens"] >= n_tokens(C) + n_tokens(B) + n_tokens(A)


def test_cache_control_blocks_compile_in_the_background_and_count_as_cache_writes(tmp_path):
    def messages(c, blocks: list[str]) -> dict:
        system = [{"type": "text", "text": t, "cache_control": {"type": "ephemeral"}} for t in blocks]
        r = c.post("/v1/messages", json={"model": "m", "max_tokens": 2, "system": system + [
            {"type": "text", "text": "Answer briefly."}], "messages": [{"role": "user", "content": "Refund?"}]})
        assert r.status_code == 200, r.text
        return r.json()["usage"]

    with client(tmp_path) as c:
        first = messages(c, [A])
        assert first["cache_creation_input_tokens"] == n_tokens(A)  # queued, not compiled on the request's clock
        assert first["cache_read_input_tokens"] == 0
        drain(c)
        second = messages(c, [B, A])  # A now after another block: composed from its block
        assert second["cache_creation_input_tokens"] == n_tokens(B)
        assert second["cache_read_input_tokens"] > 0.8 * n_tokens(A)


def test_a_section_is_calibrated_once_composed_not_when_compiled(tmp_path):
    calibrated = lambda: sum(metric("skillcache_calibrations_total", result=r)  # noqa: E731
                             for r in ("passed", "whole_block"))
    with client(tmp_path, seam_auto=True, seam_candidates=[0, 2]) as c:
        before = calibrated()
        compose(c, JOINER.join([A, B]))
        drain(c)
        assert calibrated() == before  # compiled, never used yet: nothing calibrated
        compose(c, JOINER.join([B, A]))
        drain(c)
        assert calibrated() == before + 2
