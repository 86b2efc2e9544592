"""Tool calling on Gemma-3-270M (the GGUF, Gemma's turns from the built-in template, which has no tools support:
the fallback block) behind a real uvicorn, driven by the official openai SDK: the same agent loop as the embedded
model's (tests/e2e/test_e2e_tools.py), plain and streamed, and named tool_choice over several questions."""


import pytest

from gemma_model import gemma_gguf
from tool_loop import agent_turns, check_loop, named_calls, sdk_client

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def client(tmp_path_factory, gemma_runtime):
    # gemma_runtime: the conversion exists in the caller's model cache, so the service loads rather than converts
    env = {"SKILLCACHE_MODEL": str(gemma_gguf()), "SKILLCACHE_CHAT_TEMPLATE": "gemma", "SKILLCACHE_DEVICE": "cpu",
           "SKILLCACHE_SHADOW_SAMPLE_RATE": "0"}
    yield from sdk_client(tmp_path_factory.mktemp("home"), env)


def test_gemma_agent_loop_two_tools_three_turns(client):
    c, model = client
    assert model == "gemma-3-270m-q4_k_m"
    turns = list(agent_turns(c, model, stream=False))
    check_loop(turns)
    assert turns[0][3]["skillcache"]["tools"]["format"] == "fallback"  # Gemma's template renders no tools


def test_gemma_agent_loop_streamed_accumulates_in_the_sdk(client):
    c, model = client
    turns = list(agent_turns(c, model, stream=True))
    assert [t.function.name for t in turns[0][0].tool_calls] == ["get_weather"]
    assert [t.function.name for t in turns[1][0].tool_calls] == ["get_time"]
    assert turns[1][2].prompt_tokens_details.cached_tokens > 0
    for msg, _, _, _ in turns:
        for t in msg.tool_calls or []:
            assert t.function.arguments


def test_gemma_named_tool_choice_always_yields_that_call(client):
    c, model = client
    cities = ["Paris", "Cairo", "Lima", "Tokyo", "Berlin"]
    n_json = named_calls(c, model, cities)
    print(f"named tool_choice on Gemma: {2 * len(cities)}/{2 * len(cities)} calls of the named tool, "
          f"arguments a JSON object in {n_json}/{2 * len(cities)}")
