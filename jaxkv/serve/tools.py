"""Tool calls for the OpenAI server: ``tools`` / ``tool_choice`` checked,
rendered through the chat template, and calls parsed from the output.

The format parsed is Hermes-style JSON, which Qwen2.5 / Qwen3, SmolLM2's
tool template, Hermes and many fine-tunes emit: each call a JSON object
``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and
``</tool_call>`` (vLLM's ``hermes`` parser reads the same). The text before
the first call is the message's ``content``; a call whose JSON does not
parse, or names no declared function, is left in the content as text (a
model's malformed call is shown, not dropped).

``tool_choice``: ``"auto"`` (the default with tools: the model decides),
``"none"`` (the tools still reach the template, as OpenAI renders them, but
no call is parsed), ``"required"`` and a named function
(``{"type": "function", "function": {"name": ...}}``): the output is
constrained (:mod:`jaxkv.serve.structured`) to exactly one call
``<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>`` naming one
of the declared functions (``required``) or that one, its ``arguments``
following the function's ``parameters`` schema (a function without
``parameters`` takes ``{}``). One call, not several: OpenAI's ``required``
also allows more, which the constraint does not produce.
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid

__all__ = ["CALL_END", "CALL_START", "ToolRequest", "parse_tool_calls", "parse_tools", "split_stream_text",
           "template_messages", "tool_call_regex"]

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(CALL_START) + r"\s*(.*?)\s*" + re.escape(CALL_END), re.DOTALL)


@dataclasses.dataclass(frozen=True)
class ToolRequest:
    """A request's tools (as the template takes them) and whether its output
    is parsed for calls (``tool_choice`` ``"auto"``)."""

    tools: tuple
    parse: bool
    forced: tuple = ()  # the functions a call is constrained to (tool_choice required / named); () none

    @property
    def names(self) -> frozenset:
        return frozenset(tool["function"]["name"] for tool in self.tools)


def parse_tools(body: dict, bad) -> ToolRequest | None:
    """``body``'s ``tools`` and ``tool_choice`` checked (``bad(message,
    param)`` makes the 400), or None without tools."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise bad("'tool_choice' needs 'tools'", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise bad("'tools' must be an array of tools", "tools")
    names = set()
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise bad(f"'tools[{i}]' must be {{\"type\": \"function\", \"function\": {{...}}}}", "tools")
        name = function.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", name):
            raise bad(f"'tools[{i}].function.name' must be 1 to 64 letters, digits, '_' or '-'", "tools")
        if name in names:
            raise bad(f"'tools' declares the function {name!r} twice", "tools")
        names.add(name)
        for field, kind in (("description", str), ("parameters", dict)):
            if function.get(field) is not None and not isinstance(function[field], kind):
                raise bad(f"'tools[{i}].function.{field}' must be {'a string' if kind is str else 'an object'}",
                          "tools")
    if choice is None or choice == "auto":
        parse = True
    elif choice == "none":
        parse = False
    elif choice == "required":
        return ToolRequest(tools=tuple(tools), parse=True, forced=tuple(sorted(names)))
    elif isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise bad("'tool_choice' naming a function must be {\"type\": \"function\", \"function\": "
                      "{\"name\": ...}}", "tool_choice")
        if name not in names:
            raise bad(f"'tool_choice' names the function {name[:64]!r}, which 'tools' does not declare", "tool_choice")
        return ToolRequest(tools=tuple(tools), parse=True, forced=(name,))
    else:
        raise bad(f"'tool_choice' must be 'auto', 'none', 'required' or a function, got {json.dumps(choice)[:60]}",
                  "tool_choice")
    return ToolRequest(tools=tuple(tools), parse=parse)


def tool_call_regex(request: ToolRequest) -> str:
    """The regex of one Hermes-style call to one of ``request.forced``
    (module docstring); ``InvalidArgument`` when a function's
    ``parameters`` schema cannot be enforced."""
    from jaxkv.serve.structured import schema_regex

    functions = {tool["function"]["name"]: tool["function"] for tool in request.tools}
    calls = [{"type": "object", "properties": {
        "name": {"const": name},
        "arguments": functions[name].get("parameters") or {"type": "object", "properties": {}}},
        "required": ["name", "arguments"], "additionalProperties": False} for name in request.forced]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return re.escape(CALL_START) + r"\n" + schema_regex(schema) + r"\n" + re.escape(CALL_END)


def template_messages(messages: list) -> list:
    """``messages`` as chat templates read them: an assistant message's
    ``tool_calls[*].function.arguments`` given as a JSON string (OpenAI's
    form) parsed into an object (the templates write it with ``tojson``);
    a string that is not JSON is left as it is."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if isinstance(calls, list):
            fixed = []
            for call in calls:
                function = call.get("function") if isinstance(call, dict) else None
                if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                    try:
                        function = {**function, "arguments": json.loads(function["arguments"])}
                    except ValueError:
                        pass
                    call = {**call, "function": function}
                fixed.append(call)
            message = {**message, "tool_calls": fixed}
        out.append(message)
    return out


def parse_tool_calls(text: str, names: frozenset) -> tuple[str | None, list]:
    """``(content, tool_calls)`` of a model's output: the calls (OpenAI's
    ``{"id", "type": "function", "function": {"name", "arguments": JSON
    text}}``) of every well-formed block naming a declared function, and the
    text with those blocks taken out (stripped; None when nothing is left
    and a call was found)."""
    calls, kept, at = [], [], 0
    for match in _CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
        except ValueError:
            continue
        if not (isinstance(call, dict) and call.get("name") in names):
            continue
        arguments = call.get("arguments", call.get("parameters", {}))
        calls.append({"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                      "function": {"name": call["name"],
                                   "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}})
        kept.append(text[at:match.start()])
        at = match.end()
    kept.append(text[at:])
    content = "".join(kept).strip() if calls else text
    return (content or None) if calls else content, calls


def split_stream_text(text: str) -> tuple[str, str]:
    """``(sendable, held)``: while streaming a request whose output is
    parsed for calls, the text that may go out now and the tail held back,
    from the first ``<tool_call>`` (or a partial one at the end) on, until
    the output ends and its calls are parsed."""
    start = text.find(CALL_START)
    if start >= 0:
        return text[:start], text[start:]
    for cut in range(min(len(CALL_START) - 1, len(text)), 0, -1):  # a partial "<tool_call>" at the end
        if CALL_START.startswith(text[-cut:]):
            return text[:-cut], text[-cut:]
    return text, ""
