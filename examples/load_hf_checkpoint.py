"""Load a local Hugging Face checkpoint directory (config.json +
*.safetensors + tokenizer.json) and generate text.

    python examples/load_hf_checkpoint.py [DIR]

Without DIR it first writes a small random checkpoint in the Hugging Face
layout (two safetensors shards and a word-level tokenizer) to a temporary
directory, so the example runs anywhere; point it at a real Llama / Mistral /
Qwen2 / Qwen3 checkpoint to see real text.
"""

import os
import sys
import tempfile

from flax import nnx
from tokenizers import Tokenizer, models, pre_tokenizers

from jaxkv.nn import LlamaConfig, LlamaForCausalLM, generate


def write_demo_checkpoint(path: str) -> None:
    words = "the a cache page block token key value query paged radix tree shared prefix".split()
    vocab = {"<unk>": 0, "<eos>": 1, **{w: i + 2 for i, w in enumerate(words)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(os.path.join(path, "tokenizer.json"))
    config = LlamaConfig.from_hf(dict(
        model_type="llama", vocab_size=len(vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-6, rope_theta=10000.0,
        max_position_embeddings=256, tie_word_embeddings=False, eos_token_id=1))
    LlamaForCausalLM(config, rngs=nnx.Rngs(0)).save_pretrained(path, num_shards=2)


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else tempfile.mkdtemp()
    if len(sys.argv) == 1:
        write_demo_checkpoint(path)
        print(f"wrote a random checkpoint to {path}: {sorted(os.listdir(path))}")
    model = LlamaForCausalLM.from_pretrained(path)
    tokenizer = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    eos = model.config.eos_token_id[0] if model.config.eos_token_id else None
    prompts = ["the paged cache", "a radix tree of shared prefix"]
    ids = [tokenizer.encode(text).ids for text in prompts]
    out = generate(model, ids, 16, eos_token_id=eos, page_size=16)
    for text, tokens in zip(prompts, out.tokens):
        print(f"{text!r} -> {tokenizer.decode(tokens)!r}")


if __name__ == "__main__":
    main()
