"""The vLLM engine's side in skillcache, against a stand-in vLLM that records what it was sent (the real server is
test_vllm_e2e.py's): which head, which salt, what is counted, what is refused. Tiny random-weight model."""

from __future__ import annotations

import pytest

from appclient import make_client
from tiny import tiny_spec
from service import metrics
from service.vllm import background as vllm_engine
from service.compose.pipeline import ComposeParams, SkillRef
from service.errors import EngineUnavailable
from service.vllm.client import Chunk
from service.vllm.transfer import Transfer

TEXT_A = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu " * 3
TEXT_B = "one two three four five six seven eight nine ten eleven twelve " * 3


class FakeVllm:
    """Answers like vLLM: `loads` decides whether the connector took the head (cached_tokens)."""

    def __init__(self) -> None:
        self.sent: list[dict] = []
        self.up, self.loads = True, True
        self.prefix_cache = False  # True: like vLLM's, per salt, in blocks of BLOCK tokens
        self.top_exact = [("Hel", -0.1), ("Hi", -2.5)]  # first-token logprobs asked for (fidelity checks)
        self.top_composed = [("Hel", -0.12), ("Hi", -2.4)]

    BLOCK = 16

    def _hit(self, ids: list[int], salt: str) -> int:
        """Tokens of `ids` an earlier request under the same salt computed, in whole blocks."""
        best = 0
        for old in (x["ids"] for x in self.sent if x["salt"] == salt):
            n = next((i for i, (a, b) in enumerate(zip(ids, old)) if a != b), min(len(ids), len(old)))
            best = max(best, n // self.BLOCK * self.BLOCK)
        return best

    async def health(self) -> bool:
        return self.up

    async def stream(self, ids, gen, cache_salt, transfer, usage):
        if not self.up:
            raise EngineUnavailable("vLLM at fake is not answering")
        head = n_head(transfer) if self.loads else 0
        if self.prefix_cache:
            head = max(head, self._hit(ids, cache_salt))
        self.sent.append({"ids": list(ids), "salt": cache_salt, "transfer": transfer, "max_tokens": gen.max_tokens,
                          "logprobs": gen.logprobs, "ignore_eos": gen.ignore_eos})
        usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens = len(ids), head, 2
        top = None
        if gen.logprobs:  # vLLM's top-k of the first position: the full prefill's, or the composed one's
            top = self.top_exact if cache_salt.startswith(("exact:", "check:")) else self.top_composed
        yield Chunk("Hel", [1], None, top)
        yield Chunk("lo", [2], "stop")

    async def choose(self, ids, choices, cache_salt, transfer, max_tokens) -> str:
        self.sent.append({"ids": list(ids), "salt": cache_salt, "transfer": transfer, "choices": list(choices)})
        return choices[-1]  # not the first: the choice is vLLM's

    async def prefill(self, ids, cache_salt, transfer=None, priority=0) -> None:
        self.sent.append({"ids": list(ids), "salt": cache_salt, "prefill": True, "priority": priority,
                          "transfer": {"skillcache": transfer.to_dict()} if transfer is not None else None})

    async def close(self) -> None:
        return None


@pytest.fixture
def env(tmp_path):
    fake = FakeVllm()
    with make_client(tmp_path, runtime=tiny_spec(), engine="vllm") as c:  # no weights, as make run-vllm runs
        state = c.app.state.skillcache
        c.portal.call(state.wait_ready)
        state.pipeline.runner.client = fake
        for name, text in (("a", TEXT_A), ("b", TEXT_B)):
            assert c.post("/v1/skills", json={"name": name, "text": text}).status_code in (200, 201)
        yield c, fake, state.pipeline.runner, tmp_path


def n_head(transfer: dict | None) -> int:
    """Tokens the final request's transfer loads (0: none)."""
    return Transfer.from_dict(transfer["skillcache"]).n_load if transfer else 0


def sent_by(fake, kind: str) -> list[dict]:
    """What the fake was sent, by kind: compile (a block saved from 0), step (a run saved after pieces), final."""
    out = []
    for x in fake.sent:
        t = Transfer.from_dict(x["transfer"]["skillcache"]) if x["transfer"] else None
        save = t.save if t is not None else None
        k = "final" if not x.get("prefill") else "compile" if save is not None and save.name.startswith("blk-") \
            else "step" if save is not None else "prefill"
        if k == kind:
            out.append(x)
    return out


def compose(c, skills, user="What now?", **kw):
    r = c.post("/v1/compose", json={"skills": skills, "user": user, "max_tokens": 4, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def count(outcome: str) -> float:
    return metrics.VLLM_HEADS.labels(outcome)._value.get()


def test_the_head_is_built_inside_vllm_blocks_compiled_seams_computed_in_steps_then_loaded(env):
    c, fake, runner, tmp = env
    out = compose(c, ["a", "b"])
    final = fake.sent[-1]
    assert final["salt"].startswith("approx:default:") and not final.get("prefill")
    pipeline = c.app.state.skillcache.pipeline
    prep = c.portal.call(pipeline.prepare, ComposeParams(skills=[SkillRef("a"), SkillRef("b")],
                                                          messages=[{"role": "user", "content": "What now?"}]))
    chain, seams, blocks = runner.plan(prep)
    anchor = list(runner.rt.anchor)
    # each block compiled once by vLLM, in its canonical context (after the anchor), its K/V saved whole
    compiles = sent_by(fake, "compile")
    assert sorted(tuple(x["ids"]) for x in compiles) == sorted(tuple(anchor[:b] + ids) for _, ids, b in blocks)
    for x in compiles:  # at registration, ahead of use: behind live requests
        assert x["priority"] > 0 and x["transfer"]["skillcache"]["save"][1:] == [0, len(x["ids"])]
    assert [s["source"] for s in out["skills"]] == ["engine", "engine"]
    # the second block's seam is computed by vLLM against the copied first block: one step, saved, then loaded
    (step,) = sent_by(fake, "step")
    assert seams == {0: 0, 1: prep.seams[1]} and len(chain.steps) == 1
    assert step["salt"] == final["salt"] and step["transfer"] == {"skillcache": chain.steps[0][1].to_dict()}
    assert step["ids"] == final["ids"][:chain.steps[0][0]]
    assert final["transfer"] == {"skillcache": chain.final.to_dict()} and n_head(final["transfer"]) == chain.n_head
    u = out["usage"]
    assert u["composed_tokens"] == chain.n_copied and u["prefix_tokens"] == 0
    assert u["recomputed_tokens"] == len(final["ids"]) - chain.n_copied > 0
    assert out["text"] == "Hello" and out["skills"][1]["seam"] == prep.seams[1]
    assert not list(tmp.rglob("*.safetensors")) and not list(tmp.rglob("pool-*"))  # no K/V passes through here


def test_a_block_first_used_unregistered_is_compiled_by_its_request_at_live_priority(env):
    c, fake, _, _ = env
    r = c.post("/v1/skills?compile=false", json={"name": "late", "text": TEXT_B + " and more"})
    assert r.status_code in (200, 201) and not [x for x in sent_by(fake, "compile") if x["priority"] == 0]
    out = compose(c, ["late"])
    (live,) = [x for x in sent_by(fake, "compile") if x["priority"] == 0]
    assert out["skills"][0]["source"] == "compiled" and fake.sent.index(live) < len(fake.sent) - 1
    assert compose(c, ["late"])["skills"][0]["source"] == "engine"


def test_a_repeated_composition_keeps_its_salt_and_runs_no_compile_and_no_step(env):
    c, fake, _, _ = env
    compose(c, ["a", "b"], "first turn")
    n = len(fake.sent)
    compose(c, ["a", "b"], "another, longer turn than the first one")
    first, second = fake.sent[n - 1], fake.sent[-1]
    assert len(fake.sent) == n + 1  # the final request alone
    assert first["salt"] == second["salt"] and first["transfer"] == second["transfer"]
    compose(c, ["b", "a"], "first turn")
    assert fake.sent[-1]["salt"] != first["salt"]  # another order: another composition, another salt
    assert len(sent_by(fake, "compile")) == 2  # and no new compile: both blocks are saved


def test_full_mode_and_other_namespaces_never_share_a_composed_salt(env):
    c, fake, _, _ = env
    compose(c, ["a", "b"])
    approx = fake.sent[-1]["salt"]
    out = compose(c, ["a", "b"], mode="full")
    assert fake.sent[-1]["salt"] == "exact:default" and fake.sent[-1]["transfer"] is None
    assert out["usage"]["composed_tokens"] == 0
    assert approx.startswith("approx:default:")
    from service.vllm.background import approx_salt, exact_salt

    assert approx_salt("other", "d") != approx_salt("default", "d") and exact_salt("other") != exact_salt("default")


def exact_live(fake) -> list[dict]:
    """The live requests sent under an order's own exact salt with nothing to load: refining and refined requests."""
    return [x for x in fake.sent if x["salt"].startswith("exact:default:") and not x.get("prefill")
            and x["transfer"] is None]


def test_refinement_sends_the_next_request_of_an_order_exact_and_no_background_prefill(env):
    """An order composed SKILLCACHE_VLLM_REFINE_AFTER times: its next request goes out exact (vLLM prefills the whole
    prompt, at live priority, as vLLM alone would) and so do the ones after it, from vLLM's prefix cache; no
    background prefill is ever sent for it (one vLLM cannot interrupt held a live first token 2.2 s)."""
    c, fake, runner, _ = env
    runner.refine_after = 1
    before = count("refined")
    first = compose(c, ["b", "a"])
    assert fake.sent[-1]["salt"].startswith("approx:") and first["usage"]["composed_tokens"] > 0
    assert not exact_live(fake) and count("refined") == before
    second = compose(c, ["b", "a"], "a new turn")
    (refining,) = exact_live(fake)
    assert refining is fake.sent[-1] and second["usage"]["composed_tokens"] == 0 and count("refined") == before + 1
    compose(c, ["b", "a"], "a third turn")
    assert fake.sent[-1]["salt"] == refining["salt"] and fake.sent[-1]["transfer"] is None
    c.portal.call(__import__("asyncio").sleep, 0.3)  # a quiet moment: background work would go now
    assert not [x for x in fake.sent if x["salt"] == refining["salt"] and x.get("prefill")]
    compose(c, ["b", "a"], mode="full")  # vLLM's exact prefill of the prompt, under the tenant's exact salt
    assert fake.sent[-1]["salt"] == "exact:default" != refining["salt"]
    compose(c, ["a", "b"])  # another order: composed, its own count
    assert fake.sent[-1]["salt"].startswith("approx:")


def test_refinement_waits_for_an_order_seen_often_by_default(env):
    c, fake, runner, _ = env
    assert runner.refine_after == 64
    for i in range(64):
        compose(c, ["a", "b"], f"turn {i}")
    assert not exact_live(fake)
    compose(c, ["a", "b"], "turn 64")
    assert exact_live(fake) == [fake.sent[-1]]


def test_a_refining_request_that_fails_leaves_the_order_composed_and_the_next_one_refines(env):
    c, fake, runner, _ = env
    runner.refine_after = 1
    compose(c, ["a", "b"])
    fake.up = False
    r = c.post("/v1/compose", json={"skills": ["a", "b"], "user": "down?", "max_tokens": 4})
    assert r.status_code == 503 and not runner.heads.exact
    fake.up = True
    compose(c, ["a", "b"], "up again")
    assert exact_live(fake)[-1] is fake.sent[-1] and runner.heads.exact


def wait_sent(c, fake, n: int, timeout_s: float = 10.0, saves: int = 1) -> list[dict]:
    """What was sent after the first n requests, once it has `saves` requests that save (a compile's last)."""
    import asyncio
    import time

    deadline = time.monotonic() + timeout_s
    while sum(1 for x in fake.sent[n:] if x["transfer"] and x.get("prefill")) < saves:
        assert time.monotonic() < deadline, "nothing saved was sent"
        c.portal.call(asyncio.sleep, 0.02)
    return fake.sent[n:]


def compile_ahead(c, fake, name: str, text: str, timeout_s: float = 10.0) -> list[dict]:
    """Registers a skill; the prefills of its compile ahead once the last (the one that saves) is sent: they wait for
    a quiet moment."""
    wait_sent(c, fake, 0, saves=2)  # the fixture's skills' compiles ahead
    n = len(fake.sent)
    assert c.post("/v1/skills", json={"name": name, "text": text}).status_code in (200, 201)
    out = wait_sent(c, fake, n, timeout_s)
    assert all(x.get("prefill") and x["salt"] == "compile:default" for x in out)
    return out


def test_background_prefills_go_in_steps_of_256_new_tokens_by_default(env):
    c, fake, runner, _ = env
    assert runner.bg.chunk == 256  # SKILLCACHE_VLLM_BACKGROUND_CHUNK's default
    runner.bg.chunk = 64
    steps = compile_ahead(c, fake, "long", TEXT_A * 4)
    ends = [len(x["ids"]) for x in steps]
    assert len(steps) > 1 and ends == sorted(ends) and max(b - a for a, b in zip([0] + ends, ends)) <= 64
    assert all(x["priority"] > 0 for x in steps)  # behind live work
    *early, last = steps  # the connector saves the whole block from the last request's blocks
    assert not any(x["transfer"] for x in early) and last["transfer"]["skillcache"]["save"][1:] == [0, ends[-1]]


def test_background_prefills_wait_while_a_live_request_is_in_flight(env):
    c, fake, runner, _ = env
    wait_sent(c, fake, 0, saves=2)  # the fixture's skills' compiles ahead
    runner.bg.live = 1  # a live stream in flight
    n = len(fake.sent)
    done = c.portal.start_task_soon(c.app.state.skillcache.pipeline.compile_skill, "default", TEXT_B + " waits")
    c.portal.call(__import__("asyncio").sleep, 0.3)
    assert len(fake.sent) == n and not done.done()  # the compile ahead waits
    runner.bg.live = 0
    done.result(timeout=10)
    assert wait_sent(c, fake, n)


def test_background_prefills_wait_for_a_quiet_moment_after_a_live_request_ends(env):
    """A client's next request comes right after a response: a background prefill (one vLLM cannot interrupt) sent
    in that moment would hold its first token (bench/peers_vllm.py arm c: 2.2 s), so it waits SKILLCACHE_BACKGROUND_
    IDLE_MS after the last live request ended."""
    c, fake, runner, _ = env
    assert runner.bg.idle_s == 0.1  # the setting's default, as on the embedded engine
    runner.bg.idle_s = 3600.0  # the moment after the response never ends here ...
    wait_sent(c, fake, 0, saves=2)  # the fixture's skills' compiles ahead
    compose(c, ["a", "b"], "first")
    n = len(fake.sent)
    done = c.portal.start_task_soon(c.app.state.skillcache.pipeline.compile_skill, "default", TEXT_B + " waits")
    c.portal.call(__import__("asyncio").sleep, 0.3)
    assert len(fake.sent) == n and not done.done()
    runner.bg.idle_s = 0.0  # ... until it does
    done.result(timeout=10)
    assert wait_sent(c, fake, n)


def test_a_head_vllm_did_not_load_is_counted_and_reported_as_computed(env):
    c, fake, _, _ = env
    fake.loads = False
    before = count("rejected")
    out = compose(c, ["a"], "rejected?")
    assert count("rejected") == before + 1
    assert out["usage"]["composed_tokens"] == 0 and out["usage"]["recomputed_tokens"] == out["usage"]["prompt_tokens"]


def test_vllm_down_is_503_engine_unavailable_and_not_ready(env):
    c, fake, _, _ = env
    fake.up = False
    r = c.post("/v1/compose", json={"skills": ["a"], "user": "hi", "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["type"] == "engine_unavailable"
    ready = c.get("/readyz")
    assert ready.status_code == 503 and "down" in ready.json()["engine"]
    fake.up = True
    assert c.get("/readyz").status_code == 200


def tool(name: str) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": {}}}}


def turn(c, sid: str, user: str, **kw) -> dict:
    r = c.post(f"/v1/sessions/{sid}/turns", json={"user": user, "max_tokens": 4, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_session_sends_each_turn_whole_under_its_heads_salt(env):
    c, fake, _, _ = env
    fake.prefix_cache = True
    r = c.post("/v1/sessions", json={"skills": ["a", "b"], "system": "Be brief."})
    assert r.status_code == 201, r.text
    sid, created = r.json()["id"], fake.sent[-1]
    assert created["max_tokens"] == 1 and created["transfer"] is not None  # turn 0: the head prefilled on vLLM
    assert created["salt"].startswith("approx:default:")
    assert 0 < r.json()["usage"]["reused_tokens"] <= n_head(created["transfer"])
    first = turn(c, sid, "What now?")
    t1 = fake.sent[-1]
    assert t1["salt"] == created["salt"] and t1["ids"][: len(created["ids"])] == created["ids"]
    assert t1["transfer"]["skillcache"] == created["transfer"]["skillcache"]  # the same head, built once
    assert first["text"] == "Hello" and first["usage"]["reused_tokens"] >= r.json()["usage"]["reused_tokens"]
    second = turn(c, sid, "And then?")
    t2 = fake.sent[-1]
    assert t2["salt"] == t1["salt"] and t2["ids"][: len(t1["ids"])] == t1["ids"]  # the conversation, whole
    assert second["usage"]["prefix_tokens"] >= len(t1["ids"]) // FakeVllm.BLOCK * FakeVllm.BLOCK  # vLLM kept turn 1
    assert second["usage"]["recomputed_tokens"] == len(t2["ids"]) - second["usage"]["reused_tokens"]
    got = c.get(f"/v1/sessions/{sid}").json()
    assert got["turns"] == 2 and [m["content"] for m in got["messages"] if m["role"] == "assistant"] == ["Hello"] * 2


def test_a_session_on_vllm_edits_by_erratum_resumes_from_its_document_and_runs_full_on_the_exact_salt(env):
    c, fake, _, _ = env
    sid = c.post("/v1/sessions", json={"skills": ["a"]}).json()["id"]
    turn(c, sid, "hi")
    before = fake.sent[-1]
    r = c.post("/v1/skills", json={"name": "f", "text": "The plan is {{plan}}. " + TEXT_B,
                                   "fields": {"plan": "basic"}})
    assert r.status_code in (200, 201), r.text
    sid_f = c.post("/v1/sessions", json={"skills": ["f"]}).json()["id"]
    head = fake.sent[-1]
    out = turn(c, sid_f, "which plan?", fields={"plan": "gold"})
    assert out["edits"][0]["fields"] == ["plan"] and fake.sent[-1]["salt"] == head["salt"]  # the head is unchanged
    pipeline = c.app.state.skillcache.pipeline
    assert "gold" in pipeline.rt.tokenizer.decode(fake.sent[-1]["ids"][len(head["ids"]):])  # the erratum, after it
    sessions = c.app.state.skillcache.sessions
    sessions.live.clear()  # another replica: the document is the whole session (vLLM holds its K/V)
    c.portal.call(sessions.drain)
    turn(c, sid, "again")
    assert fake.sent[-1]["ids"][: len(before["ids"])] == before["ids"] and fake.sent[-1]["salt"] == before["salt"]
    sid_full = c.post("/v1/sessions", json={"skills": ["a"], "mode": "full"}).json()["id"]
    turn(c, sid_full, "hi")
    assert fake.sent[-1]["salt"] == "exact:default" and fake.sent[-1]["transfer"] is None


def test_required_among_several_tools_is_vllms_choice_then_the_reply_continues_after_it(env):
    c, fake, _, _ = env
    r = c.post("/v1/compose", json={"skills": ["a"], "user": "hi", "max_tokens": 4, "tools": [tool("f"), tool("g")],
                                    "tool_choice": "required"})
    assert r.status_code == 200, r.text
    choice, reply = fake.sent[-2], fake.sent[-1]
    assert [x.split('"')[0] for x in choice["choices"]] == ["f", "g"]
    assert choice["salt"] == reply["salt"] and choice["transfer"] == reply["transfer"]  # the head, loaded either way
    tail = reply["ids"][len(choice["ids"]):]
    tok = c.app.state.skillcache.pipeline.rt.tokenizer
    assert reply["ids"][: len(choice["ids"])] == choice["ids"] and tok.decode(tail).startswith('g"')
    out = r.json()
    assert out["usage"]["prompt_tokens"] == len(reply["ids"])
    assert [t["function"]["name"] for t in out["tool_calls"]] == ["g"] and out["finish_reason"] == "tool_calls"


def test_tools_and_memories_go_to_vllm_inside_the_head(env):
    c, fake, _, _ = env
    compose(c, ["a"], "call it", tools=[tool("lookup")])  # the tools block compiled for it counts as recomputed
    out = compose(c, ["a"], "call it again", tools=[tool("lookup")])
    sent = fake.sent[-1]
    assert out["tools"]["path"] == "compose" and sent["transfer"] is not None  # the tools block is in the head
    assert 0 < out["usage"]["composed_tokens"] <= n_head(sent["transfer"])
    assert c.post("/v1/memories", json={"name": "m", "text": "- plan: gold\n- city: Oslo"}).status_code in (200, 201)
    compose(c, ["a"], "where do I live?")
    plain = n_head(fake.sent[-1]["transfer"])
    out = compose(c, ["a"], "where do I live?", memory="m")
    with_memory = n_head(fake.sent[-1]["transfer"])
    assert with_memory > plain and out["memory"] is not None  # the memory's blocks are composed into the head
    assert out["usage"]["recomputed_tokens"] == out["usage"]["prompt_tokens"] - out["usage"]["composed_tokens"]


def test_vllms_prefix_cache_on_a_prompt_with_no_head_is_reported_as_auto_like_the_embedded_engines(env):
    """No skills (or mode=full): the exact salt and no head; what vLLM's prefix cache serves is an automatic head, in
    usage (auto_tokens, part of prefix_tokens) and in skillcache_prompt_tokens_total{kind="auto"}."""
    c, fake, _, _ = env
    fake.prefix_cache = True
    system = "You are a support agent. " + TEXT_A + TEXT_B
    first = compose(c, [], "first turn", system=system)
    assert fake.sent[-1]["salt"] == "exact:default" and fake.sent[-1]["transfer"] is None
    assert first["usage"]["auto_tokens"] == first["usage"]["prefix_tokens"] == 0
    auto = metrics.TOKENS.labels("auto")._value.get()
    again = compose(c, [], "another turn", system=system)
    u = again["usage"]
    assert u["prefix_tokens"] == u["auto_tokens"] == u["reused_tokens"] > 0 and u["composed_tokens"] == 0
    assert u["auto_tokens"] % FakeVllm.BLOCK == 0 and u["recomputed_tokens"] == u["prompt_tokens"] - u["auto_tokens"]
    assert metrics.TOKENS.labels("auto")._value.get() == auto + u["auto_tokens"]


def test_past_a_refined_head_vllms_prefix_cache_counts_as_auto_and_the_head_as_prefix(env):
    c, fake, runner, _ = env
    fake.prefix_cache = True
    runner.refine_after = 1
    composed = compose(c, ["a", "b"], "the same turn")  # composed; its next request refines
    h = n_head(fake.sent[-1]["transfer"])
    out = compose(c, ["a", "b"], "the same turn")  # the order's exact salt, no head: vLLM computes the whole prompt
    assert fake.sent[-1]["salt"].startswith("exact:default:") and fake.sent[-1]["transfer"] is None
    assert out["usage"]["prefix_tokens"] == out["usage"]["auto_tokens"] == 0 and composed["text"] == out["text"]
    again = compose(c, ["a", "b"], "the same turn")  # now the whole prompt, but its last partial block
    u = again["usage"]
    assert u["prefix_tokens"] > h and u["auto_tokens"] == u["prefix_tokens"] - h
    other = compose(c, ["a", "b"], "another turn altogether")["usage"]  # the head and what follows it alike
    assert other["prefix_tokens"] >= h // FakeVllm.BLOCK * FakeVllm.BLOCK
    assert other["auto_tokens"] == max(0, other["prefix_tokens"] - h)


def test_sections_compose_on_vllm_where_its_exact_prefix_cache_misses_and_a_repeat_stays_exact(tmp_path):
    """With automatic reuse on, a system prompt's sections are compiled by vLLM (background priority) on first sight
    and the prompt goes as text under the exact salt; sent again as it was, it stays text (vLLM's exact prefix cache
    serves it); the same sections in another order compose: the held blocks loaded into vLLM by the connector."""
    from tests.compose.test_sections import section

    fake = FakeVllm()
    with make_client(tmp_path, runtime=tiny_spec(), engine="vllm", auto_reuse=True) as c:
        state = c.app.state.skillcache
        c.portal.call(state.wait_ready)
        state.pipeline.runner.client = fake
        one, two = section("Refunds"), section("Shipping")
        for _ in range(2):  # first sight, then the same prompt again
            body = compose(c, [], system=f"{one}\n\n{two}")
            c.portal.call(state.pipeline.guard.drain)
            assert body["skills"] == [] and body["usage"]["composed_tokens"] == 0
            final = [x for x in fake.sent if not x.get("prefill")][-1]
            assert final["salt"] == "exact:default" and final["transfer"] is None
        compiles = sent_by(fake, "compile")
        assert len(compiles) == 2 and {x["priority"] for x in compiles} == {vllm_engine.BACKGROUND}
        body = compose(c, [], system=f"{two}\n\n{one}")  # the exact prefix cache misses this order
        assert [s["name"][:6] for s in body["skills"]] == ["block-", "block-"] and body["usage"]["composed_tokens"] > 0
        final = fake.sent[-1]
        assert final["salt"].startswith("approx:default:") and n_head(final["transfer"]) > 0
        assert len(sent_by(fake, "compile")) == 2  # both sections were held: nothing compiled for this request


def test_shadow_checks_on_vllm_compare_the_composed_head_with_vllms_full_prefill_and_degrade_on_a_miss(tmp_path):
    """A sampled composed request is checked after its response: its first-token top-k again under its salt (the
    head in vLLM's prefix cache) and vLLM's full prefill under the exact salt, at background priority. A decisive
    top-1 that differs degrades the skill: it is then served by vLLM's full prefill."""
    fake = FakeVllm()
    with make_client(tmp_path, runtime=tiny_spec(), engine="vllm", shadow_sample_rate=1.0) as c:
        state = c.app.state.skillcache
        c.portal.call(state.wait_ready)
        state.pipeline.runner.client = fake
        for name, text in (("a", TEXT_A), ("b", TEXT_B)):
            assert c.post("/v1/skills", json={"name": name, "text": text}).status_code in (200, 201)
        n = len(fake.sent)
        compose(c, ["a", "b"], "hello")
        c.portal.call(state.pipeline.guard.drain)
        # the full prefill under the checks' own salt: its chunks never serve a live exact request
        checks = [x for x in fake.sent[n:] if x.get("logprobs") or x["salt"] == "check:default"]
        composed = [x for x in checks if x.get("logprobs") and x["salt"].startswith("approx:")]
        full = [x for x in checks if x.get("logprobs") and x["salt"] == "check:default"]
        assert len(composed) == 1 and composed[0]["transfer"] is not None and len(full) == 1
        assert {x["priority"] for x in checks if x.get("prefill")} == {vllm_engine.BACKGROUND}  # the full prefill
        shadow = c.get("/v1/skills/b").json()["shadow"]
        assert shadow["checks"] == 1 and shadow["passed"] == 1 and 0 < shadow["tv_max"] < 0.1
        fake.top_composed = [("Hi", -0.1), ("Hel", -2.5)]  # composition now changes a decisive first token
        compose(c, ["a", "b"], "hello again")
        c.portal.call(state.pipeline.guard.drain)
        assert c.get("/v1/skills/b").json()["degraded"]
        out = compose(c, ["a", "b"], "and now?")
        assert "full" in [s["path"] for s in out["skills"]]
        assert fake.sent[-1]["salt"] == "exact:default" and fake.sent[-1]["transfer"] is None


def test_seam_calibration_on_vllm_picks_the_smallest_seam_that_keeps_vllms_top1(tmp_path):
    """seam_auto: a registered skill is calibrated with vLLM requests (probe prompts composed at each candidate seam
    against vLLM's full prefill); the seam found is what its compositions get."""
    fake = FakeVllm()
    with make_client(tmp_path, runtime=tiny_spec(), engine="vllm", seam_auto=True, seam_candidates=[2, 6]) as c:
        state = c.app.state.skillcache
        c.portal.call(state.wait_ready)
        state.pipeline.runner.client = fake
        assert c.post("/v1/skills", json={"name": "a", "text": TEXT_A}).status_code in (200, 201)
        c.portal.call(state.pipeline.guard.drain)
        cal = c.get("/v1/skills/a").json()["calibration"]
        assert cal["passed"] and cal["seam"] == 2 and cal["n_probes"] == 2 and cal["basis"].startswith("vLLM")
        assert all(x["priority"] == vllm_engine.BACKGROUND for x in fake.sent if x.get("prefill"))
        assert c.post("/v1/skills", json={"name": "b", "text": TEXT_B}).status_code in (200, 201)
        c.portal.call(state.pipeline.guard.drain)
        out = compose(c, ["a", "b"], "hello")
        assert [s["seam"] for s in out["skills"]] == [0, 2]  # the first is exact after the anchor; b's calibrated
        fake.top_composed = [("Hi", -0.1), ("Hel", -2.5)]  # no seam keeps the top-1: the whole block
        assert c.post("/v1/skills", json={"name": "c", "text": TEXT_A + " more"}).status_code in (200, 201)
        c.portal.call(state.pipeline.guard.drain)
        cal = c.get("/v1/skills/c").json()["calibration"]
        assert not cal["passed"] and cal["seam"] == c.get("/v1/skills/c").json()["n_tokens"]


def test_ignore_eos_reaches_vllm_as_its_own_field_and_only_when_asked(env):
    """Benchmarks compare replies of one length (vLLM's ignore_eos); a typed reply still ends where its JSON does."""
    import asyncio
    import json

    import httpx

    from service.runtime.params import GenParams
    from service.vllm.client import Usage, VllmClient

    c, fake, _, _ = env
    compose(c, ["a", "b"], ignore_eos=True)
    assert fake.sent[-1]["ignore_eos"] is True
    compose(c, ["a", "b"])
    assert fake.sent[-1]["ignore_eos"] is False
    assert c.post("/v1/compose", json={"skills": ["a"], "user": "x", "ignore_eos": "yes"}).status_code == 422

    bodies: list[dict] = []

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        bodies.append(json.loads(request.content))
        chunk = {"choices": [{"text": "x", "token_ids": [1], "finish_reason": "length"}]}
        return httpx.Response(200, text=f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n")

    async def run(gen: GenParams) -> None:
        client = VllmClient("http://vllm:8000")
        client.http = httpx.AsyncClient(base_url=client.base_url, transport=httpx.MockTransport(answer))
        async for _ in client.stream([1, 2], gen, None, None, Usage()):
            pass
        await client.http.aclose()

    asyncio.run(run(GenParams(max_tokens=3, ignore_eos=True)))
    asyncio.run(run(GenParams(max_tokens=3)))
    asyncio.run(run(GenParams(max_tokens=3, ignore_eos=True, json_schema='{"type": "object"}')))
    assert [b.get("ignore_eos") for b in bodies] == [True, None, None]
