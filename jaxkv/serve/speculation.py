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

A request whose drafts are rarely kept stops speculating: after
``PROBATION_STEPS`` verify steps, if it kept fewer than
``min_accepted_per_step`` drafts per step (a verify step computes ``k + 1``
positions for every row, so a row that keeps nothing costs more than a plain
decode step), it decodes without drafts from then on; when no running
request speculates, the iteration runs the plain decode chunk.

Packed iterations (prompts being prefilled beside decoding requests) decode
their requests one token each, without drafts: the packed stream's decode
lanes bring one token (verify lanes in the packed step are not built yet).
"""

from __future__ import annotations

import numpy as np

from jaxkv._ops import pow2_at_least
from jaxkv.nn.speculative import SpeculativeConfig

__all__ = ["PROBATION_STEPS", "Speculation"]

#: Verify steps a request runs before its acceptance is judged.
PROBATION_STEPS = 8


class Speculation:
    """The host half of the engine's speculation: the rows' token
    histories, the per-request acceptance record and the rule that turns a
    request's speculation off (module docstring).

    Invariant: for a row whose ``owner`` is request ``r``,
    ``history[row, :length[row]]`` are the first ``length[row]`` of ``r``'s
    tokens (prompt then output; capped at ``width``)."""

    def __init__(self, config: SpeculativeConfig, max_seqs: int, cache):
        self.config = config
        # Room for the longest request and the tokens a chunk appends on the device (writes past it are dropped
        # there: the lookup then just does not see them).
        self.width = pow2_at_least(cache.max_context_tokens + 1)
        self.history = np.zeros((max_seqs, self.width), np.int32)
        self.length = np.zeros((max_seqs,), np.int32)
        self.owner: list = [None] * max_seqs

    def arguments(self, running: dict):
        """``(config, history, history_len, speculate)`` for a decode chunk of
        the requests ``running`` (row -> request), or None when none of them
        speculates (the plain decode chunk then runs)."""
        speculate = np.zeros(self.length.shape, bool)
        for row, req in running.items():
            if req.spec_on:
                speculate[row] = True
                self._sync(row, req)
        if not speculate.any():
            return None
        return self.config, self.history, self.length.copy(), speculate

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
            if (req.spec_steps >= PROBATION_STEPS
                    and req.spec_accepted < self.config.min_accepted_per_step * req.spec_steps):
                req.spec_on = False
        counters.spec_drafted += int(drafted.sum())
        counters.spec_accepted += int(accepted.sum())
