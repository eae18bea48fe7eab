"""JAX's persistent compilation cache, as the demo and the server use it:
where it lives by default and how it is turned on. Imports nothing but the
standard library until it is used (the demo needs no server packages)."""

from __future__ import annotations

import os

__all__ = ["configure_compile_cache", "default_automaton_cache_dir", "default_compile_cache_dir"]


def _cache_root() -> str:
    root = os.environ.get("JAXKV_CACHE_DIR")
    if not root:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
                            "jaxkv")
    return root


def default_compile_cache_dir() -> str:
    """Where the persistent JAX compilation cache lives by default:
    ``$JAXKV_CACHE_DIR/jax`` when ``JAXKV_CACHE_DIR`` is set, else
    ``$XDG_CACHE_HOME/jaxkv/jax``, else ``~/.cache/jaxkv/jax``."""
    return os.path.join(_cache_root(), "jax")


def default_automaton_cache_dir() -> str:
    """Where the server keeps structured outputs' compiled automata
    (:func:`jaxkv.serve.structured.set_automaton_cache_dir`): ``automata``
    beside :func:`default_compile_cache_dir`'s ``jax``."""
    return os.path.join(_cache_root(), "automata")


def configure_compile_cache(path: str | None) -> int:
    """Turn on JAX's persistent compilation cache in folder ``path`` (None:
    leave it off) and cache every program, however small or quick to compile
    (``jax_persistent_cache_min_compile_time_secs = 0``,
    ``jax_persistent_cache_min_entry_size_bytes = -1``: JAX's defaults skip
    programs compiled in under a second, i.e. most of a small model's on
    CPU). Call before anything is compiled. Returns the number of entries
    already in the folder (0: a cold start)."""
    if path is None:
        return 0
    import jax

    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return sum(1 for name in os.listdir(path) if not name.startswith("."))
