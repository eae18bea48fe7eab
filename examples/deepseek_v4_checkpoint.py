"""Load a DeepSeek-V4 checkpoint made by transformers and decode it through jaxkv's hybrid cache.

The checkpoint is the tiny random one the tests use
(``tests/fixtures/dsv4/small``: 5 layers, sliding window / CSA / HCA
attention, hash and top-k MoE, saved by transformers 5.23 with its
DeepSeek on-disk names). ``AutoModelForCausalLM`` picks the family from
``config.json``; ``generate`` prefills the prompts (here 6 tokens per
request per call), then decodes in one jitted loop, allocating compressed
-entry blocks on device and releasing each request's blocks when it stops.
The tokens are compared with transformers' own greedy tokens, stored beside
the checkpoint.

Run: ``python examples/deepseek_v4_checkpoint.py [CHECKPOINT_DIR]``
"""

from __future__ import annotations

import json
import pathlib
import sys

from jaxkv.nn import AutoModelForCausalLM, generate

FIXTURE = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "dsv4" / "small"


def main(path: pathlib.Path = FIXTURE) -> None:
    model = AutoModelForCausalLM.from_pretrained(path)
    config = model.config
    print(f"{type(model).__name__}: {config.num_hidden_layers} layers {list(config.layer_types)}, "
          f"window {config.sliding_window}, compress rates {config.compress_rates}")
    expected_file = path / "expected.json"
    if expected_file.exists():
        expected = json.loads(expected_file.read_text())
        prompts, want = expected["prompts"][1:4], [g[:12] for g in expected["greedy"][1:4]]
    else:
        prompts, want = [[3, 17, 42, 5, 9], [7, 7, 1, 30, 2, 11, 4, 8]], None
    out = generate(model, prompts, 12, prefill_chunk_size=6)
    for prompt, tokens in zip(prompts, out.tokens):
        print(f"prompt of {len(prompt)} tokens -> {tokens}")
    manager = out.state.manager
    print(f"cache: {manager.memory_bytes() / 2**20:.2f} MiB in {len(manager.groups)} block groups "
          f"{sorted(manager.groups)}; peak blocks in use {int(out.state.peak_used)}, "
          f"after the loop {int(manager.blocks_in_use)}")
    if want is not None:
        same = out.tokens == want
        print(f"greedy tokens equal transformers': {same}")
        if not same:
            sys.exit(1)


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else FIXTURE)
