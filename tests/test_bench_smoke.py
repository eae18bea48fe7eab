"""The benchmarks run end to end (quick mode) and end with their JSON line.
Timings are not asserted: they belong to ``python -m jaxkv.bench``."""

import json

import pytest

from jaxkv.bench.__main__ import main


# ``serve`` (two schedulers on two families, ~55 s), ``decode``, ``hybrid`` and ``memory`` run in the long
# pass (tests/conftest.py).
@pytest.mark.parametrize("name", ["alloc", "pool", "prefix", "decode", "hybrid", "serve", "memory", "kernels",
                                  "scaling", "compile_depth", "spec", "structured", "sampler"])
def test_benchmark_runs_and_prints_json(name, capsys, tmp_path):
    if name == "structured":  # SmolLM2's tokenizer
        from jaxkv.nn.gguf import SMOLLM2_INSTALL, find_smollm2

        if find_smollm2() is None:
            pytest.skip(SMOLLM2_INSTALL)
    plot = tmp_path / "plot.png"
    assert main([name, "--quick", "--json", "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    payload = json.loads(out.strip().splitlines()[-1])
    assert payload["benchmark"] == name and payload["results"]
    if name == "memory":  # the PNG when matplotlib is there, else the reason
        assert plot.exists() or "matplotlib is not installed" in out


def test_scaling_mesh_runs_every_device_count_and_two_processes(capsys):
    assert main(["scaling", "--mesh", "--quick", "--json"]) == 0
    results = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["results"]
    assert [r["devices"] for r in results["devices"]] == [1, 2, 4]
    assert results["devices"][0]["all_reduce_per_layer"] == 0  # one device: no collective
    assert all(r["all_reduce_per_layer"] == 2 for r in results["devices"][1:])  # Megatron: two per layer
    assert results["processes"][0]["us_loop_two"] > 0


def test_ideal_prefix_hits_count_the_longest_earlier_prefix():
    """The per-family hit-rate table's ideal: for each request, the longest
    prefix (at most ``len - 1``) shared with an earlier prompt + output."""
    from jaxkv.bench.prefix_families import ideal_hits

    served = [([1, 2, 3, 4], [5, 6]), ([1, 2, 3, 4, 5, 9], [7]), ([1, 2, 8], [1]), ([4], []), ([1, 2, 3, 4, 5, 9], [])]
    assert ideal_hits(served) == 0 + 5 + 2 + 0 + 5


def test_prefix_restart_times_a_hit_from_the_disk_tier(capsys):
    """``bench prefix --restart``: the disk tier's row hits the prompt after
    a restart as far as the device tier does, and the cold row hits nothing."""
    assert main(["prefix", "--restart", "--quick", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = {row["mode"]: row for row in payload["results"]}
    assert rows["cold"]["hit_tokens"] == 0
    assert rows["disk tier"]["hit_tokens"] == rows["device tier"]["hit_tokens"] >= rows["cold"]["prompt_tokens"] - 16
    uncached = rows["disk tier, files out of the page cache"]
    assert uncached["hit_tokens"] == rows["disk tier"]["hit_tokens"]
    assert uncached["disk_read_bytes"] == rows["disk tier"]["disk_read_bytes"] > 0


def test_serve_disaggregated_gives_one_servers_outputs(capsys):
    """``bench serve --disaggregated``: the prefill + decode pair gives the
    single server's outputs, and every prompt was handed over."""
    assert main(["serve", "--disaggregated", "--quick", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert payload["same_outputs"] and payload["transfer"]["failures"] == 0
    assert payload["transfer"]["requests"] == 5 and payload["transfer"]["bytes"] > 0
