"""``python -m jaxkv.bench kernels``: the Pallas kernels against their baselines.

Two tables, every figure a ratio against a baseline timed in the same run,
interleaved with the subject (minimum over the repeats):

**Gathers** (DeepSeek-V4 format: 448 fp8 + 7 ue8m0 scales + 64 bf16 RoPE in,
512 bf16 out). Bytes moved = entries read (584 B each, plus their index and
table reads) + rows written (1 KiB each + the validity byte). Achieved
bandwidth is divided by that of a device-to-device copy of a buffer of the same
size (``bw ratio``; the target on GPU is >= 0.8):

* ``csa``: ``tokens`` query tokens, each gathering ``index_topk = 512``
  random entries of its request (requests of 32k tokens, ratio 4);
* ``hca``: every entry of ``batch`` requests of 32k tokens (ratio 128);
* ``swa``: the 128-token window of ``batch`` requests from their rings.

**paged_attention** (bf16, 32 query heads, 8 KV heads, head dim 128, pages
of 16 tokens): our kernel's time over the time of JAX's own Pallas
``paged_attention`` at the same shapes and batch/length (``time ratio``;
target <= 1.0), for batch 1, 8, 64 and lengths 1k to 32k.

**ragged_paged_attention** (same heads and pages): one ragged call on a
packed step against what an engine without it launches for the same work
(``time ratio`` = ragged / baseline; target <= 1.0 for mixed steps):

* ``mixed``: ``D`` decode tokens (context ``L``) and one prefill piece of
  ``Q`` tokens after ``C`` cached ones, packed into one stream, against
  ``paged_attention`` (the decode kernel) on the decode tokens plus
  ``jaxkv.nn.paged_prefill_attention`` on the piece padded to a power of two
  (there is no prefill kernel; on GPU it runs as XLA);
* ``decode``: ``D`` decode tokens only, against ``paged_attention`` alone
  (the decode kernel's split-K is expected to win here: the ratio says by
  how much).

On a GPU the tables run the Pallas kernels. Elsewhere (CPU) the Pallas
kernels cannot be compiled, so the benchmark runs the pure-jnp references
instead, says so in the titles and in the JSON (``"implementation":
"reference"``), uses smaller shapes, and compares our attention reference
with JAX's dense ``paged_attention_reference``: useful for spotting a slow
reference, not a statement about the kernels.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged

from jaxkv.bench._timing import best_seconds_interleaved, machine_description, print_json, print_table
from jaxkv.manager.kernel_tables import pallas_gpu_block_tables
from kernels_pallas import DSV4_FP8, CompressedEntries, gather_all_compressed_kv, gather_compressed_kv, gather_swa_kv
from kernels_pallas.paged_attention import paged_attention
from kernels_pallas.ragged_attention import ragged_paged_attention

__all__ = ["main"]

FMT = DSV4_FP8
ENTRIES_PER_PAGE = {"csa": 32, "hca": 1}  # per 128-token block: 128/4 and 128/128
TOPK, WINDOW = 512, 128
HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE = 32, 8, 128, 16


def _copy_seconds(num_bytes: int, repeats: int, subject) -> tuple[float, float]:
    """(subject seconds, copy seconds) for a copy of ``num_bytes`` bytes."""
    buf = jnp.ones((max(1, num_bytes // 4),), jnp.float32)
    copy = jax.jit(lambda x: x * 1.0001)  # read once, write once; no aliasing tricks possible
    jax.block_until_ready(copy(buf))
    times = best_seconds_interleaved({"subject": subject, "copy": lambda: copy(buf)}, repeats)
    return times["subject"], times["copy"]


def _random_pool(rng, num_pages, per_page):
    x = rng.standard_normal((num_pages, per_page, FMT.head_dim), dtype=np.float32)
    return jax.jit(CompressedEntries.quantize, static_argnums=1)(jnp.asarray(x), FMT)


def _gather_rows(kind: str, count: int, context: int, rng, impl: str):
    """(name, shape text, callable, bytes moved) of one gather case."""
    out_row = FMT.head_dim * 2 + 1
    if kind == "swa":
        ring = _random_pool(rng, count, WINDOW)
        slots = jnp.arange(count, dtype=jnp.int32)
        positions = jnp.asarray(rng.integers(WINDOW, context, count), jnp.int32)
        fn = jax.jit(functools.partial(gather_swa_kv, implementation=impl))
        rows = count * WINDOW
        return f"batch {count}, window {WINDOW}", lambda: fn(ring, slots, positions), rows * (FMT.bytes_per_entry + out_row)
    per_page = ENTRIES_PER_PAGE[kind]
    entries = context // (4 if kind == "csa" else 128)
    pages_per_request = entries // per_page
    requests = count if kind == "hca" else max(1, count // 8)
    pool = _random_pool(rng, requests * pages_per_request + 1, per_page)
    table = jnp.asarray(1 + rng.permutation(requests * pages_per_request).reshape(requests, pages_per_request),
                        jnp.int32)
    if kind == "hca":
        n = jnp.full((requests,), entries, jnp.int32)
        fn = jax.jit(functools.partial(gather_all_compressed_kv, max_entries=entries, implementation=impl))
        rows = requests * entries
        return (f"batch {requests}, {entries} entries", lambda: fn(pool, table, n),
                rows * (FMT.bytes_per_entry + out_row) + table.size * 4)
    indices = jnp.asarray(rng.integers(0, entries, (count, TOPK)), jnp.int32)
    token_rows = jnp.asarray(np.arange(count) % requests, jnp.int32)
    fn = jax.jit(functools.partial(gather_compressed_kv, implementation=impl))
    rows = count * TOPK
    return (f"{count} tokens x top-{TOPK}", lambda: fn(pool, table, indices, token_rows),
            rows * (FMT.bytes_per_entry + out_row + 4))


def _gather_table(on_gpu: bool, quick: bool, repeats: int, rng, impl: str):
    if on_gpu:
        cases = [("csa", 64, 32768), ("csa", 512, 32768), ("hca", 64, 32768), ("swa", 64, 32768),
                 ("swa", 512, 32768)]
    elif quick:
        cases = [("csa", 8, 4096), ("hca", 8, 4096), ("swa", 8, 4096)]
    else:
        cases = [("csa", 64, 16384), ("hca", 64, 16384), ("swa", 64, 16384)]
    results = []
    for kind, count, context in cases:
        shape, fn, moved = _gather_rows(kind, count, context, rng, impl)
        jax.block_until_ready(fn())
        t, t_copy = _copy_seconds(moved // 2, repeats, fn)
        gbps, copy_gbps = moved / t / 1e9, moved / t_copy / 1e9
        results.append({"kernel": kind, "shape": shape, "us": t * 1e6, "gb_per_s": gbps,
                        "copy_gb_per_s": copy_gbps, "bw_ratio": gbps / copy_gbps})
    return results


def _attention_inputs(rng, batch, length):
    pages_per_seq = length // PAGE_SIZE
    num_pages = batch * pages_per_seq + 1
    shape = (KV_HEADS, num_pages, PAGE_SIZE, HEAD_DIM)
    k = jnp.asarray(rng.standard_normal(shape, dtype=np.float32), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal(shape, dtype=np.float32), jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((batch, HEADS, HEAD_DIM), dtype=np.float32), jnp.bfloat16)
    tables = jnp.asarray(1 + rng.permutation(batch * pages_per_seq).reshape(batch, pages_per_seq), jnp.int32)
    lengths = jnp.full((batch,), length, jnp.int32)
    return q, k, v, tables, lengths


def _attention_table(on_gpu: bool, quick: bool, repeats: int, rng, impl: str):
    if on_gpu:
        batches, lengths = (1, 8, 64), (1024, 4096, 16384, 32768)
    elif quick:
        batches, lengths = (1,), (1024,)
    else:
        batches, lengths = (1, 8), (1024, 4096)
    ours = jax.jit(functools.partial(paged_attention, implementation=impl))
    results = []
    for batch in batches:
        for length in lengths:
            q, k, v, tables, lens = _attention_inputs(rng, batch, length)
            scale = HEAD_DIM ** -0.5
            if on_gpu:
                theirs_tables, _ = pallas_gpu_block_tables(tables, lens)
                theirs = jax.jit(lambda q, k, v, t, n: jax_paged.paged_attention(q * scale, k, v, t, n))
                their_args = (q, k, v, theirs_tables, lens)
                baseline = "jax pallas paged_attention"
            else:
                k_dense = jnp.moveaxis(k[:, tables], 0, 3).reshape(batch, length, KV_HEADS, HEAD_DIM)
                v_dense = jnp.moveaxis(v[:, tables], 0, 3).reshape(batch, length, KV_HEADS, HEAD_DIM)
                theirs = jax.jit(lambda q, k, v, n: jax_paged.paged_attention_reference(q * scale, k, v, n))
                their_args = (q, k_dense, v_dense, lens)
                baseline = "jax paged_attention_reference (dense K/V)"
            mine = ours(q, k, v, tables, lens)
            other = theirs(*their_args)
            err = float(jnp.max(jnp.abs(mine.astype(jnp.float32) - other.astype(jnp.float32))))
            if not err < 0.05:
                raise AssertionError(f"paged_attention disagrees with {baseline} by {err} at "
                                     f"batch {batch}, length {length}")
            times = best_seconds_interleaved({"ours": lambda: ours(q, k, v, tables, lens),
                                              "theirs": lambda: theirs(*their_args)}, repeats)
            results.append({"batch": batch, "length": length, "ours_us": times["ours"] * 1e6,
                            "baseline_us": times["theirs"] * 1e6, "time_ratio": times["ours"] / times["theirs"],
                            "baseline": baseline, "max_abs_diff": err})
    return results


def _ragged_inputs(rng, decodes: int, context: int, piece: int, cached: int):
    """A packed step: ``decodes`` sequences of ``context`` tokens decoding
    one token each, then one sequence prefilling ``piece`` tokens after
    ``cached`` (its K/V, this step's included, already in the pages)."""
    seqs = decodes + (1 if piece else 0)
    kv_lens = np.array([context] * decodes + ([cached + piece] if piece else []), np.int32)
    q_lens = np.array([1] * decodes + ([piece] if piece else []), np.int32)
    width = -(-int(kv_lens.max()) // PAGE_SIZE)
    num_pages = seqs * width + 1
    shape = (KV_HEADS, num_pages, PAGE_SIZE, HEAD_DIM)
    k = jnp.asarray(rng.standard_normal(shape, dtype=np.float32), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal(shape, dtype=np.float32), jnp.bfloat16)
    tables = jnp.asarray(1 + rng.permutation(seqs * width).reshape(seqs, width), jnp.int32)
    q = jnp.asarray(rng.standard_normal((int(q_lens.sum()), HEADS, HEAD_DIM), dtype=np.float32), jnp.bfloat16)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32)
    return q, k, v, tables, jnp.asarray(kv_lens), cu


def _ragged_table(on_gpu: bool, quick: bool, repeats: int, rng, impl: str):
    from jaxkv.nn.attention import paged_prefill_attention

    if on_gpu:
        cases = [("mixed", 56, 4096, 512, 1024), ("mixed", 120, 2048, 256, 0), ("decode", 64, 4096, 0, 0)]
    elif quick:
        cases = [("mixed", 8, 256, 32, 64), ("decode", 8, 256, 0, 0)]
    else:
        cases = [("mixed", 24, 1024, 128, 256), ("decode", 32, 1024, 0, 0)]
    ragged = jax.jit(functools.partial(ragged_paged_attention, implementation=impl))
    decode = jax.jit(functools.partial(paged_attention, implementation=impl))
    results = []
    for kind, decodes, context, piece, cached in cases:
        q, k, v, tables, kv_lens, cu = _ragged_inputs(rng, decodes, context, piece, cached)
        padded = 1 << max(0, piece - 1).bit_length()

        def baseline(q, k, v, tables, kv_lens):
            out = decode(q[:decodes], k, v, tables[:decodes], kv_lens[:decodes])
            if not piece:
                return out
            q_pre = jnp.pad(q[decodes:], ((0, padded - piece), (0, 0), (0, 0)))[None]
            pre = paged_prefill_attention(q_pre, k, v, tables[decodes:], jnp.full((1,), cached, jnp.int32),
                                          jnp.full((1,), piece, jnp.int32))[0, :piece]
            return jnp.concatenate([out, pre.astype(out.dtype)])

        base = jax.jit(baseline)
        mine, theirs = ragged(q, k, v, tables, kv_lens, cu), base(q, k, v, tables, kv_lens)
        err = float(jnp.max(jnp.abs(mine.astype(jnp.float32) - theirs.astype(jnp.float32))))
        if not err < 0.05:
            raise AssertionError(f"ragged_paged_attention disagrees with the decode + prefill baseline by {err} "
                                 f"({kind}: {decodes} decodes at {context}, piece {piece} after {cached})")
        times = best_seconds_interleaved({"ours": lambda: ragged(q, k, v, tables, kv_lens, cu),
                                          "theirs": lambda: base(q, k, v, tables, kv_lens)}, repeats)
        shape = f"{decodes} x 1 @ {context}" + (f" + {piece} @ {cached}" if piece else "")
        results.append({"case": kind, "shape": shape, "tokens": int(q.shape[0]), "seqs": int(tables.shape[0]),
                        "ours_us": times["ours"] * 1e6, "baseline_us": times["theirs"] * 1e6,
                        "time_ratio": times["ours"] / times["theirs"],
                        "baseline": "paged_attention" + (f" + prefill padded to {padded}" if piece else ""),
                        "max_abs_diff": err})
    return results


def main(args) -> int:
    on_gpu = jax.default_backend() == "gpu"
    impl = "pallas" if on_gpu else "reference"
    repeats = 3 if args.quick else (20 if on_gpu else 5)
    rng = np.random.default_rng(0)
    where = ("Pallas kernels on GPU" if on_gpu else
             "no GPU: pure-jnp REFERENCES only, smaller shapes; Pallas kernel figures not measured")
    print(f"{machine_description()}\n{where}")

    gathers = _gather_table(on_gpu, args.quick, repeats, rng, impl)
    print_table(f"gather kernels ({impl}) vs a device copy of the same bytes",
                ["kernel", "shape", "us", "GB/s", "copy GB/s", "bw ratio"],
                [[r["kernel"], r["shape"], r["us"], r["gb_per_s"], r["copy_gb_per_s"], r["bw_ratio"]]
                 for r in gathers])
    attention = _attention_table(on_gpu, args.quick, repeats, rng, impl)
    print_table(f"paged_attention ({impl}) vs {attention[0]['baseline']}",
                ["batch", "length", "ours us", "baseline us", "time ratio"],
                [[r["batch"], r["length"], r["ours_us"], r["baseline_us"], r["time_ratio"]] for r in attention])
    ragged = _ragged_table(on_gpu, args.quick, repeats, rng, impl)
    print_table(f"ragged_paged_attention ({impl}): one packed call vs paged_attention on the decodes "
                f"+ a padded prefill",
                ["case", "decodes @ context + piece @ cached", "T", "S", "ours us", "baseline us", "time ratio"],
                [[r["case"], r["shape"], r["tokens"], r["seqs"], r["ours_us"], r["baseline_us"], r["time_ratio"]]
                 for r in ragged])
    if args.json:
        print_json({"benchmark": "kernels", "machine": machine_description(), "implementation": impl,
                    "results": {"gather": gathers, "paged_attention": attention, "ragged_attention": ragged}})
    return 0
