"""Context-free grammar constraints, masked on the host by llguidance.

A ``grammar`` constraint (vLLM's ``structured_outputs.grammar`` /
``guided_grammar``: a Lark grammar, or llama.cpp's GBNF, which llguidance
converts to Lark) cannot be a token automaton: a context-free language has
no finite one, so it cannot ride the device tables of
:mod:`jaxkv.nn.constraints` as JSON schemas and regexes do. Each request
holds an llguidance ``LLMatcher`` (an Earley parser over the tokenizer's
tokens) that computes the next token's mask on the host from the tokens
generated so far.

What that costs and how the engine contains it
(:mod:`jaxkv.serve.scheduler`): a row with a grammar takes **one token per
device call**, its mask computed on the host just before the call
(:meth:`GrammarState.mask`) and sent with it (``RowConstraints.row_bits``,
``[rows, ceil(vocab / 32)]`` uint32, only in calls that hold such a row).
In a decode chunk its ``max_new`` is capped at one more token, so the
other rows keep their ``decode_chunk`` steps: a grammar row costs them
nothing but the mask's transfer, and a batch without one carries no
``row_bits`` at all (the programs it compiles are the ones it compiled
before). Speculation pauses while a grammar row runs, as it does for the
other constraints.

Why llguidance (``pip install jaxkv[serve]``): it needs no other package
(xgrammar requires torch, transformers and triton), builds a grammar in
about a millisecond (no per-vocabulary index to build: JSON mode's
outlines-core DFA takes about 19 s on SmolLM2's vocabulary on 2 cores),
and computes a mask in tens of microseconds (``python -m jaxkv.bench
structured`` measures all three on the same tokenizer). JSON schemas,
regexes and choices still compile to device automata (outlines-core):
those keep the multi-step decode loop, which no host mask can.

Errors (a grammar llguidance rejects, a GBNF it cannot convert) are
``InvalidArgument``, which the HTTP server answers with 400.
"""

from __future__ import annotations

import dataclasses
import threading

import numpy as np

from jaxkv.errors import InvalidArgument

__all__ = ["GrammarState", "GrammarText", "HostGrammar", "compile_grammar"]

#: The longest grammar text accepted (characters).
MAX_GRAMMAR_CHARS = 64 << 10


def _require_llguidance():
    try:
        import llguidance
        import llguidance.numpy  # noqa: F401 - the mask helpers
    except ImportError:
        raise InvalidArgument("grammar constraints need llguidance: pip install 'jaxkv[serve]'") from None
    return llguidance


_LOCK = threading.Lock()
_TOKENIZERS: dict = {}  # (id(tokenizer), vocab_size) -> (tokenizer, LLTokenizer)


def _lltokenizer(tokenizer, vocab_size: int):
    """llguidance's view of ``tokenizer`` (its ``tokenizers`` JSON, the
    model's ``vocab_size`` logits, its end-of-sequence ids), made once per
    tokenizer (about 0.3 s for 49k tokens)."""
    key = (id(tokenizer), vocab_size)
    with _LOCK:
        entry = _TOKENIZERS.get(key)
    if entry is not None and entry[0] is tokenizer:
        return entry[1]
    llguidance = _require_llguidance()
    stops = [t for t in tokenizer.eos_token_ids if 0 <= t < vocab_size]
    if not stops:
        raise InvalidArgument("grammar constraints need the tokenizer's end-of-sequence id (it has none)")
    try:
        made = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=stops)
    except Exception as err:  # noqa: BLE001 - the library's own refusal of this tokenizer
        raise InvalidArgument(f"llguidance cannot read this tokenizer: {str(err).splitlines()[0][:300]}") from None
    with _LOCK:
        _TOKENIZERS[key] = (tokenizer, made)
    return made


@dataclasses.dataclass(frozen=True, eq=False)
class HostGrammar:
    """A validated grammar over one tokenizer: ``definition`` (llguidance's
    grammar text), ``lltokenizer``, the model's ``vocab_size`` logits and
    ``key`` (what it was compiled from, for errors). Immutable and shared
    by every request that follows it; each request parses with its own
    :class:`GrammarState`."""

    definition: str
    lltokenizer: object
    vocab_size: int
    key: str = ""

    @property
    def words(self) -> int:
        """uint32 words of one row's mask."""
        return -(-self.vocab_size // 32)

    def state(self) -> "GrammarState":
        return GrammarState(self)

    def text(self) -> "GrammarText":
        """This grammar without its tokenizer: what one process of a
        serving run sends the others (:mod:`jaxkv.serve.multihost`)."""
        return GrammarText(self.definition, self.vocab_size, self.key)


@dataclasses.dataclass(frozen=True)
class GrammarText:
    """A :class:`HostGrammar` less its llguidance tokenizer (which cannot
    be pickled): validated grammar text, ``vocab_size`` and ``key``.
    :meth:`bind` makes the grammar again over a tokenizer (the same
    model's, in another process)."""

    definition: str
    vocab_size: int
    key: str = ""

    def bind(self, tokenizer) -> HostGrammar:
        return HostGrammar(self.definition, _lltokenizer(tokenizer, self.vocab_size), self.vocab_size, self.key)


class GrammarState:
    """One request's parse (an llguidance ``LLMatcher``) after the first
    ``read`` generated tokens. :meth:`mask` feeds it the tokens generated
    since and gives the next token's allowed set."""

    def __init__(self, grammar: HostGrammar):
        self.grammar = grammar
        self.matcher = _require_llguidance().LLMatcher(grammar.lltokenizer, grammar.definition, log_level=0)
        self.read = 0
        self._bits = np.zeros((1, grammar.words), np.int32)

    def mask(self, generated: list) -> np.ndarray:
        """The allowed next tokens after ``generated`` (every token the
        request generated), ``[ceil(vocab / 32)]`` uint32, token ``v`` at
        bit ``v % 32`` of word ``v // 32``. ``InvalidArgument`` when a
        generated token is outside the grammar (the mask the device applied
        allowed it: a defect, not the request's input)."""
        import llguidance.numpy as masks

        if self.read > len(generated):  # never expected: tokens are only appended; start again
            self.matcher.reset()
            self.read = 0
        for token in generated[self.read:]:
            if not self.matcher.consume_token(int(token)):
                raise InvalidArgument(f"grammar {self.grammar.key[:80]!r}: generated token {token} is outside it "
                                      f"({self.matcher.get_error()[:200]})")
            self.read += 1
        masks.fill_next_token_bitmask(self.matcher, self._bits)
        if self.matcher.is_error():
            raise InvalidArgument(f"grammar {self.grammar.key[:80]!r}: {self.matcher.get_error()[:300]}")
        return self._bits[0].view(np.uint32).copy()


class _Spelled:
    """A vocabulary given as spellings (token id -> bytes), as llguidance's
    ``TokenizerWrapper`` reads one: ``tokens`` by id (ids without a
    spelling, the stops among them, are special tokens, never allowed but
    the stop at a grammar's end), and a greedy longest-match encoder
    (llguidance encodes the grammar's literal strings with it)."""

    def __init__(self, spellings: dict, stop_ids: list, vocab_size: int):
        self.eos_token_id, self.bos_token_id = stop_ids[0], None
        self.special_token_ids = [i for i in range(vocab_size) if not spellings.get(i) or i in stop_ids]
        special = set(self.special_token_ids)
        self.tokens = [f"<|special_{i}|>".encode() if i in special else spellings[i] for i in range(vocab_size)]
        self._ids = {spellings[i]: i for i in range(vocab_size) if i not in special}
        self._longest = max(map(len, self._ids), default=1)

    def __call__(self, data: bytes | str) -> list[int]:
        data = data.encode() if isinstance(data, str) else data
        out, at = [], 0
        while at < len(data):
            for size in range(min(self._longest, len(data) - at), 0, -1):
                token = self._ids.get(data[at:at + size])
                if token is not None:
                    out.append(token)
                    at += size
                    break
            else:  # a byte no token spells: no output can hold it, so it is left out
                at += 1
        return out


def compile_grammar(tokenizer, vocab_size: int, grammar: str, *, stop_ids=None) -> HostGrammar:
    """A :class:`HostGrammar` of ``grammar`` (Lark, or GBNF: a text with
    ``::=`` rules) over ``tokenizer``'s tokens for a model of
    ``vocab_size`` logits; ``InvalidArgument`` naming what is wrong when
    llguidance rejects it. ``tokenizer`` may instead be a dict ``{token id:
    bytes}`` of the tokens that may be emitted, ended by ``stop_ids`` (a
    model without a tokenizer, as :func:`~jaxkv.serve.structured.compile_regex`
    takes one)."""
    llguidance = _require_llguidance()
    if not isinstance(grammar, str) or not grammar.strip():
        raise InvalidArgument("a grammar constraint is a non-empty string (Lark or GBNF)")
    if len(grammar) > MAX_GRAMMAR_CHARS:
        raise InvalidArgument(f"the grammar has {len(grammar)} characters; at most {MAX_GRAMMAR_CHARS}")
    if isinstance(tokenizer, dict):
        if not stop_ids:
            raise InvalidArgument("a grammar over spellings needs its stop ids")
        lltokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Spelled(tokenizer, list(stop_ids),
                                                                                  vocab_size)), n_vocab=vocab_size)
    else:
        lltokenizer = _lltokenizer(tokenizer, vocab_size)
    try:
        definition = llguidance.grammar_from("grammar", grammar)
    except ValueError as err:
        raise InvalidArgument(f"invalid grammar: {str(err).splitlines()[0][:300]}") from None
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(definition, lltokenizer)
    if failed:
        raise InvalidArgument(f"invalid grammar: {(messages[0] if messages else 'rejected').splitlines()[0][:300]}")
    return HostGrammar(definition, lltokenizer, vocab_size, key=f"grammar:{grammar[:200]}")
