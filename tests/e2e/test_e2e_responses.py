"""The Responses API end to end: one real uvicorn serving the embedded model, driven by the official openai SDK
(`client.responses.create`, plain and streamed, the `responses.stream` helper, a forced function call and its
function_call_output in the next turn, a shipped skill in extra_body) and by the OpenAI Agents SDK's default model
(OpenAIResponsesModel) running a tool loop. Every response is parsed by the SDKs; outputs are kept short."""

import asyncio
import json
import shutil

import pytest

from tool_loop import sdk_client

from service.devserver import ROOT

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city"}},
                          "required": ["city"]}, "strict": False}
QUESTION = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    skills = tmp_path_factory.mktemp("skills")  # one shipped skill: less to preload and calibrate on a busy CPU
    shutil.copy(ROOT / "skills" / "refund-policy.md", skills)
    yield from sdk_client(tmp_path_factory.mktemp("home"), {"SKILLCACHE_SKILLS_DIR": str(skills)})


def test_plain_response_parses_with_text_and_usage(client):
    c, model = client
    r = c.responses.create(model=model, instructions="Answer in one short sentence.", input="Say hello.",
                           max_output_tokens=8)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == model
    assert r.status in ("completed", "incomplete")
    [msg] = r.output
    assert msg.type == "message" and msg.role == "assistant" and msg.content[0].type == "output_text"
    assert r.output_text == msg.content[0].text and r.output_text.strip()
    u = r.usage
    assert 0 < u.output_tokens <= 8 and u.total_tokens == u.input_tokens + u.output_tokens
    assert u.output_tokens_details.reasoning_tokens == 0 and u.input_tokens_details.cached_tokens >= 0
    assert "timings" in r.model_extra["skillcache"]


def test_streamed_events_in_order_add_up_to_the_final_response(client):
    c, model = client
    events = list(c.responses.create(model=model, input="Say hello.", max_output_tokens=6, stream=True))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert types[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text and final.output_text == text == events[-4].text
    assert final.usage.output_tokens <= 6

    with c.responses.stream(model=model, input="Write one word.", max_output_tokens=16) as s:
        helper = list(s)
        deltas = "".join(e.delta for e in helper if e.type == "response.output_text.delta")
        if helper[-1].type == "response.completed":  # the helper's final response needs response.completed
            assert s.get_final_response().output_text == deltas
    again = c.responses.create(model=model, input="Write one word.", max_output_tokens=16)
    assert deltas == again.output_text  # greedy: the stream and the plain response say the same


def test_forced_function_call_then_its_output_as_input_items(client):
    c, model = client
    r = c.responses.create(model=model, input=QUESTION, tools=[WEATHER],
                           tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=32)
    calls = [o for o in r.output if o.type == "function_call"]
    assert [o.name for o in calls] == ["get_weather"] and r.status == "completed", r.output
    call = calls[0]
    assert call.call_id.startswith("call_") and isinstance(call.arguments, str)
    print("call:", call.arguments)
    history = [{"role": "user", "content": QUESTION}, *[o.model_dump(exclude_none=True) for o in r.output],
               {"type": "function_call_output", "call_id": call.call_id,
                "output": json.dumps({"city": "Paris", "temp_c": 18, "sky": "cloudy"})}]
    answer = c.responses.create(model=model, input=history, tools=[WEATHER], tool_choice="none", max_output_tokens=24)
    assert not [o for o in answer.output if o.type == "function_call"] and answer.output_text
    assert answer.usage.input_tokens > r.usage.input_tokens
    assert answer.model_extra["skillcache"]["tools"]["source"] == "memory"  # the tools block, cached from turn one
    assert answer.usage.input_tokens_details.cached_tokens >= answer.model_extra["skillcache"]["tools"]["n_tokens"]
    print("answer:", repr(answer.output_text))

    streamed = list(c.responses.create(model=model, input=QUESTION, tools=[WEATHER], tool_choice="required",
                                       max_output_tokens=32, stream=True))
    done = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    assert [e.name for e in done] == ["get_weather"]
    item = [e.item for e in streamed if e.type == "response.output_item.done" and e.item.type == "function_call"][0]
    assert item.arguments == done[0].arguments and streamed[-1].type == "response.completed"


def test_a_shipped_skill_in_extra_body_is_reused_as_cached_tokens(client):
    c, model = client
    body = dict(model=model, input="Can I return order A-1?", max_output_tokens=4,
                extra_body={"skills": ["refund-policy"]})
    c.responses.create(**body)
    r = c.responses.create(**body)
    [skill] = r.model_extra["skillcache"]["skills"]
    assert skill["name"] == "refund-policy"
    assert r.usage.input_tokens_details.cached_tokens > 0


def test_agents_sdk_default_model_runs_a_tool_loop(client):
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    c, model = client
    agents.set_tracing_disabled(True)
    seen = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        seen.append(city)
        return "18 C and cloudy"

    async def run():
        ac = AsyncOpenAI(base_url=str(c.base_url), api_key="unused", max_retries=0, timeout=300)
        agents.set_default_openai_client(ac, use_for_tracing=False)  # the SDK's default provider and model class
        assert isinstance(agents.OpenAIProvider().get_model(model), agents.OpenAIResponsesModel)
        agent = agents.Agent(name="weather", instructions="You answer weather questions briefly.", model=model,
                             tools=[get_weather], model_settings=agents.ModelSettings(
                                 tool_choice="required", max_tokens=48, extra_body={"stop": ["\n"]}))
        try:
            return await agents.Runner.run(agent, QUESTION, max_turns=3)
        finally:
            await ac.close()

    result = asyncio.run(run())
    kinds = [type(i).__name__ for i in result.new_items]
    print("agent items:", kinds, "final:", repr(result.final_output))
    assert kinds[:2] == ["ToolCallItem", "ToolCallOutputItem"] and len(seen) == 1
    assert kinds[-1] == "MessageOutputItem" and isinstance(result.final_output, str)
    usage = result.context_wrapper.usage
    assert usage.requests == 2 and usage.input_tokens > 0
