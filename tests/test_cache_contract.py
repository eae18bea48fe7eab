"""The cache contract is complete (issue 40 item 3): everything the engine
(``serve/engine.py``, ``scheduler.py``, ``reserve.py``, ``request.py``)
reads or calls on its cache is a member of the ``KVCache`` Protocol, and
both adapters provide every member."""

from __future__ import annotations

import os
import re
import typing

import pytest
from flax import nnx

from jaxkv.nn import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from jaxkv.serve.build import build_hybrid_cache, build_paged_cache
from jaxkv.serve.caches import KVCache
from tests.test_nn_engine import CONFIG

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINE_FILES = ["engine.py", "scheduler.py", "reserve.py", "request.py"]


def protocol_members() -> set:
    names = set(typing.get_type_hints(KVCache)) if hasattr(KVCache, "__annotations__") else set()
    names |= {name for name, value in vars(KVCache).items() if callable(value) and not name.startswith("_")}
    return names


def test_the_engine_uses_only_the_contract():
    used = set()
    for name in ENGINE_FILES:
        with open(os.path.join(ROOT, "jaxkv", "serve", name), encoding="utf-8") as f:
            used |= set(re.findall(r"\bcache\.([a-z_]+)\b", f.read()))
    missing = sorted(used - protocol_members())
    assert not missing, f"the engine uses {missing} outside the KVCache Protocol"


@pytest.mark.parametrize("kind", ["paged", "hybrid"])
def test_both_adapters_provide_every_member(kind):
    if kind == "paged":
        model = LlamaForCausalLM(LlamaConfig.from_hf(CONFIG), rngs=nnx.Rngs(0))
        cache = build_paged_cache(model, max_seqs=2, page_size=4, max_model_len=32, num_pages=9,
                                 max_blocks_per_seq=None, kv_cache_memory=None, num_host_pages=None,
                                 host_kv_memory=None, kv_dtype=None, prefix_cache=True, prefill_chunk=8,
                                 host_memory_kind="numpy")
    else:
        model = AutoModelForCausalLM.from_pretrained(os.path.join(ROOT, "tests", "fixtures", "qwen3_next", "small"))
        cache = build_hybrid_cache(model, max_seqs=2, max_model_len=64, max_context_tokens=None,
                                  num_blocks={"full": 8}, kv_cache_memory=None, num_snapshots=2,
                                  entry_format="lossless", prefill_chunk=16, prefix_cache=True)
    absent = sorted(name for name in protocol_members() if not hasattr(cache, name))
    assert not absent, f"{type(cache).__name__} lacks {absent}"


# ------------------------------------------------------- the row-indexed view

def test_code_over_rows_never_asks_which_manager():
    """``nn/`` and ``serve/`` reach both managers through the row view of
    :mod:`jaxkv.manager.rows` (issue 40 item 3): no ``isinstance`` on a
    manager class there (``window_cache``'s argument check apart, which
    refuses a paged manager with an error the user can act on)."""
    offenders = []
    for package in ("nn", "serve"):
        folder = os.path.join(ROOT, "jaxkv", package)
        for name in sorted(os.listdir(folder)):
            if not name.endswith(".py") or name == "window_cache.py":
                continue
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                for number, line in enumerate(f, 1):
                    if re.search(r"isinstance\([^)]*(KVCacheManager|BlockSpaceManager)", line):
                        offenders.append(f"{package}/{name}:{number}")
    assert not offenders, f"isinstance checks on a manager: {offenders}"


def test_both_managers_give_the_same_row_view():
    """Row ``r`` of either manager behaves alike through :class:`RowCache`:
    a random-length row forked into another has its length and shares its
    full blocks, and freeing every row gives every block back. The hybrid
    manager's row ``r`` is its slot ``r + 1``."""
    import jax.numpy as jnp
    import numpy as np

    from jaxkv import BlockSpaceManager
    from jaxkv.manager.hybrid import KVCacheManager
    from jaxkv.manager.hybrid_schema import HybridConfig, qwen3_next_schedule
    from jaxkv.manager.rows import RowCache, row_of, slot_of

    rng = np.random.default_rng()
    page = 16
    n = int(rng.integers(page + 1, 4 * page))  # crosses a page, ends mid-page (or on its edge)
    paged = BlockSpaceManager.create(num_device_blocks=17, num_host_blocks=1, block_size=page, max_seqs=3,
                                     max_blocks_per_seq=8)
    paged, ok = paged.allocate(jnp.asarray([0]), n)
    assert bool(ok)
    hybrid = KVCacheManager.create(HybridConfig(), qwen3_next_schedule(4), 3, max_context_tokens=128)
    hybrid, slots, ok = hybrid.admit(3, max_n=3)
    assert bool(ok) and [row_of(int(s)) for s in slots] == [0, 1, 2]
    hybrid, _, ok = hybrid.reserve(slot_of(jnp.asarray([0])), jnp.asarray([n]), max_new_tokens=n)
    assert bool(ok)
    assert hybrid.groups["full"].tokens_per_block == page
    for manager in (paged, hybrid):
        assert isinstance(manager, RowCache)
        before = int(manager.blocks_in_use)
        if manager.ROW_TABLES:
            lens = lambda m: np.asarray(m.seq_lens)  # noqa: E731
        else:
            lens = lambda m: np.asarray(m.seq_lens)[1:]  # noqa: E731 - slot r + 1 is row r
        forked, ok = manager.fork_rows(jnp.asarray([0, -1]), jnp.asarray([1, -1]))
        assert bool(ok) and lens(forked)[:2].tolist() == [n, n]
        # Full pages are shared; a partly filled last one is copied (hybrid) or
        # shared until a write (paged: copy-on-write later).
        partial = int(n % page != 0) if not manager.ROW_TABLES else 0
        assert int(forked.blocks_in_use) == before + partial
        freed, ok = forked.free_rows(jnp.asarray([0, 1, -1]))
        assert bool(ok) and int(freed.blocks_in_use) == 0
        free, total = freed.block_totals()
        assert free == total > 0
