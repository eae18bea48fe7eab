"""The prefix cache's disk tier (``kv_disk_dir``, :mod:`jaxkv.prefix.disk`,
:mod:`jaxkv.serve.disk_tier`).

Expectations we did not write: an engine with no disk tier (a cold run)
gives the tokens every restarted engine must give; the files themselves
are checked byte by byte against what was stored. Prompts are drawn fresh
(the seed is printed in every failure message): prefixes shared between
prompts and namespaces, lengths across page boundaries.

* **Restart**: a second engine on the same folder (a restarted server)
  hits every whole page the first one cached, per namespace, and gives the
  cold run's tokens; another namespace, or another model's weights in the
  same folder, hits nothing.
* **Damage**: a power cut in the middle of a write (a half-written
  temporary file, the final one never renamed), a truncated record, a
  flipped byte: the damaged record alone is lost (the hit ends before it),
  with a warning; a foreign file is skipped and left alone.
* **Budget**: the files never exceed it; the least recently used go first.

Compile budget: the engines have test_paged_host_tier's shapes.
"""

from __future__ import annotations

import logging
import os
import secrets

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from jaxkv.errors import InvalidArgument
from jaxkv.nn import LlamaConfig, LlamaForCausalLM
from jaxkv.prefix.disk import DiskStore
from jaxkv.serve import Engine
from tests.test_paged_host_tier import CONFIG, ENGINE, PAGE  # the same shapes: the engine's programs compile once


@pytest.fixture(scope="module")
def model():
    return LlamaForCausalLM(LlamaConfig.from_hf(CONFIG), rngs=nnx.Rngs(0))


def fresh_rng():
    seed = secrets.randbelow(2**31)
    return np.random.default_rng(seed), seed


# ----------------------------------------------------------------------------- the store alone


def record_arrays(rng):
    return {"k": rng.standard_normal((2, 3, 4)).astype(np.float32),
            "v": rng.standard_normal((2, 3, 4)).astype(ml_dtypes.bfloat16),
            "scale": rng.integers(-128, 127, size=(5,)).astype(np.int8)}


def test_store_round_trip_index_and_keys(tmp_path):
    rng, seed = fresh_rng()
    store = DiskStore(tmp_path, budget_bytes=1 << 20, identity="model-a")
    tokens = rng.integers(0, 1000, size=12).tolist()
    keys = store.chain(tokens, 4, namespace="t1")
    assert len(keys) == 3 and len(set(keys)) == 3
    assert keys == store.chain(tokens + [5, 6], 4, namespace="t1")  # a partial last piece adds no key
    assert store.chain(tokens, 4, namespace="t2")[0] != keys[0]  # namespaces never share a record
    other = list(tokens)
    other[5] += 1
    assert store.chain(other, 4, namespace="t1")[:2] == [keys[0], store.key(keys[0], other[4:8], "t1")]
    assert store.chain(other, 4, namespace="t1")[1] != keys[1]  # a changed token changes its key and after
    written = {}
    for i, key in enumerate(keys):
        written[key] = record_arrays(rng)
        assert store.put(key, keys[i - 1] if i else None, tokens[4 * i:4 * i + 4], "t1", "page", written[key])
    assert not store.put(keys[0], None, tokens[:4], "t1", "page", written[keys[0]])  # already queued or on disk
    store.flush()
    again = DiskStore(tmp_path, budget_bytes=1 << 20, identity="model-a")  # a restart: the folder indexed
    for i, key in enumerate(keys):
        assert again.has(key)
        header, arrays = again.get(key, "page")
        assert header["tokens"] == tokens[4 * i:4 * i + 4] and header["parent"] == (keys[i - 1] if i else None)
        for name, want in written[key].items():
            assert arrays[name].dtype == want.dtype, seed
            np.testing.assert_array_equal(arrays[name], want, err_msg=f"seed {seed}")
    assert again.get(keys[0], "snapshot") is None  # another kind of record is refused (and dropped)
    assert again.stats().rejected == 1


def test_store_skips_foreign_corrupt_and_half_written_files(tmp_path, caplog):
    rng, seed = fresh_rng()
    ours = DiskStore(tmp_path, budget_bytes=1 << 20, identity="model-a")
    theirs = DiskStore(tmp_path, budget_bytes=1 << 20, identity="model-b")
    keys = ours.chain(rng.integers(0, 50, size=16), 4)
    for key in keys:
        ours.put(key, None, [1, 2, 3, 4], None, "page", record_arrays(rng))
    foreign = theirs.chain(rng.integers(0, 50, size=8), 4)
    for key in foreign:
        theirs.put(key, None, [1, 2, 3, 4], None, "page", record_arrays(rng))
    ours.flush()
    theirs.flush()
    path = lambda key: os.path.join(tmp_path, key + ".kvrec")  # noqa: E731
    data = open(path(keys[1]), "rb").read()
    with open(path(keys[1]), "wb") as f:  # truncated: a file system that lost the tail
        f.write(data[: len(data) // 2])
    os.remove(path(keys[2]))  # a power cut mid-write: the temporary file only
    with open(os.path.join(tmp_path, f".{keys[2]}.0badf00d.tmp"), "wb") as f:
        f.write(data[: len(data) // 3])
    flipped = bytearray(open(path(keys[3]), "rb").read())
    flipped[-40] ^= 0x01  # bit rot in the payload: only the checksum can tell
    open(path(keys[3]), "wb").write(bytes(flipped))
    with caplog.at_level(logging.WARNING, logger="jaxkv.prefix.disk"):
        again = DiskStore(tmp_path, budget_bytes=1 << 20, identity="model-a")
        assert again.has(keys[0]) and not again.has(keys[1]) and not again.has(keys[2]) and again.has(keys[3])
        assert again.get(keys[0], "page") is not None
        assert again.get(keys[3], "page") is None  # caught when loaded, never used
    text = caplog.text
    assert "write never finished" in text and "truncated" in text and "checksum mismatch" in text, text
    assert text.count("another model") == len(foreign), text
    assert all(os.path.exists(path(key)) for key in foreign)  # foreign files are left alone
    assert not os.path.exists(path(keys[1])) and not os.path.exists(path(keys[3]))  # ours, damaged: deleted
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
    assert again.stats().rejected == 2 and again.stats().records == 1, seed


def test_store_budget_deletes_least_recently_used(tmp_path):
    rng, seed = fresh_rng()
    probe = DiskStore(tmp_path / "probe", budget_bytes=1 << 20, identity="m")
    probe.put("k", None, [1], None, "page", record_arrays(rng))
    probe.flush()
    size = probe.stats().bytes
    store = DiskStore(tmp_path / "s", budget_bytes=3 * size + size // 2, identity="m")  # three records fit
    keys = store.chain(rng.integers(0, 50, size=20), 4)
    for key in keys[:3]:
        store.put(key, None, [1, 2, 3, 4], None, "page", record_arrays(rng))
    store.flush()
    assert store.get(keys[0], "page") is not None  # used: the least recently used is keys[1] now
    store.put(keys[3], None, [1, 2, 3, 4], None, "page", record_arrays(rng))
    store.flush()
    assert [store.has(k) for k in keys[:4]] == [True, False, True, True], seed
    assert store.stats().bytes <= store.budget_bytes and store.stats().dropped == 1
    assert sorted(os.listdir(tmp_path / "s")) == sorted(k + ".kvrec" for k in (keys[0], keys[2], keys[3]))
    with pytest.raises(InvalidArgument, match="byte budget"):
        DiskStore(tmp_path, budget_bytes=0, identity="m")


# ----------------------------------------------------------------------------- the engine across restarts


def workload(rng):
    """Prompts sharing prefixes (a long common head, then branches), in two namespaces."""
    head = rng.integers(1, CONFIG["vocab_size"], size=int(rng.integers(9, 14))).tolist()
    prompts = [head + rng.integers(1, CONFIG["vocab_size"], size=int(rng.integers(1, 9))).tolist()
               for _ in range(3)]
    return [(p, "alice" if i % 2 == 0 else "bob") for i, p in enumerate(prompts)]


def run_all(engine, requests, max_new=4):
    """Each request alone (one after another); their tokens and first cached counts."""
    out, cached = [], []
    for prompt, namespace in requests:
        rid = engine.add_request(prompt, max_new, namespace=namespace)
        first = None
        while engine.has_unfinished():
            for o in engine.step():
                if o.request_id == rid and o.new_token_ids and first is None:
                    first = o.cached_tokens
        out.append(engine.outputs[rid])
        cached.append(first)
    engine.check_bookkeeping()
    return out, cached


def test_a_restarted_engine_hits_the_disk_with_cold_tokens(model, tmp_path):
    rng, seed = fresh_rng()
    requests = workload(rng)
    cold, _ = run_all(Engine(model, **ENGINE), requests)
    first = Engine(model, kv_disk_dir=str(tmp_path), **ENGINE)
    got, _ = run_all(first, requests)
    assert got == cold, seed
    first.close()
    assert first.stats().disk["written"] == len(os.listdir(tmp_path)) > 0
    restarted = Engine(model, kv_disk_dir=str(tmp_path), **ENGINE)
    got, cached = run_all(restarted, requests)
    assert got == cold, seed
    for (prompt, _), hit in zip(requests, cached):  # every whole page of the prompt (bar the last token)
        assert hit == (len(prompt) - 1) // PAGE * PAGE, (seed, len(prompt), hit)
    assert restarted.stats().disk["hit_tokens"] > 0
    prompt, namespace = requests[0]
    elsewhere = Engine(model, kv_disk_dir=str(tmp_path), **ENGINE)
    got, cached = run_all(elsewhere, [(prompt, "carol")])  # another tenant's namespace: nothing to hit
    assert got == cold[:1] and cached == [0], seed


def test_damage_loses_only_the_damaged_record(model, tmp_path, caplog):
    """A power cut mid-write of page ``k`` (its temporary file half written,
    never renamed): the restarted engine hits the ``k`` pages before it and
    recomputes the rest, with the cold run's tokens; a flipped byte in
    another prompt's record ends that hit there too."""
    rng, seed = fresh_rng()
    requests = workload(rng)
    cold, _ = run_all(Engine(model, **ENGINE), requests)
    first = Engine(model, kv_disk_dir=str(tmp_path), **ENGINE)
    run_all(first, requests)
    first.close()
    store = first.cache.disk.store
    prompt, namespace = requests[0]
    keys = store.chain(prompt, PAGE, namespace)
    cut = int(rng.integers(0, len(keys)))
    path = os.path.join(tmp_path, keys[cut] + ".kvrec")
    data = open(path, "rb").read()
    os.remove(path)
    open(os.path.join(tmp_path, f".{keys[cut]}.deadbeef.tmp"), "wb").write(data[: len(data) // 2])
    prompt1, namespace1 = requests[1]
    keys1 = store.chain(prompt1, PAGE, namespace1)
    rot = int(rng.integers(0, (len(prompt1) - 1) // PAGE))
    raw = bytearray(open(os.path.join(tmp_path, keys1[rot] + ".kvrec"), "rb").read())
    raw[-33 - int(rng.integers(1, 64))] ^= 0x10
    open(os.path.join(tmp_path, keys1[rot] + ".kvrec"), "wb").write(bytes(raw))
    with caplog.at_level(logging.WARNING, logger="jaxkv.prefix.disk"):
        restarted = Engine(model, kv_disk_dir=str(tmp_path), **ENGINE)
        got, cached = run_all(restarted, requests[:2])
    assert got == cold[:2], seed
    assert cached[0] == min(cut, (len(prompt) - 1) // PAGE) * PAGE, (seed, cut, cached)
    assert cached[1] == rot * PAGE, (seed, rot, cached)
    assert "write never finished" in caplog.text and "checksum mismatch" in caplog.text


def test_another_models_records_are_never_loaded(model, tmp_path):
    rng, seed = fresh_rng()
    requests = workload(rng)[:1]
    first = Engine(model, kv_disk_dir=str(tmp_path), **ENGINE)
    run_all(first, requests)
    first.close()
    other = LlamaForCausalLM(LlamaConfig.from_hf(CONFIG), rngs=nnx.Rngs(1))  # same shapes, other weights
    cold, _ = run_all(Engine(other, **ENGINE), requests)
    theirs = Engine(other, kv_disk_dir=str(tmp_path), **ENGINE)
    got, cached = run_all(theirs, requests)
    assert got == cold and cached == [0], seed
    theirs.close()
    assert len(os.listdir(tmp_path)) == first.stats().disk["written"] + theirs.stats().disk["written"]


def test_the_servers_flags_give_the_disk_tier_options():
    import argparse

    from jaxkv.serve.options import add_arguments, from_cli

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    options = from_cli(parser.parse_args(["--kv-disk-dir", "/srv/kv", "--kv-disk-bytes", "2GiB"]))
    assert (options.cache.kv_disk_dir, options.cache.kv_disk_bytes) == ("/srv/kv", 2 * 2**30)
    assert from_cli(parser.parse_args([])).cache.kv_disk_dir is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-disk-bytes", "0.5"])  # bytes, not a fraction


def test_disk_tier_options_are_checked(model, tmp_path):
    with pytest.raises(InvalidArgument, match="prefix_cache is off"):
        Engine(model, kv_disk_dir=str(tmp_path), prefix_cache=False, **ENGINE)
    with pytest.raises(InvalidArgument, match="kv_disk_dir=3: give a folder path"):
        Engine(model, kv_disk_dir=3, **ENGINE)
    (tmp_path / "file").write_text("x")
    with pytest.raises(InvalidArgument, match="cannot be made"):
        Engine(model, kv_disk_dir=str(tmp_path / "file" / "sub"), **ENGINE)


# ----------------------------------------------------------------------------- every family (long)

FAMILIES = {  # fixture -> the engine's cache options (hybrid caches: token-grain snapshot records)
    "gemma3/small": dict(max_context_tokens=512),
    "qwen3_next/small": dict(max_context_tokens=512),
    "dsv4/small": dict(max_context_tokens=512),
    "gpt_oss/small": dict(max_context_tokens=512),
    "dsv3/small": dict(max_model_len=512),  # DeepSeek-V3's MLA pool: paged
}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_family_hits_its_disk_after_a_restart(name, tmp_path):
    """Three turns of a conversation (each prompt begins with the one
    before): after the first two, an engine started on their disk tier (a
    restart) hits the third exactly as far as the engine that served them
    and kept running does (its device and host tiers), at least the second
    prompt's pages (its prompt-end record, for a hybrid cache), and both
    give the cold run's tokens (a fresh engine without a disk tier, itself
    checked against transformers in test_engine_families)."""
    from jaxkv.nn import AutoModelForCausalLM

    rng, seed = fresh_rng()
    model = AutoModelForCausalLM.from_pretrained(os.path.join(os.path.dirname(__file__), "fixtures", name))
    options = dict(max_seqs=2, decode_chunk=4, prefill_chunk=64, **FAMILIES[name])
    vocab = model.config.vocab_size
    first = rng.integers(1, vocab, int(rng.integers(100, 150))).tolist()
    second = first + rng.integers(1, vocab, int(rng.integers(20, 60))).tolist()
    third = second + rng.integers(1, vocab, int(rng.integers(3, 20))).tolist()

    def serve(engine, prompts):
        out = []
        for prompt in prompts:
            rid = engine.add_request(prompt, 5, namespace="t")
            engine.run()
            out.append((engine.outputs[rid], engine.cached_tokens(rid)))
        return out

    cold = [tokens for tokens, _ in serve(Engine(model, **options), [first, second, third])]
    warm = Engine(model, kv_disk_dir=str(tmp_path), **options)
    assert [tokens for tokens, _ in serve(warm, [first, second])] == cold[:2], seed
    warm.close()
    restarted = Engine(model, kv_disk_dir=str(tmp_path), **options)
    ((tokens, disk_hit),) = serve(restarted, [third])
    ((warm_tokens, device_hit),) = serve(warm, [third])
    assert tokens == warm_tokens == cold[2], seed
    unit = getattr(restarted.cache, "page_size", 1)
    assert disk_hit == device_hit >= (len(second) - 1) // unit * unit, (seed, disk_hit, device_hit, len(second))
    assert restarted.stats().disk["hit_tokens"] >= disk_hit


def test_a_hybrid_prompts_interval_records_share_their_pages_on_disk(tmp_path):
    """A long prompt on a hybrid cache leaves a snapshot record every few
    tokens; on disk each whole page is written once, however many records
    pass through it (the whole-record layout repeated every page before
    each record: bytes quadratic in the prompt). Expected, from the cache's
    own records (not from the disk code): one page file per distinct page
    of the records, every page file holding a page's blocks and no more
    bytes in all than the longest record's blocks; a restart hits the disk
    with cold tokens; and a flipped byte in a page's file loses exactly the
    records standing on that page (the longest record before it is hit,
    with cold tokens)."""
    from jaxkv.nn import AutoModelForCausalLM
    from jaxkv.prefix.disk import _read_header

    rng, seed = fresh_rng()
    model = AutoModelForCausalLM.from_pretrained(os.path.join(os.path.dirname(__file__), "fixtures",
                                                              "qwen3_next/small"))
    options = dict(max_seqs=2, decode_chunk=4, prefill_chunk=32, snapshot_interval=32, max_context_tokens=512,
                   num_snapshots=24)
    prompt = rng.integers(1, model.config.vocab_size, int(rng.integers(300, 420))).tolist()

    def serve(engine, tokens):
        rid = engine.add_request(tokens, 5)
        engine.run()
        return engine.outputs[rid], engine.cached_tokens(rid)

    cold = Engine(model, **options)
    warm = Engine(model, kv_disk_dir=str(tmp_path), **options)
    assert serve(warm, prompt)[0] == serve(cold, prompt)[0], seed
    cache = warm.cache
    records = list(cache.snapshots.records.values())
    assert len(records) >= 8, (seed, len(records))  # interval records along the prompt
    unit = cache.snapshots.unit
    pages = {(repr(r.namespace), tuple(r.prefix[:(i + 1) * unit])) for r in records for i in range(len(r.path))}
    longest = max(records, key=lambda r: len(r.path))
    block_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(cache.record_data(longest)[1][0]))
    whole = sum(leaf.nbytes for r in records for leaf in jax.tree.leaves(cache.record_data(r)[1]))
    warm.close()

    names = [name for name in os.listdir(tmp_path) if name.endswith(".kvrec")]
    headers = [_read_header(os.path.join(tmp_path, name))[0] for name in names]
    page_files = [h for h in headers if h["kind"] == "snapshot-page"]
    record_files = [h for h in headers if h["kind"] == "snapshot"]
    assert len(page_files) == len(pages), (seed, len(page_files), len(pages))
    assert len(record_files) >= len(records), seed  # (a retired request's records too)
    assert sum(h["payload_bytes"] for h in page_files) <= block_bytes, seed
    assert sum(h["payload_bytes"] for h in headers) < whole, seed

    longer = prompt + rng.integers(1, model.config.vocab_size, 3).tolist()
    want, _ = serve(cold, longer)
    tokens, hit = serve(Engine(model, kv_disk_dir=str(tmp_path), **options), longer)  # a restart
    assert tokens == want and hit >= len(prompt) - 1, (seed, hit)

    # A flipped byte in page k's file: the records standing on it are lost, the longest before it is hit.
    k = int(rng.integers(1, len(longest.path)))
    [damaged] = [name for name, h in zip(names, headers) if h["kind"] == "snapshot-page"
                 and h["tokens"] == prompt[k * unit:(k + 1) * unit]]
    path = os.path.join(tmp_path, damaged)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x40
    open(path, "wb").write(bytes(data))
    # No record may stand below page k (k = 1 and the first record two pages in): then nothing is hit.
    expected = max((len(h["tokens"]) for h in record_files
                    if h["meta"]["pages"] <= k and len(h["tokens"]) < len(longer) and
                    h["tokens"] == longer[:len(h["tokens"])]), default=0)
    tokens, hit = serve(Engine(model, kv_disk_dir=str(tmp_path), **options), longer)
    assert tokens == want and hit == expected, (seed, k, hit, expected)
