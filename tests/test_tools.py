"""The tool-call parser and checks (:mod:`jaxkv.serve.tools`); the server
path through the openai client is ``tests/test_server_hostile.py``'s
``test_tool_calls_are_parsed_streamed_and_not``."""

from __future__ import annotations

import json

import pytest

from jaxkv.serve.tools import CALL_START, parse_tool_calls, parse_tools, split_stream_text, template_messages

NAMES = frozenset({"add", "get_weather"})


class Bad(Exception):
    pass


def bad(message, param):
    return Bad(f"{param}: {message}")


def test_calls_and_content():
    text = 'Sure. <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call> and\n' \
           '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}\n</tool_call>'
    content, calls = parse_tool_calls(text, NAMES)
    assert content == "Sure.  and"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Rome"})]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert len({c["id"] for c in calls}) == 2
    only = parse_tool_calls('<tool_call>{"name": "add", "arguments": {}}</tool_call>', NAMES)
    assert only[0] is None and json.loads(only[1][0]["function"]["arguments"]) == {}


@pytest.mark.parametrize("text", ["no calls at all", '<tool_call>{"name": "add", "arguments": {</tool_call>',
                                  '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
                                  '<tool_call>["add"]</tool_call>', '<tool_call>{"name": "add"}'])
def test_what_is_not_a_call_stays_text(text):
    assert parse_tool_calls(text, NAMES) == (text, [])


def test_stream_hold_back():
    assert split_stream_text("hello") == ("hello", "")
    assert split_stream_text("hello <tool") == ("hello ", "<tool")
    assert split_stream_text("a<tool_call>{x") == ("a", "<tool_call>{x")
    assert split_stream_text("a <") == ("a ", "<")
    assert split_stream_text("a <b") == ("a <b", "")
    # Fed in pieces, the text sent plus the text held is always the text so far, and a call is never sent.
    text = 'Hi <tool_call>{"name": "add"}</tool_call>'
    sent, held = "", ""
    for char in text:
        if held.startswith(CALL_START):
            held += char
        else:
            now, held = split_stream_text(held + char)
            sent += now
        assert sent + held == text[:len(sent + held)] and CALL_START not in sent
    assert sent == "Hi "


def test_tool_checks():
    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    assert parse_tools({}, bad) is None
    request = parse_tools({"tools": [tool]}, bad)
    assert request.parse and request.names == {"add"}
    assert not parse_tools({"tools": [tool], "tool_choice": "none"}, bad).parse
    assert request.forced == () and parse_tools({"tools": [tool], "tool_choice": "required"}, bad).forced == ("add",)
    assert parse_tools({"tools": [tool], "tool_choice": {"type": "function", "function": {"name": "add"}}},
                       bad).forced == ("add",)
    for body in ({"tools": "x"}, {"tools": [{"type": "web"}]}, {"tools": [{"type": "function", "function": {}}]},
                 {"tools": [tool, tool]}, {"tools": [{"type": "function", "function": {"name": "a b"}}]},
                 {"tools": [{"type": "function", "function": {"name": "a", "parameters": []}}]},
                 {"tools": [tool], "tool_choice": {"type": "function", "function": {"name": "sub"}}},
                 {"tools": [tool], "tool_choice": {"type": "function", "name": "add"}},
                 {"tools": [tool], "tool_choice": "sometimes"}, {"tool_choice": "auto"}):
        with pytest.raises(Bad):
            parse_tools(body, bad)


def test_template_messages_parse_argument_strings():
    messages = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}},
        {"id": "d", "type": "function", "function": {"name": "add", "arguments": "not json"}}]},
        {"role": "tool", "content": "3", "tool_call_id": "c"}]
    out = template_messages(messages)
    assert out[0]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert out[0]["tool_calls"][1]["function"]["arguments"] == "not json"
    assert out[1] == messages[1] and messages[0]["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'


def test_tools_and_calls_reach_the_chat_template():
    """The server renders ``tools`` and earlier calls (their arguments as
    objects) through the template, as a Hermes-style template reads them."""
    from jaxkv.serve.http import _render_chat
    from jaxkv.text import render_chat_template

    template = ("{% for t in tools %}[tool {{ t.function.name }}]{% endfor %}{% for m in messages %}"
                "{% for c in m.tool_calls or [] %}[call {{ c.function.name }} {{ c.function.arguments | tojson }}]"
                "{% endfor %}{{ m.role }}:{{ m.content }};{% endfor %}")

    class Chars:  # a tokenizer of one id per character, the template rendered for real
        def apply_chat_template(self, messages, add_generation_prompt, tokenize, chat_template, tools=None, **kw):
            return render_chat_template(chat_template, messages, add_generation_prompt=add_generation_prompt,
                                        tools=tools, **kw)

        def encode(self, text, add_special_tokens=False):
            return [ord(c) for c in text]

    tool = {"type": "function", "function": {"name": "add"}}
    messages = [{"role": "user", "content": "1+2?"},
                {"role": "assistant", "content": None,
                 "tool_calls": [{"id": "c", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]},
                {"role": "tool", "content": "3"}]
    ids = _render_chat(Chars(), messages=messages, add_generation_prompt=False, template=template, kwargs={},
                       from_request=False, tools=parse_tools({"tools": [tool]}, bad))
    assert "".join(map(chr, ids)) == '[tool add]user:1+2?;[call add {"a": 1}]assistant:;tool:3;'
