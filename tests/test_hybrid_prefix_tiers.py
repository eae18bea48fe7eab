"""The hybrid prefix cache on the engine, past what the device keeps.

With ``host_prefix_memory``, a snapshot record the device drops (its row
wanted by the retention policy, or its page evicted) is copied to host
memory whole and brought back for a later request: the hit is as long as
the record, the tokens are those of a cold run, and every block reference
comes back.

The cold reference is the same engine in a namespace of its own (nothing
shared), itself checked against transformers in ``test_engine_families``.
"""

from __future__ import annotations

import itertools
import json
import os

import numpy as np
import pytest

from jaxkv.nn import AutoModelForCausalLM
from jaxkv.serve import Engine
from tests.test_fuzz_engine_hybrid import check_hybrid_no_leak

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


def _fixture(name):
    path = os.path.join(FIXTURES, name)
    with open(os.path.join(path, "expected.json"), encoding="utf-8") as f:
        return AutoModelForCausalLM.from_pretrained(path), json.load(f)


# DeepSeek-V4: every group's blocks and its rings through the host tier.
@pytest.mark.parametrize("name", ["dsv4/small"])
def test_a_prefix_dropped_to_host_comes_back_exact(name):
    model, expected = _fixture(name)
    engine = Engine(model, max_seqs=2, max_context_tokens=512, decode_chunk=4, prefill_chunk=64, num_snapshots=2,
                    host_prefix_memory=1 << 26)
    # The fixture's prompts first: transformers' tokens with the host tier on.
    ids = [engine.add_request(p, expected["max_new_tokens"], namespace="fixture") for p in expected["prompts"]]
    engine.run()
    assert [engine.outputs[i] for i in ids] == expected["greedy"]
    rng = np.random.default_rng()
    vocab = model.config.vocab_size
    fresh = itertools.count()
    first = rng.integers(1, vocab, int(rng.integers(140, 200))).tolist()  # past one 128-token page
    engine.add_request(first, 4, namespace="shared")
    engine.run()
    for _ in range(3):  # other traffic takes both snapshot rows: the first prompt's records go to host
        engine.add_request(rng.integers(1, vocab, 40).tolist(), 2, namespace=("other", next(fresh)))
        engine.run()
    assert engine.cache.host_stored_tokens >= len(first) - 1
    extended = first + rng.integers(1, vocab, 9).tolist()
    rid = engine.add_request(extended, 6, namespace="shared")
    engine.run()
    assert engine.cache.host_loaded_tokens >= len(first) - 1
    assert engine.cached_tokens(rid) == len(first) - 1  # the prompt-end record, at token grain
    cold = engine.add_request(extended, 6, namespace=("cold", next(fresh)))
    engine.run()
    assert engine.outputs[rid] == engine.outputs[cold]
    check_hybrid_no_leak(engine)


def test_three_host_hits_in_one_admission_with_one_snapshot_row():
    """One snapshot row, three conversations continued together: their
    turn ends wait on host; each continuation's is loaded at admission into
    blocks the admission counted, its state written straight into its slot
    (then kept on the device again as the row allows, pushing the previous
    one back to host). Every continuation hits its whole previous turn and
    gives the cold run's tokens."""
    model, _ = _fixture("qwen3_next/small")
    engine = Engine(model, max_seqs=3, max_context_tokens=256, decode_chunk=4, prefill_chunk=32, num_snapshots=1,
                    host_prefix_memory=1 << 26)
    rng = np.random.default_rng()
    vocab = model.config.vocab_size
    prompts = [rng.integers(1, vocab, int(rng.integers(20, 50))).tolist() for _ in range(3)]
    ids = [engine.add_request(p, 5, namespace="chat") for p in prompts]
    engine.run()
    turns = [p + engine.outputs[i] + rng.integers(1, vocab, 7).tolist() for p, i in zip(prompts, ids)]
    ids = [engine.add_request(t, 5, namespace="chat") for t in turns]
    engine.run()
    assert [engine.cached_tokens(i) for i in ids] == [len(p) + 5 - 1 for p in prompts]
    cold = [engine.add_request(t, 5, namespace=("cold", n)) for n, t in enumerate(turns)]
    engine.run()
    assert [engine.outputs[i] for i in ids] == [engine.outputs[i] for i in cold]
    check_hybrid_no_leak(engine)
