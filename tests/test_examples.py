"""Every script in examples/ runs to completion (so none rots) and prints
what it promises."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"
EXPECTED = {  # a line each example must print
    "paged_generation.py": "KV blocks free after the loop: 21 of 21",
    "fork_sampling_beam.py": "3 beams:",
    "load_hf_checkpoint.py": "wrote a random checkpoint",
    "continuous_batching.py": "prefix hit rate",
    "swap_under_pressure.py": "recompute: 0 swaps",
    "hybrid_cache.py": "KV bytes per token of a 128k-token request",
    "deepseek_v4_checkpoint.py": "greedy tokens equal transformers': True",
    "qwen3_next_checkpoint.py": "greedy tokens equal transformers': True",
    "deepseek_v3_checkpoint.py": "greedy tokens equal transformers': True",
    "online_engine.py": "#1 [abort]:",
    "openai_client.py": "server stopped",
}


def test_every_example_is_listed():
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(EXPECTED)


# Six of them run in the long pass (tests/conftest.py).
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_example_runs(name):
    done = subprocess.run([sys.executable, str(EXAMPLES / name)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert EXPECTED[name] in done.stdout, done.stdout[-2000:]
