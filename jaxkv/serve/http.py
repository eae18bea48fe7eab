"""An OpenAI-compatible HTTP server over :class:`jaxkv.serve.Engine`.

``python -m jaxkv.serve --model PATH`` (see :mod:`jaxkv.serve.__main__`)
serves, on FastAPI + uvicorn:

* ``GET /health``: 200 once ready (model loaded, compiled programs warmed
  up), 503 while starting (or when the start failed);
* ``GET /v1/models``: the served model name(s) and ``max_model_len``;
* ``POST /v1/completions``: ``prompt`` as text, a list of token ids, or a
  list of either (one choice group per prompt);
* ``POST /v1/chat/completions``: ``messages`` rendered with the tokenizer's
  chat template (``add_generation_prompt``, ``chat_template_kwargs``: more
  template variables; ``chat_template``: one of the model's templates by
  name, or, only with ``--trust-request-chat-template``, a template of the
  request's own: see Hostile requests); ``content`` a string or a list of
  ``{"type": "text", "text": ...}`` parts;
* ``GET /metrics``: Prometheus text (:mod:`jaxkv.serve.metrics`).

Request fields: ``model`` (required), ``max_tokens`` (chat also
``max_completion_tokens``; 1..2**31-1 and within the context; default 16 for
completions, the rest of the context for chat), ``temperature`` (0..2; 0
greedy; a positive value below :data:`MIN_TEMPERATURE` is served at it, as
vLLM does), ``top_p`` (:data:`FLOAT32_TINY`..1: a positive normal float32),
``top_k`` (-1..2**31-1; 0 or -1: off), ``seed`` (an int64, OpenAI's range;
reduced to 32 bits), ``stop`` (a string or a list of at most
:data:`MAX_STOP` non-empty strings), ``n`` (1..:data:`MAX_N`), ``stream``,
``stream_options``
(``{"include_usage": true}``: a last chunk with ``usage`` and no choices),
``cache_salt`` (vLLM's name: the request's prefixes go into their own
namespace of the prefix cache, so requests with different salts never share
a prefix, and requests with the same salt do; with API keys, within the
request's tenant only: see below), and two vLLM extensions,
``ignore_eos`` and ``stop_token_ids`` (ids in the vocabulary, as prompt ids
are). ``logprobs``: chat ``logprobs: true`` with ``top_logprobs``
(0..20), completions ``logprobs`` (0..20): each token's log-probability
and the top ones', computed in the engine's jitted calls with the tokens
(read where the server's ``--logprobs-mode`` says: by default the
distribution the token was sampled from), in OpenAI's shapes for both
endpoints, streamed and not (a -inf is sent as :data:`LOGPROB_FLOOR`; a
token's text is its own decoding). ``presence_penalty`` /
``frequency_penalty`` (-2..2), ``logit_bias`` (token id strings -> -100..100,
at most 300), and vLLM's ``repetition_penalty`` (0 exclusive..10) and
``min_tokens`` (:mod:`jaxkv.nn.penalties`, applied on the device before
temperature, top-k and top-p). Chat ``tools`` / ``tool_choice`` (``auto``,
``none``) go through the chat template and Hermes-style calls are parsed
from the output (:mod:`jaxkv.serve.tools`). Completions' ``best_of`` (the
``n`` of ``best_of`` candidates with the highest cumulative logprob) and
``echo``. Structured outputs: ``response_format`` (``json_object``,
``json_schema``), vLLM's ``structured_outputs`` (``json``, ``regex``,
``choice``, ``json_object``) and ``guided_json`` / ``guided_regex`` /
``guided_choice``, and chat's ``tool_choice`` ``required`` or a named
function, compiled into a token automaton the engine applies on the device
(:mod:`jaxkv.serve.structured`); ``structured_outputs.grammar`` /
``guided_grammar`` (Lark or GBNF), parsed on the host by llguidance
(:mod:`jaxkv.serve.grammar`); an invalid or unenforceable constraint is
a 400. vLLM's ``prompt_logprobs`` (0..20: each prompt token's
log-probability, rank and top ones, scored in the packed steps that
prefill the prompt; such a request takes no prefix-cache hit), and
completions' ``echo`` with ``logprobs`` (the prompt's tokens first, the
first one's None). Fields the server cannot honour (``suffix``,
``functions``...) set to anything but their
neutral value are refused with 400 rather than silently ignored. Non-stream responses always carry ``usage``
(``prompt_tokens``: each distinct prompt once, whatever ``n``;
``completion_tokens``: over every choice).

``n > 1`` (and ``best_of``) is served as ``n`` engine requests on the same
prompt with seeds ``seed, seed + 1, ...`` (without a ``seed``, each request
draws from the engine's own per-request stream) that share one prefill:
the first is admitted and prefills the prompt, the others are its siblings
(``Engine.add_request``'s ``fork_of``): they wait for it and fork its
cache, computing only the last prompt token (on a paged pool its whole
pages taken from its block table and its partly filled page copied; on a
hybrid cache its state at the last token but one;
``tests/test_parallel_sampling.py``).

**API keys and tenants** (``create_app(api_keys={key: tenant})``; the
command line's ``--api-key`` / ``--api-keys-file``). Without keys every
request is served and its prefix-cache namespace is ``("cache_salt", salt)``
(no salt: ``None``, the shared namespace). With keys, every request except
``GET /health`` and ``GET /metrics`` (paths under ``/v1`` and unknown paths
alike) must carry ``Authorization: Bearer <key>`` with a configured key;
otherwise it gets 401 (``authentication_error``, ``code`` ``missing_api_key``
or ``invalid_api_key``) before its body is read. The key names the request's
tenant, and its namespace is ``("tenant", tenant, salt)`` (no salt:
``("tenant", tenant, None)``): a tenant's requests share prefixes unless their
salts differ, and requests of two tenants never do, whatever salts they give
(a tenant cannot enter another's namespace by guessing its salt; several keys
naming one tenant share its namespace). Keys are compared in constant time
(:class:`APIKeys`). The ``cache_salt`` value and the keys never appear in a
metric label, a log line or an error message; with keys, the per-request
metrics carry the tenant's name as label ``tenant``
(:mod:`jaxkv.serve.metrics`). ``/metrics`` itself needs no key and shows every
tenant's name and traffic: keep it off public networks (scrape it from
inside).

Errors are OpenAI-style JSON ``{"error": {"message", "type", "code",
"param"}}``: 400 (``invalid_request_error``) for a body that is not JSON or
not an object, a missing field, a value of the wrong type or out of range,
an unsupported field, a value no field takes (see Hostile requests), a
request template without the flag (``chat_template_not_allowed``), a chat
template that refuses or fails on the conversation, and a prompt that with
``max_tokens`` does not fit the context (``code: context_length_exceeded``)
or that the engine says can never fit; 401 (``authentication_error``) for a
missing or unknown API key; 404 for an unknown model (``model_not_found``)
or path; 413 (``request_too_large``) for a body over the limit; 503
(``model_not_ready``) while starting, (``render_timeout``) for rendering and
tokenizing that ran past the time bound; 500 (``internal_error``) for a
failure inside the engine. A refused request is refused before it reaches
the engine (or, for the engine's own check, at ``add_request``, which queues
nothing), so it never disturbs the requests being served.

A request the engine fails on its own (``RequestOutput.finish_reason ==
"error"``, its message in ``RequestOutput.error``) fails for its client
alone: non-streamed, 500 ``internal_error`` (400 ``invalid_value`` when the
message starts with ``InvalidArgument``: the request itself was bad), with
the HTTP request's other choices aborted; streamed, an ``{"error": ...}``
event, then ``data: [DONE]``. It counts in
``jaxkv_request_success_total{finish_reason="error"}``. Every other request
goes on.

**Hostile requests.** Whatever a body holds, the answer is a 4xx naming the
field (``param``: the top-level field the bad value is under; the message
gives its place, e.g. ``messages[0].content``), never a 500, and nothing of
it reaches the engine. A body is read up to ``max_body_bytes``
(:data:`MAX_BODY_BYTES`, ``--max-request-body``; 413 beyond) and parsed off
the event loop; anywhere in it, an integer beyond 64 bits (a 5,000-digit
literal is never converted), ``NaN`` / ``Infinity`` / an overflowing float
literal, nesting deeper than :data:`MAX_JSON_DEPTH`, or a string or key with
a lone UTF-16 surrogate (``"\\ud800"``) is refused before any field is read.
Each field is then bounded to what the device holds (int32 counts and token
ids, an int64 seed, a normal float32 ``top_p``). Chat templates: only the
model's own render, unless the server runs with
``trust_request_chat_template`` (``--trust-request-chat-template``, vLLM's
flag: a template is code, and a nested loop in one blocked a server's event
loop for seconds, vLLM's CVE-2025-61620); ``chat_template_kwargs`` may set
template variables but not the rendering call's own arguments
(``tokenize``, ``add_generation_prompt``, ``messages``, ``conversation``,
``return_dict``, ``tools``...: 400 naming the key). Templates render in
jinja2's sandbox (``jaxkv.text``; ``range`` is capped at 100,000 items), and
rendering and tokenizing (chat and text prompts) run on
:data:`RENDER_WORKERS` render threads, never on the event loop, each
request's bounded by ``render_timeout`` seconds (:data:`RENDER_TIMEOUT`,
``--render-timeout``): past it the request gets 503 ``render_timeout`` and
the render is interrupted at its next Python instruction (a thread cannot be
killed; CPython can raise an exception inside it), so a stuck template never
holds a render thread for good.

**Why FastAPI.** It is the most used ASGI framework for Python model
servers (vLLM's and SGLang's OpenAI front ends are built on it), kept by a
large community on top of Starlette (routing, ``StreamingResponse`` for
server-sent events, client-disconnect detection) and served by uvicorn. The
request bodies are checked by hand here rather than by pydantic models:
OpenAI's 400 ``{"error": ...}`` for every malformed field, with our own
messages and no type coercion (``"5"`` is not an integer).

**Threads.** The engine is not thread-safe. :class:`EngineLoop` owns it on
ONE thread beside the asyncio event loop: every ``add_request``, ``abort``,
``step`` and ``stats`` call happens there. The event loop hands commands in
through a thread-safe queue (``queue.SimpleQueue``) and gets results back
through ``loop.call_soon_threadsafe`` (one call per engine iteration
carrying every request's outputs), so no engine call ever blocks the event
loop and no asyncio object is touched from the engine thread. Request bodies
are parsed on asyncio's default executor, and chat templates rendered and
prompts tokenized on the render threads (:class:`_RenderPool`; see Hostile
requests): the event loop only routes. While it has
work the loop steps the engine back to back, taking in new commands between
steps (new requests join the running batch at the next step); idle, it
blocks on the queue.

**Disconnects.** A streaming client that goes away cancels its response
(Starlette listens for ``http.disconnect``); the response's ``finally``
sends ``abort`` for every engine request of the HTTP request still running,
and the engine frees their blocks. A non-stream request whose client goes
away is aborted the same way (the handler polls for the disconnect while it
waits).

**Start-up** (:func:`run_server`): uvicorn listens at once (``/health``
answers 503); the engine thread loads the model and tokenizer, builds the
engine and runs a warm-up (one tiny request, :func:`warm_up`) so every
program the engine compiles is compiled before ``/health`` says 200 and the first client pays no compile; the time
from the command to ready is logged (``jaxkv.serve`` logger) and exported as
``jaxkv_startup_seconds``. The persistent JAX compilation cache
(:func:`configure_compile_cache`) makes a second start skip the XLA
compiles.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import hmac
import json
import logging
import math
import os
import queue
import re
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence

try:
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.background import BackgroundTask
    from starlette.exceptions import HTTPException as StarletteHTTPException
except ImportError as _missing:  # an optional dependency: say which extra brings it
    raise ImportError(f"the HTTP server needs FastAPI ({_missing}): pip install 'jaxkv[serve]'") from _missing

from jaxkv.errors import InvalidArgument, KVCacheError
from jaxkv.nn.penalties import MAX_LOGIT_BIAS, Penalties
from jaxkv.nn.sampling import MAX_TOP_LOGPROBS, SamplingParams
from jaxkv.serve.compile_cache import configure_compile_cache, default_compile_cache_dir  # noqa: F401 - re-exported
from jaxkv.serve.metrics import CONTENT_TYPE, ServerMetrics
from jaxkv.serve.structured import compile_constraint
from jaxkv.serve.tools import (CALL_START, ToolRequest, parse_tool_calls, parse_tools, split_stream_text,
                               template_messages, tool_call_regex)

__all__ = ["MAX_N", "OPEN_PATHS", "APIError", "APIKeys", "EngineLoop", "ServerState", "configure_compile_cache",
           "create_app", "default_compile_cache_dir", "run_server", "warm_up"]

logger = logging.getLogger("jaxkv.serve")

#: The most choices one request may ask for (``n``).
MAX_N = 16
#: Completions' ``max_tokens`` when none is given (OpenAI's default).
DEFAULT_COMPLETION_MAX_TOKENS = 16
#: The largest request body read, in bytes (``create_app(max_body_bytes=...)``); a larger one gets 413.
#: A 128k-token prompt as text or as token ids is about 1 MiB; tokenizing megabytes of text takes seconds.
MAX_BODY_BYTES = 4 * 2 ** 20
#: The deepest nesting of arrays / objects in a body (the body object itself is level 1).
MAX_JSON_DEPTH = 64
#: Seconds one request's chat-template rendering and tokenizing may take, queueing included
#: (``create_app(render_timeout=...)``).
RENDER_TIMEOUT = 10.0
#: Threads that render chat templates and tokenize prompts (at most this many run at once).
RENDER_WORKERS = 4
#: The most stop strings one request may give.
MAX_STOP = 16
#: The largest value of an integer field the device holds as int32 (``max_tokens``, ``top_k``, token ids).
INT32_MAX = 2 ** 31 - 1
#: A positive temperature below this is served at this value (vLLM's rule): sampling is greedy in effect
#: there already, and ``logits / temperature`` in float32 overflows to inf for tiny ones.
MIN_TEMPERATURE = 0.01
#: The smallest positive normal float32: ``top_p`` below it would be zero (or subnormal, flushed to zero) on
#: the device, where it is a float32.
FLOAT32_TINY = 1.1754943508222875e-38


# ------------------------------------------------------------ compile cache


# ------------------------------------------------------------ errors


class APIError(Exception):
    """An error answered as OpenAI's ``{"error": {...}}`` with ``status``."""

    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 type: str | None = None, headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = dict(headers or {})
        self.type = type or {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
                             405: "invalid_request_error", 413: "invalid_request_error",
                             503: "service_unavailable"}.get(status, "server_error")

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.type, "param": self.param,
                                       "code": self.code}}, status_code=self.status, headers=self.headers or None)


def _bad(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, code=code, param=param)


_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "a boolean", list: "an array",
               dict: "an object"}


def _json_type(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def _is(value, kind) -> bool:
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind is float:  # a JSON number: an integer too (finite by nature: math.isfinite of a huge one overflows)
        if isinstance(value, float):
            return math.isfinite(value)
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


def _get(body: dict, name: str, kind, *, default=None, required: bool = False, low=None, high=None,
         low_open: bool = False):
    """``body[name]`` checked to be of JSON type ``kind`` (``None`` and a
    missing field give ``default``) and within ``[low, high]`` (``(low,
    high]`` with ``low_open``); else a 400 naming the field."""
    value = body.get(name)
    if value is None:
        if required:
            raise _bad(f"'{name}' is a required property", name, "missing_required_parameter")
        return default
    if not _is(value, kind):
        raise _bad(f"'{name}' must be {_TYPE_NAMES[kind]}, got {_json_type(value)} {json.dumps(value)[:40]}",
                   name, "invalid_type")
    if low is not None and (value <= low if low_open else value < low):
        raise _bad(f"'{name}' must be {'>' if low_open else '>='} {low}, got {value}", name)
    if high is not None and value > high:
        raise _bad(f"'{name}' must be <= {high}, got {value}", name)
    return value


# Fields OpenAI defines that this server does not implement, with their neutral values.
_UNSUPPORTED = {"suffix": (None, ""), "functions": (None, [])}


def _refuse_unsupported(body: dict) -> None:
    for name, neutral in _UNSUPPORTED.items():
        if name in body and not any(body[name] == v and type(body[name]) is type(v) or body[name] is v
                                    for v in neutral):
            raise _bad(f"'{name}' is not supported by this server (got {json.dumps(body[name])[:60]})", name,
                       "unsupported_parameter")


# ------------------------------------------------------------ reading the body


def _show(text: str, limit: int = 60) -> str:
    """``text`` as an error message may quote it: at most ``limit``
    characters, lone surrogates escaped (a JSON response must encode as
    UTF-8)."""
    cut = text if len(text) <= limit else text[:limit] + "..."
    return cut.encode("utf-8", "backslashreplace").decode("utf-8")


class _BadNumber:
    """What the JSON parser leaves where a number no field can hold was: an
    integer literal too long for 64 bits (Python refuses to convert one of
    over 4,300 digits at all) or ``NaN`` / ``Infinity`` (which Python's
    json accepts and JSON does not). :func:`_check_json` reports it with
    its place."""

    __slots__ = ("what",)

    def __init__(self, what: str):
        self.what = what


def _parse_int(text: str):
    # 24 characters hold every 64-bit integer; a longer literal is never converted (int() of a huge one is
    # quadratic, and over 4,300 digits it raises ValueError inside json.loads: a 500 before this).
    return int(text) if len(text) <= 24 else _BadNumber(f"an integer of {len(text.lstrip('-'))} digits")


def _parse_constant(text: str):
    return _BadNumber(text)  # NaN, Infinity, -Infinity


def _invalid_unicode(text: str) -> bool:
    """Whether ``text`` holds a lone UTF-16 surrogate (JSON's ``"\\ud800"``
    escape): no tokenizer encodes it and no response can echo it."""
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _check_json(body: dict) -> None:
    """Refuse (400 ``invalid_value``, ``param`` the top-level field the
    value is under, the message giving its place) a parsed body holding a
    value no field takes, wherever it is, so no later check or the engine
    ever sees one: an integer outside ``[-2**63, 2**64)``, a number that is
    not finite (``NaN``, ``Infinity``, ``1e999``), a string or key that is
    not valid Unicode, or arrays / objects nested more than
    :data:`MAX_JSON_DEPTH` deep. Iterative: no recursion however deep."""
    stack = [(body, "", None, 1)]  # (container, its place, top-level field, depth)
    while stack:
        container, where, param, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise _bad(f"'{where}' is nested more than {MAX_JSON_DEPTH} levels deep", param)
        is_dict = isinstance(container, dict)
        for key, value in (container.items() if is_dict else enumerate(container)):
            if is_dict:
                shown = _show(key, 40)
                place = f"{where}.{shown}" if where else shown
                if _invalid_unicode(key):
                    raise _bad(f"the key '{place}' is not valid Unicode (a lone surrogate)", param or shown)
            else:
                place = f"{where}[{key}]"
            field = param if param is not None else place
            kind = type(value)
            if kind is str:
                if _invalid_unicode(value):
                    raise _bad(f"'{place}' is not valid Unicode (it holds a lone surrogate)", field)
            elif kind is int:
                if not -2 ** 63 <= value < 2 ** 64:
                    raise _bad(f"'{place}' is an integer out of range (no field takes one beyond 64 bits)", field)
            elif kind is float:
                if not math.isfinite(value):
                    raise _bad(f"'{place}' is not a finite number", field)
            elif kind is _BadNumber:
                raise _bad(f"'{place}' is {value.what}: not a number any field takes (integers fit in 64 bits; "
                           "NaN and Infinity are not JSON)", field)
            elif kind is dict or kind is list:
                stack.append((value, place, field, depth + 1))


def _parse_body(raw: bytes) -> dict:
    """The request body as a checked JSON object (:func:`_check_json`); 400
    for anything else. Runs off the event loop (a body of
    :data:`MAX_BODY_BYTES` parses in tens of milliseconds)."""
    try:
        body = json.loads(raw, parse_int=_parse_int, parse_constant=_parse_constant)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise _bad(f"the request body is not valid JSON: {_show(str(err), 200)}", None, "invalid_json") from None
    except RecursionError:  # the parser's own guard (about 1,000 levels)
        raise _bad(f"the request body is nested more than {MAX_JSON_DEPTH} levels deep", None,
                   "invalid_json") from None
    if not isinstance(body, dict):
        raise _bad(f"the request body must be a JSON object, got {_json_type(body)}", None, "invalid_type")
    _check_json(body)
    return body


async def _read_body(request: Request, limit: int) -> bytes:
    """The raw body, at most ``limit`` bytes (413 ``request_too_large``
    beyond, before reading more: a declared ``Content-Length`` is checked
    first)."""
    def too_large() -> APIError:
        return APIError(413, f"the request body is larger than this server's limit of {limit} bytes",
                        code="request_too_large")

    declared = request.headers.get("content-length", "")
    if declared.isdigit() and (len(declared) > 18 or int(declared) > limit):
        raise too_large()
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large()
        chunks.append(chunk)
    return b"".join(chunks)


# ------------------------------------------------------------ API keys and tenants


#: The paths served without an API key when keys are configured (every other path needs one).
OPEN_PATHS = frozenset({"/health", "/metrics"})
#: Where the authenticated tenant's name travels in the ASGI scope.
_TENANT_SCOPE_KEY = "jaxkv.tenant"


class APIKeys:
    """The API keys a server accepts, each naming its tenant.

    ``keys`` maps key -> tenant name (non-empty strings, a key of printable
    ASCII without spaces; several keys may name one tenant, which then has
    one namespace per salt, as with one key). Only each key's SHA-256 digest
    is kept, never the key itself (nor is it in ``repr``), and
    :meth:`tenant` compares the presented key's digest with EVERY configured
    digest by :func:`hmac.compare_digest` (equal lengths: no length or prefix
    leak) without stopping at a match, so the time taken does not depend on
    which key, if any, matched. ``InvalidArgument`` for an empty mapping, a
    key or a name that is not such a string; its message numbers the entry
    and never holds a key."""

    def __init__(self, keys: Mapping[str, str]):
        if not isinstance(keys, Mapping) or not keys:
            raise InvalidArgument("API keys: give a non-empty mapping of API key -> tenant name")
        digests = []
        for number, (key, name) in enumerate(keys.items(), 1):
            if not (isinstance(key, str) and key and key.isascii() and key.isprintable() and " " not in key):
                raise InvalidArgument(f"API key #{number} must be a non-empty string of printable ASCII without "
                                      "spaces (what an Authorization header carries)")
            if not isinstance(name, str) or not name:
                raise InvalidArgument(f"API key #{number}: its tenant name must be a non-empty string")
            digests.append((hashlib.sha256(key.encode()).digest(), name))
        self._digests = tuple(digests)
        #: The configured tenant names, sorted, each once.
        self.tenants: tuple[str, ...] = tuple(sorted({name for _, name in digests}))

    def __len__(self) -> int:
        return len(self._digests)

    def __repr__(self) -> str:
        return f"APIKeys({len(self)} keys, tenants {list(self.tenants)})"

    def tenant(self, key: str | None) -> str | None:
        """The tenant ``key`` names, or None (no key, an unknown key)."""
        presented = hashlib.sha256((key or "").encode()).digest()
        found = None
        for digest, name in self._digests:  # every key, no early exit
            if hmac.compare_digest(digest, presented):
                found = name
        return found  # an empty key matches nothing: configured keys are non-empty


def _bearer(authorization: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header (the scheme
    is case-insensitive), or None."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


class _Authenticate:
    """ASGI middleware of a server with API keys: an HTTP request to a path
    outside :data:`OPEN_PATHS` passes on only with ``Authorization: Bearer
    <key>`` naming a configured key, its tenant's name in the scope
    (``scope["jaxkv.tenant"]``); any other gets 401, counted in
    ``jaxkv_http_errors_total{tenant=""}``, before its body is read."""

    def __init__(self, app, *, keys: APIKeys, metrics: ServerMetrics):
        self.app = app
        self.keys = keys
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        headers = [value for name, value in scope.get("headers", ()) if name.lower() == b"authorization"]
        token = _bearer(headers[0].decode("latin-1")) if headers else None
        tenant = self.keys.tenant(token)
        if tenant is None:
            self.metrics.observe_error(401, tenant=None)
            if token is None:
                message, code = "Missing API key: send the header 'Authorization: Bearer <key>'", "missing_api_key"
            else:
                message, code = "Invalid API key", "invalid_api_key"
            error = APIError(401, message, code=code, headers={"WWW-Authenticate": "Bearer"})
            await error.response()(scope, receive, send)
            return
        await self.app({**scope, _TENANT_SCOPE_KEY: tenant}, receive, send)


def _namespace(tenant: str | None, salt: str | None):
    """The prefix-cache namespace of a request: ``("tenant", tenant, salt)``
    for an authenticated tenant (None salt included), else ``("cache_salt",
    salt)``, or None (the shared namespace) with neither. The two shapes
    never compare equal, and two tenants' namespaces differ whatever their
    salts."""
    if tenant is not None:
        return ("tenant", tenant, salt)
    return None if salt is None else ("cache_salt", salt)


# ------------------------------------------------------------ parsed requests


@dataclasses.dataclass
class _Params:
    """What a request asks for, checked."""

    max_tokens: int | None
    sampling: SamplingParams
    seed: int | None
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    n: int
    stream: bool
    include_usage: bool
    cache_salt: str | None
    logprobs: int | None = None  # top log-probabilities per token (None: none asked)
    penalties: Penalties | None = None  # penalties, logit bias, min_tokens (None: none asked)
    tools: ToolRequest | None = None  # chat: the request's tools and whether calls are parsed
    best_of: int = 1  # completions: candidates per prompt, the n of highest cumulative logprob returned
    echo: bool = False  # completions: the prompt's text before each choice's
    structured: tuple | None = None  # (field, compile_constraint keywords) of a structured output, None: none
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs: top log-probabilities per prompt token
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:N"


def _token_ids(value, name: str, vocab: int | None) -> list[int]:
    """``value`` (already known to be a list of integers) checked to be token
    ids: in ``[0, vocab)`` (no vocabulary: ``[0, 2**31)``, int32)."""
    high = INT32_MAX + 1 if vocab is None else vocab
    bad = [t for t in value if not 0 <= t < high]
    if bad:
        raise _bad(f"'{name}' holds token ids outside the vocabulary [0, {high}): {bad[:5]}", name.split("[")[0])
    return list(value)


def _parse_params(body: dict, *, chat: bool, vocab: int | None = None) -> _Params:
    """The sampling and output fields of ``body``, each within what the
    engine and the device hold (int32 counts and ids, a float32 ``top_p``
    that is not zero there, a 64-bit ``seed``); a 400 naming the field
    otherwise. ``vocab``: the tokenizer's vocabulary size (bounds
    ``stop_token_ids``)."""
    _refuse_unsupported(body)
    max_tokens = _get(body, "max_tokens", int, low=1, high=INT32_MAX)
    if chat and max_tokens is None:
        max_tokens = _get(body, "max_completion_tokens", int, low=1, high=INT32_MAX)
    temperature = float(_get(body, "temperature", float, default=1.0, low=0, high=2))
    if 0 < temperature < MIN_TEMPERATURE:
        temperature = MIN_TEMPERATURE
    top_p = float(_get(body, "top_p", float, default=1.0, low=FLOAT32_TINY, high=1))
    top_k = _get(body, "top_k", int, default=0, low=-1, high=INT32_MAX)
    # OpenAI's documented range (int64); reduced to the 32 bits jax.random.key takes here.
    seed = _get(body, "seed", int, low=-(2 ** 63), high=2 ** 63 - 1)
    if seed is not None:
        seed %= 2 ** 32
    stop = body.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stop = tuple(stop)
    else:
        raise _bad(f"'stop' must be a string or an array of strings, got {json.dumps(stop)[:60]}", "stop",
                   "invalid_type")
    if any(not s for s in stop):
        raise _bad("'stop' strings must not be empty", "stop")
    if len(stop) > MAX_STOP:
        raise _bad(f"'stop' holds {len(stop)} strings; at most {MAX_STOP}", "stop")
    stop_token_ids = body.get("stop_token_ids")
    if stop_token_ids is None:
        stop_token_ids = ()
    elif isinstance(stop_token_ids, list) and all(_is(t, int) for t in stop_token_ids):
        stop_token_ids = tuple(dict.fromkeys(_token_ids(stop_token_ids, "stop_token_ids", vocab)))
    else:
        raise _bad("'stop_token_ids' must be an array of integers", "stop_token_ids", "invalid_type")
    stream = _get(body, "stream", bool, default=False)
    options = _get(body, "stream_options", dict, default={})
    if options and not stream:
        raise _bad("'stream_options' is only allowed with 'stream': true", "stream_options")
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise _bad("'stream_options.include_usage' must be a boolean", "stream_options", "invalid_type")
    salt = body.get("cache_salt")  # checked by hand: _get would echo the value, and a salt is never echoed
    if salt is not None and not isinstance(salt, str):
        raise _bad(f"'cache_salt' must be a string, got {_json_type(salt)}", "cache_salt", "invalid_type")
    if salt == "":
        raise _bad("'cache_salt' must not be empty", "cache_salt")
    try:
        sampling = SamplingParams(temperature=temperature, top_k=max(top_k, 0), top_p=top_p)
    except InvalidArgument as err:  # a bound of the sampler's own that the checks above did not cover
        field = re.search(r"SamplingParams\.(\w+)", str(err))
        raise _bad(str(err), field.group(1) if field else None) from None
    return _Params(
        max_tokens=max_tokens,
        sampling=sampling,
        seed=seed, stop=stop, stop_token_ids=stop_token_ids,
        ignore_eos=_get(body, "ignore_eos", bool, default=False),
        n=_get(body, "n", int, default=1, low=1, high=MAX_N), stream=stream, include_usage=include_usage,
        cache_salt=salt, logprobs=_parse_logprobs(body, chat), penalties=_parse_penalties(body, max_tokens, vocab),
        structured=_parse_structured(body),
        prompt_logprobs=_get(body, "prompt_logprobs", int, low=0, high=MAX_TOP_LOGPROBS),
        tokens_as_ids=_get(body, "return_tokens_as_token_ids", bool, default=False),
        **_parse_best_of_and_echo(body, chat, stream))


def _parse_structured(body: dict) -> tuple | None:
    """The request's structured output, if any: ``(field, keywords of
    compile_constraint)``. OpenAI's ``response_format`` (``text``,
    ``json_object``, ``json_schema``), vLLM's ``structured_outputs``
    (``json``, ``regex``, ``choice``, ``grammar``, ``json_object``) and
    its older ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
    ``guided_grammar``; at most one. A ``grammar`` (Lark or GBNF) is
    parsed on the host (:mod:`jaxkv.serve.grammar`)."""
    found = []
    fmt = body.get("response_format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind not in ("text", "json_object", "json_schema"):
            raise _bad("'response_format' must be {\"type\": \"text\" | \"json_object\" | \"json_schema\", ...}",
                       "response_format")
        if kind == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
                raise _bad("'response_format.json_schema' must be {\"name\": ..., \"schema\": {...}}",
                           "response_format")
            found.append(("response_format", {"json_schema": spec.get("schema", {})}))
    options = body.get("structured_outputs")
    if options is not None and not isinstance(options, dict):
        raise _bad("'structured_outputs' must be an object", "structured_outputs", "invalid_type")
    named = [(f"structured_outputs.{k}", k, v) for k, v in (options or {}).items() if v not in (None, False)]
    named += [(f"guided_{k}", k, body[f"guided_{k}"]) for k in ("json", "regex", "choice", "grammar")
              if body.get(f"guided_{k}") is not None]
    for field, key, value in named:
        if key == "json" and isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise _bad(f"'{field}' is not a JSON schema (not JSON)", field.split(".")[0]) from None
        keyword = {"json": "json_schema", "regex": "regex", "choice": "choice", "json_object": "json_object",
                   "grammar": "grammar"}.get(key)
        if keyword is None:
            raise _bad(f"'{field}' is not a structured-output field (json, regex, choice, grammar, json_object)",
                       field.split(".")[0])
        found.append((field.split(".")[0], {keyword: value}))
    if len(found) > 1:
        raise _bad(f"give one structured output, got {', '.join(f for f, _ in found)}", found[1][0])
    return found[0] if found else None


def _parse_best_of_and_echo(body: dict, chat: bool, stream: bool) -> dict:
    """Completions' ``best_of`` (``n``..:data:`MAX_N`; not streamed when
    above ``n``) and ``echo`` (with ``logprobs``, the prompt's tokens'
    log-probabilities come first, its first token's None); chat has
    neither (400 unless neutral)."""
    n = _get(body, "n", int, default=1, low=1, high=MAX_N)
    if chat:
        for name, neutral in (("best_of", 1), ("echo", False)):
            value = body.get(name)  # typed: True == 1 and 0 == False, but neither is the neutral value
            if value is not None and not (value == neutral and type(value) is type(neutral)):
                raise _bad(f"'{name}' is a completions field; chat completions do not take it", name,
                           "unsupported_parameter")
        return {}
    for name in ("tools", "tool_choice"):  # chat's fields: refused here rather than ignored
        if body.get(name) not in (None, []):
            raise _bad(f"'{name}' is a chat completions field", name, "unsupported_parameter")
    best_of = _get(body, "best_of", int, default=n, low=1, high=MAX_N)
    if best_of < n:
        raise _bad(f"'best_of' ({best_of}) must be >= 'n' ({n})", "best_of")
    if best_of > n and stream:
        raise _bad("'best_of' above 'n' cannot be streamed (the best are known at the end)", "best_of")
    echo = _get(body, "echo", bool, default=False)
    return {"best_of": best_of, "echo": echo}


def _parse_penalties(body: dict, max_tokens: int | None, vocab: int | None) -> Penalties | None:
    """``presence_penalty`` / ``frequency_penalty`` (-2..2), vLLM's
    ``repetition_penalty`` (0 exclusive..10) and ``min_tokens`` (0..
    ``max_tokens``), ``logit_bias`` (token id strings -> -100..100, at most
    300): a :class:`~jaxkv.nn.penalties.Penalties`, None when all are off."""
    presence = _get(body, "presence_penalty", float, default=0.0, low=-2, high=2)
    frequency = _get(body, "frequency_penalty", float, default=0.0, low=-2, high=2)
    repetition = _get(body, "repetition_penalty", float, default=1.0, low=0, low_open=True, high=10)
    min_tokens = _get(body, "min_tokens", int, default=0, low=0, high=INT32_MAX)
    if max_tokens is not None and min_tokens > max_tokens:
        raise _bad(f"'min_tokens' ({min_tokens}) must be <= 'max_tokens' ({max_tokens})", "min_tokens")
    bias = _get(body, "logit_bias", dict, default={})
    if len(bias) > MAX_LOGIT_BIAS:
        raise _bad(f"'logit_bias' has {len(bias)} entries; at most {MAX_LOGIT_BIAS}", "logit_bias")
    entries = {}
    for key, value in bias.items():
        if not re.fullmatch(r"[0-9]{1,10}", key):
            raise _bad(f"'logit_bias' keys are token ids, got {_show(key)!r}", "logit_bias")
        if not _is(value, float):
            raise _bad(f"'logit_bias[{key}]' must be a number, got {_json_type(value)}", "logit_bias", "invalid_type")
        if not -100 <= value <= 100:
            raise _bad(f"'logit_bias[{key}]' must be in [-100, 100], got {value}", "logit_bias")
        entries[_token_ids([int(key)], "logit_bias", vocab)[0]] = float(value)
    penalties = Penalties(presence=presence, frequency=frequency, repetition=repetition, logit_bias=entries,
                          min_tokens=min_tokens)
    return None if penalties.is_off else penalties


def _parse_logprobs(body: dict, chat: bool) -> int | None:
    """The top log-probabilities per token a request asks (None: none).
    Chat: ``logprobs`` (a boolean) and ``top_logprobs`` (0..20, only with
    ``logprobs: true``, as OpenAI requires); completions: ``logprobs`` (an
    integer 0..20; OpenAI's own bound is 5, vLLM's 20)."""
    if not chat:
        if body.get("top_logprobs") is not None:
            raise _bad("'top_logprobs' is a chat completions field; completions take 'logprobs': N (the top N)",
                       "top_logprobs")
        return _get(body, "logprobs", int, low=0, high=MAX_TOP_LOGPROBS)
    wanted = _get(body, "logprobs", bool, default=False)
    top = _get(body, "top_logprobs", int, low=0, high=MAX_TOP_LOGPROBS)
    if top is not None and not wanted:
        raise _bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (top or 0) if wanted else None


# ------------------------------------------------------------ the engine loop


@dataclasses.dataclass(eq=False)
class _Sink:
    """Where one engine request's results go: the asyncio queue of the HTTP
    request that owns it (``(index, item)`` pairs; ``item`` is ``("added",
    request_id)``, ``("error", exception)`` or a ``RequestOutput``)."""

    queue: asyncio.Queue
    index: int


class EngineLoop:
    """The one thread that drives the engine (module docstring: Threads).

    ``build()`` runs on that thread first (load, warm up) and returns the
    engine; ``on_ready(engine)`` and ``on_failed(exception)`` are called on
    the event loop after it. :meth:`add`, :meth:`abort`, :meth:`stats` and
    :meth:`stop` may be called from the event loop at any time (commands
    sent before the engine is built wait in the queue)."""

    def __init__(self, build: Callable[[], object], loop: asyncio.AbstractEventLoop, *,
                 on_ready: Callable[[object], None] | None = None,
                 on_failed: Callable[[BaseException], None] | None = None, idle_wait: float = 0.5,
                 lockstep=None):
        self._build = build
        # Serving across processes (jaxkv.serve.multihost): every iteration's commands and step are published
        # for the followers before the step; ``_ops`` collects them, ``_ops_next`` what goes with the next one.
        self._lockstep = lockstep
        self._ops: list = []
        self._ops_next: list = []
        self._digest: str | None = None  # of the last step's outputs, sent with the next record (Lockstep.digest)
        self._loop = loop
        self._on_ready = on_ready
        self._on_failed = on_failed
        self._idle_wait = idle_wait
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[_Sink, int] = {}  # sink -> engine request id (engine thread only)
        self._sinks: dict[int, _Sink] = {}  # engine request id -> sink (engine thread only)
        self._stopping = False
        # Serving across processes: set (from the watchdog's thread) when a process died; the engine never
        # steps again and every request gets this error.
        self._lost: BaseException | None = None
        self._lost_event = threading.Event()
        self.engine = None
        self.thread = threading.Thread(target=self._run, name="jaxkv-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    # Called on the event loop.

    def add(self, sink: _Sink, prompt: list, kwargs: dict) -> None:
        self._commands.put(("add", sink, prompt, kwargs))

    def abort(self, sink: _Sink) -> None:
        self._commands.put(("abort", sink))

    def stats(self, future: asyncio.Future) -> None:
        self._commands.put(("stats", future))

    def call(self, future: asyncio.Future, fn: Callable[[object], object]) -> None:
        """Run ``fn(engine)`` on the engine thread between iterations; its
        result (or exception) settles ``future``."""
        self._commands.put(("call", future, fn))

    def fail_all(self, error: BaseException) -> None:
        """Answer ``error`` to every request in flight and to every later
        one, and stop stepping (any thread: a process of a multi-process
        server died, and no collective step can complete again)."""
        self._lost = error
        self._lost_event.set()
        for sink in list(self._live):
            self._post(_deliver, [(sink, ("error", error))])

    def stop(self, timeout: float = 30.0) -> None:
        self._commands.put(("stop",))
        if self.thread.is_alive():
            self.thread.join(timeout)

    # The engine thread.

    def _post(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: shutting down
            pass

    def _run(self) -> None:
        try:
            engine = self._build()
        except BaseException as err:  # noqa: BLE001 - reported to the server, which answers 503
            logger.exception("engine start-up failed")
            if self._on_failed is not None:
                self._post(self._on_failed, err)
            self._fail_pending(err)
            return
        self.engine = engine
        if self._on_ready is not None:
            self._post(self._on_ready, engine)
        while not self._stopping:
            if self._lost is not None:  # the requests in flight were answered; the queued ones are below
                break
            commands = []
            if not engine.has_unfinished():
                try:
                    commands.append(self._commands.get(timeout=self._idle_wait))
                except queue.Empty:
                    continue
            while True:
                try:
                    commands.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            deliveries: list = []
            self._ops, self._ops_next = self._ops_next, []
            for command in commands:
                self._handle(engine, command, deliveries)
            stepping = not self._stopping and engine.has_unfinished()
            if self._lockstep is not None and (self._ops or stepping):
                try:
                    self._lockstep.publish(self._ops, stepping, after=self._digest)
                except Exception as err:  # noqa: BLE001 - the followers cannot follow: stop serving
                    logger.exception("serving across processes: the iteration could not be published; stopping")
                    self.fail_all(APIError(503, f"this server runs across processes and could not reach the "
                                                f"others ({type(err).__name__}: {err})", code="process_lost"))
                    self._stopping = True
                    stepping = False
            if stepping:
                contained = getattr(engine, "last_failure", None)
                try:
                    outputs = engine.step()
                except Exception as err:  # noqa: BLE001 - a bug in the engine: fail its requests, keep serving
                    if self._process_lost():
                        break
                    logger.exception("engine step failed; failing the %d requests in flight", len(self._live))
                    for sink, rid in list(self._live.items()):
                        deliveries.append((sink, ("error", err)))
                        self._forget(sink)
                        self._ops_next.append(("abort", rid))  # the followers' engines abort them too
                        try:
                            engine.abort(rid)
                        except Exception:  # noqa: BLE001
                            pass
                    outputs = []
                if getattr(engine, "last_failure", None) is not contained and self._process_lost():
                    break  # the step's failure was contained, its outputs may be the failure's "error"s
                if self._lockstep is not None:
                    self._digest = self._lockstep.digest(outputs)
                for output in outputs:
                    sink = self._sinks.get(output.request_id)
                    if sink is not None:
                        deliveries.append((sink, output))
                    if output.finished:
                        if sink is not None:
                            self._forget(sink)
                        self._release(engine, output.request_id)
            if deliveries:
                self._post(_deliver, deliveries)
        if self._lost is not None:  # a process died: no stop to publish; every later command gets its error
            for sink in list(self._live):  # again: one may have been added after the watchdog's answer
                self._post(_deliver, [(sink, ("error", self._lost))])
            self._close(engine)
            self._fail_pending(self._lost, until_stop=True)
            return
        for sink in list(self._live):  # stopping: whoever still waits gets an error
            self._post(_deliver, [(sink, ("error", APIError(503, "the server is shutting down",
                                                            code="shutting_down")))])
        if self._lockstep is not None:
            try:
                self._lockstep.publish(self._ops_next, False, stop=True, after=self._digest)
            except Exception:  # noqa: BLE001 - shutting down: the followers find the leader gone
                logger.warning("serving across processes: the stop could not be published", exc_info=True)
        self._close(engine)

    def _process_lost(self) -> bool:
        """After a failed step, serving across processes: whether a process
        of the run died. A collective that met a dead process fails at
        once, and the watchdog's verdict comes within the heartbeat timeout
        (``Lockstep.verdict_seconds``, waited for here): then every request
        gets the lost process's 503, not the step's error."""
        if self._lockstep is None or not self._lost_event.wait(self._lockstep.verdict_seconds):
            return False
        logger.error("engine step failed as a process of the run died (%s)", self._lost)
        return True

    @staticmethod
    def _close(engine) -> None:
        close = getattr(engine, "close", None)
        if close is not None:  # the disk tier's queued records reach the disk before the process ends
            try:
                close()
            except Exception:  # noqa: BLE001 - shutting down: log, never hang
                logger.exception("engine close failed")

    @staticmethod
    def _release(engine, rid: int) -> None:
        """Drop a finished request's records from the engine (a long-running
        server would otherwise keep every request's tokens)."""
        forget = getattr(engine, "forget", None)
        if forget is not None:
            try:
                forget(rid)
            except Exception:  # noqa: BLE001 - already forgotten
                logger.debug("forget(%d) failed", rid, exc_info=True)

    def _forget(self, sink: _Sink) -> None:
        rid = self._live.pop(sink, None)
        if rid is not None:
            self._sinks.pop(rid, None)

    def _handle(self, engine, command, deliveries: list) -> None:
        kind = command[0]
        if kind == "add":
            _, sink, prompt, kwargs = command
            if isinstance(kwargs.get("fork_of"), _Sink):  # its sibling's engine id (None: refused or gone)
                kwargs = dict(kwargs, fork_of=self._live.get(kwargs["fork_of"]))
            if self._lockstep is not None:  # the followers need the request as it is: refuse what cannot travel
                error = self._lockstep.unsendable(kwargs)
                if error is not None:
                    deliveries.append((sink, ("error", error)))
                    return
            try:
                rid = engine.add_request(prompt, **kwargs)
            except Exception as err:  # noqa: BLE001 - answered to its client; others go on
                deliveries.append((sink, ("error", err)))
                self._ops.append(("add", prompt, kwargs, None))
                return
            self._ops.append(("add", prompt, kwargs, rid))
            self._live[sink] = rid
            self._sinks[rid] = sink
            deliveries.append((sink, ("added", rid)))
        elif kind == "abort":
            sink = command[1]
            rid = self._live.get(sink)
            if rid is not None:  # its last output ("abort") comes from a later step and is dropped
                self._forget(sink)
                self._ops.append(("abort", rid))
                try:
                    engine.abort(rid)
                except Exception:  # noqa: BLE001 - already finished: nothing to free
                    logger.debug("abort of request %d failed", rid, exc_info=True)
        elif kind == "stats":
            future = command[1]
            try:
                result = engine.stats()
            except Exception as err:  # noqa: BLE001
                self._post(_settle, future, None, err)
            else:
                self._post(_settle, future, result, None)
        elif kind == "call":
            _, future, fn = command
            try:
                result = fn(engine)
            except Exception as err:  # noqa: BLE001 - the caller's
                self._post(_settle, future, None, err)
            else:
                self._post(_settle, future, result, None)
        elif kind == "stop":
            self._stopping = True

    def _fail_pending(self, err: BaseException, *, until_stop: bool = False) -> None:
        """Answer ``err`` to every queued command: the engine never started
        (the server refuses later requests itself); or, ``until_stop``, a
        process of the run died, and every command until :meth:`stop` is
        answered so (a route that got past the server's own check never
        waits on an engine that will not step)."""
        while True:
            try:
                command = self._commands.get(timeout=self._idle_wait) if until_stop else self._commands.get_nowait()
            except queue.Empty:
                if until_stop and not self._stopping:
                    continue
                return
            if command[0] == "add":
                self._post(_deliver, [(command[1], ("error", err))])
            elif command[0] in ("stats", "call"):
                self._post(_settle, command[1], None, err)
            elif command[0] == "stop":
                self._stopping = True


def _deliver(deliveries: list) -> None:
    """On the event loop: hand each item to its request's queue."""
    for sink, item in deliveries:
        sink.queue.put_nowait((sink.index, item))


def _settle(future: asyncio.Future, result, error) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


# ------------------------------------------------------------ rendering off the event loop


class _RenderTimeout(BaseException):
    """Raised inside a render thread whose call ran past its bound. A
    ``BaseException``: no ``except Exception`` of a template engine or
    tokenizer swallows it."""


def _raise_in_thread(ident: int, exc: type[BaseException] | None) -> bool:
    """Have thread ``ident`` raise ``exc`` at its next Python instruction
    (``exc`` None: cancel one asked for and not raised yet), through
    CPython's ``PyThreadState_SetAsyncExc``; False where that is missing."""
    try:
        import ctypes

        set_async_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc
    except (ImportError, AttributeError):  # not CPython: the call runs to its end
        return False
    return set_async_exc(ctypes.c_ulong(ident), None if exc is None else ctypes.py_object(exc)) == 1


@dataclasses.dataclass(eq=False)
class _RenderJob:
    fn: Callable
    args: tuple
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    thread: int | None = None  # the worker running it (under the pool's lock)
    abandoned: bool = False  # its client has its answer (time-out) or left: skip it, or interrupt it
    interrupted: bool = False


class _RenderPool:
    """Runs what a request makes the server compute before the engine sees
    it -- chat-template rendering and tokenizing, whose cost the client
    shapes -- on ``workers`` daemon threads, never on the event loop (so
    ``/health`` and every other request stay served while one renders).

    Invariants: at most ``workers`` calls run at once, the others wait in
    order; a call not finished ``timeout`` seconds after :meth:`run` was
    awaited (waiting included) is answered 503 ``render_timeout`` at once,
    and if it runs, ``_RenderTimeout`` is raised inside its thread
    (:func:`_raise_in_thread`), which stops a template looping in Python at
    its next instruction (a call inside one C function, e.g. a tokenizer's
    encode, finishes that function first: the body size bounds it); a
    worker is never lost to an interrupt (one that lands after its call
    ended is cancelled or caught by the worker's loop) and never runs an
    abandoned call."""

    def __init__(self, workers: int = RENDER_WORKERS, timeout: float = RENDER_TIMEOUT):
        if not (isinstance(timeout, (int, float)) and timeout > 0 and math.isfinite(timeout)):
            raise InvalidArgument(f"render_timeout must be a positive number of seconds, got {timeout!r}")
        self.workers = workers
        self.timeout = float(timeout)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._running: set[_RenderJob] = set()

    @property
    def busy(self) -> int:
        """Calls running now."""
        with self._lock:
            return len(self._running)

    async def run(self, fn: Callable, *args):
        """``fn(*args)`` on a worker; its result, or its exception raised
        here."""
        loop = asyncio.get_running_loop()
        job = _RenderJob(fn, args, loop, loop.create_future())
        with self._lock:
            if not self._threads:
                for i in range(self.workers):
                    thread = threading.Thread(target=self._work, name=f"jaxkv-render-{i}", daemon=True)
                    thread.start()
                    self._threads.append(thread)
        self._jobs.put(job)
        try:
            return await asyncio.wait_for(job.future, self.timeout)
        except asyncio.TimeoutError:
            self._abandon(job)
            raise APIError(503, f"rendering the chat template and tokenizing the prompt took longer than this "
                                f"server's limit of {self.timeout:g} s", code="render_timeout") from None
        except asyncio.CancelledError:  # the client went away
            self._abandon(job)
            raise

    def close(self) -> None:
        """Let the workers end (after the calls queued before)."""
        with self._lock:
            for _ in self._threads:
                self._jobs.put(None)
            self._threads = []

    def _abandon(self, job: _RenderJob) -> None:
        with self._lock:
            job.abandoned = True
            if job.thread is not None and not job.interrupted:
                job.interrupted = True
                _raise_in_thread(job.thread, _RenderTimeout)

    def _work(self) -> None:
        ident = threading.get_ident()
        while True:
            job = None
            try:  # an interrupt raised anywhere in here lands in the except below, never outside the loop
                job = self._jobs.get()
                if job is None:
                    return
                with self._lock:
                    if job.abandoned:
                        continue
                    job.thread = ident
                    self._running.add(job)
                result = error = None
                try:
                    result = job.fn(*job.args)
                except BaseException as err:  # noqa: BLE001 - handed to the request (_RenderTimeout: it has left)
                    error = err
                finally:
                    with self._lock:  # no interrupt is sent for this call after this
                        job.thread = None
                        self._running.discard(job)
                        if job.interrupted:
                            _raise_in_thread(ident, None)  # one sent and not raised yet: cancel it
                try:
                    job.loop.call_soon_threadsafe(_settle, job.future, result, error)
                except RuntimeError:  # the event loop is closed: shutting down
                    pass
            except _RenderTimeout:  # landed after the call ended, before it was cancelled: tidy up
                if job is not None:
                    with self._lock:
                        job.thread = None
                        self._running.discard(job)


# ------------------------------------------------------------ server state


@dataclasses.dataclass
class ServerState:
    """What the routes share. ``engine_loop`` is set by the app's start-up;
    ``ready`` once the engine is built and warmed up."""

    tokenizer: object
    served_model_names: list[str]
    metrics: ServerMetrics
    max_model_len: int | None = None
    engine_loop: EngineLoop | None = None
    ready: bool = False
    failed: BaseException | None = None
    lost: APIError | None = None  # serving across processes: one died (jaxkv.serve.multihost)
    role: str | None = None  # "prefill" / "decode" (jaxkv.serve.disaggregated), None: both here
    prefill: object = None  # a decode server's prefill servers (jaxkv.serve.disaggregated.PrefillRouter)
    transfer: object = None  # this process's KVTransfer (a role given)
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    eos_token_ids: tuple[int, ...] = ()
    vocab_size: int | None = None  # the model's logits (structured outputs' automata span them)
    renderer: _RenderPool = dataclasses.field(default_factory=_RenderPool)
    trust_request_chat_template: bool = False
    max_body_bytes: int = MAX_BODY_BYTES


def _engine_max_model_len(engine) -> int | None:
    for name in ("max_model_len",):
        value = getattr(engine, name, None)
        if value is not None:
            return int(value)
    cache = getattr(engine, "cache", None)
    value = getattr(cache, "max_context_tokens", None)
    return None if value is None else int(value)


# ------------------------------------------------------------ the app


def create_app(build: Callable[[], tuple[object, object]], *, served_model_names: Sequence[str],
               metrics: ServerMetrics | None = None, startup_clock: float | None = None,
               api_keys: Mapping[str, str] | APIKeys | None = None, trust_request_chat_template: bool = False,
               render_timeout: float = RENDER_TIMEOUT, max_body_bytes: int = MAX_BODY_BYTES, lockstep=None,
               lost_grace: float = 3.0, role: str | None = None, prefill_url: str | Sequence[str] | None = None,
               transfer=None) -> FastAPI:
    """The FastAPI app. ``build()`` runs on the engine thread when the app
    starts and returns ``(engine, tokenizer)`` (load, build, warm up); the
    app answers 503 until it returns. ``startup_clock``: the
    ``time.perf_counter()`` value the start-up time is counted from (default:
    when the app starts). ``api_keys``: API key -> tenant name (or an
    :class:`APIKeys`); given, every path but :data:`OPEN_PATHS` needs a key
    and each tenant has its own namespaces (module docstring: API keys and
    tenants). ``metrics`` (default: new ones) must have a ``tenant`` label
    exactly when keys are given (``ServerMetrics(tenants=keys.tenants)``);
    ``InvalidArgument`` otherwise. ``trust_request_chat_template``: render
    a chat template the request gives (``chat_template``,
    ``chat_template_kwargs.chat_template``); off, only the model's own
    templates render and a request's is refused with 400. ``lockstep``:
    a :class:`~jaxkv.serve.multihost.Lockstep` when this is process 0 of a
    server across processes (the engine loop publishes every iteration for
    the followers; a watchdog answers 503 and exits ``lost_grace`` seconds
    after a process dies). ``role``: ``"prefill"`` (answers ``POST
    /v1/jaxkv/prefill``) or ``"decode"`` (takes each prompt's KV from the
    prefill server at ``prefill_url``, or one of several:
    :class:`~jaxkv.serve.disaggregated.PrefillRouter`), both through
    ``transfer`` (a :class:`~jaxkv.serve.disaggregated.KVTransfer`).
    ``render_timeout``: seconds one request's rendering and tokenizing may
    take (503 ``render_timeout`` after). ``max_body_bytes``: the largest
    request body (413 beyond)."""
    if not (isinstance(max_body_bytes, int) and max_body_bytes > 0):
        raise InvalidArgument(f"max_body_bytes must be a positive integer, got {max_body_bytes!r}")
    keys = None if api_keys is None else api_keys if isinstance(api_keys, APIKeys) else APIKeys(api_keys)
    if metrics is None:
        metrics = ServerMetrics(tenants=None if keys is None else keys.tenants)
    elif (metrics.tenants is None) != (keys is None):
        raise InvalidArgument("create_app: the metrics need a tenant label exactly when API keys are given "
                              "(ServerMetrics(tenants=...))")
    prefill = None
    if prefill_url is not None:
        from jaxkv.serve.disaggregated import PrefillRouter

        prefill = PrefillRouter([prefill_url] if isinstance(prefill_url, str) else prefill_url)
    state = ServerState(tokenizer=None, served_model_names=list(served_model_names), metrics=metrics,
                        renderer=_RenderPool(timeout=render_timeout),
                        trust_request_chat_template=bool(trust_request_chat_template), max_body_bytes=max_body_bytes,
                        role=role, prefill=prefill, transfer=transfer)

    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loop = asyncio.get_running_loop()
        began = time.perf_counter() if startup_clock is None else startup_clock
        built: dict = {}

        def build_on_thread():
            engine, tokenizer = build()
            built["tokenizer"] = tokenizer
            return engine

        def on_ready(engine):
            state.tokenizer = built["tokenizer"]
            state.max_model_len = _engine_max_model_len(engine)
            state.vocab_size = getattr(engine, "vocab_size", None)
            eos = getattr(state.tokenizer, "eos_token_ids", ()) or ()
            state.eos_token_ids = tuple(int(i) for i in eos)
            state.ready = metrics.ready = True
            metrics.startup_seconds = time.perf_counter() - began
            logger.info("ready in %.1f s (serving %s, max_model_len %s)", metrics.startup_seconds,
                        ", ".join(state.served_model_names), state.max_model_len)

        def on_failed(err):
            state.failed = err

        state.engine_loop = EngineLoop(build_on_thread, loop, on_ready=on_ready, on_failed=on_failed,
                                       lockstep=lockstep)
        state.engine_loop.start()
        if lockstep is not None:
            from jaxkv.serve.multihost import watch

            def on_lost(message: str) -> None:  # the watchdog's thread
                logger.error("serving across processes: %s; answering 503 and exiting in %g s", message,
                             lost_grace)
                state.lost = APIError(503, f"this server runs across {lockstep.num_processes} processes and "
                                      f"{message}; it is shutting down", code="process_lost")
                state.ready = metrics.ready = False
                state.engine_loop.fail_all(state.lost)
                threading.Timer(lost_grace, os._exit, args=(1,)).start()

            watch(lockstep.num_processes, on_lost)
        try:
            yield
        finally:
            state.ready = metrics.ready = False
            state.renderer.close()
            await asyncio.to_thread(state.engine_loop.stop)

    app = FastAPI(title="jaxkv", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.jaxkv = state
    if keys is not None:
        app.add_middleware(_Authenticate, keys=keys, metrics=metrics)

    def tenant_of(request: Request) -> str | None:
        """The request's tenant (None without API keys)."""
        tenant = request.scope.get(_TENANT_SCOPE_KEY)
        if keys is not None and tenant is None:  # never: _Authenticate answered 401 before
            raise APIError(401, "Missing API key", code="missing_api_key")
        return tenant

    @app.exception_handler(APIError)
    async def api_error(request: Request, err: APIError):
        metrics.observe_error(err.status, tenant=request.scope.get(_TENANT_SCOPE_KEY))
        return err.response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException):
        metrics.observe_error(err.status_code, tenant=request.scope.get(_TENANT_SCOPE_KEY))
        code = {404: "not_found", 405: "method_not_allowed"}.get(err.status_code)
        message = f"{request.method} {request.url.path}: {err.detail}"
        return APIError(err.status_code, message, code=code).response()

    @app.exception_handler(Exception)
    async def internal_error(request: Request, err: Exception):
        logger.exception("internal error on %s", request.url.path)
        metrics.observe_error(500, tenant=request.scope.get(_TENANT_SCOPE_KEY))
        return APIError(500, f"internal error: {type(err).__name__}: {err}", code="internal_error").response()

    def check_ready() -> None:
        if state.lost is not None:
            raise state.lost
        if state.failed is not None:
            raise APIError(503, f"the engine failed to start: {type(state.failed).__name__}: {state.failed}",
                           code="startup_failed")
        if not state.ready:
            raise APIError(503, "the model is loading; retry when GET /health answers 200", code="model_not_ready")

    @app.get("/health")
    async def health():
        check_ready()
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models():
        check_ready()
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": state.created, "owned_by": "jaxkv",
             "root": state.served_model_names[0], "max_model_len": state.max_model_len}
            for name in state.served_model_names]}

    @app.get("/metrics")
    async def prometheus():
        if state.ready and state.engine_loop is not None:
            future = asyncio.get_running_loop().create_future()
            state.engine_loop.stats(future)
            try:
                metrics.set_engine_stats(await asyncio.wait_for(future, timeout=30))
            except Exception:  # noqa: BLE001 - serve the last snapshot
                logger.warning("engine stats unavailable; /metrics serves the last snapshot", exc_info=True)
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/v1/jaxkv/prefill")
    async def prefill(request: Request):
        """A prefill server's hand-over (:mod:`jaxkv.serve.disaggregated`):
        compute the prompt, offer its KV on the transfer server, say where."""
        check_ready()
        if state.role != "prefill":
            raise APIError(404, "this server is not a prefill server (--role prefill)", code="not_found")
        from jaxkv.serve.disaggregated import export_prefix, namespace_from_json

        body = await _json_body(request, state)
        prompt = body.get("prompt")
        if not isinstance(prompt, list) or len(prompt) < 2 or not all(isinstance(t, int) for t in prompt):
            raise _bad("'prompt' must be a list of at least two token ids", "prompt")
        namespace = namespace_from_json(body.get("namespace"))
        queue_: asyncio.Queue = asyncio.Queue()
        state.engine_loop.add(_Sink(queue_, 0), prompt, dict(max_new_tokens=1, namespace=namespace))
        while True:
            _, item = await queue_.get()
            if isinstance(item, tuple) and item[0] == "error":
                raise APIError(400, f"the prefill engine refused the prompt: {item[1]}", code="prefill_failed")
            if not isinstance(item, tuple) and item.finished:
                break
        meta = await _engine_call(state, lambda engine: export_prefix(engine, prompt, namespace, state.transfer))
        return meta if meta is not None else {"none": True}

    # Each route checks the whole request before the engine sees any of it, and renders / tokenizes off the
    # event loop (state.renderer), so a request of any shape costs other requests nothing but its share of
    # the CPU.
    @app.post("/v1/completions")
    async def completions(request: Request):
        check_ready()
        body = await _json_body(request, state)
        _check_model(state, body)
        inputs = _completion_inputs(state, body)
        params = _parse_params(body, chat=False, vocab=getattr(state.tokenizer, "vocab_size", None))
        prompts = await state.renderer.run(_tokenize_prompts, state.tokenizer, inputs)
        echo = None
        if params.echo:  # a text prompt as given, a token-id prompt decoded
            echo = [p if isinstance(p, str) else _echo_text(state.tokenizer, p) for _, p in inputs]
        return await _serve(request, state, prompts, params, chat=False, tenant=tenant_of(request), echo_texts=echo)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        check_ready()
        body = await _json_body(request, state)
        _check_model(state, body)
        inputs = _chat_inputs(state, body)
        params = _parse_params(body, chat=True, vocab=getattr(state.tokenizer, "vocab_size", None))
        params = dataclasses.replace(params, tools=inputs["tools"])
        prompt = await state.renderer.run(functools.partial(_render_chat, state.tokenizer, **inputs))
        return await _serve(request, state, [prompt], params, chat=True, tenant=tenant_of(request))

    return app


async def _json_body(request: Request, state: ServerState) -> dict:
    """The body read (at most ``state.max_body_bytes``), parsed and checked
    off the event loop (:func:`_parse_body`)."""
    raw = await _read_body(request, state.max_body_bytes)
    return await asyncio.to_thread(_parse_body, raw)


def _check_model(state: ServerState, body: dict) -> None:
    name = _get(body, "model", str, required=True)
    if name not in state.served_model_names:
        raise APIError(404, f"The model '{_show(name)}' does not exist; this server serves "
                            f"{', '.join(repr(n) for n in state.served_model_names)}", code="model_not_found",
                       param="model")


def _completion_inputs(state: ServerState, body: dict) -> list[tuple[str, str | list[int]]]:
    """``prompt`` checked: ``(place, text or token ids)`` per prompt (a
    string, a list of ids, or a list of strings / id lists: one choice group
    each). Ids are checked here; texts are tokenized by
    :func:`_tokenize_prompts`, off the event loop."""
    prompt = body.get("prompt")
    if prompt is None:
        raise _bad("'prompt' is a required property", "prompt", "missing_required_parameter")
    vocab = getattr(state.tokenizer, "vocab_size", None)

    def one(p, where: str):
        if isinstance(p, str):
            return where, p
        if isinstance(p, list) and all(_is(t, int) for t in p):
            return where, _token_ids(p, where, vocab)
        raise _bad(f"'{where}' must be a string or an array of token ids (integers)", "prompt", "invalid_type")

    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > MAX_N:
            raise _bad(f"'prompt' holds {len(prompt)} prompts; at most {MAX_N} per request", "prompt")
        return [one(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    return [one(prompt, "prompt")]


def _encode(tokenizer, text: str, *, add_special_tokens: bool = True) -> list[int]:
    """``tokenizer.encode(text, add_special_tokens=...)``, through its
    ``tokenizers`` backend's ``encode_batch`` where it has one: that call
    releases the GIL and ``encode`` does not, so a long text (megabytes:
    seconds) tokenized on a render thread would still stop the event loop's
    thread for as long as it takes. The same ids (``encode_batch`` encodes
    each text as ``encode`` does)."""
    batch = getattr(getattr(tokenizer, "backend", None), "encode_batch", None)
    if batch is None:
        return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
    return list(batch([text], add_special_tokens=add_special_tokens)[0].ids)


def _tokenize_prompts(tokenizer, prompts: list[tuple[str, str | list[int]]]) -> list[list[int]]:
    """The token ids of :func:`_completion_inputs`' prompts (on a render
    worker); 400 for an empty one."""
    out = []
    for where, p in prompts:
        ids = _encode(tokenizer, p) if isinstance(p, str) else p
        if not ids:
            raise _bad(f"'{where}' is empty (no tokens)", "prompt")
        out.append(list(ids))
    return out


#: ``chat_template_kwargs`` keys that name an argument of the rendering call itself (transformers'
#: ``apply_chat_template``, jaxkv.text's ``render_chat_template``), not a template variable: given there they
#: would override the server's own arguments (or fail the call with a TypeError), so they are refused.
#: ``chat_template`` is handled apart (a request template: see _chat_template).
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "conversation", "add_generation_prompt", "continue_final_message", "tokenize", "template",
    "tools", "documents", "special_tokens", "return_dict", "return_tensors", "return_assistant_tokens_mask",
    "padding", "truncation", "max_length", "tokenizer_kwargs", "self"})


def _chat_template(state: ServerState, body: dict, kwargs: dict) -> str | None:
    """The template the request names: ``chat_template`` (vLLM's field) or
    ``chat_template_kwargs.chat_template``, or None (the model's default).
    A name of one of the model's own templates is always taken; a template
    text only by a server started with ``trust_request_chat_template``
    (``--trust-request-chat-template``), else 400 naming the field: a
    client's template is code the server runs."""
    given = [(name, value) for name, value in (("chat_template", body.get("chat_template")),
                                                ("chat_template_kwargs", kwargs.pop("chat_template", None)))
             if value is not None]
    if len(given) > 1:
        raise _bad("give the chat template once: 'chat_template' or 'chat_template_kwargs.chat_template'",
                   "chat_template")
    if not given:
        return None
    param, template = given[0]
    where = "chat_template" if param == "chat_template" else "chat_template_kwargs.chat_template"
    if not isinstance(template, str):
        raise _bad(f"'{where}' must be a string, got {_json_type(template)}", param, "invalid_type")
    own = getattr(state.tokenizer, "chat_templates", None) or {}
    if template in own or state.trust_request_chat_template:
        return template
    names = f" (the model's templates, by name: {', '.join(sorted(own))})" if own else ""
    raise _bad(f"'{where}': this server renders only the model's chat templates{names}; a template from the "
               "request is taken only when the server runs with --trust-request-chat-template", param,
               "chat_template_not_allowed")


def _chat_inputs(state: ServerState, body: dict) -> dict:
    """The arguments of :func:`_render_chat`, checked (on the event loop:
    cheap, bounded by the body)."""
    messages = body.get("messages")
    if messages is None:
        raise _bad("'messages' is a required property", "messages", "missing_required_parameter")
    if not isinstance(messages, list) or not messages:
        raise _bad("'messages' must be a non-empty array of messages", "messages", "invalid_type")
    rendered = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _bad(f"'messages[{i}]' must be an object", "messages", "invalid_type")
        role = message.get("role")
        if not isinstance(role, str):
            raise _bad(f"'messages[{i}].role' must be a string", "messages",
                       "missing_required_parameter" if role is None else "invalid_type")
        content = message.get("content")
        if isinstance(content, list):
            parts = []
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise _bad(f"'messages[{i}].content' parts must be {{\"type\": \"text\", \"text\": ...}} "
                               "(this server takes text only)", "messages", "invalid_type")
                parts.append(part["text"])
            content = "".join(parts)
        elif content is not None and not isinstance(content, str):
            raise _bad(f"'messages[{i}].content' must be a string or an array of text parts", "messages",
                       "invalid_type")
        rendered.append({**message, "content": content})
    kwargs = dict(_get(body, "chat_template_kwargs", dict, default={}))
    template = _chat_template(state, body, kwargs)
    reserved = sorted(_RESERVED_TEMPLATE_KWARGS.intersection(kwargs))
    if reserved:
        raise _bad(f"'chat_template_kwargs' may not set {', '.join(repr(k) for k in reserved)}: the server "
                   "sets the rendering call's own arguments ('add_generation_prompt' is a field of the "
                   "request)", "chat_template_kwargs")
    add_generation_prompt = _get(body, "add_generation_prompt", bool, default=True)
    tools = parse_tools(body, _bad)
    return dict(messages=rendered, add_generation_prompt=add_generation_prompt, template=template, kwargs=kwargs,
                from_request=template is not None and template not in (getattr(state.tokenizer, "chat_templates",
                                                                               None) or {}), tools=tools)


def _render_chat(tokenizer, *, messages: list, add_generation_prompt: bool, template: str | None, kwargs: dict,
                 from_request: bool, tools: ToolRequest | None = None) -> list[int]:
    """The conversation's token ids (on a render worker). A template that
    refuses the conversation or fails on it answers 400 (``param``
    ``chat_template`` for a request's own template, else ``messages``): the
    request's data or template made it fail."""
    param = "chat_template" if from_request else "messages"
    try:
        text = tokenizer.apply_chat_template(template_messages(messages), add_generation_prompt=add_generation_prompt,
                                             tokenize=False, chat_template=template,
                                             tools=None if tools is None else list(tools.tools), **kwargs)
        ids = _encode(tokenizer, text, add_special_tokens=False)  # as tokenize=True does: the template wrote them
    except KVCacheError as err:  # ChatTemplateError / no template: the conversation is refused
        raise _bad(f"the chat template refused the messages: {_show(str(err), 500)}", param) from None
    except (RecursionError, MemoryError, ArithmeticError, LookupError, TypeError, ValueError) as err:
        raise _bad(f"the chat template failed on the messages: {type(err).__name__}: {_show(str(err), 500)}",
                   param) from None
    if not ids:
        raise _bad("the rendered conversation is empty", "messages")
    return list(ids)


# ------------------------------------------------------------ serving one request


@dataclasses.dataclass
class _Choice:
    index: int
    prompt_tokens: int
    text: list = dataclasses.field(default_factory=list)
    tokens: int = 0
    finish_reason: str | None = None
    last: float | None = None  # when its last tokens were delivered
    role_sent: bool = False
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    logprobs: list = dataclasses.field(default_factory=list)  # (token id, logprob, top) per token, when asked
    text_length: int = 0  # characters of text before the newest tokens (completions' text_offset)
    held: str = ""  # streaming with tools: the text held back from the first "<tool_call>" on
    prompt_ids: list = dataclasses.field(default_factory=list)
    prompt_scores: tuple | None = None  # RequestOutput.prompt_logprobs, when the prompt was scored

    def hold_calls(self, text: str, reason: str | None, names: frozenset) -> tuple[str, list | None, str | None]:
        """Streaming a chat whose output is parsed for tool calls: ``(text to
        send now, calls, finish reason)``. Text from the first
        ``<tool_call>`` on (or a partial one at the end) is held until the
        output ends; then its calls are parsed (what is not a call is sent
        as content) and the reason becomes ``"tool_calls"`` if any."""
        if self.held.startswith(CALL_START):
            self.held += text
            send = ""
        else:
            send, self.held = split_stream_text(self.held + text)
        if reason is None:
            return send, None, None
        rest, calls = parse_tool_calls(self.held, names)
        self.held = ""
        if not calls:
            return send + rest, None, reason
        return send + (rest or ""), calls, _call_reason(reason)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def _engine_kwargs(state: ServerState, params: _Params, prompt: list[int], index: int, tenant: str | None,
                   constraint=None) -> dict:
    max_tokens = params.max_tokens
    limit = state.max_model_len
    if limit is not None:
        if len(prompt) >= limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens; the prompt has "
                                f"{len(prompt)} tokens (at least one must be left to generate)",
                           code="context_length_exceeded", param="messages")
        if max_tokens is None:
            max_tokens = limit - len(prompt)
        elif len(prompt) + max_tokens > limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens; the request asks for "
                                f"{len(prompt) + max_tokens} ({len(prompt)} in the prompt, {max_tokens} to "
                                "generate). Shorten the prompt or lower max_tokens",
                           code="context_length_exceeded", param="max_tokens")
    if max_tokens is None:
        max_tokens = DEFAULT_COMPLETION_MAX_TOKENS
    eos = () if params.ignore_eos else state.eos_token_ids
    stop_ids = tuple(dict.fromkeys([*eos[1:], *params.stop_token_ids]))
    kwargs = dict(max_new_tokens=max_tokens, sampling=params.sampling,
                  eos_token_id=eos[0] if eos else None, stop_token_ids=stop_ids, stop=params.stop,
                  namespace=_namespace(tenant, params.cache_salt),
                  seed=None if params.seed is None else (params.seed + index) % 2 ** 32,
                  # best_of ranks its candidates by their tokens' log-probabilities: computed even if not asked
                  logprobs=params.logprobs if params.logprobs is not None or params.best_of <= params.n else 0,
                  penalties=params.penalties, constraint=constraint)
    scored = _scored_prompt(params)
    if scored is not None:
        kwargs["prompt_logprobs"] = scored
    return kwargs


def _scored_prompt(params: _Params) -> int | None:
    """The top count the engine scores each prompt token with: vLLM's
    ``prompt_logprobs``, or completions' ``logprobs`` with ``echo``; None:
    the prompt is not scored."""
    asks = [n for n in (params.prompt_logprobs, params.logprobs if params.echo else None) if n is not None]
    return max(asks) if asks else None


class _Job:
    """One HTTP request's engine requests (prompts x n choices) for
    ``tenant`` (None: a server without API keys)."""

    def __init__(self, state: ServerState, prompts: list[list[int]], params: _Params, tenant: str | None = None,
                 constraint=None):
        self.state = state
        self.params = params
        self.tenant = tenant
        self.arrival = time.perf_counter()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.choices: list[_Choice] = []
        self.sinks: list[_Sink] = []
        self.submissions = []
        self.prompt_tokens = sum(len(p) for p in prompts)
        candidates = max(params.n, params.best_of)
        for p, prompt in enumerate(prompts):
            for j in range(candidates):
                index = p * candidates + j
                self.choices.append(_Choice(index, len(prompt), prompt_ids=prompt))
                self.submissions.append((prompt, _engine_kwargs(state, params, prompt, j, tenant, constraint)))
        self.live: set[int] = set()

    async def submit(self) -> None:
        """Queue every engine request; raise the first refusal (400) after
        aborting the ones that were accepted."""
        loop = self.state.engine_loop
        candidates = max(self.params.n, self.params.best_of)
        for index, (prompt, kwargs) in enumerate(self.submissions):
            sink = _Sink(self.queue, index)
            self.sinks.append(sink)
            if index % candidates:  # a sibling: forks the first candidate's prompt (the engine thread resolves it)
                kwargs = dict(kwargs, fork_of=self.sinks[index - index % candidates])
            loop.add(sink, prompt, kwargs)
        pending = set(range(len(self.sinks)))
        error = None
        early: list = []
        while pending:
            index, item = await self.queue.get()
            if isinstance(item, tuple) and item[0] == "added":
                pending.discard(index)
                self.live.add(index)
            elif isinstance(item, tuple) and item[0] == "error":
                pending.discard(index)
                error = error or item[1]
            else:
                early.append((index, item))  # an output that came with its acknowledgement
        for entry in early:
            self.queue.put_nowait(entry)
        if error is not None:
            self.abort()
            raise _as_api_error(error, self.params.cache_salt)

    def abort(self) -> None:
        """Abort every engine request still running (a client that left)."""
        now = time.perf_counter()
        for index in sorted(self.live):
            self.state.engine_loop.abort(self.sinks[index])
            self.state.metrics.observe_finished(self.arrival, now, "abort", tenant=self.tenant)
        self.live.clear()

    def take(self, index: int, item) -> tuple[str, str | None, list]:
        """Record output ``item`` of choice ``index``; returns ``(new text,
        finish_reason or None, new logprob entries)`` (entries: ``(token id,
        logprob, top)``, empty unless the request asked). An error item
        raises."""
        if isinstance(item, tuple):
            if item[0] == "error":
                self.live.discard(index)
                raise _as_api_error(item[1], self.params.cache_salt)
            return "", None, []
        choice = self.choices[index]
        now = time.perf_counter()
        count = len(item.new_token_ids)
        if getattr(item, "prompt_logprobs", None) is not None:
            choice.prompt_scores = item.prompt_logprobs
        entries = []
        if item.new_logprobs is not None:
            entries = [(token, logprob, top) for token, (logprob, top) in zip(item.new_token_ids, item.new_logprobs)]
            choice.logprobs += entries
        metrics = self.state.metrics
        if count:
            metrics.observe_tokens(self.arrival, choice.last, now, count, tenant=self.tenant)
            choice.last = now
            choice.tokens += count
        text = item.new_text or ""
        if text:
            choice.text.append(text)
        choice.cached_tokens = item.cached_tokens
        if item.finished:
            choice.finish_reason = item.finish_reason or "stop"
            self.live.discard(index)
            metrics.observe_prompt(choice.prompt_tokens, tenant=self.tenant)
            metrics.observe_finished(self.arrival, now, choice.finish_reason, tenant=self.tenant)
            if choice.finish_reason == "error":  # the engine failed this request alone: an error for its client
                raise _request_error(getattr(item, "error", None), self.params.cache_salt)
        return text, (choice.finish_reason if item.finished else None), entries

    def usage(self) -> dict:
        completion = sum(c.tokens for c in self.choices)
        prompt = self.prompt_tokens
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(c.cached_tokens for c in self.choices)}}

    @property
    def finished(self) -> bool:
        return all(c.finished for c in self.choices)


def _redact(text: str, salt: str | None) -> str:
    """``text`` without ``salt`` in the forms an engine message would show it
    (quoted, as in a namespace's ``repr``)."""
    if salt is None:
        return text
    for form in (repr(salt), json.dumps(salt)):
        text = text.replace(form, "'<cache_salt>'")
    return text


def _as_api_error(err: BaseException, salt: str | None = None) -> APIError:
    """The answer to an engine error; the request's ``salt`` is redacted from
    the message (the engine's messages may show a namespace)."""
    if isinstance(err, APIError):
        return err
    if isinstance(err, KVCacheError):  # InvalidArgument from add_request: can never fit, bad ids, ...
        code = "context_length_exceeded" if "never fit" in str(err) else "invalid_value"
        return APIError(400, _redact(f"{type(err).__name__}: {err}", salt), code=code)
    return APIError(500, _redact(f"the engine failed: {type(err).__name__}: {err}", salt), code="internal_error")


def _request_error(message: str | None, salt: str | None = None) -> APIError:
    """The answer to a request the engine finished with ``finish_reason
    "error"`` (``RequestOutput.error``: its message): 400 when the message
    says the request itself was invalid (``InvalidArgument: ...``), else 500
    ``internal_error``; the request's ``salt`` redacted."""
    message = _redact(message or "the engine failed this request", salt)
    if message.startswith("InvalidArgument"):
        return APIError(400, message, code="invalid_value")
    return APIError(500, f"the engine failed this request: {message}", code="internal_error")


def _completion_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def _best_choices(choices: list, n: int, best_of: int) -> list:
    """Of each prompt's ``best_of`` candidates (consecutive in ``choices``),
    the ``n`` of highest cumulative log-probability (vLLM's ``best_of``
    rule; ties: the earlier), reindexed ``prompt * n + j``."""
    if best_of <= n:
        return choices
    kept = []
    for start in range(0, len(choices), best_of):
        group = choices[start:start + best_of]
        ranked = sorted(group, key=lambda c: -sum(logprob for _, logprob, _ in c.logprobs))[:n]
        kept += [dataclasses.replace(c, index=start // best_of * n + j) for j, c in enumerate(ranked)]
    return kept


async def _constraint(state: ServerState, params: _Params):
    """The token automaton of the request's structured output or forced
    tool call (None: none), compiled off the event loop (a new JSON schema
    takes up to seconds; :func:`~jaxkv.serve.structured.compile_constraint`
    caches them); an invalid one is a 400 naming the field."""
    spec = params.structured
    if params.tools is not None and params.tools.forced:
        if spec is not None:
            raise _bad(f"'tool_choice' {'required' if len(params.tools.forced) > 1 else 'naming a function'} and "
                       f"'{spec[0]}' both constrain the output; give one", "tool_choice")
        spec = ("tool_choice", {"regex": tool_call_regex(params.tools)})
    if spec is None:
        return None
    if state.tokenizer is None or state.vocab_size is None:
        raise _bad("structured outputs need the model's tokenizer", spec[0], "unsupported_parameter")
    try:
        return await asyncio.to_thread(compile_constraint, state.tokenizer, state.vocab_size, **spec[1])
    except InvalidArgument as err:
        raise _bad(str(err), spec[0]) from None


async def _engine_call(state: ServerState, fn):
    future = asyncio.get_running_loop().create_future()
    state.engine_loop.call(future, fn)
    return await future


async def _take_prompts(state: ServerState, job: _Job) -> None:
    """A decode server: each distinct prompt of ``job`` prefilled by a
    prefill server, its KV pulled and adopted into the prefix cache
    (:mod:`jaxkv.serve.disaggregated`). The prefill servers are asked in
    :class:`~jaxkv.serve.disaggregated.PrefillRouter`'s order, the next
    when one fails; a prompt none can hand over is computed here (logged,
    counted). A prompt this server's own prefix cache holds already, all
    but less than a unit (a page) of it, is not asked for (counted)."""
    import httpx

    metrics = state.metrics
    seen = set()
    async with httpx.AsyncClient(timeout=600) as client:
        for prompt, kwargs in job.submissions:
            namespace = kwargs.get("namespace")
            key = (tuple(prompt), json.dumps(namespace))
            if key in seen or len(prompt) < 2:
                continue
            seen.add(key)
            held, unit = await _engine_call(state, lambda engine, p=list(prompt), n=namespace: (
                len(p) - 1 - engine.cache.cached_length(p, n) < engine.cache.unit, engine.cache.unit))
            if held:
                metrics.kv_transfer_held.inc()
                continue
            for url in state.prefill.order(prompt, namespace, unit):
                if await _take_prompt_from(state, client, url, prompt, namespace):
                    state.prefill.record(prompt, namespace, unit, url)
                    break
            else:
                logger.warning("no prefill server could hand over a %d-token prompt; computing it here",
                               len(prompt))
                metrics.kv_transfer_failures.inc()


async def _take_prompt_from(state: ServerState, client, url: str, prompt: list, namespace) -> bool:
    """Ask the prefill server at ``url`` for ``prompt`` and adopt what it
    hands over (:func:`_take_prompts`); False, logged and counted, when it
    cannot."""
    from jaxkv.serve.disaggregated import import_prefix

    metrics = state.metrics
    began = time.perf_counter()
    state.prefill.in_flight[url] += 1
    try:
        response = await client.post(url + "/v1/jaxkv/prefill", json={"prompt": list(prompt), "namespace": namespace})
        response.raise_for_status()
        meta = response.json()
        if meta.get("none"):
            return True  # it holds nothing to hand over: computed here, as a prompt too short for a page is
        pulled = time.perf_counter()
        leaves = await asyncio.to_thread(state.transfer.pull, meta["address"], meta["uuid"], meta["leaves"])
        pulled = time.perf_counter() - pulled
        adopted = await _engine_call(state, lambda engine: import_prefix(engine, prompt, namespace, meta, leaves))
    except Exception as err:  # noqa: BLE001 - the next server is asked, else the prompt is computed here
        logger.warning("prefill server %s could not hand over a %d-token prompt (%s: %s)", url, len(prompt),
                       type(err).__name__, err)
        metrics.kv_transfer_server.labels(server=url, outcome="failed").inc()
        return False
    finally:
        state.prefill.in_flight[url] -= 1
    metrics.kv_transfer_server.labels(server=url, outcome="ok").inc()
    metrics.kv_transfers.inc()
    metrics.kv_transfer_bytes.inc(meta["bytes"])
    metrics.kv_transfer_tokens.inc(adopted)
    metrics.kv_transfer_seconds.inc(time.perf_counter() - began)
    metrics.kv_transfer_pull_seconds.inc(pulled)
    return True


async def _serve(request: Request, state: ServerState, prompts: list[list[int]], params: _Params, *, chat: bool,
                 tenant: str | None = None, echo_texts: list | None = None):
    job = _Job(state, prompts, params, tenant, await _constraint(state, params))
    if state.role == "decode":
        await _take_prompts(state, job)
    if echo_texts is not None:  # each choice starts with its prompt's text
        candidates = max(params.n, params.best_of)
        for choice in job.choices:
            choice.text.append(echo_texts[choice.index // candidates])
    await job.submit()
    rid = _completion_id(chat)
    created = int(time.time())
    model = state.served_model_names[0]
    if params.stream:
        # The background task aborts what is left if the stream never started (a client gone before the
        # first byte: the generator's own ``finally`` only runs once it has started).
        return StreamingResponse(_stream(job, rid, created, model, chat), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                                 background=BackgroundTask(job.abort))
    try:
        while not job.finished:
            try:
                index, item = await asyncio.wait_for(job.queue.get(), timeout=1.0)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    logger.debug("client of %s went away: aborting", rid)
                    return Response(status_code=499)
                continue
            job.take(index, item)
    finally:
        job.abort()  # nothing is left live when the job finished; a client that left frees its blocks
    choices = []
    asked = params.logprobs is not None
    for choice in _best_choices(job.choices, params.n, params.best_of):
        text = "".join(choice.text)
        if chat:
            logprobs = _chat_logprobs(_names(state, params), choice.logprobs) if asked else None
            message, reason = {"role": "assistant", "content": text}, choice.finish_reason
            if params.tools is not None and params.tools.parse:
                content, calls = parse_tool_calls(text, params.tools.names)
                if calls:
                    message, reason = {"role": "assistant", "content": content, "tool_calls": calls}, _call_reason(
                        reason)
            choices.append({"index": choice.index, "message": message, "logprobs": logprobs,
                            "finish_reason": reason})
        else:
            entries = (_prompt_entries(choice, params.logprobs) if params.echo else []) + choice.logprobs
            logprobs = _completion_logprobs(_names(state, params), entries, 0) if asked else None
            choices.append({"index": choice.index, "text": text, "logprobs": logprobs,
                            "finish_reason": choice.finish_reason,
                            **_prompt_logprobs_field(_names(state, params), choice, params.prompt_logprobs)})
    extra = {}
    if chat and params.prompt_logprobs is not None and job.choices:  # chat: the response's, of its one prompt
        extra = _prompt_logprobs_field(_names(state, params), job.choices[0], params.prompt_logprobs)
    return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                         "model": model, "choices": choices, "usage": job.usage(), **extra})


def _prompt_entries(choice: _Choice, top: int) -> list:
    """Completions' ``echo`` with ``logprobs``: the prompt's tokens as
    entries ``(token id, logprob, top)``, the first one's logprob and top
    None (nothing precedes it); [] when the prompt was not scored."""
    if choice.prompt_scores is None or not choice.prompt_ids:
        return []
    return [(choice.prompt_ids[0], None, None)] + [
        (token, logprob, alternatives[:top])
        for token, (logprob, _, alternatives) in zip(choice.prompt_ids[1:], choice.prompt_scores[1:])]


def _prompt_logprobs_field(tokenizer, choice: _Choice, top: int | None) -> dict:
    """vLLM's ``prompt_logprobs``: per prompt token None (the first) or
    ``{token id: {"logprob", "rank", "decoded_token"}}`` holding the token
    and the ``top`` most likely (ranks 1..top); {} when not asked."""
    if top is None or choice.prompt_scores is None:
        return {}
    out = [None]
    for token, (logprob, rank, alternatives) in zip(choice.prompt_ids[1:], choice.prompt_scores[1:]):
        entry = {str(token): {"logprob": _finite(logprob), "rank": rank,
                              "decoded_token": _token_text(tokenizer, token)}}
        for place, (other, value) in enumerate(alternatives[:top], start=1):
            entry.setdefault(str(other), {"logprob": _finite(value), "rank": place,
                                          "decoded_token": _token_text(tokenizer, other)})
        out.append(entry)
    return {"prompt_logprobs": out}


def _echo_text(tokenizer, ids: list) -> str:
    """A token-id prompt's text for ``echo`` (its special tokens included)."""
    return "" if tokenizer is None else tokenizer.decode(ids, skip_special_tokens=False)


def _call_reason(reason: str | None) -> str | None:
    """The finish reason of an answer that made tool calls: OpenAI's
    ``"tool_calls"`` where the model stopped by itself."""
    return "tool_calls" if reason == "stop" else reason


#: What a log-probability of -inf (a token top-k or top-p filtered out, in the processed mode) is sent as:
#: JSON has no infinity (vLLM sends the same number).
LOGPROB_FLOOR = -9999.0


def _names(state: ServerState, params: _Params):
    """What names tokens in log-probabilities: the tokenizer (each token's
    own decoding), or None for ``token_id:N`` (vLLM's
    ``return_tokens_as_token_ids``: byte tokens that are no whole
    character stay distinguishable)."""
    return None if params.tokens_as_ids else state.tokenizer


def _token_text(tokenizer, token: int) -> str:
    """A token's text as OpenAI's logprobs show it: its own decoding (an
    incomplete UTF-8 character reads U+FFFD); ``token_id:N`` without a
    tokenizer."""
    if tokenizer is None:
        return f"token_id:{token}"
    return tokenizer.decode([token], skip_special_tokens=False)


def _finite(logprob: float) -> float:
    return logprob if logprob > LOGPROB_FLOOR else LOGPROB_FLOOR


def _chat_logprobs(tokenizer, entries: list) -> dict:
    """OpenAI's chat ``logprobs``: ``{"content": [{"token", "logprob",
    "bytes", "top_logprobs": [...]}, ...]}``."""
    def one(token: int, logprob: float) -> dict:
        text = _token_text(tokenizer, token)
        return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}

    return {"content": [{**one(token, logprob), "top_logprobs": [one(t, lp) for t, lp in top]}
                        for token, logprob, top in entries]}


def _completion_logprobs(tokenizer, entries: list, offset: int) -> dict:
    """OpenAI's (legacy) completions ``logprobs``: parallel ``tokens``,
    ``token_logprobs``, ``top_logprobs`` (a dict per token: text ->
    logprob) and ``text_offset`` (where each token's text starts in the
    choice's text, from ``offset``)."""
    tokens, starts = [], []
    for token, _, _ in entries:
        text = _token_text(tokenizer, token)
        starts.append(offset)
        tokens.append(text)
        offset += len(text)
    tops = []
    for _, _, top in entries:
        if top is None:  # an echoed prompt's first token: nothing precedes it
            tops.append(None)
            continue
        by_text = {}
        for t, lp in top:  # most likely first: a text two tokens share keeps the likelier one's
            by_text.setdefault(_token_text(tokenizer, t), _finite(lp))
        tops.append(by_text)
    return {"tokens": tokens, "token_logprobs": [None if lp is None else _finite(lp) for _, lp, _ in entries],
            "top_logprobs": tops, "text_offset": starts}


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"


def _first_stream_pieces(job: _Job, index: int, chat: bool) -> list:
    """What a stream sends with a choice's first output: completions'
    echoed prompt with its scores (``echo`` with ``logprobs``), and vLLM's
    ``prompt_logprobs`` when asked; [] otherwise."""
    params, choice, tokenizer = job.params, job.choices[index], _names(job.state, job.params)
    field = _prompt_logprobs_field(tokenizer, choice, params.prompt_logprobs)
    if not chat and params.echo and params.logprobs is not None:
        logprobs = _completion_logprobs(tokenizer, _prompt_entries(choice, params.logprobs), 0)
        choice.text_length = sum(len(t) for t in logprobs["tokens"])
        return [{"index": index, "text": choice.text[0], "logprobs": logprobs, "finish_reason": None, **field}]
    if not field:
        return []
    if chat:
        return [{"index": index, "delta": {}, "logprobs": None, "finish_reason": None, **field}]
    return [{"index": index, "text": "", "logprobs": None, "finish_reason": None, **field}]


async def _stream(job: _Job, rid: str, created: int, model: str, chat: bool):
    """Server-sent events in OpenAI's chunk format; ``data: [DONE]`` last."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    usage_field = {"usage": None} if job.params.include_usage else {}

    def chunk(choices: list) -> str:
        return _sse({"id": rid, "object": kind, "created": created, "model": model, "choices": choices,
                     **usage_field})

    try:
        if chat:  # the assistant's role first, as OpenAI sends it
            yield chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None} for c in job.choices])
        elif job.params.echo and job.params.logprobs is None:  # the prompts' texts first (_serve put each at
            # the head of its choice's text); with logprobs, each with its scores when its first output comes
            yield "".join(chunk([{"index": c.index, "text": c.text[0], "logprobs": None, "finish_reason": None}])
                          for c in job.choices)
        first = set(range(len(job.choices)))  # choices whose first output is still to come
        while not job.finished:
            entries = [await job.queue.get()]
            while not job.queue.empty():  # whatever else arrived with it: one write
                entries.append(job.queue.get_nowait())
            try:
                out = []
                for index, item in entries:
                    text, reason, new = job.take(index, item)
                    if index in first and not isinstance(item, tuple):
                        first.discard(index)
                        out += _first_stream_pieces(job, index, chat)
                    calls = None
                    if chat and job.params.tools is not None and job.params.tools.parse:
                        text, calls, reason = job.choices[index].hold_calls(text, reason, job.params.tools.names)
                    if not text and reason is None and not new:
                        continue
                    logprobs = None
                    if job.params.logprobs is not None:
                        choice = job.choices[index]
                        names = _names(job.state, job.params)
                        logprobs = (_chat_logprobs(names, new) if chat else
                                    _completion_logprobs(names, new, choice.text_length))
                        choice.text_length += len(text)
                    if chat:
                        delta = {"content": text} if text else {}
                        if calls:
                            delta["tool_calls"] = [{"index": j, **call} for j, call in enumerate(calls)]
                        out.append({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason})
                    else:
                        out.append({"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason})
            except APIError as err:  # the engine failed mid-stream: an error event, then the end
                yield _sse({"error": {"message": err.message, "type": err.type, "param": None, "code": err.code}})
                break
            if out:
                yield "".join(chunk([c]) for c in out)
        if job.params.include_usage:
            yield _sse({"id": rid, "object": kind, "created": created, "model": model, "choices": [],
                        "usage": job.usage()})
        yield "data: [DONE]\n\n"
    finally:
        if job.live:
            logger.debug("stream %s closed with %d requests running: aborting them", rid, len(job.live))
        job.abort()


# ------------------------------------------------------------ warm-up and running


def warm_up(engine, *, vocab_size: int | None = None) -> dict:
    """Compile the engine's programs before the first client. Padded
    scheduler: ONE tiny greedy request with two new tokens through
    ``engine.step`` (a prefill call, then a decode call). Packed scheduler:
    one such request per packed stream length (``engine.stream_lengths()``:
    a prompt that fills each bucket; distinct first tokens, so no prefix hit
    shortens one). Then one more with a sibling (``fork_of``: the server's
    ``n`` > 1), whose fork copies the other's partly filled page. The
    engine's other shapes are fixed (decode ``[max_seqs]``, padded id
    arrays, sampling parameters traced per row), so this compiles every
    program a paged model serves with: later prompt lengths, batch sizes,
    sampling settings, prefix hits, siblings and aborts compile nothing more
    (tests/test_server.py checks it through
    ``jaxkv_xla_compilations_total``). Exceptions: swap-in/out (host KV
    memory) compiles at the first swap, and a hybrid model's Gated DeltaNet
    view compiles once more per power of two of prompt pieces packed in one
    step. The records are dropped (``engine.forget``); their full pages stay
    in the prefix cache. A warm-up request the engine finishes with
    ``finish_reason "error"`` is logged as a warning and counted (``errors``)
    and the server still becomes ready: a request that fails fails alone.
    Returns ``{"seconds", "requests", "tokens", "errors"}``."""
    start = time.perf_counter()
    vocab = vocab_size or getattr(engine, "vocab_size", None) or 2
    limit = getattr(engine, "max_model_len", None)
    lengths = engine.stream_lengths() if hasattr(engine, "stream_lengths") else []
    tokens = requests = errors = 0
    buckets = lengths or [4]
    # Then a request and its sibling (n > 1): the fork's copy of the other's partly filled page (or state).
    for i, length in enumerate([*buckets, 4]):
        if limit is not None:  # a tiny context
            length = max(min(length, limit - 2), 1)
        ids = [1 + (7 * k + 3 * i) % max(vocab - 1, 1) for k in range(length)]
        rids = [engine.add_request(ids, 2)]
        if i == len(buckets):
            rids.append(engine.add_request(ids, 2, fork_of=rids[0]))
        while engine.has_unfinished():
            for output in engine.step():
                tokens += len(output.new_token_ids)
                if output.finished and output.finish_reason == "error":
                    errors += 1
                    logger.warning("warm-up request %d (%d prompt tokens) finished with an error: %s; serving "
                                   "anyway (what it did not compile compiles on first use)", i, length,
                                   getattr(output, "error", None) or "no message")
        for rid in rids:
            EngineLoop._release(engine, rid)
        requests += len(rids)
    return {"seconds": time.perf_counter() - start, "requests": requests, "tokens": tokens, "errors": errors}


def _count_compiles(metrics: ServerMetrics) -> None:
    """Count XLA backend compiles into ``metrics`` (``jax.monitoring``)."""
    import jax.monitoring

    def listener(event: str, duration: float, **kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            metrics.count_compile(duration)

    jax.monitoring.register_event_duration_secs_listener(listener)


def run_server(build: Callable[[], tuple[object, object]], *, host: str, port: int,
               served_model_names: Sequence[str], startup_clock: float | None = None,
               log_level: str = "info", on_started: Callable[[object], None] | None = None,
               api_keys: Mapping[str, str] | APIKeys | None = None, trust_request_chat_template: bool = False,
               render_timeout: float = RENDER_TIMEOUT, max_body_bytes: int = MAX_BODY_BYTES,
               lockstep=None, role: str | None = None, prefill_url: str | Sequence[str] | None = None,
               transfer=None) -> None:
    """Serve until interrupted (uvicorn; SIGINT / SIGTERM stop it).
    ``api_keys``, ``trust_request_chat_template``, ``render_timeout``,
    ``max_body_bytes``, ``lockstep``, ``role``, ``prefill_url``, ``transfer``: as :func:`create_app`'s."""
    import uvicorn

    keys = None if api_keys is None else api_keys if isinstance(api_keys, APIKeys) else APIKeys(api_keys)
    metrics = ServerMetrics(tenants=None if keys is None else keys.tenants)
    _count_compiles(metrics)
    app = create_app(build, served_model_names=served_model_names, metrics=metrics, startup_clock=startup_clock,
                     api_keys=keys, trust_request_chat_template=trust_request_chat_template,
                     render_timeout=render_timeout, max_body_bytes=max_body_bytes, lockstep=lockstep, role=role,
                     prefill_url=prefill_url, transfer=transfer)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    if on_started is not None:
        on_started(server)
    server.run()

