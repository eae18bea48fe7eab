"""Load a DeepSeek-V3 checkpoint made by transformers and serve it on the MLA pool.

DeepSeek-V3's attention is multi-head latent attention: per token and layer
the cache keeps one ``kv_lora_rank`` latent plus a shared RoPE key (576
values at real sizes) in :class:`~jaxkv.KVPool`'s MLA mode, and decoding
attends in the latent space (the query absorbed through ``kv_b_proj``) with
the MLA path of :func:`kernels_pallas.paged_attention`. Since those rows are
ordinary paged blocks, everything of the Llama path applies: ``generate``,
``sample_n`` (forked blocks, copy-on-write) and the continuous-batching
engine (``tests/test_nn_qwen3_next_dsv3.py`` forks it). The tokens are
checked against transformers' greedy tokens.

Run: ``python examples/deepseek_v3_checkpoint.py [CHECKPOINT_DIR]``
"""

from __future__ import annotations

import json
import pathlib
import sys

from jaxkv.nn import AutoModelForCausalLM, generate

FIXTURE = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "dsv3" / "small"


def main(path: pathlib.Path = FIXTURE) -> None:
    model = AutoModelForCausalLM.from_pretrained(path)
    c = model.config
    print(f"{type(model).__name__}: {c.num_hidden_layers} layers, MLA rows of {c.kv_lora_rank} + "
          f"{c.qk_rope_head_dim} per token and layer")
    expected = json.loads((path / "expected.json").read_text()) if (path / "expected.json").exists() else None
    prompts = expected["prompts"][:3] if expected else [[3, 17, 42, 5, 9], [7, 7, 1, 30, 2, 11, 4, 8]]
    out = generate(model, prompts, 10)
    for prompt, tokens in zip(prompts, out.tokens):
        print(f"prompt of {len(prompt)} tokens -> {tokens}")
    if expected:
        same = out.tokens == [g[:10] for g in expected["greedy"][:3]]
        print(f"greedy tokens equal transformers': {same}")
        if not same:
            sys.exit(1)


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else FIXTURE)
