"""A request's record and its intake: what :meth:`Engine.add_request
<jaxkv.serve.Engine.add_request>` checks before anything is queued, the
record the scheduler moves through its life cycle, and what one step
reports per request (:class:`RequestOutput`).

Intake refuses, naming the argument, whatever could fail later inside a
step (:mod:`jaxkv.serve.faults`): token ids
outside the vocabulary, counts and seeds that are not integers a device
type holds, sampling that is not a :class:`~jaxkv.nn.sampling.SamplingParams`
(which checks its own fields), stop strings without a tokenizer, and a
request that could never fit the cache."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Hashable

import jax
import numpy as np

from jaxkv import _host
from jaxkv.errors import InvalidArgument
from jaxkv.nn.constraints import TokenAutomaton
from jaxkv.nn.penalties import OFF, Penalties
from jaxkv.nn.sampling import MAX_TOP_LOGPROBS, SamplingParams
from jaxkv.serve.grammar import GrammarState, HostGrammar

__all__ = ["Request", "RequestOutput", "RequestState", "check_token_ids", "find_stop", "new_request",
           "request_key_data"]


class RequestState(enum.Enum):
    """Where a request is in its life cycle (see the module docstring)."""

    WAITING = "waiting"  # queued: not arrived, not admitted yet, or preempted for recomputation
    RUNNING = "running"  # holds a sequence row and device blocks
    SWAPPED = "swapped"  # holds a sequence row whose blocks are in host memory
    FINISHED = "finished"  # done; its tokens are in Engine.outputs


@dataclasses.dataclass(frozen=True, slots=True)
class RequestOutput:
    """What one request produced in one :meth:`Engine.step`.

    ``new_token_ids``: the tokens it made in this step, in order (a decode
    chunk makes several; a stop token or EOS is included, tokens a stop
    condition cut off are not); ``finished``: whether it is done, and
    ``finish_reason``: ``"stop"`` (EOS, a stop token id or a stop string),
    ``"length"`` (``max_new_tokens``), ``"abort"`` (:meth:`Engine.abort`),
    ``"error"`` (its own part of a step failed, or it was in flight at
    :data:`MAX_REQUEST_FAULTS` failed steps: ``error`` says why), or None
    while it runs; ``new_text``: with a tokenizer, the text those
    tokens complete (stop tokens and EOS add none; with stop strings, the
    last ``len(longest stop string) - 1`` characters are held back until
    they cannot begin one, and a stop string and what follows it are never
    emitted), else ``""``; ``cached_tokens``: prompt tokens served from the
    prefix cache at its admission (its latest one, after a recompute
    preemption; OpenAI's ``usage.prompt_tokens_details.cached_tokens``).
    With speculative decoding: ``draft_tokens`` (drafts its verify steps
    checked so far) and ``accepted_draft_tokens`` (of them kept); 0 without.
    ``new_logprobs`` (a request that asked for ``logprobs``; None
    otherwise): per new token ``(logprob, ((token id, logprob), ...))``,
    the token's log-probability and the ``logprobs`` most likely tokens'
    (most likely first), read where the engine's ``logprobs_mode`` says
    (:func:`jaxkv.nn.sampling.token_logprobs`). ``prompt_logprobs`` (a
    request that asked for ``prompt_logprobs``, in the output that carries
    its first token; None otherwise): per prompt token, None for the first,
    then ``(logprob, rank, ((token id, logprob), ...))``: the token's
    log-probability given the tokens before it under the model's softmax
    (raw: no temperature, penalty or constraint applies to a prompt), its
    rank (1: the most likely) and the ``prompt_logprobs`` most likely
    tokens'.
    """

    request_id: int
    new_token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None
    new_text: str = ""
    cached_tokens: int = 0
    error: str | None = None
    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    new_logprobs: tuple | None = None
    prompt_logprobs: tuple | None = None

    @classmethod
    def _make(cls, request_id: int, new_token_ids: tuple, finished: bool, finish_reason: str | None,
              new_text: str, cached_tokens: int, error: str | None, draft_tokens: int = 0,
              accepted_draft_tokens: int = 0, new_logprobs: tuple | None = None,
              prompt_logprobs: tuple | None = None) -> "RequestOutput":
        """The same object as the constructor's, for the engine's per-step
        outputs (one per request that moved: 256 a step at 256 rows). A
        frozen dataclass's ``__init__`` sets each field through
        ``object.__setattr__``, a call each; this builds the object as its
        mutable twin :class:`_OutputBuilder` (the same fields in the same
        slots: a plain ``__init__``), then makes it a ``RequestOutput``
        (``__class__`` assignment, which Python allows between classes of
        the same layout). Fields, equality, hash, repr and frozenness are
        the dataclass's. At 256 rows this is a tenth of a packed
        iteration's host time less than an instance dict filled at once."""
        out = _OutputBuilder(request_id, new_token_ids, finished, finish_reason, new_text, cached_tokens, error,
                             draft_tokens, accepted_draft_tokens, new_logprobs, prompt_logprobs)
        out.__class__ = cls
        return out


# RequestOutput's mutable twin (RequestOutput._make): made from its fields, so the two never differ in layout.
_OutputBuilder = dataclasses.make_dataclass(
    "_OutputBuilder",
    [(f.name, f.type, dataclasses.field(default=f.default)) for f in dataclasses.fields(RequestOutput)], slots=True)


@dataclasses.dataclass(slots=True, eq=False)
class Request:
    """The engine's record of one request (host only; the cache holds its
    device state on row ``row``). Records compare by identity: ``req in
    list`` and ``list.remove(req)`` find the record itself without comparing
    every field of every other record."""

    id: int
    prompt: list
    max_new: int
    sampling: SamplingParams
    eos_id: int  # the stop id the device checks (-1: none)
    arrival: int
    namespace: Hashable
    key: np.ndarray  # PRNG key data of the request's own stream (advanced as it samples)
    # The fields every step reads for every running request next: with __slots__ they share the object's
    # first cache lines (a step's first pass over 256 records after a device call misses on each line).
    state: RequestState = RequestState.WAITING
    pieces: list = dataclasses.field(default_factory=list)  # (start, end) prompt pieces still to prefill
    generated: list = dataclasses.field(default_factory=list)
    detok: object = None  # incremental detokenizer (with a tokenizer)
    stop_ids: frozenset = frozenset()  # every stop token id (eos included): checked on the host
    first_token_at: float | None = None
    last_token_at: float | None = None
    logprobs: int | None = None  # top log-probabilities asked per token (None: none; 0: the token's own only)
    penalties: Penalties = OFF  # penalties, logit bias and min_tokens (jaxkv.nn.penalties)
    constraint: TokenAutomaton | None = None  # structured output (jaxkv.nn.constraints), None: unconstrained
    grammar: GrammarState | None = None  # a context-free grammar, masked on the host (jaxkv.serve.grammar)
    row: int = -1  # sequence row while RUNNING or SWAPPED, else -1
    cached_tokens: int = 0  # prompt tokens its latest admission served from the prefix cache
    spec_drafted: int = 0  # draft tokens its verify steps checked
    spec_accepted: int = 0  # of which it kept
    prompt_logprobs: int | None = None  # top log-probabilities asked per prompt token (None: its prompt unscored)
    stop: tuple = ()  # stop strings
    text: str = ""  # the detokenized output so far (a stop string cut off)
    emitted: int = 0  # characters of ``text`` already given out in a RequestOutput
    finish_reason: str | None = None
    error: str | None = None  # why it finished with "error"
    faults: int = 0  # failed steps it was in flight for (MAX_REQUEST_FAULTS finishes it)
    hit: object = None  # its pinned prefix hit (PrefixHit) while running (None once a window trimmed it away)
    shared: object = None  # per group, the blocks of its admission's hit (shared with the prefix cache)
    lane: object = None  # its PrefillLane while its prompt is prefilled
    order: int = -1  # admission order (preemption picks the largest)
    arrived_at: float | None = None  # wall time when the scheduler first saw it arrived
    spec_on: bool = True  # with speculation: whether it still drafts (jaxkv.serve.speculation's rule)
    spec_steps: int = 0  # verify steps with drafts it ran
    spec_probe_steps: int = 0  # of which on probation (one draft each: jaxkv.serve.speculation)
    spec_probe_kept: int = 0  # and the drafts they kept
    spec_full_steps: int = 0  # of which with k drafts, after probation
    spec_full_kept: int = 0  # and the drafts they kept
    token_logprobs: list = dataclasses.field(default_factory=list)  # with logprobs: one entry per generated token
    prompt_scores: dict = dataclasses.field(default_factory=dict)  # prompt index -> (logprob, rank, top entries)
    prompt_scores_given: bool = False  # whether an output carried them
    constraint_state: int = -1  # its automaton's state after the first constraint_read generated tokens
    constraint_read: int = 0
    fork_of: int | None = None  # the sibling whose prompt's KV this one forks (Engine.add_request's fork_of)
    grammar_bits: np.ndarray | None = None  # its mask for the next token, computed when the request is screened

    def automaton_state(self) -> int:
        """The constraint's state after every generated token (walked on
        the host from where it was last read: the device advances its own
        copy inside decode loops)."""
        if self.constraint_read > len(self.generated):  # recomputed from the start (preemption)
            self.constraint_state, self.constraint_read = self.constraint.initial, 0
        new = self.generated[self.constraint_read:]
        state = self.constraint.walk(self.constraint_state, new)
        if state < 0:  # a token the device's mask allowed must be allowed here: stop where it was
            raise InvalidArgument(f"request {self.id}: generated token outside its constraint {self.constraint.key!r}")
        self.constraint_state, self.constraint_read = state, len(self.generated)
        return state

    @property
    def tokens(self) -> list:
        return self.prompt + self.generated

    def tokens_between(self, start: int, stop: int) -> list:
        """``tokens[start:stop]``, sliced where they lie (no copy of the
        whole context)."""
        cut = len(self.prompt)
        return (list(self.prompt[start:min(stop, cut)])
                + list(self.generated[max(start - cut, 0):max(stop - cut, 0)]))

    @property
    def kv_len(self) -> int:
        """Tokens whose K/V are in the cache: all but the last sampled one."""
        return len(self.prompt) + len(self.generated) - 1


def _stop_strings(stop) -> tuple[str, ...]:
    """``stop`` (a string or a sequence of strings) as a tuple of non-empty
    strings (None: none), else ``InvalidArgument``."""
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = (stop,)
    try:
        stop = tuple(stop)
    except TypeError:
        raise InvalidArgument(f"stop={stop!r}: give a string or a sequence of strings") from None
    if not all(isinstance(x, str) and x for x in stop):
        raise InvalidArgument(f"stop={list(stop)!r}: stop strings must be non-empty strings")
    return stop


def find_stop(text: str, stops: tuple, start: int) -> int | None:
    """Where the earliest of ``stops`` begins in ``text`` at or after ``start``."""
    found = [i for i in (text.find(stop, start) for stop in stops) if i >= 0]
    return min(found) if found else None


def check_token_ids(ids: list, name: str, vocab: int | None) -> None:
    """``InvalidArgument`` naming ``name`` for ids outside the vocabulary
    (the embedding lookup would not fail, it would read garbage)."""
    bad = [t for t in ids if t < 0 or (vocab is not None and t >= vocab)]
    if bad:
        raise InvalidArgument(f"{name} holds token ids outside the vocabulary [0, {vocab or '...'}): "
                              f"{_host.preview(bad)}")


def _penalties(penalties, vocab: int | None, max_new_tokens: int) -> Penalties:
    """``penalties`` (a :class:`~jaxkv.nn.penalties.Penalties`, a dict of its
    fields, or None) checked against the vocabulary and ``max_new_tokens``."""
    if penalties is None:
        return OFF
    if isinstance(penalties, dict):
        unknown = sorted(set(penalties) - {f.name for f in dataclasses.fields(Penalties)})
        if unknown:
            raise InvalidArgument(f"penalties: unknown keys {unknown}")
        penalties = Penalties(**penalties)
    if not isinstance(penalties, Penalties):
        raise InvalidArgument(f"penalties must be a Penalties or a dict of its fields, got {penalties!r}")
    check_token_ids([token for token, _ in penalties.logit_bias], "penalties.logit_bias", vocab)
    if penalties.min_tokens > max_new_tokens:
        raise InvalidArgument(f"penalties.min_tokens={penalties.min_tokens} is more than max_new_tokens="
                              f"{max_new_tokens}")
    return penalties


@jax.jit
def request_key_data(engine_key, rid):
    """The key data of request ``rid``'s own stream, ``fold_in(engine_key,
    rid)`` (``rid`` a uint32), compiled once: the eager ``fold_in``
    dispatched each of its operations, about 0.4 ms a request on the
    2-core VM (10,000 queued requests: seconds)."""
    return jax.random.key_data(jax.random.fold_in(engine_key, rid))


def new_request(rid: int, prompt_tokens, max_new_tokens, *, sampling, eos_token_id, stop_token_ids, stop,
                namespace, seed, arrival_step, now_step: int, vocab: int | None, has_tokenizer: bool, cache,
                engine_key, logprobs=None, penalties=None, constraint=None, prompt_logprobs=None) -> Request:
    """The record of request ``rid`` from :meth:`Engine.add_request
    <jaxkv.serve.Engine.add_request>`'s arguments (that method documents
    them and what is refused), checked against the vocabulary ``vocab``
    and the limits of ``cache``; ``InvalidArgument`` naming the argument
    otherwise, with nothing queued. Its PRNG stream: ``key(seed)``, or the
    engine's key folded with ``rid``."""
    prompt = _host.int_array(prompt_tokens, "prompt_tokens", ndim=1).tolist()
    if not prompt:
        raise InvalidArgument("prompt_tokens is empty: a request needs at least one token")
    check_token_ids(prompt, "prompt_tokens", vocab)
    max_new_tokens = _host.int_at_least(max_new_tokens, "max_new_tokens", 1)
    eos_id = -1
    if eos_token_id is not None:
        eos_id = _host.int_scalar(eos_token_id, "eos_token_id")
        check_token_ids([eos_id], "eos_token_id", vocab)
    try:
        stop_ids = [] if stop_token_ids is None else list(stop_token_ids)
    except TypeError:
        raise InvalidArgument(f"stop_token_ids={stop_token_ids!r}: give a sequence of token ids") from None
    stop_ids = _host.int_array(stop_ids, "stop_token_ids", ndim=1).tolist() if stop_ids else []
    check_token_ids(stop_ids, "stop_token_ids", vocab)
    stop = _stop_strings(stop)
    if stop and not has_tokenizer:
        raise InvalidArgument(f"stop={list(stop)}: stop strings need the engine's tokenizer "
                              "(Engine(model, tokenizer=...)); give stop_token_ids instead")
    # A request added after its arrival step arrives now: queued after those already there.
    arrival = max(_host.int_at_least(arrival_step, "arrival_step", 0), now_step)
    if not isinstance(sampling, SamplingParams):
        raise InvalidArgument(f"sampling must be a SamplingParams, got {sampling!r}")
    try:
        hash(namespace)
    except TypeError:
        raise InvalidArgument(f"namespace must be hashable, got {namespace!r}") from None
    total = len(prompt) + max_new_tokens
    blocks = cache.peak_blocks(len(prompt), total)
    if total > cache.max_context_tokens or np.any(blocks > cache.capacity):
        raise InvalidArgument(
            f"add_request: {len(prompt)} + {max_new_tokens} tokens need blocks {blocks.tolist()} of groups "
            f"{list(cache.groups)} at their peak and can never fit: {cache.limits()}")
    if logprobs is not None:
        logprobs = _host.int_at_least(logprobs, "logprobs", 0)
        if logprobs > MAX_TOP_LOGPROBS:
            raise InvalidArgument(f"logprobs={logprobs}: at most {MAX_TOP_LOGPROBS} top log-probabilities per token")
    penalties = _penalties(penalties, vocab, max_new_tokens)
    grammar = None
    if constraint is not None:
        if not isinstance(constraint, (TokenAutomaton, HostGrammar)):
            raise InvalidArgument(f"constraint must be a TokenAutomaton or a HostGrammar "
                                  f"(jaxkv.serve.structured.compile_constraint), got {type(constraint).__name__}")
        if vocab is not None and constraint.vocab_size != vocab:
            raise InvalidArgument(f"constraint {constraint.key!r} was built for {constraint.vocab_size} tokens; the "
                                  f"model has {vocab}")
        if isinstance(constraint, HostGrammar):  # parsed on the host, one state per request
            constraint, grammar = None, constraint.state()
    if prompt_logprobs is not None:
        prompt_logprobs = _host.int_at_least(prompt_logprobs, "prompt_logprobs", 0)
        if prompt_logprobs > MAX_TOP_LOGPROBS:
            raise InvalidArgument(f"prompt_logprobs={prompt_logprobs}: at most {MAX_TOP_LOGPROBS} top "
                                  "log-probabilities per prompt token")
    if seed is not None:
        seed = _host.int_scalar(seed, "seed")
    key_data = (request_key_data(engine_key, np.uint32(rid)) if seed is None
                else jax.random.key_data(jax.random.key(seed)))
    device_stop = eos_id if eos_id >= 0 else (stop_ids[0] if stop_ids else -1)
    return Request(rid, prompt, max_new_tokens, sampling, device_stop, arrival, namespace, np.asarray(key_data),
                   stop_ids=frozenset(stop_ids + ([eos_id] if eos_id >= 0 else [])), stop=stop, logprobs=logprobs,
                   penalties=penalties, constraint=constraint, prompt_logprobs=prompt_logprobs,
                   constraint_state=-1 if constraint is None else constraint.initial, grammar=grammar)
