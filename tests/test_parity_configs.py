"""Parity over configurations: jaxkv's greedy tokens equal transformers' on
randomly drawn small configurations of the Llama family (Llama, Mistral,
Qwen2, Qwen3), Qwen3-Next and DeepSeek-V3.

The fixtures under ``tests/fixtures/parity/`` were drawn with a fixed seed and
made by transformers 5.24 with ``tests/fixtures/make_parity_configs.py`` (the
table of what each one is: ``tests/fixtures/parity/README.md``; torch is not
needed here). Each holds prompts whose lengths cross that configuration's
sliding windows, the Gated DeltaNet chunk of 64 and pages of 16, and
transformers' greedy continuation (each token the argmax of a full no-cache
forward over the sequence so far, kept only where transformers' cached
``generate`` agrees and every margin is >= 0.05).

Every configuration runs through :func:`jaxkv.nn.generate` (all prompts in one
mixed-length batch: prefill, then the jitted decode loop) and through the
engine (:class:`jaxkv.serve.Engine`, fewer rows than prompts so requests queue,
prompts prefilled in pieces of at most ``PREFILL_CHUNK`` tokens, so chunked
prefill crosses the windows and pages too). The tokens must equal
transformers' exactly.

CI time: the default run takes ONE configuration per family (``DEFAULT``: the
one furthest from the older fixtures); the others are in the ``long`` pass
(the rule in tests/conftest.py; ``pytest -m long``, run by ``.ci/run`` after
the README's command).
"""

from __future__ import annotations

import json
import math
import os

import pytest

from jaxkv.nn import AutoModelForCausalLM, generate
from jaxkv.serve import Engine

ROOT = os.path.join(os.path.dirname(__file__), "fixtures", "parity")
FAMILIES = ("llama", "qwen3_next", "dsv3")
#: The default-run configuration of each family (see the README table):
#: llama_3   Qwen3 with q/k norm, attention_bias, a window of 21 on layers 1-2
#:           only, linear RoPE x8, head_dim 8 != hidden / heads;
#: qwen3_next_2  [linear, full], conv kernel 2, full rotary, 2 -> 4 GDN value
#:           heads, top-3 MoE behind a dense layer 0, attention_bias, tied;
#: dsv3_4    all-MoE (first_k_dense_replace 0), YaRN x40 with truncate False
#:           and mscale without mscale_all_dim, attention_bias, tied.
DEFAULT = {"llama": "llama_3", "qwen3_next": "qwen3_next_2", "dsv3": "dsv3_4"}
PAGE = 16
PREFILL_CHUNK = 40  # engine prefill pieces: prompts longer than this are prefilled in several calls
ENGINE_ROWS = 3


def _names():
    return sorted(n for n in os.listdir(ROOT) if os.path.isdir(os.path.join(ROOT, n)) and n.rsplit("_", 1)[0]
                  in FAMILIES)


NAMES = _names()
_MODELS: dict = {}


def _expected(name):
    with open(os.path.join(ROOT, name, "expected.json"), encoding="utf-8") as f:
        return json.load(f)


def _fixture(name):
    """``(model, expected)``, the model loaded once per module."""
    if name not in _MODELS:
        _MODELS[name] = AutoModelForCausalLM.from_pretrained(os.path.join(ROOT, name)), _expected(name)
    return _MODELS[name]


def test_every_family_has_a_default_and_long_configurations():
    names = NAMES
    for family, default in DEFAULT.items():
        assert default in names
        assert sum(n.rsplit("_", 1)[0] == family for n in names) >= 4, family
    for name in names:
        expected = _expected(name)
        assert len(expected["prompts"]) >= 4 and min(expected["min_margin"]) >= 0.05, name


@pytest.mark.parametrize("name", NAMES)
def test_generate_equals_transformers(name):
    model, expected = _fixture(name)
    out = generate(model, expected["prompts"], expected["max_new_tokens"])
    assert out.tokens == expected["greedy"]


# The engine's default run: Llama's configuration only; Qwen3-Next's and
# DeepSeek-V3's configurations here are in the long pass (tests/conftest.py).
@pytest.mark.parametrize("name", NAMES)
def test_engine_equals_transformers(name):
    model, expected = _fixture(name)
    prompts, new = expected["prompts"], expected["max_new_tokens"]
    longest = max(map(len, prompts)) + new
    if hasattr(model, "make_cache"):  # Qwen3-Next: its hybrid cache
        engine = Engine(model, max_seqs=ENGINE_ROWS, max_context_tokens=longest, prefill_chunk=PREFILL_CHUNK)
    else:
        blocks = math.ceil(longest / PAGE)
        engine = Engine(model, max_seqs=ENGINE_ROWS, page_size=PAGE, max_blocks_per_seq=blocks,
                        num_pages=ENGINE_ROWS * blocks + 1, prefill_chunk=PREFILL_CHUNK)
    ids = [engine.add_request(p, new) for p in prompts]
    engine.run()
    assert [engine.outputs[i] for i in ids] == expected["greedy"]
