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
