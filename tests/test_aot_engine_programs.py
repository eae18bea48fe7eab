"""The engine's own jitted programs compiled for H100 without a GPU, at real
sizes (``python -m jaxkv.bench engine_aot``'s quick subset): Llama-3.1-8B's
smallest and largest packed step, its decode chunk, its speculative decode
chunk and a packed step with speculative verify lanes on one H100 (a 51 GB
paged pool beside 16 GB of weights), gpt-oss-20b's decode chunk (its hybrid
cache beside 42 GB of weights), and a tiny DeepSeek-V4's on eight H100s
(its replicated latent pools kept whole). ``aot`` tests (the ``test_aot_`` names put
them in that pass): they need the CUDA plugin (``pip install
'jax[cuda12]>=0.10,<0.11'``) and skip without it; ``.ci/run`` installs it.

What they check, per program, from ``compiled.memory_analysis()``: the
cache is an argument and comes back aliased to it (updated in place), and
no temporary is the size of the cache (a copy of the KV pool); and in the
compiled HLO, that no instruction was rematerialized (computed twice).
"""

from __future__ import annotations

import functools

import pytest

GB = 10**9

#: The known defect (docs/gpu.md, issue 41): BlockSpaceManager.append_slots passes the pool through two
#: predicated ``jax.lax.cond``s (the block take and its copy-on-write), and XLA:GPU copies the pool in both
#: branches of each and back into the donated output; an index ``jax.lax.switch`` of the same branches is not
#: copied. Until it is fixed, the Llama test expects exactly that defect (any other fails it).
APPEND_SLOTS_COPIES = ("XLA:GPU copies the KV pool through the predicated lax.cond of "
                       "BlockSpaceManager.append_slots (docs/gpu.md, issue 41)")


@functools.cache
def _results(name: str) -> tuple:
    from jaxkv.bench import engine_aot

    spec = next(spec for spec in engine_aot.MODELS if spec.name == name)
    setup = engine_aot.build(spec)
    results = [engine_aot.compile_program(setup, *program)
               for program in engine_aot.programs(setup, engine_aot.QUICK[name])]
    return setup, results


def _sane(setup, results) -> None:
    for r in results:
        assert not r.error, (r.program, r.error)
        assert r.seconds > 0
        # No instruction recomputed: XLA's rematerialization pass, which reckons the donated cache twice and
        # so ran 31 of the 32 q/k/v GEMMs of Llama's 512-token packed step twice, is off in these programs
        # (jaxkv.nn.steps.PROGRAM_OPTIONS).
        assert r.rematerialized == 0, (r.program, r.rematerialized)
        # The weights and the cache are arguments; the donated cache is aliased to the outputs.
        assert r.argument_bytes >= r.cache_bytes + setup.weights_bytes, (r.program, r.argument_bytes)
        assert r.output_bytes >= r.cache_bytes and r.alias_bytes >= 0.9 * r.cache_bytes, (r.program, r.alias_bytes)


def test_aot_llama_programs_update_the_pool_in_place():
    setup, results = _results("Llama-3.1-8B")
    assert setup.kind == "paged" and setup.max_seqs == 256 and setup.max_num_batched_tokens == 8192
    assert 40 * GB < setup.cache_bytes < 64 * GB  # the pool fills the H100 beside 16 GB of weights
    assert [r.program for r in results] == ["packed[16]", "packed[8192]", "decode chunk x16"]
    _sane(setup, results)
    defects = [r for r in results if r.verdict != "ok"]
    if defects and all(r.verdict == "POOL-SIZED TEMP" and all(line.startswith("copy ") for line in r.cache_buffers)
                       and any("block_space.py" in line for line in r.cache_buffers) for r in defects):
        pytest.xfail(APPEND_SLOTS_COPIES)
    for r in results:
        assert r.temp_bytes < 0.5 * r.cache_bytes, (r.program, r.temp_bytes / GB, r.cache_buffers or r.largest)
        assert r.verdict == "ok" and r.peak_bytes < 80 * GB, (r.program, r.verdict, r.peak_bytes / GB)
    # The sizing rule measured the same programs (jaxkv.serve.build.room_for_programs): the largest temporaries of
    # the packed step at the token budget and of the decode chunk, each compiled again here.
    assert setup.program_bytes == max(r.temp_bytes for r in results if r.program in ("packed[8192]",
                                                                                    "decode chunk x16"))
    assert setup.budget_rule == "0.8 of the free memory"  # 16 GB of weights leave the default room enough


def test_aot_hybrid_decode_chunk_updates_its_cache_in_place():
    setup, results = _results("gpt-oss-20b")
    assert setup.kind == "hybrid" and setup.cache_bytes > 10 * GB
    _sane(setup, results)
    for r in results:
        assert r.temp_bytes < 0.5 * r.cache_bytes, (r.program, r.temp_bytes / GB, r.cache_buffers or r.largest)
        assert r.verdict == "ok" and r.peak_bytes < 80 * GB, (r.program, r.verdict, r.peak_bytes / GB)


def test_aot_speculative_programs_update_the_pool_in_place():
    """Llama-3.1-8B's speculative decode chunk (n-gram verify steps of k =
    4) and a packed step with verify lanes: the pool updated in place, no
    cache-sized temporary, within an H100 (a switch between a verify step
    and a plain one copied the pool three times: 153 GB)."""
    from jaxkv.bench import engine_aot

    setup, _ = _results("Llama-3.1-8B")
    results = [engine_aot.compile_program(setup, *program)
               for program in engine_aot.programs(setup, ("spec", "verify:first"))]
    assert [r.program for r in results] == ["spec chunk x16 k4", "packed verify[16] k4"]
    _sane(setup, results)
    for r in results:
        assert r.verdict == "ok" and r.peak_bytes < 80 * GB, (r.program, r.verdict, r.peak_bytes / GB,
                                                             r.cache_buffers or r.largest)


def test_a_copy_is_traced_to_the_operation_it_sits_in():
    """The defect report's reader of compiled HLO (no GPU needed): the
    buffers made anew, not views, in-place updates or fused
    instructions, each traced to the op that made it or, for a ``copy``
    that copy insertion added, to the op calling its computation."""
    from jaxkv.bench.engine_aot import big_buffers

    hlo = "\n".join([
        "%fused_scatter (p0: u16[4,1024], p1: s32[2]) -> u16[4,1024] {",
        "  %big = u16[4,1024]{1,0} copy(%p0)",
        "  ROOT %scatter.1 = u16[4,1024]{1,0} scatter(%big, %p1, %p1)",
        "}",
        "%region_1.3 (arg: (u16[4,1024])) -> (u16[4,1024]) {",
        "  %get-tuple-element.6 = u16[4,1024]{1,0} get-tuple-element(%arg), index=0",
        "  %copy.2 = u16[4,1024]{1,0} copy(%get-tuple-element.6), metadata={scheduling_name=\"copy.2\"}",
        "  %copy.3 = u16[4,8]{1,0} copy(%get-tuple-element.6)",
        "  ROOT %f = u16[4,1024]{1,0} fusion(%copy.2), kind=kInput, calls=%fused_scatter",
        "}",
        "ENTRY %main.4 (a.3: u16[4,1024]) -> u16[4,1024] {",
        "  %c = (u16[4,1024]{1,0}) conditional(%p, %t, %t), true_computation=%region_1.3, "
        "false_computation=%region_0.1, metadata={op_name=\"jit(f)/cond\"}",
        "  %g = (u16[4,256]{1,0}, u16[4,1024]{1,0}) all-gather-start(%x), metadata={op_name=\"jit(f)/kernel\"}",
        "  %d = u16[4,1024]{1,0} all-gather-done(%g)",
        "  ROOT %copy.4 = u16[4,1024]{1,0} copy(%d)",
        "}"])
    found = [(b.op, b.name, b.computation, b.origin) for b in big_buffers(hlo, 4096)]
    assert sorted(found) == sorted([("copy", "copy.2", "region_1.3", "in a conditional jit(f)/cond"),
                                    ("all-gather-start", "g", "ENTRY", "jit(f)/kernel"),
                                    ("copy", "copy.4", "ENTRY", "")])


def test_aot_deepseek_v4_on_tp8_keeps_its_latent_pools_whole(monkeypatch):
    """A tiny DeepSeek-V4 (``tests/fixtures/dsv4/small``) on eight H100s
    (tp=8): its decode chunk and packed step make no buffer from the cache's
    arrays (a dimension only the cache has). Its latent pools (window rings,
    entries, indexer keys) are replicated; the rows written to them, and the
    indexer's queries, are placed whole or by heads first
    (``HeadPlacement.place_whole``, ``place_kv``). Without that XLA split the
    pools' updates along the features of the sharded projections and
    gathered and transposed the pools back, every step: 15 such buffers in
    the decode chunk, 18 in the packed step (on one device: none)."""
    import json
    import os

    from jaxkv.bench import deployment, engine_aot

    with open(os.path.join(os.path.dirname(__file__), "fixtures", "dsv4", "small", "config.json")) as f:
        monkeypatch.setitem(deployment.HF_CONFIGS, "DSV4-small", json.load(f))
    setup = engine_aot.build(engine_aot.ModelSpec("DSV4-small", "DSV4-small", 8))
    for label, fn, args, kwargs in engine_aot.programs(setup, ("decode", "packed:16")):
        hlo = engine_aot.compile_for_h100(fn, args, kwargs).as_text()
        made = [b.describe() for b in engine_aot.big_buffers(hlo, 1 << 20) if setup.cache_dims.intersection(b.dims)]
        assert made == [], (label, made[:4])
