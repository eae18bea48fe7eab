"""``python -m jaxkv.bench serve --host-overhead`` (the scheduler's host time
per iteration) runs at tiny sizes and reports its table (the figures are
the benchmark's, not asserted here); and the host-path shortcuts it led to
give exactly what the per-request code gave: the running requests' reserve
over arrays (``reserve.growth_total``) and the packed stream built with
array operations (``caches.pack_stream``)."""

from __future__ import annotations

import contextlib
import io
import json

import jax
import numpy as np
import pytest

from jaxkv.bench.__main__ import main
from jaxkv.errors import InvalidArgument
from jaxkv.nn.packed import PackedLane, pack
from jaxkv.nn.sampling import GREEDY
from jaxkv.serve.caches import pack_stream
from jaxkv.serve.hybrid_cache import HybridCache
from jaxkv.serve.paged_cache import PagedCache
from jaxkv.serve.request import Request, RequestState
from jaxkv.serve.reserve import growth, growth_total

COLUMNS = ["family", "phase", "rows", "running", "host ms p50", "host ms p90", "host CPU ms p50", "device ms p50",
           "calls/iter", "host / at 4"]


def test_host_overhead_table_has_every_row_and_column():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["serve", "--host-overhead", "--quick", "--families", "llama", "--iterations", "2", "--json"])
    text = out.getvalue()
    assert rc == 0, text
    lines = text.strip().splitlines()
    header = next(line for line in lines if line.startswith("| family"))
    assert [c.strip() for c in header.strip("|").split("|")] == COLUMNS
    table = [[c.strip() for c in line.strip("|").split("|")] for line in lines
             if line.startswith("|") and not line.startswith(("| family", "|-"))]
    assert [(r[0], r[1], r[2]) for r in table] == [("llama (paged)", phase, rows) for phase in ("decode", "packed")
                                                   for rows in ("4", "8")]
    assert all(r[3] == r[2] for r in table)  # every row runs a request
    payload = json.loads(lines[-1])
    assert payload["benchmark"] == "serve" and payload["mode"] == "host_overhead" and payload["rows"] == [4, 8]
    for r in payload["results"]:
        assert r["iterations"] == 2 and r["host_ms_p50"] > 0 and r["device_ms_p50"] > 0
        assert set(r) >= {"family", "phase", "rows", "running", "host_ms_p90", "host_cpu_ms_p50",
                          "device_calls_per_iteration", "host_ratio_to_smallest"}
    assert "host <= 2 ms per iteration at 256 rows" in text


def _paged(page_size: int, window):
    cache = object.__new__(PagedCache)  # the block arithmetic only (no pool)
    cache.page_size, cache.window, cache.groups = page_size, window, ("pages",)
    return cache


def _hybrid(per_block):
    cache = object.__new__(HybridCache)
    cache._per_block, cache.groups = list(per_block), tuple(f"g{i}" for i in range(len(per_block)))
    return cache


@pytest.mark.parametrize("cache", [_paged(4, None), _paged(4, 9), _paged(16, 3), _hybrid([(1, 4), (4, 2), (16, 1)])],
                         ids=["paged", "paged-window", "paged-small-window", "hybrid"])
def test_growth_total_is_the_sum_of_each_request_growth(cache):
    rng = np.random.default_rng(0)
    key = np.zeros((2,), np.uint32)
    for _ in range(40):
        reqs = []
        for i in range(int(rng.integers(1, 24))):
            req = Request(i, rng.integers(1, 9, int(rng.integers(1, 60))).tolist(), int(rng.integers(1, 40)), GREEDY,
                          -1, 0, None, key)
            req.generated = rng.integers(1, 9, int(rng.integers(0, req.max_new + 3))).tolist()
            req.pieces = [(0, 1)] if rng.random() < 0.3 else []
            req.shared = rng.integers(0, 4, len(cache.groups)).astype(np.int64)
            req.state = RequestState.RUNNING
            reqs.append(req)
        chunk = int(rng.integers(1, 9))
        want = sum((growth(cache, r, chunk) for r in reqs), np.zeros(len(cache.groups), np.int64))
        assert growth_total(cache, reqs, chunk).tolist() == want.tolist()
    assert growth_total(cache, [], 4).tolist() == [0] * len(cache.groups)


def test_pack_stream_builds_the_batch_pack_builds():
    rng = np.random.default_rng(1)
    for _ in range(30):
        num_lanes, num_prefill_lanes = 12, int(rng.integers(1, 13))
        prefill = [PackedLane(int(rng.integers(0, 20)), rng.integers(0, 50, int(rng.integers(0, 6))).tolist(),
                              int(rng.integers(0, 30)), bool(rng.random() < 0.7))
                   for _ in range(int(rng.integers(0, num_prefill_lanes + 1)))]
        decode = int(rng.integers(0, num_lanes - len(prefill) + 1))
        seq_ids, tokens, positions = (rng.integers(0, 20, decode), rng.integers(0, 50, decode),
                                      rng.integers(0, 30, decode))
        lanes = prefill + [PackedLane(int(s), [int(t)], int(p)) for s, t, p in zip(seq_ids, tokens, positions)]
        num_tokens = sum(len(lane.tokens) for lane in lanes) + int(rng.integers(0, 5))
        want = pack(lanes, num_lanes=num_lanes, num_tokens=num_tokens, num_prefill_lanes=num_prefill_lanes,
                    max_prefill_len=5, num_prefill=len(prefill))
        got = pack_stream(prefill, seq_ids, tokens, positions, num_lanes=num_lanes, num_tokens=num_tokens,
                          num_prefill_lanes=num_prefill_lanes, max_prefill_len=5)
        assert jax.tree.structure(got) == jax.tree.structure(want)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(InvalidArgument, match="more than the batch's 2"):
        pack_stream([PackedLane(0, [1, 2], 0)], [1], [3], [4], num_lanes=4, num_tokens=2, num_prefill_lanes=4,
                    max_prefill_len=4)
    with pytest.raises(InvalidArgument, match="5 lanes for a batch of 4"):
        pack_stream([PackedLane(0, [1], 0)], [1] * 4, [3] * 4, [4] * 4, num_lanes=4, num_tokens=9, num_prefill_lanes=4,
                    max_prefill_len=4)
