"""The engine's side of speculative decoding (``Engine(...,
speculative=...)``, the server's ``--speculative-config``).

A decode iteration whose running requests speculate runs
:func:`jaxkv.serve.caches.speculative_chunk` instead of the plain decode
chunk: ``decode_chunk`` verify steps in one jitted loop, each feeding a row
its next token and up to ``num_speculative_tokens`` prompt-lookup drafts
(:mod:`jaxkv.nn.speculative`; the drafts are found on the device from the
row's history). That history stays on the device (:class:`Speculation`):
one ``[max_seqs, width]`` array of each row's prompt and output, which each
call that reads it returns updated (the chunk appends what it emits); the
host sends only what changed since (a new request's tokens once, then the
tokens plain chunks and packed steps added).

A verify step computes ``k + 1`` positions for every row, so it costs more
than a decode step (on the 2-core CPU with SmolLM2 at batch 4, k = 4: 1.7x);
it pays when the rows keep enough drafts. ``min_accepted_per_step`` (θ) is
that break-even, in drafts kept per verify step and row (derived when not
given: :func:`break_even`). The rules read counts only (never timings, so
the engine stays deterministic: processes in lockstep, seeded sampling
reproducible):

* **probation**: a request's first ``PROBATION_STEPS`` verify steps with a
  draft verify **one** draft each (a chunk of ``PROBATION_STEPS`` steps at
  ``k = 1`` runs while any running request is on probation: two positions
  per row, not ``k + 1``, so a request that keeps nothing costs little).
  Its acceptance rate ``a`` there gives the drafts a ``k``-draft step
  would keep, ``a + a^2 + ... + a^k``; below θ it stops speculating;
* afterwards a decode iteration runs ``k``-draft verify steps only when its
  speculating rows together are expected to keep at least θ drafts per
  running row (a request's expectation: its own rate over its ``k``-draft
  steps once it has ``PROBATION_STEPS`` of them, else what its probation
  implied); otherwise it runs the plain decode chunk;
* a request that, after ``PROBATION_STEPS`` ``k``-draft steps, kept fewer
  than θ per step stops speculating.

With ``{"method": "draft_model", "draft_layers": d}`` the drafts come
from the target's own first ``d`` layers, its final norm and head (a
self-speculative early exit, :func:`jaxkv.nn.speculative.early_exit_draft`
with ``share_pool``): over a paged pool (the Llama family, DeepSeek-V3)
the draft runs on the target's cache itself, so it costs no memory, no
prefill and no rollback of its own, and prefix hits, swaps, preemption and
scrubbing serve it unchanged. Its ``k`` draft steps cost about ``k d / L``
decode steps of the target (``L`` layers), which θ adds (:func:`break_even`).
With ``{"method": "draft_model", "model": m}`` (a jaxkv paged-pool model
or a checkpoint path, same vocabulary; any target, a hybrid cache's too)
the draft keeps a paged cache of its own, filled lazily in the
speculative chunks themselves (:class:`jaxkv.serve.drafts.DraftCache`);
θ adds ``k`` times its parameters over the target's. Its requests bring
one token in packed iterations (its cache is caught up in the speculative
chunks only) and verify in decode chunks; an early exit's verify in
packed iterations too (below).

Packed iterations (prompts being prefilled beside decoding requests, one
model call) carry **verify lanes**: a request past its probation and
expected to keep θ drafts brings its token and ``k`` placeholders, which
the device fills with drafts from the row's history and verifies in the
same call as the prompt pieces and the other decode lanes (an early
exit's drafts are drawn there by its ``k`` decode steps over the lanes'
appended positions, before the packed model call;
:func:`jaxkv.nn.speculative.paged_packed_verify_step` over a paged pool,
:func:`jaxkv.nn.speculative.hybrid_packed_verify_step` over a hybrid
cache, its rollback inside the call); the verify lanes take ``k`` more
tokens of the step's budget each.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxkv._ops import pow2_at_least
from jaxkv.nn.speculative import SpeculativeConfig

__all__ = ["PROBATION_STEPS", "Speculation", "break_even", "on_probation"]

#: Verify steps with a draft a request runs at one draft each before its acceptance is judged (and
#: ``k``-draft steps before its own rate replaces what the probation implied).
PROBATION_STEPS = 4


def break_even(config: SpeculativeConfig, draft_fraction: float = 0.0) -> float:
    """θ: ``config.min_accepted_per_step``, or when None the device's: 1.0
    on a CPU (a verify step of k + 1 positions is compute: 1.7x a decode
    step measured with SmolLM2, batch 4, k = 4, so 0.7 kept drafts per step
    break even; 1.0 leaves a margin), 0.25 on an accelerator (decode reads
    the weights and the KV whatever the positions: a verify step at small
    batch costs about a decode step), plus, for a draft model, the ``k``
    draft steps it runs per verify step, each ``draft_fraction`` of a
    target decode step (an early exit's layers over the target's), capped
    at ``k``."""
    if config.min_accepted_per_step is not None:
        return float(config.min_accepted_per_step)
    base = 1.0 if jax.default_backend() == "cpu" else 0.25
    k = config.num_speculative_tokens
    return min(base + k * draft_fraction, float(k))


class Speculation:
    """The host half of the engine's speculation: the rows' token
    histories, the per-request acceptance record and the rules that turn a
    request's speculation off (module docstring).

    The histories live on the device (:attr:`base`, ``[max_seqs,
    width]``), the array each call that reads them returns updated: the
    host sends only what changed since (:attr:`pending`, applied first in
    that call: :meth:`history_arguments`), and a speculative chunk writes
    the tokens it emits itself. Invariant: for a row whose ``owner`` is
    request ``r``, :attr:`base` with :attr:`pending` applied holds ``r``'s
    first ``length[row]`` tokens in ``[row, :length[row]]`` (prompt then
    output; capped at ``width``)."""

    def __init__(self, config: SpeculativeConfig, max_seqs: int, cache, draft=None):
        self.config = config
        #: The probation chunks' config: one draft per verify step.
        self.probe = dataclasses.replace(config, num_speculative_tokens=1, min_accepted_per_step=None)
        #: A draft model (:mod:`jaxkv.serve.drafts`: an early exit over the target's pool or a separate model
        #: with a cache of its own), or None (n-gram).
        self.draft = draft
        self.theta = break_even(config, 0.0 if draft is None else draft.cost_fraction)
        # Room for the longest request and the tokens a chunk appends on the device (writes past it are dropped
        # there: the lookup then just does not see them).
        self.width = pow2_at_least(cache.max_context_tokens + 1)
        self.max_seqs = max_seqs
        self._forget()

    def arguments(self, running: dict, decode_chunk: int):
        """``(config, history, history_len, speculate, steps, draft)`` for a
        decode chunk of the requests ``running`` (row -> request), or None
        when the chunk runs plain (module docstring); ``draft``:
        :attr:`draft`, its plan for the chunk made (the histories are kept
        for n-gram lookup only; a separate draft's cache may take rows out
        of ``speculate``: :meth:`jaxkv.serve.drafts.DraftCache.plan`).
        While a speculating request is
        on probation: ``PROBATION_STEPS`` verify steps of one draft
        (``config`` is :attr:`probe`); else ``decode_chunk`` steps of ``k``
        drafts when the speculating requests are expected to keep θ drafts
        per running request together."""
        speculating = [(row, req) for row, req in running.items() if req.spec_on]
        if not speculating:
            return None
        if any(on_probation(req) for _, req in speculating):
            config, steps = self.probe, min(PROBATION_STEPS, decode_chunk)
        elif sum(self.expected(req) for _, req in speculating) >= self.theta * len(running):
            config, steps = self.config, decode_chunk
        else:
            return None
        speculate = np.zeros(self.length.shape, bool)
        for row, req in speculating:
            speculate[row] = True
            if self.draft is None:
                self._sync(row, req)
        if self.draft is not None:  # a separate draft's cache may leave rows out of this chunk
            speculate = self.draft.plan(running, speculate, steps, config.num_speculative_tokens)
            if not speculate.any():
                return None
        # The chunk appends each synced row's emitted tokens to its history; the others' are left alone (a
        # length past the width drops the writes).
        self._synced = speculate if self.draft is None else np.zeros_like(speculate)
        history_len = np.where(self._synced, self.length, self.width).astype(np.int32)
        return config, self.history_arguments(), history_len, speculate, steps, self.draft

    def history_arguments(self) -> tuple:
        """``(base, updates)`` for a call that reads the histories:
        :attr:`base` (zeros from the host before the first call), and the
        pending writes as ``(rows, columns, tokens)`` int32 vectors of a
        power-of-two length of at least 64 (padding rows ``max_seqs``: the
        scatter drops them). The call returns the histories updated, for
        :meth:`took`."""
        base = self.base if self.base is not None else np.zeros((self.max_seqs, self.width), np.int32)
        count = sum(len(tokens) for _, _, tokens in self.pending)
        size = max(pow2_at_least(count), 64)
        rows = np.full((size,), self.max_seqs, np.int32)
        columns = np.zeros((size,), np.int32)
        values = np.zeros((size,), np.int32)
        at = 0
        for row, start, tokens in self.pending:
            n = len(tokens)
            rows[at:at + n], columns[at:at + n], values[at:at + n] = row, np.arange(start, start + n), tokens
            at += n
        return base, (rows, columns, values)

    def took(self, history, counts=None) -> None:
        """After a call given :meth:`history_arguments`: ``history`` (its
        updated histories, on the device) becomes :attr:`base` and the
        pending writes are done. ``counts`` (a speculative chunk's tokens
        per row): the rows synced for it grew by them on the device."""
        self.base, self.pending = history, []
        if counts is not None:
            synced = self._synced
            self.length = np.where(synced, np.minimum(self.length + np.asarray(counts), self.width),
                                   self.length).astype(np.int32)

    def rebuilt(self) -> None:
        """Forget the rows' histories and empty a draft's cache (after the
        engine rebuilt its cache: rows now serve other requests; a failed
        call may have taken :attr:`base`)."""
        self._forget()
        if self.draft is not None:
            self.draft.rebuilt()

    def _forget(self) -> None:
        """No history on the device yet, none pending, no row owned."""
        #: The rows' histories on the device (None: none yet; the first call takes zeros from the host).
        self.base = None
        #: Writes :attr:`base` has not had yet: ``(row, first column, tokens)``.
        self.pending: list = []
        self.length = np.zeros((self.max_seqs,), np.int32)
        self.owner: list = [None] * self.max_seqs
        self._synced = np.zeros((self.max_seqs,), bool)

    def packed_arguments(self, decoding: list, budget: int):
        """``(speculation, verify)`` for a packed step whose decode lanes are
        ``decoding`` (``(row, request)`` in lane order), or ``(None, None)``:
        the requests past probation expected to keep θ drafts per step
        verify ``k`` drafts in the step (as many as leave a token of
        ``budget`` to the prompts; ``verify``: a bool per decode lane), the
        others bring their one token. ``speculation`` is what
        :meth:`~jaxkv.serve.caches.CacheBase.packed_step` takes: ``(config,
        histories, history_len, verify, draft)``, ``draft`` an early exit's
        ``(graphdef, params)`` (its drafts are drawn in the packed call)
        or None (n-gram). A separate draft model's requests bring one token
        (its cache is caught up in the speculative chunks only)."""
        if self.draft is not None and not self.draft.packs_verify_lanes:
            return None, None
        k = self.config.num_speculative_tokens
        room = max(budget - len(decoding) - 1, 0) // k
        verify = np.zeros((len(decoding),), bool)
        for lane, (row, req) in enumerate(decoding):
            if room and req.spec_on and not on_probation(req) and self.expected(req) >= self.theta:
                verify[lane] = True
                room -= 1
                if self.draft is None:
                    self._sync(row, req)
        if not verify.any():
            return None, None
        draft = None if self.draft is None else (self.draft.graphdef, self.draft.params)
        return (self.config, self.history_arguments(), self.length.copy(), verify, draft), verify

    def record_packed(self, decoding: list, first_lane: int, result, counters) -> None:
        """:meth:`record` for a packed step's verify lanes (decode lane ``j``
        is lane ``first_lane + j`` of ``result``): ``k``-draft steps."""
        lanes = np.arange(first_lane, first_lane + len(decoding))
        verified = {row: req for (row, req), lane in zip(decoding, lanes) if result.drafted[lane] > 0}
        by_row = [np.zeros(self.length.shape, np.int64) for _ in range(3)]
        for (row, _), lane in zip(decoding, lanes):
            if row in verified:
                by_row[0][row], by_row[1][row], by_row[2][row] = result.drafted[lane], result.accepted[lane], 1
        self.record(verified, self.config, *by_row, counters)
        counters.spec_packed_drafted += int(by_row[0].sum())

    def expected(self, req) -> float:
        """Drafts ``req`` is expected to keep per ``k``-draft verify step:
        its own rate over ``PROBATION_STEPS`` or more such steps, else what
        its probation's acceptance rate implies."""
        if req.spec_full_steps >= PROBATION_STEPS:
            return req.spec_full_kept / req.spec_full_steps
        rate = req.spec_probe_kept / max(req.spec_probe_steps, 1)
        return sum(rate ** i for i in range(1, self.config.num_speculative_tokens + 1))

    def _sync(self, row: int, req) -> None:
        """Bring row ``row``'s history to ``req``'s tokens: what changed goes
        to :attr:`pending` (a new request's tokens once, then what was added)."""
        total = min(len(req.prompt) + len(req.generated), self.width)
        have = int(self.length[row]) if self.owner[row] == req.id else 0
        if have < total:
            self.pending.append((row, have, np.asarray(req.tokens_between(have, total), np.int32)))
        self.length[row], self.owner[row] = total, req.id

    def record(self, running: dict, config: SpeculativeConfig, drafted: np.ndarray, accepted: np.ndarray,
               steps: np.ndarray, counters) -> None:
        """After a speculative chunk of ``config``: each request's drafts
        verified and kept (its ``RequestOutput``'s counts and the engine's
        totals), its probation or ``k``-draft record, and the off rules."""
        one_draft = config.num_speculative_tokens == 1  # a probation chunk (with k = 1, every chunk)
        full = config.num_speculative_tokens == self.config.num_speculative_tokens
        for row, req in running.items():
            if not req.spec_on:
                continue
            kept, ran = int(accepted[row]), int(steps[row])
            req.spec_drafted += int(drafted[row])
            req.spec_accepted += kept
            req.spec_steps += ran
            if one_draft and on_probation(req):
                req.spec_probe_steps += ran
                req.spec_probe_kept += kept
                if not on_probation(req) and self.expected(req) < self.theta:
                    req.spec_on = False
            elif full:
                req.spec_full_steps += ran
                req.spec_full_kept += kept
                if req.spec_full_steps >= PROBATION_STEPS and req.spec_full_kept < self.theta * req.spec_full_steps:
                    req.spec_on = False
        counters.spec_drafted += int(drafted.sum())
        counters.spec_accepted += int(accepted.sum())


def on_probation(req) -> bool:
    """Whether ``req`` has verified fewer than ``PROBATION_STEPS`` single drafts."""
    return req.spec_probe_steps < PROBATION_STEPS
