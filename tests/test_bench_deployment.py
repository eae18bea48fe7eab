"""jaxkv.bench.deployment against a hand computation from Llama-3.1-70B's
published config.json (80 layers, hidden 8192, MLP 28672, 64 query / 8 KV
heads of 128 dims, vocabulary 128256, untied LM head), bf16 throughout."""

import pytest

from jaxkv.bench.deployment import CONTEXT, H100_BYTES, USABLE, deployment_rows

LAYERS, HIDDEN, MLP, KV_HEADS, HEAD_DIM, VOCAB = 80, 8192, 28672, 8, 128, 128256
KV_BYTES_PER_TOKEN = LAYERS * KV_HEADS * HEAD_DIM * 2 * 2  # K and V, 2 bytes each
EMBED = VOCAB * HIDDEN
NORMS = LAYERS * 2 * HIDDEN + HIDDEN
PARAMS = (2 * EMBED + NORMS  # embeddings, LM head, norms
          + LAYERS * (2 * HIDDEN * HIDDEN + 2 * HIDDEN * KV_HEADS * HEAD_DIM + 3 * HIDDEN * MLP))


@pytest.fixture(scope="module")
def rows():
    return {r["mesh"]: r for r in deployment_rows(models=("Llama-3.1-70B",))}


def test_llama_70b_by_hand(rows):
    assert KV_BYTES_PER_TOKEN == 327_680
    assert PARAMS == 70_553_706_496  # "70.6B"
    assert set(rows) == {"tp=1", "tp=8", "tp=16"}  # the four-node and expert meshes are for the MoE giants

    one = rows["tp=1"]
    assert one["params_b"] * 1e9 == pytest.approx(PARAMS, rel=1e-12)
    assert one["weights_gb"] * 1e9 == pytest.approx(2 * PARAMS, rel=1e-12)
    assert one["kv_gb"] * 1e9 == pytest.approx(KV_BYTES_PER_TOKEN * CONTEXT, rel=1e-12)  # 42.9 GB
    assert one["seqs"] == 0  # 141 GB of weights: nothing fits in 72 GB

    # tp=8: every projection and the LM head split 8 ways; the embedding table and the norms whole.
    tp8 = rows["tp=8"]
    weights = 2 * (EMBED + NORMS + (PARAMS - EMBED - NORMS) / 8)
    assert tp8["weights_gb"] * 1e9 == pytest.approx(weights, rel=1e-9)
    assert 2 * PARAMS / 8 < weights < 2 * PARAMS / 8 + 2 * EMBED
    assert tp8["kv_bytes_per_token"] == pytest.approx(KV_BYTES_PER_TOKEN / 8, rel=1e-12)  # one KV head each
    assert tp8["kv_split"] == 1.0 and tp8["notes"] == ""
    assert tp8["seqs"] == int((USABLE * H100_BYTES - weights) // (KV_BYTES_PER_TOKEN * CONTEXT / 8)) == 9

    # tp=16: 8 KV heads do not divide 16, so every device keeps the whole cache.
    tp16 = rows["tp=16"]
    assert tp16["kv_bytes_per_token"] == pytest.approx(KV_BYTES_PER_TOKEN, rel=1e-12)
    assert tp16["kv_split"] == 0.0 and "8 KV heads, tp=16" in tp16["notes"]
    assert tp16["seqs"] == 1
