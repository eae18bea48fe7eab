"""The hybrid KV cache gives the same answers as recomputing without a cache.

Requests run through :class:`KVCacheManager` as a serving loop would: admit;
then per step ``reserve`` -> per layer ``acquire`` -> the layer's step ->
``update``; release. Each step is one packed batch of tokens (a request's
whole prompt on its first step, then one token per step, padding after), so
one jitted program serves prefill and decode. Requests are admitted at
different times, some released mid-way and new ones admitted into their
slots. Every output of every layer is compared with the layer's no-cache
recomputation of the request's whole sequence:

* DeepSeek-V4 kinds (SWA-only, CSA, HCA; :mod:`tests.reference.dsv4_reference`):
  against ``forward_full(quantize=True)`` (the cache's fp8 round trip applied
  to the same values) tightly (see ``TIGHT``), with the CSA top-k choices
  identical; and against ``forward_full(quantize=False)`` within fp8 bounds;
* Qwen3-Next (3 Gated DeltaNet layers + 1 full-attention layer): against
  the GDN layer's ``forward_full`` and dense causal attention.

Inputs and weights are fresh random draws each run; the seed is in every
assertion message (to rerun one, make ``_seed`` return it).

Compile time dominates (tiny shapes, ~150 steps of one jitted program): the
test's own jits use LLVM ``-O0`` (``xla_backend_optimization_level=0``),
which roughly halves compile time. It can change whether LLVM fuses ``a * b
+ c`` into an FMA; the reference layer's exact projections and RoPE do not
depend on that, and the comparisons' tolerances cover the rest.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxkv.manager.hybrid import KVCacheManager
from jaxkv.manager.hybrid_schema import (
    AttentionKind,
    HybridConfig,
    LayerSpec,
    qwen3_next_schedule,
)
from tests.reference import dsv4_reference as dsv4
from tests.reference import gated_delta_net as gdn
from jaxkv.nn.rope import apply_rope, rope_inv_freq
from kernels_pallas.formats import EntryFormat

HIDDEN = 32
HEADS = 2
WINDOW = 8
MAX_REQS = 3
TINY = EntryFormat("tiny", nope_dim=64, rope_dim=16, group_size=32, scale_kind="ue8m0")
TINY_FP32 = EntryFormat("tiny_fp32", nope_dim=64, rope_dim=16, group_size=32, scale_kind="fp32")
_FAST = {"xla_backend_optimization_level": 0}

# Tight bound (cache vs forward_full(quantize=True)). Both paths store the
# same values: projections and RoPE are exact in float32 whatever program XLA
# builds (see tests.reference.dsv4_reference), both round them through the same fp8
# / bf16 formats, and the gathers dequantize exactly. The attention then sums
# in different orders (window + gathered entries vs the whole masked
# sequence): a few ulps on outputs of size ~1 (observed <= 1.1e-6), so
# TIGHT = 1e-4. One thing is not exact: the compressor's softmax pooling,
# which the cache (dsv4_compressor.compress_step) and the reference compute in different
# programs; ~3% of pooled values differ in their last bit, and such a value
# lands on the other side of an fp8 (bf16) rounding boundary with probability
# ~2**-19.5 (2**-15.5): about one run in 100 has one flipped entry value. Its
# effect on the outputs of the request that owns it, measured by injecting
# flips: bf16 median 5e-5, max 2.5e-4; fp8 median 1.1e-3, max 6.5e-3. So at
# most ONE (request, layer) pair may exceed TIGHT (two flips in one run:
# ~1e-4), and none may exceed ONE_FLIP = 1e-2. Real bugs are far above both:
# mutants of hybrid.py (ring row, SWA slot, entry slot, causal count, a
# missing block at the boundary, the in-step pooling rows) give 0.1 .. 2.6 in
# many pairs.
TIGHT = 1e-4
ONE_FLIP = 1e-2
# fp8 bounds (cache vs forward_full(quantize=False)). e4m3 keeps 3 mantissa
# bits: each stored NoPE value is off by at most 2**-4 of itself, uniformly
# spread, so ~2**-4/sqrt(3) = 3.6% RMS (bf16 RoPE: 2**-9); keys and values
# both carry it, and the output (a convex combination of values, through the
# softmax of the keys, then the output projection) inherits about that
# relative RMS error. Observed over ~300 (request, layer) pairs: RMS error /
# RMS output 0.022 .. 0.034, max error / max |output| <= 0.077. Bounds:
# FP8_RMS = 0.08 (2x the model, 2.4x the worst seen) and FP8_MAX = 0.25 (3x the
# worst seen) -- a wrong or missing row costs ~the output scale.
FP8_RMS = 0.08
FP8_MAX = 0.25
# CSA under quantize=False: the fp8 error may reorder index scores that are
# within ~2**-4 of each other, so a token can pick a different 3rd entry.
# Those tokens are excluded from the value comparison; most tokens must agree.
MIN_SAME_TOPK = 0.75


def _seed() -> int:
    return int(np.random.SeedSequence().entropy % 2**31)


def _inputs(rng, shape) -> np.ndarray:
    """Random float32 inputs on the 2**-8 grid, never zero (dsv4.to_grid)."""
    return dsv4.to_grid(rng.normal(size=shape))


# --------------------------------------------------------------------------
# The host loop shared by both schedules.
# --------------------------------------------------------------------------


@dataclasses.dataclass
class Req:
    """A request admitted before step ``start``: its ``prompt`` tokens (at
    least one) in that step, then one token per step; ``total`` tokens in all.
    Released after its last step if ``release``."""

    name: str
    start: int
    total: int
    prompt: int = 1
    release: bool = False

    @property
    def end(self) -> int:
        """The step after its last."""
        return self.start + self.total - self.prompt + 1


def _admit_fn():
    return jax.jit(lambda m: m.admit(1, max_n=1), compiler_options=_FAST)


def _release_fn():
    return jax.jit(lambda m, s: m.release(s), compiler_options=_FAST)


def _packed(step_body, width):
    """Jit ``step_body(manager, slots [R], positions [T], request_ids [T], x)
    -> (manager, ys [L, T, HIDDEN], aux)`` behind the reserve of the packed
    batch: ``slots [R]`` (-1 rows: padding; the last row always is),
    ``num_new [R]``, ``offsets [T]`` (token's index in its request's chunk),
    ``request_ids [T]`` (padding tokens: the last row)."""

    def step(manager, slots, num_new, offsets, request_ids, x):
        manager, starts, ok = manager.reserve(slots, num_new, max_new_tokens=width)
        positions = jnp.where(slots[request_ids] >= 0, starts[request_ids] + offsets, -1)
        manager, ys, aux = step_body(manager, slots, positions, request_ids, x)
        return manager, starts, ok, ys, aux

    return jax.jit(step, compiler_options=_FAST)


def _drive(manager, step, width, reqs, inputs, rng, seed, *, on_release=None):
    """Run ``reqs`` through ``step`` (a :func:`_packed` program ``width``
    tokens wide). Slot ``s`` is batch row ``s - 1``.

    Returns ``{name: ys [L, total, HIDDEN]}`` (position order), ``{name:
    [aux per token]}`` and ``{name: slot}``."""
    admit, release = _admit_fn(), _release_fn()
    rows = MAX_REQS + 1  # the last row is padding
    num_steps = max(r.end for r in reqs)
    slot_of, freed, done = {}, [], {r.name: 0 for r in reqs}
    outs = {r.name: [] for r in reqs}
    auxs = {r.name: [] for r in reqs}
    for i in range(num_steps):
        for r in reqs:
            if r.start != i:
                continue
            manager, ids, ok = admit(manager)
            slot = int(ids[0])
            assert bool(ok) and slot >= 1, f"seed {seed}: admit of {r.name} failed ({slot})"
            if freed:  # lowest first: the request takes the lowest released slot
                assert slot == min(freed), f"seed {seed}: {r.name} got slot {slot}, freed {freed}"
                freed.remove(slot)
            assert int(manager.seq_lens[slot]) == 0, f"seed {seed}: admitted slot {slot} not reset"
            slot_of[r.name] = slot
        live = [r for r in reqs if r.start <= i < r.end]
        slots = np.full((rows,), -1, np.int32)
        num_new = np.zeros((rows,), np.int32)
        offsets = np.full((width,), -1, np.int32)
        request_ids = np.full((width,), rows - 1, np.int32)
        x = _inputs(rng, (width, HIDDEN))  # padding tokens get random filler
        chunks, t = {}, 0
        for r in sorted(live, key=lambda r: slot_of[r.name]):
            row, n = slot_of[r.name] - 1, (r.prompt if i == r.start else 1)
            slots[row], num_new[row] = slot_of[r.name], n
            offsets[t:t + n], request_ids[t:t + n] = np.arange(n), row
            x[t:t + n] = inputs[r.name][done[r.name]:done[r.name] + n]
            chunks[r.name] = (t, n)
            t += n
        assert t <= width, f"step {i} needs {t} tokens, the program takes {width}"
        manager, starts, ok, ys, aux = step(manager, *map(jnp.asarray, (slots, num_new, offsets, request_ids, x)))
        assert bool(ok), f"seed {seed}: reserve failed at step {i}"
        starts, ys = np.asarray(starts), np.asarray(ys)
        aux = jax.tree.map(np.asarray, aux)
        for r in live:
            (t, n), row = chunks[r.name], slot_of[r.name] - 1
            assert starts[row] == done[r.name], f"seed {seed}: {r.name} at {starts[row]}, not {done[r.name]}"
            for k in range(t, t + n):
                outs[r.name].append(ys[:, k])
                auxs[r.name].append(jax.tree.map(lambda a, k=k: a[k], aux))
            done[r.name] += n
        for r in live:
            if r.release and i == r.end - 1:
                slot = slot_of[r.name]
                manager, ok = release(manager, jnp.asarray([slot], jnp.int32))
                assert bool(ok), f"seed {seed}: release of {r.name} (slot {slot}) failed"
                if on_release is not None:
                    on_release(manager, slot)
                freed.append(slot)
    assert all(done[r.name] == r.total for r in reqs), done
    return {k: np.stack(v, axis=1) for k, v in outs.items()}, auxs, slot_of


# --------------------------------------------------------------------------
# DeepSeek-V4: SWA-only, CSA and HCA layers.
# --------------------------------------------------------------------------


def _v4_step(params, width):
    def body(manager, slots, positions, request_ids, x):
        ys, aux = [], {}
        for layer, p in enumerate(params):
            handle = manager.acquire(layer, slots, positions, request_ids)
            handle, y, a = dsv4.forward_step(p, handle, x, return_aux=True)
            manager = manager.update(handle)
            ys.append(y)
            aux.update({f"topk{layer}": v for v in a.values()})
        return manager, jnp.stack(ys), aux

    return _packed(body, width)


def _v4_references(params, xs):
    """Every layer's forward_full over ``xs [R, max_len, HIDDEN]``, with and
    without the fp8 round trip (one compile)."""

    def run(params, xs):
        out = {}
        for quantize in (True, False):
            for layer, p in enumerate(params):
                out[quantize, layer] = jax.vmap(
                    lambda x, p=p, q=quantize: dsv4.forward_full(p, x, quantize=q, return_aux=True))(xs)
        return out

    out = jax.jit(run, compiler_options=_FAST)(params, jnp.asarray(xs))
    return jax.tree.map(np.asarray, out)


def _check_released(seed, group_names):
    def check(manager, slot):
        """A released slot holds nothing and its state is initial again."""
        for layer in range(len(manager.schemas)):
            cache = manager.layer_cache(layer)
            if cache is None:
                continue
            swa = np.asarray(cache.swa.nope[slot].astype(jnp.float32))
            assert (swa == 0).all(), f"seed {seed}: layer {layer} SWA ring of released slot {slot} not zeroed"
            if cache.comp_score is not None:
                assert np.isneginf(np.asarray(cache.comp_score[slot])).all(), \
                    f"seed {seed}: layer {layer} compressor ring of released slot {slot} not reset"
                assert (np.asarray(cache.comp_kv[slot]) == 0).all(), f"seed {seed}: layer {layer} comp_kv"
        for name in group_names:
            group = manager.groups[name]
            assert int(group.lens[slot]) == 0 and (np.asarray(group.tables[slot]) == -1).all(), \
                f"seed {seed}: group {name} still lists blocks for released slot {slot}"
        assert int(manager.seq_lens[slot]) == 0, f"seed {seed}: seq_lens[{slot}] not 0 after release"

    return check


def _run_v4(fmt, schedule, reqs, max_len, width):
    seed = _seed()
    rng = np.random.default_rng(seed)
    config = HybridConfig(entry_format=fmt, window=WINDOW, index_head_dim=16, index_topk=3)
    manager = KVCacheManager.create(config, schedule, MAX_REQS, max_context_tokens=256)
    keys = jax.random.split(jax.random.key(seed), len(schedule))
    params = tuple(dsv4.init_params(keys[i], HIDDEN, HEADS, s, max_len=max_len)
                   for i, s in enumerate(manager.schemas))
    inputs = {r.name: _inputs(rng, (max_len, HIDDEN)) for r in reqs}  # rows past `total`: padding
    outs, auxs, slot_of = _drive(manager, _v4_step(params, width), width, reqs, inputs, rng, seed,
                                 on_release=_check_released(seed, list(manager.groups)))
    ref = _v4_references(params, np.stack([inputs[r.name] for r in reqs]))
    above_tight = []
    for b, r in enumerate(reqs):
        n = r.total
        for layer, s in enumerate(manager.schemas):
            where = f"seed {seed}: {r.name} (slot {slot_of[r.name]}), layer {layer} ({s.kind.value}{s.compress_ratio})"
            got = outs[r.name][layer]  # [total, HIDDEN]
            exact, exact_aux = ref[True, layer]
            np.testing.assert_allclose(got, exact[b, :n], rtol=0, atol=ONE_FLIP,
                                       err_msg=f"{where}: vs forward_full(quantize=True)")
            if np.abs(got - exact[b, :n]).max() > TIGHT:
                above_tight.append(f"{where}: max |cache - forward_full(quantize=True)| = "
                                   f"{np.abs(got - exact[b, :n]).max():.3g}")
            keep = np.ones((n,), bool)
            if s.kind == AttentionKind.CSA:
                picked = np.sort(np.stack([a[f"topk{layer}"] for a in auxs[r.name]]), axis=1)
                np.testing.assert_array_equal(picked, np.sort(exact_aux["topk"][b, :n], axis=1),
                                              err_msg=f"{where}: top-k choices differ from quantize=True")
                keep = (np.sort(ref[False, layer][1]["topk"][b, :n], axis=1) == picked).all(axis=1)
                assert keep.mean() >= MIN_SAME_TOPK, \
                    f"{where}: only {keep.mean():.0%} of tokens pick the unquantized top-k"
            plain = ref[False, layer][0][b, :n]
            err, kept = (got - plain)[keep], plain[keep]
            rms, rms_ref = np.sqrt(np.mean(err**2)), np.sqrt(np.mean(kept**2))
            assert rms <= FP8_RMS * rms_ref, \
                f"{where}: RMS |cache - forward_full(quantize=False)| = {rms:.4g} > {FP8_RMS} x {rms_ref:.4g}"
            assert np.abs(err).max() <= FP8_MAX * np.abs(kept).max(), \
                f"{where}: max |cache - forward_full(quantize=False)| = {np.abs(err).max():.4g} > " \
                f"{FP8_MAX} x {np.abs(kept).max():.4g}"
    # At most one rounding flip (see TIGHT); anything more is a real difference.
    assert len(above_tight) <= 1, "\n".join(above_tight)


def test_deepseek_v4_schedule_matches_recompute():
    """SWA-only, CSA (ratio 4: 32 entries per block) and HCA (ratio 8: 16
    entries per block) layers, window 8, top-3 of the indexer. Request A runs
    140 tokens: it wraps the SWA ring many times, completes 35 CSA and 17 HCA
    entries and crosses a block boundary in both groups (entry 32 at position
    131, entry 16 at position 135). B and C are released mid-run; D and E are
    admitted into their slots and must match a fresh recompute. E starts with
    a 16-token prompt in one step beside A's and D's decode tokens (see the
    fp32 test for what a prompt exercises)."""
    schedule = [LayerSpec(0, AttentionKind.SWA), LayerSpec(1, AttentionKind.CSA, 4),
                LayerSpec(2, AttentionKind.HCA, 8)]
    reqs = [Req("A", 0, 140), Req("B", 2, 37, release=True), Req("C", 6, 50, release=True),
            Req("D", 41, 99), Req("E", 60, 95, prompt=16)]
    _run_v4(TINY, schedule, reqs, max_len=144, width=18)


def test_deepseek_v4_fp32_scales_and_prompts_match_recompute():
    """fp32 scales (the DSV32_FP8 encoding), other ratios (CSA ratio 2,
    HCA ratio 16), and 18-token prompts in one step each (B's beside A's
    decode token), then decoding. A prompt is over two windows long, so its
    later tokens overwrite ring rows its earlier ones see (attended from the
    step); 9 CSA entries and an HCA entry complete inside the step, pooling
    rows of the same step (the ``here`` path of ``compress_step``), and decoding
    then continues from the compressor rings and SWA ring the prompt left.
    (Prompts split over several steps:
    :func:`test_swa_rows_of_earlier_steps_survive_a_multi_token_step`.)"""
    schedule = [LayerSpec(0, AttentionKind.CSA, 2), LayerSpec(1, AttentionKind.HCA, 16)]
    reqs = [Req("A", 0, 70, prompt=18), Req("B", 5, 45, prompt=18)]
    _run_v4(TINY_FP32, schedule, reqs, max_len=72, width=19)


def test_swa_rows_of_earlier_steps_survive_a_multi_token_step():
    """After positions 0..7, a step with positions 8 and 9: ``gather_swa(kv)``
    before ``write_swa`` returns token 8's whole window (positions 1..8),
    though position 9 then overwrites position 1's ring row; and the decode
    path (``gather_swa()`` after the write) marks exactly that row invalid."""
    config = HybridConfig(entry_format=TINY, window=WINDOW)
    manager = KVCacheManager.create(config, [LayerSpec(0, AttentionKind.SWA)], 1, max_context_tokens=64)
    manager, slots, _ = _admit_fn()(manager)

    n = 2  # tokens per step (one compile); positions 0..7 in 4 steps, then 8 and 9

    @functools.partial(jax.jit, compiler_options=_FAST)
    def run(manager):
        manager, starts, _ = manager.reserve(slots, jnp.asarray([n]), max_new_tokens=n)
        positions = starts[0] + jnp.arange(n, dtype=jnp.int32)
        handle = manager.acquire(0, slots, positions, jnp.zeros((n,), jnp.int32))
        values = jnp.broadcast_to((positions + 1.0)[:, None], (n, TINY.head_dim))
        kv, valid = handle.gather_swa(values)
        handle = handle.write_swa(values)
        _, after_valid = handle.gather_swa()
        return manager.update(handle), positions, kv[:, :, 0].astype(jnp.float32), valid, after_valid

    for _ in range(WINDOW // n + 1):
        manager, positions, kv, valid, after_valid = run(manager)
    positions, kv, valid, after_valid = map(np.asarray, (positions, kv, valid, after_valid))
    assert list(positions) == [WINDOW, WINDOW + 1], positions
    for t in range(n):
        window = np.arange(positions[t] - WINDOW + 1, positions[t] + 1)  # oldest first, as gather_swa returns
        assert valid[t].all(), f"token {positions[t]}: rows of positions {window[~valid[t]]} lost"
        np.testing.assert_array_equal(kv[t], window + 1.0)
    # After the write, position 1 (token 8's oldest row) was overwritten by 9.
    assert after_valid[0].tolist() == [False] + [True] * (WINDOW - 1) and after_valid[1].all()


# --------------------------------------------------------------------------
# Qwen3-Next: Gated DeltaNet layers + full attention.
# --------------------------------------------------------------------------

GDN_DIMS = {"num_k_heads": 1, "num_v_heads": 2, "head_k_dim": 8, "head_v_dim": 8, "conv_kernel": 4}
FULL_DIM = 16  # full-attention head dim (1 KV head, HEADS query heads)
GDN_TOL = 1e-4  # float32 everywhere (fp32 conv state): step-by-step vs scan, summation order only


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class FullParams:
    wq: jax.Array
    wk: jax.Array
    wv: jax.Array
    wo: jax.Array


def _full_params(rng) -> FullParams:
    def w(n_in, n_out):
        return jnp.asarray(rng.normal(size=(n_in, n_out)) / np.sqrt(n_in), jnp.float32)

    return FullParams(wq=w(HIDDEN, HEADS * FULL_DIM), wk=w(HIDDEN, FULL_DIM), wv=w(HIDDEN, FULL_DIM),
                      wo=w(HEADS * FULL_DIM, HIDDEN))


def _full_qkv(p: FullParams, x, positions):
    """``q [N, HEADS, Dh]``, ``k, v [N, 1, Dh]`` with RoPE (rotate-half) at ``positions``."""
    inv_freq = rope_inv_freq(FULL_DIM)
    n = x.shape[0]
    pos = jnp.clip(positions, 0, None)[None, :]
    q = apply_rope((x @ p.wq).reshape(1, n, HEADS, FULL_DIM), pos, inv_freq)[0]
    k = apply_rope((x @ p.wk).reshape(1, n, 1, FULL_DIM), pos, inv_freq)[0]
    return q, k, (x @ p.wv).reshape(n, 1, FULL_DIM)


def _full_dense(p: FullParams, x):
    """Dense causal attention over ``x [T, HIDDEN]``, no cache."""
    t = x.shape[0]
    q, k, v = _full_qkv(p, x, jnp.arange(t))
    logits = jnp.einsum("thd,sd->ths", q, k[:, 0]) / np.sqrt(FULL_DIM)
    causal = jnp.arange(t)[None, :] <= jnp.arange(t)[:, None]
    weights = jax.nn.softmax(jnp.where(causal[:, None, :], logits, -jnp.inf), axis=-1)
    return jnp.einsum("ths,sd->thd", weights, v[:, 0]).reshape(t, -1) @ p.wo


def test_qwen3_next_schedule_matches_recompute():
    """3 Gated DeltaNet layers + 1 full-attention layer (page size 4), four
    requests; B is released after 12 tokens and D admitted into its slot: D's
    GDN states and pages must start fresh."""
    seed = _seed()
    rng = np.random.default_rng(seed)
    config = HybridConfig(num_kv_heads=1, kv_head_dim=FULL_DIM, kv_dtype=jnp.float32, page_size=4,
                          linear_num_k_heads=GDN_DIMS["num_k_heads"], linear_num_v_heads=GDN_DIMS["num_v_heads"],
                          linear_head_k_dim=GDN_DIMS["head_k_dim"], linear_head_v_dim=GDN_DIMS["head_v_dim"],
                          linear_conv_kernel=GDN_DIMS["conv_kernel"], linear_dtype=jnp.float32)
    schedule = qwen3_next_schedule(4)
    manager = KVCacheManager.create(config, schedule, MAX_REQS, max_context_tokens=64)
    keys = jax.random.split(jax.random.key(seed), 3)
    gdn_params = tuple(gdn.init_params(keys[i], HIDDEN, **GDN_DIMS) for i in range(3))
    full_params = _full_params(rng)
    kinds = [s.kind for s in manager.schemas]
    assert kinds == [AttentionKind.LINEAR] * 3 + [AttentionKind.FULL], kinds

    def body(manager, slots, positions, request_ids, x):
        # Decode only (one token per request): the GDN layer works per batch row.
        x_rows = jnp.zeros((slots.shape[0], HIDDEN), x.dtype).at[request_ids].set(x)
        ys = []
        for layer in range(4):
            handle = manager.acquire(layer, slots, positions, request_ids)
            if layer < 3:
                pool, y = gdn.decode_step(gdn_params[layer], handle.gdn, handle.gdn_layer, handle.request_slots,
                                          x_rows)
                handle, y = handle.replace(gdn=pool), y[request_ids]
            else:
                q, k, v = _full_qkv(full_params, x, handle.positions)
                handle = handle.write_kv(k, v)
                y = handle.attend(q).reshape(x.shape[0], -1) @ full_params.wo
            manager = manager.update(handle)
            ys.append(y)
        return manager, jnp.stack(ys), {}

    def on_release(manager, slot):
        assert (np.asarray(manager.gdn.recurrent_state[:, slot]) == 0).all(), \
            f"seed {seed}: GDN recurrent state of released slot {slot} not zeroed"
        assert (np.asarray(manager.gdn.conv_state[:, slot]) == 0).all(), \
            f"seed {seed}: GDN conv state of released slot {slot} not zeroed"
        assert int(manager.groups["full"].lens[slot]) == 0, f"seed {seed}: pages of slot {slot} not released"

    max_len = 32
    reqs = [Req("A", 0, 30), Req("B", 1, 12, release=True), Req("C", 4, 20), Req("D", 14, 17)]
    inputs = {r.name: rng.normal(size=(max_len, HIDDEN)).astype(np.float32) for r in reqs}
    outs, _, slot_of = _drive(manager, _packed(body, MAX_REQS), MAX_REQS, reqs, inputs, rng, seed,
                              on_release=on_release)
    assert slot_of["D"] == slot_of["B"], slot_of

    def references(xs):
        return ([jax.vmap(lambda x, p=p: gdn.forward_full(p, x))(xs) for p in gdn_params]
                + [jax.vmap(lambda x: _full_dense(full_params, x))(xs)])

    ref = jax.jit(references, compiler_options=_FAST)(jnp.asarray(np.stack([inputs[r.name] for r in reqs])))
    for b, r in enumerate(reqs):
        for layer in range(4):
            np.testing.assert_allclose(
                outs[r.name][layer], np.asarray(ref[layer])[b, : r.total], rtol=GDN_TOL, atol=GDN_TOL,
                err_msg=f"seed {seed}: {r.name} (slot {slot_of[r.name]}), layer {layer} ({kinds[layer].value})")
