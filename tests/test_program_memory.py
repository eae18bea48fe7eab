"""The cache leaves room for the engine's programs' temporaries
(:mod:`jaxkv.serve.program_memory`, :func:`jaxkv.serve.build.program_reserve`).

On a CPU the engine does not measure them (no device limit to fit); these
tests turn the measurement on (``build.measures_programs``) and give the
free memory (``free_bytes``). The expectations are independent of the
measurement's code: XLA's memory analysis of the programs the engine then
runs (jit compiles nothing more when the plan kept the measured shapes:
the measured programs are the engine's own), the reference tokens of each
family (transformers' for the fixtures), and the bytes the engine's cache
holds."""

from __future__ import annotations

import functools
import json
import logging
import os

import jax
import numpy as np
import pytest
from flax import nnx

from jaxkv.errors import InvalidArgument
from jaxkv.nn import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, generate
from jaxkv.serve import Engine, build
from jaxkv.serve.options import Derived
from jaxkv.serve.program_memory import PROGRAM_MARGIN

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
LLAMA = dict(model_type="llama", vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0,
             max_position_embeddings=256, tie_word_embeddings=False)
MiB = 1 << 20
# A packed step over the whole token budget, then decode chunks: the programs the engine measures.
PROGRAMS = ("_paged_packed", "_hybrid_packed", "decode_chunk")


@functools.lru_cache(maxsize=None)
def model(name):
    if name == "llama":
        return LlamaForCausalLM(LlamaConfig.from_hf(LLAMA), rngs=nnx.Rngs(0))
    return AutoModelForCausalLM.from_pretrained(os.path.join(FIXTURES, name))


def reference(name, rng, index=1):
    """``(prompt, greedy tokens)``: a fresh prompt of 200-250 tokens and
    ``generate``'s tokens for the tiny Llama; a fixture's prompt
    ``index`` and transformers' tokens."""
    if name == "llama":
        prompt = rng.integers(1, LLAMA["vocab_size"], int(rng.integers(200, 250))).tolist()
        return prompt, generate(model(name), [prompt], 6).tokens[0]
    with open(os.path.join(FIXTURES, name, "expected.json"), encoding="utf-8") as f:
        data = json.load(f)
    return data["prompts"][index], data["greedy"][index][:6]


@pytest.fixture
def measured(monkeypatch):
    """The engine measures its programs, as on an accelerator."""
    monkeypatch.setattr(build, "measures_programs", lambda mesh=None: True)


def compiled_programs(caplog, budget: int | None = None) -> list[str]:
    """The measured programs jit compiled: a decode chunk, or a packed step
    (over ``budget`` tokens, when given: its token arrays are ``[budget]``)."""
    out = []
    for record in caplog.records:
        text = record.getMessage()
        if not text.startswith("Compiling jit("):
            continue
        if "jit(decode_chunk)" in text or (any(f"jit({p})" in text for p in PROGRAMS[:2])
                                           and (budget is None or f"int32[{budget}]" in text)):
            out.append(text.split(" with ")[0])
    return out


# (name, token budget, fixture prompt): one prompt that fills the largest packed stream in one piece.
ROOM = [("llama", 256, None), ("dsv4/small", 128, 5)]


@pytest.mark.parametrize("name,budget,index", ROOM)
def test_room_left_serves_from_the_measured_compile(name, budget, index, measured, caplog):
    """Free memory enough for the default plan beside the programs: the
    plan is the default's, and the engine's packed step over the whole
    token budget and its decode chunks compile nothing (shorter streams
    compile as before) (jit serves them
    from the measurement's compile: the measured programs are the ones
    that run; a paged pool and a hybrid cache). The tokens are the
    reference's."""
    prompt, want = reference(name, np.random.default_rng(), index)
    with caplog.at_level(logging.INFO, logger="jaxkv.serve"):
        engine = Engine(model(name), free_bytes=PROGRAM_MARGIN + 256 * MiB, max_num_batched_tokens=budget)
    assert "leaves room for the programs' temporaries" in engine.cache_plan.source
    assert engine.stream_lengths()[-1] == budget and budget // 2 < len(prompt) <= budget
    assert f"packed[{budget}]" in engine.cache_plan.source
    caplog.clear()
    with jax.log_compiles(), caplog.at_level(logging.WARNING):
        rid = engine.add_request(prompt, len(want))
        engine.run()
    assert engine.outputs[rid] == want
    assert compiled_programs(caplog, budget) == []


@pytest.mark.parametrize("name", ["llama", "qwen3_next/small", "dsv4/small"])
def test_a_cache_short_of_room_is_sized_to_what_the_programs_leave(name, measured):
    """Free memory that 0.8 of would leave the programs too little: the
    cache takes what the temporaries and the margin leave (within one block
    per group), and still serves the reference tokens."""
    m = model(name)
    probe = Engine(m, free_bytes=PROGRAM_MARGIN + 256 * MiB, max_num_batched_tokens=64, max_model_len=128)
    temps, need = probe.cache_plan.program_bytes, probe.cache.device_bytes()
    assert temps > 0
    # Free memory whose 0.8 holds the whole default cache, but not beside the programs and the margin.
    free = PROGRAM_MARGIN + temps + need * 3 // 4
    assert 0.8 * free > need
    engine = Engine(m, free_bytes=free, max_num_batched_tokens=64, max_model_len=128)
    plan = engine.cache_plan
    used = engine.cache.device_bytes()
    assert "less the programs' temporaries" in plan.source and plan.program_bytes == temps
    assert plan.budget_bytes == free - temps - PROGRAM_MARGIN
    assert used <= plan.budget_bytes < used + sum(g.bytes_per_block for g in plan.groups)
    prompt, want = reference(name, np.random.default_rng())
    rid = engine.add_request(prompt[:60], 4)
    engine.run()
    if name == "llama":
        want = generate(m, [prompt[:60]], 4).tokens[0]
    else:
        assert prompt[:60] == prompt
    assert engine.outputs[rid] == want[:4]


def test_no_room_at_all_is_refused_with_the_numbers(measured):
    with pytest.raises(InvalidArgument, match=r"\d+ free device bytes \(given\) do not hold the programs' "
                                              r"temporaries \(packed\[\d+\] .* and a margin of \d+ bytes"):
        Engine(model("llama"), free_bytes=PROGRAM_MARGIN + 1024, max_num_batched_tokens=64)


def test_program_memory_given_is_kept_free_without_compiling(caplog):
    """``program_memory=N`` (any platform): N bytes and the margin kept
    free, nothing compiled to size the cache."""
    free = PROGRAM_MARGIN + 6 * MiB
    with jax.log_compiles(), caplog.at_level(logging.WARNING):
        engine = Engine(model("llama"), free_bytes=free, program_memory=5 * MiB)
    assert compiled_programs(caplog) == []
    used = engine.cache.device_bytes()
    assert used <= free - 5 * MiB - PROGRAM_MARGIN
    assert "program_memory 5 MiB" in engine.cache_plan.source and engine.cache_plan.program_bytes == 5 * MiB


def test_a_cache_sized_by_hand_measures_nothing(measured, caplog):
    """``kv_cache_memory`` given: used whole, nothing measured or compiled."""
    with jax.log_compiles(), caplog.at_level(logging.WARNING):
        engine = Engine(model("llama"), kv_cache_memory=3 * MiB, max_model_len=128)
    assert compiled_programs(caplog) == []
    assert engine.cache_plan.budget_bytes == 3 * MiB
    assert "temporaries" not in engine.cache_plan.source and engine.cache_plan.program_bytes == 0


def test_a_derived_token_budget_is_lowered_when_its_programs_leave_the_cache_too_little(measured, caplog):
    """The packed step over the derived token budget (256 on the CPU) needs
    more than the free memory leaves beside half the default cache: the
    engine runs with the largest packed stream length whose programs leave
    that half, measured; a prompt longer than it is prefilled over several
    steps and gets ``generate``'s tokens. A budget given is kept (the cache
    shrinks instead)."""
    m = model("llama")
    probe = Engine(m, free_bytes=PROGRAM_MARGIN + 256 * MiB)
    assert probe.stream_lengths()[-1] == 256
    temps, want = probe.cache_plan.program_bytes, probe.cache.device_bytes()
    free = PROGRAM_MARGIN + temps + want // 4
    with caplog.at_level(logging.INFO, logger="jaxkv.serve"):
        engine = Engine(m, free_bytes=free)
    tokens = engine.options.scheduler.max_num_batched_tokens
    assert tokens in (16, 32, 48, 64, 96, 128, 192) and engine.stream_lengths()[-1] == tokens
    assert engine.options.scheduler.prefill_chunk == tokens
    assert engine.cache_plan.program_bytes <= free - PROGRAM_MARGIN - want // 2
    assert f"the token budget lowered from 256 to {tokens}" in engine.cache_plan.source
    assert any(f"max_num_batched_tokens={tokens}" in r.getMessage() for r in caplog.records)
    prompt = np.random.default_rng().integers(1, LLAMA["vocab_size"], tokens + 40).tolist()
    rid = engine.add_request(prompt, 5)
    engine.run()
    assert engine.outputs[rid] == generate(m, [prompt], 5).tokens[0]
    given = Engine(m, free_bytes=free, max_num_batched_tokens=256)
    assert given.options.scheduler.max_num_batched_tokens == 256
    assert given.cache.device_bytes() < want and "lowered" not in given.cache_plan.source


def test_derived_rows_follow_the_budget_the_programs_leave(measured, monkeypatch, caplog):
    """As on a GPU (the platform the defaults are derived for): ``max_seqs``
    derived from 0.8 of the free memory, then the programs' temporaries cut
    the budget: the engine derives the rows again from what they leave (the
    same rule, :func:`jaxkv.serve.build.derive_scheduler_defaults`), and
    sizes its cache for them; the tokens are ``generate``'s."""
    m = model("llama")
    monkeypatch.setattr(build, "_platform", lambda mesh=None: "gpu")
    options = dict(max_num_batched_tokens=256, max_model_len=128)
    free = PROGRAM_MARGIN + 64 * MiB
    wide = Engine(m, free_bytes=free, **options)
    assert wide.options.scheduler.max_seqs == 256  # the rows the 0.8 budget gives, at most 256
    temps, want = wide.cache_plan.program_bytes, wide.cache.device_bytes()
    del wide
    free = PROGRAM_MARGIN + temps + want // 8
    with caplog.at_level(logging.INFO, logger="jaxkv.serve"):
        engine = Engine(m, free_bytes=free, **options)
    rows = engine.options.scheduler.max_seqs
    room = free - temps - PROGRAM_MARGIN
    again = build.derive_scheduler_defaults(m, engine.options.replace(kv_cache_memory=room, max_seqs=Derived(8)),
                                            free_bytes=free)
    assert 8 <= rows < 256 and rows == again.values()["max_seqs"]
    assert engine.cache_plan.max_seqs == rows and engine.cache.device_bytes() <= room
    assert any(f"max_seqs={rows}" in r.getMessage() for r in caplog.records)
    prompt = np.random.default_rng().integers(1, LLAMA["vocab_size"], 70).tolist()
    rid = engine.add_request(prompt, 5)
    engine.run()
    assert engine.outputs[rid] == generate(m, [prompt], 5).tokens[0]


def test_rows_whose_own_state_passes_the_room_are_derived_again(measured, monkeypatch):
    """As on a GPU, a hybrid cache (Qwen3-Next: every row carries its Gated
    DeltaNet state): the programs leave less than the derived rows' own
    state, so the first sizing cannot place one block. The engine derives
    the rows again from what the programs leave and sizes the cache for
    them, instead of refusing; the tokens are transformers'."""
    m = model("qwen3_next/small")
    monkeypatch.setattr(build, "_platform", lambda mesh=None: "gpu")
    options = dict(max_num_batched_tokens=256, max_model_len=128, prefix_cache=False)
    wide = Engine(m, free_bytes=PROGRAM_MARGIN + 256 * MiB, **options)
    rows, temps = wide.options.scheduler.max_seqs, wide.cache_plan.program_bytes
    state = rows * wide.cache_plan.snapshot_bytes  # the rows' own state, whatever the blocks
    del wide
    free = PROGRAM_MARGIN + temps + state // 2
    with pytest.raises(InvalidArgument, match="do not hold the cache's fixed"):
        Engine(m, free_bytes=free, max_seqs=rows, **options)  # rows given: kept, so refused with the numbers
    engine = Engine(m, free_bytes=free, **options)
    assert engine.options.scheduler.max_seqs < rows
    assert engine.cache.device_bytes() <= free - temps - PROGRAM_MARGIN
    prompt, want = reference("qwen3_next/small", None, 3)
    rid = engine.add_request(prompt, len(want))
    engine.run()
    assert engine.outputs[rid] == want
