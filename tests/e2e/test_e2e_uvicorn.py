"""End to end: a real uvicorn on 127.0.0.1 serving the embedded model, driven by the official
openai SDK and by the skillcache client package."""

import httpx
import pytest

from service.devserver import ROOT, ServiceNotReady, ServiceProcess

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    svc = ServiceProcess(tmp_path_factory.mktemp("home"), {"SKILLCACHE_SKILLS_DIR": str(ROOT / "skills")},
                         threads=None)
    with svc:
        try:
            svc.wait_ready(300)
        except ServiceNotReady as e:
            pytest.fail(str(e))
        yield svc.url


def test_openai_sdk_streams_a_chat_completion_with_two_skills(server):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server}/v1", api_key="unused")
    model = client.models.list().data[0].id
    stream = client.chat.completions.create(
        model=model, max_tokens=16, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "system", "content": "You are a support agent."},
                  {"role": "user", "content": "My order was delivered and is unused. Refund? APPROVE or DENY."}],
        extra_body={"skills": ["refund-policy", "style-guide"]},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert text.strip()
    assert usage.completion_tokens <= 16
    assert usage.prompt_tokens_details.cached_tokens > 1000  # both skills were reused, not recomputed
    assert any(c.choices and c.choices[0].finish_reason for c in chunks)

    full = client.chat.completions.create(
        model=model, max_tokens=16,
        messages=[{"role": "user", "content": "Hello"}], extra_body={"skills": ["tool-specs"], "mode": "full"},
    )
    assert full.usage.prompt_tokens_details.cached_tokens == 0
    assert full.choices[0].message.content


def test_client_package_registers_and_composes(server):
    from skillcache_client import SkillcacheClient, SkillcacheError

    with SkillcacheClient(server) as c:
        rec = c.add_skill("e2e-note", "Shipping to Mars takes {{days}} days.", fields={"days": "300"})
        assert rec["version"] == 1 and rec["compiled"]
        events = list(c.compose_stream(["e2e-note"], "How long does shipping to Mars take?", max_tokens=12,
                                       fields={"days": "200"}))
        assert events[-1]["type"] == "done"
        assert events[-1]["skills"][0]["source"] in ("memory", "disk")
        assert "200" in events[-1]["edits"][0]["lines"][0]
        assert "".join(e["text"] for e in events if e["type"] == "delta")
        names = {s["name"] for s in c.list_skills()}
        assert {"refund-policy", "tool-specs", "e2e-note"} <= names
        c.delete_skill("e2e-note")
        with pytest.raises(SkillcacheError) as err:
            c.compose(["e2e-note"], "hi")
        assert err.value.error_type == "skill_not_found"
    metrics = httpx.get(f"{server}/metrics").text
    assert 'skillcache_skill_hits_total{tier="memory"}' in metrics


def test_compose_and_full_agree_on_greedy_decision(server):
    """The same request in both modes: the shipped refund policy's one-word decision agrees."""
    body = {"skills": ["refund-policy"], "max_tokens": 3,
            "user": "Order delivered 5 days ago, unused, standard tier. Decide: APPROVE or DENY?"}
    comp = httpx.post(f"{server}/v1/compose", json=body, timeout=120).json()
    full = httpx.post(f"{server}/v1/compose", json={**body, "mode": "full"}, timeout=120).json()
    assert comp["usage"]["prompt_tokens"] == full["usage"]["prompt_tokens"]
    assert comp["usage"]["reused_tokens"] > 0 and full["usage"]["reused_tokens"] == 0
    print("compose:", repr(comp["text"]), comp["timings"], "full:", repr(full["text"]), full["timings"])
    assert comp["text"].split()[:1] == full["text"].split()[:1]
