"""Context-free grammar constraints (:mod:`jaxkv.serve.grammar`): llguidance
masks on the host, one token per device call for such a row.

Expectations we did not write: the ``lark`` parser (Earley) parses every
finished output of a grammar drawn at random, and a hand-written check of
the nested family (``OPEN^n MID CLOSE^n``, a language no token automaton
holds) accepts every output, finished or cut, as that language or a prefix
of it. The model is test_structured's random Llama over a BPE trained on
JSON, which left alone emits garbage. Unconstrained requests beside grammar
rows must produce the tokens they produce alone, and keep their
``decode_chunk`` tokens per decode call while a grammar row takes one.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("llguidance")
lark = pytest.importorskip("lark")

from jaxkv.errors import InvalidArgument  # noqa: E402
from jaxkv.serve.grammar import HostGrammar, compile_grammar  # noqa: E402
from jaxkv.serve.structured import compile_constraint  # noqa: E402
from tests.test_structured import model, tokenizer  # noqa: E402,F401 - the shared fixtures

OPENS, CLOSES, MIDS = "[{(<", "]})>", ["x", "ok", "name", "7", "true"]


def draw_nested(rng) -> tuple[str, tuple]:
    """A grammar of ``OPEN^n MID CLOSE^n`` (n at least a drawn depth of 1
    to 3) with drawn delimiters, in Lark or in GBNF, and its parts."""
    k, depth = int(rng.integers(len(OPENS))), int(rng.integers(1, 4))
    o, c, m = OPENS[k], CLOSES[k], str(rng.choice(MIDS))
    outer = " ".join([f'"{o}"'] * depth + ["inner"] + [f'"{c}"'] * depth)
    if rng.random() < 0.5:
        return f'start: {outer}\ninner: "{o}" inner "{c}" | "{m}"\n', (o, c, m, depth)
    return f'root ::= {outer}\ninner ::= "{o}" inner "{c}" | "{m}"\n', (o, c, m, depth)


def as_lark(grammar: str, parts) -> str:
    """The Lark text of a drawn grammar (GBNF ones rewritten)."""
    if parts is None or grammar.startswith("start"):
        return grammar
    return grammar.replace("root ::=", "start:").replace("inner ::=", "inner:")


def nested_state(text: str, parts: tuple) -> str:
    """``"done"`` when ``text`` is ``OPEN^n MID CLOSE^n`` with ``n`` at
    least the depth, ``"prefix"`` when it is a proper prefix of one,
    ``"bad"`` otherwise."""
    o, c, m, depth = parts
    n = len(text) - len(text.lstrip(o))
    rest, whole = text[n:], m + c * n
    if rest == whole and n >= depth:
        return "done"
    if not rest:
        return "prefix"
    return "prefix" if n >= depth and whole.startswith(rest) else "bad"


def draw_arithmetic(rng) -> str:
    """A Lark grammar of arithmetic expressions with drawn operators and
    number widths (parentheses nest without bound)."""
    ops1 = " | ".join(f'"{op}"' for op in rng.choice(["+", "-"], int(rng.integers(1, 3)), replace=False))
    ops2 = " | ".join(f'"{op}"' for op in rng.choice(["*", "/", "%"], int(rng.integers(1, 4)), replace=False))
    width = int(rng.integers(1, 4))
    return (f"start: expr\nexpr: term (OP1 term)*\nterm: atom (OP2 atom)*\n"
            f'atom: NUMBER | "(" expr ")"\nNUMBER: /[0-9]{{1,{width}}}/\nOP1: {ops1}\nOP2: {ops2}\n')


def _lark_parses(grammar: str, text: str) -> bool:
    try:
        lark.Lark(grammar, start="start").parse(text)
    except lark.exceptions.LarkError:
        return False
    return True


# ------------------------------------------------------------ compiling


def test_grammars_compile_and_bad_ones_are_refused_with_the_reason(tokenizer):
    vocab = tokenizer.vocab_size + 5
    rng = np.random.default_rng()
    grammar, _ = draw_nested(rng)
    compiled = compile_constraint(tokenizer, vocab, grammar=grammar)
    assert isinstance(compiled, HostGrammar) and compiled.vocab_size == vocab
    for bad, says in (('start: foo', "unknown name"), ("garbage ::: x", "GBNF"), ("", "non-empty"),
                      ("start: " + "x" * (1 << 17), "characters")):
        with pytest.raises(InvalidArgument, match=says):
            compile_grammar(tokenizer, vocab, bad)
    with pytest.raises(InvalidArgument, match="exactly one"):
        compile_constraint(tokenizer, vocab, grammar=grammar, regex="a+")


def test_host_masks_walk_only_into_the_language(tokenizer):
    """Walks drawn token by token among what the mask allows: each text
    stays a prefix of the nested language (hand check) and, where the mask
    allows the end, the text is in the language and ``lark`` parses it;
    ids past the tokenizer and special tokens are never allowed."""
    vocab = tokenizer.vocab_size + 5
    rng = np.random.default_rng()
    eos = tokenizer.eos_token_ids[0]
    for _ in range(6):
        grammar, parts = draw_nested(rng)
        state = compile_grammar(tokenizer, vocab, grammar).state()
        generated, ended = [], False
        for step in range(31):  # up to 30 tokens, each text checked (the 30th's too: it may complete the text)
            bits = state.mask(generated)
            allowed = np.flatnonzero((bits[:, None] >> np.arange(32, dtype=np.uint32)) & 1)
            assert allowed.max() < tokenizer.vocab_size, allowed.max()
            text = tokenizer.decode(generated)
            assert nested_state(text, parts) != "bad", (grammar, text)
            if eos in allowed:
                assert nested_state(text, parts) == "done", (grammar, text)
                assert _lark_parses(as_lark(grammar, parts), text), (grammar, text)
                ended = True
                if rng.random() < 0.5:
                    break
            token = int(rng.choice(allowed[allowed != eos])) if (allowed != eos).any() else eos
            if token == eos or step == 30:
                break
            generated.append(token)
        assert ended or nested_state(tokenizer.decode(generated), parts) == "prefix"


def test_a_grammar_sent_as_text_masks_as_the_original(tokenizer):
    """What a leader sends its followers (``HostGrammar.text()``, pickled)
    bound to another copy of the tokenizer gives the original's masks along
    a walk drawn among them."""
    import pickle

    from jaxkv.text import Tokenizer

    vocab = tokenizer.vocab_size + 5
    rng = np.random.default_rng()
    grammar, _ = draw_nested(rng)
    original = compile_grammar(tokenizer, vocab, grammar)
    other = Tokenizer(type(tokenizer.backend).from_str(tokenizer.backend.to_str()),  # another process's copy
                      eos_token_ids=tokenizer.eos_token_ids)
    sent = pickle.loads(pickle.dumps(original.text())).bind(other)
    assert isinstance(sent, HostGrammar) and sent.lltokenizer is not original.lltokenizer
    mine, theirs, generated = original.state(), sent.state(), []
    for _ in range(20):
        bits = mine.mask(generated)
        assert np.array_equal(bits, theirs.mask(generated)), (grammar, generated)
        allowed = np.flatnonzero((bits[:, None] >> np.arange(32, dtype=np.uint32)) & 1)
        allowed = allowed[~np.isin(allowed, tokenizer.eos_token_ids)]
        if not allowed.size:
            break
        generated.append(int(rng.choice(allowed)))


# ------------------------------------------------------------ the engine


@pytest.fixture(scope="module")
def small_tokenizer():
    """A byte-level BPE of 250 tokens (only the characters of its corpus:
    the fixtures' 256 logits), for the hybrid cache's fixture."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from jaxkv.text import Tokenizer

    rng = np.random.default_rng(0)
    corpus = []
    for _ in range(400):
        k, n = int(rng.integers(len(OPENS))), int(rng.integers(0, 5))
        corpus.append(OPENS[k] * n + str(rng.choice(MIDS)) + CLOSES[k] * n)
        corpus.append("".join(str(rng.choice(list("0123456789+-*/%()"))) for _ in range(12)))
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=250, special_tokens=["<|endoftext|>", "<|im_end|>"],
                                  show_progress=False)
    backend.train_from_iterator(corpus, trainer)
    return Tokenizer(backend, eos_token_ids=[backend.token_to_id("<|im_end|>")])


@pytest.mark.parametrize("variant", ["packed", "padded", "speculative", "gemma3"])
def test_engine_grammar_rows_beside_plain_rows(tokenizer, model, small_tokenizer, variant):
    """Grammars drawn at random (the nested family, arithmetic) on a random
    model sampled at temperature 1, beside unconstrained requests: every
    grammar output is in its language (finished: ``lark`` and the hand
    check) or a prefix of it (cut at its length); a grammar row takes one
    token per call while the plain rows keep ``decode_chunk`` tokens per
    decode call; the plain rows' tokens equal a run without the grammar
    rows; left alone, the same requests leave the language. Both
    schedulers, and a speculating engine (which pauses speculation while a
    grammar row runs: the plain rows are greedy, so their tokens are the
    same either way); and a hybrid cache (Gemma 3's fixture: window rings,
    its packed and decode steps) with a smaller tokenizer."""
    from jaxkv.nn.sampling import SamplingParams
    from jaxkv.serve import Engine

    if variant == "gemma3":
        import os

        from jaxkv.nn import AutoModelForCausalLM

        tokenizer = small_tokenizer
        model = AutoModelForCausalLM.from_pretrained(os.path.join(os.path.dirname(__file__), "fixtures",
                                                                  "gemma3", "small"))

    vocab = model.config.vocab_size
    rng = np.random.default_rng()
    eos = tokenizer.eos_token_ids[0]
    specs = [draw_nested(rng) for _ in range(2)] + [(draw_arithmetic(rng), None)]

    def request(seed, **extra):
        prompt = rng.integers(0, tokenizer.vocab_size, int(rng.integers(2, 20))).tolist()
        return dict(prompt_tokens=prompt, max_new_tokens=40, sampling=SamplingParams(temperature=1.0), seed=seed,
                    eos_token_id=eos) | extra

    grammar_reqs = [request(k, constraint=compile_constraint(tokenizer, vocab, grammar=g)) for k, (g, _) in
                    enumerate(specs)]
    plain = [request(1000 + i, max_new_tokens=int(rng.integers(20, 40)), sampling=SamplingParams())
             for i in range(2)]
    options = dict(max_seqs=6, max_model_len=256, decode_chunk=8, prefill_chunk=16,
                   scheduler="padded" if variant == "padded" else "packed")
    if variant == "speculative":
        options["speculative"] = {"method": "ngram", "num_speculative_tokens": 3}
    engine = Engine(model, tokenizer=tokenizer, **options)
    ids = [engine.add_request(**kw) for kw in grammar_reqs + plain]
    tokens: dict = {rid: [] for rid in ids}
    reasons: dict = {}
    beside = 0  # decode calls in which a grammar row took one token while a plain row took more
    while engine.has_unfinished():
        outs = engine.step()
        counts = {out.request_id: len(out.new_token_ids) for out in outs}
        # A grammar row: one token per call (the padded scheduler's step is a prefill call and a decode call).
        assert all(counts.get(rid, 0) <= (2 if variant == "padded" else 1) for rid in ids[:3]), counts
        if any(counts.get(rid) in (1, 2) for rid in ids[:3]) and any(counts.get(rid, 0) > 2 for rid in ids[3:]):
            beside += 1
        for out in outs:
            tokens[out.request_id] += out.new_token_ids
            if out.finish_reason is not None:
                reasons[out.request_id] = out.finish_reason
    engine.check_bookkeeping()
    assert beside > 0, "the plain rows never decoded a chunk beside a grammar row"
    for rid, (grammar, parts) in zip(ids, specs):
        out, reason = tokens[rid], reasons[rid]
        finished = reason == "stop"
        if finished:
            assert out[-1] == eos, (grammar, out)
            out = out[:-1]
        text = tokenizer.decode(out)
        if parts is not None:  # cut at its length: possibly just when it could have ended
            assert nested_state(text, parts) in (("done",) if finished else ("prefix", "done")), (grammar, text)
        if finished:
            assert _lark_parses(as_lark(grammar, parts), text), (grammar, text)
    alone = Engine(model, tokenizer=tokenizer, **options)
    plain_ids = [alone.add_request(**kw) for kw in plain]
    free_ids = [alone.add_request(**dict(kw, constraint=None)) for kw in grammar_reqs]
    alone_tokens: dict = {rid: [] for rid in plain_ids + free_ids}
    while alone.has_unfinished():
        for out in alone.step():
            alone_tokens[out.request_id] += out.new_token_ids
    assert [tokens[rid] for rid in ids[3:]] == [alone_tokens[rid] for rid in plain_ids]
    # Left alone the model leaves the language: the mask did it.
    free = [tokenizer.decode([t for t in alone_tokens[rid] if t != eos]) for rid in free_ids]
    assert not all(_lark_parses(as_lark(g, parts), text) for (g, parts), text in zip(specs, free)), free


def test_a_grammar_that_fails_finishes_its_request_alone(tokenizer, model, monkeypatch):
    """A grammar whose parser fails mid-output (injected) finishes its own
    request with ``"error"`` and the reason; the request beside it gives
    the tokens it gives alone, and nothing leaks."""
    from jaxkv.nn.sampling import SamplingParams
    from jaxkv.serve import Engine
    from jaxkv.serve.grammar import GrammarState

    rng = np.random.default_rng()
    grammar, _ = draw_nested(rng)
    constraint = compile_constraint(tokenizer, model.config.vocab_size, grammar=grammar)
    real = GrammarState.mask

    def failing(self, generated):
        if len(generated) >= 2:
            raise RuntimeError("parser broke")
        return real(self, generated)

    monkeypatch.setattr(GrammarState, "mask", failing)
    prompt = rng.integers(0, tokenizer.vocab_size, 9).tolist()
    plain = dict(prompt_tokens=prompt[:5], max_new_tokens=20, sampling=SamplingParams())
    options = dict(max_seqs=4, max_model_len=128, decode_chunk=8, prefill_chunk=16)
    engine = Engine(model, tokenizer=tokenizer, **options)
    bad = engine.add_request(prompt_tokens=prompt, max_new_tokens=20, constraint=constraint,
                             sampling=SamplingParams(temperature=1.0), seed=3)
    good = engine.add_request(**plain)
    outs: dict = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    engine.check_bookkeeping()
    assert outs[bad][-1].finish_reason == "error" and "parser broke" in outs[bad][-1].error, outs[bad][-1]
    assert sum(len(o.new_token_ids) for o in outs[bad]) == 2
    alone = Engine(model, tokenizer=tokenizer, **options)
    rid = alone.add_request(**plain)
    tokens = []
    while alone.has_unfinished():
        tokens += [t for out in alone.step() if out.request_id == rid for t in out.new_token_ids]
    assert [t for o in outs[good] for t in o.new_token_ids] == tokens


def test_a_grammar_over_spellings_without_a_tokenizer():
    """``compile_grammar`` over a dict of spellings (a model with no
    tokenizer, as the serving bench's): walks drawn among what the mask
    allows stay in the nested language, a spelling-less id is never
    allowed, and the stop id only where the text is complete."""
    rng = np.random.default_rng()
    vocab, stop = 300, 2
    alphabet = list(OPENS + CLOSES + "".join(MIDS))
    spellings = {3 + i: bytes([b]) for i, b in enumerate(sorted(set("".join(alphabet).encode())))}
    for i in range(3 + len(spellings), vocab - 10):  # 10 ids past the end spell nothing
        spellings[i] = "".join(rng.choice(alphabet, int(rng.integers(2, 4)))).encode()
    for _ in range(4):
        grammar, parts = draw_nested(rng)
        state = compile_grammar(spellings, vocab, grammar, stop_ids=[stop]).state()
        generated = []
        for _ in range(25):
            bits = state.mask(generated)
            allowed = np.flatnonzero((bits[:, None] >> np.arange(32, dtype=np.uint32)) & 1)
            text = b"".join(spellings[t] for t in generated).decode()
            assert set(allowed.tolist()) <= set(spellings) | {stop}, allowed
            assert nested_state(text, parts) != "bad", (grammar, text)
            assert (stop in allowed) == (nested_state(text, parts) == "done"), (grammar, text)
            choices = allowed[allowed != stop]
            if not len(choices) or (stop in allowed and rng.random() < 0.3):
                break
            generated.append(int(rng.choice(choices)))
    with pytest.raises(InvalidArgument, match="stop ids"):
        compile_grammar(spellings, vocab, grammar)
