"""The engine's options as one checked object (issue 40 item 2;
``jaxkv.serve.options``): each option defined once, checked when made
(never coerced), the same engine from an ``EngineOptions`` or from flat
keywords, and the server's flags generated from the same fields."""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np
import pytest
from flax import nnx

from jaxkv.errors import InvalidArgument
from jaxkv.nn import LlamaConfig, LlamaForCausalLM
from jaxkv.serve import Engine
from jaxkv.serve.options import (CacheOptions, EngineOptions, SchedulerOptions, TenantOptions, add_arguments,
                                 describe, from_cli)
from tests.test_nn_engine import CONFIG

GROUPS = (CacheOptions, SchedulerOptions, TenantOptions)


def test_every_option_is_defined_once_with_its_documentation():
    names = [f.name for cls in GROUPS for f in dataclasses.fields(cls)]
    assert len(names) == len(set(names)), "an option in two groups"
    for cls in GROUPS:
        for f in dataclasses.fields(cls):
            assert len(f.metadata["doc"]) > 20, f.name
            assert f.name in cls.__doc__
    assert len(describe().splitlines()) == len(names)
    assert set(EngineOptions().flat()) == set(names)


@pytest.mark.parametrize("name, value", [
    ("max_seqs", "8"), ("max_seqs", 0), ("max_seqs", 2.0), ("max_seqs", True), ("seed", None), ("seed", "1"),
    ("scrub_on_free", "no"), ("scrub_on_free", 1), ("prefix_cache", "off"), ("enable_kv_events", None),
    ("prefix_quota", "0.5"), ("prefix_quota", 0.0), ("prefix_quota", 1.5), ("prefix_quota", True),
    ("kv_cache_memory", "1GiB"), ("kv_cache_memory", 0), ("kv_cache_memory", 1.5), ("kv_cache_memory", True),
    ("max_model_len", 1), ("max_context_tokens", 1), ("num_pages", 1), ("num_host_pages", -1),
    ("scheduler", "fast"), ("entry_format", "fp4"), ("snapshot_retention", "fifo"), ("num_blocks", [("full", 8)]),
    ("decode_chunk", 10**30),
])
def test_a_bad_value_is_refused_naming_the_option(name, value):
    with pytest.raises(InvalidArgument, match=name):
        EngineOptions.from_kwargs(**{name: value})


def test_values_are_normalised_not_coerced():
    options = EngineOptions.from_kwargs(max_seqs=np.int64(4), scrub_on_free=np.bool_(True), prefix_quota=np.float32(0.5),
                                        kv_cache_memory=0.5)
    assert type(options.scheduler.max_seqs) is int and options.scheduler.max_seqs == 4
    assert options.tenants.scrub_on_free is True and options.tenants.prefix_quota == 0.5
    with pytest.raises(TypeError, match="unknown engine option 'max_num_seqs'"):
        EngineOptions.from_kwargs(max_num_seqs=4)
    base = EngineOptions.from_kwargs(max_seqs=4)
    assert base.replace(decode_chunk=2).scheduler == SchedulerOptions(max_seqs=4, decode_chunk=2)
    assert base.scheduler.decode_chunk == 8  # frozen: replace made a copy


def test_an_engine_from_options_equals_one_from_keywords():
    model = LlamaForCausalLM(LlamaConfig.from_hf(CONFIG), rngs=nnx.Rngs(0))
    kwargs = dict(num_pages=10, page_size=4, max_seqs=3, max_blocks_per_seq=8, decode_chunk=4, seed=7)
    a = Engine(model, **kwargs)
    b = Engine(model, EngineOptions.from_kwargs(**kwargs))
    c = Engine(model, EngineOptions.from_kwargs(max_seqs=1), **kwargs)  # keywords over options
    assert a.options == b.options == c.options
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    outs = []
    for engine in (a, b):
        rid = engine.add_request(prompt, 6)
        engine.run()
        outs.append(engine.outputs[rid])
    assert outs[0] == outs[1]
    with pytest.raises(InvalidArgument, match="options must be an EngineOptions"):
        Engine(model, {"max_seqs": 2})


def test_the_command_line_is_generated_from_the_fields():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    unset = from_cli(parser.parse_args([]))
    assert unset == EngineOptions()
    given = from_cli(parser.parse_args(["--max-num-seqs", "64", "--kv-cache-memory", "512MiB", "--swap-space", "1GB",
                                        "--scrub-on-free", "--prefix-quota", "0.25", "--seed", "3"]))
    assert given.scheduler.max_seqs == 64 and given.cache.kv_cache_memory == 512 * 2**20
    assert given.cache.host_kv_memory == 10**9 and given.tenants.scrub_on_free and given.tenants.prefix_quota == 0.25
    assert from_cli(parser.parse_args(["--kv-cache-memory", "0.9"])).cache.kv_cache_memory == 0.9
    for bad in (["--max-num-seqs", "0"], ["--prefix-quota", "2"], ["--kv-cache-memory", "lots"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)
