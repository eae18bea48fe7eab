"""The interleaved window families (Gemma 3, gpt-oss) with their layers under
one ``lax.scan`` (:mod:`jaxkv.nn.scan`, issue 41 item 1) against the same
model unrolled, built from the same seed (equal weights): configurations
drawn at random around the transformers fixtures' (layer counts, window
patterns, windows), then the same greedy tokens through the ring cache and
the paged one, dense logits equal to float32 summation order, and
checkpoints saved under the same names and loaded back.

The window rings of every window layer are one stacked cache
(:class:`~jaxkv.pool.window.WindowLayerCache`), reached by a traced layer
index under the scan: a decode step still scatters into it in place
(``tests/test_window_cache.py``)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from flax import nnx

from jaxkv.nn import Gemma3ForCausalLM, GptOssForCausalLM
from jaxkv.nn.checkpoint import read_config
from jaxkv.nn.gemma3_config import Gemma3Config
from jaxkv.nn.gpt_oss_config import GptOssConfig
from tests.util import assert_scanned_is_unrolled

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


def _gemma3_config(rng) -> Gemma3Config:
    """The fixture's config with a drawn depth and window pattern (every
    ``k``-th layer global, ``k`` in 2..6) and window."""
    base = Gemma3Config.from_hf(read_config(os.path.join(FIXTURES, "gemma3", "small")))
    layers, k = int(rng.integers(4, 14)), int(rng.integers(2, 7))
    types = tuple("full_attention" if (i + 1) % k == 0 else "sliding_attention" for i in range(layers))
    if all(t == "sliding_attention" for t in types):
        types = types[:-1] + ("full_attention",)
    return base.replace(num_hidden_layers=layers, layer_types=types, sliding_window=int(rng.integers(3, 9)))


def _gpt_oss_config(rng) -> GptOssConfig:
    """The fixture's config with a drawn depth, alternation phase and window."""
    base = GptOssConfig.from_hf(read_config(os.path.join(FIXTURES, "gpt_oss", "small")))
    layers, phase = int(rng.integers(4, 12)), int(rng.integers(0, 2))
    types = tuple("sliding_attention" if (i + phase) % 2 == 0 else "full_attention" for i in range(layers))
    return base.replace(num_hidden_layers=layers, layer_types=types, sliding_window=int(rng.integers(3, 9)))


FAMILIES = {"gemma3": (Gemma3ForCausalLM, _gemma3_config), "gpt_oss": (GptOssForCausalLM, _gpt_oss_config)}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_scanned_interleaved_model_is_the_unrolled_one(family, tmp_path):
    rng = np.random.default_rng()
    cls, draw = FAMILIES[family]
    config = draw(rng)
    seed = int(rng.integers(1 << 20))
    scanned = cls(config, rngs=nnx.Rngs(seed))
    unrolled = cls(config, rngs=nnx.Rngs(seed), scan_layers=False)
    signatures = [config.is_sliding(i) for i in range(config.num_hidden_layers)]
    prompts = [rng.integers(1, config.vocab_size, int(rng.integers(3, 25))).tolist() for _ in range(3)]
    assert_scanned_is_unrolled(scanned, unrolled, signatures, rng, tmp_path, dense_tokens=23, prompts=prompts,
                               new_tokens=7, generate_kws=({}, {"prefill_chunk_size": 5}))
