"""ToolCallParser per format (Hermes/Qwen tags, the fallback's list, Llama-3 JSON), whole and streamed: complete,
parallel, malformed and partial calls, and forced calls read leniently."""

from __future__ import annotations

import pytest

from service.tools.formats import FALLBACK, HERMES, LLAMA3_JSON
from service.tools.parser import CallEvent, ContentEvent, ToolCallParser
from service.tools.spec import Tool, ToolChoice, ToolsParams

WEATHER = Tool("get_weather", "Weather in a city", {"type": "object", "properties": {"city": {"type": "string"}},
                                                    "required": ["city"]})
TIME = Tool("get_time", "Local time", {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]})


def params(mode="auto", name=None, parallel=True, tools=(WEATHER, TIME)) -> ToolsParams:
    return ToolsParams(list(tools), ToolChoice(mode, name), parallel)


def run(fmt, text, p=None, pieces=None, forced_from=None):
    """Feed `text` whole (pieces=None) or in pieces of `pieces` characters; returns (content, calls, events)."""
    p = p or params()
    forced = fmt.forced_opening(p) if forced_from is None else forced_from
    parser = ToolCallParser(fmt, p, forced=forced)
    events = []
    step = pieces or max(1, len(text))
    for i in range(0, len(text), step):
        events += parser.feed(text[i:i + step])
    events += parser.finish()
    return parser, [(c.name, c.arguments_value()) for c in parser.calls], events


def both(fmt, text, p=None):
    """The result whole and streamed one character at a time: they must agree."""
    whole, calls, _ = run(fmt, text, p)
    streamed, calls_s, events = run(fmt, text, p, pieces=1)
    assert (streamed.text, calls_s) == (whole.text, calls)
    streamed_text = "".join(e.text for e in events if isinstance(e, ContentEvent))
    assert streamed_text == "".join(whole.content)
    return whole, calls, events


HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_hermes_single_call_is_a_call_with_an_id_and_no_content():
    parser, calls, events = both(HERMES, HERMES_CALL)
    assert calls == [("get_weather", {"city": "Paris"})]
    assert parser.text == "" and parser.finish_reason("stop") == "tool_calls"
    assert parser.calls[0].id.startswith("call_") and len(parser.calls[0].id) == 29
    assert [type(e) for e in events] == [CallEvent]


def test_hermes_content_then_parallel_calls_in_order():
    text = "Let me check both.\n" + HERMES_CALL + "\n" + HERMES_CALL.replace("get_weather", "get_time").replace(
        '"city": "Paris"', '"tz": "Europe/Paris"')
    parser, calls, events = both(HERMES, text)
    assert calls == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "Europe/Paris"})]
    assert parser.text.startswith("Let me check both.")
    assert [e.index for e in events if isinstance(e, CallEvent)] == [0, 1]
    _, single, _ = run(HERMES, text, params(parallel=False))
    assert single == [("get_weather", {"city": "Paris"})]  # parallel_tool_calls false: the first call only


def test_hermes_arguments_as_a_json_string_are_read():
    text = '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}</tool_call>'
    assert both(HERMES, text)[1] == [("get_weather", {"city": "Oslo"})]


@pytest.mark.parametrize("text", [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"</tool_call>',  # broken JSON
    '<tool_call>\n{"name": "launch_rockets", "arguments": {}}\n</tool_call>',  # not an offered tool
    '<tool_call>\n{"name": "get_weather", "arguments": [1, 2]}\n</tool_call>',  # arguments not an object
    '<tool_call>\n["get_weather"]\n</tool_call>',
    'Sure: <tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',  # partial: the reply ended inside it
])
def test_hermes_malformed_and_partial_calls_are_content(text):
    parser, calls, _ = both(HERMES, text)
    assert calls == [] and parser.text == text and parser.finish_reason("stop") == "stop"


def test_hermes_a_call_whose_closing_tag_never_came_is_read_when_its_json_is_complete():
    parser, calls, _ = both(HERMES, HERMES_CALL[: -len("</tool_call>")])  # cut at the stop string
    assert calls == [("get_weather", {"city": "Paris"})] and parser.finish_reason("stop") == "tool_calls"


def test_hermes_streaming_holds_a_tag_back_only_until_it_is_resolved():
    parser = ToolCallParser(HERMES, params())
    assert parser.feed("Use <tool") == [ContentEvent("Use ")]  # "<tool" may open a call
    assert parser.feed("s> wisely") == [ContentEvent("<tools> wisely")]  # it did not
    out = parser.feed(HERMES_CALL[:30])
    assert out == []  # a call is reported when complete, not before
    out = parser.feed(HERMES_CALL[30:])
    assert [type(e) for e in out] == [CallEvent] and out[0].call.name == "get_weather"
    assert parser.finish() == [] and parser.text == "Use <tools> wisely"


def test_fallback_list_of_calls_in_one_tag():
    text = ('<tool_call>[{"name": "get_weather", "arguments": {"city": "Rome"}}, '
            '{"name": "get_time", "arguments": {"tz": "Europe/Rome"}}]</tool_call>')
    parser, calls, _ = both(FALLBACK, text)
    assert calls == [("get_weather", {"city": "Rome"}), ("get_time", {"tz": "Europe/Rome"})]
    assert both(FALLBACK, '<tool_call>{"name": "get_time", "arguments": {"tz": "UTC"}}</tool_call>')[1] == [
        ("get_time", {"tz": "UTC"})]  # a Hermes-style object in the tag is read too


@pytest.mark.parametrize("text", [
    "<tool_call>[]</tool_call>",  # an empty list is no call
    '<tool_call>[{"name": "get_weather", "arguments": {"city": "Rome"}}, {"oops"]</tool_call>',
    '<tool_call>[{"name": "get_weather", "arguments": {"city": "Ro',
])
def test_fallback_malformed_and_partial_calls_are_content(text):
    parser, calls, _ = both(FALLBACK, text)
    assert calls == [] and parser.text == text


def test_llama3_json_calls_and_separated_calls():
    parser, calls, _ = both(LLAMA3_JSON, '{"name": "get_weather", "parameters": {"city": "Lima"}}')
    assert calls == [("get_weather", {"city": "Lima"})] and parser.text == ""
    two = '{"name": "get_weather", "parameters": {"city": "Lima"}}; {"name": "get_time", "parameters": {"tz": "UTC"}}'
    assert [n for n, _ in both(LLAMA3_JSON, two)[1]] == ["get_weather", "get_time"]
    listed = '[{"name": "get_time", "arguments": {"tz": "UTC"}}]'
    assert both(LLAMA3_JSON, listed)[1] == [("get_time", {"tz": "UTC"})]


def test_llama3_json_text_streams_at_once_and_json_that_is_no_call_is_content():
    parser = ToolCallParser(LLAMA3_JSON, params())
    assert parser.feed("It is sunny") == [ContentEvent("It is sunny")]  # not JSON: no waiting for the end
    for text in ['{"answer": 42}', '{"name": "get_weather", "parameters": {"city": ', "  {not json"]:
        parser, calls, events = both(LLAMA3_JSON, text)
        assert calls == [] and parser.text == text
        assert [type(e) for e in events] == [ContentEvent]  # held back, then released as one piece


@pytest.mark.parametrize("fmt", [HERMES, FALLBACK, LLAMA3_JSON])
def test_forced_named_call_reads_the_model_continuation(fmt):
    p = params("named", "get_weather")
    closer = {"hermes": '"}}\n</tool_call>', "fallback": '"}}]</tool_call>', "llama3_json": '"}}'}[fmt.name]
    parser, calls, _ = run(fmt, '{"city": "Paris' + closer, p)  # the arguments under the schema, then the close
    assert calls == [("get_weather", {"city": "Paris"})] and parser.finish_reason("stop") == "tool_calls"


def test_forced_call_with_a_stray_brace_and_chatter_after_it_is_still_the_call():
    p = params("named", "get_weather")
    parser, calls, _ = run(FALLBACK, '{"city": "Cairo", "unit": "C"}}}\n\nThe output must adhere to the format.', p)
    assert calls == [("get_weather", {"city": "Cairo", "unit": "C"})]


def test_forced_call_cut_by_max_tokens_is_closed_and_says_length():
    p = params("named", "get_weather")
    parser, calls, _ = run(FALLBACK, '{"city": "San Fran', p)
    assert calls == [("get_weather", {"city": "San Fran"})]
    assert parser.finish_reason("length") == "length"  # the call was cut: OpenAI's finish_reason for that
    parser, calls, _ = run(FALLBACK, '{"city": "Paris"}}]', p)
    assert parser.finish_reason("length") == "tool_calls"  # complete, only the closing tag was missing


def test_forced_required_call_keeps_the_model_name_and_raw_arguments_that_are_no_object():
    p = params("required")
    assert FALLBACK.forced_opening(p).endswith('[{"name": "')
    parser, calls, _ = run(FALLBACK, 'get_time", "arguments": {"tz": "Asia/Tokyo"}}]', p)
    assert calls == [("get_time", {"tz": "Asia/Tokyo"})]
    parser, _, _ = run(FALLBACK, 'get_time", "arguments": "now"}]', p)
    assert [(c.name, c.arguments) for c in parser.calls] == [("get_time", '"now"}]')]  # as the model wrote them
    parser, calls, _ = run(FALLBACK, 'order_pizza", "arguments": {}}]', p)
    assert calls == [] and "order_pizza" in parser.text  # a name that is not offered is no call: text


def test_forced_opening_is_not_content_when_the_call_fails():
    parser, _, events = run(HERMES, "!!!", params("required"))
    assert parser.calls == [] and parser.text == HERMES.forced_opening(params("required")) + "!!!"
    assert all(isinstance(e, ContentEvent) for e in events)
