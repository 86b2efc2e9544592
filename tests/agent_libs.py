"""The agent libraries' typed-answer calls, as their users write them, against a TestClient's app (no socket): the
OpenAI Agents SDK's own model with an `output_type` and ModelSettings hints, pydantic-ai's `NativeOutput`,
LangChain's `with_structured_output(method="json_schema")`, instructor's `JSON_SCHEMA` mode. Each returns what the
library returned: the pydantic model itself when the reply parsed and validated. None retries (a second try would
hide a first that failed). Shared by the embedded engine's tests and the vLLM engine's."""

from __future__ import annotations

import httpx
from openai import AsyncOpenAI, OpenAI

BASE = "http://testserver/v1"


def _run_async(client, make):
    """`make(AsyncOpenAI)` awaited on the app's own loop, over an ASGI transport."""

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=client.app), base_url=BASE) as http:
            return await make(AsyncOpenAI(base_url=BASE, api_key="unused", http_client=http, max_retries=0))

    return client.portal.call(go)


def agents_sdk(client, output_type, prompt: str, max_tokens: int, seed: int = 0, extra: dict | None = None):
    from agents import Agent, ModelSettings, OpenAIResponsesModel, RunConfig, Runner
    from openai.types.shared import Reasoning

    async def make(oai):
        agent = Agent(name="a", instructions="Answer briefly.", model=OpenAIResponsesModel("m", oai),
                      output_type=output_type,
                      model_settings=ModelSettings(verbosity="low", reasoning=Reasoning(effort="low"),
                                                   temperature=1.0, max_tokens=max_tokens,
                                                   extra_body={"seed": seed, **(extra or {})}))
        return (await Runner.run(agent, prompt, run_config=RunConfig(tracing_disabled=True))).final_output

    return _run_async(client, make)


def pydantic_ai(client, output_type, prompt: str, max_tokens: int, seed: int = 0, extra: dict | None = None):
    from pydantic_ai import Agent, NativeOutput
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.settings import ModelSettings

    async def make(oai):
        model = OpenAIChatModel("m", provider=OpenAIProvider(openai_client=oai))
        agent = Agent(model, output_type=NativeOutput(output_type), retries=0,
                      model_settings=ModelSettings(temperature=1.0, max_tokens=max_tokens, seed=seed,
                                                   extra_body=extra or {}))
        return (await agent.run(prompt)).output

    return _run_async(client, make)


def langchain(client, output_type, prompt: str, max_tokens: int, seed: int = 0, extra: dict | None = None):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model="m", base_url=BASE, api_key="unused", http_client=client, max_retries=0, temperature=1.0,
                     max_tokens=max_tokens, seed=seed, extra_body=extra or {})
    return llm.with_structured_output(output_type, method="json_schema", strict=True).invoke(prompt)


def instructor_json_schema(client, output_type, prompt: str, max_tokens: int, seed: int = 0,
                           extra: dict | None = None):
    import instructor

    ic = instructor.from_openai(OpenAI(base_url=BASE, api_key="unused", http_client=client, max_retries=0),
                                mode=instructor.Mode.JSON_SCHEMA)
    return ic.chat.completions.create(model="m", response_model=output_type, max_retries=0, temperature=1.0, seed=seed,
                                      max_tokens=max_tokens, extra_body=extra or {},
                                      messages=[{"role": "user", "content": prompt}])


LIBRARIES = {"agents-sdk": agents_sdk, "pydantic-ai": pydantic_ai, "langchain": langchain,
             "instructor": instructor_json_schema}
