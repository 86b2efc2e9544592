"""bench/vllm_streams.py's arithmetic and its stream reader, without vLLM: tokens/s of one stream at a time is tokens
over the streams' own times; of concurrent streams, tokens over each round's wall time; a reply shorter than asked
(ignore_eos not honoured) is an error, not a faster engine."""

import asyncio
import json
import sys

import httpx
import pytest

from embedded_model import ROOT

sys.path.insert(0, str(ROOT / "bench"))

import vllm_streams  # noqa: E402


def rec(tokens: int, e2e: float) -> dict:
    return {"tokens": tokens, "ttft_s": 0.1, "e2e_s": e2e, "decode_tok_s": (tokens - 1) / (e2e - 0.1)}


def test_one_stream_at_a_time_is_tokens_over_their_times_and_concurrent_over_the_rounds_wall_time():
    single = vllm_streams.summary([([rec(64, 2.0)], 2.5), ([rec(64, 2.0)], 2.5)], concurrent=False)
    assert single["tok_s"] == pytest.approx(32.0) and single["round_tok_s"] == [32.0, 32.0]
    rounds = [([rec(64, 3.0), rec(64, 4.0)], 4.0), ([rec(64, 1.0), rec(64, 2.0)], 2.0)]
    together = vllm_streams.summary(rounds, concurrent=True)
    assert together["tok_s"] == pytest.approx(256 / 6.0) and together["round_tok_s"] == [32.0, 64.0]
    assert together["streams"] == 4 and together["ttft_ms_p50"] == pytest.approx(100.0)


def sse(events: list[dict]) -> str:
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"


class Prompts:
    def ids(self, order, user):
        return [1, 2, 3]


def test_the_reader_counts_each_engines_tokens_and_refuses_a_short_reply():
    vllm = sse([{"choices": [{"text": "a"}]}, {"choices": [{"text": "b"}]}, {"choices": [], "usage": {
        "prompt_tokens": 3, "completion_tokens": 2}}])  # vLLM's usage chunk
    sc = sse([{"type": "delta", "text": "a"}, {"type": "delta", "text": "b"},
              {"type": "done", "usage": {"prompt_tokens": 3, "reused_tokens": 0, "completion_tokens": 2}}])

    async def run(engine, body, n):
        async with httpx.AsyncClient(base_url="http://x", transport=httpx.MockTransport(
                lambda request: httpx.Response(200, text=body))) as c:
            return await vllm_streams.stream(c, engine, Prompts(), ("a",), "hi", n)
    for engine, body in (("vllm", vllm), ("skillcache-vllm", sc)):
        got = asyncio.run(run(engine, body, 2))
        assert got["tokens"] == 2 and got["ttft_s"] <= got["e2e_s"]
        with pytest.raises(RuntimeError, match="2 tokens streamed, 64 asked"):
            asyncio.run(run(engine, body, 64))
