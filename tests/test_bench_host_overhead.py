"""``python -m jaxkv.bench serve --host-overhead`` (the scheduler's host time
per iteration) runs at tiny sizes and reports its table (the figures are
the benchmark's, not asserted here); and the host-path shortcuts it led to
give exactly what the per-request code gave: the running requests' reserve
over arrays (``reserve.growth_total``) and its bound at admission
(``reserve.growth_bound``), the decoding requests' step inputs from the
row mirror (``RowInputs``), the packed stream built with
array operations (``caches.pack_stream``), ``OutputProcessor.take_all``'s
inline common case (against ``_take_ids`` request by request), step
results read without ``device_get`` (``caches.fetch``), key data wrapped
inside the step (``typed_keys`` / ``keys_as_given``: the same draws as
typed keys), the paged manager passed without its host allocator
(``in_step``), the graph definition hashed once (``hashed_graphdef``) and
``Penalties.is_off`` computed once."""

from __future__ import annotations

import collections
import contextlib
import io
import json

import jax
import numpy as np
import pytest

from jaxkv.bench.__main__ import main
from jaxkv.errors import BookkeepingError, InvalidArgument
from jaxkv.nn.packed import PackedLane, pack
from jaxkv.nn.penalties import Penalties
from jaxkv.nn.sampling import GREEDY, RowSampling, SamplingParams
from jaxkv.serve.caches import decode_chunk, fetch, hashed_graphdef, keys_as_given, pack_stream, typed_keys
from jaxkv.serve.output import Counters, OutputProcessor, spread_gaps
from jaxkv.serve.hybrid_cache import HybridCache
from jaxkv.serve.paged_cache import PagedCache
from jaxkv.serve.request import Request, RequestState
from jaxkv.serve.reserve import growth, growth_bound, growth_total

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
    assert [(r[0], r[1], r[2]) for r in table] == [("llama (paged)", phase, rows)
                                                   for phase in ("decode", "packed", "burst", "queued") for rows in ("4", "8")]
    assert all(r[3] == r[2] for r in table)  # every row runs a request
    payload = json.loads(lines[-1])
    assert payload["benchmark"] == "serve" and payload["mode"] == "host_overhead" and payload["rows"] == [4, 8]
    for r in payload["results"]:
        assert r["iterations"] == (3 if r["phase"] == "burst" else 2)
        assert r["host_ms_p50"] > 0 and r["device_ms_p50"] > 0
        assert (r["phase"] == "queued") == ("add_request_us_p50" in r)
        if r["phase"] == "queued":
            assert r["queued"] == 200 and r["add_request_us_p50"] > 0
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


@pytest.mark.parametrize("cache", [_paged(4, None), _paged(1, None), _paged(4, 9), _paged(16, 3),
                                   _hybrid([(1, 4), (4, 2), (16, 1), (3, 5)])],
                         ids=["paged", "paged-page-1", "paged-window", "paged-small-window", "hybrid"])
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
        # The admission's first test: a bound from the count alone (none with a window on every layer).
        bound = growth_bound(cache, len(reqs), chunk)
        assert (bound is None) == (cache.window is not None)
        if bound is not None:
            assert np.all(want <= bound), (want, bound)
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


def _drawn_requests(rng, n: int) -> list:
    """Running requests in drawn states: outputs of any length up to their
    limit, some without a first token yet, some with stop ids."""
    reqs = []
    for i in range(n):
        req = Request(i, rng.integers(1, 9, int(rng.integers(1, 9))).tolist(), int(rng.integers(1, 12)), GREEDY, -1,
                      0, None, np.zeros((2,), np.uint32))
        req.generated = rng.integers(1, 30, int(rng.integers(0, req.max_new))).tolist()
        req.stop_ids = frozenset(rng.integers(1, 30, int(rng.integers(0, 3))).tolist())
        if rng.random() < 0.8:
            req.first_token_at = req.last_token_at = float(rng.random())
        req.cached_tokens = int(rng.integers(0, 9))
        req.spec_drafted = int(rng.integers(0, 9))
        req.spec_accepted = int(rng.integers(0, req.spec_drafted + 1))
        req.state = RequestState.RUNNING
        reqs.append(req)
    return reqs


def test_take_all_gives_what_take_ids_gives_request_by_request():
    """``take_all``'s inline common case against the per-request path it
    stands for (``req.key = key`` then ``_take_ids``), on drawn requests and
    token runs (stops among them or not, room or not, the device done or
    not, empty runs): the same tokens, reasons, records and outputs. In
    some draws the step is steady (every request's previous token at one
    time, every run the same length): ``spread_gaps``' one-list path."""
    import copy

    rng = np.random.default_rng(2)
    for _ in range(80):
        reqs = _drawn_requests(rng, int(rng.integers(1, 12)))
        steady = rng.random() < 0.4
        if steady:
            previous = float(rng.random())
            for req in reqs:
                if req.first_token_at is not None:
                    req.last_token_at = previous
        twins = copy.deepcopy(reqs)
        chunk = int(rng.integers(1, 6))
        items = [(chunk if steady else int(rng.integers(0, 6)), bool(rng.random() < 0.1),
                  rng.integers(0, 2**31, 2).astype(np.uint32)) for _ in reqs]
        now = 2.0 + float(rng.random())
        got, want = OutputProcessor(Counters()), OutputProcessor(Counters())
        earlier = [req.id for req in reqs if rng.random() < 0.2]  # a step's outputs so far: some have an entry
        for out in (got, want):
            for rid in earlier:
                out._open(rid)[0].append(7)
        runs = [rng.integers(1, 30, n).tolist() for n, _, _ in items]
        # A column shorter or longer than the requests is refused before any request changes.
        cut = int(rng.integers(len(reqs) + 2))
        if cut != len(reqs):
            def state():
                records = [(list(r.generated), r.last_token_at, r.key.tolist()) for r in reqs]
                return records, copy.deepcopy(got.pending), list(got.itl_samples)

            before = state()
            with pytest.raises(BookkeepingError, match="columns of"):
                got.take_all(reqs, [list(run) for run in runs][:cut] + [[1]] * (cut - len(reqs)),
                             [key for _, _, key in items], now)
            assert state() == before
        finished = got.take_all(reqs, [list(run) for run in runs], [key for _, _, key in items], now,
                                [done for _, done, _ in items])
        expected = []
        for req, run, (_, done, key) in zip(twins, runs, items):
            req.key = key
            if want._take_ids(req, list(run), now, done, None):
                expected.append(req.id)
        assert [req.id for req in finished] == expected
        # Requests that move again in the step (more tokens, finished): an output made whole is opened again.
        for req, twin in zip(reqs, twins):
            if rng.random() < 0.2 and req.finish_reason is None:
                more = rng.integers(1, 30, int(rng.integers(1, 3))).tolist()
                assert got._take_ids(req, list(more), now, False) == want._take_ids(twin, list(more), now, False)
            if rng.random() < 0.2:
                got.mark_finished(req)
                want.mark_finished(twin)
        # The same outputs (take_all's common case makes them whole; _take_ids leaves entries for collect).
        assert got.collect({req.id: req for req in reqs}) == want.collect({req.id: req for req in twins})
        assert got.counters.generated == want.counters.generated
        assert list(got.itl_samples) == list(want.itl_samples) and list(got.ttft_samples) == list(want.ttft_samples)
        for a, b in zip(reqs, twins):
            assert (a.generated, a.last_token_at, a.first_token_at, a.finish_reason) == (
                b.generated, b.last_token_at, b.first_token_at, b.finish_reason)
            assert a.key is b.key or np.array_equal(a.key, b.key)


def test_spread_gaps_gives_each_requests_gap_once_per_token():
    """``spread_gaps`` against the rule written out per token (request i's
    gap since its previous token, divided evenly over the tokens it took),
    on drawn steps: steady ones (one previous time, one count: the one-list
    path), ones with equal times but other counts, and mixed ones."""
    rng = np.random.default_rng(7)
    assert spread_gaps(1.0, [], []) == []
    for _ in range(300):
        n, now = int(rng.integers(1, 20)), 5.0 + float(rng.random())
        kind = int(rng.integers(3))
        previous = float(rng.random())
        lasts = [previous] * n if kind < 2 else [float(rng.random()) for _ in range(n)]
        counts = [int(rng.integers(1, 6))] * n if kind == 0 else rng.integers(1, 6, n).tolist()
        want = []
        for last, count in zip(lasts, counts):
            for _ in range(count):
                want.append((now - last) / count)
        assert spread_gaps(now, lasts, counts) == want


def test_token_bytes_list_path_gives_the_checked_paths_bytes_and_errors():
    """``token_bytes``' list path (``array``, no numpy) against the checked
    numpy path it stands for (``int_array`` then int32 bytes, refusing ids
    outside int32), on drawn lists and tuples: ints across the whole int32
    range and just past it, numpy integer scalars, and a bool, float, None,
    string or list slipped in. The same bytes, or InvalidArgument from both."""
    from jaxkv import _host
    from jaxkv.prefix.radix import token_bytes

    def checked(tokens):
        ids = _host.int_array(tokens, "tokens", ndim=1)
        if ids.size and (ids.min() < -(2**31) or ids.max() > 2**31 - 1):
            raise InvalidArgument("outside int32")
        return ids.astype(np.int32).tobytes()

    rng = np.random.default_rng()
    odd = [True, False, np.bool_(True), 1.0, np.float32(2), None, "7", [1, 2], 2**31, -(2**31) - 1, 2**63]
    edges = [2**31 - 1, -(2**31), 0, 1, np.int64(5), np.int32(-3), np.uint16(9)]
    refused = 0
    for _ in range(400):
        tokens = rng.integers(-(2**31), 2**31, int(rng.integers(0, 40))).tolist()
        tokens[: int(rng.integers(0, 3))] = [edges[i] for i in rng.integers(0, len(edges), 2)]
        if tokens and rng.random() < 0.4:
            tokens[int(rng.integers(0, len(tokens)))] = odd[int(rng.integers(0, len(odd)))]
        tokens = tuple(tokens) if rng.random() < 0.3 else tokens
        try:
            want = checked(tokens)
        except InvalidArgument:
            refused += 1
            with pytest.raises(InvalidArgument):
                token_bytes(tokens)
            continue
        assert token_bytes(tokens) == want
    assert 40 < refused < 400  # both branches were drawn


def test_fetch_reads_what_device_get_reads():
    """``fetch`` (tuples and lists walked by hand on the CPU backend)
    against ``device_get``: a fixed tree, then drawn nestings of tuples,
    lists, dicts, named tuples, None, device and numpy arrays and scalars."""
    import collections

    pair = collections.namedtuple("pair", "a b")
    rng = np.random.default_rng()

    def leaf():
        kind = int(rng.integers(5))
        values = rng.integers(-9, 9, tuple(rng.integers(0, 4, int(rng.integers(0, 3)))))
        return [None, jax.numpy.asarray(values, jax.numpy.int32), values.astype(np.float32),
                jax.numpy.bool_(bool(rng.random() < 0.5)), int(rng.integers(9))][kind]

    def drawn(depth):
        if depth == 0 or rng.random() < 0.3:
            return leaf()
        children = [drawn(depth - 1) for _ in range(int(rng.integers(0, 4)))]
        kind = int(rng.integers(4))
        if kind == 0:
            return tuple(children)
        if kind == 1:
            return children
        if kind == 2:
            return {f"k{i}": child for i, child in enumerate(children)}
        return pair(drawn(depth - 1), drawn(depth - 1))

    trees = [(jax.numpy.arange(6).reshape(2, 3), None, jax.numpy.float32(2.5), {"ok": jax.numpy.bool_(True)},
              jax.random.key_data(jax.random.split(jax.random.key(3), 4)))] + [drawn(4) for _ in range(60)]
    for tree in trees:
        got, want = fetch(tree), jax.device_get(tree)
        assert jax.tree.structure(got) == jax.tree.structure(want)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert isinstance(a, np.ndarray) and a.dtype == np.asarray(b).dtype and np.array_equal(a, b)


def test_with_host_gives_what_replace_gives():
    """The paged cache's fast host swap (``_with_host``) against
    ``manager.replace(host=...)``, on managers of drawn sizes and drawn
    allocations: equal pytrees (structure, static fields, every leaf), the
    original unchanged, and every field of the dataclass carried over (a
    field added later without ``__dict__`` semantics would fail here)."""
    import dataclasses

    from jaxkv.manager.block_space import BlockSpaceManager
    from jaxkv.serve.paged_cache import _with_host

    rng = np.random.default_rng()
    for _ in range(6):
        seqs, blocks = int(rng.integers(1, 6)), int(rng.integers(3, 40))
        manager = BlockSpaceManager.create(num_device_blocks=blocks, num_host_blocks=int(rng.integers(0, 9)),
                                           block_size=int(rng.integers(1, 9)), max_seqs=seqs,
                                           max_blocks_per_seq=int(rng.integers(1, 5)))
        manager = manager.replace(seq_lens=jax.numpy.asarray(rng.integers(0, 30, seqs), jax.numpy.int32))
        other = BlockSpaceManager.create(num_device_blocks=4, num_host_blocks=int(rng.integers(2, 9)), block_size=2,
                                         max_seqs=1, max_blocks_per_seq=1).host
        before = jax.tree.leaves(manager)
        for host in (None, other, manager.host):
            got, want = _with_host(manager, host), manager.replace(host=host)
            assert type(got) is type(want) and jax.tree.structure(got) == jax.tree.structure(want)
            assert all(getattr(got, f.name) is getattr(want, f.name) for f in dataclasses.fields(want))
            assert got.host is host and set(vars(got)) == {f.name for f in dataclasses.fields(want)}
        assert all(a is b for a, b in zip(jax.tree.leaves(manager), before))


def test_steps_given_key_data_draw_what_typed_keys_draw():
    """A decode chunk given key data (what the caches pass) draws the same
    tokens as one given typed keys and returns the advanced keys' data;
    a paged manager passed without its host allocator runs the same."""
    from flax import nnx

    from jaxkv.manager.block_space import BlockSpaceManager
    from jaxkv.nn import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=16),
                             rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    rows, steps = 3, 3
    rng = np.random.default_rng(5)
    typed = jax.random.split(jax.random.key(int(rng.integers(1 << 30))), rows)
    sampling = RowSampling.broadcast(SamplingParams(temperature=1.0), rows)
    outs = []
    for keys, without_host in ((typed, False), (jax.random.key_data(typed), True)):
        manager = BlockSpaceManager.create(num_device_blocks=16, num_host_blocks=4, block_size=4, max_seqs=rows,
                                           max_blocks_per_seq=4)
        manager, ok = manager.admit_with_prefix(np.arange(rows, dtype=np.int32), np.full((rows, 4), -1, np.int32),
                                                np.full((rows,), 2, np.int32))
        assert bool(ok)
        if without_host:
            assert manager.replace(host=None).in_step().host.num_blocks == 2  # the placeholder
            manager = manager.replace(host=None)
        else:
            assert manager.in_step() is manager
        pool = model.make_pool(16, 4, dtype=jax.numpy.float32)
        state = decode_chunk(graphdef, params, manager, pool, rng.integers(0, 64, rows).astype(np.int32),
                             np.ones((rows,), bool), np.zeros((rows,), np.int32), np.full((rows,), steps, np.int32),
                             np.full((rows,), -1, np.int32), sampling, keys, num_steps=steps)
        outs.append(state)
        rng = np.random.default_rng(5)  # the same last tokens for the second run
        rng.integers(1 << 30)
    plain, data = outs
    assert np.array_equal(np.asarray(plain.tokens), np.asarray(data.tokens))
    assert data.keys.dtype == np.uint32
    assert np.array_equal(np.asarray(jax.random.key_data(plain.keys)), np.asarray(data.keys))

    @jax.jit
    def round_trip(k):
        return keys_as_given(typed_keys(k), k)

    k = jax.random.key_data(typed)
    assert np.array_equal(np.asarray(round_trip(k)), np.asarray(k))
    assert jax.numpy.issubdtype(round_trip(typed).dtype, jax.dtypes.prng_key)


def test_hashed_graphdef_is_equal_hashed_and_merged_as_the_original():
    import pickle

    from flax import nnx

    from jaxkv.nn import LlamaConfig, LlamaForCausalLM

    def split(layers):
        config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                             num_attention_heads=2, num_key_value_heads=1, head_dim=16)
        return nnx.split(LlamaForCausalLM(config, rngs=nnx.Rngs(0)))

    (g, params), (g2, _), (g3, _) = split(2), split(2), split(3)
    h, h2, h3 = hashed_graphdef(g), hashed_graphdef(g2), hashed_graphdef(g3)
    assert hash(h) == hash(g) and h == h2 and hash(h) == hash(h2) and h != h3
    assert hashed_graphdef(h) is h
    assert pickle.loads(pickle.dumps(h)) == h
    merged = nnx.merge(h, params)
    assert merged.config.num_hidden_layers == 2

    step = jax.jit(lambda x, graphdef: x + 1, static_argnames=("graphdef",))
    step(1, graphdef=h)
    step(1, graphdef=h2)  # an equal definition: the program compiled for h
    assert step._cache_size() == 1


def test_penalties_is_off_holds_for_drawn_penalties():
    import dataclasses

    rng = np.random.default_rng(4)
    for _ in range(200):
        fields = dict(presence=float(rng.choice([0.0, rng.uniform(-2, 2)])),
                      frequency=float(rng.choice([0.0, rng.uniform(-2, 2)])),
                      repetition=float(rng.choice([1.0, rng.uniform(0.1, 3)])),
                      logit_bias={int(t): float(rng.uniform(-5, 5)) for t in rng.integers(0, 50, rng.integers(0, 2))},
                      min_tokens=int(rng.choice([0, rng.integers(1, 5)])))
        p = Penalties(**fields)
        off = (p.presence == 0 and p.frequency == 0 and p.repetition == 1 and not p.logit_bias and p.min_tokens == 0)
        assert p.is_off == off
        q = dataclasses.replace(p, presence=0.0)
        assert q.is_off == (q.frequency == 0 and q.repetition == 1 and not q.logit_bias and q.min_tokens == 0)
        assert p == Penalties(**fields)
    assert Penalties().is_off and not Penalties(min_tokens=1).is_off


@pytest.mark.parametrize("family", ["llama", "qwen3-next"])
def test_row_mirror_gives_the_tokens_the_records_give(family):
    """The decoding requests' step inputs from the row mirror
    (:class:`~jaxkv.serve.row_inputs.RowInputs`: advanced from each call's
    results, a changed row read from its record) against the same engine
    reading every record every step: drawn prompts arriving while others
    decode (packed steps with decode lanes), sampled with seeds or greedy,
    stop ids, different lengths (requests finish, rows are taken again),
    one with penalties (its steps read the records): the same outputs; the
    mirror served packed steps and decode chunks, some step read only the
    rows that changed, and decode chunks and packed steps screened fewer
    requests (only those whose entries were stale, and a packed step's
    prefilling ones)."""
    from jaxkv.bench.serve import _host_models
    from jaxkv.serve import Engine
    from jaxkv.serve.row_inputs import RowInputs

    build, options = _host_models([family])[next(iter(_host_models([family])))]
    model = build()
    rng = np.random.default_rng(6)
    work = []
    for i in range(12):
        sampling = SamplingParams(temperature=float(rng.choice([0.0, 0.8])), top_k=int(rng.choice([0, 5])))
        work.append(dict(prompt=rng.integers(3, 500, int(rng.integers(3, 20))).tolist(),
                         max_new=5 if i == 3 else int(rng.integers(3, 40)), sampling=sampling,
                         seed=int(rng.integers(1 << 20)),
                         stop=[int(rng.integers(3, 500))], arrival=int(rng.integers(0, 12)),
                         penalties=Penalties(presence=0.5) if i == 3 else None))
    used = []  # per mirror call: (rows, rows read from records), or None: every record read
    kinds = set()  # the steps the mirror served

    class Counted(RowInputs):
        def stale(self, rows, reqs, calls):
            self.rows = rows
            return super().stale(rows, reqs, calls)

        def write(self, stale, sampling_rows, calls):
            before = self.stamp.copy()
            wrote = super().write(stale, sampling_rows, calls)
            index = np.asarray(self.rows, np.int64)
            used.append((len(index), int((self.stamp[index] != before[index]).sum())) if wrote else None)
            return wrote

        def packed_arrays(self, index, first_lane):
            kinds.add("packed")
            return super().packed_arrays(index, first_lane)

        def decode_arrays(self, index):
            kinds.add("decode")
            return super().decode_arrays(index)

    class Never(RowInputs):
        def write(self, stale, sampling_rows, calls):
            return False

    def run(mirror):
        engine = Engine(model, **options(6, 64))
        engine._row_inputs, engine._row_inputs_cache = mirror(6, engine.cache.key_array([]).shape[1:],
                                                              engine.logprobs_mode), engine.cache
        real, screened, step = engine._sampling_row, [], ["decode"]
        packed = engine._packed

        def sampling_row(req):  # counted: a request whose entry is current is not screened again
            screened.append((step[0], req.id))
            return real(req)

        def counted_packed():
            step[0] = "packed"
            try:
                packed()
            finally:
                step[0] = "decode"

        engine._sampling_row, engine._packed = sampling_row, counted_packed
        for w in work:
            engine.add_request(w["prompt"], w["max_new"], sampling=w["sampling"], seed=w["seed"],
                               stop_token_ids=w["stop"], arrival_step=w["arrival"], penalties=w["penalties"])
        outputs = []
        while engine.has_unfinished():
            outputs.append([(o.request_id, o.new_token_ids, o.finish_reason) for o in engine.step()])
        return outputs, collections.Counter(kind for kind, _ in screened)

    mirrored, screened = run(Counted)
    served = [u for u in used if u is not None]
    records, screened_records = run(Never)
    assert records == mirrored
    # Both decode chunks and packed steps screened fewer requests (a packed step's prefilling ones are always
    # screened, so some are).
    assert screened["decode"] < screened_records["decode"], (screened, screened_records)
    assert 0 < screened["packed"] < screened_records["packed"], (screened, screened_records)
    assert kinds == {"packed", "decode"}
    assert served and any(0 < read < rows for rows, read in served), used  # only the changed rows were read
    assert any(read == 0 for _, read in served), used  # and steps that read none


def test_a_packed_iteration_admits_in_its_step_call(monkeypatch):
    """The paged cache puts an admission off to the packed step's call
    (``PagedCache._defer_admission``): drawn prompts arriving while others
    decode, seeded sampling and greedy, some sharing a prefix (hits), give
    the same outputs as the same engine admitting in a call of its own;
    with the fold no admission call is made, the packed calls are the
    same in number, and the host mirror (free blocks, row status) agrees
    with the device after every step."""
    from jaxkv.bench.serve import _host_models
    from jaxkv.serve import Engine, paged_cache
    from jaxkv.serve.paged_cache import PagedCache

    build, options = _host_models(["llama"])["llama (paged)"]
    model = build()
    rng = np.random.default_rng()
    shared = rng.integers(3, 500, 20).tolist()
    work = []
    for i in range(14):
        head = shared if i % 3 == 0 else []
        work.append(dict(prompt=head + rng.integers(3, 500, int(rng.integers(2, 30))).tolist(),
                         max_new=int(rng.integers(1, 30)), seed=int(rng.integers(1 << 20)),
                         sampling=SamplingParams(temperature=float(rng.choice([0.0, 0.9])), top_k=8),
                         arrival=int(rng.integers(0, 16))))
    calls = collections.Counter()
    for name in ("_admit_paged", "_paged_packed"):
        real = getattr(paged_cache, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(paged_cache, name, counted)

    def run():
        calls.clear()
        engine = Engine(model, **options(6, 96))
        for w in work:
            engine.add_request(w["prompt"], w["max_new"], sampling=w["sampling"], seed=w["seed"],
                               arrival_step=w["arrival"])
        outputs = []
        while engine.has_unfinished():
            outputs.append([(o.request_id, o.new_token_ids, o.finish_reason) for o in engine.step()])
            engine.check_bookkeeping()  # the mirror against the device, the records against the mirror
        assert engine.stats().step_failures == 0, engine.last_failure  # (a contained failure hides nothing here)
        return outputs, dict(calls), engine.stats().prefix_hit_tokens

    folded, folded_calls, hits = run()
    monkeypatch.setattr(PagedCache, "_defer_admission", lambda self, rows, prefix, lengths:
                        self._admit(rows, prefix, lengths))
    alone, alone_calls, _ = run()
    assert folded == alone
    assert hits > 0, "no prompt hit the shared prefix"
    assert alone_calls["_admit_paged"] > 0 and "_admit_paged" not in folded_calls, (folded_calls, alone_calls)
    assert folded_calls["_paged_packed"] == alone_calls["_paged_packed"] > 0


def test_a_deferred_admission_predicts_the_mirror_it_makes():
    """Between a deferred admission and the call that makes it, the host
    mirror holds what it will make: at every packed iteration (drawn
    prompts, some hitting a cached prefix), the free blocks and row status
    read then equal those read from the device once the admission ran in
    a call of its own."""
    from jaxkv.bench.serve import _host_models
    from jaxkv.serve import Engine

    build, options = _host_models(["llama"])["llama (paged)"]
    engine = Engine(build(), **options(6, 96))
    rng = np.random.default_rng()
    shared = rng.integers(3, 500, 33).tolist()
    for i in range(10):
        engine.add_request((shared if i % 2 else []) + rng.integers(3, 500, int(rng.integers(2, 30))).tolist(),
                           int(rng.integers(1, 20)), arrival_step=int(rng.integers(0, 10)))
    cache, packed, seen = engine.cache, engine._packed, []

    def checked():
        if cache._deferred is not None:
            predicted = cache.free_blocks(), cache.row_status()
            seen.append(int((cache._deferred[0] >= 0).sum()))  # the rows it admits
            cache.manager  # the admission made in its own call; the mirror read from the device
            np.testing.assert_array_equal(predicted[0], cache.free_blocks())
            np.testing.assert_array_equal(predicted[1], cache.row_status())
        packed()

    engine._packed = checked
    engine.run()
    assert engine.stats().step_failures == 0, engine.last_failure
    assert sum(seen) >= 10, seen  # every request was admitted through a deferred admission


@pytest.mark.parametrize("num_pages", [None, 24])
def test_admission_with_the_reserve_bound_admits_as_with_the_reserve(num_pages, monkeypatch):
    """Admission tests the running requests' reserve bound first
    (``growth_bound``: no pass over their records) and computes the reserve
    only where the bound does not fit: the same admissions, evictions and
    preemptions, so the same outputs, as an engine computing the reserve
    every time; drawn prompts sharing prefixes and arrivals, with plenty of
    pages (the bound serves) and few (the reserve is computed and evicts)."""
    from jaxkv.bench.serve import _host_models
    from jaxkv.serve import Engine, scheduler

    build, options = _host_models(["llama"])["llama (paged)"]
    model = build()
    rng = np.random.default_rng(int(num_pages or 1))
    shared = rng.integers(3, 500, 40).tolist()
    work = [dict(prompt=shared[: int(rng.integers(0, 40))] + rng.integers(3, 500, int(rng.integers(2, 24))).tolist(),
                 max_new=int(rng.integers(2, 30)), arrival=int(rng.integers(0, 10))) for _ in range(14)]
    reserves = []
    real = scheduler.Scheduler._growth_reserve

    def counted(self, *args, **kwargs):
        reserves.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(scheduler.Scheduler, "_growth_reserve", counted)

    def run():
        reserves.clear()
        kwargs = options(6, 96)
        if num_pages is not None:
            kwargs["num_pages"] = num_pages
        engine = Engine(model, **kwargs)
        for w in work:
            engine.add_request(w["prompt"], w["max_new"], arrival_step=w["arrival"])
        outputs = []
        while engine.has_unfinished():
            outputs.append([(o.request_id, o.new_token_ids, o.finish_reason) for o in engine.step()])
        stats = engine.stats()
        return outputs, (stats.prefix_hit_tokens, stats.preemptions), len(reserves)

    bounded, counts, computed = run()
    monkeypatch.setattr(scheduler, "growth_bound", lambda *args: None)
    assert run()[:2] == (bounded, counts)
    if num_pages is None:
        assert computed == 0  # the bound served every admission
    else:
        assert computed > 0  # the bound did not fit: the reserve was computed
