"""Forced openings written from the tool's schema, stop strings per choice, past calls written back, and which
templates count as rendering tools in a format the service reads."""

from __future__ import annotations

import json

import pytest

from service.tools import jsonfix
from service.tools.formats import FALLBACK, HERMES, LLAMA3_JSON, template_format
from service.tools.spec import Tool, ToolCall, ToolChoice, ToolsParams

WEATHER = Tool("get_weather", None, {"type": "object", "properties": {"city": {"type": "string"}},
                                     "required": ["city"]})
COUNT = Tool("count", None, {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]})
PING = Tool("ping", None, {"type": "object", "properties": {}})
LOOSE = Tool("search", None, {"type": "object", "properties": {"q": {"type": "string"}}})


def named(tool: Tool, *others: Tool) -> ToolsParams:
    return ToolsParams([tool, *others], ToolChoice("named", tool.name))


@pytest.mark.parametrize("tool", [WEATHER, COUNT, PING, LOOSE])
def test_a_named_opening_ends_at_the_arguments_key(tool):
    """The arguments are decoded under the tool's schema (ToolsPrep.gen), not begun in the opening."""
    opening = FALLBACK.forced_opening(named(tool, WEATHER))
    assert opening == '<tool_call>[{"name": "' + tool.name + '", "arguments": '


def test_openings_per_format_and_choice():
    p = named(WEATHER)
    assert HERMES.forced_opening(p) == '<tool_call>\n{"name": "get_weather", "arguments": '
    assert LLAMA3_JSON.forced_opening(p) == '{"name": "get_weather", "parameters": '
    two = [WEATHER, COUNT]
    assert HERMES.forced_opening(ToolsParams(two, ToolChoice("required"))) == '<tool_call>\n{"name": "'
    assert HERMES.forced_opening(ToolsParams([COUNT], ToolChoice("required"))).endswith('"count", "arguments": ')
    for mode in ("auto", "none"):
        assert HERMES.forced_opening(ToolsParams(two, ToolChoice(mode))) == ""


def test_the_arguments_schema_is_an_object_whatever_the_parameters_say():
    assert WEATHER.arguments_schema() == WEATHER.parameters
    assert Tool("free", None, None).arguments_schema() == {"type": "object"}
    assert Tool("loose", None, {"properties": {"q": {"type": "string"}}}).arguments_schema()["type"] == "object"


def test_stop_strings_end_the_reply_when_only_one_call_may_come():
    assert HERMES.stop_strings(ToolChoice("named", "x"), True) == ["</tool_call>"]
    assert HERMES.stop_strings(ToolChoice("auto"), False) == ["</tool_call>"]
    assert HERMES.stop_strings(ToolChoice("auto"), True) == []  # several tags may follow
    assert FALLBACK.stop_strings(ToolChoice("auto"), True) == ["</tool_call>"]  # one tag holds every call
    assert FALLBACK.stop_strings(ToolChoice("none"), False) == []
    assert LLAMA3_JSON.stop_strings(ToolChoice("named", "x"), False) == []


def test_past_calls_are_written_back_the_way_the_format_reads_them():
    calls = [ToolCall("c1", "get_weather", '{"city": "Paris"}'), ToolCall("c2", "count", "not json")]
    assert FALLBACK.call_text(calls) == ('<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                                         '{"name": "count", "arguments": "not json"}]</tool_call>')
    assert HERMES.call_text(calls[:1]) == ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
                                           '\n</tool_call>')
    assert json.loads(LLAMA3_JSON.call_text(calls[:1])) == {"name": "get_weather", "parameters": {"city": "Paris"}}


def test_template_format_needs_tools_and_a_known_call_convention():
    assert template_format("{{ messages }}") is None
    assert template_format("{% if tools %}<tool_call>{% endif %}") is HERMES
    assert template_format("{% if tools %}<|python_tag|>{% endif %}") is LLAMA3_JSON
    assert template_format("{% if tools %}[TOOL_CALLS]{% endif %}") is None  # a convention not parsed: fallback


@pytest.mark.parametrize("text,expected", [
    ('{"a": 1} trailing', {"a": 1}),
    ('{"a": "unfinished', {"a": "unfinished"}),
    ('{"a": 1, "b": [1, 2', {"a": 1, "b": [1, 2]}),
    ('{"a": 1, "b', {"a": 1}),
    ('{"a": {"b": "c"}}}}', {"a": {"b": "c"}}),
    ("[1]", None),
    ("nothing", None),
])
def test_first_object_reads_or_closes_a_truncated_object(text, expected):
    assert jsonfix.first_object(text) == expected


def test_values_reads_separated_json():
    assert jsonfix.values('{"a": 1}; {"b": 2} ') == [{"a": 1}, {"b": 2}]
    assert jsonfix.values('{"a": 1} x') is None and jsonfix.values("   ") is None
