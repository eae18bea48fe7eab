"""Every family and the engine on a mesh, in one process and across two
``jax.distributed`` processes, give one device's tokens.

Each case runs ``tests/mesh_worker.py`` in subprocesses (so only they see
several CPU devices): the worker draws prompts from a fresh seed, generates
on one device, then on a ``data x tp`` mesh, through ``generate`` and
through the ``Engine`` (a second round of requests hits the first round's
prefixes), and prints both. Two-process runs start two workers on
localhost (CPU collectives over gloo), each bounded by a timeout and
killed if it outlives it.

CI time: the one-process Llama case runs by default; every other family
and the two-process runs in the long pass (tests/conftest.py; CI runs it too).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from jaxkv._processes import run_processes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = 600


def run_workers(fixture: str, *, processes: int, devices: int, mesh: str, paths: str = "generate,engine",
                speculative: dict | None = None) -> list:
    """The JSON line of every worker process (all started together, all
    waited for, any left over killed)."""
    seed = int(np.random.default_rng().integers(1 << 30))
    extra = [] if speculative is None else ["--speculative", json.dumps(speculative)]
    results = run_processes(["-m", "tests.mesh_worker", fixture, "--mesh", mesh, "--devices", str(devices),
                             "--seed", str(seed), "--paths", paths, *extra], processes, timeout=TIMEOUT, cwd=ROOT,
                            env=dict(os.environ, PYTHONPATH=ROOT))
    for code, _, err in results:
        assert code == 0, f"seed {seed}: worker exited {code}\n{err[-4000:]}"
    return [json.loads(out.strip().splitlines()[-1]) for _, out, _ in results]


def check_same_tokens(results: list, processes: int, devices: int, *, latent_cache: bool = False) -> None:
    assert sorted(r["process"] for r in results) == list(range(processes))
    for r in results:
        assert r["processes"] == processes and r["devices"] == processes * devices
        assert r["sharded"] == r["single"]  # a mesh gives one device's tokens
        assert r["split_params"] > 0  # and really split something
        # the engine's cache stays where cache_sharding puts it (KV heads over tp where they divide; latent
        # caches, MLA pages and DeepSeek-V4's entries and rings, one shared head, replicated by design)
        assert all(r["cache_as_planned"]), r
        assert r["split_cache"] == r["planned_split"], r
        if latent_cache:
            assert all(n == 0 for n in r["split_cache"]), r["split_cache"]
        for path in r["single"].values():
            assert all(len(tokens) > 0 for tokens in path)
    assert all(r["sharded"] == results[0]["sharded"] for r in results)  # every process got every token


ONE_PROCESS = ["parity/llama_0", "dsv3/small", "dsv4/small", "qwen3_next/small", "gpt_oss/small", "gemma3/small"]
TWO_PROCESSES = [name
                 for name in ("parity/llama_0", "qwen3_next/small", "dsv4/small")]


@pytest.mark.parametrize("fixture", ONE_PROCESS)
def test_one_process_eight_devices(fixture):
    check_same_tokens(run_workers(fixture, processes=1, devices=8, mesh="4x2"), 1, 8,
                      latent_cache=fixture.startswith(("dsv3", "dsv4")))


@pytest.mark.parametrize("fixture", TWO_PROCESSES)
def test_two_processes(fixture):
    check_same_tokens(run_workers(fixture, processes=2, devices=2, mesh="2x2"), 2, 2,
                      latent_cache=fixture.startswith("dsv4"))


#: Speculation on a mesh: an early exit over the sharded paged pool (its heads split over tp like the
#: target's), a separate draft model (the target's own checkpoint: every draft kept) with a cache of its own
#: split the same way, and n-gram drafts over Qwen3-Next's checkpoint rows; θ 0, so the rows verify to the end.
SPECULATIVE = {
    "early_exit": ("parity/llama_0", {"method": "draft_model", "draft_layers": 1, "num_speculative_tokens": 3,
                                      "min_accepted_per_step": 0}),
    "separate_draft": ("parity/llama_0", {"method": "draft_model", "num_speculative_tokens": 3,
                                          "model": os.path.join(ROOT, "tests", "fixtures", "parity", "llama_0"),
                                          "min_accepted_per_step": 0}),
    "ngram_hybrid": ("qwen3_next/small", {"num_speculative_tokens": 3, "min_accepted_per_step": 0}),
}


@pytest.mark.parametrize("case", sorted(SPECULATIVE))
def test_a_speculating_engine_on_a_mesh(case):
    """A speculating engine on a 4x2 mesh gives one device's tokens (both
    speculating, so each draft's acceptance is the same decision), with
    the same drafts verified and kept; a separate draft's cache is placed
    as the target's and keeps every draft of the target's own weights."""
    fixture, config = SPECULATIVE[case]
    results = run_workers(fixture, processes=1, devices=8, mesh="4x2", paths="engine", speculative=config)
    check_same_tokens(results, 1, 8)
    single, sharded = results[0]["drafts"]
    if case == "separate_draft":
        # The target's own checkpoint: its cache is planned as the target's (the same leaves split).
        assert single[0] == single[1] and results[0]["draft_split"] == [[results[0]["split_cache"][0], True]], \
            results[0]
    assert single == sharded and single[0] > 0, results[0]["drafts"]
