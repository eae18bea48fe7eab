"""DeepSeek-V4 against transformers on randomly drawn configurations.

``tests/fixtures/parity/dsv4_<k>/`` were drawn by
``tests/fixtures/make_parity_dsv4.py`` (one fixed seed: layer orders with
leading CSA/HCA layers, compress rates, windows, partial rotary factors,
all-RoPE indexers, ``hc_mult``, ``o_groups``, indexer heads / dims / top-k,
hash layers, MoE settings, YaRN) with transformers' greedy tokens on prompts
whose lengths straddle every window and compression boundary. Each
configuration runs through ``generate`` (all prompts in one batch) and the
engine (prompts arriving together, decoded in chunks, prefilled in pieces),
and both must give transformers' tokens exactly.

The README's test command runs the configurations in ``DEFAULT``; the others
are in the ``long`` pass (the rule in tests/conftest.py; ``.ci/run`` runs it
after the README's command): each configuration is its own set of compiled
programs.
"""

from __future__ import annotations

import glob
import json
import os

import pytest

from jaxkv.nn import AutoModelForCausalLM, generate
from jaxkv.serve import Engine

PARITY = os.path.join(os.path.dirname(__file__), "fixtures", "parity")
CONFIGS = sorted(os.path.basename(p) for p in glob.glob(os.path.join(PARITY, "dsv4_*")))
#: None by default (CI time: DeepSeek-V4 meets transformers by default in
#: test_nn_deepseek_v4); every drawn configuration runs in the long pass.
DEFAULT: list[str] = []


def _load(name):
    path = os.path.join(PARITY, name)
    with open(os.path.join(path, "expected.json"), encoding="utf-8") as f:
        return AutoModelForCausalLM.from_pretrained(path), json.load(f)


def test_the_drawn_configurations_are_there():
    assert len(CONFIGS) >= 10, CONFIGS
    for name in CONFIGS:
        with open(os.path.join(PARITY, name, "expected.json"), encoding="utf-8") as f:
            expected = json.load(f)
        assert len(expected["prompts"]) >= 2 and min(expected["min_margin"]) >= 0.05, name


@pytest.mark.parametrize("name", CONFIGS)
def test_generate_and_engine_give_transformers_tokens(name):
    model, expected = _load(name)
    prompts, want, n_new = expected["prompts"], expected["greedy"], expected["max_new_tokens"]
    out = generate(model, prompts, n_new)
    for i, tokens in enumerate(out.tokens):
        assert list(map(int, tokens)) == want[i], f"{name}: generate, prompt {i} (length {len(prompts[i])})"
    longest = max(len(p) for p in prompts) + n_new
    engine = Engine(model, max_seqs=2, max_context_tokens=512 if longest > 256 else 256, decode_chunk=4,
                    prefill_chunk=64)
    ids = [engine.add_request(p, n_new) for p in prompts]
    engine.run()
    for i, rid in enumerate(ids):
        assert engine.outputs[rid] == want[i], f"{name}: engine, prompt {i} (length {len(prompts[i])})"
