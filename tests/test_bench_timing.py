"""``jaxkv.bench._timing`` reads one JAX internal (whether a backend started);
a JAX that moved it must make the benchmarks say so, never break them."""

from __future__ import annotations

import jax

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
