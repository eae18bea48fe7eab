"""Structured outputs (:mod:`jaxkv.serve.structured`, :mod:`jaxkv.nn.constraints`).

Expectations we did not write: ``jsonschema`` validates every constrained
output against its schema (schemas drawn at random: nesting, enums, arrays,
bounded integers and numbers, optional properties, unions), Python's ``re``
full-matches regex outputs, outlines-core's own ``Index`` gives the allowed
tokens and next states our compressed tables must reproduce, and Python's
integers check the range regexes. The model is a random Llama over a small
byte-level BPE trained here on JSON (multi-byte tokens such as ``":``), which
left alone emits garbage: the mask alone must make its outputs valid.
Unconstrained requests batched beside constrained ones must produce exactly
the tokens they produce alone. SmolLM2 (the real model) runs in the ``long``
profile.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

pytest.importorskip("outlines_core")
jsonschema = pytest.importorskip("jsonschema")

from jaxkv.errors import InvalidArgument  # noqa: E402
from jaxkv.nn.constraints import RowConstraints, advance, constrain, stack_automata  # noqa: E402
from jaxkv.serve.structured import (compile_constraint, constraint_regex, integer_range_regex,  # noqa: E402
                                    number_range_regex)


# ------------------------------------------------------------ a tokenizer and a model


def _corpus(rng, n: int) -> list[str]:
    words = ["name", "age", "tags", "ok", "x", "value", "items", "true", "false", "null", "alpha", "beta"]
    out = []
    for _ in range(n):
        values = [int(rng.integers(-999, 999)), float(np.round(rng.normal(), 3)), str(rng.choice(words)),
                  bool(rng.integers(2)), None, [int(x) for x in rng.integers(0, 50, 3)]]
        doc = {str(rng.choice(words)): values[int(rng.integers(len(values)))] for _ in range(int(rng.integers(1, 4)))}
        out.append(json.dumps(doc, separators=(",", ":") if rng.random() < 0.5 else (", ", ": ")))
    return out


@pytest.fixture(scope="module")
def tokenizer():
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from tokenizers.pre_tokenizers import ByteLevel

    from jaxkv.text import Tokenizer

    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_end|>"],
                                  initial_alphabet=ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(_corpus(np.random.default_rng(0), 2000), trainer)
    return Tokenizer(backend, eos_token_ids=[backend.token_to_id("<|im_end|>")])


@pytest.fixture(scope="module")
def model(tokenizer):
    from flax import nnx

    from jaxkv.nn import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=tokenizer.vocab_size + 5, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         max_position_embeddings=512)  # 5 ids past the tokenizer: never allowed
    return LlamaForCausalLM(config, rngs=nnx.Rngs(int(np.random.default_rng().integers(1 << 30))))


# ------------------------------------------------------------ random schemas


def draw_schema(rng, depth: int = 0) -> dict:
    """A JSON schema every output of which is short (strings and arrays
    bounded), drawn over the kinds outlines-core and jaxkv's ranges cover."""
    kinds = ["string", "enum", "integer", "number", "boolean", "null", "anyOf"] + (["object", "array"] * 2
                                                                                   if depth < 2 else [])
    kind = kinds[int(rng.integers(len(kinds)))]
    if kind == "object":
        names = rng.choice(["a", "bb", "name", "x_1", "value", "ok"], int(rng.integers(1, 4)), replace=False)
        props = {str(n): draw_schema(rng, depth + 1) for n in names}
        required = [n for n in props if rng.random() < 0.6]
        return {"type": "object", "properties": props, "required": required}
    if kind == "array":
        low = int(rng.integers(0, 2))
        return {"type": "array", "items": draw_schema(rng, depth + 1), "minItems": low,
                "maxItems": low + int(rng.integers(0, 3))}
    if kind == "string":
        return {"type": "string", "maxLength": int(rng.integers(1, 6))}
    if kind == "enum":
        pool = ["red", "green", "a b", 'q"t', 7, -2.5, True, None]
        return {"enum": [pool[i] for i in rng.choice(len(pool), int(rng.integers(1, 4)), replace=False)]}
    if kind == "integer":
        lo = int(rng.integers(-300, 300))
        return {"type": "integer", "minimum": lo, "maximum": lo + int(rng.integers(0, 500))}
    if kind == "number":
        lo = float(np.round(rng.uniform(-50, 50), 1))
        bound = {"minimum": lo, "maximum": lo + float(np.round(rng.uniform(2, 80), 1))}
        if rng.random() < 0.3:
            bound = {"exclusiveMinimum": lo, "exclusiveMaximum": bound["maximum"]}
        return {"type": "number", **bound}
    if kind == "anyOf":
        return {"anyOf": [draw_schema(rng, depth + 1), {"type": "null"}]}
    return {"type": kind}


# ------------------------------------------------------------ ranges


def test_integer_ranges_match_exactly_the_integers_inside():
    rng = np.random.default_rng()
    for _ in range(150):
        lo, hi = (None if rng.random() < 0.2 else int(rng.integers(-3000, 3000)) for _ in range(2))
        if lo is not None and hi is not None and lo > hi:
            lo, hi = hi, lo
        pattern = re.compile(integer_range_regex(lo, hi))
        for v in range(-3200, 3200):
            assert bool(pattern.fullmatch(str(v))) == ((lo is None or v >= lo) and (hi is None or v <= hi)), (lo, hi, v)
        assert not pattern.fullmatch("-0") and not pattern.fullmatch("01")
        # A side with no bound stops at MAX_NUMBER_DIGITS digits (16): past those, a model may repeat one forever.
        if hi is None:
            assert pattern.fullmatch("9" * 16) and not pattern.fullmatch("1" + "0" * 16)
        if lo is None:
            assert pattern.fullmatch("-" + "9" * 16) and not pattern.fullmatch("-1" + "0" * 16)
    with pytest.raises(InvalidArgument, match="empty"):
        integer_range_regex(5, 4)


def test_number_ranges_produce_only_numbers_inside():
    rng = np.random.default_rng()
    for _ in range(150):
        lo, hi = sorted(float(np.round(x, int(rng.integers(0, 3)))) for x in rng.uniform(-400, 400, 2))
        if np.floor(hi) - np.ceil(lo) < 2:
            continue
        lo_open, hi_open = bool(rng.integers(2)), bool(rng.integers(2))
        pattern = re.compile(number_range_regex(lo, hi, lo_open, hi_open))
        inside = 0
        # Drawn around the range, and one integer surely in the subset (a narrow range's subset may be that integer
        # alone, which 400 draws miss about a third of the time).
        drawn = list(zip(rng.uniform(lo - 50, hi + 50, 400), rng.integers(0, 4, 400))) + [(np.ceil(lo) + 1, 0)]
        for x in (round(float(v), int(d)) for v, d in drawn):
            text = repr(float(x)) if rng.random() < 0.5 else f"{x:.3f}"
            if pattern.fullmatch(text):
                inside += 1
                value = float(text)
                assert (value > lo if lo_open else value >= lo) and (value < hi if hi_open else value <= hi), \
                    (lo, hi, lo_open, hi_open, text)
        assert inside > 0, (lo, hi)  # the subset is not empty where the range spans integers
        # An integer m with m - 1 and m + 1 in the range: m.333... lies inside it with up to 16 digits, no more.
        a = int(np.floor(lo)) + 1 if lo_open or lo != np.floor(lo) else int(lo)
        b = int(np.ceil(hi)) - 1 if hi_open or hi != np.ceil(hi) else int(hi)
        if b - a >= 2:
            m = (a + b) // 2
            assert pattern.fullmatch(f"{m}." + "3" * 16) and not pattern.fullmatch(f"{m}." + "3" * 17), (lo, hi, m)
    with pytest.raises(InvalidArgument, match="no integer"):
        number_range_regex(0.2, 0.8)


# ------------------------------------------------------------ tables against outlines-core's index


def test_tables_reproduce_the_outlines_index(tokenizer, model):
    """Every state's allowed tokens and next states equal outlines-core's
    Index (our tables compress tokens into classes and add EOS ourselves),
    on the host and through the device mask and advance. Its index is of
    the plain regex (ours has the end mark appended): an object's regex
    ends a match only at its closing brace, where leftmost-first matching
    drops nothing."""
    import jax.numpy as jnp
    import outlines_core

    from jaxkv.serve.structured import _vocabulary

    vocab = model.config.vocab_size
    rng = np.random.default_rng()
    schema = draw_schema(rng)
    kind, regex = constraint_regex(json_schema={"type": "object", "properties": {"k": schema}, "required": ["k"]})
    automaton = compile_constraint(tokenizer, vocab, json_schema={"type": "object", "properties": {"k": schema},
                                                                  "required": ["k"]})
    index = outlines_core.Index(regex, _vocabulary(tokenizer, vocab)[0])
    eos = set(tokenizer.eos_token_ids)
    # Walk the index from its initial state, alongside ours.
    transitions = index.get_transitions()
    start_state = index.get_initial_state()
    ours, frontier = {start_state: automaton.initial}, [start_state]
    while frontier:
        theirs_state = frontier.pop()
        state = ours[theirs_state]
        theirs = {t: n for t, n in transitions.get(theirs_state, {}).items() if t not in eos and t < vocab}
        want = set(theirs) | (eos if index.is_final_state(theirs_state) else set())
        assert set(automaton.allowed(state).tolist()) == want, (schema, theirs_state)
        for token, nxt in theirs.items():
            if nxt not in ours:
                frontier.append(nxt)
            assert ours.setdefault(nxt, automaton.step(state, token)) == automaton.step(state, token)
    assert len(set(ours.values())) == len(ours) == automaton.num_states
    # The device tables, stacked with a second automaton, for random states and tokens.
    other = compile_constraint(tokenizer, vocab, choice=["yes", "no"])
    table, offsets = stack_automata([other, automaton], vocab)
    states = rng.integers(0, automaton.num_states, 6)
    rows = RowConstraints(table.allowed_bits, table.next_state, table.class_of,
                          jnp.asarray([2] * 6 + [0], jnp.int32), jnp.asarray([*(states + offsets[1]), 0], jnp.int32))
    logits = jnp.asarray(rng.normal(size=(7, vocab)), jnp.float32)
    masked = np.asarray(constrain(logits, rows))
    for r, s in enumerate(states):
        assert set(np.flatnonzero(np.isfinite(masked[r])).tolist()) == set(automaton.allowed(int(s)).tolist())
    assert np.isfinite(masked[6]).all()  # the universal row
    tokens = [int(rng.choice(automaton.allowed(int(s)))) for s in states] + [3]
    after = np.asarray(advance(rows, rows.state, jnp.asarray(tokens, jnp.int32), jnp.ones(7, bool)))
    assert after[:6].tolist() == [automaton.step(int(s), t) + offsets[1] for s, t in zip(states, tokens[:6])]
    assert after[6] == 0


def test_tables_are_the_same_arrays_whatever_order_the_states_come_in(tokenizer, model):
    """One automaton gives the same arrays however its transitions are
    ordered (outlines-core hands its states in another order on each build;
    numbered in that order, a rebuilt automaton differed from the one kept
    on disk: a chance failure of the disk test below). Drawn automata whose
    states, edges and finals are shuffled, then two builds of a drawn
    schema through outlines-core."""
    from jaxkv.nn.constraints import TokenAutomaton
    from jaxkv.serve.structured import _vocabulary, compile_regex

    rng = np.random.default_rng()
    fields = ("next_state", "class_of", "allowed_bits", "final")
    for _ in range(40):
        n, vocab = int(rng.integers(1, 14)), int(rng.integers(8, 60))
        names = rng.permutation(1000)[:n].tolist()  # any names: outlines' are arbitrary ints
        transitions = {name: {int(t): names[int(rng.integers(n))] for t in rng.integers(2, vocab, rng.integers(0, 7))}
                       for name in names}
        finals = [name for name in names if rng.random() < 0.3]
        built = TokenAutomaton.from_transitions(transitions, names[0], finals, vocab, [1])
        order = rng.permutation(n)
        shuffled = {names[i]: dict(sorted(transitions[names[i]].items(), key=lambda _: rng.random())) for i in order}
        again = TokenAutomaton.from_transitions(shuffled, names[0], finals[::-1], vocab, [1])
        assert again.initial == built.initial
        for field in fields:
            assert np.array_equal(getattr(again, field), getattr(built, field)), field
    vocab = model.config.vocab_size
    _, regex = constraint_regex(json_schema=draw_schema(rng))
    vocabulary, stops, _ = _vocabulary(tokenizer, vocab)
    first, second = (compile_regex(regex, vocabulary, stops, vocab) for _ in range(2))
    for field in fields:
        assert np.array_equal(getattr(first, field), getattr(second, field)), field


def test_automata_accept_exactly_what_the_regex_matches_whole(tokenizer, model):
    """outlines-core matches leftmost-first (``y|yes`` alone would never
    write "yes"); jaxkv's automata accept exactly the outputs
    ``re.fullmatch`` accepts: drawn choices and regexes whose alternatives
    are prefixes of one another, against Python's ``re`` on every string
    over their alphabet up to 5 characters, and whole-schema integer
    ranges against arithmetic."""
    import itertools

    vocab = model.config.vocab_size
    rng = np.random.default_rng()

    def accepts(automaton, text: str) -> bool:
        state = automaton.walk(automaton.initial, tokenizer.encode(text))
        return state >= 0 and bool(automaton.final[state])

    def word(letters: str, longest: int) -> str:
        return "".join(rng.choice(list(letters), int(rng.integers(1, longest + 1))))

    strings = ["".join(p) for n in range(1, 6) for p in itertools.product("abxy", repeat=n)]
    for _ in range(3):
        words = sorted({word("ab", 4) for _ in range(6)})
        words += [words[0] + word("ab", 2)]  # surely one word a prefix of another
        regex = "(?:" + "|".join(words) + ")(?:x|xy|" + word("xy", 2) + ")?"
        for kind, spec in (("choice", words), ("regex", regex)):
            automaton = compile_constraint(tokenizer, vocab, **{kind: spec})
            pattern = regex if kind == "regex" else "|".join(words)
            for text in strings:
                assert accepts(automaton, text) == bool(re.fullmatch(pattern, text)), (kind, spec, text)
    for _ in range(3):
        lo = int(rng.integers(-300, 300))
        hi = lo + int(rng.integers(0, 400))
        automaton = compile_constraint(tokenizer, vocab, json_schema={"type": "integer", "minimum": lo, "maximum": hi})
        for v in {lo - 1, lo, hi, hi + 1, *rng.integers(lo - 100, hi + 100, 60).tolist()}:
            assert accepts(automaton, str(v)) == (lo <= v <= hi), (lo, hi, v)


def _longest_output(automaton) -> int | None:
    """The most tokens (before the stop) any output of ``automaton`` has;
    None when a cycle lets an output grow without end (Kahn's order over
    the states, the DEAD and STOP columns left out: STOP loops on a final
    state)."""
    edges = [sorted({int(n) for n in row[2:] if n >= 0}) for row in automaton.next_state]
    indegree = np.zeros(automaton.num_states, int)
    for targets in edges:
        for n in targets:
            indegree[n] += 1
    order, ready = [], [s for s in range(automaton.num_states) if indegree[s] == 0]
    while ready:
        state = ready.pop()
        order.append(state)
        for n in edges[state]:
            indegree[n] -= 1
            if indegree[n] == 0:
                ready.append(n)
    if len(order) < automaton.num_states:
        return None
    depth = np.zeros(automaton.num_states, int)
    for state in order:
        for n in edges[state]:
            depth[n] = max(depth[n], depth[state] + 1)
    return int(depth.max())


def test_every_number_a_schema_allows_is_bounded(tokenizer, model):
    """A schema whose strings and arrays are bounded (drawn, and unbounded
    integers and numbers) has an acyclic automaton: no output runs past
    a finite length, so a model cannot write digits until its token limit
    (the real SmolLM2 once reached it inside a drawn ``number``, in CI). An
    unbounded string's automaton has a cycle: the check can fail."""
    vocab = model.config.vocab_size
    rng = np.random.default_rng()
    unbounded = [{"type": "number"}, {"type": "integer"}, {"type": "integer", "minimum": int(rng.integers(-99, 99))},
                 {"type": "number", "maximum": float(rng.uniform(-99, 99))}]
    for schema in unbounded + [draw_schema(rng) for _ in range(6)]:
        automaton = compile_constraint(tokenizer, vocab, json_schema={"type": "object", "properties": {"k": schema},
                                                                      "required": ["k"]})
        assert _longest_output(automaton) is not None, schema
    assert _longest_output(compile_constraint(tokenizer, vocab, json_schema={"type": "string"})) is None
    # Sixteen digits on each side of the point, no more.
    automaton = compile_constraint(tokenizer, vocab, json_schema={"type": "number"})
    state = automaton.walk(automaton.initial, tokenizer.encode("9" * 16 + "." + "9" * 16))
    assert state >= 0 and automaton.final[state]
    assert automaton.walk(automaton.initial, tokenizer.encode("9" * 17)) < 0
    assert automaton.walk(automaton.initial, tokenizer.encode("9." + "9" * 17)) < 0


# ------------------------------------------------------------ the engine


def _served(engine, requests: list) -> list:
    """``requests``: ``add_request`` keyword dicts; each one's outputs
    (``RequestOutput`` list) once all finished."""
    ids = [engine.add_request(**kw) for kw in requests]
    outputs: dict = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    engine.check_bookkeeping()
    return [outputs[rid] for rid in ids]


def _run(engine, requests: list) -> list:
    """``(tokens, finish reason)`` per request of :func:`_served`."""
    return [([t for o in outs for t in o.new_token_ids], outs[-1].finish_reason) for outs in _served(engine, requests)]


def _check_output(tokenizer, tokens, reason, kind, spec) -> str:
    assert reason == "stop" and tokens[-1] in tokenizer.eos_token_ids, (kind, spec, reason, tokens)
    text = tokenizer.decode(tokens[:-1])
    if kind == "json_schema":
        jsonschema.validate(json.loads(text), spec)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict), text
    elif kind == "regex":
        assert re.fullmatch(spec, text), (spec, text)
    else:
        assert text in spec, (spec, text)
    return text


def _valid(tokenizer, tokens, reason, kind, spec) -> bool:
    """Whether an output passes :func:`_check_output`."""
    try:
        _check_output(tokenizer, tokens, reason, kind, spec)
    except (AssertionError, ValueError, jsonschema.ValidationError):
        return False
    return True


def engine_follows_constraints(tokenizer, model, scheduler: str, num_schemas: int) -> None:
    """Random schemas, a regex and a choice on a random model (sampled at
    temperature 1, two seeds each), beside unconstrained requests: every
    constrained output that stopped is valid, one cut at its length (a
    random model may wander in a number with no bound on its digits: seen
    once in CI-sized runs) holds only tokens its automaton allowed, most
    stop, and the others' tokens are those of a run without the
    constrained ones."""
    from jaxkv.nn.sampling import SamplingParams
    from jaxkv.serve import Engine

    vocab = model.config.vocab_size
    rng = np.random.default_rng()
    specs = [("json_schema", draw_schema(rng)) for _ in range(num_schemas)]
    specs += [("regex", r"(ab|c[0-9]{1,3})+-?[xyz]"), ("choice", ["left", "right", "up down"])]
    sampling = SamplingParams(temperature=1.0)
    eos = tokenizer.eos_token_ids[0]

    def request(seed, **extra):
        prompt = rng.integers(0, tokenizer.vocab_size, int(rng.integers(2, 20))).tolist()
        return dict(prompt_tokens=prompt, max_new_tokens=160, sampling=sampling, seed=seed, eos_token_id=eos) | extra

    constrained, labels = [], []
    for k, (kind, spec) in enumerate(specs):
        automaton = compile_constraint(tokenizer, vocab, **{kind: spec})
        for seed in (2 * k, 2 * k + 1):
            constrained.append(request(seed, constraint=automaton))
            labels.append((kind, spec))
    plain = [request(1000 + i, max_new_tokens=int(rng.integers(5, 40))) for i in range(3)]
    options = dict(max_seqs=6, max_model_len=256, decode_chunk=8, prefill_chunk=16, scheduler=scheduler)
    mixed = _run(Engine(model, tokenizer=tokenizer, **options), constrained[:3] + plain + constrained[3:])
    outputs = mixed[:3] + mixed[6:]
    for (tokens, reason), (kind, spec), req in zip(outputs, labels, constrained):
        if reason == "length":  # cut, not finished: every token still one the mask allowed
            automaton = req["constraint"]
            assert automaton.walk(automaton.initial, tokens) >= 0, (kind, spec, tokens)
        else:
            _check_output(tokenizer, tokens, reason, kind, spec)
    assert sum(reason == "stop" for _, reason in outputs) >= 3 * len(outputs) // 4, [r for _, r in outputs]
    assert mixed[3:6] == _run(Engine(model, tokenizer=tokenizer, **options), plain)
    # Left alone the model emits garbage: the mask did it. (Not "some request does not stop": a random model at
    # temperature 1 stops within 160 tokens about a third of the time, so all four did in about 1 run of 100.)
    free = _run(Engine(model, tokenizer=tokenizer, **options), [dict(r, constraint=None) for r in constrained[:4]])
    assert not all(_valid(tokenizer, tokens, reason, kind, spec)
                   for (tokens, reason), (kind, spec) in zip(free, labels)), free


def test_engine_outputs_follow_random_schemas(tokenizer, model):
    engine_follows_constraints(tokenizer, model, "packed", 3)


def test_engine_outputs_follow_random_schemas_wide(tokenizer, model):
    engine_follows_constraints(tokenizer, model, "padded", 6)
    engine_follows_constraints(tokenizer, model, "packed", 10)


def test_smollm2_follows_random_schemas_and_json_mode():
    """The real SmolLM2 (Q4_1 GGUF, 49,152 tokens, many of them multi-byte):
    chat requests under random schemas (greedy and sampled) and JSON mode
    give documents ``jsonschema`` accepts. A schema's requests may write as
    many tokens as its longest output (its automaton is acyclic), so each
    must stop; JSON mode's objects are unbounded, and 200 tokens have
    always sufficed."""
    from jaxkv.nn import AutoModelForCausalLM
    from jaxkv.nn.gguf import SMOLLM2_INSTALL, find_smollm2
    from jaxkv.nn.sampling import SamplingParams
    from jaxkv.serve import Engine
    from jaxkv.text import Tokenizer

    path = find_smollm2()
    if path is None:
        pytest.skip(SMOLLM2_INSTALL)
    model, tokenizer = AutoModelForCausalLM.from_pretrained(path), Tokenizer.from_pretrained(path)
    vocab = model.config.vocab_size
    rng = np.random.default_rng()
    specs = [("json_schema", {"type": "object", "properties": {"colour": draw_schema(rng, 1),
                                                               "count": draw_schema(rng, 1)},
                              "required": ["colour", "count"]}) for _ in range(3)]
    specs.append(("json_object", True))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Describe a colour as JSON."}], tokenize=True)
    engine = Engine(model, tokenizer=tokenizer, max_seqs=4, max_model_len=1024, decode_chunk=8)
    automata = [compile_constraint(tokenizer, vocab, **{kind: spec}) for kind, spec in specs]
    limits = [_longest_output(a) for a in automata[:-1]] + [199]
    assert None not in limits and max(limits) < 1024 - len(prompt), limits
    requests = [dict(prompt_tokens=prompt, max_new_tokens=limit + 1, eos_token_id=tokenizer.eos_token_ids[0], seed=k,
                     sampling=SamplingParams(temperature=0.7) if k % 2 else SamplingParams(), constraint=automaton)
                for k, (automaton, limit) in enumerate(zip(automata, limits))]
    for (tokens, reason), (kind, spec) in zip(_run(engine, requests), specs):
        _check_output(tokenizer, tokens, reason, kind, spec)


def test_constraints_arriving_beside_a_speculating_request(tokenizer, model):
    """A speculating engine (n-gram drafts, packed verify lanes): requests
    that arrive, constrained or asking log-probabilities, while a plain one
    verifies drafts, are prefilled in plain steps (verify steps apply no
    constraint and compute no log-probabilities): the JSON is valid and
    every token has its entry."""
    from jaxkv.nn.sampling import SamplingParams
    from jaxkv.serve import Engine

    rng = np.random.default_rng()
    loop = rng.integers(0, tokenizer.vocab_size, 6).tolist() * 4  # repeats: n-gram drafts are found
    schema = draw_schema(rng)
    constraint = compile_constraint(tokenizer, model.config.vocab_size, json_schema=schema)
    engine = Engine(model, tokenizer=tokenizer, max_seqs=4, max_model_len=256, decode_chunk=4,
                    speculative={"method": "ngram", "num_speculative_tokens": 3})
    eos = tokenizer.eos_token_ids[0]
    requests = [dict(prompt_tokens=loop, max_new_tokens=40, arrival_step=0),
                dict(prompt_tokens=loop[:9], max_new_tokens=160, sampling=SamplingParams(temperature=1.0), seed=1,
                     eos_token_id=eos, constraint=constraint, arrival_step=3),
                dict(prompt_tokens=loop[:7], max_new_tokens=12, logprobs=2, arrival_step=4)]
    _, constrained, asking = _served(engine, requests)
    tokens = [t for o in constrained for t in o.new_token_ids]
    _check_output(tokenizer, tokens, constrained[-1].finish_reason, "json_schema", schema)
    entries = [e for o in asking for e in (o.new_logprobs or ())]
    assert len(entries) == sum(len(o.new_token_ids) for o in asking) == 12
    assert engine.stats().spec_draft_tokens > 0  # the plain request did speculate


def test_automata_kept_on_disk_load_as_built_and_damaged_files_are_rebuilt(tokenizer, model, tmp_path, caplog):
    """With a disk folder, a new process's first request (a new tokenizer
    object: nothing in memory) loads the automaton the last one built,
    array for array; a truncated file, a file whose arrays were changed
    (its checksum) and a half-written temporary file (a power cut) are
    never used: the automaton is built again, equal."""
    from jaxkv.serve.structured import set_automaton_cache_dir
    from jaxkv.text import Tokenizer

    vocab = model.config.vocab_size
    schema = draw_schema(np.random.default_rng())
    fields = ("next_state", "class_of", "allowed_bits", "final", "initial")

    def fresh():  # another process's view: a tokenizer object of its own
        return compile_constraint(Tokenizer(tokenizer.backend, eos_token_ids=list(tokenizer.eos_token_ids)), vocab,
                                  json_schema=schema)

    set_automaton_cache_dir(str(tmp_path))
    try:
        built = fresh()
        files = list(tmp_path.glob("*.npz"))
        assert len(files) == 1, files
        (tmp_path / "half.npz.tmp").write_bytes(files[0].read_bytes()[:100])  # a write cut short: never read
        loaded = fresh()
        for field in fields:
            assert np.array_equal(getattr(loaded, field), getattr(built, field)), field
        data = dict(np.load(files[0]))
        data["final"] = ~data["final"]  # another automaton under the old checksum
        np.savez(files[0], **data)
        for damage in ("changed", "truncated"):
            if damage == "truncated":
                files[0].write_bytes(files[0].read_bytes()[:200])
            caplog.clear()
            with caplog.at_level("WARNING", logger="jaxkv.serve"):
                again = fresh()
            assert "building again" in caplog.text, damage
            for field in fields:
                assert np.array_equal(getattr(again, field), getattr(built, field)), (damage, field)
            assert fresh().initial == built.initial  # the rebuilt file replaced the damaged one
    finally:
        set_automaton_cache_dir(None)
