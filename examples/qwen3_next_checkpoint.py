"""Load a Qwen3-Next checkpoint made by transformers and decode it through jaxkv's hybrid cache.

Qwen3-Next mixes Gated DeltaNet layers (a fixed-size recurrent state per
request, no K/V per token) with gated full-attention layers (paged K/V). The
model's ``make_cache`` builds one :class:`~jaxkv.KVCacheManager` holding both:
the attention layers' pages in its ``full`` group, the linear layers'
conv and recurrent states in its ``GDNPool``. ``generate`` prefills in chunks
(the chunked form of the delta rule), then decodes one token per step (the
recurrent form) in one jitted loop. The tokens are checked against
transformers' greedy tokens stored beside the checkpoint.

Run: ``python examples/qwen3_next_checkpoint.py [CHECKPOINT_DIR]``
"""

from __future__ import annotations

import json
import pathlib
import sys

from jaxkv.nn import AutoModelForCausalLM, generate

FIXTURE = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "qwen3_next" / "small"


def main(path: pathlib.Path = FIXTURE) -> None:
    model = AutoModelForCausalLM.from_pretrained(path)
    c = model.config
    print(f"{type(model).__name__}: layers {list(c.layer_types)}")
    expected = json.loads((path / "expected.json").read_text()) if (path / "expected.json").exists() else None
    prompts = expected["prompts"][:3] if expected else [[3, 17, 42, 5, 9], [7, 7, 1, 30, 2, 11, 4, 8]]
    out = generate(model, prompts, 10, prefill_chunk_size=8)
    for prompt, tokens in zip(prompts, out.tokens):
        print(f"prompt of {len(prompt)} tokens -> {tokens}")
    gdn = out.state.manager.gdn
    per_request = (gdn.recurrent_state.nbytes + gdn.conv_state.nbytes) // gdn.pool_size
    print(f"Gated DeltaNet state per request: {per_request} bytes over {gdn.num_gdn_layers} linear layers "
          f"(independent of length); full-attention blocks in use after the loop: "
          f"{int(out.state.manager.blocks_in_use)}")
    if expected:
        same = out.tokens == [g[:10] for g in expected["greedy"][:3]]
        print(f"greedy tokens equal transformers': {same}")
        if not same:
            sys.exit(1)


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else FIXTURE)
