"""Structured outputs: JSON schemas, JSON mode, regexes and choices compiled
into token automata (:class:`~jaxkv.nn.constraints.TokenAutomaton`) the
engine applies on the device.

Why outlines-core (``pip install jaxkv[serve]``): its ``Index`` is a
token-level DFA, built once per (constraint, vocabulary), which is exactly
what fits on the device as tables, so a constrained row keeps the
multi-step decode loop (no host round trip per token). xgrammar and
llguidance accept more (context-free grammars), but compute each token's
mask on the host from a pushdown automaton / Earley parser, which takes
constrained rows out of the device loop: jaxkv uses llguidance for
``grammar`` constraints only (:mod:`jaxkv.serve.grammar`, one token per
device call for such a row). The price of a DFA: recursion is unrolled to a
fixed depth (``json_object``'s nesting), and building the index for a large
regex takes seconds (``json_object`` on SmolLM2's 49,152 tokens: about 19 s
on 2 cores, once per machine: :func:`compile_constraint` caches automata
in memory, and on disk where :func:`set_automaton_cache_dir` says, as the
server does).

What is accepted (:func:`constraint_regex`):

* ``json_schema``: a JSON schema (outlines-core's regex for it), with
  integers and numbers written by regexes of jaxkv's own
  (:func:`integer_range_regex`, :func:`number_range_regex`): they enforce
  the bounds (``minimum`` / ``maximum`` / ``exclusive*``, which
  outlines-core ignores) and limit the digits to
  :data:`MAX_NUMBER_DIGITS` (no exponent). Keywords no
  DFA here enforces (``multipleOf``, ``uniqueItems``, ``not``,
  ``minProperties``...) are refused with the keyword named, rather than
  producing output the schema rejects;
* ``json_object``: any JSON object (outlines-core's schema ``{"type":
  "object"}``);
* ``regex``: a regular expression the whole output must match;
* ``choice``: one of a list of strings.

Errors (a schema that is not valid JSON Schema, an unsupported keyword, a
regex outlines-core cannot compile, an automaton past
:data:`MAX_AUTOMATON_BYTES`) are ``InvalidArgument``, which the HTTP server
answers with 400.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import math
import os
import re
import tempfile
import threading
from collections import OrderedDict

import numpy as np

from jaxkv.errors import InvalidArgument
from jaxkv.nn.constraints import RowConstraints, TokenAutomaton, stack_automata
from jaxkv.serve.grammar import HostGrammar, compile_grammar

__all__ = ["ConstraintTable", "MAX_AUTOMATON_BYTES", "MAX_NUMBER_DIGITS", "compile_constraint", "compile_regex",
           "constraint_regex", "integer_range_regex", "number_range_regex", "schema_regex", "set_automaton_cache_dir",
           "token_bytes"]

#: The largest automaton accepted (its device tables' bytes).
MAX_AUTOMATON_BYTES = 256 << 20
#: The most digits a schema's number has in its fraction, and in its integer
#: part where no bound limits it (past a float64's 15-17 significant digits,
#: digits carry nothing a JSON parser keeps). Without a limit a model may
#: write digits until ``max_new_tokens`` (the real SmolLM2 did once, in CI,
#: under a drawn schema); llama.cpp's JSON-schema grammars limit both to 16 too.
MAX_NUMBER_DIGITS = 16
#: Validation keywords no regex here enforces: a schema using one is refused.
UNENFORCED_KEYWORDS = ("multipleOf", "uniqueItems", "not", "if", "then", "else", "minProperties", "maxProperties",
                       "patternProperties", "propertyNames", "contains", "minContains", "maxContains",
                       "dependentRequired", "dependentSchemas", "dependencies", "unevaluatedProperties",
                       "unevaluatedItems")
_DATA_KEYS = ("enum", "const", "default", "examples")  # values, not schemas: never rewritten


def _require_outlines():
    try:
        import outlines_core
    except ImportError:
        raise InvalidArgument("structured outputs need outlines-core: pip install 'jaxkv[serve]'") from None
    return outlines_core


# ------------------------------------------------------------ numeric ranges


def _same_length(lo: str, hi: str) -> str:
    """A regex for the decimal strings of ``len(lo)`` digits from ``lo`` to
    ``hi`` (``lo <= hi``, same length)."""
    if lo == hi:
        return lo
    rest = len(lo) - 1
    if lo[1:] == "0" * rest and hi[1:] == "9" * rest:
        head = lo[0] if lo[0] == hi[0] else f"[{lo[0]}-{hi[0]}]"
        return head + (f"[0-9]{{{rest}}}" if rest else "")
    if lo[0] == hi[0]:
        return lo[0] + f"(?:{_same_length(lo[1:], hi[1:])})"
    parts = [lo[0] + f"(?:{_same_length(lo[1:], '9' * rest)})"]
    if int(hi[0]) - int(lo[0]) > 1:
        parts.append(f"[{int(lo[0]) + 1}-{int(hi[0]) - 1}][0-9]{{{rest}}}")
    parts.append(hi[0] + f"(?:{_same_length('0' * rest, hi[1:])})")
    return "|".join(parts)


def _natural_range(lo: int, hi: int | None) -> str:
    """A regex for the integers ``lo..hi`` (``0 <= lo``; ``hi`` None: those
    of at most ``max(MAX_NUMBER_DIGITS, digits of lo + 1)`` digits) written
    without leading zeros."""
    parts = []
    digits = len(str(lo))
    top = digits if hi is None else len(str(hi))
    for n in range(digits, top + 1):
        low = max(lo, 10 ** (n - 1) if n > 1 else 0)
        high = 10 ** n - 1 if hi is None else min(hi, 10 ** n - 1)
        if low <= high:
            parts.append(_same_length(str(low), str(high)))
    if hi is None:
        parts.append(f"[1-9][0-9]{{{digits},{max(MAX_NUMBER_DIGITS, digits + 1) - 1}}}")
    return "|".join(f"(?:{p})" for p in parts)


def integer_range_regex(lo: int | None, hi: int | None) -> str:
    """A regex matching exactly the JSON integers in ``[lo, hi]`` (None: no
    bound on that side but :data:`MAX_NUMBER_DIGITS` digits; ``-0`` is not
    produced). ``InvalidArgument`` when the range is empty."""
    if lo is not None and hi is not None and lo > hi:
        raise InvalidArgument(f"the integer range [{lo}, {hi}] is empty")
    parts = []
    if hi is None or hi >= 0:
        parts.append(_natural_range(max(lo, 0) if lo is not None else 0, hi))
    if lo is None or lo < 0:
        parts.append("-(?:" + _natural_range(max(-hi, 1) if hi is not None else 1, None if lo is None else -lo) + ")")
    return "(?:" + "|".join(parts) + ")"


def number_range_regex(lo: float | None, hi: float | None, lo_open: bool = False, hi_open: bool = False) -> str:
    """A regex for JSON numbers (no exponent) in the range, every match
    inside it: a decimal whose integer part ``I`` lies within the bounds
    rounded inwards to integers ``a..b``, any fraction when ``I`` is
    strictly inside, none but zeros at an end (so values in ``(a - 1, a)``
    and past ``b`` are never produced: a subset of the range, refused when
    it holds no integer). At most :data:`MAX_NUMBER_DIGITS` digits after
    the point (and before it, on a side with no bound)."""
    a = None if lo is None else math.ceil(lo) + (1 if lo_open and math.ceil(lo) == lo else 0)
    b = None if hi is None else math.floor(hi) - (1 if hi_open and math.floor(hi) == hi else 0)
    if a is not None and b is not None and a > b:
        raise InvalidArgument(f"number bounds [{lo}, {hi}] hold no integer; jaxkv enforces number bounds on the "
                              "integer part and cannot serve this range")
    fraction, zeros = rf"(?:\.[0-9]{{1,{MAX_NUMBER_DIGITS}}})?", rf"(?:\.0{{1,{MAX_NUMBER_DIGITS}}})?"
    parts = []
    if b is None or b >= 0:  # I.f with I >= max(a, 0)
        low = max(a, 0) if a is not None else 0
        if b is None:
            parts.append(f"(?:{_natural_range(low, None)}){fraction}")
        else:
            if low <= b - 1:
                parts.append(f"(?:{_natural_range(low, b - 1)}){fraction}")
            parts.append(f"(?:{_natural_range(b, b)}){zeros}")
    if a is None or a < 0:  # -(J.f) with J >= max(-b, 0)
        low = max(-b, 0) if b is not None else 0
        if a is None:
            parts.append(f"-(?:{_natural_range(low, None)}){fraction}")
        else:
            if low <= -a - 1:
                parts.append(f"-(?:{_natural_range(low, -a - 1)}){fraction}")
            parts.append(f"-(?:{_natural_range(-a, -a)}){zeros}")
    return "(?:" + "|".join(parts) + ")"


# ------------------------------------------------------------ schemas


def _check_schema(schema) -> None:
    if not isinstance(schema, (dict, bool)):
        raise InvalidArgument(f"a JSON schema is an object, got {type(schema).__name__}")
    try:
        import jsonschema
    except ImportError:
        return  # checked only where jsonschema is installed (the serve extra has it)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as err:
        raise InvalidArgument(f"invalid JSON schema: {err.message} (at {'/'.join(map(str, err.path)) or 'the root'})"
                              ) from None


def _bound(node: dict, name: str, exclusive: str):
    """``(value, open)`` of one side's bound (draft 4's boolean
    ``exclusive*`` and 2019's numeric one both read)."""
    value, flag = node.get(name), node.get(exclusive)
    if isinstance(flag, bool):
        return value, flag and value is not None
    if flag is not None and (value is None or (flag >= value if name == "minimum" else flag <= value)):
        return flag, True
    return value, False


def _rewrite(node, ranges: list, path: str):
    """``node`` with every integer / number (but an ``enum`` or ``const``
    one) replaced by a marker constant (its regex appended to ``ranges``);
    refuses unenforced keywords."""
    if isinstance(node, list):
        return [_rewrite(item, ranges, f"{path}/{i}") for i, item in enumerate(node)]
    if not isinstance(node, dict):
        return node
    for keyword in UNENFORCED_KEYWORDS:
        if keyword in node:
            raise InvalidArgument(f"JSON schema keyword {keyword!r} (at {path or '/'}) is not enforced by jaxkv's "
                                  "structured outputs; remove it or use a regex")
    kind = node.get("type")
    # Every integer and number, bounded or not: outlines-core's own number regex has no limit on its digits.
    if kind in ("integer", "number") and not any(k in node for k in ("enum", "const")):
        (lo, lo_open), (hi, hi_open) = _bound(node, "minimum", "exclusiveMinimum"), \
            _bound(node, "maximum", "exclusiveMaximum")
        if kind == "integer":
            a = None if lo is None else math.floor(lo) + 1 if lo_open or lo != math.floor(lo) else int(lo)
            b = None if hi is None else math.ceil(hi) - 1 if hi_open or hi != math.ceil(hi) else int(hi)
            regex = integer_range_regex(a, b)
        else:
            regex = number_range_regex(lo, hi, lo_open, hi_open)
        ranges.append(regex)
        return {"const": f"JXKVRANGE{len(ranges) - 1}Q"}
    return {k: (v if k in _DATA_KEYS else _rewrite(v, ranges, f"{path}/{k}")) for k, v in node.items()}


def schema_regex(schema) -> str:
    """The regex of a JSON schema (module docstring)."""
    outlines = _require_outlines()
    _check_schema(schema)
    ranges: list = []
    rewritten = _rewrite(schema, ranges, "")
    text = json.dumps(rewritten)
    if "JXKVRANGE" in json.dumps(schema):
        raise InvalidArgument("the JSON schema holds the reserved text 'JXKVRANGE'")
    try:
        regex = outlines.json_schema.build_regex_from_schema(text)
    except (ValueError, TypeError) as err:
        raise InvalidArgument(f"JSON schema not supported: {str(err).splitlines()[0]}") from None
    for i, sub in enumerate(ranges):  # a marker outlines-core left out is a value never produced (maxItems 0)
        regex = regex.replace(f'"JXKVRANGE{i}Q"', sub)
    return regex


def constraint_regex(*, json_schema=None, json_object: bool = False, regex: str | None = None,
                     choice=None) -> tuple[str, str]:
    """``(kind, regex)`` of exactly one constraint (module docstring)."""
    given = [name for name, value in (("json_schema", json_schema), ("json_object", json_object or None),
                                      ("regex", regex), ("choice", choice)) if value is not None]
    if len(given) != 1:
        raise InvalidArgument(f"give exactly one structured-output constraint, got {given or 'none'}")
    if json_schema is not None:
        return "json_schema", schema_regex(json_schema)
    if json_object:
        return "json_object", schema_regex({"type": "object"})
    if regex is not None:
        if not isinstance(regex, str) or not regex:
            raise InvalidArgument("a regex constraint is a non-empty string")
        try:
            re.compile(regex)
        except re.error as err:
            raise InvalidArgument(f"invalid regex: {err}") from None
        return "regex", regex
    if not isinstance(choice, (list, tuple)) or not choice or not all(isinstance(c, str) and c for c in choice):
        raise InvalidArgument("a choice constraint is a non-empty list of non-empty strings")
    return "choice", "(?:" + "|".join(re.escape(c) for c in choice) + ")"


# ------------------------------------------------------------ vocabulary


def token_bytes(tokenizer) -> dict[int, bytes]:
    """The bytes each ordinary token id adds to the output (byte-level BPE
    spellings mapped back to bytes; SentencePiece's ``▁`` a space and its
    ``<0xNN>`` tokens one byte); special tokens are left out."""
    from jaxkv.text import bytes_to_unicode

    backend = tokenizer.backend
    added = backend.get_added_tokens_decoder()
    decoder = json.dumps(json.loads(backend.to_str()).get("decoder") or {})
    byte_level = '"ByteLevel"' in decoder
    inverse = {c: b for b, c in bytes_to_unicode().items()}
    out = {}
    for text, i in backend.get_vocab(with_added_tokens=False).items():
        if i in added:
            continue
        if byte_level:
            try:
                out[i] = bytes(inverse[c] for c in text)
            except KeyError:
                continue
        else:
            byte = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", text)
            out[i] = bytes([int(byte.group(1), 16)]) if byte else text.replace("\u2581", " ").encode("utf-8")
    for i, token in added.items():
        if not token.special:
            out[i] = token.content.encode("utf-8")
    return out


logger = logging.getLogger("jaxkv.serve")

_LOCK = threading.Lock()
_VOCABULARIES: dict = {}  # (id(tokenizer), vocab_size) -> (tokenizer, outlines Vocabulary, stop ids, fingerprint)
_AUTOMATA: OrderedDict = OrderedDict()  # (id(tokenizer), vocab_size, regex) -> (tokenizer, TokenAutomaton)
_AUTOMATA_BYTES = 1 << 30  # the cache's bound


#: Appended to every regex before outlines-core builds its index, and spelled
#: by a token of jaxkv's own (:data:`_END_ID`) that is never emitted.
#: outlines-core's DFA matches leftmost-first: in ``y|yes``, once ``y`` ends
#: a match the branch ``yes`` is dropped, so "yes" could never be written
#: (nor 55 under ``[5-9]|[1-9][0-9]``). With the end marked, no branch ends
#: a match before the whole output is written, and the automaton accepts
#: exactly the outputs ``re.fullmatch`` accepts. The mark is a Unicode
#: noncharacter, which text does not hold: where a regex matches it too
#: (``.`` does), only outputs that hold it could be judged otherwise.
_END_MARK = "\ufdd0"
_END_ID = 1 << 30  # past every vocabulary


def _outlines_vocabulary(spelled: dict, stop_ids: list):
    """An outlines-core ``Vocabulary`` of ``spelled`` (token id -> bytes):
    tokens grouped by spelling, the stop ids and empty spellings left out
    (a stop is the automaton's own STOP class), and the end mark's token
    (:data:`_END_ID`, never emitted) added."""
    stops = set(stop_ids)
    spellings: dict = {}
    for i, text in spelled.items():
        if i not in stops and text:
            spellings.setdefault(text, []).append(i)
    spellings.setdefault(_END_MARK.encode(), []).append(_END_ID)
    return _require_outlines().Vocabulary(stop_ids[0], spellings)


def _vocabulary(tokenizer, vocab_size: int):
    """``(outlines Vocabulary, stop ids, fingerprint)`` of ``tokenizer``
    for ``vocab_size`` logits, made once per tokenizer; the fingerprint
    (a SHA-256 of every token's spelling, the stops and the size) names
    its automata on disk."""
    key = (id(tokenizer), vocab_size)
    with _LOCK:
        entry = _VOCABULARIES.get(key)
    if entry is not None and entry[0] is tokenizer:
        return entry[1:]
    stops = [t for t in tokenizer.eos_token_ids if 0 <= t < vocab_size]
    if not stops:
        raise InvalidArgument("structured outputs need the tokenizer's end-of-sequence id (it has none)")
    spelled = {i: text for i, text in token_bytes(tokenizer).items() if i < vocab_size}
    vocabulary = _outlines_vocabulary(spelled, stops)
    digest = hashlib.sha256(f"{vocab_size} {stops}".encode())
    for i in sorted(spelled):
        digest.update(i.to_bytes(4, "little") + len(spelled[i]).to_bytes(4, "little") + spelled[i])
    with _LOCK:
        _VOCABULARIES[key] = (tokenizer, vocabulary, stops, digest.hexdigest())
    return vocabulary, stops, digest.hexdigest()


# ------------------------------------------------------------ automata on disk

#: The folder automata are kept in across processes (None: none; :func:`set_automaton_cache_dir`).
_DISK: dict = {"dir": None}
_DISK_FORMAT = 2  # 2: outputs the regex matches whole (_END_MARK)
_DISK_FIELDS = ("next_state", "class_of", "allowed_bits", "final")


def set_automaton_cache_dir(path: str | None) -> None:
    """Keep compiled automata in folder ``path`` (None: in memory only), so
    that a restarted server does not build them again (``json_object`` on
    SmolLM2's vocabulary: 11-19 s on 2 cores). One ``.npz`` file per
    (tokenizer spellings, vocabulary size, regex, outlines-core version,
    format), written atomically, with a SHA-256 of its arrays; a file that
    does not load, fails its checksum or breaks the automaton's shapes is
    ignored (and replaced by the next build), never used."""
    if path is not None:
        os.makedirs(path, exist_ok=True)
    _DISK["dir"] = path


def _disk_path(fingerprint: str, regex: str) -> str | None:
    folder = _DISK["dir"]
    if folder is None:
        return None
    version = importlib.metadata.version("outlines-core")
    name = hashlib.sha256(f"{_DISK_FORMAT} {version} {fingerprint} {regex}".encode()).hexdigest()[:40]
    return os.path.join(folder, f"{name}.npz")


def _arrays_digest(arrays: dict) -> str:
    digest = hashlib.sha256()
    for field in _DISK_FIELDS:
        digest.update(np.ascontiguousarray(arrays[field]).tobytes())
    return digest.hexdigest()


def _load_automaton(path: str, vocab_size: int, key: str) -> TokenAutomaton | None:
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {field: data[field] for field in _DISK_FIELDS}
            initial, checksum = int(data["initial"]), str(data["checksum"])
    except FileNotFoundError:
        return None
    except Exception as err:  # noqa: BLE001 - a damaged file is skipped, whatever numpy says of it
        logger.warning("automaton cache file %s unreadable (%s): building again", path, type(err).__name__)
        return None
    states = arrays["next_state"].shape[0] if arrays["next_state"].ndim == 2 else -1
    shapes_ok = (states > 0 and arrays["class_of"].shape == (vocab_size,)
                 and arrays["allowed_bits"].shape == (states, -(-vocab_size // 32))
                 and arrays["final"].shape == (states,) and 0 <= initial < states)
    if not shapes_ok or checksum != _arrays_digest(arrays):
        logger.warning("automaton cache file %s is damaged (shapes or checksum): building again", path)
        return None
    return TokenAutomaton(**arrays, initial=initial, key=key)


def _store_automaton(path: str, automaton: TokenAutomaton) -> None:
    arrays = {field: getattr(automaton, field) for field in _DISK_FIELDS}
    folder = os.path.dirname(path)
    try:
        with tempfile.NamedTemporaryFile(dir=folder, suffix=".tmp", delete=False) as f:
            np.savez(f, **arrays, initial=np.int64(automaton.initial), checksum=np.str_(_arrays_digest(arrays)))
        os.replace(f.name, path)  # atomic: a reader sees the old file or the whole new one
    except OSError as err:  # a full or read-only disk costs the next start a build, nothing else
        logger.warning("automaton cache: cannot write %s (%s)", path, err)


def _fullmatch_transitions(index) -> tuple[dict, list]:
    """``(transitions, finals)`` of the outputs ``s`` for which ``s`` and
    the end mark are in ``index``'s language (a regex with
    :data:`_END_MARK` appended): a state is final where the mark's token
    ends the output; the mark's token is dropped, and so are the states no
    final one is reachable from (a mark spelled by byte tokens)."""
    transitions = index.get_transitions()
    index_finals = set(index.get_final_states())
    finals = [s for s, edges in transitions.items() if edges.get(_END_ID) in index_finals]
    sources: dict = {}
    for state, edges in transitions.items():
        for target in set(edges.values()):
            sources.setdefault(target, []).append(state)
    live, frontier = set(finals), list(finals)
    while frontier:
        for state in sources.get(frontier.pop(), ()):
            if state not in live:
                live.add(state)
                frontier.append(state)
    kept = {}
    for state, edges in transitions.items():
        if state in live:
            if _END_ID in edges or not live.issuperset(edges.values()):
                edges = {t: n for t, n in edges.items() if t != _END_ID and n in live}
            kept[state] = edges
    return kept, finals


def compile_regex(regex: str, vocabulary, stop_ids, vocab_size: int, *, key: str = "") -> TokenAutomaton:
    """The automaton of the outputs ``regex`` matches whole (as
    ``re.fullmatch``) over ``vocabulary`` (an outlines-core ``Vocabulary``
    made by :func:`_outlines_vocabulary`, or a dict ``{token id: bytes}``
    of the tokens that may be emitted), ended by any of ``stop_ids``; not
    cached."""
    outlines = _require_outlines()
    stop_ids = list(stop_ids)
    if isinstance(vocabulary, dict):
        vocabulary = _outlines_vocabulary(vocabulary, stop_ids)
    try:
        index = outlines.Index(f"(?:{regex}){_END_MARK}", vocabulary)
    except (ValueError, TypeError) as err:
        raise InvalidArgument(f"constraint {key or regex[:80]!r} cannot be compiled: "
                              f"{str(err).splitlines()[0][:300]}") from None
    transitions, finals = _fullmatch_transitions(index)
    if index.get_initial_state() not in transitions:
        raise InvalidArgument(f"constraint {key or regex[:80]!r} matches no output the vocabulary can write")
    automaton = TokenAutomaton.from_transitions(transitions, index.get_initial_state(), finals, vocab_size,
                                                stop_ids, key=key)
    if automaton.nbytes > MAX_AUTOMATON_BYTES:
        raise InvalidArgument(f"constraint {key[:80]!r} needs {automaton.nbytes / 2**20:.0f} MiB of tables "
                              f"({automaton.num_states} states); at most {MAX_AUTOMATON_BYTES >> 20} MiB")
    return automaton


def compile_constraint(tokenizer, vocab_size: int, **constraint) -> TokenAutomaton | HostGrammar:
    """The :class:`TokenAutomaton` of one constraint (keywords of
    :func:`constraint_regex`) over ``tokenizer``'s tokens, for a model of
    ``vocab_size`` logits; cached (same tokenizer, size and regex: the same
    automaton). Thread-safe; the build itself runs outside the lock.
    ``grammar=`` (alone): a context-free grammar, a
    :class:`~jaxkv.serve.grammar.HostGrammar` (:func:`compile_grammar`)."""
    if "grammar" in constraint:
        grammar = constraint.pop("grammar")
        if constraint:
            raise InvalidArgument(f"give exactly one structured-output constraint, got {['grammar', *constraint]}")
        return compile_grammar(tokenizer, vocab_size, grammar)
    kind, regex = constraint_regex(**constraint)
    key = (id(tokenizer), vocab_size, regex)
    with _LOCK:
        entry = _AUTOMATA.get(key)
        if entry is not None and entry[0] is tokenizer:
            _AUTOMATA.move_to_end(key)
            return entry[1]
    vocabulary, stops, fingerprint = _vocabulary(tokenizer, vocab_size)
    path = _disk_path(fingerprint, regex)
    automaton = None if path is None else _load_automaton(path, vocab_size, f"{kind}:{regex[:200]}")
    if automaton is None:
        automaton = compile_regex(regex, vocabulary, stops, vocab_size, key=f"{kind}:{regex[:200]}")
        if path is not None:
            _store_automaton(path, automaton)
    with _LOCK:
        _AUTOMATA[key] = (tokenizer, automaton)
        while sum(a.nbytes for _, a in _AUTOMATA.values()) > _AUTOMATA_BYTES and len(_AUTOMATA) > 1:
            _AUTOMATA.popitem(last=False)
    return automaton


# ------------------------------------------------------------ the engine's table


class ConstraintTable:
    """The device tables of the automata the engine's running requests
    follow (:func:`~jaxkv.nn.constraints.stack_automata`), rebuilt only
    when that set changes; :meth:`rows` gives a batch's
    :class:`RowConstraints`."""

    def __init__(self, vocab: int):
        self.vocab = vocab
        self._automata: tuple = ()
        self._device: RowConstraints | None = None
        self._offsets: dict = {}
        self.rebuilds = 0

    def rows(self, max_rows: int, constrained: dict, masked: dict | None = None) -> RowConstraints | None:
        """``constrained``: lane -> ``(automaton, state)`` (states local to
        the automaton); ``masked``: lane -> ``[W]`` uint32, a mask the host
        computed for the lane's next token (a grammar,
        :mod:`jaxkv.serve.grammar`: ``row_bits``, every bit set for the
        other lanes). None when both are empty (nothing is computed then)."""
        if not constrained and not masked:
            return None
        automata = tuple(dict.fromkeys(a for a, _ in constrained.values()))
        if self._device is None or {id(a) for a in automata} != {id(a) for a in self._automata}:
            self._automata = automata
            self._device, offsets = stack_automata(list(automata), self.vocab)
            self._offsets = {id(a): (k + 1, offset) for k, (a, offset) in enumerate(zip(automata, offsets))}
            self.rebuilds += 1
        automaton = np.zeros(max_rows, np.int32)
        state = np.zeros(max_rows, np.int32)
        for lane, (a, local) in constrained.items():
            automaton[lane], offset = self._offsets[id(a)]
            state[lane] = offset + local
        row_bits = None
        if masked:
            row_bits = np.full((max_rows, -(-self.vocab // 32)), 0xFFFFFFFF, np.uint32)
            for lane, bits in masked.items():
                row_bits[lane] = bits
        return self._device.replace(automaton=automaton, state=state, row_bits=row_bits)
