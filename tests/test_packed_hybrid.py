"""``forward_packed`` of the hybrid-cache families against their unpacked step.

A packed step (:class:`jaxkv.nn.packed.PackedBatch`) runs the prefill pieces
of some requests and the decode token of others as ONE flat stream. The
expectation is the model's existing ``[rows, width]`` step
(:func:`jaxkv.nn.steps.hybrid_prefill_chunk`, which the model tests check
against transformers) fed the same requests, the same pieces, in the same
steps, on a cache of its own: every lane's logits agree to float32
round-off and the greedy tokens are identical.

The scenario (fresh random prompts from a seed): request A's long prompt
goes in random pieces through a prefill lane while requests B and C, short
prompts prefilled first, decode in the same steps; lanes sit in random
positions of their class (idle lanes between them), requests in random
request slots, and a decode request may also ride a free prefill lane (a
one-token row of the chunked form). The stream always ends in padding.

Models: the ``small`` fixtures. DeepSeek-V4 (window 16, rates 4 / 16, a CSA
layer with its indexer (top 4), HCA layers, an SWA layer): prompts long
enough that the indexer chooses among more entries than it keeps, pieces
that cross compression boundaries inside them. Qwen3-Next: Gated DeltaNet
and full-attention layers, prompts crossing K/V pages.

Each family compiles two programs (the packed and the unpacked step, one
static shape each) and reuses them across every case.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxkv.nn import AutoModelForCausalLM
from jaxkv.nn.packed import PackedLane, pack
from jaxkv.nn.steps import hybrid_prefill_chunk

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
#: Static shapes, one program per family: lanes, prefill lanes (the first
#: ones), their widest piece, and the stream (always some padding at its end).
NUM_LANES, PREFILL_LANES, MAX_PIECE = 5, 2, 8
NUM_TOKENS = PREFILL_LANES * MAX_PIECE + (NUM_LANES - PREFILL_LANES) + 2
MAX_REQUESTS = 5
#: Relative to the lane's largest logit (about 10-30 here): the two paths
#: run the same float32 arithmetic in differently shaped ops (measured:
#: at most 2.2e-6; a wrong row of a window or an entry moves logits by O(1)).
TOLERANCE = 1e-5

_MODELS = {}


def _model(family):
    if family not in _MODELS:
        _MODELS[family] = AutoModelForCausalLM.from_pretrained(os.path.join(FIXTURES, family, "small"))
    return _MODELS[family]


def _packed_body(graphdef, params, manager, batch):
    """What a packed engine step does around ``forward_packed``: reserve the
    lanes' tokens, run the step, capture boundary snapshots."""
    manager, _, ok = manager.reserve(batch.seq_ids, batch.q_lens, max_new_tokens=batch.max_prefill_len)
    logits, manager = nnx.merge(graphdef, params).forward_packed(batch, manager)
    return manager.capture(batch.seq_ids, ok & (batch.q_lens > 0)), logits, ok


_packed = jax.jit(_packed_body, static_argnames=("graphdef",))
_unpacked = jax.jit(hybrid_prefill_chunk, static_argnames=("graphdef",))


def _fresh_cache(model, context):
    """Every slot admitted (requests then take random ones)."""
    manager = model.make_cache(MAX_REQUESTS, context)
    manager, slots, ok = manager.admit(MAX_REQUESTS, max_n=MAX_REQUESTS)
    assert bool(ok) and sorted(np.asarray(slots).tolist()) == list(range(1, MAX_REQUESTS + 1))
    return manager


def _schedule(rng, prompts, fed):
    """One step's lanes: ``[(request, tokens count) or None] * NUM_LANES``.
    Requests still in their prompt take prefill lanes (random piece
    lengths); decoding requests take decode lanes, the rest free prefill
    lanes (one token) or wait."""
    lanes = [None] * NUM_LANES
    budget = NUM_TOKENS - 2  # keep some padding at the end of the stream
    prefilling = [r for r in range(len(prompts)) if fed[r] < len(prompts[r])]
    decoding = [r for r in range(len(prompts)) if fed[r] == len(prompts[r])]
    rng.shuffle(prefilling)
    rng.shuffle(decoding)
    free_prefill = list(rng.permutation(PREFILL_LANES))
    free_decode = list(PREFILL_LANES + rng.permutation(NUM_LANES - PREFILL_LANES))
    for r in decoding:
        # Now and then on a free prefill lane (a one-token row of the chunked form).
        spare = len(free_prefill) > len(prefilling)
        lane = (free_prefill.pop() if free_prefill and (not free_decode or (spare and rng.random() < 0.3))
                else free_decode.pop() if free_decode else None)
        if lane is not None:
            lanes[lane] = (r, 1)
            budget -= 1
    for r in prefilling:
        if not free_prefill or budget < 1:
            break
        remaining = len(prompts[r]) - fed[r]
        n = int(rng.integers(1, min(MAX_PIECE, remaining, budget) + 1))
        if rng.random() < 0.5:  # often a whole piece: crosses more boundaries
            n = min(MAX_PIECE, remaining, budget)
        lanes[free_prefill.pop()] = (r, n)
        budget -= n
    return lanes


def _run(family, seed, prompt_lens, extra_steps, context):
    """Drive both paths through the same random scenario until the longest
    prompt has ``extra_steps`` tokens generated. Returns ``(history,
    generated, near_ties)``: each step's :class:`Lane` s (for the callers'
    coverage checks), each request's greedy tokens, and how many of them
    differed on an exact near-tie."""
    model = _model(family)
    graphdef, params = nnx.split(model)
    rng = np.random.default_rng(seed)
    vocab = model.config.vocab_size
    prompts = [rng.integers(0, vocab, size=n).tolist() for n in prompt_lens]
    slots = rng.choice(np.arange(1, MAX_REQUESTS + 1), size=len(prompts), replace=False).tolist()
    packed_cache = _fresh_cache(model, context)
    unpacked_cache = _fresh_cache(model, context)
    fed = [0] * len(prompts)
    generated = [[] for _ in prompts]
    history, near_ties = [], 0
    longest = int(np.argmax(prompt_lens))
    while len(generated[longest]) < extra_steps:
        assert len(history) < 1000
        lanes = _schedule(rng, prompts, fed)
        packed_lanes, rows, counts, starts = [], np.zeros((NUM_LANES, MAX_PIECE), np.int32), [], []
        for i, lane in enumerate(lanes):
            if lane is None:
                packed_lanes.append(PackedLane(seq_id=-1, tokens=[], start=0, sample=False))
                counts.append(0)
                starts.append(0)
                continue
            r, n = lane
            if fed[r] < len(prompts[r]):
                tokens = prompts[r][fed[r]:fed[r] + n]
                start = fed[r]
            else:
                tokens = [generated[r][-1]]
                start = len(prompts[r]) + len(generated[r]) - 1
            packed_lanes.append(PackedLane(seq_id=slots[r], tokens=tokens, start=start,
                                           sample=start + n >= len(prompts[r])))
            rows[i, :n] = tokens
            counts.append(n)
            starts.append(start)
        batch = pack(packed_lanes, num_lanes=NUM_LANES, num_tokens=NUM_TOKENS, num_prefill_lanes=PREFILL_LANES,
                     max_prefill_len=MAX_PIECE)
        packed_cache, packed_logits, ok = _packed(graphdef, params, packed_cache, batch)
        assert bool(ok)
        lane_slots = jnp.asarray([slots[lane[0]] if lane else -1 for lane in lanes], jnp.int32)
        unpacked_cache, unpacked_logits, ok = _unpacked(graphdef, params, unpacked_cache, lane_slots,
                                                        jnp.asarray(rows), jnp.asarray(counts, jnp.int32))
        assert bool(ok)
        packed_logits, unpacked_logits = np.asarray(packed_logits), np.asarray(unpacked_logits)
        assert packed_logits.shape == (NUM_LANES, vocab) and np.isfinite(packed_logits).all()
        for i, lane in enumerate(lanes):
            if lane is None:
                continue
            r, n = lane
            scale = TOLERANCE * max(1.0, float(np.max(np.abs(unpacked_logits[i]))))
            np.testing.assert_allclose(packed_logits[i], unpacked_logits[i], atol=scale, rtol=TOLERANCE,
                                       err_msg=f"{family} seed {seed}: lane {i} (request {r}, {n} tokens "
                                               f"from position {starts[i]})")
            if fed[r] < len(prompts[r]):
                fed[r] += n
            if fed[r] == len(prompts[r]):  # the prompt is in: the lane samples
                token, expected = int(np.argmax(packed_logits[i])), int(np.argmax(unpacked_logits[i]))
                # Identical, unless the two paths' round-off straddles an exact near-tie
                # (never on the default seeds; both paths go on with the packed token).
                assert token == expected or unpacked_logits[i, expected] - unpacked_logits[i, token] <= scale, (
                    f"{family} seed {seed}: lane {i} (request {r}) greedy {token} != {expected}")
                near_ties += token != expected
                generated[r].append(token)
        history.append([None if lane is None else Lane(*lane, start, start >= len(prompts[lane[0]]))
                        for lane, start in zip(lanes, starts)])
    _assert_same_cache(packed_cache, unpacked_cache)
    return history, generated, near_ties


def _assert_same_cache(packed, unpacked):
    """Both caches hold the same: lengths and tables exactly, every state and
    pool (SWA / compressor rings, entries, indexer keys; GDN states, paged
    K/V) to round-off. Null rows (slot, block or page 0) are left out:
    padding may write there, and nothing reads them."""
    def contents(m):
        kept = {"seq_lens": m.seq_lens, "tables": {name: g.tables for name, g in m.groups.items()},
                "v4_stores": [jax.tree.map(lambda x: x[:, 1:], c) for c in m.v4_stores]}  # [layers, rows, ...]
        if m.full_pool is not None:  # [layers, heads, pages, page_size, dim]
            kept["full"] = jax.tree.map(lambda x: x[:, :, 1:], (m.full_pool.k_bits, m.full_pool.v_bits))
        if m.gdn is not None:  # [layers, slots, ...]
            kept["gdn"] = (m.gdn.recurrent_state[:, 1:], m.gdn.conv_bits[:, 1:])
        return kept

    leaves = jax.tree_util.tree_leaves_with_path(contents(packed))
    for (path, a), b in zip(leaves, jax.tree_util.tree_leaves(contents(unpacked)), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        name = jax.tree_util.keystr(path)
        if np.issubdtype(a.dtype, np.floating):
            scale = TOLERANCE * max(1.0, float(np.max(np.abs(b[np.isfinite(b)]), initial=0.0)))  # -inf: initial scores
            np.testing.assert_allclose(a, b, atol=scale, rtol=TOLERANCE, err_msg=name)
        else:
            np.testing.assert_array_equal(a, b, err_msg=name)


class Lane(NamedTuple):
    """What one lane of a packed step carried."""

    request: int
    count: int
    start: int
    decoding: bool


def _mixed_steps(history):
    """Steps with a prefill piece of several tokens AND at least two decode tokens."""
    return sum(1 for step in history
               if any(lane and lane.count > 1 for lane in step[:PREFILL_LANES])
               and sum(1 for lane in step if lane and lane.decoding) >= 2)


def _decode_on_prefill_lanes(history):
    return sum(1 for step in history for lane in step[:PREFILL_LANES] if lane and lane.decoding)


def _crossings(history, ratio):
    """Prefill pieces that complete an entry of rate ``ratio`` before their last token."""
    return sum(1 for step in history for lane in step
               if lane and any((p + 1) % ratio == 0 for p in range(lane.start, lane.start + lane.count - 1)))


# ----------------------------------------------------------------------------- DeepSeek-V4


def test_dsv4_packed_steps_equal_unpacked_steps():
    """A (44-token prompt in pieces) beside B and C decoding: every lane's
    logits and every greedy token as the unpacked step. Context up to 50
    tokens: 12 rate-4 entries for an indexer keeping 4, 3 rate-16 entries,
    the window of 16 wrapped three times."""
    config = _model("dsv4").config
    assert {"sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"} <= set(
        config.layer_types) and config.index_topk == 4 and config.compress_rates == (4, 16)
    history, generated, near_ties = _run("dsv4", seed=3, prompt_lens=[44, 5, 3], extra_steps=6, context=64)
    assert near_ties == 0 and _mixed_steps(history) >= 3 and _decode_on_prefill_lanes(history) >= 1
    assert _crossings(history, 4) >= 3 and _crossings(history, 16) >= 1
    assert all(len(g) >= 6 for g in generated)


# ----------------------------------------------------------------------------- Qwen3-Next


def test_qwen3_next_packed_steps_equal_unpacked_steps():
    """The same scenario through Gated DeltaNet (prefill lanes: the chunked
    form from each request's states; decode lanes: the recurrent form) and
    full attention (pages of 16: A's prompt crosses two)."""
    config = _model("qwen3_next").config
    assert {"linear_attention", "full_attention"} <= set(config.layer_types)
    history, generated, near_ties = _run("qwen3_next", seed=5, prompt_lens=[44, 5, 3], extra_steps=6, context=64)
    assert near_ties == 0 and _mixed_steps(history) >= 3 and _decode_on_prefill_lanes(history) >= 1
    assert all(len(g) >= 6 for g in generated)


# ----------------------------------------------------------------------------- wide sweeps


@pytest.mark.parametrize("family", ["dsv4", "qwen3_next"])
@pytest.mark.parametrize("seed", range(10, 22))
def test_packed_steps_equal_unpacked_steps_sweep(family, seed):
    """Random prompt lengths (up to past the 128-token compressed blocks
    and many K/V pages), request counts and schedules, same programs."""
    rng = np.random.default_rng(seed)
    count = int(rng.integers(2, MAX_REQUESTS + 1))
    prompt_lens = [int(rng.integers(60, 150))] + [int(rng.integers(1, 30)) for _ in range(count - 1)]
    _run(family, seed, prompt_lens, extra_steps=int(rng.integers(1, 6)), context=192)
