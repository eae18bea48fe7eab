"""``python -m jaxkv.bench serve``: the engine serving a Poisson arrival
workload with shared prefixes under its two schedulers, in the same run:
packed steps (ONE jitted call per iteration over a flat stream of decode
tokens and prompt pieces, ``scheduler="packed"``, at token budgets 512, 256
and 128) against the padded scheduler (a ``[max_seqs, prefill_chunk]``
prefill call then a decode chunk per iteration), whose whole-prompt
configuration (prompts prefilled whole at admission) is the baseline; then
a hybrid family (a tiny Qwen3-Next: Gated DeltaNet and full attention) the
same way. The **mixed** row is the packed scheduler at budget 128 with a
quarter of the requests asking for the top 5 log-probabilities and a
quarter for penalties (:data:`MIXED_PENALTIES`) and a quarter constrained
to a JSON schema (:data:`MIXED_SCHEMA`, a token automaton on the device):
the cost of computing them in the same calls (its penalized and constrained
requests' tokens differ; the others' must not, and the constrained ones
must follow the automaton). The **grammar** table (:func:`grammar_rows`):
the same workload under the packed scheduler at budget 128, a quarter of
the requests following a context-free grammar (:data:`MIXED_GRAMMAR`,
arithmetic with nested parentheses, masked on the host by llguidance: one
token per call for such a row) against the same run without it: the
unconstrained requests' tokens/s (their tokens over the time until the last
of them finished) against the 0.9x target (reported, not an exit status),
their tokens the same, and the grammar rows' finished outputs parse
(``lark``, when installed).

The workload (``numpy.random.default_rng(0)``): a small random-weight Llama
(2 layers, hidden 128, the demo's model) on CPU; requests arrive at
scheduler steps drawn from a Poisson process (exponential gaps, mean 0.5
steps); each is one of four 64-token system prompts plus a 8..32-token
question, one in five with a 192..384-token document appended (the long
prompts that stall decoding when prefilled whole), and 16..32 new tokens,
sampled (temperature 0.7) with a seed per request, so every configuration
generates the same tokens.

Each configuration serves the whole workload on a fresh engine (same pool,
rows and chunk widths; a warm-up run per configuration compiles its
programs first). Reported per configuration: wall time, generated
tokens/s, time to first token and inter-token latency (mean, p50, p99, from
the engine's summary), calls per iteration (model calls per iteration that
ran the model: ``EngineStats.model_calls / model_iterations``), the padding
fraction (token slots those calls computed for padding / all they computed:
idle lanes and rows, bucket tails, rows finished inside a decode chunk),
prefix hit rate, and the ratios of TTFT p50 and throughput to the
whole-prompt scheduler. Figures are the median of the repeats
(interleaved, so a noisy spell hits every configuration alike); every
configuration must generate the same tokens (exit 1 otherwise).

``--disaggregated``: a prefill and a decode server process against one
server (:mod:`jaxkv.bench.disaggregated`; ``python -m jaxkv.bench`` routes
the flag there).

``--http`` (:func:`http_main`): the same kind of workload through
``python -m jaxkv.serve`` against the engine in this process, in the same
run. The model (the same tiny Llama) is saved to a temporary checkpoint
with a word-level tokenizer (one word per token, so a streamed chunk's text
counts its tokens); the server runs in a subprocess on 127.0.0.1 with a
fresh compilation cache (started twice in a full run: the ready times of a
cold and a warm start are reported). Requests (128; ``--quick`` 12) arrive
in wall time as a Poisson process (24 per second, ``--quick`` 40: more than
the server finishes, so throughput is the server's, not the arrivals'),
each one of four shared 64-token system prompts plus a question (one in
five with a document), 16..32 new tokens sampled at temperature 0.7 with a
seed per request (``ignore_eos``), and each is its own streaming client
(``httpx``, ``/v1/completions`` with token-id prompts, ``stream_options:
include_usage``). The in-process path adds each request to an
:class:`~jaxkv.serve.Engine` built with the server's options when its
arrival time has passed and steps the engine back to back, as the server's
engine loop does. Reported per path (median of 3 interleaved repeats;
``--quick`` 1): wall time (first arrival to last token), generated tokens/s,
time to first token (from the scheduled arrival) and inter-token latency
p50/p99 (a chunk's gap spread over its tokens), requests lost (an error, or
fewer tokens than asked: must be 0), and the HTTP / in-process throughput
ratio; the two paths must stream the same text (seeded requests). Exits 1
when a request is lost or the texts differ.

``--host-overhead`` (:func:`host_overhead_main`): the scheduler's host
cost per iteration. Each :meth:`~jaxkv.serve.Engine.step` is timed whole,
and every jitted call the caches make (the module-level jitted functions of
:mod:`jaxkv.serve.caches`, :mod:`~jaxkv.serve.paged_cache` and
:mod:`~jaxkv.serve.hybrid_cache`: the model steps and the bookkeeping
calls) is timed to ``block_until_ready`` while the bench runs
(:class:`DeviceTimer`); host time = step wall time - the time inside those
calls. Two phases per row count (``--rows``, default 16, 64 and 256;
``--quick`` 4 and 8), on a tiny random Llama (paged cache) and a tiny
Qwen3-Next (hybrid cache, Gated DeltaNet and full attention), each on a
fresh engine of ``max_seqs`` = rows after an untimed warm-up that compiles
its programs: **decode**, every row decoding (steady state: ``decode_chunk``
4 steps per iteration, nothing arriving, nothing finishing); **packed**,
rows - 2 requests decoding while two 24-token prompts arrive before every
iteration (each runs in the iteration's ONE packed step, gets its token and
finishes: the rows stay full, every iteration admits two and retires two);
**burst** (:func:`burst_run`), as many requests as rows, each with its own
64-token prompt, arriving at once on a fresh engine whose token budget
holds them all: the one step that admits them and prefills them, the
median of three fresh engines after one that compiles (admission's cost
against the batch: the in-batch prefix rule once compared every pair);
**queued** (:func:`queued_run`), every row decoding while 10,000 more
requests (``--quick``: 200) wait for one: its steps should cost what
decode's do, and each ``add_request`` (timed as they are added, median
reported apart) should not grow with the queue.
Reported per family, phase and row count: host ms per iteration (median
and p90 over ``--iterations``, default 30, ``--quick`` 4), device ms per
iteration (median), jitted calls per iteration, and the host median over
the smallest row count's (the issue's target: at most 4x from 16 to 256
rows, and at most 2 ms per iteration at 256). ``--profile``: cProfile of
the timed steps at the largest row count, the top host functions.
"""

from __future__ import annotations

import functools

import statistics

import numpy as np
from flax import nnx

from jaxkv.bench._timing import machine_description, print_json, print_table
from jaxkv.nn import LlamaConfig, LlamaForCausalLM, SamplingParams
from jaxkv.serve import Engine

__all__ = ["DeviceTimer", "ServerProcess", "host_overhead_main", "host_overhead_run", "http_main", "http_workload",
           "main", "parse_extra", "poisson_workload", "write_checkpoint"]

CONFIG = dict(model_type="llama", vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=10000.0,
              max_position_embeddings=2048, tie_word_embeddings=False)
ENGINE = dict(num_pages=384, page_size=16, max_seqs=8, max_blocks_per_seq=32, decode_chunk=4, prefill_chunk=256)


def poisson_workload(num_requests: int, rng, vocab: int = CONFIG["vocab_size"]) -> list[tuple[list, int, int]]:
    """``(prompt, max_new_tokens, arrival_step)`` per request (module docstring)."""
    systems = [rng.integers(3, vocab, 64).tolist() for _ in range(4)]
    arrival, out = 0.0, []
    for _ in range(num_requests):
        arrival += rng.exponential(0.5)
        prompt = systems[int(rng.integers(4))] + rng.integers(3, vocab, int(rng.integers(8, 33))).tolist()
        if rng.random() < 0.2:
            prompt += rng.integers(3, vocab, int(rng.integers(192, 385))).tolist()
        out.append((prompt, int(rng.integers(16, 33)), int(arrival)))
    return out


#: The mixed configuration's extras: request ``i`` with ``i % 4 == 1`` asks for the top 5 log-probabilities,
#: ``i % 4 == 2`` for penalties, ``i % 4 == 3`` follows :data:`MIXED_SCHEMA` (the tokens of the last two differ
#: from the plain run's; the others' must not).
MIXED_LOGPROBS = 5
MIXED_PENALTIES = dict(presence=0.5, frequency=0.5, repetition=1.1, logit_bias={7: -5.0})
MIXED_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3}},
    "required": ["name", "age", "tags"]}
#: The stop id of the constrained requests (ends their JSON; the bench's requests otherwise never stop early).
MIXED_STOP = 2


@functools.lru_cache(maxsize=2)
def mixed_constraint(vocab: int):
    """:data:`MIXED_SCHEMA` as a token automaton over a synthetic spelling of
    the bench model's vocabulary (it has no tokenizer): ids 3..258 the 256
    bytes, the rest 2- to 4-byte strings of JSON's characters drawn from
    ``default_rng(7)``; id :data:`MIXED_STOP` ends it."""
    from jaxkv.serve.structured import compile_regex, schema_regex

    return compile_regex(schema_regex(MIXED_SCHEMA), _spellings(vocab), [MIXED_STOP], vocab,
                         key="bench mixed schema")


#: The grammar table's constraint: arithmetic, parentheses nested without bound (no token automaton holds it).
MIXED_GRAMMAR = ('start: expr\nexpr: term (("+" | "-") term)*\nterm: atom (("*" | "/") atom)*\n'
                 'atom: /[0-9]{1,3}/ | "(" expr ")"\n')


def _spellings(vocab: int) -> dict:
    """:func:`mixed_constraint`'s synthetic spelling of the bench model's
    vocabulary (ids 3..258 the 256 bytes, the rest 2- to 4-byte strings of
    JSON's characters from ``default_rng(7)``)."""
    rng = np.random.default_rng(7)
    alphabet = np.frombuffer(b'{}[]:," abcdefghijklmnopqrstuvwxyz0123456789-.', np.uint8)
    spellings = {3 + b: bytes([b]) for b in range(min(256, vocab - 3))}
    for i in range(259, vocab):
        spellings[i] = bytes(rng.choice(alphabet, int(rng.integers(2, 5))).tolist())
    return spellings


def grammar_rows(model, workload, repeats: int) -> tuple[list, bool]:
    """The grammar table (module docstring): ``(rows for JSON, the checks
    held)``. Each run steps the engine itself, timing when each request
    finishes."""
    import time

    from jaxkv.serve.grammar import compile_grammar

    vocab = model.config.vocab_size
    spellings = _spellings(vocab)
    grammar = compile_grammar(spellings, vocab, MIXED_GRAMMAR, stop_ids=[MIXED_STOP])
    sampling = SamplingParams(temperature=0.7)
    plain = [i for i in range(len(workload)) if i % 4 != 3]

    def run(with_grammar: bool):
        engine = Engine(model, **ENGINE, max_num_batched_tokens=128, scheduler="packed")
        ids = [engine.add_request(p, n, arrival_step=a, sampling=sampling, seed=i,
                                  constraint=grammar if with_grammar and i % 4 == 3 else None)
               for i, (p, n, a) in enumerate(workload)]
        done, start = {}, time.perf_counter()
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = time.perf_counter()
        outputs = [engine.outputs[i] for i in ids]
        plain_tokens = sum(len(outputs[i]) for i in plain)
        return plain_tokens / (max(done[ids[i]] for i in plain) - start), outputs

    run(False), run(True)  # compile every program first
    runs = {False: [], True: []}
    for _ in range(repeats):
        for with_grammar in (False, True):
            runs[with_grammar].append(run(with_grammar))
    base, mixed = (statistics.median(tps for tps, _ in runs[g]) for g in (False, True))
    same = [runs[True][0][1][i] for i in plain] == [runs[False][0][1][i] for i in plain]
    parsed, total = _grammar_outputs_parse([runs[True][0][1][i] for i in range(len(workload)) if i % 4 == 3],
                                           spellings)
    ok = same and parsed in (None, total)  # the 0.9x target is reported, not a failure (timings are noisy)
    print_table(f"grammar rows beside plain ones ({len(workload)} requests, a quarter following an arithmetic "
                f"grammar on the host; packed, budget 128; median of {repeats})",
                ["run", "unconstrained requests' tokens/s", "ratio"],
                [["plain", f"{base:.0f}", "1.00"], ["a quarter with a grammar", f"{mixed:.0f}", f"{mixed / base:.2f}"]])
    print(f"\nUnconstrained tokens the same: {same}; finished grammar outputs parsed by lark: {parsed}/{total} "
          f"(None: lark not installed); the 0.9x target {'met' if mixed >= 0.9 * base else 'MISSED'}\n")
    return [{"run": "grammar", "plain_tokens_per_s": base, "mixed_tokens_per_s": mixed, "ratio": mixed / base,
             "same_tokens": same, "parsed": parsed, "grammar_outputs": total}], ok


def _grammar_outputs_parse(outputs: list, spellings: dict) -> tuple[int | None, int]:
    """``(parsed, finished)``: of the grammar outputs that finished their
    expression (a stop id follows it: the rows run on to their length),
    how many ``lark`` parses as :data:`MIXED_GRAMMAR` (None without lark);
    one cut at its length before the expression closed is not counted."""
    finished = [tokens[: tokens.index(MIXED_STOP)] for tokens in outputs if MIXED_STOP in tokens]
    try:
        import lark
    except ImportError:
        return None, len(finished)
    parser = lark.Lark(MIXED_GRAMMAR, start="start")
    parsed = 0
    for tokens in finished:
        try:
            parser.parse(b"".join(spellings[t] for t in tokens).decode("latin-1"))
            parsed += 1
        except lark.exceptions.LarkError:
            pass
    return parsed, len(finished)


def _serve(model, workload, scheduler: str, budget, engine_args: dict, mixed: bool = False):
    """The workload on a fresh engine: ``(summary, stats, outputs)``; with
    ``mixed`` a quarter of the requests ask for log-probabilities and a
    quarter for penalties (:data:`MIXED_PENALTIES`)."""
    engine = Engine(model, **engine_args, max_num_batched_tokens=budget, scheduler=scheduler)
    sampling = SamplingParams(temperature=0.7)
    constraint = mixed_constraint(model.config.vocab_size) if mixed else None
    # A constrained request that completes its JSON emits only the stop id: not a stop for it here, so that it
    # runs its full length as the plain run's request does (the same token count, the same schedule).
    ids = [engine.add_request(p, n, arrival_step=a, sampling=sampling, seed=i,
                              logprobs=MIXED_LOGPROBS if mixed and i % 4 == 1 else None,
                              penalties=MIXED_PENALTIES if mixed and i % 4 == 2 else None,
                              constraint=constraint if mixed and i % 4 == 3 else None)
           for i, (p, n, a) in enumerate(workload)]
    summary = engine.run()
    return summary, engine.stats(), [engine.outputs[i] for i in ids]


BASELINE = "padded, whole prompts"
MIXED = "packed, budget 128, mixed"
#: name -> (scheduler, max_num_batched_tokens, mixed: a quarter with logprobs, a quarter with penalties)
PAGED_CONFIGS = {BASELINE: ("padded", None, False), "padded, budget 128": ("padded", 128, False),
                 "packed, budget 512": ("packed", 512, False), "packed, budget 256": ("packed", 256, False),
                 "packed, budget 128": ("packed", 128, False), MIXED: ("packed", 128, True)}
QUICK_CONFIGS = (BASELINE, "packed, budget 128")  # CI's smoke run: the two ends
HYBRID_CONFIGS = (BASELINE, "padded, budget 128", "packed, budget 128")
HYBRID_ENGINE = dict(max_model_len=512, max_seqs=8, decode_chunk=4, prefill_chunk=256)


def _follows_schema(tokens: list, vocab: int) -> bool:
    """Whether a constrained request's tokens spell a document of
    :data:`MIXED_SCHEMA` (up to its first stop id; cut by its length, a
    prefix of one) in :func:`mixed_constraint`'s spelling."""
    automaton = mixed_constraint(vocab)
    return automaton.walk(automaton.initial, tokens) >= 0


def _table(title: str, family: str, model, workload, names, engine_args: dict, repeats: int, warm: bool):
    """Serve ``workload`` under each configuration ``names`` (median of
    ``repeats`` interleaved runs); print the table, return (rows for JSON,
    same tokens everywhere)."""
    configs = {name: PAGED_CONFIGS[name] for name in names}
    if warm:  # compile every program once first (the configurations of one scheduler share them)
        for scheduler, budget, mixed in {v for v in configs.values()}:
            _serve(model, workload[:6], scheduler, budget, engine_args, mixed)
    runs: dict[str, list] = {name: [] for name in configs}
    outputs = {}
    for _ in range(repeats):
        for name, (scheduler, budget, mixed) in configs.items():
            summary, stats, outputs[name] = _serve(model, workload, scheduler, budget, engine_args, mixed)
            runs[name].append((summary, stats))
    # Every request's tokens are the same everywhere, but a mixed run's penalized and constrained ones (logprobs
    # change none); a constrained one's output follows its schema.
    same = all([o for i, o in enumerate(out) if not (configs[name][2] and i % 4 in (2, 3))]
               == [o for i, o in enumerate(outputs[BASELINE]) if not (configs[name][2] and i % 4 in (2, 3))]
               for name, out in outputs.items())
    if MIXED in outputs:
        same = same and all(_follows_schema(o, model.config.vocab_size) for i, o in enumerate(outputs[MIXED])
                            if i % 4 == 3)

    def med(name, f):
        return statistics.median(f(summary, stats) for summary, stats in runs[name])

    base_tps = med(BASELINE, lambda s, _: s.tokens_per_second)
    base_ttft = med(BASELINE, lambda s, _: s.ttft[1])
    rows, payload = [], []
    for name in configs:
        ttft = tuple(med(name, lambda s, _, i=i: s.ttft[i]) for i in range(3))
        itl = tuple(med(name, lambda s, _, i=i: s.itl[i]) for i in range(3))
        tps = med(name, lambda s, _: s.tokens_per_second)
        wall = med(name, lambda s, _: s.wall_seconds)
        stats = runs[name][-1][1]  # counts are the same every run (same schedule)
        busy = stats.model_iterations
        calls = stats.model_calls / busy if busy else 0.0
        padding = stats.padding_slots / stats.token_slots if stats.token_slots else 0.0
        hit = runs[name][-1][0].prefix_hit_rate
        rows.append([name, f"{wall:.2f}", f"{tps:.0f}", "/".join(f"{1e3 * x:.0f}" for x in ttft),
                     "/".join(f"{1e3 * x:.1f}" for x in itl), f"{calls:.2f}", f"{padding:.1%}", f"{hit:.0%}",
                     f"{ttft[1] / base_ttft:.2f}", f"{tps / base_tps:.2f}"])
        scheduler, budget, mixed = configs[name]
        payload.append({"family": family, "scheduler": name, "engine_scheduler": scheduler, "mixed": mixed,
                        "max_num_batched_tokens": budget, "wall_seconds": wall, "tokens_per_s": tps,
                        "ttft_ms": {"mean": 1e3 * ttft[0], "p50": 1e3 * ttft[1], "p99": 1e3 * ttft[2]},
                        "itl_ms": {"mean": 1e3 * itl[0], "p50": 1e3 * itl[1], "p99": 1e3 * itl[2]},
                        "calls_per_iteration": calls, "padding_fraction": padding, "model_calls": stats.model_calls,
                        "iterations_with_model_calls": busy, "prefix_hit_rate": hit,
                        "ttft_p50_ratio": ttft[1] / base_ttft, "throughput_ratio": tps / base_tps})
    print_table(title, ["scheduler", "wall s", "tokens/s", "TTFT ms mean/p50/p99", "ITL ms mean/p50/p99",
                        "calls/iter", "padding", "prefix hits", "TTFT p50 / whole", "tokens/s / whole"], rows)
    print(f"\nSame tokens under every scheduler (seeded requests): {same}\n")
    return payload, same


def main(args) -> int:
    if getattr(args, "http", False):
        return http_main(args)
    if getattr(args, "host_overhead", False):
        return host_overhead_main(args)
    from jaxkv.bench.prefix_families import family_models

    num_requests = 8 if args.quick else 64
    repeats = 1 if args.quick else 3
    workload = poisson_workload(num_requests, np.random.default_rng(0))
    model = LlamaForCausalLM(LlamaConfig.from_hf(CONFIG), rngs=nnx.Rngs(0))
    names = QUICK_CONFIGS if args.quick else tuple(PAGED_CONFIGS)
    machine = machine_description()
    payload, same = _table(f"serving {num_requests} Poisson-arriving requests with shared prefixes, tiny Llama "
                           f"(median of {repeats}) on {machine}", "llama", model, workload, names, ENGINE, repeats,
                           warm=not args.quick)
    grammar, grammar_ok = grammar_rows(model, workload, repeats)
    qwen = family_models()["qwen3-next (GDN snapshots)"]
    hybrid_requests = 6 if args.quick else 32
    hybrid_workload = poisson_workload(hybrid_requests, np.random.default_rng(1), vocab=qwen.config.vocab_size)
    hybrid, hybrid_same = _table(f"the same kind of workload ({hybrid_requests} requests), tiny Qwen3-Next (hybrid "
                                 f"cache: Gated DeltaNet + full attention; median of {repeats})", "qwen3_next", qwen,
                                 hybrid_workload, QUICK_CONFIGS if args.quick else HYBRID_CONFIGS, HYBRID_ENGINE,
                                 repeats, warm=not args.quick)
    if args.json:
        print_json({"benchmark": "serve", "machine": machine, "same_tokens": same and hybrid_same,
                    "results": payload + hybrid, "grammar": grammar})
    return 0 if same and hybrid_same and grammar_ok else 1


# ------------------------------------------------------------------ --http

HTTP_ENGINE = dict(max_model_len=512, max_seqs=8, decode_chunk=4, prefill_chunk=256)
HTTP_TIME_LIMIT = 600.0  # seconds one HTTP run may take


def write_checkpoint(path: str) -> str:
    """The bench's tiny random Llama (``CONFIG``) saved to ``path`` with a
    word-level tokenizer of its vocabulary (token ``i`` is the word ``w{i}``,
    decoded with spaces between words: the streamed text counts its tokens)."""
    import json
    import os

    from tokenizers import Tokenizer, models, pre_tokenizers

    os.makedirs(path, exist_ok=True)
    vocab = {f"w{i}": i for i in range(CONFIG["vocab_size"])}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"unk_token": "w0"}, f)
    LlamaForCausalLM(LlamaConfig.from_hf(CONFIG), rngs=nnx.Rngs(0)).save_pretrained(path)
    return path


def http_workload(num_requests: int, rate: float, rng) -> list[dict]:
    """Per request: ``prompt`` (token ids: one of four shared 64-token system
    prompts, an 8..32-token question, one in five with a 192..384-token
    document), ``max_tokens`` (16..32), ``arrival`` (seconds from the start:
    Poisson, ``rate`` requests per second) and ``seed``."""
    vocab = CONFIG["vocab_size"]
    systems = [rng.integers(3, vocab, 64).tolist() for _ in range(4)]
    arrival, out = 0.0, []
    for i in range(num_requests):
        prompt = systems[int(rng.integers(4))] + rng.integers(3, vocab, int(rng.integers(8, 33))).tolist()
        if rng.random() < 0.2:
            prompt += rng.integers(3, vocab, int(rng.integers(192, 385))).tolist()
        out.append({"prompt": prompt, "max_tokens": int(rng.integers(16, 33)), "arrival": arrival, "seed": i})
        arrival += float(rng.exponential(1.0 / rate))
    return out


def _percentiles(values: list) -> tuple[float, float]:
    if not values:
        return (0.0, 0.0)
    arr = np.asarray(values, np.float64)
    return float(np.percentile(arr, 50)), float(np.percentile(arr, 99))


def _summarize(workload, results: dict, start: float, end: float) -> dict:
    """``results[i] = {"text", "tokens", "first", "gaps"}`` (absolute
    perf_counter times for ``first``) into the table's figures."""
    ttft = [results[i]["first"] - (start + w["arrival"]) for i, w in enumerate(workload)
            if i in results and results[i]["first"] is not None]
    itl = [gap for r in results.values() for gap in r["gaps"]]
    tokens = sum(r["tokens"] for r in results.values())
    lost = sum(1 for i, w in enumerate(workload) if i not in results or results[i]["tokens"] != w["max_tokens"]
               or results[i].get("error"))
    wall = end - start
    return {"wall_seconds": wall, "tokens": tokens, "tokens_per_second": tokens / wall if wall > 0 else 0.0,
            "ttft_p50_p99_s": _percentiles(ttft), "itl_p50_p99_s": _percentiles(itl), "requests_lost": lost}


def _run_in_process(engine, workload) -> tuple[dict, dict]:
    """The workload on ``engine`` in this process: requests added when their
    arrival time has passed, ``step`` back to back while there is work (the
    server's engine loop, without HTTP)."""
    import time

    sampling = SamplingParams(temperature=0.7)
    order = sorted(range(len(workload)), key=lambda i: workload[i]["arrival"])
    results: dict = {}
    owner: dict = {}
    start = time.perf_counter()
    end = start
    nxt = 0
    while nxt < len(order) or engine.has_unfinished():
        now = time.perf_counter() - start
        while nxt < len(order) and workload[order[nxt]]["arrival"] <= now:
            i = order[nxt]
            w = workload[i]
            owner[engine.add_request(w["prompt"], w["max_tokens"], sampling=sampling, seed=w["seed"])] = i
            results[i] = {"text": [], "tokens": 0, "first": None, "last": None, "gaps": []}
            nxt += 1
        if not engine.has_unfinished():
            time.sleep(max(workload[order[nxt]]["arrival"] - (time.perf_counter() - start), 0.0))
            continue
        outputs = engine.step()
        t = time.perf_counter()
        for out in outputs:
            r = results[owner[out.request_id]]
            if out.new_token_ids:
                record_arrival(r, len(out.new_token_ids), t, out.new_text)
            if out.finished:
                engine.forget(out.request_id)
                end = t
    for r in results.values():
        r["text"] = "".join(r["text"])
    return _summarize(workload, results, start, end), results


def record_arrival(r: dict, count: int, t: float, text: str | None = None) -> None:
    """``count`` tokens (``text``, kept when given) of one request arrived
    at ``t`` (``r``: its ``tokens``, ``first``, ``last``, ``gaps``): the
    first one sets its first-token time, the rest share the gap since the
    last arrival evenly (one chunk or SSE event may carry several)."""
    if text is not None:
        r["text"].append(text)
    r["tokens"] += count
    if r["first"] is None:
        r["first"] = r["last"] = t
        count -= 1
    if count:
        r["gaps"] += [(t - r["last"]) / count] * count
        r["last"] = t


async def _run_http_async(url: str, model: str, workload) -> tuple[dict, dict]:
    import asyncio
    import json
    import time

    import httpx

    results: dict = {}

    async def one(client, i, start):
        w = workload[i]
        await asyncio.sleep(max(start + w["arrival"] - time.perf_counter(), 0.0))
        r = {"text": [], "tokens": 0, "first": None, "last": None, "gaps": [], "usage": None, "error": None,
             "end": None}
        results[i] = r
        body = {"model": model, "prompt": w["prompt"], "max_tokens": w["max_tokens"], "temperature": 0.7,
                "seed": w["seed"], "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
        try:
            async with client.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    r["error"] = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                    return
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    t = time.perf_counter()
                    if chunk.get("usage"):
                        r["usage"] = chunk["usage"]
                    for choice in chunk.get("choices") or ():
                        text = choice.get("text") or ""
                        count = len(text.split())  # one word per token (write_checkpoint's tokenizer)
                        if count:
                            record_arrival(r, count, t, text)
            r["end"] = time.perf_counter()
            if r["usage"] is None or r["usage"]["completion_tokens"] != r["tokens"]:
                r["error"] = f"usage {r['usage']} disagrees with the {r['tokens']} streamed tokens"
        except (httpx.HTTPError, ValueError) as err:
            r["error"] = f"{type(err).__name__}: {err}"

    limits = httpx.Limits(max_connections=len(workload) + 8, max_keepalive_connections=len(workload) + 8)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(300.0), limits=limits) as client:
        start = time.perf_counter()
        try:  # bounded: a request still streaming after the limit counts as lost
            await asyncio.wait_for(asyncio.gather(*(one(client, i, start) for i in range(len(workload)))),
                                   timeout=HTTP_TIME_LIMIT)
        except asyncio.TimeoutError:
            print(f"HTTP run stopped after {HTTP_TIME_LIMIT} s")
    end = max((r["end"] for r in results.values() if r["end"] is not None), default=start)
    for r in results.values():
        r["text"] = "".join(r["text"])
    return _summarize(workload, results, start, end), results


class ServerProcess:
    """``python -m jaxkv.serve`` on 127.0.0.1 in a subprocess, with the
    engine ``options`` (default :data:`HTTP_ENGINE`) as its flags."""

    def __init__(self, checkpoint: str, cache_dir: str, log_path: str, options: dict | None = None):
        import os
        import socket
        import subprocess
        import sys
        import time

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.log = open(log_path, "w")
        args = [sys.executable, "-m", "jaxkv.serve", "--model", checkpoint, "--served-model-name", "bench", "--host",
                "127.0.0.1", "--port", str(self.port), "--compile-cache-dir", cache_dir, "--log-level", "warning"]
        for name, value in (HTTP_ENGINE if options is None else options).items():
            args += ["--" + {"max_seqs": "max-num-seqs"}.get(name, name.replace("_", "-")), str(value)]
        self.started = time.perf_counter()
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def wait_ready(self, timeout: float = 600.0) -> float:
        import time

        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}: {self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.perf_counter() - self.started
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"the server was not ready after {timeout} s: {self.tail()}")

    def tail(self) -> str:
        self.log.flush()
        with open(self.log_path) as f:
            return f.read()[-3000:]

    def stop(self) -> None:
        import subprocess

        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.log.close()


def http_main(args) -> int:
    """``python -m jaxkv.bench serve --http`` (see the module docstring)."""
    import asyncio
    import os
    import tempfile

    from jaxkv.serve.http import warm_up
    from jaxkv.text import Tokenizer

    num_requests, rate, repeats = (12, 40.0, 1) if args.quick else (128, 24.0, 3)
    workload = http_workload(num_requests, rate, np.random.default_rng(0))
    with tempfile.TemporaryDirectory(prefix="jaxkv-bench-http-") as tmp:
        checkpoint = write_checkpoint(os.path.join(tmp, "ckpt"))
        cache = os.path.join(tmp, "jax-cache")
        starts = []
        server = None
        try:
            for attempt in range(1 if args.quick else 2):  # a cold start, then (full run) a warm one that serves
                if server is not None:
                    server.stop()
                server = ServerProcess(checkpoint, cache, os.path.join(tmp, f"server{attempt}.log"))
                starts.append(server.wait_ready())
            model = LlamaForCausalLM.from_pretrained(checkpoint)
            engine = Engine(model, tokenizer=Tokenizer.from_pretrained(checkpoint), **HTTP_ENGINE)
            warm_up(engine)
            runs: dict = {"in-process engine": [], "HTTP (jaxkv.serve)": []}
            texts: dict = {}
            for _ in range(repeats):  # interleaved: a noisy spell hits both alike
                summary, results = _run_in_process(engine, workload)
                runs["in-process engine"].append(summary)
                texts["in-process engine"] = {i: r["text"] for i, r in results.items()}
                summary, results = asyncio.run(_run_http_async(server.url, "bench", workload))
                runs["HTTP (jaxkv.serve)"].append(summary)
                texts["HTTP (jaxkv.serve)"] = {i: r["text"] for i, r in results.items()}
                errors = [r["error"] for r in results.values() if r["error"]]
                if errors:
                    print(f"HTTP errors ({len(errors)}): {errors[:3]}")
        finally:
            if server is not None:
                server.stop()
    same = texts["in-process engine"] == texts["HTTP (jaxkv.serve)"]
    figures = {}
    for name, summaries in runs.items():
        def med(key, k=None):
            return statistics.median(s[key] if k is None else s[key][k] for s in summaries)

        figures[name] = {"tokens_per_second": med("tokens_per_second"), "wall_seconds": med("wall_seconds"),
                         "ttft_p50_p99_s": (med("ttft_p50_p99_s", 0), med("ttft_p50_p99_s", 1)),
                         "itl_p50_p99_s": (med("itl_p50_p99_s", 0), med("itl_p50_p99_s", 1)),
                         "requests_lost": max(s["requests_lost"] for s in summaries),
                         "tokens": summaries[-1]["tokens"]}
    base = figures["in-process engine"]["tokens_per_second"]
    rows, payload = [], []
    for name, f in figures.items():
        ratio = f["tokens_per_second"] / base if base else 0.0
        rows.append([name, f"{f['wall_seconds']:.2f}", f"{f['tokens_per_second']:.0f}",
                     "/".join(f"{1e3 * x:.0f}" for x in f["ttft_p50_p99_s"]),
                     "/".join(f"{1e3 * x:.1f}" for x in f["itl_p50_p99_s"]), f["requests_lost"], f"{ratio:.2f}"])
        payload.append({"path": name, **f, "throughput_ratio": ratio})
    print_table(f"{num_requests} streaming clients, Poisson arrivals at {rate:g}/s, four shared system prompts, "
                f"tiny Llama over loopback (median of {repeats}) on {machine_description()}",
                ["path", "wall s", "tokens/s", "TTFT ms p50/p99", "ITL ms p50/p99", "requests lost",
                 "tokens/s / in-process"], rows)
    http_ratio = figures["HTTP (jaxkv.serve)"]["tokens_per_second"] / base if base else 0.0
    print(f"\nServer ready after {starts[0]:.1f} s (cold compilation cache)"
          + (f", {starts[1]:.1f} s (second start, warm cache)" if len(starts) > 1 else "")
          + f"; same text on both paths (seeded requests): {same}; HTTP / in-process tokens/s {http_ratio:.2f}")
    lost = sum(f["requests_lost"] for f in figures.values())
    if args.json:
        print_json({"benchmark": "serve", "mode": "http", "machine": machine_description(), "requests": num_requests,
                    "rate_per_second": rate, "same_text": same, "requests_lost": lost,
                    "ready_seconds_cold": starts[0], "ready_seconds_warm": starts[1] if len(starts) > 1 else None,
                    "http_to_in_process_throughput": http_ratio, "results": payload})
    return 0 if same and lost == 0 else 1


# ------------------------------------------------------------------ --host-overhead

#: The modules whose module-level jitted functions :class:`DeviceTimer` times.
DEVICE_MODULES = ("jaxkv.serve.caches", "jaxkv.serve.paged_cache", "jaxkv.serve.hybrid_cache")
HOST_ROWS = (16, 64, 256)
HOST_ROWS_QUICK = (4, 8)
HOST_ARRIVALS = 2  # prompts arriving before every packed-phase iteration
HOST_PROMPT = 24  # tokens per prompt
HOST_CHUNK = 4  # decode_chunk
HOST_WARMUP = 3  # untimed iterations after the programs compiled
HOST_MAX_ITERATIONS = 1000  # the most timed iterations a phase may ask for
BURST_PROMPT = 64  # tokens per prompt of the burst phase: longer than the in-batch prefix rule's head
BURST_REPEATS = 3  # timed bursts per row count (each on a fresh engine)
QUEUED = 10_000  # requests waiting in the queued phase (--quick: QUEUED_QUICK)
QUEUED_QUICK = 200


class DeviceTimer:
    """While entered: every module-level jitted function of
    :data:`DEVICE_MODULES` is replaced by a wrapper that waits for its
    results (``block_until_ready``) and adds its wall time to ``seconds``
    and its name to ``calls``; restored on exit. The engine's calls go
    through the modules' globals, so they are timed without a change to
    the engine (its results are the same: only when the host waits moves)."""

    def __init__(self):
        self.seconds = 0.0  # wall time inside the calls
        self.cpu_seconds = 0.0  # this thread's CPU time inside them (time.thread_time)
        self.calls: list[str] = []
        self._saved: list = []

    @staticmethod
    def jitted(obj) -> bool:
        return callable(obj) and hasattr(obj, "lower") and hasattr(obj, "trace")

    def reset(self) -> None:
        self.seconds, self.cpu_seconds, self.calls = 0.0, 0.0, []

    def __enter__(self) -> "DeviceTimer":
        import importlib
        import time

        import jax

        for name in DEVICE_MODULES:
            module = importlib.import_module(name)
            for attr, fn in list(vars(module).items()):
                if not self.jitted(fn):
                    continue

                def timed(*args, _fn=fn, _attr=attr, **kwargs):
                    start, cpu = time.perf_counter(), time.thread_time()
                    try:
                        return jax.block_until_ready(_fn(*args, **kwargs))
                    finally:
                        self.seconds += time.perf_counter() - start
                        self.cpu_seconds += time.thread_time() - cpu
                        self.calls.append(_attr)

                self._saved.append((module, attr, fn))
                setattr(module, attr, timed)
        return self

    def __exit__(self, *exc) -> None:
        for module, attr, fn in reversed(self._saved):
            setattr(module, attr, fn)
        self._saved = []


def _host_models(names=None) -> dict:
    """The bench's families (``names``: the first words of those wanted;
    None: all): ``name -> (model builder, engine options for a row
    count and the tokens a request holds)``. The models are :func:`jaxkv.bench.prefix_families.family_models`'
    tiny Llama and Qwen3-Next, built alone."""
    from jaxkv.nn import LlamaConfig, LlamaForCausalLM, Qwen3NextForCausalLM
    from jaxkv.nn.qwen3_next_config import Qwen3NextConfig

    def llama():
        return LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                                            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                            head_dim=32), rngs=nnx.Rngs(0))

    def qwen():
        return Qwen3NextForCausalLM(Qwen3NextConfig.from_hf(dict(
            model_type="qwen3_next", vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=32, linear_key_head_dim=16,
            linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
            layer_types=["linear_attention", "full_attention"])), rngs=nnx.Rngs(0))

    def paged(rows: int, context: int) -> dict:
        pages = -(-context // 16)
        return dict(num_pages=rows * (pages + 1) + 16, page_size=16, max_blocks_per_seq=pages, max_seqs=rows,
                    decode_chunk=HOST_CHUNK, max_num_batched_tokens=rows * HOST_PROMPT)

    def hybrid(rows: int, context: int) -> dict:
        return dict(max_model_len=context, max_seqs=rows, decode_chunk=HOST_CHUNK,
                    max_num_batched_tokens=rows * HOST_PROMPT)

    families = {"llama (paged)": (llama, paged), "qwen3-next (hybrid)": (qwen, hybrid)}
    return {name: f for name, f in families.items() if names is None or name.split(" ")[0] in names}


def _time_steps(engine, timer: DeviceTimer, iterations: int, before_step, profile=None) -> dict:
    """``iterations`` timed ``engine.step()`` calls (``before_step()`` runs
    untimed before each): per iteration host seconds (wall - device), host
    CPU seconds (the thread's CPU time, less its CPU time inside the
    calls: what other processes on a shared machine do not inflate),
    device seconds, jitted calls and whether it ran a packed step."""
    import time

    host, host_cpu, device, calls, packed = [], [], [], [], []
    for _ in range(iterations):
        before_step()
        timer.reset()
        if profile is not None:
            profile.enable()
        start, cpu = time.perf_counter(), time.thread_time()
        engine.step()
        wall, cpu = time.perf_counter() - start, time.thread_time() - cpu
        if profile is not None:
            profile.disable()
        host.append(wall - timer.seconds)
        host_cpu.append(cpu - timer.cpu_seconds)
        device.append(timer.seconds)
        calls.append(len(timer.calls))
        packed.append(any(name.endswith("_packed") for name in timer.calls))
    return {"host": host, "host_cpu": host_cpu, "device": device, "calls": calls, "packed": packed}


def host_overhead_run(model, options, rows: int, iterations: int, rng, timer: DeviceTimer,
                      profile=None) -> dict:
    """Both phases (module docstring) at ``rows`` rows on one fresh engine:
    ``{"decode": figures, "packed": figures}`` (:func:`_time_steps`'s, plus
    the rows each timed step runs; the packed phase's only from the
    iterations that ran a packed step). Every row is admitted and prefilled
    in one packed step (the token budget holds every prompt), the decode
    phase timed, then two decoders are aborted and the packed phase timed:
    one engine compiles each program once."""
    vocab = model.config.vocab_size
    new = 2 * (HOST_WARMUP + iterations) * HOST_CHUNK + 8  # never finishes while timed
    engine = Engine(model, **options(rows, HOST_PROMPT + new))
    decoders = [engine.add_request(rng.integers(3, vocab, HOST_PROMPT).tolist(), new) for _ in range(rows)]
    while engine._prefilling or engine._waiting:  # admit and prefill them all
        engine.step()
    out = {}
    for phase in ("decode", "packed"):
        running = []

        def before_step(phase=phase, running=running):
            held = sum(rid is not None for rid in engine._rows)
            if phase == "packed":  # prompts arrive as rows free up, at most HOST_ARRIVALS per iteration
                for _ in range(min(HOST_ARRIVALS, rows - held - len(engine._waiting))):
                    engine.add_request(rng.integers(3, vocab, HOST_PROMPT).tolist(), 1)
            running.append(min(rows, held + len(engine._waiting)))  # the rows this step runs

        if phase == "packed":
            for rid in decoders[-HOST_ARRIVALS:]:
                engine.abort(rid)
        _time_steps(engine, timer, HOST_WARMUP, before_step)  # compiles what the phase runs first
        running.clear()
        figures = _time_steps(engine, timer, iterations, before_step, profile)
        figures["running"] = running
        if phase == "packed":  # only the iterations that ran the packed step
            keep = [i for i, packed in enumerate(figures["packed"]) if packed]
            figures = {k: [v[i] for i in keep] for k, v in figures.items()}
        out[phase] = figures
    return out


def burst_run(model, options, rows: int, rng, timer: DeviceTimer, repeats: int = BURST_REPEATS) -> dict:
    """The burst phase (module docstring): ``rows`` requests of
    :data:`BURST_PROMPT` distinct tokens arrive at once on a fresh engine
    whose token budget holds them all; the first step (their admission
    and the packed step that prefills them) is timed, ``repeats`` times
    after an untimed one that compiles. Figures as :func:`_time_steps`',
    one entry per burst."""
    import gc

    vocab = model.config.vocab_size
    figures = {"host": [], "host_cpu": [], "device": [], "calls": [], "packed": [], "running": []}
    for repeat in range(repeats + 1):
        engine = Engine(model, **dict(options(rows, BURST_PROMPT + 8), max_num_batched_tokens=rows * BURST_PROMPT))
        for _ in range(rows):
            engine.add_request(rng.integers(3, vocab, BURST_PROMPT).tolist(), 2)
        # Untimed before the step: the engines before this one are garbage, their collection is not its cost.
        got = _time_steps(engine, timer, 1, gc.collect)
        if repeat:
            for name, values in got.items():
                figures[name] += values
            figures["running"].append(sum(rid is not None for rid in engine._rows))
    return figures


def queued_run(model, options, rows: int, iterations: int, queued: int, rng, timer: DeviceTimer) -> dict:
    """The queued phase (module docstring): ``rows`` requests decoding
    while ``queued`` more wait for a row (added after the rows filled, each
    ``add_request`` timed). Figures as :func:`_time_steps`' over
    ``iterations`` decode iterations, plus ``add_us``: the median
    microseconds of one ``add_request``."""
    import time

    vocab = model.config.vocab_size
    new = (HOST_WARMUP + iterations) * HOST_CHUNK + 8  # the rows never finish while timed
    engine = Engine(model, **options(rows, HOST_PROMPT + new))
    for _ in range(rows):
        engine.add_request(rng.integers(3, vocab, HOST_PROMPT).tolist(), new)
    while engine._prefilling or engine._waiting:
        engine.step()
    prompts = rng.integers(3, vocab, (queued, HOST_PROMPT)).tolist()
    adds = []
    for prompt in prompts:
        start = time.perf_counter()
        engine.add_request(prompt, 1)
        adds.append(time.perf_counter() - start)
    _time_steps(engine, timer, HOST_WARMUP, lambda: None)
    figures = _time_steps(engine, timer, iterations, lambda: None)
    figures["running"] = [rows] * iterations
    figures["add_us"] = float(np.median(adds)) * 1e6
    return figures


def parse_extra(args, rest: list[str]):
    """``--host-overhead`` and its options (``python -m jaxkv.bench``'s hook)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m jaxkv.bench serve")
    p.add_argument("--host-overhead", action="store_true", help="the scheduler's host ms per iteration "
                   "(jaxkv.bench.serve.host_overhead_main)")
    p.add_argument("--rows", help="--host-overhead: comma list of row counts (default 16,64,256; --quick 4,8)")
    p.add_argument("--iterations", type=int, help="--host-overhead: timed iterations per phase (default 30)")
    p.add_argument("--families", help="--host-overhead: comma list of llama,qwen3-next (default both)")
    p.add_argument("--profile", action="store_true", help="--host-overhead: cProfile the largest row count")
    for name, value in vars(p.parse_args(rest)).items():
        setattr(args, name, value)
    return args


def host_overhead_main(args) -> int:
    """``python -m jaxkv.bench serve --host-overhead`` (module docstring)."""
    profiles: dict = {}
    rows_list = (tuple(int(r) for r in args.rows.split(",")) if getattr(args, "rows", None)
                 else HOST_ROWS_QUICK if args.quick else HOST_ROWS)
    if min(rows_list) <= HOST_ARRIVALS:
        raise SystemExit(f"--rows: at least {HOST_ARRIVALS + 1} rows (the packed phase decodes rows - "
                         f"{HOST_ARRIVALS} while {HOST_ARRIVALS} prompts arrive)")
    iterations = getattr(args, "iterations", None) or (4 if args.quick else 30)
    if not 1 <= iterations <= HOST_MAX_ITERATIONS:
        raise SystemExit(f"--iterations: 1 .. {HOST_MAX_ITERATIONS}")
    wanted = getattr(args, "families", None)
    families = _host_models(wanted.split(",") if wanted else None)
    profile_rows = max(rows_list) if getattr(args, "profile", False) else None
    queued = QUEUED_QUICK if args.quick else QUEUED
    results = {}
    with DeviceTimer() as timer:
        for family, (build, options) in families.items():
            model = build()
            for n in rows_list:
                profile = None
                if n == profile_rows:
                    import cProfile

                    profile = profiles[family] = cProfile.Profile()
                results[family, n] = host_overhead_run(model, options, n, iterations, np.random.default_rng(n),
                                                       timer, profile)
                results[family, n]["burst"] = burst_run(model, options, n, np.random.default_rng(n), timer)
                results[family, n]["queued"] = queued_run(model, options, n, iterations, queued,
                                                          np.random.default_rng(n), timer)
    rows, payload = [], []
    for family in families:
        for phase in ("decode", "packed", "burst", "queued"):
            base = None
            for n in rows_list:
                run = results[family, n][phase]
                host = np.asarray(run["host"]) * 1e3
                if not host.size:
                    raise SystemExit(f"{family} {phase} at {n} rows: no iteration ran a packed step")
                p50, p90 = float(np.median(host)), float(np.percentile(host, 90))
                cpu = float(np.median(run["host_cpu"])) * 1e3
                device = float(np.median(run["device"])) * 1e3
                calls = float(np.mean(run["calls"]))
                running = float(np.mean(run["running"]))
                base = p50 if base is None else base
                rows.append([family, phase, n, f"{running:.0f}", f"{p50:.2f}", f"{p90:.2f}", f"{cpu:.2f}",
                             f"{device:.1f}", f"{calls:.1f}", f"{p50 / base:.2f}"])
                payload.append({"family": family, "phase": phase, "rows": n, "running": running,
                                "iterations": len(host), "host_ms_p50": p50, "host_ms_p90": p90,
                                "host_cpu_ms_p50": cpu, "device_ms_p50": device,
                                "device_calls_per_iteration": calls, "host_ratio_to_smallest": p50 / base,
                                **({"queued": queued, "add_request_us_p50": run["add_us"]} if phase == "queued"
                                   else {})})
    machine = machine_description()
    small, large = min(rows_list), max(rows_list)
    print_table(f"scheduler host time per iteration (Engine.step wall time - time inside the jitted calls), "
                f"median and p90 of {iterations} iterations, tiny random models, decode_chunk {HOST_CHUNK} "
                f"on {machine}", ["family", "phase", "rows", "running", "host ms p50", "host ms p90",
                                  "host CPU ms p50", "device ms p50", "calls/iter", f"host / at {small}"], rows)
    print(f"\nTargets (issue 41): host <= 2 ms per iteration at 256 rows; host at 256 rows <= 4x host at 16 "
          f"(decode and packed). No target for burst (the step in which every row's {BURST_PROMPT}-token prompt "
          f"arrives at once, median of {BURST_REPEATS}) or queued (decode while {queued} requests wait; it should "
          f"cost what decode costs).")
    for r in payload:
        if r["phase"] == "queued":
            print(f"{r['family']} at {r['rows']} rows: add_request {r['add_request_us_p50']:.0f} us (median) with up "
                  f"to {queued} requests queued")
    for r in payload:
        if r["rows"] == large and large != small and r["phase"] in ("decode", "packed"):
            print(f"{r['family']} {r['phase']}: host {r['host_ms_p50']:.2f} ms at {large} rows, "
                  f"{r['host_ratio_to_smallest']:.2f}x the {small}-row figure")
    for family, profile in profiles.items():
        import pstats

        print(f"\ncProfile of {family}'s timed steps (both phases) at {profile_rows} rows, by own time:")
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)
    if args.json:
        print_json({"benchmark": "serve", "mode": "host_overhead", "machine": machine, "rows": list(rows_list),
                    "iterations": iterations, "results": payload})
    return 0
