"""Constrained sampling with token automata held on the device.

A structured output (a JSON schema, a regex, a choice) is compiled on the
host into a :class:`TokenAutomaton`: a deterministic automaton over token
ids whose every path from ``initial`` to a final state spells a string the
constraint accepts (:mod:`jaxkv.serve.structured` builds them with
outlines-core). Its tables are small because tokens that move every state
alike share a *class*: ``class_of [V]`` maps a token to its class and
``next_state [S, C]`` gives the state after a class (-1: not allowed).
Two classes are fixed: :data:`DEAD` (never allowed: special tokens, ids
past the tokenizer) and :data:`STOP` (the end-of-sequence ids, allowed in a
final state, which they do not leave). ``allowed_bits [S, ceil(V / 32)]``
packs each state's allowed tokens 32 to a word, so a row's mask is one
row gather and a shift, not a ``[V]`` table walk.

On the device a batch carries :class:`RowConstraints`: the tables of every
automaton its rows follow, stacked (global state numbers; automaton 0 is
the universal one, state 0 allows every token and stays there, so an
unconstrained row costs nothing but its share of the mask), and each row's
automaton and current state. :func:`constrain` sets the logits of
disallowed tokens to -inf (after penalties, before temperature / top-k /
top-p, so processed log-probabilities include it); :func:`advance` moves
each row by the token it sampled, inside the multi-step decode loop, so a
constrained row never needs the host between tokens. A batch in which no
row is constrained carries None and computes nothing.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from flax import struct
from jaxtyping import Array, Bool, Float, Int

from jaxkv.errors import InvalidArgument

__all__ = ["DEAD", "STOP", "RowConstraints", "TokenAutomaton", "advance", "allowed_tokens", "constrain",
           "stack_automata"]

#: The class no state allows (special tokens, ids the tokenizer lacks).
DEAD = 0
#: The class of the end-of-sequence ids: allowed in final states only, where it stays.
STOP = 1


def _pack_bits(allowed: np.ndarray) -> np.ndarray:
    """``[S, V]`` bool as ``[S, ceil(V / 32)]`` uint32, token ``v`` at bit
    ``v % 32`` of word ``v // 32``."""
    states, vocab = allowed.shape
    words = -(-vocab // 32)
    padded = np.zeros((states, words * 32), bool)
    padded[:, :vocab] = allowed
    weights = (np.uint64(1) << np.arange(32, dtype=np.uint64)).astype(np.uint64)
    return (padded.reshape(states, words, 32).astype(np.uint64) * weights).sum(-1).astype(np.uint32)


@dataclasses.dataclass(frozen=True, eq=False)
class TokenAutomaton:
    """A constraint as a DFA over token ids (module docstring); host numpy.

    Invariants (checked by :meth:`from_transitions`): ``next_state`` is
    ``[S, C]`` int32 with values in ``[-1, S)``; column :data:`DEAD` is all
    -1; column :data:`STOP` is ``s`` in final states and -1 elsewhere;
    ``class_of`` is ``[V]`` int32 in ``[0, C)``; ``allowed_bits`` is the
    packed ``next_state[:, class_of] >= 0``; every state allows at least
    one token. ``key``: what it was compiled from (for caches and errors).
    """

    next_state: np.ndarray
    class_of: np.ndarray
    allowed_bits: np.ndarray
    final: np.ndarray
    initial: int
    key: str = ""

    @property
    def num_states(self) -> int:
        return self.next_state.shape[0]

    @property
    def num_classes(self) -> int:
        return self.next_state.shape[1]

    @property
    def vocab_size(self) -> int:
        return self.class_of.shape[0]

    @property
    def nbytes(self) -> int:
        return self.next_state.nbytes + self.class_of.nbytes + self.allowed_bits.nbytes

    def step(self, state: int, token: int) -> int:
        """The state after ``token`` from ``state`` (-1: not allowed)."""
        if not 0 <= token < self.vocab_size:
            return -1
        return int(self.next_state[state, self.class_of[token]])

    def walk(self, state: int, tokens) -> int:
        """The state after ``tokens`` from ``state`` (-1 once one is not
        allowed)."""
        for token in tokens:
            if state < 0:
                return -1
            state = self.step(state, int(token))
        return state

    def allowed(self, state: int) -> np.ndarray:
        """The token ids allowed in ``state`` (sorted)."""
        return np.flatnonzero(self.next_state[state, self.class_of] >= 0)

    @classmethod
    def from_transitions(cls, transitions: dict, initial: int, finals, vocab_size: int, stop_ids, *,
                         key: str = "") -> TokenAutomaton:
        """The automaton of ``transitions`` (state -> {token id: next
        state}, any hashable state names), starting at ``initial``; a
        ``finals`` state ends the output with any of ``stop_ids``. Tokens at
        or past ``vocab_size`` and the stop ids' own transitions are
        dropped; states no token leaves and that are not final become
        final (the row stops there rather than draw from an empty set).

        Classes are found by hashing each token's transition set (a sum of
        random 64-bit values per edge) and then checked exactly: every edge
        must be the table's, and the table must hold no edge more.

        The same transitions give the same arrays whatever the order of
        ``transitions`` (:func:`_canonical_states`; outlines-core hands its
        states in a different order on every build).
        """
        stop_ids = sorted({int(t) for t in stop_ids if 0 <= int(t) < vocab_size})
        if not stop_ids:
            raise InvalidArgument("a token automaton needs at least one end-of-sequence id in the vocabulary")
        names = _canonical_states(transitions, initial, finals)
        index = {name: i for i, name in enumerate(names)}
        num_states = len(names)
        stops = np.zeros(vocab_size, bool)
        stops[stop_ids] = True
        src, tok, dst = [], [], []
        for state, targets in transitions.items():
            ids = np.fromiter(targets.keys(), np.int64, len(targets))
            nxt = np.fromiter((index[t] for t in targets.values()), np.int64, len(targets))
            keep = (ids >= 0) & (ids < vocab_size)
            keep[keep] &= ~stops[ids[keep]]
            src.append(np.full(int(keep.sum()), index[state], np.int64))
            tok.append(ids[keep])
            dst.append(nxt[keep])
        src = np.concatenate(src) if src else np.zeros(0, np.int64)
        tok = np.concatenate(tok) if tok else np.zeros(0, np.int64)
        dst = np.concatenate(dst) if dst else np.zeros(0, np.int64)

        # A token's class: its set of (state, next state) edges, hashed.
        rng = np.random.default_rng(0x6A61786B76)
        salt_src = rng.integers(1, 2**63, num_states, dtype=np.int64).astype(np.uint64)
        salt_dst = rng.integers(1, 2**63, num_states, dtype=np.int64).astype(np.uint64) | np.uint64(1)
        signature = np.zeros(vocab_size, np.uint64)
        with np.errstate(over="ignore"):
            np.add.at(signature, tok, salt_src[src] * salt_dst[dst] + salt_src[dst])
        has_edge = np.zeros(vocab_size, bool)
        has_edge[tok] = True
        class_of = np.full(vocab_size, DEAD, np.int32)
        class_of[stops] = STOP
        uniq, inverse = np.unique(signature[has_edge], return_inverse=True)
        class_of[has_edge] = 2 + inverse.astype(np.int32)
        num_classes = 2 + len(uniq)

        next_state = np.full((num_states, num_classes), -1, np.int32)
        next_state[src, class_of[tok]] = dst
        final = np.zeros(num_states, bool)
        final[[index[f] for f in finals]] = True
        final |= (next_state[:, 2:] < 0).all(axis=1)  # a dead end stops rather than draws from nothing
        next_state[final, STOP] = np.flatnonzero(final)
        # Exact check of the hashing: every edge is the table's, and the table has no edge more.
        class_size = np.bincount(class_of, minlength=num_classes)
        if (next_state[src, class_of[tok]] != dst).any() or \
                int(((next_state[:, 2:] >= 0) * class_size[2:]).sum()) != len(src):
            raise InvalidArgument(f"token classes of constraint {key!r} collided; this is a bug, please report it")
        allowed_bits = _pack_bits(next_state[:, class_of] >= 0)
        return cls(next_state=next_state, class_of=class_of, allowed_bits=allowed_bits, final=final,
                   initial=index[initial], key=key)


def _canonical_states(transitions: dict, initial, finals) -> list:
    """The state names of an automaton in a canonical order: breadth first
    from ``initial``, each state's edges taken by ascending token id, then
    the states not reached from it (sorted where their names compare, else
    as they come). Numbering states by this order makes the tables of one
    automaton the same arrays on every build, whatever order its
    ``transitions`` come in."""
    names, seen = [initial], {initial}
    for state in names:  # grows while walked: breadth first
        targets = transitions.get(state, {})
        for token in sorted(targets):
            target = targets[token]
            if target not in seen:
                seen.add(target)
                names.append(target)
    rest = [name for name in dict.fromkeys([*transitions, *finals,
                                             *(t for targets in transitions.values() for t in targets.values())])
            if name not in seen]
    try:
        rest.sort()
    except TypeError:  # names that do not compare keep their order
        pass
    return names + rest


@struct.dataclass
class RowConstraints:
    """A batch's constraints on the device (module docstring).

    Fields: ``allowed_bits [S, W]`` uint32 and ``next_state [S, C]`` int32
    of every automaton in the batch, stacked (global state numbers; state 0
    the universal one); ``class_of [A, V]`` int32, automaton ``a``'s token
    classes; per row ``automaton [B]`` and ``state [B]`` int32 (0 and 0: an
    unconstrained row); ``row_bits [B, W]`` uint32, a mask computed on the
    host for each row's next token and ANDed with its state's (a grammar
    row, :mod:`jaxkv.serve.grammar`; every bit set for the others), or None
    when no row has one (then nothing is computed for it)."""

    allowed_bits: Int[Array, "S W"]
    next_state: Int[Array, "S C"]
    class_of: Int[Array, "A V"]
    automaton: Int[Array, " B"]
    state: Int[Array, " B"]
    row_bits: Int[Array, "B W"] | None = None


def allowed_tokens(constraints: RowConstraints, states: Int[Array, " B"], vocab: int) -> Bool[Array, "B V"]:
    """Per row, the tokens ``states`` allow (``[B, vocab]`` bool), and its
    ``row_bits`` where given."""
    words = constraints.allowed_bits[states]  # [B, W]
    if constraints.row_bits is not None:
        words = words & constraints.row_bits
    bits = (words[:, :, None] >> jnp.arange(32, dtype=jnp.uint32)) & jnp.uint32(1)
    return bits.reshape(words.shape[0], -1)[:, :vocab].astype(bool)


def constrain(logits: Float[Array, "B V"], constraints: RowConstraints | None,
              states: Int[Array, " B"] | None = None) -> Float[Array, "B V"]:
    """``logits`` with every token the row's state (``states``, default
    ``constraints.state``) does not allow at -inf; as they are when
    ``constraints`` is None."""
    if constraints is None:
        return logits
    states = constraints.state if states is None else states
    return jnp.where(allowed_tokens(constraints, states, logits.shape[-1]), logits, -jnp.inf)


def advance(constraints: RowConstraints, states: Int[Array, " B"], tokens: Int[Array, " B"],
            took: Bool[Array, " B"]) -> Int[Array, " B"]:
    """Each row's state after the token it sampled (rows that did not
    ``took`` one, and tokens the state does not allow, keep it)."""
    classes = constraints.class_of[constraints.automaton, jnp.clip(tokens, 0, constraints.class_of.shape[1] - 1)]
    after = constraints.next_state[states, classes]
    return jnp.where(took & (after >= 0), after, states)


def _pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def stack_automata(automata: list[TokenAutomaton], vocab: int) -> tuple[RowConstraints, list[int]]:
    """The device tables of ``automata`` (after the universal automaton 0)
    with per-row fields for a batch of one unconstrained row, and each
    automaton's first global state. Sizes are rounded up to powers of two
    (one program per bucket, not per set of automata); ``vocab``: the
    logits' width (every automaton's ``vocab_size`` must equal it)."""
    for a in automata:
        if a.vocab_size != vocab:
            raise InvalidArgument(f"constraint {a.key!r} was built for {a.vocab_size} tokens, the model has {vocab}")
    words = -(-vocab // 32)
    offsets, at = [], 1
    for a in automata:
        offsets.append(at)
        at += a.num_states
    num_states = _pow2(at)
    num_classes = _pow2(max([a.num_classes for a in automata] + [1]))
    bits = np.zeros((num_states, words), np.uint32)
    bits[0] = np.uint32(0xFFFFFFFF)
    next_state = np.zeros((num_states, num_classes), np.int32)  # state 0 (and padding) stays at 0
    class_of = np.zeros((_pow2(len(automata) + 1), vocab), np.int32)
    for k, (a, offset) in enumerate(zip(automata, offsets)):
        span = slice(offset, offset + a.num_states)
        bits[span] = a.allowed_bits
        table = np.full((a.num_states, num_classes), -1, np.int32)
        table[:, :a.num_classes] = np.where(a.next_state >= 0, a.next_state + offset, -1)
        next_state[span] = table
        class_of[k + 1] = a.class_of
    zeros = np.zeros(1, np.int32)
    return RowConstraints(allowed_bits=jnp.asarray(bits), next_state=jnp.asarray(next_state),
                          class_of=jnp.asarray(class_of), automaton=zeros, state=zeros), offsets
