"""What each decoding request brings to a step, mirrored on the host per
row (:class:`RowInputs`), so that the scheduler's host work per iteration
follows the requests that changed, not all of them.

A step's per-request inputs (the last token, its position, the token
count, ``max_new``, EOS, temperature / top-k / top-p and the PRNG key data)
would otherwise be read from every running request's record on every
iteration: at 256 rows, several passes over cold Python objects after each
device call. The mirror keeps them in ``[max_seqs]`` arrays, advances them
from each call's results, and reads a record again only for a row whose
entry is not current (a request new to decoding, or one after a call that
did not advance it)."""

from __future__ import annotations

import operator

import numpy as np

from jaxkv.nn.sampling import RowSampling
from jaxkv.serve.request import Request

__all__ = ["RowInputs", "asks_extra"]


def asks_extra(req: Request) -> bool:
    """Whether ``req`` asks for log-probabilities, penalties, a constraint
    or a grammar: inputs that change with every token in other ways than
    the mirror follows (and that speculative verify steps do not compute)."""
    return (req.logprobs is not None or not req.penalties.is_off or req.constraint is not None
            or req.grammar is not None)


class RowInputs:
    """Per row, the inputs of the plain request decoding there.

    Row ``r``'s entry is *current* while ``owner[r]`` is the request that
    decodes on row ``r`` and ``stamp[r]`` is the engine's model-call count:
    it was written from that request's record after the last model call
    (:meth:`current`), or advanced from that call's results
    (:meth:`advance`). Invariant the scheduler keeps: a call's results are
    advanced only when every request still running took exactly the tokens
    the call counted for its row (a request whose tokens were cut at a stop
    finished), with its key advanced by that call; so a current entry equals
    what the record would give. Any other model call leaves every entry it
    did not advance stale, to be read from the record when next needed.
    Only plain requests (not :func:`asks_extra`) have entries."""

    def __init__(self, max_seqs: int, key_shape: tuple, logprobs_mode: str):
        self.max_seqs, self.logprobs_mode = max_seqs, logprobs_mode
        self.owner: list = [None] * max_seqs
        self.stamp = np.full((max_seqs,), -1, np.int64)
        self.last = np.zeros((max_seqs,), np.int32)  # the last generated token
        self.position = np.zeros((max_seqs,), np.int32)  # kv_len: where the next token's K/V go
        self.num_generated = np.zeros((max_seqs,), np.int32)
        self.max_new = np.zeros((max_seqs,), np.int32)
        self.eos = np.full((max_seqs,), -1, np.int32)
        self.temperature = np.zeros((max_seqs,), np.float32)
        self.top_k = np.zeros((max_seqs,), np.int32)
        self.top_p = np.ones((max_seqs,), np.float32)
        self.keys = np.zeros((max_seqs, *key_shape), np.uint32)

    def current(self, rows: list, reqs: list, sampling_rows: dict, calls: int,
                stale: list | None = None) -> np.ndarray | None:
        """Rows ``rows`` (``reqs[i]`` decodes on ``rows[i]``;
        ``sampling_rows``: request id -> its screened sampling row, needed
        for the stale ones) as an index array, with their entries made
        current (:meth:`stale`, then :meth:`write`); None, with nothing
        written, when any stale one :func:`asks_extra` (the caller reads
        the records). ``stale``: :meth:`stale` of these same arguments, when
        the caller has it already."""
        index = np.asarray(rows, np.int64)
        if stale is None:
            stale = self.stale(rows, reqs, calls)
        return index if self.write([(rows[i], reqs[i]) for i in stale], sampling_rows, calls) else None

    def stale(self, rows: list, reqs: list, calls: int) -> list:
        """The positions ``i`` whose entry is not current for ``reqs[i]``
        on row ``rows[i]`` after ``calls`` model calls, in order: ``[]`` in
        the common case, found by two array-speed tests (no pass over the
        records). Only those requests need screening: a current entry's
        request was screened when its entry was written, and a plain
        request's sampling parameters never change."""
        owner = self.owner
        if all(map(operator.is_, map(owner.__getitem__, rows), reqs)) and bool(
                (self.stamp[np.asarray(rows, np.int64)] == calls).all()):
            return []
        stamp = self.stamp.tolist()
        return [i for i, (row, req) in enumerate(zip(rows, reqs)) if owner[row] is not req or stamp[row] != calls]

    def write(self, stale: list, sampling_rows: dict, calls: int) -> bool:
        """Make the entries ``stale`` (``(row, request)`` pairs: the stale
        ones of a step's rows, :meth:`stale`) current from the records
        after ``calls`` model calls (``sampling_rows``: request id -> its
        screened sampling row); False, with nothing written, when any of
        them :func:`asks_extra`."""
        if any(asks_extra(req) for _, req in stale):
            return False
        owner = self.owner
        for row, req in stale:
            owner[row] = req
            self.stamp[row] = calls
            self.last[row] = req.generated[-1]
            self.position[row] = req.kv_len
            self.num_generated[row] = len(req.generated)
            self.max_new[row], self.eos[row] = req.max_new, req.eos_id
            self.temperature[row], self.top_k[row], self.top_p[row] = sampling_rows[req.id]
            self.keys[row] = req.key
        return True

    def advance(self, index: np.ndarray, last: np.ndarray, counts: np.ndarray, keys: np.ndarray, calls: int) -> None:
        """Entries ``index`` after the call that made the engine's model
        calls ``calls`` gave them ``counts`` tokens each, the last of them
        ``last`` (read where the count is positive), and advanced their
        keys to ``keys`` (the invariant above)."""
        counts = np.asarray(counts, np.int32)
        ran = counts > 0
        self.last[index[ran]] = np.asarray(last)[ran]
        self.position[index] += counts
        self.num_generated[index] += counts
        self.keys[index] = keys
        self.stamp[index] = calls

    def sampling(self, lanes: np.ndarray, index: np.ndarray, heads: list = ()) -> RowSampling:
        """Per-lane sampling: lane ``lanes[j]`` takes row ``index[j]``'s
        entry, lane ``i`` the sampling row ``heads[i]`` (``(temperature,
        top_k, top_p)``: a prefill lane's), the rest greedy, as
        :func:`~jaxkv.serve.scheduler.row_sampling` makes them."""
        out_t = np.zeros((self.max_seqs,), np.float32)
        out_k = np.zeros((self.max_seqs,), np.int32)
        out_p = np.ones((self.max_seqs,), np.float32)
        for lane, (temperature, top_k, top_p) in enumerate(heads):
            out_t[lane], out_k[lane], out_p[lane] = temperature, top_k, top_p
        out_t[lanes], out_k[lanes], out_p[lanes] = self.temperature[index], self.top_k[index], self.top_p[index]
        return RowSampling(out_t, out_k, out_p, logprobs=-1, logprobs_mode=self.logprobs_mode)

    def decode_arrays(self, index: np.ndarray) -> tuple:
        """A decode chunk's row inputs for rows ``index`` (others idle):
        ``(last, active, num_generated, max_new, eos, sampling, keys)``,
        each ``[max_seqs]`` (keys ``[max_seqs, ...]``), idle rows zero with
        ``eos`` -1 and greedy sampling."""
        last = np.zeros((self.max_seqs,), np.int32)
        active = np.zeros((self.max_seqs,), bool)
        num_generated = np.zeros((self.max_seqs,), np.int32)
        max_new = np.zeros((self.max_seqs,), np.int32)
        eos = np.full((self.max_seqs,), -1, np.int32)
        keys = np.zeros_like(self.keys)
        last[index], num_generated[index], max_new[index] = self.last[index], self.num_generated[index], \
            self.max_new[index]
        eos[index], keys[index], active[index] = self.eos[index], self.keys[index], True
        return last, active, num_generated, max_new, eos, self.sampling(index, index), keys

    def packed_arrays(self, index: np.ndarray, first_lane: int) -> tuple:
        """A packed step's decode entries for rows ``index`` in lanes
        ``first_lane, first_lane + 1, ...``: ``(decode, keys)``, ``decode``
        the ``[n, 3]`` ``(row, token, position)`` rows that
        :meth:`~jaxkv.serve.caches.CacheBase.packed_step` takes, ``keys``
        the lanes' key data ``[max_seqs, ...]`` (the prefill lanes' still to
        be written)."""
        decode = np.stack([index, self.last[index], self.position[index]], axis=1)
        keys = np.zeros_like(self.keys)
        keys[first_lane:first_lane + len(index)] = self.keys[index]
        return decode, keys
