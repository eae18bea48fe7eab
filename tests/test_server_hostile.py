"""Hostile requests against the OpenAI-compatible server (issue 39: one
request's failure never touches another's tokens; :mod:`jaxkv.serve.http`,
"Hostile requests").

Two kinds of server:

* ``server``: tests/test_server.py's own fixture (``python -m jaxkv.serve``
  in a subprocess over the tiny random Llama with a byte-level tokenizer and
  a ChatML template), for what reaches the real engine: numbers no field
  holds, nesting, lone surrogates, out-of-range integers (``top_k`` of 2**31
  once failed every request in flight), client chat templates refused, the
  rendering call's own arguments refused in ``chat_template_kwargs``, and a
  hypothesis property test drawing hostile bodies (every one refused with a
  4xx, the server live after each);
* an in-process uvicorn (a thread) over the real tokenizer and
  :class:`FakeEngine`, a stand-in that fails the requests whose prompt holds
  token 0 or 1 with ``finish_reason "error"``: per-request engine errors,
  and a server started with ``trust_request_chat_template`` rendering a
  client's slow template off the event loop (``/health`` answers within a
  second meanwhile) until its time bound interrupts it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import threading
import time

import pytest

from tests.test_server import (MAX_MODEL_LEN, MODEL, _error, checkpoint, free_port, metric,  # noqa: F401 (fixtures)
                               metrics, server)

httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

VOCAB = 259  # the tiny checkpoint's byte-level vocabulary: 256 bytes + 3 specials
MAX_BODY = 4 * 2 ** 20  # the server's default body limit (jaxkv.serve.http.MAX_BODY_BYTES)
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "temperature": 0}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}
PATHS = {False: "/v1/completions", True: "/v1/chat/completions"}
# Two nested loops of 100,000 (jinja's sandbox allows ranges up to 100,000): 10**10 iterations.
SLOW_TEMPLATE = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x"


# ------------------------------------------------------------------ raw JSON


class Raw(str):
    """A JSON literal written into a body as is (what ``json.dumps`` cannot
    write: ``NaN``, a 5,000-digit integer, 100,000 nested arrays, a lone
    surrogate escape)."""


def encode(body) -> bytes:
    """``body`` as JSON, each :class:`Raw` (a value or a key) written as its
    literal."""
    literals: dict[str, str] = {}

    def sub(value):
        if isinstance(value, Raw):
            token = f"@@raw{len(literals)}@@"
            literals[token] = str(value)
            return token
        if isinstance(value, dict):
            return {sub(k): sub(v) for k, v in value.items()}
        if isinstance(value, list):
            return [sub(v) for v in value]
        return value

    text = json.dumps(sub(body), ensure_ascii=False)
    for token, literal in literals.items():
        text = text.replace(json.dumps(token), literal)
    return text.encode("utf-8")


def post(url: str, body, **kw) -> httpx.Response:
    raw = body if isinstance(body, bytes) else encode(body)
    return httpx.post(url, content=raw, headers={"Content-Type": "application/json"}, timeout=120, **kw)


def assert_live(url: str) -> None:
    """``/health`` 200 and a normal request of each kind answered."""
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    for chat in (False, True):
        response = post(url + PATHS[chat], CHAT if chat else COMPLETION)
        assert response.status_code == 200, response.text


# ------------------------------------------------------------------ 500s that must be 400s

DEEP = Raw("[" * 100_000 + "]" * 100_000)
HUGE = Raw("9" * 5000)
SURROGATE = Raw('"a\\ud800b"')
# (name, chat, body, status, param): the first ones answered 500 (or crashed the engine step) before issue 39.
HOSTILE = [
    ("5000-digit max_tokens", False, {**COMPLETION, "max_tokens": HUGE}, 400, "max_tokens"),
    ("5000-digit unknown field", False, {**COMPLETION, "x": HUGE}, 400, "x"),
    ("5000-digit token id", False, {**COMPLETION, "prompt": [72, HUGE]}, 400, "prompt"),
    ("5000-digit in a message", True, {**CHAT, "messages": [{"role": "user", "content": "a", "n": HUGE}]}, 400,
     "messages"),
    ("400-digit temperature", False, {**COMPLETION, "temperature": Raw("1" + "0" * 400)}, 400, "temperature"),
    ("400-digit top_p", True, {**CHAT, "top_p": Raw("1" + "0" * 400)}, 400, "top_p"),
    ("100,000-deep prompt", False, {**COMPLETION, "prompt": DEEP}, 400, None),
    ("100,000-deep messages", True, {**CHAT, "messages": DEEP}, 400, None),
    ("lone surrogate in prompt", False, {**COMPLETION, "prompt": SURROGATE}, 400, "prompt"),
    ("lone surrogate in a prompt list", False, {**COMPLETION, "prompt": ["ok", SURROGATE]}, 400, "prompt"),
    ("lone surrogate in content", True, {**CHAT, "messages": [{"role": "user", "content": SURROGATE}]}, 400,
     "messages"),
    ("lone surrogate in a content part", True,
     {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": SURROGATE}]}]}, 400, "messages"),
    ("lone surrogate in model", False, {**COMPLETION, "model": SURROGATE}, 400, "model"),
    ("chat_template_kwargs.tokenize", True, {**CHAT, "chat_template_kwargs": {"tokenize": False}}, 400,
     "chat_template_kwargs"),
    ("chat_template_kwargs.add_generation_prompt", True,
     {**CHAT, "chat_template_kwargs": {"add_generation_prompt": False}}, 400, "chat_template_kwargs"),
    ("chat_template_kwargs.messages", True, {**CHAT, "chat_template_kwargs": {"messages": []}}, 400,
     "chat_template_kwargs"),
    ("top_k 2**31", False, {**COMPLETION, "temperature": 1.0, "top_k": 2 ** 31}, 400, "top_k"),
    ("stop_token_ids 2**40", False, {**COMPLETION, "stop_token_ids": [2 ** 40]}, 400, "stop_token_ids"),
    # new bounds: nothing outside them reaches the engine
    ("lone surrogate in stop", False, {**COMPLETION, "stop": [SURROGATE]}, 400, "stop"),
    ("lone surrogate in cache_salt", False, {**COMPLETION, "cache_salt": SURROGATE}, 400, "cache_salt"),
    ("lone surrogate in a key", False, {**COMPLETION, Raw('"k\\udc00"'): 1}, 400, "k\\udc00"),
    ("70-deep unknown field", False, {**COMPLETION, "x": Raw("[" * 70 + "]" * 70)}, 400, "x"),
    ("NaN temperature", False, {**COMPLETION, "temperature": Raw("NaN")}, 400, "temperature"),
    ("Infinity in an unknown field", False, {**COMPLETION, "x": Raw("-Infinity")}, 400, "x"),
    ("1e999 top_p", False, {**COMPLETION, "top_p": Raw("1e999")}, 400, "top_p"),
    ("subnormal top_p", False, {**COMPLETION, "top_p": 1e-40}, 400, "top_p"),
    ("seed 2**63", False, {**COMPLETION, "seed": 2 ** 63}, 400, "seed"),
    ("seed 2**64", False, {**COMPLETION, "seed": 2 ** 64}, 400, "seed"),
    ("max_tokens 2**31", False, {**COMPLETION, "max_tokens": 2 ** 31}, 400, "max_tokens"),
    ("n 2**70", False, {**COMPLETION, "n": 2 ** 70}, 400, "n"),
    ("token id 2**31", False, {**COMPLETION, "prompt": [2 ** 31]}, 400, "prompt"),
    ("stop_token_ids -1", False, {**COMPLETION, "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ("17 stop strings", False, {**COMPLETION, "stop": [f"s{i}" for i in range(17)]}, 400, "stop"),
    ("chat_template_kwargs.conversation", True, {**CHAT, "chat_template_kwargs": {"conversation": []}}, 400,
     "chat_template_kwargs"),
    ("chat_template_kwargs.return_dict", True, {**CHAT, "chat_template_kwargs": {"return_dict": True}}, 400,
     "chat_template_kwargs"),
    ("client template in chat_template_kwargs", True, {**CHAT, "chat_template_kwargs": {"chat_template": "hi"}},
     400, "chat_template_kwargs"),
    ("client template in chat_template", True, {**CHAT, "chat_template": "{{ 'hi' }}"}, 400, "chat_template"),
    # a surrogate encoded in UTF-8 (json decodes bytes with "surrogatepass"), and bytes that are no UTF-8
    ("UTF-8 surrogate", False, b'{"model": "tiny", "prompt": "\xed\xa0\x80"}', 400, "prompt"),
    ("invalid UTF-8", False, b'{"model": "tiny", "prompt": "\xff\xfe"}', 400, None),
]


@pytest.mark.parametrize("name, chat, body, status, param", HOSTILE, ids=[case[0] for case in HOSTILE])
def test_hostile_fields_are_typed_4xx(server, name, chat, body, status, param):
    err = _error(post(server.url + PATHS[chat], body), status)
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert httpx.get(server.url + "/health", timeout=2).status_code == 200


def test_body_over_the_limit_is_413(server):
    response = post(server.url + "/v1/completions", {**COMPLETION, "x": "a" * MAX_BODY})
    err = _error(response, 413, "request_too_large")
    assert err["type"] == "invalid_request_error"
    assert_live(server.url)


def test_hostile_requests_never_disturb_a_running_stream(server):
    """A stream in flight ends with the text it has alone while every
    hostile request above arrives (top_k = 2**31 once failed the engine step
    and so every request in it), and no request got a 500."""
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 48, "temperature": 0, "ignore_eos": True}
    alone = post(server.url + "/v1/completions", body).json()["choices"][0]["text"]
    errors_500 = metric(metrics(server), "jaxkv_http_errors_total", status="500")

    async def stream(http):
        text = []
        async with http.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    payload = json.loads(line[6:])
                    assert "error" not in payload, payload
                    text += [c["text"] for c in payload["choices"]]
        return "".join(text)

    async def hostile(http):
        await asyncio.sleep(0.05)
        statuses = []
        for _, chat, raw, _, _ in HOSTILE:
            response = await http.post(server.url + PATHS[chat], content=raw if isinstance(raw, bytes) else
                                       encode(raw), headers={"Content-Type": "application/json"})
            statuses.append(response.status_code)
        return statuses

    async def run():
        async with httpx.AsyncClient(timeout=120) as http:
            return await asyncio.gather(stream(http), hostile(http))

    text, statuses = asyncio.run(run())
    assert text == alone
    assert all(400 <= s < 500 for s in statuses), statuses
    assert metric(metrics(server), "jaxkv_http_errors_total", status="500") == errors_500


# ------------------------------------------------------------------ chat templates


def test_client_templates_refused_and_model_templates_by_name(server):
    url = server.url + "/v1/chat/completions"
    for body, param in (({**CHAT, "chat_template": SLOW_TEMPLATE}, "chat_template"),
                        ({**CHAT, "chat_template_kwargs": {"chat_template": SLOW_TEMPLATE}}, "chat_template_kwargs")):
        started = time.perf_counter()
        err = _error(post(url, body), 400, "chat_template_not_allowed")
        assert err["param"] == param and "--trust-request-chat-template" in err["message"]
        assert time.perf_counter() - started < 5  # refused, never rendered
    # the model's own template, by name, and a harmless template variable
    assert post(url, {**CHAT, "chat_template": "default"}).status_code == 200
    assert post(url, {**CHAT, "chat_template_kwargs": {"enable_thinking": False}}).status_code == 200
    for key in ("tokenize", "add_generation_prompt", "messages", "conversation", "return_dict", "tools",
                "documents", "special_tokens", "template"):
        err = _error(post(url, {**CHAT, "chat_template_kwargs": {key: None}}), 400)
        assert err["param"] == "chat_template_kwargs" and repr(key) in err["message"], err


# ------------------------------------------------------------------ the property test

# valid ranges (max_tokens: with the shortest prompt, "hi" as 2 tokens)
INT_FIELDS = {"max_tokens": (1, MAX_MODEL_LEN - 2), "n": (1, 16), "top_k": (-1, 2 ** 31 - 1),
              "seed": (-(2 ** 63), 2 ** 63 - 1)}
BOOL_FIELDS = ("stream", "ignore_eos")


def _json_values(exclude: tuple = ()) -> st.SearchStrategy:
    """Plain JSON values (no null: a null field is a missing one), none of
    the kinds in ``exclude`` (``int``, ``float``, ``str``, ``bool``,
    ``list``, ``dict``)."""
    kinds = {"int": st.integers(-10 ** 6, 10 ** 6), "float": st.floats(allow_nan=False, allow_infinity=False),
             "str": st.text(max_size=8), "bool": st.booleans(), "list": st.lists(st.integers(0, 9), max_size=3),
             "dict": st.dictionaries(st.text(max_size=3), st.integers(0, 9), max_size=2)}
    return st.one_of(*[s for k, s in kinds.items() if k not in exclude])


def _outside(low: int, high: int) -> st.SearchStrategy:
    return st.one_of(st.integers(min_value=-(2 ** 70), max_value=low - 1),
                     st.integers(min_value=high + 1, max_value=2 ** 70),
                     st.sampled_from([low - 1, high + 1, 2 ** 31, 2 ** 32, 2 ** 63, 2 ** 64, -(2 ** 63) - 1]).filter(
                         lambda v: not low <= v <= high))


def _surrogate_string() -> st.SearchStrategy:
    def build(parts):
        before, code, after = parts
        dump = lambda t: json.dumps(t, ensure_ascii=False)[1:-1]  # noqa: E731
        return Raw(f'"{dump(before)}\\u{code:04x}{dump(after)}"')
    return st.tuples(st.text(max_size=6), st.integers(0xD800, 0xDFFF), st.text(max_size=6)).map(build)


def _anywhere() -> st.SearchStrategy:
    """Values no field takes, wherever they are: integers beyond 64 bits
    (up to 6,000 digits), NaN / Infinity / overflowing literals, nesting
    deeper than 64 (up to 100,000), lone surrogates."""
    return st.one_of(
        st.tuples(st.sampled_from(["", "-"]), st.integers(20, 6000)).map(lambda t: Raw(t[0] + "9" * t[1])),
        st.one_of(st.integers(min_value=2 ** 64), st.integers(max_value=-(2 ** 63) - 1)).map(lambda v: Raw(str(v))),
        st.sampled_from(["NaN", "Infinity", "-Infinity", "1e999", "-1e400", "1" + "0" * 400 + ".5"]).map(Raw),
        st.tuples(st.integers(64, 100_000), st.booleans()).map(
            lambda t: Raw("[" * t[0] + "]" * t[0] if t[1] else '{"a":' * t[0] + "1" + "}" * t[0])),
        _surrogate_string())


def _field_mutations(chat: bool) -> st.SearchStrategy:
    """``[(field, bad value), ...]``: each sets a field to a value it never
    takes (wrong type, out of range, refused)."""
    m = []
    for name, (low, high) in INT_FIELDS.items():
        m.append(st.tuples(st.just(name), st.one_of(_outside(low, high), _json_values(("int",)))))
    for name in BOOL_FIELDS:
        m.append(st.tuples(st.just(name), _json_values(("bool",))))
    m += [
        st.tuples(st.just("temperature"), st.one_of(
            st.floats(max_value=-1e-9, allow_infinity=False), st.floats(min_value=2.0001, allow_infinity=False),
            _json_values(("int", "float")))),
        st.tuples(st.just("top_p"), st.one_of(
            st.floats(max_value=1e-39, allow_infinity=False, allow_nan=False), st.floats(min_value=1.0001,
                                                                                        allow_infinity=False),
            _json_values(("int", "float")))),
        st.tuples(st.just("stop"), st.one_of(
            _json_values(("str", "list")), st.just([""]), st.lists(st.text(min_size=1), min_size=17, max_size=20),
            st.lists(_json_values(("str",)), min_size=1, max_size=3))),
        st.tuples(st.just("stop_token_ids"), st.one_of(
            _json_values(("list",)), st.lists(st.one_of(_outside(0, VOCAB - 1), _json_values(("int",))),
                                               min_size=1, max_size=3))),
        st.tuples(st.just("stream_options"), st.one_of(_json_values(("dict",)), st.just({"include_usage": True}))),
        st.tuples(st.just("cache_salt"), st.one_of(_json_values(("str",)), st.just(""))),
        st.tuples(st.just("model"), st.one_of(_json_values(("str",)), st.text(min_size=1).filter(lambda t: t != MODEL),
                                              st.integers(10 ** 4, 10 ** 6).map(lambda n: "m" * n))),
        st.tuples(st.just("best_of"), st.one_of(_outside(1, 16), st.sampled_from([0.5, "3", True]))),
        st.tuples(st.just("echo"), st.sampled_from([1, "yes", [True]])),
        st.tuples(st.just("prompt_logprobs"), st.one_of(_outside(0, 20), st.sampled_from([0.5, "3", [1]]))),
        st.tuples(st.sampled_from(["tools", "response_format"]),
                  st.sampled_from([5, 2, 0.5, True, {"1": 5}, [{"type": "function"}]]).filter(
                      lambda v: v not in (0, 1, False))),
        st.tuples(st.sampled_from(["presence_penalty", "frequency_penalty"]),
                  st.one_of(st.floats(2.0001, 1e300), st.floats(-1e300, -2.0001), st.sampled_from(["1", [1], True]))),
        st.tuples(st.just("repetition_penalty"), st.one_of(st.floats(-1e300, 0), st.floats(10.0001, 1e300),
                                                           st.sampled_from(["1", True]))),
        st.tuples(st.just("min_tokens"), st.one_of(_outside(0, 2 ** 31 - 1), st.sampled_from([0.5, "3"]))),
        st.tuples(st.just("logit_bias"), st.one_of(
            st.sampled_from([[1], "x", {"x": 1}, {"-1": 1}, {"1": 101}, {"1": -100.5}, {"1": "5"}, {"1": True},
                             {str(VOCAB): 1}, {"99999999999": 1}]),
            st.integers(301, 400).map(lambda n: {str(i): 1 for i in range(n)}))),
        st.tuples(st.just("logprobs"), st.one_of(_outside(0, 20), st.sampled_from([0.5, "3", [1]]))),
        st.tuples(st.just("top_logprobs"), st.one_of(_outside(0, 20), st.sampled_from([0.5, "3", [1]]))),
    ]
    if chat:
        m += [
            st.tuples(st.just("messages"), st.one_of(
                _json_values(("list",)), st.just([]), st.lists(_json_values(("dict",)), min_size=1, max_size=2),
                st.just([{"content": "no role"}]), st.just([{"role": 5, "content": "x"}]),
                st.just([{"role": "user", "content": 5}]),
                st.just([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]),
                st.integers(300, 200_000).map(lambda n: [{"role": "user", "content": "w" * n}]))),
            st.tuples(st.just("chat_template_kwargs"), st.one_of(
                _json_values(("dict",)),
                st.sampled_from(["tokenize", "add_generation_prompt", "messages", "conversation", "return_dict",
                                 "tools", "documents", "template", "chat_template"]).flatmap(
                    lambda key: st.fixed_dictionaries({key: st.one_of(st.none(), _json_values())})).filter(
                    lambda d: d.get("chat_template", "x") not in (None, "default")))),
            st.tuples(st.just("chat_template"), st.one_of(
                _json_values(("str",)), st.text(min_size=1).filter(lambda t: t != "default"))),
            st.tuples(st.just("add_generation_prompt"), _json_values(("bool",))),
            st.tuples(st.just("max_completion_tokens"), st.one_of(_outside(1, MAX_MODEL_LEN - 2),
                                                                  _json_values(("int",)))),
        ]
    else:
        m.append(st.tuples(st.just("prompt"), st.one_of(
            _json_values(("str", "list")), st.just(""), st.just([]), st.just([[]]),
            st.lists(st.one_of(_outside(0, VOCAB - 1), st.floats(), st.booleans()), min_size=1, max_size=3),
            st.lists(st.just("p"), min_size=17, max_size=20),
            st.integers(300, 200_000).map(lambda n: "w" * n))))
    return st.one_of(*m)


@st.composite
def hostile_bodies(draw) -> tuple[bool, dict]:
    """A valid request with one to three fields set to values it never
    takes (any field, known or not, for the values no field takes)."""
    chat = draw(st.booleans())
    body = dict(CHAT if chat else COMPLETION)
    names = st.one_of(st.sampled_from(sorted(body) + ["n", "seed", "top_k", "stop", "x"]), st.text(max_size=6))
    for _ in range(draw(st.integers(1, 3))):
        name, value = draw(st.one_of(st.tuples(names, _anywhere()), _field_mutations(chat),
                                     st.tuples(_surrogate_string(), _json_values())))  # a key no one can read
        if name == "max_completion_tokens":
            body.pop("max_tokens", None)  # it counts only without max_tokens
        body[name] = value
    return chat, body


def _check_hostile(url: str, case: tuple[bool, dict]) -> None:
    chat, body = case
    raw = encode(body)
    response = post(url + PATHS[chat], raw)
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:300], raw[:300])
    err = response.json()["error"]
    assert isinstance(err["message"], str) and err["type"] == "invalid_request_error", err
    health = httpx.get(url + "/health", timeout=5)
    assert health.status_code == 200


def test_property_hostile_bodies_are_4xx_and_the_server_stays_live(server):
    @settings(max_examples=60, deadline=None)
    @given(case=hostile_bodies())
    def check(case):
        _check_hostile(server.url, case)

    check()
    assert_live(server.url)
    assert metric(metrics(server), "jaxkv_http_errors_total", status="500") == 0


def test_property_hostile_bodies_long(server):
    """The same, wider (``pytest -m long``; ``JAXKV_HYPOTHESIS=long`` widens
    it further)."""
    @settings(max_examples=max(1000, settings.default.max_examples * 3), deadline=None)
    @given(case=hostile_bodies())
    def check(case):
        _check_hostile(server.url, case)

    check()
    assert_live(server.url)
    assert metric(metrics(server), "jaxkv_http_errors_total", status="500") == 0


# ------------------------------------------------------------------ an in-process server and a fake engine


@dataclasses.dataclass
class FakeOutput:
    """A :class:`jaxkv.serve.RequestOutput` with the ``error`` field the
    engine gives a request it fails alone."""

    request_id: int
    new_token_ids: tuple
    finished: bool
    finish_reason: str | None
    new_text: str = ""
    cached_tokens: int = 0
    error: str | None = None
    new_logprobs: tuple | None = None


class FakeEngine:
    """An engine stand-in: each request makes token ``x`` once per step up
    to ``max_new_tokens``; a request whose prompt holds token 0 fails alone
    (``finish_reason "error"``, a ``RuntimeError`` message), token 1 too
    (an ``InvalidArgument`` message); with ``fail_all`` every request
    fails."""

    vocab_size = VOCAB
    max_model_len = MAX_MODEL_LEN

    def __init__(self, fail_all: bool = False):
        self.fail_all = fail_all
        self.requests: dict[int, dict] = {}
        self.aborted: list[int] = []
        self.next_id = 0

    def add_request(self, prompt, max_new_tokens=16, **kwargs) -> int:
        rid, self.next_id = self.next_id, self.next_id + 1
        self.requests[rid] = {"prompt": list(prompt), "left": max_new_tokens}
        return rid

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[FakeOutput]:
        time.sleep(0.002)
        out = []
        for rid, request in list(self.requests.items()):
            if self.fail_all or 0 in request["prompt"]:
                out.append(FakeOutput(rid, (), True, "error", error="RuntimeError: boom in this request's row"))
            elif 1 in request["prompt"]:
                out.append(FakeOutput(rid, (), True, "error", error="InvalidArgument: this request's row is bad"))
            else:
                request["left"] -= 1
                done = request["left"] == 0
                out.append(FakeOutput(rid, (120,), done, "length" if done else None, new_text="x"))
                if not done:
                    continue
            del self.requests[rid]
        return out

    def abort(self, rid: int) -> None:
        if self.requests.pop(rid, None) is not None:
            self.aborted.append(rid)

    def forget(self, rid: int) -> None:
        pass

    def stats(self) -> dict:
        return {}


class ThreadServer:
    """An app served by uvicorn on a thread of this process (127.0.0.1)."""

    def __init__(self, app):
        self.app = app
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    access_log=False))
        self.thread = threading.Thread(target=self.server.run, name="test-uvicorn", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        self.stop()
        raise AssertionError("the in-process server never became ready")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="module")
def tokenizer(checkpoint):  # noqa: F811 - checkpoint: tests/test_server.py's fixture
    from jaxkv.text import Tokenizer

    return Tokenizer.from_pretrained(str(checkpoint))


def _serve_fake(tokenizer, engine: FakeEngine, **options) -> ThreadServer:
    from jaxkv.serve.http import create_app

    return ThreadServer(create_app(lambda: (engine, tokenizer), served_model_names=[MODEL], **options))


@pytest.fixture(scope="module")
def fake(tokenizer):
    engine = FakeEngine()
    srv = _serve_fake(tokenizer, engine)
    srv.engine = engine
    try:
        yield srv
    finally:
        srv.stop()


def _sse(url: str, body: dict) -> list[str]:
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200
        return [line for line in response.iter_lines() if line.startswith("data: ")]


def test_engine_error_fails_its_request_alone(fake):
    """A request the engine finishes with ``finish_reason "error"`` gets an
    error of its own (500 ``internal_error``; 400 for an ``InvalidArgument``
    message; streamed: an error event, then ``[DONE]``), counted as finished
    with reason ``error``; a stream running beside it ends whole."""
    url = fake.url + "/v1/completions"
    before = metric(metrics(fake), "jaxkv_request_success_total", finish_reason="error")

    async def run():
        async with httpx.AsyncClient(timeout=60) as http:
            stream = asyncio.create_task(http.post(url, json={"model": MODEL, "prompt": [5, 6], "max_tokens": 40,
                                                               "stream": True}))
            await asyncio.sleep(0.02)
            failed = [await http.post(url, json={"model": MODEL, "prompt": [7, 0], "max_tokens": 5}),
                      await http.post(url, json={"model": MODEL, "prompt": [7, 1], "max_tokens": 5})]
            return await stream, failed

    streamed, (internal, invalid) = asyncio.run(run())
    err = _error(internal, 500, "internal_error")
    assert "boom in this request's row" in err["message"]
    err = _error(invalid, 400, "invalid_value")
    assert err["message"].startswith("InvalidArgument")
    lines = [line for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "x" * 40
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"

    # streamed: an error event, then the end
    lines = _sse(url, {"model": MODEL, "prompt": [0, 9], "max_tokens": 5})
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["error"]["code"] == "internal_error"

    # one choice of several fails: the request fails, the others are aborted
    aborted = len(fake.engine.aborted)
    response = post(url, {"model": MODEL, "prompt": [[5, 6], [0, 6]], "max_tokens": 200})
    _error(response, 500, "internal_error")
    deadline = time.monotonic() + 10
    while len(fake.engine.aborted) == aborted and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(fake.engine.aborted) > aborted and not fake.engine.requests

    assert metric(metrics(fake), "jaxkv_request_success_total", finish_reason="error") == before + 4
    ok = post(url, {"model": MODEL, "prompt": [5, 6], "max_tokens": 3})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "xxx"


def test_warm_up_error_warns_and_the_server_gets_ready(tokenizer, caplog):
    from jaxkv.serve.http import create_app, warm_up

    with caplog.at_level(logging.WARNING, logger="jaxkv.serve"):
        result = warm_up(FakeEngine(fail_all=True), vocab_size=VOCAB)
    assert result["requests"] == 3  # one per bucket (the fake has none: one), then a request and its sibling
    assert any("warm-up" in r.getMessage() and "error" in r.getMessage() for r in caplog.records
               if r.levelno == logging.WARNING), caplog.text

    def build():
        engine = FakeEngine(fail_all=True)
        warm_up(engine, vocab_size=VOCAB)
        engine.fail_all = False
        return engine, tokenizer

    srv = ThreadServer(create_app(build, served_model_names=[MODEL]))  # waits for /health 200
    try:
        assert post(srv.url + "/v1/completions", {"model": MODEL, "prompt": [5], "max_tokens": 2}).status_code == 200
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def trusted(tokenizer):
    srv = _serve_fake(tokenizer, FakeEngine(), trust_request_chat_template=True, render_timeout=3.0)
    try:
        yield srv
    finally:
        srv.stop()


def test_trusted_server_renders_a_client_template(trusted):
    url = trusted.url + "/v1/chat/completions"
    template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    for body in ({**CHAT, "chat_template": template}, {**CHAT, "chat_template_kwargs": {"chat_template": template}}):
        out = post(url, body)
        assert out.status_code == 200, out.text
        assert out.json()["usage"]["prompt_tokens"] == len("[hi]")  # byte-level: one token a byte
    # still not the call's own arguments, and a template given twice is ambiguous
    _error(post(url, {**CHAT, "chat_template_kwargs": {"tokenize": False}}), 400)
    _error(post(url, {**CHAT, "chat_template": template, "chat_template_kwargs": {"chat_template": template}}), 400)
    # a template that fails on the conversation is the request's fault: 400
    err = _error(post(url, {**CHAT, "chat_template": "{{ raise_exception('no thanks') }}"}), 400)
    assert "no thanks" in err["message"] and err["param"] == "chat_template"


def test_long_text_tokenizes_off_the_event_loop(server, tokenizer):
    """Tokenizing a 3 MB prompt (seconds with the byte-level tokenizer)
    never stops the server's event loop: ``/health`` answers within a second
    meanwhile (``tokenizers``' ``encode`` holds the GIL throughout, so on a
    render thread it would still freeze the loop; the server tokenizes
    through ``encode_batch``, which releases it, and gets the same ids).
    The subprocess server: a server in this process would freeze this
    test's thread too."""
    from jaxkv.serve.http import _encode

    for text in ("Hello, world!", "<|im_start|>user\nhi<|im_end|>", "caf\u00e9 \U0001F600 \t\n end"):
        for special in (True, False):
            assert _encode(tokenizer, text, add_special_tokens=special) == tokenizer.encode(text, special)
    result: dict = {}

    def long_prompt():
        started = time.perf_counter()
        result["response"] = post(server.url + "/v1/completions", {"model": MODEL, "prompt": "w" * 3_000_000})
        result["seconds"] = time.perf_counter() - started

    thread = threading.Thread(target=long_prompt)
    thread.start()
    answered = []
    while thread.is_alive() and len(answered) < 40:
        started = time.perf_counter()
        assert httpx.get(server.url + "/health", timeout=30).status_code == 200
        answered.append(time.perf_counter() - started)
        time.sleep(0.05)
    thread.join(60)
    _error(result["response"], 400, "context_length_exceeded")
    assert result["seconds"] > 1.5, "tokenizing was too quick to show anything"
    assert len(answered) >= 5 and max(answered) < 1.0, answered


def test_slow_template_renders_off_the_event_loop_and_is_interrupted(trusted):
    """A client's template that would loop 10**10 times renders on a render
    thread: ``/health`` and other requests answer within a second meanwhile;
    at the time bound (3 s here) its request gets 503 ``render_timeout`` and
    the render is interrupted, so its thread is free again."""
    renderer = trusted.app.state.jaxkv.renderer
    result: dict = {}

    def slow():
        started = time.perf_counter()
        result["response"] = post(trusted.url + "/v1/chat/completions", {**CHAT, "chat_template": SLOW_TEMPLATE})
        result["seconds"] = time.perf_counter() - started

    thread = threading.Thread(target=slow)
    thread.start()
    deadline = time.monotonic() + 10
    while renderer.busy == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert renderer.busy == 1, "the slow template never started rendering"
    answered = []
    started = time.perf_counter()
    assert post(trusted.url + "/v1/chat/completions", CHAT).status_code == 200  # the model's template meanwhile
    answered.append(time.perf_counter() - started)
    while thread.is_alive() and len(answered) < 10:
        started = time.perf_counter()
        assert httpx.get(trusted.url + "/health", timeout=5).status_code == 200
        answered.append(time.perf_counter() - started)
        time.sleep(0.1)
    assert renderer.busy == 1 or not thread.is_alive()
    assert len(answered) >= 5 and max(answered) < 1.0, answered
    thread.join(30)
    err = _error(result["response"], 503, "render_timeout")
    assert "3 s" in err["message"]
    assert result["seconds"] < 10
    deadline = time.monotonic() + 5
    while renderer.busy and time.monotonic() < deadline:
        time.sleep(0.01)
    assert renderer.busy == 0, "the timed-out render still runs"


def test_render_pool_survives_interrupts_at_any_moment():
    """Calls that end just before, at and after their time bound (so the
    interrupt lands inside the call, between its end and its bookkeeping, or
    is cancelled): afterwards every worker is alive, none is busy, and calls
    return their results."""
    from jaxkv.serve.http import APIError, _RenderPool

    def spin(seconds: float) -> float:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass
        return seconds

    async def run():
        pool = _RenderPool(workers=3, timeout=0.05)
        outcomes = {"done": 0, "timed_out": 0}

        async def one(i: int):
            try:
                assert await pool.run(spin, 0.035 + 0.0005 * (i % 60)) > 0
                outcomes["done"] += 1
            except APIError as err:
                assert err.status == 503 and err.code == "render_timeout"
                outcomes["timed_out"] += 1

        for start in range(0, 120, 3):  # three at a time: no queueing, the bound falls inside the calls
            await asyncio.gather(*(one(i) for i in range(start, start + 3)))
        deadline = time.monotonic() + 5
        while pool.busy and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert pool.busy == 0
        assert all(thread.is_alive() for thread in pool._threads)
        assert await asyncio.gather(*(pool.run(spin, 0.001) for _ in range(6))) == [0.001] * 6
        pool.close()
        return outcomes

    outcomes = asyncio.run(run())
    assert outcomes["done"] and outcomes["timed_out"], outcomes


# ------------------------------------------------------------------ tool calls (a scripted engine)


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}}}}}


class ScriptedEngine(FakeEngine):
    """Every request's output is ``script``, given out in pieces of 1 to 4
    characters (a stream splits a ``<tool_call>`` tag across chunks), then
    ``"stop"``."""

    def __init__(self, script: str):
        super().__init__()
        self.script = script

    def add_request(self, prompt, max_new_tokens=16, **kwargs) -> int:
        rid = super().add_request(prompt, max_new_tokens, **kwargs)
        self.requests[rid]["text"] = self.script
        return rid

    def step(self) -> list[FakeOutput]:
        time.sleep(0.002)
        out = []
        for rid, request in list(self.requests.items()):
            piece, request["text"] = request["text"][: 1 + rid % 4], request["text"][1 + rid % 4:]
            done = not request["text"]
            out.append(FakeOutput(rid, (120,), done, "stop" if done else None, new_text=piece))
            if done:
                del self.requests[rid]
        return out


def test_tool_calls_are_parsed_streamed_and_not(tokenizer):
    """Hermes-style calls in the output come back as OpenAI ``tool_calls``
    (the text around them as content, finish reason ``tool_calls``),
    streamed (the tag held back across chunks) and not, through the openai
    client; a malformed call stays text; ``tool_choice: none`` parses
    nothing; a named function that is not declared is a 400 (``required``
    and named calls are constrained: tests/test_server.py)."""
    import openai

    script = ('Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
              '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>')
    srv = _serve_fake(tokenizer, ScriptedEngine(script))
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
        kw = dict(model=MODEL, messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER], max_tokens=200)
        for n in range(3):  # requests of different ids: pieces of 1, 2, 3 characters
            full = client.chat.completions.create(**kw)
            message = full.choices[0].message
            assert message.content == "Let me look." and full.choices[0].finish_reason == "tool_calls"
            assert [json.loads(c.function.arguments) for c in message.tool_calls] == [{"city": "Paris"},
                                                                                     {"city": "Oslo"}]
            assert all(c.function.name == "get_weather" and c.type == "function" for c in message.tool_calls)
            chunks = [c for c in client.chat.completions.create(**kw, stream=True) if c.choices]
            assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Let me look."
            calls = [t for c in chunks for t in (c.choices[0].delta.tool_calls or [])]
            assert [json.loads(t.function.arguments) for t in calls] == [{"city": "Paris"}, {"city": "Oslo"}]
            assert [t.index for t in calls] == [0, 1]
            assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["tool_calls"]
        plain = client.chat.completions.create(**kw, tool_choice="none")
        assert plain.choices[0].message.content == script and not plain.choices[0].message.tool_calls
        with pytest.raises(openai.BadRequestError, match="does not declare"):
            client.chat.completions.create(**kw, tool_choice={"type": "function", "function": {"name": "nope"}})
    finally:
        srv.stop()
    broken = _serve_fake(tokenizer, ScriptedEngine('<tool_call>{"name": "get_weather", "arguments": {</tool_call>'))
    try:
        response = post(broken.url + "/v1/chat/completions", {**kw, "tools": [WEATHER]})
        choice = response.json()["choices"][0]
        assert choice["message"]["content"].startswith("<tool_call>") and "tool_calls" not in choice["message"]
        assert choice["finish_reason"] == "stop"
    finally:
        broken.stop()
