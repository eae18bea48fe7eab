"""Window layers of interleaved models (gpt-oss, Gemma 3) through the hybrid
cache: the per-request K/V ring (``AttentionKind.WINDOW``) and the paged
layout with ``sliding_window`` both give, step after step, what a float64
numpy attention over each request's whole history gives; the ring holds
``window`` tokens however long a request grows, resets on release and
travels through snapshot rows and the host store."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.errors import InvalidArgument
from jaxkv.manager.hybrid_host import read_state_rows, write_state_rows
from jaxkv.manager.hybrid_schema import AttentionKind
from jaxkv.nn.window_cache import attend_through_cache, interleaved_cache

HEADS, KV_HEADS, DIM, WINDOW = 4, 2, 8, 5
SLIDING = (True, False)  # layer 0 windowed, layer 1 full


def reference(q, keys, values, positions, window, scale, sinks, cap):
    """float64 attention of one token ``q [H, D]`` at ``positions[-1]`` over
    its request's history (keys/values ``[n, KVH, D]`` at ``positions``)."""
    p = positions[-1]
    seen = (positions <= p) & ((positions > p - window) if window else True)
    k, v = keys[seen].astype(np.float64), values[seen].astype(np.float64)
    group = HEADS // KV_HEADS
    out = np.zeros((HEADS, v.shape[-1]))
    for h in range(HEADS):
        logits = k[:, h // group] @ q[h].astype(np.float64) * scale
        if cap:
            logits = cap * np.tanh(logits / cap)
        top = logits.max() if sinks is None else max(logits.max(), sinks[h])
        w = np.exp(logits - top)
        total = w.sum() + (0.0 if sinks is None else np.exp(sinks[h] - top))
        out[h] = (w / total) @ v[:, h // group]
    return out


@functools.partial(jax.jit, static_argnames=("layer", "window", "cap", "with_sinks"))
def _step(manager, slots, positions, request_ids, q, k, v, sinks, *, layer, window, cap, with_sinks):
    handle = manager.acquire(layer, slots, positions, request_ids)
    out, handle = attend_through_cache(handle, q, k, v, sm_scale=0.3, sliding_window=window,
                                       sinks=sinks if with_sinks else None, logit_soft_cap=cap)
    return out, manager.update(handle)


def _run(window_cache, steps, *, cap, with_sinks, rng, check_bounded=False):
    """Drive both layers of a 2-layer cache through ``steps`` (lists of
    ``(request, num_new)`` per step, packed as one stream with padding) and
    compare every real token's output with the reference."""
    manager = interleaved_cache(SLIDING, 3, 64, num_kv_heads=KV_HEADS, head_dim=DIM, num_query_heads=HEADS,
                                window=WINDOW, dtype=jnp.float32, page_size=4, window_cache=window_cache)
    manager, slots, ok = manager.admit(2, max_n=2)
    assert bool(ok)
    sinks = rng.normal(size=HEADS).astype(np.float32)
    history = {r: {layer: ([], [], []) for layer in range(2)} for r in range(2)}
    length = [0, 0]
    for step in steps:
        num_new = np.zeros(2, np.int32)
        for r, n in step:
            num_new[r] = n
        manager, starts, ok = manager.reserve(slots, jnp.asarray(num_new), max_new_tokens=16)
        assert bool(ok)
        # The packed stream: each request's tokens, then two padding tokens.
        ids, pos = [], []
        for r, n in step:
            ids += [r] * n
            pos += list(range(length[r], length[r] + n))
        ids += [0, 1]
        pos += [-1, -1]
        t = len(ids)
        for layer in range(2):
            q = rng.normal(size=(t, HEADS, DIM)).astype(np.float32)
            k = rng.normal(size=(t, KV_HEADS, DIM)).astype(np.float32)
            v = rng.normal(size=(t, KV_HEADS, DIM)).astype(np.float32)
            window = WINDOW if SLIDING[layer] else None
            out, manager = _step(manager, slots, jnp.asarray(pos, jnp.int32), jnp.asarray(ids, jnp.int32),
                                 jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(sinks), layer=layer,
                                 window=window, cap=cap, with_sinks=with_sinks)
            out = np.asarray(out)
            for i in range(t):
                if pos[i] < 0:
                    assert not np.any(out[i]), "a padding token must read nothing"
                    continue
                hk, hv, hp = history[ids[i]][layer]
                hk.append(k[i])
                hv.append(v[i])
                hp.append(pos[i])
            for i in range(t):
                if pos[i] < 0:
                    continue
                hk, hv, hp = history[ids[i]][layer]
                upto = hp.index(pos[i]) + 1
                want = reference(q[i], np.stack(hk[:upto]), np.stack(hv[:upto]), np.asarray(hp[:upto]), window, 0.3,
                                 sinks if with_sinks else None, cap)
                np.testing.assert_allclose(out[i], want, rtol=2e-5, atol=2e-5,
                                           err_msg=f"{window_cache} layer {layer} request {ids[i]} pos {pos[i]}")
        for r, n in step:
            length[r] += n
        if check_bounded:
            held = np.asarray(manager.window_pool.pos[0])[np.asarray(slots)]
            for r in range(2):
                live = held[r][held[r] >= 0]
                assert sorted(live) == list(range(max(0, length[r] - WINDOW), length[r])), (r, live, length[r])
    return manager, slots


# Chunks longer than the window, chunks that straddle it, decodes; two
# requests at different lengths in each packed step.
STEPS = [[(0, 11), (1, 3)], [(0, 1), (1, 7)], [(0, 1), (1, 1)], [(0, 6), (1, 1)], [(0, 1), (1, 12)],
         [(0, 2), (1, 1)]]


# The paged layout in the long pass (tests/conftest.py): its sinks path is also covered by the gpt-oss model tests.
@pytest.mark.parametrize("window_cache", ["ring", "paged"])
def test_interleaved_cache_matches_float64_attention(window_cache):
    rng = np.random.default_rng()
    _run(window_cache, STEPS, cap=None, with_sinks=True, rng=rng, check_bounded=window_cache == "ring")


def test_window_ring_with_soft_cap_and_no_sinks():
    _run("ring", STEPS[:3], cap=2.0, with_sinks=False, rng=np.random.default_rng())


def test_ring_holds_window_tokens_and_layout():
    manager = interleaved_cache(SLIDING, 3, 4096, num_kv_heads=KV_HEADS, head_dim=DIM, num_query_heads=HEADS,
                                window=WINDOW, dtype=jnp.bfloat16, window_cache="ring")
    assert [s.kind for s in manager.schemas] == [AttentionKind.WINDOW, AttentionKind.FULL]
    assert list(manager.groups) == ["full"]  # the window layer takes no blocks
    ring = manager.window_pool
    k, _, _ = ring.read(0, jnp.arange(manager.num_slots))
    assert ring.k_bits.shape == (1, manager.num_slots, KV_HEADS, WINDOW, DIM) and k.dtype == jnp.bfloat16
    assert ring.k_bits.dtype == jnp.uint16  # stored as bits: scatters update in place on CPU
    paged = interleaved_cache(SLIDING, 3, 4096, num_kv_heads=KV_HEADS, head_dim=DIM, num_query_heads=HEADS,
                              window=WINDOW, dtype=jnp.bfloat16, window_cache="paged")
    assert [s.kind for s in paged.schemas] == [AttentionKind.FULL, AttentionKind.FULL]
    assert paged.full_pool.k_pages.shape[0] == 2 and manager.full_pool.k_pages.shape[0] == 1


def test_ring_resets_on_release_and_moves_through_snapshots_and_host():
    rng = np.random.default_rng()
    manager = interleaved_cache(SLIDING, 2, 64, num_kv_heads=KV_HEADS, head_dim=DIM, num_query_heads=HEADS,
                                window=WINDOW, dtype=jnp.float32, page_size=4, num_snapshots=2)
    manager, slots, _ = manager.admit(1, max_n=1)
    manager, _, ok = manager.reserve(slots, jnp.asarray([9]), max_new_tokens=16)
    assert bool(ok)
    positions = jnp.arange(9, dtype=jnp.int32)
    ids = jnp.zeros(9, jnp.int32)
    q, k, v = (jnp.asarray(rng.normal(size=(9, h, DIM)), jnp.float32) for h in (HEADS, KV_HEADS, KV_HEADS))
    _, manager = _step(manager, slots, positions, ids, q, k, v, jnp.zeros(HEADS), layer=0, window=WINDOW, cap=None,
                       with_sinks=False)
    slot = int(slots[0])

    def row(manager, r):  # (k, v, pos) of state row r of the window layer
        return [np.asarray(a[0]) for a in manager.window_pool.read(0, jnp.asarray([r]))]

    ring_k, _, ring_pos = row(manager, slot)
    np.testing.assert_array_equal(np.sort(ring_pos), np.arange(4, 9))
    np.testing.assert_array_equal(ring_k[:, np.arange(4, 9) % WINDOW], np.asarray(k[4:9]).transpose(1, 0, 2))
    # Into a snapshot row and out to the host and back into another row.
    snapshot = manager.num_slots
    manager = manager.copy_state(jnp.asarray([slot]), jnp.asarray([snapshot]))
    rows = read_state_rows(manager, jnp.asarray([snapshot]))
    manager, _ = manager.release(slots)
    released_k, _, released_pos = row(manager, slot)
    assert np.all(released_pos == -1) and not np.any(released_k)
    manager = write_state_rows(manager, jnp.asarray([snapshot + 1]), rows)
    back_k, _, back_pos = row(manager, snapshot + 1)
    np.testing.assert_array_equal(back_k, ring_k)
    np.testing.assert_array_equal(back_pos, ring_pos)


def test_errors_name_the_problem():
    with pytest.raises(InvalidArgument, match="window_cache 'rings'"):
        interleaved_cache(SLIDING, 2, 64, num_kv_heads=2, head_dim=8, num_query_heads=4, window=4,
                          dtype=jnp.float32, window_cache="rings")
    with pytest.raises(InvalidArgument, match="every layer is a window layer"):
        interleaved_cache((True, True), 2, 64, num_kv_heads=2, head_dim=8, num_query_heads=4, window=4,
                          dtype=jnp.float32)
    manager = interleaved_cache(SLIDING, 2, 64, num_kv_heads=2, head_dim=8, num_query_heads=4, window=4,
                                dtype=jnp.float32)
    manager, slots, _ = manager.admit(1, max_n=1)
    handle = manager.acquire(0, slots, jnp.zeros(1, jnp.int32))
    x = jnp.zeros((1, 2, 8))
    with pytest.raises(InvalidArgument, match="ring holds 4 tokens but the layer attends a window of 8"):
        attend_through_cache(handle, jnp.zeros((1, 4, 8)), x, x, sm_scale=1.0, sliding_window=8)


def test_a_decode_step_updates_the_ring_in_place():
    """A donated decode step through a bf16 ring layer scatters into the
    ring (K, V, positions) and copies or converts none of it."""
    from tests.util import pool_sized_copies, pool_sized_updates

    manager = interleaved_cache(SLIDING, 4, 2048, num_kv_heads=4, head_dim=64, num_query_heads=8, window=256,
                                dtype=jnp.bfloat16)
    manager, slots, _ = manager.admit(4, max_n=4)
    manager, _, _ = manager.reserve(slots, jnp.full((4,), 300), max_new_tokens=512)

    def step(manager, q, k, v):
        handle = manager.acquire(0, slots, manager.seq_lens[slots] - 1)
        out, handle = attend_through_cache(handle, q, k, v, sm_scale=0.1, sliding_window=256)
        return out, manager.update(handle)

    q, kv = jnp.ones((4, 8, 64), jnp.bfloat16), jnp.ones((4, 4, 64), jnp.bfloat16)
    hlo = jax.jit(step, donate_argnums=0).lower(manager, q, kv, kv).compile().as_text()
    ring = jax.tree.leaves(manager.window_pool)
    assert pool_sized_updates(hlo, min(a.nbytes for a in ring)) == 3
    assert pool_sized_copies(hlo, shapes=[a.shape for a in ring]) == []
