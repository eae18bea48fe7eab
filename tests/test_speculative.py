"""Speculative decoding (``jaxkv.nn.speculative``): the proposer against a
numpy lookup, greedy verification against a numpy rule, the sampling rule
by its output distribution (and a wrong rule caught), the caches' rollback
against caches that never saw the rejected tokens (free memory poisoned
with NaN), and greedy speculative ``generate`` against transformers' tokens
for every family (the parity fixtures; the default pass runs the paged
Llama and the Gated DeltaNet Qwen3-Next, the ``long`` pass the rest).
"""

from __future__ import annotations

import json
import os
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxkv.errors import InvalidArgument
from jaxkv.manager.block_space import BlockSpaceManager
from jaxkv.manager.rows import slot_of
from jaxkv.nn import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, generate
from jaxkv.nn import speculative as spec
from jaxkv.nn.generate import prefill
from jaxkv.nn.sampling import GREEDY, SamplingParams
from jaxkv.nn.speculative import SpeculativeConfig, accept_drafts, ngram_propose
from jaxkv.nn.steps import decode_logits, hybrid_prefill_chunk
from kernels_pallas.bits import from_bits

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


# ---------------------------------------------------------------- the proposer


def ngram_reference(history, length, k, max_n, min_n):
    """Prompt lookup in plain Python: the longest suffix (max_n .. min_n)
    seen earlier, its most recent earlier occurrence followed by a token."""
    tokens = list(history[:length])
    for n in range(max_n, min_n - 1, -1):
        if n > length:
            continue
        suffix = tokens[length - n:]
        for start in range(length - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                follow = tokens[start + n:start + n + k]
                return follow + [0] * (k - len(follow)), len(follow)
    return [0] * k, 0


@pytest.mark.parametrize("seed", range(3))
def test_ngram_proposals_equal_a_python_lookup(seed):
    rng = np.random.default_rng(seed)
    batch, width = 24, 40
    k, max_n, min_n = int(rng.integers(1, 6)), int(rng.integers(1, 5)), 1
    min_n = int(rng.integers(1, max_n + 1))
    history = rng.integers(0, 4, (batch, width)).astype(np.int32)  # four symbols: matches are common
    length = rng.integers(1, width + 1, batch).astype(np.int32)
    drafts, num = jax.jit(partial(ngram_propose, k=k, max_n=max_n, min_n=min_n))(history, length)
    for b in range(batch):
        want, count = ngram_reference(history[b], int(length[b]), k, max_n, min_n)
        assert int(num[b]) == count, (b, history[b, : length[b]].tolist())
        assert np.asarray(drafts[b]).tolist() == want


# ---------------------------------------------------------------- verification


def test_greedy_verification_keeps_the_prefix_equal_to_the_argmax():
    rng = np.random.default_rng(0)
    batch, k, vocab = 64, 4, 11
    logits = rng.normal(size=(batch, k + 1, vocab)).astype(np.float32)
    argmax = logits.argmax(-1)
    # Drafts equal to the argmax for a random number of leading positions, then random.
    drafts = rng.integers(0, vocab, (batch, k)).astype(np.int32)
    agree = rng.integers(0, k + 1, batch)
    for b in range(batch):
        drafts[b, : agree[b]] = argmax[b, : agree[b]]
    num = rng.integers(0, k + 1, batch).astype(np.int32)
    tokens, accepted = jax.jit(lambda *a: accept_drafts(*a, GREEDY, None))(logits, drafts, num)
    for b in range(batch):
        n = 0
        while n < num[b] and drafts[b, n] == argmax[b, n]:
            n += 1
        assert int(accepted[b]) == n
        assert np.asarray(tokens[b, : n + 1]).tolist() == drafts[b, :n].tolist() + [int(argmax[b, n])]


def _chi_square_p(counts, probs):
    """p-value of Pearson's chi-square test of ``counts`` against ``probs``
    (cells with expected count < 5 pooled)."""
    from scipy import stats  # a dependency of jax

    total = counts.sum()
    expected = probs / probs.sum() * total
    keep = expected >= 5
    observed = np.append(counts[keep], counts[~keep].sum())
    expected = np.append(expected[keep], expected[~keep].sum())
    if expected[-1] == 0:
        observed, expected = observed[:-1], expected[:-1]
    expected = expected * observed.sum() / expected.sum()  # the sums agree to float64 rounding
    return stats.chisquare(observed, expected).pvalue


def _sampled_tokens(logits, drafts, num, draft_probs, sampling, draws, seed):
    """``draws`` independent verifications of the same row (batch = draws)."""
    tile = lambda a: jnp.broadcast_to(a, (draws, *a.shape[1:]))  # noqa: E731
    run = jax.jit(lambda key: accept_drafts(tile(logits), tile(drafts), tile(num), sampling, key,
                                            None if draft_probs is None else tile(draft_probs)))
    tokens, accepted = run(jax.random.key(seed))
    return np.asarray(tokens), np.asarray(accepted)


def _target_probs(logits, sampling):
    from jaxkv.nn.sampling import filtered_logits

    scaled, _ = filtered_logits(jnp.asarray(logits[0]), sampling)
    return np.asarray(jax.nn.softmax(scaled, axis=-1), np.float64)


def _check_rule(draft_probs_given: bool, seed: int):
    """The first emitted token follows p_0, and given that the first draft
    was accepted the second follows p_1 (each position's target
    distribution; the rule must not depend on what was drafted)."""
    rng = np.random.default_rng(seed)
    vocab, k, draws = 6, 2, 60_000
    sampling = SamplingParams(temperature=0.9, top_k=5)
    logits = (2 * rng.normal(size=(1, k + 1, vocab))).astype(np.float32)
    if draft_probs_given:
        q = rng.dirichlet(np.ones(vocab), size=(1, k)).astype(np.float32)
        drafts = np.stack([rng.choice(vocab, size=draws, p=q[0, i]) for i in range(k)], axis=1).astype(np.int32)
    else:
        q = None
        drafts = np.broadcast_to(np.asarray([[int(np.argsort(logits[0, 0])[-2]), 1]], np.int32), (draws, k))
    num = np.full((1,), k, np.int32)
    tile = lambda a: jnp.broadcast_to(a, (draws, *a.shape[1:]))  # noqa: E731
    run = jax.jit(lambda key, d: accept_drafts(tile(logits), d, tile(num), sampling, key,
                                               None if q is None else tile(q)))
    tokens, accepted = map(np.asarray, run(jax.random.key(seed), jnp.asarray(drafts)))
    p = _target_probs(logits, sampling)
    first = np.bincount(tokens[:, 0], minlength=vocab)
    p_first = _chi_square_p(first, p[0])
    second_rows = accepted >= 1
    second = np.bincount(tokens[second_rows, 1], minlength=vocab)
    p_second = _chi_square_p(second, p[1])
    return p_first, p_second


@pytest.mark.parametrize("draft_model", [False, True], ids=["ngram", "draft-distribution"])
def test_sampled_speculation_follows_the_target_distribution(draft_model):
    p_first, p_second = _check_rule(draft_model, seed=1)
    assert p_first > 1e-4 and p_second > 1e-4, (p_first, p_second)


def test_a_wrong_rejection_rule_is_caught(monkeypatch):
    # Resampling from p instead of max(0, p - q) favours the drafted token.
    monkeypatch.setattr(spec, "_residual", lambda p, q: p)
    p_first, _ = _check_rule(False, seed=1)
    assert p_first < 1e-6


def test_config_refuses_what_it_cannot_do():
    with pytest.raises(InvalidArgument, match="EAGLE and MTP are not yet"):
        SpeculativeConfig(method="eagle")
    with pytest.raises(InvalidArgument, match="num_speculative_tokens"):
        SpeculativeConfig.of({"num_speculative_tokens": 0})
    with pytest.raises(InvalidArgument, match="unknown keys"):
        SpeculativeConfig.of({"method": "ngram", "num_tokens": 3})
    with pytest.raises(InvalidArgument, match="prompt_lookup_min"):
        SpeculativeConfig(prompt_lookup_max=2, prompt_lookup_min=3)


# ---------------------------------------------------------------- BlockSpaceManager.truncate


def _refcounts_from_tables(manager, num_blocks):
    counts = np.zeros(num_blocks, np.int64)
    tables, status = np.asarray(manager.block_tables), np.asarray(manager.status)
    for row in np.flatnonzero(status == 1):
        for block in tables[row]:
            if block >= 0:
                counts[block] += 1
    return counts


@pytest.mark.parametrize("seed", range(2))
def test_truncate_releases_what_the_append_took_and_keeps_shared_blocks(seed):
    rng = np.random.default_rng(seed)
    bs, rows, num_blocks = 4, 6, 64
    manager = BlockSpaceManager.create(num_device_blocks=num_blocks, num_host_blocks=1, block_size=bs, max_seqs=rows,
                                       max_blocks_per_seq=12)
    pool = LlamaForCausalLM(LlamaConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                                        num_attention_heads=1, num_key_value_heads=1, head_dim=8),
                            rngs=nnx.Rngs(0)).make_pool(num_blocks, bs)
    manager = manager.allocate_or_raise([0, 1, 2], 9)
    manager = manager.fork_or_raise([0, 1], [3, 4])  # rows 3 and 4 share every block of 0 and 1
    append = jax.jit(lambda m, p, s: m.append_slots(p, s, 5))
    truncate = jax.jit(BlockSpaceManager.truncate)
    for _ in range(4):
        seqs = np.asarray([0, 1, 2, 3, 4, -1], np.int32)
        before = np.asarray(manager.seq_lens).copy()
        grown, pool, _, _, ok = append(manager, pool, seqs)
        assert bool(ok)
        keep = before + rng.integers(0, 6, rows)
        kept, ok = truncate(grown, seqs, keep)
        assert bool(ok)
        lens = np.asarray(kept.seq_lens)
        tables = np.asarray(kept.block_tables)
        for row in range(5):
            assert lens[row] == keep[row]
            held = (tables[row] >= 0).sum()
            assert held == -(-keep[row] // bs), (row, tables[row])
            assert (tables[row, held:] == -1).all()
        counts = np.asarray(kept.device.ref_counts)
        assert (counts[1:] == _refcounts_from_tables(kept, num_blocks)[1:]).all()
        assert int(kept.device.num_free) == num_blocks - 1 - (counts[1:] > 0).sum()
        manager = kept
    # All or nothing: a length past the row's, a FREE row, a row named twice.
    for seqs, lens in (([0, -1], [int(manager.seq_lens[0]) + 1, 0]), ([5, -1], [0, 0]), ([1, 1], [1, 1])):
        after, ok = truncate(manager, np.asarray(seqs, np.int32), np.asarray(lens, np.int32))
        assert not bool(ok)
        jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), after, manager)


# ---------------------------------------------------------------- rollback against never-written caches


def _poison(tree):
    return jax.tree.map(lambda a: jnp.full_like(a, jnp.nan) if jnp.issubdtype(a.dtype, jnp.floating) else a, tree)


LLAMA = dict(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8)


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("drafts", ["given", "early_exit"])
def test_paged_rollback_equals_a_cache_that_never_saw_the_rejected_tokens(drafts, seed):
    """Verify k + 1 random tokens per row, keep a random prefix of them:
    lengths, free blocks and every live position's K/V equal those of a
    cache that decoded only the kept tokens, and so do the logits of the
    steps after, with every free slot and page poisoned with NaN. With
    ``early_exit`` the drafts come from the model's first layer over the
    same pool (it writes their K/V into the first layer's slots before the
    verify pass): nothing of it may survive either."""
    rng = np.random.default_rng(seed)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA), rngs=nnx.Rngs(seed))
    graphdef, params = nnx.split(model)
    batch, k, bs, num_pages = 4, 4, 4, 48
    lengths = rng.integers(2, 11, batch).astype(np.int32)
    prompts = rng.integers(1, LLAMA["vocab_size"], (batch, 16)).astype(np.int32)
    manager = BlockSpaceManager.create(num_device_blocks=num_pages, num_host_blocks=1, block_size=bs, max_seqs=batch,
                                       max_blocks_per_seq=12)
    state = prefill(graphdef, params, manager, _poison(model.make_pool(num_pages, bs)), prompts, lengths,
                    jax.random.key(0), np.int32(-1), GREEDY, max_new=8)
    inputs = rng.integers(1, LLAMA["vocab_size"], (batch, k + 1)).astype(np.int32)
    num_drafts = np.full((batch,), k, np.int32)
    accepted = rng.integers(0, k + 1, batch).astype(np.int32)
    active = np.ones((batch,), bool)

    propose = None
    if drafts == "early_exit":
        draft = spec.early_exit_draft(model, 1, share_pool=True)
        propose = partial(spec._shared_pool_propose, *nnx.split(draft), sampling=GREEDY, key=None)

    @jax.jit
    def speculated(manager, pool):
        _, _, ok, rollback, proposed, _ = spec._paged_verify(graphdef, params, manager, pool, inputs, num_drafts,
                                                             active, propose=propose)
        return (*rollback(jnp.asarray(accepted)), ok, proposed)

    one = jax.jit(lambda m, p, last, act: decode_logits(graphdef, params, m, p, last, act))
    m_a, p_a, ok, proposed = speculated(state.manager, state.pool)
    assert bool(ok)
    inputs[:, 1:] = np.asarray(proposed)  # the drafts that were verified (the given ones, or the early exit's)
    m_b, p_b = state.manager, state.pool
    for i in range(k + 1):  # the reference: the kept tokens one decode step at a time
        m_b, p_b, _, _, ok = one(m_b, p_b, inputs[:, i], jnp.asarray(i <= accepted))
        assert bool(ok)
    np.testing.assert_array_equal(np.asarray(m_a.seq_lens), np.asarray(m_b.seq_lens))
    assert int(m_a.device.num_free) == int(m_b.device.num_free)
    # Leaf by leaf: every live position's K and V, read through each manager's own tables.
    (ta, ka, va), (tb, kb, vb) = ((np.asarray(m.block_tables), np.asarray(p.k_pages), np.asarray(p.v_pages))
                                  for m, p in ((m_a, p_a), (m_b, p_b)))
    for row, length in enumerate(np.asarray(m_a.seq_lens)):
        at = np.arange(length)
        for x_a, x_b in ((ka, kb), (va, vb)):  # [layers, heads, pages, page, dim]
            np.testing.assert_allclose(x_a[:, :, ta[row, at // bs], at % bs], x_b[:, :, tb[row, at // bs], at % bs],
                                       rtol=1e-5, atol=1e-5)
    for _ in range(3):
        token = rng.integers(1, LLAMA["vocab_size"], batch).astype(np.int32)
        m_a, p_a, logits_a, _, _ = one(m_a, p_a, token, jnp.asarray(active))
        m_b, p_b, logits_b, _, _ = one(m_b, p_b, token, jnp.asarray(active))
        assert np.isfinite(np.asarray(logits_a)).all()
        np.testing.assert_allclose(np.asarray(logits_a), np.asarray(logits_b), rtol=1e-5, atol=1e-5)


HYBRID = ["parity/qwen3_next_2", "gemma3/small", "gpt_oss/small", "dsv4/small"]


def _assert_same_live_state(m_a, m_b, slots, tol: float) -> None:
    """Leaf by leaf, what two hybrid managers hold for the live tokens of
    ``slots``: the full-attention pages of every position below the slot's
    length (read through each manager's own tables: block ids may differ),
    the Gated DeltaNet recurrent and conv states, and every window-ring
    slot holding a position inside the window below the length (rings may
    differ where they hold positions past it: rolled-back drafts, which
    reads mask), and DeepSeek-V4's stores (:func:`_assert_same_v4_stores`)."""
    slots = np.asarray(slots)
    lengths = np.asarray(m_a.seq_lens)[slots]
    np.testing.assert_array_equal(lengths, np.asarray(m_b.seq_lens)[slots])
    if m_a.full_pool is not None:
        page = m_a.full_pool.page_size
        (ta, ka, va), (tb, kb, vb) = ((np.asarray(m.groups["full"].tables), np.asarray(m.full_pool.k_pages, np.float32),
                                       np.asarray(m.full_pool.v_pages, np.float32)) for m in (m_a, m_b))
        for slot, length in zip(slots, lengths):
            positions = np.arange(length)
            for x_a, x_b in ((ka, kb), (va, vb)):  # [layers, heads, pages, page, dim] at each live position
                np.testing.assert_allclose(x_a[:, :, ta[slot, positions // page], positions % page],
                                           x_b[:, :, tb[slot, positions // page], positions % page], rtol=tol,
                                           atol=tol)
    if m_a.gdn is not None:
        np.testing.assert_allclose(np.asarray(m_a.gdn.recurrent_state)[:, slots],
                                   np.asarray(m_b.gdn.recurrent_state)[:, slots], rtol=tol, atol=tol)
        np.testing.assert_allclose(np.asarray(m_a.gdn.conv_state, np.float32)[:, slots],
                                   np.asarray(m_b.gdn.conv_state, np.float32)[:, slots], rtol=tol, atol=tol)
    if m_a.window_pool is not None:
        ring_a, ring_b = m_a.window_pool, m_b.window_pool
        pos_a, pos_b = np.asarray(ring_a.pos)[:, slots], np.asarray(ring_b.pos)[:, slots]  # [layers, rows, slots]
        live = (pos_b >= 0) & (pos_b >= lengths[None, :, None] - ring_b.window)
        assert live.any()
        np.testing.assert_array_equal(pos_a[live], pos_b[live])
        for name in ("k_bits", "v_bits"):  # [layers, rows, heads, slots, dim] -> [layers, rows, slots, heads, dim]
            x_a = np.moveaxis(np.asarray(from_bits(getattr(ring_a, name), ring_a.dtype), np.float32)[:, slots], 2, 3)
            x_b = np.moveaxis(np.asarray(from_bits(getattr(ring_b, name), ring_b.dtype), np.float32)[:, slots], 2, 3)
            np.testing.assert_allclose(x_a[live], x_b[live], rtol=tol, atol=tol)
    if m_a.v4_stores:
        _assert_same_v4_stores(m_a, m_b, slots, lengths, tol)


def _assert_same_v4_stores(m_a, m_b, slots, lengths, tol: float) -> None:
    """DeepSeek-V4's stores, leaf by leaf, for ``slots``: each slot's whole
    state rows (SWA rings, the compressors' and the indexer's partial
    buffers: a row restored from its checkpoint and replayed holds what
    one that only ever ran the kept tokens holds, slots past the length
    included), and the compressed entries and indexer keys of every
    complete entry below the length (``length // ratio`` of them), read
    through each manager's own tables."""
    from jaxkv.manager.hybrid import v4_layout

    for schema, store_a, store_b in zip(v4_layout(m_a.schemas)[0], m_a.v4_stores, m_b.v4_stores):
        rows = ["swa"] + [f for f in ("comp_kv", "comp_score", "index_kv", "index_score")
                          if getattr(store_a, f) is not None]
        for name in rows:  # [layers, state rows, ...]
            for leaf_a, leaf_b in zip(jax.tree.leaves(getattr(store_a, name)), jax.tree.leaves(getattr(store_b, name))):
                np.testing.assert_allclose(np.asarray(leaf_a, np.float32)[:, slots],
                                           np.asarray(leaf_b, np.float32)[:, slots], rtol=tol, atol=tol,
                                           err_msg=f"{schema.kind} store {name}")
        if store_a.entries is None:
            continue
        group_a, group_b = m_a.groups[schema.group], m_b.groups[schema.group]
        per_block, ratio = group_a.entries_per_block, group_a.tokens_per_entry
        (ta, tb) = (np.asarray(group_a.tables), np.asarray(group_b.tables))
        checked = 0
        for slot, length in zip(slots, lengths):
            index = np.arange(length // ratio)
            checked += len(index)
            for name in ("entries", "index_keys"):
                if getattr(store_a, name) is None:
                    continue
                for leaf_a, leaf_b in zip(jax.tree.leaves(getattr(store_a, name)),
                                          jax.tree.leaves(getattr(store_b, name))):
                    x_a = np.asarray(leaf_a, np.float32)[:, ta[slot, index // per_block], index % per_block]
                    x_b = np.asarray(leaf_b, np.float32)[:, tb[slot, index // per_block], index % per_block]
                    np.testing.assert_allclose(x_a, x_b, rtol=tol, atol=tol, err_msg=f"{schema.group} {name}")
        assert checked > 0, f"no complete {schema.group} entry to compare"


def _assert_same_hybrid_caches(m_a, m_b, slots, chunk, rng, vocab: int) -> None:
    """Two hybrid managers hold the same for ``slots``: lengths, each
    group's lengths and free blocks, the live state leaf by leaf
    (:func:`_assert_same_live_state`), then three more random tokens per
    row through ``chunk(manager, slots, tokens, num_new)`` give the same
    finite logits."""
    rows = len(slots)
    np.testing.assert_array_equal(np.asarray(m_a.seq_lens), np.asarray(m_b.seq_lens))
    for group in m_a.groups:
        np.testing.assert_array_equal(np.asarray(m_a.groups[group].lens), np.asarray(m_b.groups[group].lens))
        assert int(m_a.groups[group].allocator.num_free) == int(m_b.groups[group].allocator.num_free)
    _assert_same_live_state(m_a, m_b, slots, tol=2e-4)
    for _ in range(3):
        token = jnp.asarray(rng.integers(1, vocab, (rows, 1)).astype(np.int32))
        m_a, logits_a, _ = chunk(m_a, slots, token, jnp.ones((rows,), jnp.int32))
        m_b, logits_b, _ = chunk(m_b, slots, token, jnp.ones((rows,), jnp.int32))
        assert np.isfinite(np.asarray(logits_a)).all()
        np.testing.assert_allclose(np.asarray(logits_a), np.asarray(logits_b), rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("name", HYBRID)
def test_hybrid_rollback_equals_a_cache_that_never_saw_the_rejected_tokens(name):
    """The same for a hybrid cache: Gated DeltaNet states, window rings,
    DeepSeek-V4's rings, compressed entries and indexer keys come back as
    if only the kept tokens had run (the reference runs them as one chunk
    per row): lengths, blocks, and leaf by leaf the live pages, GDN states
    and ring slots (:func:`_assert_same_live_state`), then three more steps
    agree; free pages and the checkpoint
    rows start as NaN. The cache is built as speculation builds it
    (``hybrid_cache_options``): Gemma 3's and gpt-oss's rings get ``k``
    slots of slack and roll back by length alone (8-token windows, which
    every row crosses), the others restore a checkpoint."""
    rng = np.random.default_rng(len(name))
    model = AutoModelForCausalLM.from_pretrained(os.path.join(FIXTURES, name))
    vocab = model.config.vocab_size
    graphdef, params = nnx.split(model)
    batch, k = 3, 5
    lengths = rng.integers(3, 40, batch).astype(np.int32)
    options, checkpoints = spec.hybrid_cache_options(model, k, batch, max_context_tokens=128)
    assert (checkpoints == 0) == (name in ("gemma3/small", "gpt_oss/small"))
    manager = _poison(model.make_cache(batch, 128, num_snapshots=checkpoints, **options))
    manager, slots, ok = jax.jit(lambda m: m.admit(batch, max_n=batch))(manager)
    assert bool(ok)
    chunk = jax.jit(partial(hybrid_prefill_chunk, graphdef))
    prompt = np.zeros((batch, 64), np.int32)
    prompt[:, :40] = rng.integers(1, vocab, (batch, 40))
    manager, _, ok = chunk(params, manager, slots, jnp.asarray(prompt), jnp.asarray(lengths))
    assert bool(ok)
    inputs = rng.integers(1, vocab, (batch, k + 1)).astype(np.int32)
    num_drafts = rng.integers(0, k + 1, batch).astype(np.int32)
    accepted = np.asarray([int(rng.integers(0, n + 1)) for n in num_drafts], np.int32)
    # Row 0 rejects two drafts or more: its verify overwrote ring slots that a ring without slack still needs.
    num_drafts[0], accepted[0] = k, rng.integers(0, k - 1)
    active = np.ones((batch,), bool)

    @jax.jit
    def speculated(manager):
        _, _, ok, rollback = spec._hybrid_verify(graphdef, params, manager, inputs, num_drafts, active)
        return rollback(jnp.asarray(accepted))[0], ok

    m_a, ok = speculated(manager)
    assert bool(ok)
    m_b, _, ok = chunk(params, manager, slots, jnp.asarray(inputs), jnp.asarray(accepted + 1))
    assert bool(ok)
    _assert_same_hybrid_caches(m_a, m_b, slots, partial(chunk, params), rng, vocab)


def test_rings_without_slack_fail_the_rollback_check(monkeypatch):
    """The check above catches a wrong rule: Gemma 3's rings with no slack,
    rolled back by length alone, lose keys the next steps attend (the ring
    slots' positions differ first)."""
    from jaxkv.manager.hybrid import KVCacheManager

    monkeypatch.setattr(spec, "hybrid_cache_options", lambda model, k, rows, **_: ({"ring_slack": 0}, 0))
    monkeypatch.setattr(KVCacheManager, "rolls_back_by_length", lambda self, num_drafts: True)
    with pytest.raises(AssertionError, match="Arrays are not equal"):
        test_hybrid_rollback_equals_a_cache_that_never_saw_the_rejected_tokens("gemma3/small")


# ---------------------------------------------------------------- generate, every family, against transformers


@pytest.mark.parametrize("name", HYBRID)
def test_hybrid_packed_verify_equals_a_cache_that_never_saw_the_rejected_tokens(name):
    """A hybrid packed step with verify lanes (one model call: a new
    request's prompt piece, a verify lane whose drafts are the target's
    own greedy continuation with one draft at a random place changed, a
    verify lane of two random drafts and placeholders left over, a plain
    decode lane): lane 0 keeps exactly the drafts before the changed
    one, every lane's tokens are the argmax of a cache that ran only the
    kept tokens (one chunk per row), and that cache's lengths, blocks and
    live state (pages, GDN states, rings, DeepSeek-V4's stores) equal the
    step's leaf by leaf, then three more steps agree; free pages and the
    checkpoint rows start as NaN."""
    from jaxkv.nn.packed import PackedLane
    from jaxkv.nn.sampling import RowSampling
    from jaxkv.serve.caches import pack_stream

    rng = np.random.default_rng(len(name) + 7)
    model = AutoModelForCausalLM.from_pretrained(os.path.join(FIXTURES, name))
    vocab = model.config.vocab_size
    graphdef, params = nnx.split(model)
    rows, k = 4, 4
    config = SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_max=2, prompt_lookup_min=1)
    options, checkpoints = spec.hybrid_cache_options(model, k, rows, max_context_tokens=128)
    manager = _poison(model.make_cache(rows, 128, num_snapshots=checkpoints, **options))
    manager, slots, ok = jax.jit(lambda m: m.admit(rows, max_n=rows))(manager)
    assert bool(ok)
    slots = np.asarray(slots)
    chunk = jax.jit(partial(hybrid_prefill_chunk, graphdef))
    lengths = np.append(rng.integers(9, 40, rows - 1), 0).astype(np.int32)  # the last row's prompt comes packed
    prompt = rng.integers(1, vocab, (rows, 40)).astype(np.int32)
    manager, _, ok = chunk(params, manager, slots, jnp.asarray(prompt), jnp.asarray(lengths))
    assert bool(ok)
    fed = rng.integers(1, vocab, rows).astype(np.int32)
    # Row 0's drafts: the target's greedy continuation after its fed token, one draft changed (or none).
    greedy, m, token = [], manager, fed.copy()
    for _ in range(k + 1):
        m, logits, _ = chunk(params, m, slots, jnp.asarray(token[:, None]), jnp.asarray([1, 0, 0, 0], jnp.int32))
        token[0] = int(np.argmax(np.asarray(logits)[0]))
        greedy.append(int(token[0]))
    changed = int(rng.integers(0, k + 1))  # k: every draft kept
    drafts = greedy[:k]
    if changed < k:
        drafts[changed] = (drafts[changed] + 1) % vocab
    # Histories whose lookup gives those drafts (row 0: "a fed" seen before, followed by them; row 1: its fed
    # token seen before, followed by two tokens that end the history).
    a = next(t for t in range(1, vocab) if t not in drafts and t != fed[0])
    history = np.zeros((rows, 32), np.int32)
    history_len = np.zeros((rows,), np.int32)
    for row, tokens in ((0, [a, int(fed[0]), *drafts, a, int(fed[0])]),
                        (1, [int(fed[1]), int(rng.integers(1, vocab)), int(fed[1])])):
        history[row, :len(tokens)] = tokens
        history_len[row] = len(tokens)
    piece = rng.integers(1, vocab, 13).tolist()
    batch = pack_stream([PackedLane(int(slots[3]), piece, 0)], slots[:3], fed[:3], lengths[:3], num_lanes=rows,
                        num_tokens=32, num_prefill_lanes=1, max_prefill_len=len(piece),
                        decode_widths=[k + 1, k + 1, 1])
    verify = np.asarray([False, True, True, False])
    step = jax.jit(partial(spec.hybrid_packed_verify_step, graphdef, config=config))
    m_a, tokens, counts, _, prefill_ok, decode_ok, *_, drafted, accepted = step(
        params, manager, batch, RowSampling.broadcast(GREEDY, rows), jax.random.split(jax.random.key(0), rows),
        jnp.asarray(history), jnp.asarray(history_len), jnp.asarray(verify))
    assert bool(prefill_ok) and bool(decode_ok)
    tokens, counts, drafted, accepted = (np.asarray(x) for x in (tokens, counts, drafted, accepted))
    assert drafted.tolist() == [0, k, 2, 0]
    assert accepted[1] == changed and tokens[1, :counts[1]].tolist() == greedy[:changed + 1]
    assert counts.tolist() == [1, changed + 1, accepted[2] + 1, 1]
    # The reference: each row runs only what it kept, in one chunk.
    kept = np.zeros((rows, 16), np.int32)
    kept[3, :len(piece)] = piece
    for row, lane in ((0, 1), (1, 2), (2, 3)):
        kept[row, :counts[lane]] = [fed[row], *tokens[lane, :counts[lane] - 1]]
    m_b, logits_b, ok = chunk(params, manager, slots, jnp.asarray(kept),
                              jnp.asarray([counts[1], counts[2], counts[3], len(piece)], jnp.int32))
    assert bool(ok)
    want = np.argmax(np.asarray(logits_b), axis=-1)
    assert [tokens[lane, counts[lane] - 1] for lane in (1, 2, 3, 0)] == want.tolist()
    _assert_same_hybrid_caches(m_a, m_b, slots, partial(chunk, params), rng, vocab)


FAMILIES = ["parity/llama_3", "parity/qwen3_next_2", "parity/dsv3_4", "gemma3/small", "gpt_oss/small", "dsv4/small"]


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_speculative_generate_gives_transformers_tokens(name):
    with open(os.path.join(FIXTURES, name, "expected.json"), encoding="utf-8") as f:
        expected = json.load(f)
    model = AutoModelForCausalLM.from_pretrained(os.path.join(FIXTURES, name))
    out = generate(model, expected["prompts"], expected["max_new_tokens"],
                   speculative={"num_speculative_tokens": 3, "prompt_lookup_min": 1})
    assert out.tokens == expected["greedy"]
    assert sum(out.draft_tokens) > 0  # the drafts ran, and were checked
    assert all(a <= d for a, d in zip(out.accepted_tokens, out.draft_tokens))


def test_copying_text_is_accepted_and_sampled_runs_finish():
    """A random Llama whose greedy output loops: the drafts are accepted
    (fewer verify steps than tokens), the tokens are those of plain
    ``generate``, one call per verify step gives the same, and a sampled
    run stops at its length with every block back."""
    model = LlamaForCausalLM(LlamaConfig(**LLAMA), rngs=nnx.Rngs(3))
    rng = np.random.default_rng(3)
    base = rng.integers(1, LLAMA["vocab_size"], 9).tolist()
    prompts = [base * 3, rng.integers(1, LLAMA["vocab_size"], 5).tolist()]
    plain = generate(model, prompts, 24, page_size=4)
    fast = generate(model, prompts, 24, page_size=4, speculative={"num_speculative_tokens": 4})
    assert fast.tokens == plain.tokens
    assert sum(fast.accepted_tokens) > 0 and sum(fast.verify_steps) < sum(map(len, plain.tokens))
    assert generate(model, prompts, 24, page_size=4, per_step=True,
                    speculative=SpeculativeConfig(num_speculative_tokens=4)).tokens == plain.tokens
    sampled = generate(model, prompts, 17, page_size=4, sampling=SamplingParams(temperature=0.8), seed=5,
                       speculative={"num_speculative_tokens": 2})
    assert [len(t) for t in sampled.tokens] == [17, 17]
    manager = sampled.state.manager
    assert int(manager.device.num_free) == manager.device.capacity


# ---------------------------------------------------------------- the engine


def _engine_run(model, prompts, new, **options):
    from jaxkv.serve import Engine

    engine = Engine(model, **options)
    ids = [engine.add_request(p, new) for p in prompts]
    outputs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
    return engine, [[t for o in outputs[i] for t in o.new_token_ids] for i in ids], [outputs[i][-1] for i in ids]


#: The engine's three ways to draft: prompt lookup, the target's first layer of two over its own pool (an
#: early exit), and a separate model with a cache of its own (here the target itself, as a model apart: it
#: proposes the target's own tokens, so it keeps every draft exactly when its cache holds the target's tokens);
#: θ 0 so that requests verify drafts to the end, kept or not.
ENGINE_DRAFTS = {"ngram": {"num_speculative_tokens": 3},
                 "early_exit": {"method": "draft_model", "draft_layers": 1, "num_speculative_tokens": 3,
                                "min_accepted_per_step": 0.0},
                 "separate": {"method": "draft_model", "model": "the target", "num_speculative_tokens": 3,
                              "min_accepted_per_step": 0.0}}


def _drafts(method: str, model) -> dict:
    """``ENGINE_DRAFTS[method]`` with the target as the separate draft model."""
    config = dict(ENGINE_DRAFTS[method])
    if "model" in config:
        config["model"] = model
    return config


@pytest.mark.parametrize("method", sorted(ENGINE_DRAFTS))
def test_engine_speculates_with_generate_tokens_under_preemption_and_prefix_hits(method):
    """Speculative decode chunks in the engine: greedy tokens equal plain
    ``generate``'s with rows preempted (a pool too small for all) and
    prompts sharing prefixes; the drafts are counted per request, in the
    stats and on /metrics. The early-exit draft runs over the target's own
    pool, so the pool is the same size as without speculation."""
    from prometheus_client.parser import text_string_to_metric_families

    from jaxkv.serve.metrics import ServerMetrics

    model = LlamaForCausalLM(LlamaConfig(**LLAMA), rngs=nnx.Rngs(3))
    rng = np.random.default_rng(11)
    base = rng.integers(1, LLAMA["vocab_size"], 9).tolist()
    prompts = [base * 2 + [5, 9], rng.integers(1, 61, 19).tolist(), base[:4] * 5, base * 2 + [7, 7]]
    expected = generate(model, prompts, 40, page_size=4).tokens
    # Three rows whose prompts and next chunk fit the pool, not their outputs: the newest is preempted.
    options = dict(max_seqs=3, page_size=4, num_pages=33, max_model_len=72, decode_chunk=4)
    engine, tokens, last = _engine_run(model, prompts, 40, speculative=_drafts(method, model), **options)
    assert tokens == expected
    stats = engine.stats()
    assert stats.preemptions > 0 and stats.prefix_hit_tokens > 0
    assert stats.spec_draft_tokens == sum(o.draft_tokens for o in last) > 0
    assert 0 < stats.spec_accepted_tokens == sum(o.accepted_draft_tokens for o in last) <= stats.spec_draft_tokens
    if method == "separate":  # its cache, filled lazily beside preemption and prefix hits, held the target's tokens
        assert stats.spec_accepted_tokens == stats.spec_draft_tokens
    engine.check_bookkeeping()
    metrics = ServerMetrics()
    metrics.set_engine_stats(stats)
    values = {s.name: s.value for f in text_string_to_metric_families(metrics.render().decode()) for s in f.samples}
    assert values["jaxkv_spec_draft_tokens_total"] == stats.spec_draft_tokens
    assert values["jaxkv_spec_accepted_tokens_total"] == stats.spec_accepted_tokens


HYBRID_ENGINE = ["gemma3/small", "qwen3_next/small", "gpt_oss/small"]


@pytest.mark.parametrize("name", HYBRID_ENGINE)
def test_hybrid_engine_speculates_with_generate_tokens_under_preemption_and_prefix_hits(name):
    """Speculation over a hybrid cache in the engine (window rings, Gated
    DeltaNet states: rolled back from the checkpoint rows), verify steps
    that never turn off: plain ``generate``'s greedy tokens (which begin
    with transformers') with rows preempted (twelve blocks for three rows
    that outgrow them), then a second turn that hits the first turn's
    snapshot; drafts were kept and rejected, and every block comes back."""
    from jaxkv.serve import Engine
    from tests.test_fuzz_engine_hybrid import check_hybrid_no_leak

    with open(os.path.join(FIXTURES, name, "expected.json"), encoding="utf-8") as f:
        fixture = json.load(f)
    model = AutoModelForCausalLM.from_pretrained(os.path.join(FIXTURES, name))
    prompts, new = fixture["prompts"], 40
    expected = generate(model, prompts, new).tokens
    assert [t[:fixture["max_new_tokens"]] for t in expected] == fixture["greedy"]
    engine = Engine(model, max_seqs=3, max_context_tokens=256, num_blocks={"full": 12}, decode_chunk=2,
                    prefill_chunk=64, speculative={"num_speculative_tokens": 3, "min_accepted_per_step": 0.0})
    order = np.argsort([-len(p) for p in prompts])  # longest first: three admitted together
    ids = {int(i): engine.add_request(prompts[i], new) for i in order}
    summary = engine.run()
    assert {i: engine.outputs[rid] for i, rid in ids.items()} == dict(enumerate(expected))
    assert summary.recompute_preemptions > 0
    last = int(order[-1])  # admitted last, retired last: its turn's snapshot is still cached
    turn = prompts[last] + expected[last] + [3, 5, 7]
    rid = engine.add_request(turn, new)
    assert engine.run().prefix_hit_tokens == len(turn) - 4  # the first turn's end (its last token never written)
    assert engine.outputs[rid] == generate(model, [turn], new).tokens[0]
    stats = engine.stats()
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens
    check_hybrid_no_leak(engine)
    assert engine.cache_plan.checkpoint_rows == (3 if name == "qwen3_next/small" else 0)  # rings: slack instead


@pytest.mark.parametrize("name", HYBRID_ENGINE + ["dsv4/small"])
def test_hybrid_packed_steps_verify_drafts_beside_prompt_pieces(name, monkeypatch):
    """Over a hybrid cache too (Gated DeltaNet states and DeepSeek-V4's
    stores restored from checkpoints, window rings with slack): requests
    arriving while others decode get packed steps that carry verify lanes
    beside their prompt pieces, drafts are verified there, and every
    request gets plain ``generate``'s tokens, greedy; sampled
    requests run to their lengths; every block comes back."""
    import jaxkv.serve.hybrid_cache as hybrid_cache
    import jaxkv.serve.speculation as speculation
    from jaxkv.serve import Engine
    from tests.test_fuzz_engine_hybrid import check_hybrid_no_leak

    real, seen = hybrid_cache._hybrid_packed_verify, []

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        seen.append((int(np.asarray(args[8]).sum()), int(np.asarray(out[7]).sum()), int(np.asarray(out[8]).sum())))
        return out

    monkeypatch.setattr(hybrid_cache, "_hybrid_packed_verify", spy)
    # No probation (its rule has tests of its own): every decoding request verifies in the packed steps.
    monkeypatch.setattr(speculation, "on_probation", lambda req: False)
    model = AutoModelForCausalLM.from_pretrained(os.path.join(FIXTURES, name))
    vocab = model.config.vocab_size
    rng = np.random.default_rng(len(name))
    base = rng.integers(1, vocab, 9).tolist()
    prompts = [base * 3, base * 2 + [4], rng.integers(1, vocab, 21).tolist(), base[:5] * 4]
    engine = Engine(model, max_seqs=4, max_context_tokens=128, decode_chunk=2, prefill_chunk=8,
                    speculative={"num_speculative_tokens": 3, "min_accepted_per_step": 0.0})
    ids = [engine.add_request(p, 30, arrival_step=step) for p, step in zip(prompts, (0, 8, 12, 16))]
    engine.run()
    assert [engine.outputs[i] for i in ids] == generate(model, prompts, 30).tokens
    assert seen and sum(verify for verify, _, _ in seen) > 0
    # Drafts were verified there (what a random model keeps of them is chance; the step's accept and reject
    # paths are checked exactly in test_hybrid_packed_verify_equals_a_cache_that_never_saw_the_rejected_tokens).
    assert 0 <= sum(kept for *_, kept in seen) < sum(drafted for _, drafted, _ in seen)
    seen.clear()
    ids = [engine.add_request(p, 20, sampling=SamplingParams(temperature=0.8), seed=i, arrival_step=engine._step + 4 * i)
           for i, p in enumerate(prompts)]
    engine.run()
    assert [len(engine.outputs[i]) for i in ids] == [20] * 4 and seen
    check_hybrid_no_leak(engine)


@pytest.mark.parametrize("method", sorted(ENGINE_DRAFTS))
def test_a_speculating_engine_swaps_aborts_and_keeps_tenants_apart(method):
    """Speculation beside preemption by swap (host pages), an abort in
    flight and two tenants' namespaces: every request not aborted gets
    plain ``generate``'s tokens, the aborted one a prefix of them, and
    every block comes back (an early-exit draft's K/V are the pool's first
    layer: swapped and shared with the rest)."""
    model = LlamaForCausalLM(LlamaConfig(**LLAMA), rngs=nnx.Rngs(3))
    rng = np.random.default_rng(12)
    base = rng.integers(1, LLAMA["vocab_size"], 9).tolist()
    first = base * 2 + [5, 9]
    # Request 0's prompt again, late: in the other tenant's namespace (1) and in its own (4).
    prompts = [first, first, rng.integers(1, 61, 19).tolist(), rng.integers(1, 61, 20).tolist(), first]
    expected = generate(model, prompts, 40, page_size=4).tokens
    from jaxkv.serve import Engine

    # 24 pages: two rows of 60 tokens (15 pages each) outgrow them even after the abort.
    engine = Engine(model, max_seqs=3, page_size=4, num_pages=25, max_model_len=72, decode_chunk=4,
                    num_host_pages=64, host_memory_kind="numpy",
                    speculative={**_drafts(method, model), "min_accepted_per_step": 0.0})
    ids = [engine.add_request(p, 40, namespace=tenant, arrival_step=step)
           for p, tenant, step in zip(prompts, "ABABA", (0, 40, 0, 0, 40))]
    for _ in range(3):
        engine.step()
    engine.abort(ids[2])
    summary = engine.run()
    for i, rid in enumerate(ids):
        got = engine.outputs[rid]
        assert got == (expected[i][:len(got)] if i == 2 else expected[i]), f"request {i}"
    assert len(engine.outputs[ids[2]]) < 40 and summary.swap_preemptions > 0
    stats = engine.stats()
    assert stats.spec_accepted_tokens > 0
    if method == "separate":  # swapped rows come back elsewhere: their draft rows are filled again from the start
        assert stats.spec_accepted_tokens == stats.spec_draft_tokens
    assert engine.cached_tokens(ids[1]) == 0 < engine.cached_tokens(ids[4])  # no hit across tenants
    engine.check_bookkeeping()


def test_packed_steps_verify_drafts_beside_prompt_pieces(monkeypatch):
    """Requests arriving while others decode: the packed steps that
    prefill their prompts (in 8-token pieces) carry verify lanes for the
    decoding requests past probation, in the same call; drafts are kept
    there, and every request gets plain ``generate``'s tokens. The rows'
    histories stay on the device: every call but the first gets them as a
    device array, the host sends each token at most once, and at the end
    each row holds its request's prompt and output."""
    import jaxkv.serve.caches as caches
    import jaxkv.serve.paged_cache as paged_cache
    from jaxkv.serve import Engine

    real, seen, sent = paged_cache._paged_packed_verify, [], []

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        seen.append((np.asarray(args[9]).sum(), int(np.asarray(out[8]).sum()), int(np.asarray(out[9]).sum())))
        sent.append((isinstance(args[7], jax.Array), int((np.asarray(args[10][0]) < 4).sum())))
        return out

    real_chunk = caches.speculative_chunk

    def chunk_spy(*args, **kwargs):
        sent.append((isinstance(args[11], jax.Array), int((np.asarray(args[20][0]) < 4).sum())))
        return real_chunk(*args, **kwargs)

    monkeypatch.setattr(paged_cache, "_paged_packed_verify", spy)
    monkeypatch.setattr(caches, "speculative_chunk", chunk_spy)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA), rngs=nnx.Rngs(3))
    rng = np.random.default_rng(3)
    base = rng.integers(1, LLAMA["vocab_size"], 9).tolist()
    prompts = [base * 3, base * 2 + [4], rng.integers(1, LLAMA["vocab_size"], 21).tolist(), base[:5] * 4]
    engine = Engine(model, max_seqs=4, page_size=4, num_pages=96, max_model_len=96, decode_chunk=2,
                    prefill_chunk=8, speculative={"num_speculative_tokens": 3, "min_accepted_per_step": 0.0})
    ids = [engine.add_request(p, 40, arrival_step=step) for p, step in zip(prompts, (0, 8, 12, 16))]
    engine.run()
    assert [engine.outputs[i] for i in ids] == generate(model, prompts, 40, page_size=4).tokens
    assert seen and sum(verify for verify, _, _ in seen) > 0
    assert 0 < sum(kept for *_, kept in seen) <= sum(drafted for _, drafted, _ in seen)
    engine.check_bookkeeping()
    assert len(sent) > 2 and not sent[0][0] and all(on_device for on_device, _ in sent[1:])
    assert 0 < sum(n for _, n in sent) <= sum(len(p) + 40 for p in prompts)
    speculation = engine.speculation
    history = np.asarray(speculation.base)
    for row, owner in enumerate(speculation.owner):
        if owner is not None:
            want = prompts[ids.index(owner)] + engine.outputs[owner]
            assert history[row, :speculation.length[row]].tolist() == want[:speculation.length[row]]
    # Sampled: the rejection rule in the packed step; each request runs to its length, every block back.
    seen.clear()
    ids = [engine.add_request(p, 30, sampling=SamplingParams(temperature=0.8), seed=i, arrival_step=engine._step + 4 * i)
           for i, p in enumerate(prompts)]
    engine.run()
    assert [len(engine.outputs[i]) for i in ids] == [30] * 4 and seen
    engine.check_bookkeeping()


@pytest.mark.parametrize("draft", ["first_layer", "whole_target"])
def test_early_exit_drafts_verify_in_packed_steps(draft, monkeypatch):
    """An early exit's requests ride in packed steps as verify lanes too:
    the draft's ``k`` decode steps run over the lanes' appended positions
    inside the packed call, before the target's. Requests arriving while
    others decode (probation patched away, so every decoding request
    verifies there) get plain ``generate``'s tokens; with the whole
    target as its own early exit (the layer-count check patched) every
    draft verified in a packed step is kept, greedy, which holds only if
    the draft steps saw exactly the target's context; sampled requests
    run to their lengths; every block comes back."""
    import jaxkv.serve.engine as engine_module
    import jaxkv.serve.paged_cache as paged_cache
    import jaxkv.serve.speculation as speculation
    from jaxkv.serve import Engine

    real, seen = paged_cache._paged_packed_verify, []

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        seen.append((int(np.asarray(args[9]).sum()), int(np.asarray(out[8]).sum()), int(np.asarray(out[9]).sum())))
        return out

    monkeypatch.setattr(paged_cache, "_paged_packed_verify", spy)
    monkeypatch.setattr(speculation, "on_probation", lambda req: False)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA), rngs=nnx.Rngs(3))
    if draft == "whole_target":
        monkeypatch.setattr(engine_module, "early_exit_draft", lambda target, layers, share_pool=False: target)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(1, LLAMA["vocab_size"], n).tolist() for n in (27, 19, 21, 20)]
    engine = Engine(model, max_seqs=4, page_size=4, num_pages=96, max_model_len=96, decode_chunk=2,
                    prefill_chunk=8, speculative={"method": "draft_model", "draft_layers": 1,
                                                  "num_speculative_tokens": 3, "min_accepted_per_step": 0.0})
    ids = [engine.add_request(p, 30, arrival_step=step) for p, step in zip(prompts, (0, 8, 12, 16))]
    engine.run()
    assert [engine.outputs[i] for i in ids] == generate(model, prompts, 30, page_size=4).tokens
    verified, drafted, kept = (sum(x) for x in zip(*seen))
    assert verified > 0 and drafted == 3 * verified
    assert kept == drafted if draft == "whole_target" else 0 <= kept < drafted
    engine.check_bookkeeping()
    seen.clear()
    prompts = [rng.integers(1, LLAMA["vocab_size"], n).tolist() for n in (27, 19, 21, 20)]  # no prefix hits
    ids = [engine.add_request(p, 20, sampling=SamplingParams(temperature=0.8), seed=i, arrival_step=engine._step + 4 * i)
           for i, p in enumerate(prompts)]
    engine.run()
    assert [len(engine.outputs[i]) for i in ids] == [20] * 4 and seen
    engine.check_bookkeeping()


def test_engine_turns_speculation_off_for_a_request_that_keeps_few_drafts():
    """A bar few requests meet (two kept drafts per verify step with k = 2:
    every draft kept): a request is judged after its probation of one
    draft per step (within a chunk of it) and, if it kept every one, after
    as many 2-draft steps; those off decode plainly, with the same tokens;
    a sampled run finishes at its lengths."""
    from jaxkv.serve.speculation import PROBATION_STEPS

    model = LlamaForCausalLM(LlamaConfig(**LLAMA), rngs=nnx.Rngs(5))
    rng = np.random.default_rng(5)
    prompts = [rng.integers(1, LLAMA["vocab_size"], 12).tolist() for _ in range(3)]
    config = {"num_speculative_tokens": 2, "min_accepted_per_step": 2.0}
    options = dict(max_seqs=3, page_size=4, num_pages=64, max_model_len=72, decode_chunk=2)
    engine, tokens, last = _engine_run(model, prompts, 48, speculative=config, **options)
    assert tokens == generate(model, prompts, 48, page_size=4).tokens
    records = list(engine._requests.values())
    for r in records:  # the documented rules, recomputed from the request's counts
        assert r.spec_probe_steps < PROBATION_STEPS + 2 and r.spec_full_steps < PROBATION_STEPS + 2  # a chunk's
        rate = r.spec_probe_kept / max(r.spec_probe_steps, 1)
        off_at_probation = r.spec_probe_steps >= PROBATION_STEPS and rate + rate ** 2 < 2.0
        off_later = r.spec_full_steps >= PROBATION_STEPS and r.spec_full_kept < 2.0 * r.spec_full_steps
        assert r.spec_on == (not off_at_probation and not off_later), r
        assert r.spec_full_steps == 0 or not off_at_probation  # k-draft steps only after a probation passed
    assert any(not r.spec_on for r in records)
    _, sampled, _ = _engine_run(model, prompts, 9, speculative=config, **options)
    assert [len(t) for t in sampled] == [9, 9, 9]


def test_engine_speculation_options():
    from jaxkv.serve import Engine
    from jaxkv.serve.options import EngineOptions

    options = EngineOptions.from_kwargs(speculative='{"method": "ngram", "num_speculative_tokens": 2}')
    assert options.scheduler.speculative == SpeculativeConfig(num_speculative_tokens=2)
    with pytest.raises(InvalidArgument, match="not JSON"):
        EngineOptions.from_kwargs(speculative="{method: ngram}")
    with pytest.raises(InvalidArgument, match="unknown keys"):
        EngineOptions.from_kwargs(speculative={"method": "ngram", "k": 2})
    model = LlamaForCausalLM(LlamaConfig(**LLAMA), rngs=nnx.Rngs(3))
    # A separate draft's cache holds the target's tokens, at most every row at full length, out of the same
    # budget: the target as its own draft costs what the target costs per token.
    for rows, budget in ((2, 400_000), (16, 200_000)):
        plain = Engine(model, max_seqs=rows, max_model_len=64, kv_cache_memory=budget)
        drafted = Engine(model, max_seqs=rows, max_model_len=64, kv_cache_memory=budget,
                         speculative={"method": "draft_model", "model": model})
        tokens = [engine.cache_plan.group("pages").tokens for engine in (plain, drafted)]
        draft = drafted.speculation.draft
        held = (draft.num_pages - 1) * draft.page_size
        cap = rows * (64 + 4 + 1)
        assert min(tokens[1], cap) <= held < min(tokens[1], cap) + draft.page_size
        assert tokens[1] + held <= tokens[0] * 1.02  # the two share what the target alone held
        assert drafted.cache_plan.device_bytes + draft.pool_bytes <= budget * 1.02
    # A hybrid cache's checkpoint rows (one per sequence row) come out of the same budget as its blocks.
    qwen = AutoModelForCausalLM.from_pretrained(os.path.join(FIXTURES, "qwen3_next/small"))
    plain, spec = (Engine(qwen, max_seqs=4, max_model_len=256, kv_cache_memory=2_000_000, speculative=config).cache_plan
                   for config in (None, {"num_speculative_tokens": 4}))
    assert (plain.checkpoint_rows, spec.checkpoint_rows) == (0, 4)
    assert spec.device_bytes <= spec.budget_bytes == 2_000_000
    assert spec.group("full").blocks < plain.group("full").blocks


# ---------------------------------------------------------------- draft models


def test_draft_models_give_the_target_tokens_and_a_perfect_draft_is_always_kept():
    """A self-speculative draft (the target's first two of four layers) and
    the target itself as its draft: greedy tokens equal plain ``generate``'s,
    the target as its own draft has every draft kept, and the draft's cache
    is rolled back with the target's (its rows end at the target's lengths)."""
    from jaxkv.nn.speculative import early_exit_draft

    model = LlamaForCausalLM(LlamaConfig(**{**LLAMA, "num_hidden_layers": 4}), rngs=nnx.Rngs(3))
    rng = np.random.default_rng(2)
    prompts = [rng.integers(1, LLAMA["vocab_size"], n).tolist() for n in (5, 11, 3)]
    plain = generate(model, prompts, 20, page_size=4).tokens
    early = generate(model, prompts, 20, page_size=4,
                     speculative={"method": "draft_model", "draft_layers": 2, "num_speculative_tokens": 3})
    assert early.tokens == plain and sum(early.draft_tokens) > 0
    perfect = generate(model, prompts, 20, page_size=4,
                       speculative={"method": "draft_model", "model": model, "num_speculative_tokens": 3})
    assert perfect.tokens == plain and perfect.accepted_tokens == perfect.draft_tokens
    # The early exit is the target cut short: its logits are the target's first layers' (same arrays).
    draft = early_exit_draft(model, 2)
    assert draft.config.num_hidden_layers == 2
    np.testing.assert_array_equal(np.asarray(draft.hf_state_dict()["model.embed_tokens.weight"]),
                                  np.asarray(model.hf_state_dict()["model.embed_tokens.weight"]))


def test_draft_model_refusals():
    model = LlamaForCausalLM(LlamaConfig(**LLAMA), rngs=nnx.Rngs(0))
    other = LlamaForCausalLM(LlamaConfig(**{**LLAMA, "vocab_size": 64}), rngs=nnx.Rngs(0))
    with pytest.raises(InvalidArgument, match="one of model"):
        SpeculativeConfig(method="draft_model")
    with pytest.raises(InvalidArgument, match=r"draft_layers=2: must be in \[1, 2\)"):
        generate(model, [[1, 2]], 4, speculative={"method": "draft_model", "draft_layers": 2})
    with pytest.raises(InvalidArgument, match="vocabulary"):
        generate(model, [[1, 2]], 4, speculative={"method": "draft_model", "model": other})
    qwen = AutoModelForCausalLM.from_pretrained(os.path.join(FIXTURES, "parity/qwen3_next_2"))
    with pytest.raises(InvalidArgument, match="paged pool"):
        generate(model, [[1, 2]], 4, speculative={"method": "draft_model", "model": qwen})
    from jaxkv.serve import Engine

    with pytest.raises(InvalidArgument, match="keeps a hybrid cache"):
        Engine(qwen, max_seqs=2, max_model_len=64, speculative={"method": "draft_model", "draft_layers": 1})
    with pytest.raises(InvalidArgument, match=r"draft_layers=2: must be in \[1, 2\)"):
        Engine(model, max_seqs=2, max_model_len=64, speculative={"method": "draft_model", "draft_layers": 2})


def test_a_separate_draft_model_runs_on_a_mesh():
    """A separate draft on a (one-device) mesh: its cache is placed there
    as the target's (the pool by ``cache_sharding``, the manager
    replicated), and the target as its own draft keeps every draft and
    gives plain ``generate``'s tokens (eight devices, the cache split over
    ``tp``: tests/test_mesh.py, long)."""
    from jaxkv.nn.sharding import cache_sharding
    from jaxkv.serve import Engine

    model = LlamaForCausalLM(LlamaConfig(**LLAMA), rngs=nnx.Rngs(0))
    prompts = [np.random.default_rng(9).integers(1, LLAMA["vocab_size"], n).tolist() for n in (7, 12)]
    expected = generate(model, prompts, 16, page_size=4).tokens
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("tp",))
    engine = Engine(model, max_seqs=2, max_model_len=64, page_size=4, decode_chunk=4, mesh=mesh,
                    speculative={"method": "draft_model", "model": model, "num_speculative_tokens": 3,
                                 "min_accepted_per_step": 0.0})
    draft = engine.speculation.draft
    for leaf, planned in zip(jax.tree.leaves(draft.pool), jax.tree.leaves(cache_sharding(draft.pool, mesh))):
        assert leaf.sharding.is_equivalent_to(planned, leaf.ndim)
    ids = [engine.add_request(p, 16) for p in prompts]
    engine.run()
    assert [engine.outputs[i] for i in ids] == expected
    stats = engine.stats()
    assert 0 < stats.spec_accepted_tokens == stats.spec_draft_tokens


@pytest.mark.parametrize("seed", range(3))
def test_a_ragged_append_equals_appending_each_row_alone(seed):
    """``append_slots(..., counts=)`` grows row ``i`` by ``counts[i]``
    tokens (0 included, shared last blocks copied on write): the lengths,
    the free blocks and each row's slots equal those of appending each row
    alone, and every slot lies in the row's own table."""
    from jaxkv import BlockSpaceManager

    rng = np.random.default_rng(seed)
    rows, bs, width = 5, 4, 11
    manager = BlockSpaceManager.create(num_device_blocks=64, num_host_blocks=2, block_size=bs, max_seqs=rows,
                                       max_blocks_per_seq=8, watermark=0.0)
    pool = LlamaForCausalLM(LlamaConfig(**LLAMA), rngs=nnx.Rngs(0)).make_pool(64, bs)
    manager, ok = manager.allocate([0, 1], int(rng.integers(1, 7)))  # rows 0 and 1 share a prompt
    assert bool(ok)
    for row in range(2, rows):
        manager, ok = manager.allocate([row], int(rng.integers(1, 9)))
        assert bool(ok)
    counts = rng.integers(0, width + 1, rows).astype(np.int32)
    counts[int(rng.integers(rows))] = 0
    ragged, _, slots, _, ok = manager.append_slots(pool, np.arange(rows), width, counts=counts)
    assert bool(ok)
    alone = manager
    for row in range(rows):
        if counts[row]:
            alone, _, _, _, ok = alone.append_slots(pool, [row], int(counts[row]))
            assert bool(ok)
    np.testing.assert_array_equal(np.asarray(ragged.seq_lens), np.asarray(alone.seq_lens))
    assert int(ragged.device.num_free) == int(alone.device.num_free)
    slots = np.asarray(slots)
    before = np.asarray(manager.seq_lens)
    for row in range(rows):
        assert (slots[row, counts[row]:] == -1).all()
        positions = before[row] + np.arange(counts[row])
        want = np.asarray(ragged.token_slots(jnp.asarray([row]), jnp.asarray(positions)[None]))[0]
        np.testing.assert_array_equal(slots[row, :counts[row]], want)
    assert len(set(slots[slots >= 0].tolist())) == int((slots >= 0).sum())  # no slot written twice


def test_a_separate_draft_cache_plans_for_a_small_pool_and_a_catch_up_cap(monkeypatch):
    """A separate draft whose cache holds few pages and catches up at most 8
    tokens a chunk: the plan leaves rows out (they decode plainly in that
    chunk) and feeds long prompts over several chunks, no append in a
    chunk fails (the engine would raise), and the greedy tokens are plain
    ``generate``'s; the target as its own draft keeps every draft."""
    from jaxkv.serve import Engine, drafts

    model = LlamaForCausalLM(LlamaConfig(**LLAMA), rngs=nnx.Rngs(3))
    rng = np.random.default_rng(5)
    prompts = [rng.integers(1, LLAMA["vocab_size"], n).tolist() for n in (21, 9, 14, 6)]
    expected = generate(model, prompts, 30, page_size=4).tokens
    cls = drafts.DraftCache
    small = partial(cls, num_pages=13)  # 12 pages of 4: not every row's peak at once

    def make(*args, num_pages, catch_up_tokens, **kwargs):
        return small(*args, catch_up_tokens=8, **kwargs)

    plans = []
    real = cls.plan

    def spy(self, running, speculate, steps, k):
        drafting = real(self, running, speculate, steps, k)
        plans.append((int(speculate.sum()), int(drafting.sum())))
        return drafting

    monkeypatch.setattr(cls, "plan", spy)
    monkeypatch.setattr(drafts, "DraftCache", make)
    engine, tokens, _ = _engine_run(model, prompts, 30, max_seqs=3, page_size=4, num_pages=40, max_model_len=64,
                                    decode_chunk=2, speculative=_drafts("separate", model))
    assert tokens == expected
    assert any(d < s for s, d in plans) and any(d > 0 for _, d in plans)
    stats = engine.stats()
    assert 0 < stats.spec_accepted_tokens == stats.spec_draft_tokens
    engine.check_bookkeeping()


def test_a_hybrid_target_drafts_with_a_separate_paged_model():
    """Gemma 3 (window rings with slack, a hybrid cache) drafting with a
    one-layer Llama of its vocabulary over a paged cache of its own: plain
    ``generate``'s greedy tokens under preemption, drafts verified."""
    from jaxkv.serve import Engine

    model = AutoModelForCausalLM.from_pretrained(os.path.join(FIXTURES, "gemma3/small"))
    with open(os.path.join(FIXTURES, "gemma3/small", "expected.json"), encoding="utf-8") as f:
        prompts = json.load(f)["prompts"]
    draft = LlamaForCausalLM(LlamaConfig(**{**LLAMA, "vocab_size": model.config.vocab_size, "num_hidden_layers": 1}),
                             rngs=nnx.Rngs(1))
    expected = generate(model, prompts, 24).tokens
    engine = Engine(model, max_seqs=3, max_context_tokens=256, num_blocks={"full": 12}, decode_chunk=2,
                    prefill_chunk=64, speculative={"method": "draft_model", "model": draft,
                                                   "num_speculative_tokens": 3, "min_accepted_per_step": 0.0})
    ids = [engine.add_request(p, 24) for p in prompts]
    engine.run()
    assert [engine.outputs[i] for i in ids] == expected
    assert engine.stats().spec_draft_tokens > 0


def _early_exit_sampled_second_tokens(model, prompt, sampling, draws):
    """The second token of ``draws`` seeded requests of ``prompt`` (two new
    tokens each) through an engine whose early-exit draft (the first layer)
    proposes them: the first comes from the prefill, the second from a
    verify step (requests arrive in waves of a batch, so each wave's
    prefill ends before its verify steps)."""
    from jaxkv.serve import Engine

    engine = Engine(model, max_seqs=64, page_size=4, num_pages=400, max_model_len=16, decode_chunk=2,
                    speculative={"method": "draft_model", "draft_layers": 1, "num_speculative_tokens": 2,
                                 "min_accepted_per_step": 0.0})
    ids = []
    for wave in range(0, draws, 64):
        ids += [engine.add_request(prompt, 2, sampling=sampling, seed=seed) for seed in range(wave, wave + 64)]
        engine.run()
    assert engine.stats().spec_draft_tokens > draws * 0.9  # (nearly) every second token went through a verify
    return np.asarray([engine.outputs[i][1] for i in ids])


def test_early_exit_drafts_in_the_engine_keep_the_target_distribution(monkeypatch):
    """Sampled speculation in the engine (per-request seeds, temperature
    and top-k): the second token's frequencies over 1,536 requests match
    the target's exact marginal ``sum_t1 p(t1) p(t2 | t1)`` (dense forward,
    no cache) by Pearson's chi-square; the same run with the draft's ``q``
    taken before temperature and top-k (a plumbing bug the rule cannot
    absorb) fails it."""
    from jaxkv.nn.sampling import filtered_logits

    vocab = 12
    model = LlamaForCausalLM(LlamaConfig(**{**LLAMA, "vocab_size": vocab, "num_hidden_layers": 4}),
                             rngs=nnx.Rngs(7))
    sampling = SamplingParams(temperature=0.5, top_k=4)

    def dist(logits):
        scaled, _ = filtered_logits(logits, sampling)
        return np.asarray(jax.nn.softmax(scaled, axis=-1), np.float64)

    prompt = np.random.default_rng(7).integers(1, vocab, 6).tolist()
    p1 = dist(model.forward_dense(jnp.asarray([prompt]))[:, -1])[0]
    p2 = p1 @ dist(model.forward_dense(jnp.asarray([prompt + [t] for t in range(vocab)]))[:, -1])
    draws = 1536
    second = _early_exit_sampled_second_tokens(model, prompt, sampling, draws)
    assert _chi_square_p(np.bincount(second, minlength=vocab), p2) > 1e-4
    real = spec._draft_token

    def unfiltered_q(logits, sampling, key, i):
        token, q = real(logits, sampling, key, i)
        return token, None if q is None else jax.nn.softmax(logits, axis=-1)

    monkeypatch.setattr(spec, "_draft_token", unfiltered_q)
    jax.clear_caches()  # the engine's jitted chunk traced the real one
    wrong = _early_exit_sampled_second_tokens(model, prompt, sampling, draws)
    assert _chi_square_p(np.bincount(wrong, minlength=vocab), p2) < 1e-6


@pytest.mark.parametrize("family", ["llama", "dsv3"])
def test_early_exit_engine_gives_generate_tokens_for_each_paged_family(family):
    """The engine's early-exit draft for both paged-pool families (a GQA
    Llama pool; DeepSeek-V3's MLA latent pool, MoE past its dense first
    layer): greedy tokens equal plain ``generate``'s under preemption and
    prefix hits, drafts kept."""
    if family == "dsv3":
        model = AutoModelForCausalLM.from_pretrained(os.path.join(FIXTURES, "parity/dsv3_1"))
    else:
        model = LlamaForCausalLM(LlamaConfig(**{**LLAMA, "num_hidden_layers": 4}), rngs=nnx.Rngs(9))
    vocab = model.config.vocab_size
    rng = np.random.default_rng(1)
    base = rng.integers(1, vocab, 9).tolist()
    prompts = [base * 2 + [5, 9], rng.integers(1, vocab, 19).tolist(), base[:4] * 5]
    expected = generate(model, prompts, 24, page_size=4).tokens
    config = {"method": "draft_model", "draft_layers": 1, "num_speculative_tokens": 3, "min_accepted_per_step": 0}
    engine, tokens, _ = _engine_run(model, prompts, 24, speculative=config, max_seqs=2, page_size=4, num_pages=20,
                                    max_model_len=64, decode_chunk=4)
    assert tokens == expected
    stats = engine.stats()
    assert stats.preemptions > 0 and stats.prefix_hit_tokens > 0 and stats.spec_accepted_tokens > 0
    engine.check_bookkeeping()


def test_smollm2_speculates_with_its_own_first_layers():
    """The real SmolLM2: greedy tokens with a self-speculative draft (its
    first 15 of 30 layers) and with n-gram lookup equal plain ``generate``'s
    on a prompt that copies a passage."""
    from jaxkv.bench.spec import PASSAGE
    from jaxkv.nn.gguf import SMOLLM2_INSTALL, find_smollm2
    from jaxkv.text import Tokenizer

    path = find_smollm2()
    if path is None:
        pytest.skip(SMOLLM2_INSTALL)
    model, tokenizer = AutoModelForCausalLM.from_pretrained(path), Tokenizer.from_pretrained(path)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": f"Repeat this text exactly:\n\n{PASSAGE}"}],
                                        tokenize=True)
    plain = generate(model, [ids], 40).tokens
    ngram = generate(model, [ids], 40, speculative={"num_speculative_tokens": 4})
    early = generate(model, [ids], 40, speculative={"method": "draft_model", "draft_layers": 15,
                                                     "num_speculative_tokens": 3})
    assert ngram.tokens == plain and early.tokens == plain
    assert sum(ngram.accepted_tokens) > 0 and sum(early.accepted_tokens) > 0
    # The engine, drafting with the same early exit over the model's own pool.
    _, tokens, last = _engine_run(model, [ids], 40, max_seqs=2, max_model_len=512, decode_chunk=4,
                                  speculative={"method": "draft_model", "draft_layers": 15,
                                               "num_speculative_tokens": 3, "min_accepted_per_step": 0})
    assert tokens == plain and last[0].accepted_draft_tokens > 0


def test_the_server_flag_reaches_the_engine_options():
    import argparse

    from jaxkv.serve.options import add_arguments, from_cli

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 5, '
                                                       '"prompt_lookup_max": 4}'])
    config = from_cli(args).scheduler.speculative
    assert config == SpeculativeConfig(num_speculative_tokens=5, prompt_lookup_max=4)
    assert from_cli(parser.parse_args([])).scheduler.speculative is None


@pytest.mark.parametrize("method", ["ngram", "separate"])
def test_a_speculating_engine_recovers_from_a_failed_step_with_its_lookahead(method):
    """A contained failure rebuilds the cache (jaxkv.serve.faults): the new
    one keeps the verify step's lookahead, a separate draft's cache is
    emptied with it (the target as its own draft keeps every draft after,
    so its rows were filled again), and the requests finish with plain
    ``generate``'s tokens."""
    model = LlamaForCausalLM(LlamaConfig(**LLAMA), rngs=nnx.Rngs(3))
    rng = np.random.default_rng(4)
    base = rng.integers(1, LLAMA["vocab_size"], 7).tolist()
    prompts = [base * 3, base * 2 + [3]]
    from jaxkv.serve import Engine

    engine = Engine(model, max_seqs=2, page_size=4, num_pages=40, max_model_len=64, decode_chunk=4,
                    speculative=_drafts(method, model))
    ids = [engine.add_request(p, 20) for p in prompts]
    engine.step()
    engine.step()
    real = engine.cache.decode
    calls = {"n": 0}

    def fail_once(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected")
        return real(*args, **kwargs)

    engine.cache.decode = fail_once
    engine.run()
    stats = engine.stats()
    assert stats.step_failures == 1 and engine.cache.lookahead == 3
    assert [engine.outputs[i] for i in ids] == generate(model, prompts, 20, page_size=4).tokens
    if method == "separate":
        assert 0 < stats.spec_accepted_tokens == stats.spec_draft_tokens
