"""GPU-sized defaults (issue 41 item 2): ``max_seqs``, ``max_num_batched_tokens``
and ``decode_chunk`` left out are derived for the device from the KV budget
and the model (:func:`jaxkv.serve.sizing.scheduler_defaults`, a pure
function called here with a GPU's numbers; :func:`jaxkv.serve.build.resolve_options`
measures them); the CPU keeps its small defaults; an option the user gives
always wins; a mesh counts one device's share of a split cache; the server's
command line still comes from the fields.

Compile budget: one tiny engine runs two requests with GPU-derived options;
the rest is arithmetic, ``jax.eval_shape`` and one subprocess on a 2-device
CPU mesh (cache placement, no model call).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys

import jax.numpy as jnp
import pytest
from flax import nnx
from jax.sharding import AbstractMesh

from jaxkv.errors import InvalidArgument
from jaxkv.nn import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from jaxkv.serve import Engine, sizing
from jaxkv.serve.build import derive_scheduler_defaults, resolve_options
from jaxkv.serve.options import Derived, EngineOptions, SchedulerOptions, add_arguments, from_cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests", "fixtures")
KiB, GiB = 1 << 10, 1 << 30
#: Llama-3.1-8B in bf16: 32 layers * 8 KV heads * 128 dims * 2 (K, V) * 2 bytes.
LLAMA_8B_TOKEN = 32 * 8 * 128 * 2 * 2
#: Llama-3.2-1B in bf16: 16 layers * 8 KV heads * 64 dims * 2 * 2.
LLAMA_1B_TOKEN = 16 * 8 * 64 * 2 * 2
#: An H100's KV budget for an 8B model (80 GB, less the weights and activations).
H100_BUDGET = 60 * GiB
TINY = dict(model_type="llama", vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0,
            max_position_embeddings=256, tie_word_embeddings=False)
#: Llama-3.1-8B's config.json (the keys that shape its cache and its default max_model_len).
LLAMA_8B = dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5,
                rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=False)


class PoolOnly:
    """What the derivation reads of a :class:`LlamaForCausalLM` (its config,
    cache kind and ``make_pool``), without building the 8B parameters."""

    cache_kind = "paged"
    make_pool = LlamaForCausalLM.make_pool

    def __init__(self, config: dict, dtype=jnp.bfloat16):
        self.config, self.dtype = LlamaConfig.from_hf(config), dtype
        self.pool_layers = self.config.num_hidden_layers  # make_pool's layers (the model's own depth)


# ------------------------------------------------------------------ the rule, as a pure function


@pytest.mark.parametrize("bytes_per_token, budget, split, expected", [
    # Llama-3.1-8B on an H100: 491520 tokens, 480 rows of 1024 -> vLLM's 256 and 8192
    (LLAMA_8B_TOKEN, H100_BUDGET, 1, dict(max_seqs=256, max_num_batched_tokens=8192, tokens=491520)),
    # a 1B model: four times the tokens, the same caps
    (LLAMA_1B_TOKEN, H100_BUDGET, 1, dict(max_seqs=256, max_num_batched_tokens=8192, tokens=1966080)),
    # a budget of 20000 tokens: 19 rows of 1024 -> 16 (a multiple of 8); 8192 tokens still fit
    (LLAMA_8B_TOKEN, 20000 * LLAMA_8B_TOKEN, 1, dict(max_seqs=16, max_num_batched_tokens=8192, tokens=20000)),
    # the same per-device budget on tp=8 with the KV heads split: 8 times the tokens, 156 -> 152 rows
    (LLAMA_8B_TOKEN, 20000 * LLAMA_8B_TOKEN, 8, dict(max_seqs=152, max_num_batched_tokens=8192, tokens=160000)),
    # tp=8 on the H100 budget: 3.9M tokens per device, still capped at 256 / 8192
    (LLAMA_8B_TOKEN, H100_BUDGET, 8, dict(max_seqs=256, max_num_batched_tokens=8192, tokens=3932160)),
    # 5000 tokens: 4 rows (under 8: not rounded) and a token budget of what the cache holds
    (LLAMA_8B_TOKEN, 5000 * LLAMA_8B_TOKEN, 1, dict(max_seqs=4, max_num_batched_tokens=5000, tokens=5000)),
    # less than one typical context: one row
    (LLAMA_8B_TOKEN, 600 * LLAMA_8B_TOKEN, 1, dict(max_seqs=1, max_num_batched_tokens=600, tokens=600)),
])
def test_the_gpu_rule_fills_the_device(bytes_per_token, budget, split, expected):
    d = sizing.scheduler_defaults("gpu", budget, bytes_per_token, 4096, split)
    assert (d.max_seqs, d.max_num_batched_tokens, d.tokens) == (
        expected["max_seqs"], expected["max_num_batched_tokens"], expected["tokens"])
    assert d.decode_chunk == sizing.GPU_DECODE_CHUNK == 16
    assert d.max_seqs <= sizing.GPU_MAX_SEQS and d.max_num_batched_tokens >= d.max_seqs
    # the rows it gives each hold a typical context, and the token budget fits the cache
    assert d.max_seqs * sizing.TYPICAL_CONTEXT <= max(d.tokens, sizing.TYPICAL_CONTEXT)
    assert d.max_num_batched_tokens <= max(d.tokens, d.max_seqs)
    assert len(d.lines()) == 4 and all(line.startswith("scheduler default (gpu): ") for line in d.lines())
    assert str(d.max_seqs) in d.lines()[0] and str(d.tokens) in d.lines()[0]
    # a row's prefill may take the whole token budget (packed); the padded scheduler keeps 256
    assert d.prefill_chunk == d.max_num_batched_tokens and f"prefill_chunk={d.prefill_chunk}" in d.lines()[3]
    padded = sizing.scheduler_defaults("gpu", budget, bytes_per_token, 4096, split, packed=False)
    assert padded.prefill_chunk == 256 and padded.max_num_batched_tokens == d.max_num_batched_tokens


def test_the_gpu_rule_counts_rows_lengths_and_a_given_max_seqs():
    # a short max_model_len is the typical context: twice the rows of 1024 (capped), and rows * len bounds tokens
    d = sizing.scheduler_defaults("gpu", 20000 * LLAMA_8B_TOKEN, LLAMA_8B_TOKEN, 512)
    assert d.max_seqs == 32 and d.max_num_batched_tokens == 8192  # 39 rows of 512 -> 32
    d = sizing.scheduler_defaults("gpu", 20000 * LLAMA_8B_TOKEN, LLAMA_8B_TOKEN, 16)
    assert d.max_seqs == 256 and d.max_num_batched_tokens == 256 * 16
    # per-row state (a hybrid cache's recurrent states) costs rows
    row = 64 * 2**20  # Qwen3-Next-80B's GDN states are ~77 MB a row
    d = sizing.scheduler_defaults("gpu", 8 * GiB, 24 * KiB, 4096, bytes_per_row=row)
    assert d.max_seqs == 88 and d.max_seqs * (row + 1024 * 24 * KiB) <= 8 * GiB  # 91 rows -> 88
    # a max_seqs given is kept and bounds the token budget
    d = sizing.scheduler_defaults("gpu", H100_BUDGET, LLAMA_8B_TOKEN, 1024, max_seqs=2)
    assert d.max_seqs == 2 and d.max_num_batched_tokens == 2048 and "given" in d.lines()[0]
    d = sizing.scheduler_defaults("gpu", H100_BUDGET, LLAMA_8B_TOKEN, 4096, max_seqs=300)
    assert d.max_seqs == 300 and d.max_num_batched_tokens == 8192
    for bad in (dict(budget_bytes=0), dict(bytes_per_token=0), dict(max_model_len=0), dict(split=0.5)):
        args = dict(budget_bytes=GiB, bytes_per_token=1024, max_model_len=64, split=1) | bad
        with pytest.raises(InvalidArgument, match="scheduler_defaults"):
            sizing.scheduler_defaults("gpu", **args)


def test_the_cpu_keeps_the_small_defaults():
    for budget, per_token in ((H100_BUDGET, LLAMA_8B_TOKEN), (GiB, 256)):
        d = sizing.scheduler_defaults("cpu", budget, per_token, 4096, 8)
        assert (d.max_seqs, d.max_num_batched_tokens, d.decode_chunk, d.tokens) == (8, None, 8, None)
        assert d.values() == dict(max_seqs=8, max_num_batched_tokens=None, decode_chunk=8, prefill_chunk=256)
    assert sizing.scheduler_defaults("cpu", GiB, 256, 4096, max_seqs=3).max_seqs == 3
    # the CPU's values are the options' own defaults, as ints that mark them derived
    options = SchedulerOptions()
    assert isinstance(options.max_seqs, Derived) and options.max_seqs == 8
    assert isinstance(options.decode_chunk, Derived) and options.decode_chunk == 8
    assert options.max_num_batched_tokens is None and options.prefill_chunk == 256
    assert isinstance(options.prefill_chunk, Derived)
    # a value given is a plain int, even the CPU's own
    given = SchedulerOptions(max_seqs=8, decode_chunk=8)
    assert type(given.max_seqs) is int and type(given.decode_chunk) is int
    assert type(EngineOptions.from_kwargs(max_seqs=8).scheduler.max_seqs) is int
    assert isinstance(EngineOptions().replace(seed=3).scheduler.max_seqs, Derived)  # replace keeps the marker


# ------------------------------------------------------------------ measured from a model


def test_derived_from_llama_8b_shapes_on_an_h100_and_on_meshes():
    model = PoolOnly(LLAMA_8B)
    free = int(H100_BUDGET / sizing.DEFAULT_MEMORY_FRACTION) + 1  # the default budget takes 0.8 of it
    d = derive_scheduler_defaults(model, EngineOptions(), platform="gpu", free_bytes=free)
    assert (d.max_seqs, d.max_num_batched_tokens, d.decode_chunk, d.tokens) == (256, 8192, 16, 491520)
    # tp=8: each device holds an eighth of every page (8 KV heads over 8)
    d8 = derive_scheduler_defaults(model, EngineOptions(), platform="gpu", free_bytes=free,
                                   mesh=AbstractMesh((1, 8), ("data", "tp")))
    assert d8.tokens == 8 * 491520 and "split 8 ways" in d8.lines()[0]
    # tp=16 does not divide 8 KV heads: the pool stays whole on every device, no more tokens
    d16 = derive_scheduler_defaults(model, EngineOptions(), platform="gpu", free_bytes=free,
                                    mesh=AbstractMesh((16,), ("tp",)))
    assert d16.tokens == 491520
    # an explicit budget of 20000 tokens' bytes (a little more: the tables' rows)
    small = EngineOptions.from_kwargs(kv_cache_memory=20000 * LLAMA_8B_TOKEN)
    d = derive_scheduler_defaults(model, small, platform="gpu")
    assert (d.max_seqs, d.max_num_batched_tokens, d.tokens) == (16, 8192, 20000)
    d = derive_scheduler_defaults(model, small, platform="gpu", mesh=AbstractMesh((1, 8), ("data", "tp")))
    assert (d.max_seqs, d.tokens) == (152, 160000)
    # expert pages: the tokens they hold
    d = derive_scheduler_defaults(model, EngineOptions.from_kwargs(num_pages=1001), platform="gpu")
    assert d.tokens == 16000 and d.max_seqs == 8 and d.max_num_batched_tokens == 8192
    # a CPU measures nothing
    d = derive_scheduler_defaults(model, EngineOptions(), platform="cpu")
    assert d.values() == dict(max_seqs=8, max_num_batched_tokens=None, decode_chunk=8, prefill_chunk=256)


def test_a_hybrid_cache_counts_its_per_row_state_and_snapshots():
    model = AutoModelForCausalLM.from_pretrained(os.path.join(FIXTURES, "qwen3_next", "small"))
    budget = 3_000_000
    d = derive_scheduler_defaults(model, EngineOptions.from_kwargs(kv_cache_memory=budget, max_model_len=256),
                                  platform="gpu")
    row = float(d.lines()[0].split(" bytes of per-row state")[0].rsplit(" ", 1)[1])
    assert row > 0  # GDN states, tables
    per_token = budget * 3 // 4 / d.tokens  # a quarter of the budget is left to the snapshots
    assert d.max_seqs * (row + 256 * per_token) <= budget * 3 // 4
    # and the engine built with them serves within the budget (built only)
    engine = Engine(model, resolve_options(model, EngineOptions.from_kwargs(kv_cache_memory=budget,
                                                                            max_model_len=256), platform="gpu"))
    assert engine.options.scheduler.max_seqs == engine.cache_plan.max_seqs == d.max_seqs
    assert engine.cache_plan.device_bytes <= budget


def test_resolve_options_derives_what_is_left_out_and_keeps_what_is_given(caplog):
    model = PoolOnly(LLAMA_8B)
    free = int(H100_BUDGET / sizing.DEFAULT_MEMORY_FRACTION) + 1
    with caplog.at_level(logging.INFO, logger="jaxkv.serve"):
        resolved = resolve_options(model, EngineOptions(), platform="gpu", free_bytes=free)
    s = resolved.scheduler
    assert (s.max_seqs, s.max_num_batched_tokens, s.decode_chunk, s.prefill_chunk) == (256, 8192, 16, 8192)
    assert type(s.max_seqs) is int and type(s.decode_chunk) is int  # resolved: nothing left to derive
    assert resolve_options(model, resolved, platform="gpu") is resolved  # twice is once
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("scheduler default (gpu)")]
    assert len(logged) == 4 and "max_seqs=256" in logged[0] and "491520 tokens" in logged[0]
    # given options win, even when they equal the CPU's defaults; only the others are derived
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="jaxkv.serve"):
        given = resolve_options(model, EngineOptions.from_kwargs(max_seqs=8, decode_chunk=4), platform="gpu",
                                free_bytes=free)
    assert (given.scheduler.max_seqs, given.scheduler.decode_chunk) == (8, 4)
    assert given.scheduler.max_num_batched_tokens == 8192
    logged = [r.getMessage() for r in caplog.records if "scheduler default" in r.getMessage()]
    assert len(logged) == 2 and "max_num_batched_tokens=8192" in logged[0]  # only what was derived
    assert given.scheduler.prefill_chunk == 8192 and "prefill_chunk=8192" in logged[1]
    given = resolve_options(model, EngineOptions.from_kwargs(prefill_chunk=512), platform="gpu", free_bytes=free)
    assert given.scheduler.prefill_chunk == 512 and given.scheduler.max_num_batched_tokens == 8192
    padded = resolve_options(model, EngineOptions.from_kwargs(scheduler="padded"), platform="gpu", free_bytes=free)
    assert padded.scheduler.prefill_chunk == 256  # its prefill call is [max_seqs, prefill_chunk] tokens
    given = resolve_options(model, EngineOptions.from_kwargs(max_num_batched_tokens=512), platform="gpu",
                            free_bytes=free)
    assert given.scheduler.max_num_batched_tokens == 512 and given.scheduler.max_seqs == 256
    # on a CPU: today's defaults, as plain values
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="jaxkv.serve"):
        cpu = resolve_options(model, EngineOptions(), platform="cpu")
        assert resolve_options(model, cpu, platform="cpu") is cpu  # its None token budget is resolved, not open
    assert (cpu.scheduler.max_seqs, cpu.scheduler.max_num_batched_tokens, cpu.scheduler.decode_chunk) == (8, None, 8)
    assert type(cpu.scheduler.max_seqs) is int
    assert [r.getMessage() for r in caplog.records if "scheduler default" in r.getMessage()] == [
        "scheduler default (cpu): max_seqs=8, max_num_batched_tokens=None (prefill_chunk, 256), decode_chunk=8, "
        "prefill_chunk=256: a CPU keeps the small defaults"]  # logged once


def test_a_cpu_engine_keeps_the_small_defaults_and_runs_gpu_derived_ones():
    model = LlamaForCausalLM(LlamaConfig.from_hf(TINY), rngs=nnx.Rngs(0))
    engine = Engine(model)  # this machine is a CPU
    s = engine.options.scheduler
    assert (s.max_seqs, s.decode_chunk, s.max_num_batched_tokens, s.prefill_chunk) == (8, 8, None, 256)
    assert engine.cache_plan.max_seqs == engine.max_seqs == 8 and engine.decode_chunk == 8
    assert Engine(model, resolve_options(model, EngineOptions())).options.scheduler == SchedulerOptions()
    # the options a GPU would get for this model and a 400000-byte budget, served here
    options = resolve_options(model, EngineOptions.from_kwargs(kv_cache_memory=400_000, max_model_len=64),
                              platform="gpu")
    s = options.scheduler
    # 1562 tokens of 256 bytes; 24 rows of 64 tokens (and a 24-byte table row each)
    assert (s.max_seqs, s.decode_chunk, s.max_num_batched_tokens) == (24, 16, min(8192, 1562, 24 * 64))
    engine = Engine(model, options)
    assert engine.options == options and engine.cache_plan.max_seqs == 24 and engine.decode_chunk == 16
    assert engine.cache_plan.device_bytes <= 400_000
    ids = [engine.add_request([3, 4, 5, 6, 7], 20), engine.add_request([9, 8, 7], 20)]
    engine.run()
    assert all(len(engine.outputs[rid]) == 20 for rid in ids)


# ------------------------------------------------------------------ a real mesh: one device's share


MESH_CHECK = r"""
import json, os
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
import jax, numpy as np
from flax import nnx
from jaxkv.nn import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from jaxkv.serve.build import build_cache
from jaxkv.serve.options import CacheOptions

mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]).reshape(1, 2), ("data", "tp"))
out = {}
for name, model, budget, rows in (
        ("llama", LlamaForCausalLM(LlamaConfig.from_hf(json.loads(os.environ["TINY"])), rngs=nnx.Rngs(0)), 200_000, 4),
        ("qwen3_next", AutoModelForCausalLM.from_pretrained(os.environ["QWEN"]), 3_000_000, 2)):
    got = {}
    for where, on in (("one", None), ("mesh", mesh)):
        cache = build_cache(model, CacheOptions(kv_cache_memory=budget, max_model_len=64), max_seqs=rows,
                            prefill_chunk=16, mesh=on)
        got[where] = dict(tokens=cache.plan.groups[0].tokens, plan=cache.plan.device_bytes, source=cache.plan.source)
        if on is not None:
            cache.place_on(on)
            device = jax.devices()[0]
            got[where]["held"] = sum(s.data.nbytes for leaf in jax.tree.leaves((cache.manager, cache.pool))
                                     for s in leaf.addressable_shards if s.device == device)
    out[name] = got
print(json.dumps(out))
"""


def test_on_a_mesh_the_cache_is_sized_by_one_devices_share():
    env = dict(os.environ, PYTHONPATH=ROOT, TINY=json.dumps(TINY), QWEN=os.path.join(FIXTURES, "qwen3_next", "small"),
               JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", MESH_CHECK], capture_output=True, text=True, env=env, timeout=300,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    llama, qwen = out["llama"], out["qwen3_next"]
    # the tiny Llama's 2 KV heads split over tp=2: twice the tokens for the same per-device budget
    assert llama["mesh"]["tokens"] >= 2 * llama["one"]["tokens"] - 16
    # Qwen3-Next's full-attention pool splits too (its GDN states as well)
    assert qwen["mesh"]["tokens"] > 1.9 * qwen["one"]["tokens"]
    for got, budget in ((llama, 200_000), (qwen, 3_000_000)):
        # what device 0 really holds once placed is the plan's figure, within the budget
        assert got["mesh"]["held"] == got["mesh"]["plan"] <= budget
        assert "per device of a data=1xtp=2 mesh" in got["mesh"]["source"]


# ------------------------------------------------------------------ the command line


def test_the_command_line_leaves_derived_options_out_and_keeps_given_ones(capsys):
    from jaxkv.serve.__main__ import build_parser, engine_options, main

    parse = build_parser().parse_args
    assert not {"max_seqs", "decode_chunk", "max_num_batched_tokens"} & set(engine_options(parse(["--model", "m"])))
    given = engine_options(parse(["--model", "m", "--max-num-seqs", "8", "--decode-chunk", "8",
                                  "--max-num-batched-tokens", "1024"]))
    assert given == dict(max_seqs=8, decode_chunk=8, max_num_batched_tokens=1024)  # 8 given: kept, not derived
    assert type(EngineOptions.from_kwargs(**given).scheduler.max_seqs) is int
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert from_cli(parser.parse_args([])) == EngineOptions()
    assert isinstance(from_cli(parser.parse_args([])).scheduler.max_seqs, Derived)
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for flag in ("--max-num-seqs", "--max-num-batched-tokens", "--decode-chunk", "--prefill-chunk",
                 "--kv-cache-memory", "--max-model-len"):
        assert flag in text
    assert "on an accelerator min(256" in text and "on a CPU 8" in text and "min(8192" in text
    assert "Derived(" not in text
