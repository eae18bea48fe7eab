"""DeepSeek-V4 with its decoder layers under one ``lax.scan`` (issue 41 item
1, :mod:`jaxkv.nn.scan`) against the same model unrolled, built from the
same seed (equal weights): configurations drawn at random around the
transformers fixture's (``tests/fixtures/dsv4/small``: leading hash-routed
layers, then a repeating pattern of SWA / CSA / HCA layers, compression
rates, windows, indexer top-k), the same greedy tokens through the hybrid
cache (whole prompts and prefill chunks, lossless and fp8 entries), dense
logits equal to float32 summation order, and checkpoints saved under the
same names and loaded back.

The cache follows the layers: the SWA / CSA / HCA arrays of one store class
are one stacked :class:`~jaxkv.pool.compressed.CompressedLayerCache`
reached by the scan's traced index, so a donated decode step still scatters
into every store in place (no pool-sized copy, checked on the compiled HLO).
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxkv.manager.hybrid import v4_layout
from jaxkv.nn.checkpoint import read_config
from jaxkv.nn.deepseek_v4 import DeepseekV4ForCausalLM
from jaxkv.nn.deepseek_v4_config import DeepseekV4Config
from tests.util import assert_scanned_is_unrolled, pool_sized_copies, pool_sized_updates

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "dsv4", "small")
SWA, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


def _config(rng, wide: bool = True) -> DeepseekV4Config:
    """The fixture's config with a drawn schedule: 0 to 2 leading hash-routed
    layers (of drawn kinds), then a pattern of 1 to 3 SWA / CSA / HCA layers
    repeated 2 or 3 times (not ``wide``: at most 1 leading layer, a pattern
    of at most 2 repeated twice); a drawn window, HCA rate and indexer
    top-k."""
    base = DeepseekV4Config.from_hf(read_config(FIXTURE))
    kinds = (SWA, CSA, HCA)
    head = [kinds[int(k)] for k in rng.integers(0, 3, int(rng.integers(0, 3 if wide else 2)))]
    pattern = [kinds[int(k)] for k in rng.integers(0, 3, int(rng.integers(1, 4 if wide else 3)))]
    if pattern == [SWA]:  # the pattern compresses something: the cache's stores under the scan include entries
        pattern = [CSA]
    types = tuple(head + pattern * int(rng.integers(2, 4 if wide else 3)))
    mlp = tuple(["hash_moe"] * len(head) + ["moe"] * (len(types) - len(head)))
    return base.replace(num_hidden_layers=len(types), layer_types=types, mlp_layer_types=mlp,
                        sliding_window=int(rng.choice([4, 8, 16])),
                        compress_rates=(4, int(rng.choice([8, 16]))), index_topk=int(rng.integers(2, 6)))


def _models(rng, wide: bool = True):
    config = _config(rng, wide)
    seed = int(rng.integers(1 << 20))
    return (config, DeepseekV4ForCausalLM(config, rngs=nnx.Rngs(seed)),
            DeepseekV4ForCausalLM(config, rngs=nnx.Rngs(seed), scan_layers=False))


def _scanned_is_unrolled(tmp_path, generate_kws, wide: bool) -> None:
    rng = np.random.default_rng()
    config, scanned, unrolled = _models(rng, wide)
    signatures = [(config.layer_types[i], config.mlp_layer_types[i]) for i in range(config.num_hidden_layers)]
    prompts = [rng.integers(2, config.vocab_size, int(rng.integers(3, 22))).tolist() for _ in range(2)]
    assert_scanned_is_unrolled(scanned, unrolled, signatures, rng, tmp_path, dense_tokens=29, prompts=prompts,
                               new_tokens=6, generate_kws=generate_kws)


def test_a_scanned_deepseek_v4_is_the_unrolled_one(tmp_path):
    """A smaller drawn schedule; whole prompts, lossless entries (the
    chunked fp8 run and the longer schedules in the wide twin)."""
    _scanned_is_unrolled(tmp_path, ({},), wide=False)


def test_a_scanned_deepseek_v4_is_the_unrolled_one_wide(tmp_path):
    """Another drawn schedule, with prefill chunks of 5 and fp8 entries too."""
    _scanned_is_unrolled(tmp_path, ({}, {"prefill_chunk_size": 5, "entry_format": "fp8"}), wide=True)


def test_the_cache_stacks_the_layers_of_one_store_class():
    """Layers of one kind and ratio are rows of one store; acquiring a layer
    by a traced index (as the scan does) gives its row."""
    config = _config(np.random.default_rng(0)).replace(
        num_hidden_layers=5, layer_types=(SWA, CSA, HCA, CSA, HCA), mlp_layer_types=("hash_moe",) + ("moe",) * 4)
    model = DeepseekV4ForCausalLM(config, rngs=nnx.Rngs(0))
    manager = model.make_cache(2, 64)
    classes, store, row = v4_layout(manager.schemas)
    assert [s.kind.value for s in classes] == ["swa", "csa", "hca"]
    assert (store, row) == ((0, 1, 2, 1, 2), (0, 0, 0, 1, 1))
    assert [c.num_layers for c in manager.v4_stores] == [1, 2, 2]
    assert len(manager.write_epochs) == 3 + 4
    layer = jax.jit(lambda m, i: m.acquire(i, jnp.asarray([1]), jnp.asarray([0]), like=1).cache_layer)
    assert int(layer(manager, 3)) == 1 and int(layer(manager, 1)) == 0


def _decode_step_hlo(model, manager):
    def step(manager, tokens, slots, starts):
        logits, manager = model(tokens, manager, slots, starts, jnp.ones_like(slots))
        return logits, manager

    slots = jnp.arange(1, 5, dtype=jnp.int32)
    manager, _, _ = manager.admit(4, max_n=4)
    manager, starts, _ = manager.reserve(slots, jnp.full((4,), 37), max_new_tokens=64)
    manager, starts, _ = manager.reserve(slots, jnp.ones((4,), jnp.int32), max_new_tokens=1)
    tokens = jnp.ones((4, 1), jnp.int32)
    return jax.jit(step, donate_argnums=0).lower(manager, tokens, slots, starts).compile().as_text()


def test_a_scanned_decode_step_updates_the_cache_in_place():
    """A donated decode step through a scanned DeepSeek-V4 (fp8 entries, two
    CSA and two HCA layers under the scan) scatters into every store and
    copies none of it, nor any layer's slice of it. The stores are sized
    well above any activation of the step, so a copy cannot hide."""
    config = DeepseekV4Config.from_hf(read_config(FIXTURE)).replace(
        num_hidden_layers=5, layer_types=(SWA, CSA, HCA, CSA, HCA), mlp_layer_types=("hash_moe",) + ("moe",) * 4,
        sliding_window=64)
    model = DeepseekV4ForCausalLM(config, rngs=nnx.Rngs(0))
    assert model.layers.reps == 2
    manager = model.make_cache(6, 2048, entry_format="fp8")
    hlo = _decode_step_hlo(model, manager)
    leaves = [a for a in jax.tree.leaves(manager.v4_stores) if a.size]  # the indexer keys' RoPE part is 0 wide
    stacked = [a for a in leaves if a.shape[0] == 2]  # the scanned CSA and HCA stores
    shapes = [a.shape for a in leaves] + [a.shape[1:] for a in stacked]
    assert pool_sized_updates(hlo, min(a.nbytes for a in stacked)) >= 4
    copies = pool_sized_copies(hlo, min_bytes=min(a.nbytes // 2 for a in leaves), shapes=shapes)
    assert not copies, "a donated decode step copies a store:\n" + "\n".join(line[:300] for line in copies)


def test_scanned_and_unrolled_caches_are_equal():
    """One prefill step through the cache leaves the same stores whichever
    way the layers ran (the scanned model writes each layer's row)."""
    rng = np.random.default_rng()
    config, scanned, unrolled = _models(rng)
    model = scanned
    manager = model.make_cache(2, 64)
    manager, slots, _ = manager.admit(2, max_n=2)
    manager, starts, _ = manager.reserve(slots, jnp.asarray([9, 5]), max_new_tokens=9)
    tokens = jnp.asarray(rng.integers(2, config.vocab_size, (2, 9)), jnp.int32)
    _, got = jax.jit(model)(tokens, manager, slots, starts, jnp.asarray([9, 5], jnp.int32))
    _, want = jax.jit(unrolled)(tokens, manager, slots, starts, jnp.asarray([9, 5], jnp.int32))
    for x, y in zip(jax.tree.leaves(got.v4_stores), jax.tree.leaves(want.v4_stores), strict=True):
        np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=1e-5, atol=1e-5)
