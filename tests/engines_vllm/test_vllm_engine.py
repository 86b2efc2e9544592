"""The vLLM engine's side in skillcache, against a stand-in vLLM that records what it was sent (the real server is
test_vllm_e2e.py's): which head, which salt, what is counted, what is refused. Tiny random-weight model."""

from __future__ import annotations

import pytest
import torch

from appclient import make_client
from service import metrics
from service.compose.pipeline import ComposeParams, SkillRef
from service.errors import EngineUnavailable
from service.runtime.engine import run_steps
from service.vllm.client import Chunk
from service.vllm.heads import HeadReader, HeadRef

TEXT_A = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu " * 3
TEXT_B = "one two three four five six seven eight nine ten eleven twelve " * 3


class FakeVllm:
    """Answers like vLLM: `loads` decides whether the connector took the head (cached_tokens)."""

    def __init__(self) -> None:
        self.sent: list[dict] = []
        self.up, self.loads = True, True

    async def health(self) -> bool:
        return self.up

    async def stream(self, ids, gen, cache_salt, transfer, usage):
        if not self.up:
            raise EngineUnavailable("vLLM at fake is not answering")
        self.sent.append({"ids": list(ids), "salt": cache_salt, "transfer": transfer})
        head = transfer["skillcache"]["n_tokens"] if transfer and self.loads else 0
        usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens = len(ids), head, 2
        yield Chunk("Hel", [1])
        yield Chunk("lo", [2], "stop")

    async def prefill(self, ids, cache_salt) -> None:
        self.sent.append({"ids": list(ids), "salt": cache_salt, "transfer": None, "prefill": True})

    async def close(self) -> None:
        return None


@pytest.fixture
def env(tmp_path):
    fake = FakeVllm()
    with make_client(tmp_path, engine="vllm", vllm_heads_dir=tmp_path / "heads",
                     vllm_head_pool_bytes=64 * 1024**2) as c:
        state = c.app.state.skillcache
        c.portal.call(state.wait_ready)
        state.pipeline.runner.client = fake
        for name, text in (("a", TEXT_A), ("b", TEXT_B)):
            assert c.post("/v1/skills", json={"name": name, "text": text}).status_code in (200, 201)
        yield c, fake, state.pipeline.runner, tmp_path / "heads"


def compose(c, skills, user="What now?", **kw):
    r = c.post("/v1/compose", json={"skills": skills, "user": user, "max_tokens": 4, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def count(outcome: str) -> float:
    return metrics.VLLM_HEADS.labels(outcome)._value.get()


def test_the_published_head_is_the_composed_cache_up_to_the_last_block(env):
    c, fake, runner, heads = env
    out = compose(c, ["a", "b"])
    sent = fake.sent[-1]
    ref = HeadRef.from_dict(sent["transfer"]["skillcache"])
    assert sent["salt"].startswith("approx:default:")
    assert out["usage"]["composed_tokens"] == ref.n_tokens and out["usage"]["prefix_tokens"] == 0
    assert out["usage"]["recomputed_tokens"] == len(sent["ids"]) - ref.n_tokens > 0
    assert out["text"] == "Hello"
    # the same composition, here: its cache over the head's tokens is what the pool holds, layer by layer
    pipeline = c.app.state.skillcache.pipeline
    prep = c.portal.call(pipeline.prepare, ComposeParams(skills=[SkillRef("a"), SkillRef("b")],
                                                          messages=[{"role": "user", "content": "What now?"}]))
    pre = run_steps(runner.rt.prefill_steps(prep.plan, prep.blocks, mode="compose", seam_tokens=prep.seams,
                                            defer_tail=True, tail_limit=1 << 30))
    m = HeadReader(heads).open(ref, sent["ids"], runner.layout)
    for i, layer in enumerate(pre.cache.layers):
        torch.testing.assert_close(m.keys[i], layer.keys[0, :, :ref.n_tokens].transpose(0, 1), rtol=0, atol=0)
        torch.testing.assert_close(m.values[i], layer.values[0, :, :ref.n_tokens].transpose(0, 1), rtol=0, atol=0)


def test_a_repeated_composition_keeps_its_salt_and_its_head(env):
    c, fake, _, _ = env
    compose(c, ["a", "b"], "first turn")
    reused = count("reused")
    compose(c, ["a", "b"], "another, longer turn than the first one")
    first, second = fake.sent[-2], fake.sent[-1]
    assert first["salt"] == second["salt"] and first["transfer"] == second["transfer"]
    assert count("reused") == reused + 1
    compose(c, ["b", "a"], "first turn")
    assert fake.sent[-1]["salt"] != first["salt"]  # another order: another composition, another salt


def test_full_mode_and_other_namespaces_never_share_a_composed_salt(env):
    c, fake, _, _ = env
    compose(c, ["a", "b"])
    approx = fake.sent[-1]["salt"]
    out = compose(c, ["a", "b"], mode="full")
    assert fake.sent[-1]["salt"] == "exact:default" and fake.sent[-1]["transfer"] is None
    assert out["usage"]["composed_tokens"] == 0
    assert approx.startswith("approx:default:")
    from service.engines.vllm import approx_salt, exact_salt

    assert approx_salt("other", "d") != approx_salt("default", "d") and exact_salt("other") != exact_salt("default")


def test_refinement_prefills_the_exact_head_on_vllm_then_sends_no_head(env):
    c, fake, runner, _ = env
    runner.refine_after = 1
    compose(c, ["b", "a"])
    composed, prefill = fake.sent  # after the response: vLLM prefills the head's ids under the exact salt
    assert prefill.get("prefill") and prefill["salt"] == "exact:default"
    assert composed["ids"][:len(prefill["ids"])] == prefill["ids"]
    assert len(prefill["ids"]) == composed["transfer"]["skillcache"]["n_tokens"]
    out = compose(c, ["b", "a"], "a new turn")
    assert fake.sent[-1]["salt"] == "exact:default" and fake.sent[-1]["transfer"] is None
    assert out["usage"]["prefix_tokens"] == 0  # the fake's prefix cache is empty: what vLLM reports is what counts


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


def test_what_vllm_does_not_serve_yet_is_501(env):
    c, _, _, _ = env
    r = c.post("/v1/sessions", json={"skills": ["a"]})
    assert r.status_code == 501 and r.json()["error"]["type"] == "not_supported_on_engine"
    r = c.post("/v1/compose", json={"skills": ["a"], "user": "hi", "max_tokens": 2, "tools": [tool("f"), tool("g")],
                                    "tool_choice": "required"})
    assert r.status_code == 501 and r.json()["error"]["type"] == "not_supported_on_engine"


def test_tools_and_memories_go_to_vllm_inside_the_head(env):
    c, fake, _, _ = env
    compose(c, ["a"], "call it", tools=[tool("lookup")])  # the tools block compiled for it counts as recomputed
    out = compose(c, ["a"], "call it again", tools=[tool("lookup")])
    sent = fake.sent[-1]
    assert out["tools"]["path"] == "compose" and sent["transfer"] is not None  # the tools block is in the head
    assert out["usage"]["composed_tokens"] == sent["transfer"]["skillcache"]["n_tokens"]
    assert c.post("/v1/memories", json={"name": "m", "text": "- plan: gold\n- city: Oslo"}).status_code in (200, 201)
    compose(c, ["a"], "where do I live?")
    plain = fake.sent[-1]["transfer"]["skillcache"]["n_tokens"]
    out = compose(c, ["a"], "where do I live?", memory="m")
    with_memory = fake.sent[-1]["transfer"]["skillcache"]["n_tokens"]
    assert with_memory > plain and out["memory"] is not None  # the memory's blocks are composed into the head
    assert out["usage"]["recomputed_tokens"] == out["usage"]["prompt_tokens"] - with_memory
