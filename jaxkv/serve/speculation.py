"""The engine's side of speculative decoding (``Engine(...,
speculative=...)``, the server's ``--speculative-config``).

A decode iteration whose running requests speculate runs
:func:`jaxkv.serve.caches.speculative_chunk` instead of the plain decode
chunk: ``decode_chunk`` verify steps in one jitted loop, each feeding a row
its next token and up to ``num_speculative_tokens`` prompt-lookup drafts
(:mod:`jaxkv.nn.speculative`; the drafts are found on the device from the
row's history). The host keeps that history (:class:`Speculation`): one
``[max_seqs, width]`` array of each row's prompt and output, written only
where a row's request or length changed since the last chunk (a new
request's tokens once, then the tokens each chunk added).

A verify step computes ``k + 1`` positions for every row, so it costs more
than a decode step (on the 2-core CPU with SmolLM2 at batch 4, k = 4: 1.7x);
it pays when the rows keep enough drafts. ``min_accepted_per_step`` (θ) is
that break-even, in drafts kept per verify step and row (derived when not
given: :func:`break_even`). Two rules, both on counts only (never on
timings, so the engine stays deterministic: processes in lockstep, seeded
sampling reproducible):

* a request that, after ``PROBATION_STEPS`` verify steps with drafts, kept
  fewer than θ drafts per such step stops speculating;
* a decode iteration runs verify steps only when its speculating rows
  together are expected to keep at least θ drafts per running row (a
  request's expectation is its own rate, or θ while on probation);
  otherwise it runs the plain decode chunk. While a request is on
  probation the chunk runs ``PROBATION_STEPS`` verify steps, not a whole
  ``decode_chunk``, so it is judged early.

Packed iterations (prompts being prefilled beside decoding requests) decode
their requests one token each, without drafts: the packed stream's decode
lanes bring one token (verify lanes in the packed step are not built yet).
"""

from __future__ import annotations

import jax
import numpy as np

from jaxkv._ops import pow2_at_least
from jaxkv.nn.speculative import SpeculativeConfig

__all__ = ["PROBATION_STEPS", "Speculation", "break_even"]

#: Verify steps with drafts a request runs before its acceptance is judged.
PROBATION_STEPS = 4


def break_even(config: SpeculativeConfig) -> float:
    """θ: ``config.min_accepted_per_step``, or when None the device's: 1.0
    on a CPU (a verify step of k + 1 positions is compute: 1.7x a decode
    step measured with SmolLM2, batch 4, k = 4, so 0.7 kept drafts per step
    break even; 1.0 leaves a margin), 0.25 on an accelerator (decode reads
    the weights and the KV whatever the positions: a verify step at small
    batch costs about a decode step)."""
    if config.min_accepted_per_step is not None:
        return float(config.min_accepted_per_step)
    return 1.0 if jax.default_backend() == "cpu" else 0.25


class Speculation:
    """The host half of the engine's speculation: the rows' token
    histories, the per-request acceptance record and the rule that turns a
    request's speculation off (module docstring).

    Invariant: for a row whose ``owner`` is request ``r``,
    ``history[row, :length[row]]`` are the first ``length[row]`` of ``r``'s
    tokens (prompt then output; capped at ``width``)."""

    def __init__(self, config: SpeculativeConfig, max_seqs: int, cache):
        self.config = config
        self.theta = break_even(config)
        # Room for the longest request and the tokens a chunk appends on the device (writes past it are dropped
        # there: the lookup then just does not see them).
        self.width = pow2_at_least(cache.max_context_tokens + 1)
        self.history = np.zeros((max_seqs, self.width), np.int32)
        self.length = np.zeros((max_seqs,), np.int32)
        self.owner: list = [None] * max_seqs

    def arguments(self, running: dict, decode_chunk: int):
        """``(config, history, history_len, speculate, steps)`` for a decode
        chunk of the requests ``running`` (row -> request), or None when the
        chunk runs plain (module docstring: no request speculates, or those
        that do are not expected to keep θ drafts per running row together).
        ``steps``: the verify steps to run, ``PROBATION_STEPS`` while a
        speculating request is on probation (its judgement comes after a
        short chunk, not a whole one), else ``decode_chunk``."""
        speculating = [(row, req) for row, req in running.items() if req.spec_on]
        expected = sum(self.expected(req) for _, req in speculating)
        if not speculating or expected < self.theta * len(running):
            return None
        speculate = np.zeros(self.length.shape, bool)
        for row, req in speculating:
            speculate[row] = True
            self._sync(row, req)
        probation = any(req.spec_steps < PROBATION_STEPS for _, req in speculating)
        steps = min(PROBATION_STEPS, decode_chunk) if probation else decode_chunk
        return self.config, self.history, self.length.copy(), speculate, steps

    def expected(self, req) -> float:
        """Drafts ``req`` is expected to keep per verify step: its own rate,
        or θ while on probation."""
        if req.spec_steps < PROBATION_STEPS:
            return self.theta
        return req.spec_accepted / req.spec_steps

    def _sync(self, row: int, req) -> None:
        """Bring ``history[row]`` to ``req``'s tokens, writing what changed."""
        prompt, generated = req.prompt, req.generated
        total = min(len(prompt) + len(generated), self.width)
        have = int(self.length[row]) if self.owner[row] == req.id else 0
        if have < len(prompt):
            head = prompt[have:total]
            self.history[row, have:have + len(head)] = head
            have += len(head)
        if have < total:
            self.history[row, have:total] = generated[have - len(prompt):total - len(prompt)]
        self.length[row], self.owner[row] = total, req.id

    def record(self, running: dict, drafted: np.ndarray, accepted: np.ndarray, steps: np.ndarray, counters) -> None:
        """After a speculative chunk: each request's drafts verified and kept
        (its ``RequestOutput``'s counts and the engine's totals), and the
        off rule."""
        for row, req in running.items():
            if not req.spec_on:
                continue
            req.spec_drafted += int(drafted[row])
            req.spec_accepted += int(accepted[row])
            req.spec_steps += int(steps[row])
            if req.spec_steps >= PROBATION_STEPS and req.spec_accepted < self.theta * req.spec_steps:
                req.spec_on = False
        counters.spec_drafted += int(drafted.sum())
        counters.spec_accepted += int(accepted.sum())
