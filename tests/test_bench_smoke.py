"""The benchmarks run end to end (quick mode) and end with their JSON line.
Timings are not asserted: they belong to ``python -m jaxkv.bench``."""

import json

import pytest

from jaxkv.bench.__main__ import main


@pytest.mark.parametrize("name", ["alloc", "pool", "prefix", "decode", "kernels", "hybrid"])
def test_benchmark_runs_and_prints_json(name, capsys):
    assert main([name, "--quick", "--json"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    payload = json.loads(last)
    assert payload["benchmark"] == name and payload["results"]


def test_unbuilt_benchmark_says_so(capsys):
    assert main(["memory"]) == 2
    assert "not built yet" in capsys.readouterr().out
