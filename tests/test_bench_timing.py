"""``jaxkv.bench._timing`` reads one JAX internal (whether a backend started);
a JAX that moved it must make the benchmarks say so, never break them."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxkv.bench import _timing


def test_inline_cpu_dispatch_reads_the_backend_state():
    jax.devices()  # the backend is started: the config is left alone
    assert _timing.backend_started() is True
    assert _timing.inline_cpu_dispatch() in ("inline CPU dispatch", "async dispatch")


def test_inline_cpu_dispatch_falls_back_when_jax_internals_move(monkeypatch):
    def moved():
        raise AttributeError("module 'jax._src.xla_bridge' has no attribute '_backends'")

    monkeypatch.setattr(_timing, "_read_backends_started", moved)
    updates = []
    monkeypatch.setattr(jax.config, "update", lambda *args: updates.append(args))
    assert _timing.backend_started() is None
    assert _timing.inline_cpu_dispatch() == "dispatch mode unknown (JAX internals changed)"
    assert updates == []  # the config is not touched when the backend state is unknown


def test_decode_bench_accepts_only_near_tie_splits():
    """The decode benchmark's token check: a row may split from the reference
    only where the reference's top two logits nearly tied (a rounding flip);
    a split at a clear winner raises, naming the row and margin."""
    from jaxkv.bench.decode import NEAR_TIE, check_same_greedy

    rng = np.random.default_rng()
    reference = rng.integers(0, 1000, size=(4, 12))
    margins = rng.uniform(10 * NEAR_TIE, 1.0, size=reference.shape)
    assert check_same_greedy(reference.copy(), reference, margins, "same") == []

    ours = reference.copy()
    ours[2, 5:] = (reference[2, 5:] + 1) % 1000  # row 2 follows another history from step 5
    margins[2, 5] = NEAR_TIE / 4
    margins[2, 6:] = 0.5  # after the split nothing is compared
    assert check_same_greedy(ours, reference, margins, "near tie") == [(2, 5, NEAR_TIE / 4)]

    margins[2, 5] = 0.3
    with pytest.raises(AssertionError, match=r"row 2 first at step 5.*3\.00e-01 apart"):
        check_same_greedy(ours, reference, margins, "clear winner")
