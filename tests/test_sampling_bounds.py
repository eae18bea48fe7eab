"""SamplingParams' bounds and the sampler at their edges (issue 39).

* Every field is checked where it enters: each bad value is refused with
  ``InvalidArgument`` naming the field and the value, and every accepted
  extreme goes through :meth:`RowSampling.stack` and the engine's int32 /
  float32 casts without raising (they used to fail inside the engine's step,
  for every request in flight).
* The nucleus always keeps the most likely token: a tiny ``top_p`` (the
  smallest accepted, just above float32's smallest normal, and a ``top_p``
  the device reads as 0 in a ``RowSampling``) samples the argmax of fresh
  random logits, as does a tiny temperature on logits that are all
  negative (they used to draw token 0).
* Ordinary values keep their rule: over many keys, every sampled token lies
  in the top-k / top-p set computed independently with numpy.
"""

from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv import InvalidArgument
from jaxkv.nn.sampling import TOP_K_MAX, RowSampling, SamplingParams, filtered_logits, sample

F32 = np.finfo(np.float32)
SMALLEST_NORMAL = float(F32.smallest_normal)  # 1.1754943508222875e-38: the smallest accepted top_p

BAD = [
    ("temperature", -0.5), ("temperature", -1e-30), ("temperature", float("nan")), ("temperature", float("inf")),
    ("temperature", float("-inf")), ("temperature", 1e39), ("temperature", 1e-40), ("temperature", True),
    ("temperature", "1.0"), ("temperature", None), ("temperature", 1j),
    ("top_k", -1), ("top_k", 2**31), ("top_k", 2**63), ("top_k", True), ("top_k", 2.0), ("top_k", 5.5),
    ("top_k", "5"), ("top_k", None), ("top_k", np.float32(3)),
    ("top_p", 0), ("top_p", 0.0), ("top_p", -0.1), ("top_p", 1.0000001), ("top_p", 1.5), ("top_p", float("nan")),
    ("top_p", float("inf")), ("top_p", 1e-40), ("top_p", 1e-300), ("top_p", 1.1754942e-38), ("top_p", True),
    ("top_p", "0.5"), ("top_p", None),
]


@pytest.mark.parametrize(("field", "value"), BAD, ids=[f"{f}={v!r}" for f, v in BAD])
def test_bad_values_are_refused_naming_the_field(field, value):
    with pytest.raises(InvalidArgument) as info:
        SamplingParams(**{"temperature": 1.0, field: value})
    message = str(info.value)
    assert f"SamplingParams.{field}" in message, message
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        assert repr(float(value) if field != "top_k" else value) in message or repr(value) in message, message


ACCEPTED = [
    dict(temperature=0.0), dict(temperature=0), dict(temperature=SMALLEST_NORMAL), dict(temperature=float(F32.max)),
    dict(temperature=np.float64(0.7)), dict(temperature=1.0, top_k=TOP_K_MAX), dict(temperature=1.0, top_k=np.int64(7)),
    dict(temperature=1.0, top_p=SMALLEST_NORMAL), dict(temperature=1.0, top_p=1.2e-38), dict(temperature=1.0, top_p=1),
    dict(temperature=1.0, top_p=np.float32(0.9)),
]


@pytest.mark.parametrize("kwargs", ACCEPTED, ids=[repr(k) for k in ACCEPTED])
def test_accepted_values_stack_and_cast_without_raising(kwargs):
    """What SamplingParams accepts, RowSampling.stack and the engine's casts
    (np.int32 / np.float32 with overflow raising) take exactly, with every
    numpy floating-point error raising and every warning an error."""
    params = SamplingParams(**kwargs)
    assert type(params.temperature) is float and type(params.top_k) is int and type(params.top_p) is float
    import warnings

    with warnings.catch_warnings(), np.errstate(all="raise"):
        warnings.simplefilter("error")
        rows = RowSampling.stack([params, None, params])
        cast = (np.float32(params.temperature), np.int32(params.top_k), np.float32(params.top_p))
    assert rows.top_k.tolist() == [params.top_k, 0, params.top_k]
    assert rows.temperature[0] == np.float32(params.temperature) and np.isfinite(rows.temperature).all()
    assert rows.top_p[0] == np.float32(params.top_p) and (rows.top_p >= F32.smallest_normal).all()
    assert cast[1] == params.top_k and np.isfinite(cast[0]) and cast[2] > 0


def _logits(seed: int, rows: int = 4, vocab: int = 257, scale: float = 3.0, shift: float = 0.0) -> np.ndarray:
    return (np.random.default_rng(seed).normal(size=(rows, vocab)) * scale + shift).astype(np.float32)


@pytest.mark.parametrize("top_p", [SMALLEST_NORMAL, 1.2e-38, 1e-30, 1e-7])
def test_tiny_top_p_samples_the_argmax(top_p):
    """The smallest accepted top_p (and other tiny ones): the argmax of
    fresh random logits, several seeds and keys, with and without top_k."""
    jitted = jax.jit(sample)
    for seed in range(6):
        logits = _logits(100 + seed)
        want = np.argmax(logits, axis=-1)
        for top_k in (0, 50):
            params = SamplingParams(temperature=1.5, top_k=top_k, top_p=top_p)
            for key in range(3):
                got = np.asarray(jitted(jnp.asarray(logits), jax.random.key(1000 * seed + key), params))
                np.testing.assert_array_equal(got, want, err_msg=f"top_p={top_p} seed={seed} key={key}")


def test_a_top_p_the_device_reads_as_zero_still_keeps_the_top_token():
    """RowSampling arrays bypass SamplingParams' check: a top_p of 0 or one
    below float32's smallest normal (flushed to 0 on the device) keeps the
    most likely token; it used to leave no token, and the draw was token 0."""
    logits = _logits(7, rows=5)
    assert (np.argmax(logits, axis=-1) != 0).all()
    params = RowSampling(temperature=np.full(5, 1.0, np.float32), top_k=np.array([0, 0, 3, 0, 0], np.int32),
                         top_p=np.array([0.0, 1e-40, 1e-40, 1e-45, -1.0], np.float32))
    for key in range(5):
        got = np.asarray(jax.jit(sample)(jnp.asarray(logits), jax.random.key(key), params))
        np.testing.assert_array_equal(got, np.argmax(logits, axis=-1))


@pytest.mark.parametrize("temperature", [SMALLEST_NORMAL, 1e-37, 1e-30])
def test_tiny_temperature_samples_the_argmax_even_with_negative_logits(temperature):
    """Logits that are all negative, divided by a tiny temperature, used to
    be -inf everywhere (token 0); each row's max is now exactly 0 first."""
    for seed in range(4):
        for shift in (-60.0, 0.0, 60.0):
            logits = _logits(200 + seed, shift=shift)
            got = np.asarray(sample(jnp.asarray(logits), jax.random.key(seed), SamplingParams(temperature=temperature)))
            np.testing.assert_array_equal(got, np.argmax(logits, axis=-1), err_msg=f"seed={seed} shift={shift}")


def allowed_tokens(row: np.ndarray, temperature: float, top_k: int, top_p: float, tol: float = 1e-4) -> set[int]:
    """The tokens the rule of jaxkv.nn.sampling may draw, in float64 numpy:
    the top_k most likely (ties at the k-th value kept), then the most likely
    ones whose more likely tokens (within the top k, renormalised) hold less
    than top_p (+ tol, for float32 rounding at the boundary), at least one."""
    if temperature == 0:
        return {int(np.argmax(row))}
    z = row.astype(np.float64) / temperature
    order = np.argsort(-z, kind="stable")
    k = len(z) if top_k == 0 else min(top_k, len(z))
    in_top_k = z >= z[order[k - 1]]
    head = z[order[:k]]
    probs = np.exp(head - head.max())
    probs /= probs.sum()
    before = np.cumsum(probs) - probs
    count = max(1, int(np.sum(before < top_p + tol)))
    return set(np.flatnonzero(in_top_k & (z >= z[order[count - 1]])).tolist())


def test_ordinary_values_keep_their_rule():
    """Many keys per row of random logits (per-row keys, one jitted call):
    every token drawn lies in the numpy-computed allowed set, and a row
    whose set has several tokens draws more than one of them."""
    grid = [(t, k, p) for t in (0.0, 0.5, 1.0, 2.0) for k in (0, 1, 5, 40) for p in (0.3, 0.9, 1.0)]
    draws = 64
    logits = _logits(11, rows=len(grid), vocab=97, scale=2.0)
    params = RowSampling.stack([SamplingParams(temperature=t, top_k=k, top_p=p) for t, k, p in grid])
    tile = lambda a: np.repeat(a, draws, axis=0)  # noqa: E731 - row r's draws are rows r*draws .. (r+1)*draws-1
    tiled = RowSampling(tile(params.temperature), tile(params.top_k), tile(params.top_p))
    keys = jax.random.split(jax.random.key(3), len(grid) * draws)
    drawn = np.asarray(jax.jit(sample)(jnp.asarray(tile(logits)), keys, tiled)).reshape(len(grid), draws)
    for r, (t, k, p) in enumerate(grid):
        allowed = allowed_tokens(logits[r], t, k, p)
        seen = set(drawn[r].tolist())
        assert seen <= allowed, (t, k, p, seen - allowed)
        if len(allowed) >= 3 and t >= 1.0:
            assert len(seen) > 1, (t, k, p, allowed)


def _always_filtered(logits, params: RowSampling):
    """:func:`filtered_logits` with its top-k / top-p step always taken (the
    rule before the step was skipped where it changes nothing)."""
    from jaxkv.nn.sampling import _top_k_top_p

    scaled, temperature = filtered_logits(logits, RowSampling(params.temperature, params.top_k, params.top_p))
    top_k, top_p = jnp.asarray(params.top_k, jnp.int32), jnp.asarray(params.top_p, jnp.float32)
    return _top_k_top_p(scaled, top_k, top_p), temperature


def test_skipped_filters_and_draws_change_no_token():
    """The sampler skips the top-k / top-p step (its sort of the whole
    vocabulary) when no row asks for either, and the draw when no row
    samples. Over fresh random batches where no row filters (greedy rows,
    temperature-only rows, top_k at or past the vocabulary, logits with
    -inf from a mask): ``filtered_logits`` is, bit for bit, what the step
    always taken gives, and each row's token, drawn with its own key, is
    the one it draws beside another row that does filter (so the step and
    the draw ran) and the argmax for a greedy row."""
    rng = np.random.default_rng()
    vocab = 61
    jitted = jax.jit(lambda logits, keys, params: (sample(logits, keys, params), filtered_logits(logits, params)))
    for trial in range(6):
        rows = int(rng.integers(2, 9))
        logits = (rng.standard_normal((rows, vocab)) * rng.choice([0.5, 3.0])).astype(np.float32)
        logits[rng.random((rows, vocab)) < 0.2] = -np.inf  # a structured-output mask
        logits[np.arange(rows), rng.integers(0, vocab, rows)] = 1.0  # every row keeps a finite token
        temperature = np.where(rng.random(rows) < 0.5, 0.0, rng.uniform(0.3, 2.0, rows)).astype(np.float32)
        if trial == 0:
            temperature[:] = 0.0  # every row greedy: no draw at all
        top_k = rng.choice([0, vocab, vocab + 5], rows).astype(np.int32)
        params = RowSampling(temperature, top_k, np.ones(rows, np.float32))
        keys = jax.random.split(jax.random.key(int(rng.integers(2**31))), rows + 1)
        tokens, (scaled, _) = jitted(jnp.asarray(logits), keys[:rows], params)
        expected, _ = _always_filtered(jnp.asarray(logits), params)
        np.testing.assert_array_equal(np.asarray(scaled), np.asarray(expected))
        greedy = temperature == 0
        np.testing.assert_array_equal(np.asarray(tokens)[greedy], np.argmax(logits, axis=-1)[greedy])
        # The same rows beside one that filters (top_k 3, sampled): the filter step and the draw both run.
        beside = RowSampling(np.append(temperature, np.float32(1.0)), np.append(top_k, np.int32(3)),
                             np.ones(rows + 1, np.float32))
        logits_beside = np.concatenate([logits, rng.standard_normal((1, vocab)).astype(np.float32)])
        tokens_beside, (scaled_beside, _) = jitted(jnp.asarray(logits_beside), keys, beside)
        np.testing.assert_array_equal(np.asarray(tokens_beside)[:rows], np.asarray(tokens))
        np.testing.assert_array_equal(np.asarray(scaled_beside)[:rows], np.asarray(scaled))
        assert np.isneginf(np.asarray(scaled_beside)[rows]).sum() == vocab - 3


def test_the_vocabulary_sort_runs_only_under_its_condition():
    """The sampler's one sort of the whole vocabulary (top-k / top-p) sits
    inside a ``cond`` on whether any row asks for a filter, and its draw
    inside one on whether any row samples: an engine step with greedy rows
    runs neither (on a GPU, a [256, 128256] sort per decode step). A static
    greedy ``SamplingParams`` compiles to a bare argmax, with no cond."""

    def primitives(jaxpr, inside=False, found=None):
        found = [] if found is None else found
        for eqn in jaxpr.eqns:
            found.append((eqn.primitive.name, inside))
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                primitives(sub, inside or eqn.primitive.name == "cond", found)
        return found

    logits, keys = jnp.zeros((4, 50)), jax.random.split(jax.random.key(0), 4)
    params = RowSampling(np.zeros(4, np.float32), np.zeros(4, np.int32), np.ones(4, np.float32))
    found = primitives(jax.make_jaxpr(sample)(logits, keys, params).jaxpr)
    assert ("sort", True) in found and ("sort", False) not in found
    assert ("random_bits", True) in found and ("random_bits", False) not in found
    static = primitives(jax.make_jaxpr(lambda x: sample(x, keys, SamplingParams()))(logits).jaxpr)
    assert not any(name in ("cond", "sort", "random_bits") for name, _ in static)


def test_sorted_descending_is_jnp_sort_reversed(monkeypatch):
    """``sorted_descending`` (int32 keys from the floats' bits) orders fresh
    random rows as ``jnp.sort(x)[:, ::-1]`` does, with ties, infinities,
    -0.0, subnormals and NaN among them; and the top-k / top-p step gives, bit for bit,
    what it gives with ``jnp.sort``."""
    from jaxkv.nn import sampling

    rng = np.random.default_rng()
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1.5, -1.5, 1e-45, -1e-45], np.float32)
    for _ in range(4):
        rows, vocab = int(rng.integers(1, 6)), int(rng.integers(2, 300))
        x = (rng.standard_normal((rows, vocab)) * rng.choice([1e-3, 1.0, 1e30])).astype(np.float32)
        mask = rng.random((rows, vocab)) < 0.25
        x[mask] = rng.choice(specials, mask.sum())
        got = np.asarray(jax.jit(sampling.sorted_descending)(jnp.asarray(x)))
        expected = np.asarray(jnp.sort(jnp.asarray(x), axis=-1))[:, ::-1]
        # XLA flushes subnormals to zero: jnp.sort's comparator ties them with 0.0, sorted_descending returns 0.0.
        expected = np.where(np.abs(expected) < F32.smallest_normal, np.float32(0.0), expected)
        np.testing.assert_array_equal(got, expected)
        finite = np.where(np.isnan(x), -np.inf, x)  # the sampler's logits: no NaN
        top_k = rng.integers(0, vocab + 2, rows).astype(np.int32)
        top_p = rng.choice([0.1, 0.5, 0.9, 1.0], rows).astype(np.float32)
        step = jax.jit(sampling._top_k_top_p)
        new = np.asarray(step(jnp.asarray(finite), top_k, top_p))
        monkeypatch.setattr(sampling, "sorted_descending", lambda v: jnp.sort(v, axis=-1)[:, ::-1])
        old = np.asarray(jax.jit(sampling._top_k_top_p)(jnp.asarray(finite), top_k, top_p))
        monkeypatch.undo()
        np.testing.assert_array_equal(new.view(np.int32), old.view(np.int32))
