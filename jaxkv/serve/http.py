"""An OpenAI-compatible HTTP server over :class:`jaxkv.serve.Engine`.

``python -m jaxkv.serve --model PATH`` (see :mod:`jaxkv.serve.__main__`)
serves, on FastAPI + uvicorn:

* ``GET /health``: 200 once ready (model loaded, compiled programs warmed
  up), 503 while starting (or when the start failed);
* ``GET /v1/models``: the served model name(s) and ``max_model_len``;
* ``POST /v1/completions``: ``prompt`` as text, a list of token ids, or a
  list of either (one choice group per prompt);
* ``POST /v1/chat/completions``: ``messages`` rendered with the tokenizer's
  chat template (``add_generation_prompt``); ``content`` a string or a list
  of ``{"type": "text", "text": ...}`` parts;
* ``GET /metrics``: Prometheus text (:mod:`jaxkv.serve.metrics`).

Request fields: ``model`` (required), ``max_tokens`` (chat also
``max_completion_tokens``; default 16 for completions, the rest of the
context for chat), ``temperature`` (0..2; 0 greedy), ``top_p`` (0..1],
``top_k`` (0 or -1: off), ``seed``, ``stop`` (a string or a list of
strings), ``n`` (1..:data:`MAX_N`), ``stream``, ``stream_options``
(``{"include_usage": true}``: a last chunk with ``usage`` and no choices),
``cache_salt`` (vLLM's name: the request's prefixes go into their own
namespace of the prefix cache, so requests with different salts never share
a prefix, and requests with the same salt do; with API keys, within the
request's tenant only: see below), and two vLLM extensions,
``ignore_eos`` and ``stop_token_ids``. Fields the server cannot honour
(``logprobs``, penalties, ``logit_bias``, ``tools``, ``echo``,
``best_of``...) set to anything but their neutral value are refused with 400
rather than silently ignored. Non-stream responses always carry ``usage``
(``prompt_tokens``: each distinct prompt once, whatever ``n``;
``completion_tokens``: over every choice).

``n > 1`` is served as ``n`` engine requests on the same prompt with seeds
``seed, seed + 1, ...`` (without a ``seed``, each request draws from the
engine's own per-request stream): the engine cannot fork a running request
yet, so the prompt is shared through the prefix cache (the first request to
finish prefilling leaves its full pages in the cache for the others when
they are admitted later; requests admitted in the same iteration each
prefill their own copy).

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
an unsupported field, and a prompt that with ``max_tokens`` does not fit the
context (``code: context_length_exceeded``) or that the engine says can never
fit; 401 (``authentication_error``) for a missing or unknown API key; 404
for an unknown model (``model_not_found``) or path; 503
(``model_not_ready``) while starting; 500 for a failure inside the engine.
A refused request is refused before it reaches the engine (or, for the
engine's own check, at ``add_request``, which queues nothing), so it never
disturbs the requests being served.

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
loop and no asyncio object is touched from the engine thread. While it has
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
import hashlib
import hmac
import json
import logging
import math
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from jaxkv.errors import InvalidArgument, KVCacheError
from jaxkv.nn.sampling import SamplingParams
from jaxkv.serve.metrics import CONTENT_TYPE, ServerMetrics

__all__ = ["MAX_N", "OPEN_PATHS", "APIError", "APIKeys", "EngineLoop", "ServerState", "configure_compile_cache",
           "create_app", "default_compile_cache_dir", "run_server", "warm_up"]

logger = logging.getLogger("jaxkv.serve")

#: The most choices one request may ask for (``n``).
MAX_N = 16
#: Completions' ``max_tokens`` when none is given (OpenAI's default).
DEFAULT_COMPLETION_MAX_TOKENS = 16


# ------------------------------------------------------------ compile cache


def default_compile_cache_dir() -> str:
    """Where the persistent JAX compilation cache lives by default:
    ``$JAXKV_CACHE_DIR/jax`` when ``JAXKV_CACHE_DIR`` is set, else
    ``$XDG_CACHE_HOME/jaxkv/jax``, else ``~/.cache/jaxkv/jax``."""
    root = os.environ.get("JAXKV_CACHE_DIR")
    if not root:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
                            "jaxkv")
    return os.path.join(root, "jax")


def configure_compile_cache(path: str | None) -> int:
    """Turn on JAX's persistent compilation cache in folder ``path`` (None:
    leave it off) and cache every program, however small or quick to compile
    (``jax_persistent_cache_min_compile_time_secs = 0``,
    ``jax_persistent_cache_min_entry_size_bytes = -1``: JAX's defaults skip
    programs compiled in under a second, i.e. most of a small model's on
    CPU). Call before anything is compiled. Returns the number of entries
    already in the folder (0: a cold start)."""
    if path is None:
        return 0
    import jax

    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return sum(1 for name in os.listdir(path) if not name.startswith("."))


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
                             405: "invalid_request_error", 503: "service_unavailable"}.get(status, "server_error")

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
    if kind is float:  # a JSON number: an integer too
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
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
_UNSUPPORTED = {"logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False),
                "best_of": (None, 1), "logit_bias": (None, {}), "presence_penalty": (None, 0, 0.0),
                "frequency_penalty": (None, 0, 0.0), "suffix": (None, ""), "tools": (None, []),
                "functions": (None, []), "response_format": (None, {"type": "text"}),
                "repetition_penalty": (None, 1, 1.0), "min_tokens": (None, 0)}


def _refuse_unsupported(body: dict) -> None:
    for name, neutral in _UNSUPPORTED.items():
        if name in body and not any(body[name] == v and type(body[name]) is type(v) or body[name] is v
                                    for v in neutral):
            raise _bad(f"'{name}' is not supported by this server (got {json.dumps(body[name])[:60]})", name,
                       "unsupported_parameter")


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


def _parse_params(body: dict, *, chat: bool) -> _Params:
    _refuse_unsupported(body)
    max_tokens = _get(body, "max_tokens", int, low=1)
    if chat and max_tokens is None:
        max_tokens = _get(body, "max_completion_tokens", int, low=1)
    temperature = float(_get(body, "temperature", float, default=1.0, low=0, high=2))
    top_p = float(_get(body, "top_p", float, default=1.0, low=0, high=1, low_open=True))
    top_k = _get(body, "top_k", int, default=0, low=-1)
    seed = _get(body, "seed", int, low=-(2 ** 63), high=2 ** 64 - 1)
    if seed is not None:
        seed %= 2 ** 32  # jax.random.key takes a 32-bit seed here
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
    stop_token_ids = body.get("stop_token_ids")
    if stop_token_ids is None:
        stop_token_ids = ()
    elif isinstance(stop_token_ids, list) and all(_is(t, int) for t in stop_token_ids):
        stop_token_ids = tuple(stop_token_ids)
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
    return _Params(
        max_tokens=max_tokens,
        sampling=SamplingParams(temperature=temperature, top_k=max(top_k, 0), top_p=top_p),
        seed=seed, stop=stop, stop_token_ids=stop_token_ids,
        ignore_eos=_get(body, "ignore_eos", bool, default=False),
        n=_get(body, "n", int, default=1, low=1, high=MAX_N), stream=stream, include_usage=include_usage,
        cache_salt=salt)


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
                 on_failed: Callable[[BaseException], None] | None = None, idle_wait: float = 0.5):
        self._build = build
        self._loop = loop
        self._on_ready = on_ready
        self._on_failed = on_failed
        self._idle_wait = idle_wait
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[_Sink, int] = {}  # sink -> engine request id (engine thread only)
        self._sinks: dict[int, _Sink] = {}  # engine request id -> sink (engine thread only)
        self._stopping = False
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
            for command in commands:
                self._handle(engine, command, deliveries)
            if not self._stopping and engine.has_unfinished():
                try:
                    outputs = engine.step()
                except Exception as err:  # noqa: BLE001 - a bug in the engine: fail its requests, keep serving
                    logger.exception("engine step failed; failing the %d requests in flight", len(self._live))
                    for sink, rid in list(self._live.items()):
                        deliveries.append((sink, ("error", err)))
                        self._forget(sink)
                        try:
                            engine.abort(rid)
                        except Exception:  # noqa: BLE001
                            pass
                    outputs = []
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
        for sink in list(self._live):  # stopping: whoever still waits gets an error
            self._post(_deliver, [(sink, ("error", APIError(503, "the server is shutting down",
                                                            code="shutting_down")))])

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
            try:
                rid = engine.add_request(prompt, **kwargs)
            except Exception as err:  # noqa: BLE001 - answered to its client; others go on
                deliveries.append((sink, ("error", err)))
                return
            self._live[sink] = rid
            self._sinks[rid] = sink
            deliveries.append((sink, ("added", rid)))
        elif kind == "abort":
            sink = command[1]
            rid = self._live.get(sink)
            if rid is not None:  # its last output ("abort") comes from a later step and is dropped
                self._forget(sink)
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
        elif kind == "stop":
            self._stopping = True

    def _fail_pending(self, err: BaseException) -> None:
        """The engine never started: answer every queued command."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                self._post(_deliver, [(command[1], ("error", err))])
            elif command[0] == "stats":
                self._post(_settle, command[1], None, err)


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
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    eos_token_ids: tuple[int, ...] = ()


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
               api_keys: Mapping[str, str] | APIKeys | None = None) -> FastAPI:
    """The FastAPI app. ``build()`` runs on the engine thread when the app
    starts and returns ``(engine, tokenizer)`` (load, build, warm up); the
    app answers 503 until it returns. ``startup_clock``: the
    ``time.perf_counter()`` value the start-up time is counted from (default:
    when the app starts). ``api_keys``: API key -> tenant name (or an
    :class:`APIKeys`); given, every path but :data:`OPEN_PATHS` needs a key
    and each tenant has its own namespaces (module docstring: API keys and
    tenants). ``metrics`` (default: new ones) must have a ``tenant`` label
    exactly when keys are given (``ServerMetrics(tenants=keys.tenants)``);
    ``InvalidArgument`` otherwise."""
    keys = None if api_keys is None else api_keys if isinstance(api_keys, APIKeys) else APIKeys(api_keys)
    if metrics is None:
        metrics = ServerMetrics(tenants=None if keys is None else keys.tenants)
    elif (metrics.tenants is None) != (keys is None):
        raise InvalidArgument("create_app: the metrics need a tenant label exactly when API keys are given "
                              "(ServerMetrics(tenants=...))")
    state = ServerState(tokenizer=None, served_model_names=list(served_model_names), metrics=metrics)

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
            eos = getattr(state.tokenizer, "eos_token_ids", ()) or ()
            state.eos_token_ids = tuple(int(i) for i in eos)
            state.ready = metrics.ready = True
            metrics.startup_seconds = time.perf_counter() - began
            logger.info("ready in %.1f s (serving %s, max_model_len %s)", metrics.startup_seconds,
                        ", ".join(state.served_model_names), state.max_model_len)

        def on_failed(err):
            state.failed = err

        state.engine_loop = EngineLoop(build_on_thread, loop, on_ready=on_ready, on_failed=on_failed)
        state.engine_loop.start()
        try:
            yield
        finally:
            state.ready = metrics.ready = False
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

    @app.post("/v1/completions")
    async def completions(request: Request):
        check_ready()
        body = await _json_body(request)
        _check_model(state, body)
        prompts = _completion_prompts(state, body)
        params = _parse_params(body, chat=False)
        return await _serve(request, state, prompts, params, chat=False, tenant=tenant_of(request))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        check_ready()
        body = await _json_body(request)
        _check_model(state, body)
        prompt = _chat_prompt(state, body)
        params = _parse_params(body, chat=True)
        return await _serve(request, state, [prompt], params, chat=True, tenant=tenant_of(request))

    return app


async def _json_body(request: Request) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise _bad(f"the request body is not valid JSON: {err}", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise _bad(f"the request body must be a JSON object, got {_json_type(body)}", None, "invalid_type")
    return body


def _check_model(state: ServerState, body: dict) -> None:
    name = _get(body, "model", str, required=True)
    if name not in state.served_model_names:
        raise APIError(404, f"The model '{name}' does not exist; this server serves "
                            f"{', '.join(repr(n) for n in state.served_model_names)}", code="model_not_found",
                       param="model")


def _completion_prompts(state: ServerState, body: dict) -> list[list[int]]:
    """``prompt`` as token id lists: a string, a list of ids, or a list of
    strings / id lists (one choice group each)."""
    prompt = body.get("prompt")
    if prompt is None:
        raise _bad("'prompt' is a required property", "prompt", "missing_required_parameter")
    vocab = getattr(state.tokenizer, "vocab_size", None)

    def one(p, where: str) -> list[int]:
        if isinstance(p, str):
            ids = state.tokenizer.encode(p)
        elif isinstance(p, list) and all(_is(t, int) for t in p):
            ids = list(p)
            bad = [t for t in ids if t < 0 or (vocab is not None and t >= vocab)]
            if bad:
                raise _bad(f"'{where}' holds token ids outside the vocabulary [0, {vocab}): {bad[:5]}", "prompt")
        else:
            raise _bad(f"'{where}' must be a string or an array of token ids (integers)", "prompt", "invalid_type")
        if not ids:
            raise _bad(f"'{where}' is empty (no tokens)", "prompt")
        return ids

    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > MAX_N:
            raise _bad(f"'prompt' holds {len(prompt)} prompts; at most {MAX_N} per request", "prompt")
        return [one(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    return [one(prompt, "prompt")]


def _chat_prompt(state: ServerState, body: dict) -> list[int]:
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
    kwargs = _get(body, "chat_template_kwargs", dict, default={})
    add_generation_prompt = _get(body, "add_generation_prompt", bool, default=True)
    try:
        ids = state.tokenizer.apply_chat_template(rendered, add_generation_prompt=add_generation_prompt,
                                                  tokenize=True, **kwargs)
    except KVCacheError as err:  # ChatTemplateError / no template: the conversation is refused
        raise _bad(f"the chat template refused the messages: {err}", "messages") from None
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

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def _engine_kwargs(state: ServerState, params: _Params, prompt: list[int], index: int, tenant: str | None) -> dict:
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
                  seed=None if params.seed is None else (params.seed + index) % 2 ** 32)
    return kwargs


class _Job:
    """One HTTP request's engine requests (prompts x n choices) for
    ``tenant`` (None: a server without API keys)."""

    def __init__(self, state: ServerState, prompts: list[list[int]], params: _Params, tenant: str | None = None):
        self.state = state
        self.params = params
        self.tenant = tenant
        self.arrival = time.perf_counter()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.choices: list[_Choice] = []
        self.sinks: list[_Sink] = []
        self.submissions = []
        self.prompt_tokens = sum(len(p) for p in prompts)
        for p, prompt in enumerate(prompts):
            for j in range(params.n):
                index = p * params.n + j
                self.choices.append(_Choice(index, len(prompt)))
                self.submissions.append((prompt, _engine_kwargs(state, params, prompt, j, tenant)))
        self.live: set[int] = set()

    async def submit(self) -> None:
        """Queue every engine request; raise the first refusal (400) after
        aborting the ones that were accepted."""
        loop = self.state.engine_loop
        for index, (prompt, kwargs) in enumerate(self.submissions):
            sink = _Sink(self.queue, index)
            self.sinks.append(sink)
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

    def take(self, index: int, item) -> tuple[str, str | None]:
        """Record output ``item`` of choice ``index``; returns ``(new text,
        finish_reason or None)``. An error item raises."""
        if isinstance(item, tuple):
            if item[0] == "error":
                self.live.discard(index)
                raise _as_api_error(item[1], self.params.cache_salt)
            return "", None
        choice = self.choices[index]
        now = time.perf_counter()
        count = len(item.new_token_ids)
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
        return text, (choice.finish_reason if item.finished else None)

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


def _completion_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


async def _serve(request: Request, state: ServerState, prompts: list[list[int]], params: _Params, *, chat: bool,
                 tenant: str | None = None):
    job = _Job(state, prompts, params, tenant)
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
    for choice in job.choices:
        text = "".join(choice.text)
        if chat:
            choices.append({"index": choice.index, "message": {"role": "assistant", "content": text},
                            "logprobs": None, "finish_reason": choice.finish_reason})
        else:
            choices.append({"index": choice.index, "text": text, "logprobs": None,
                            "finish_reason": choice.finish_reason})
    return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
                         "model": model, "choices": choices, "usage": job.usage()})


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"


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
        while not job.finished:
            entries = [await job.queue.get()]
            while not job.queue.empty():  # whatever else arrived with it: one write
                entries.append(job.queue.get_nowait())
            try:
                out = []
                for index, item in entries:
                    text, reason = job.take(index, item)
                    if not text and reason is None:
                        continue
                    if chat:
                        out.append({"index": index, "delta": {"content": text} if text else {}, "logprobs": None,
                                    "finish_reason": reason})
                    else:
                        out.append({"index": index, "text": text, "logprobs": None, "finish_reason": reason})
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
    shortens one). The engine's other shapes are fixed (decode ``[max_seqs]``,
    padded id arrays, sampling parameters traced per row), so this compiles
    every program a paged model serves with: later prompt lengths, batch
    sizes, sampling settings, prefix hits and aborts compile nothing more
    (tests/test_server.py checks it through
    ``jaxkv_xla_compilations_total``). Exceptions: swap-in/out (host KV
    memory) compiles at the first swap, and a hybrid model's Gated DeltaNet
    view compiles once more per power of two of prompt pieces packed in one
    step. The records are dropped (``engine.forget``); their full pages stay
    in the prefix cache. Returns ``{"seconds", "requests", "tokens"}``."""
    start = time.perf_counter()
    vocab = vocab_size or getattr(engine, "vocab_size", None) or 2
    limit = getattr(engine, "max_model_len", None)
    lengths = engine.stream_lengths() if hasattr(engine, "stream_lengths") else []
    tokens = requests = 0
    for i, length in enumerate(lengths or [4]):
        if limit is not None:  # a tiny context
            length = max(min(length, limit - 2), 1)
        ids = [1 + (7 * k + 3 * i) % max(vocab - 1, 1) for k in range(length)]
        rid = engine.add_request(ids, 2)
        while engine.has_unfinished():
            tokens += sum(len(o.new_token_ids) for o in engine.step())
        EngineLoop._release(engine, rid)
        requests += 1
    return {"seconds": time.perf_counter() - start, "requests": requests, "tokens": tokens}


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
               api_keys: Mapping[str, str] | APIKeys | None = None) -> None:
    """Serve until interrupted (uvicorn; SIGINT / SIGTERM stop it).
    ``api_keys``: as :func:`create_app`'s."""
    import uvicorn

    keys = None if api_keys is None else api_keys if isinstance(api_keys, APIKeys) else APIKeys(api_keys)
    metrics = ServerMetrics(tenants=None if keys is None else keys.tenants)
    _count_compiles(metrics)
    app = create_app(build, served_model_names=served_model_names, metrics=metrics, startup_clock=startup_clock,
                     api_keys=keys)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    if on_started is not None:
        on_started(server)
    server.run()

