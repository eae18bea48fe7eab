"""Tiny GGUF files for the tests, written with ggml's own ``gguf.GGUFWriter``.

``write_llama_gguf`` writes a jaxkv ``LlamaForCausalLM`` as llama.cpp's
converter (``convert_hf_to_gguf.py``, ``LlamaModel``) would: the ``llama.*``
metadata, tensors under GGUF names, and the rows of ``attn_q`` / ``attn_k``
permuted for llama.cpp's RoPE (``reshape(heads, 2, head_dim // 2, ...)
.swapaxes(1, 2)``, KV heads for k). ``tiny_vocab`` is a byte-level BPE
vocabulary (256 byte symbols, merges that build whole and partial multi-byte
characters, two control tokens) to go with it.
"""

from __future__ import annotations

import numpy as np

# transformers name (with {i} for the layer) -> GGUF name, written out here
# independently of jaxkv.nn.gguf's table.
HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "model.layers.{i}.input_layernorm.weight": "blk.{i}.attn_norm.weight",
    "model.layers.{i}.self_attn.q_proj.weight": "blk.{i}.attn_q.weight",
    "model.layers.{i}.self_attn.k_proj.weight": "blk.{i}.attn_k.weight",
    "model.layers.{i}.self_attn.v_proj.weight": "blk.{i}.attn_v.weight",
    "model.layers.{i}.self_attn.o_proj.weight": "blk.{i}.attn_output.weight",
    "model.layers.{i}.post_attention_layernorm.weight": "blk.{i}.ffn_norm.weight",
    "model.layers.{i}.mlp.gate_proj.weight": "blk.{i}.ffn_gate.weight",
    "model.layers.{i}.mlp.up_proj.weight": "blk.{i}.ffn_up.weight",
    "model.layers.{i}.mlp.down_proj.weight": "blk.{i}.ffn_down.weight",
}

CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant: {% endif %}")
WORDS = ["hello", " world", " the", "中文", "日本", "é", "ü", "😀", "👍", "🇫🇷", " a", "ing", "\n\n"]


def gguf_name(hf: str) -> str:
    parts = hf.split(".")
    if parts[:2] == ["model", "layers"]:
        key = ".".join(["model", "layers", "{i}", *parts[3:]])
        return HF_TO_GGUF[key].format(i=parts[2])
    return HF_TO_GGUF[hf]


def permute_for_llama_cpp(w: np.ndarray, heads: int) -> np.ndarray:
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_vocab():
    """``(tokens, merges, token_types)``: the 256 byte symbols of byte-level
    BPE, then merged tokens for WORDS built left to right (so the vocabulary
    holds pieces that split characters, like the first two bytes of 中),
    then control tokens ``<s>`` and ``</s>``."""
    from jaxkv.text import bytes_to_unicode

    spell = bytes_to_unicode()
    tokens = [spell[b] for b in range(256)]
    merges = []
    seen = set(tokens)
    for word in WORDS:
        symbols = [spell[b] for b in word.encode("utf-8")]
        acc = symbols[0]
        for s in symbols[1:]:
            merged = acc + s
            if merged not in seen:
                merges.append(f"{acc} {s}")
                tokens.append(merged)
                seen.add(merged)
            acc = merged
    types = [1] * len(tokens) + [3, 3]
    tokens += ["<s>", "</s>"]
    return tokens, merges, types


def write_llama_gguf(path, model, *, arch: str = "llama", qtype: str = "F32", tokenizer: bool = True,
                     tokenizer_model: str = "gpt2", extra: dict | None = None, permute: bool = True) -> dict:
    """Write ``model`` (a jaxkv LlamaForCausalLM) to GGUF file ``path``;
    2-D weights stored as ``qtype`` (``F32``, ``F16`` or ``Q8_0``), norms
    F32. Returns the transformers-named float32 arrays a loader must give back
    (the quantization round trip applied)."""
    import gguf

    c = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_dimension_count(c.head_dim)
    w.add_rope_freq_base(c.rope_theta)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    if tokenizer:
        tokens, merges, types = tiny_vocab()
        w.add_tokenizer_model(tokenizer_model)
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(len(tokens) - 2)
        w.add_eos_token_id(len(tokens) - 1)
        w.add_add_bos_token(True)
        w.add_chat_template(CHAT_TEMPLATE)
    expected = {}
    qt = getattr(gguf.GGMLQuantizationType, qtype)
    for hf, arr in model.hf_state_dict().items():
        arr = np.asarray(arr, np.float32)
        name = gguf_name(hf)
        stored = arr
        if permute and ".attn_q." in name:
            stored = permute_for_llama_cpp(arr, c.num_attention_heads)
        elif permute and ".attn_k." in name:
            stored = permute_for_llama_cpp(arr, c.num_key_value_heads)
        if arr.ndim == 2 and qtype != "F32":
            data = gguf.quants.quantize(stored, qt)
            w.add_tensor(name, data, raw_dtype=qt)
            back = gguf.quants.dequantize(gguf.quants.quantize(arr, qt), qt).astype(np.float32)
        else:
            w.add_tensor(name, np.ascontiguousarray(stored))
            back = arr
        expected[hf] = back
    for name, arr in (extra or {}).items():
        w.add_tensor(name, np.asarray(arr, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected
