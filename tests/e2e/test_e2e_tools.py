"""Tool calling end to end: a real uvicorn serving the embedded model, driven by the official openai SDK.

An agent loop with two tools over three turns (a call, a tool result and the next call, then the answer), plain and
streamed; named tool_choice over 20 questions; skills and tools composed together. What the 135M model does with
tool_choice auto is measured by bench/tools.py (docs/BENCHMARKS.md), not asserted here."""

import shutil

import pytest

from tool_loop import TOOLS, agent_turns, check_loop, named_calls, sdk_client

from service.devserver import ROOT

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    skills = tmp_path_factory.mktemp("skills")  # one shipped skill: less to preload and calibrate on a busy CPU
    shutil.copy(ROOT / "skills" / "refund-policy.md", skills)
    yield from sdk_client(tmp_path_factory.mktemp("home"), {"SKILLCACHE_SKILLS_DIR": str(skills)})


def test_agent_loop_two_tools_three_turns(client):
    c, model = client
    check_loop(list(agent_turns(c, model, stream=False)))


def test_agent_loop_streamed_accumulates_in_the_sdk(client):
    c, model = client
    turns = list(agent_turns(c, model, stream=True))
    assert [t.function.name for t in turns[0][0].tool_calls] == ["get_weather"]
    assert [t.function.name for t in turns[1][0].tool_calls] == ["get_time"]
    assert turns[1][2].prompt_tokens_details.cached_tokens > 0
    for msg, _, _, _ in turns:
        for t in msg.tool_calls or []:
            assert t.function.arguments  # the arguments chunks added up to the call's arguments


def test_named_tool_choice_always_yields_that_call(client):
    c, model = client
    cities = ["Paris", "London", "Cairo", "Oslo", "Lima", "Tokyo", "Sydney", "Berlin", "Chicago", "Mumbai"]
    n_json = named_calls(c, model, cities)
    print(f"named tool_choice: 20/20 calls of the named tool, arguments a JSON object in {n_json}/20")


def test_skills_and_tools_compose_together(client):
    c, model = client
    body = dict(model=model, messages=[{"role": "user", "content": "Can I return order A-1?"}], tools=TOOLS,
                max_tokens=4, extra_body={"skills": ["refund-policy"]})
    c.chat.completions.create(**body)
    r = c.chat.completions.create(**body)
    x = r.model_extra["skillcache"]
    skill = x["skills"][0]
    assert x["tools"]["source"] == "memory" and x["tools"]["path"] in ("compose", "prefix")
    # the skill is copied as is, the tools block after it re-rotated (its seam recomputed) or inside a refined prefix
    assert r.usage.prompt_tokens_details.cached_tokens >= x["tools"]["n_tokens"] + 700 - (x["tools"]["seam"] or 0)
    assert skill["name"] == "refund-policy"
