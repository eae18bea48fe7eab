"""What the engine's programs need beside its cache: their temporaries,
read from XLA's compiled memory analysis before the cache is allocated.

The default KV budget is a fraction (:data:`~jaxkv.serve.sizing.DEFAULT_MEMORY_FRACTION`,
0.8) of the device's free memory after the weights: the rest is left for
the programs that run over the cache. A fraction is not a measurement. A
model whose weights take most of the device leaves little: DeepSeek-V4-Flash
on eight 80 GB H100s keeps 73.2 GB of weights on each, the default took 0.8
of the 6.8 GB left and its programs needed 2.3-2.4 GB of temporaries, past
the 1.4 GB the fraction left (peak 81 GB: out of memory at the first step).
vLLM sizes its cache from what a profiled forward pass leaves; the same
figure is available here without running anything: lower the engine's
programs at the shapes they will run at (:class:`jax.ShapeDtypeStruct`
arguments: nothing allocated), compile them, and read
``compiled.memory_analysis().temp_size_in_bytes``.

:func:`engine_programs` builds those programs: the packed step at the
largest stream length (the token budget; the padded scheduler's
``[max_seqs, prefill_chunk]`` prefill call instead) and the decode chunk,
each as the engine calls it (the same jitted functions, static arguments,
shapes and dtypes), with the cache's arrays as shapes. :func:`measure`
compiles them. The engine (:func:`jaxkv.serve.build.build_cache`) then
sizes the cache so that the cache, the largest temporaries and
:data:`PROGRAM_MARGIN` fit the free memory.

The arguments are unplaced shapes on one device, which is what the engine's
own arrays are there, so jit's cache serves the engine's first call of the
same program from this compile when the plan did not change; on a mesh they
carry the placement's shardings. A speculative engine's programs (verify
lanes, the speculative chunk) are not among them: their temporaries are
those of the same model over ``k + 1`` tokens a row, and they are not
measured.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

from jaxkv._ops import pow2_at_least

__all__ = ["PROGRAM_MARGIN", "MeasuredPrograms", "ProgramMemory", "admission", "as_shapes", "engine_programs",
           "measure", "packed_batch", "row_inputs"]

#: Bytes kept free beside the cache and the programs' temporaries: what the
#: runtime allocates outside a program's buffers (GEMM workspaces, the
#: collectives' buffers, allocator fragmentation).
PROGRAM_MARGIN = 512 << 20


@dataclasses.dataclass(frozen=True)
class ProgramMemory:
    """Temporary bytes per program (``(label, bytes)``, one device's) and
    the seconds the compiles took."""

    temp_bytes: tuple[tuple[str, int], ...]
    seconds: float

    @property
    def largest(self) -> int:
        return max((n for _, n in self.temp_bytes), default=0)

    def words(self) -> str:
        parts = ", ".join(f"{label} {n / 2**20:.0f} MiB" for label, n in self.temp_bytes)
        return f"the programs' temporaries ({parts}; compiled in {self.seconds:.1f} s)"


def as_shapes(tree, shardings):
    """``tree``'s leaves as ``jax.ShapeDtypeStruct``s carrying ``shardings``
    (one sharding for every leaf, or a pytree of them shaped like ``tree``)."""
    if shardings is None or isinstance(shardings, jax.sharding.Sharding):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings), tree)
    return jax.tree.map(lambda x, where: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=where), tree, shardings)


def row_inputs(max_seqs: int, sharding=None):
    """The per-row inputs every program takes, as shapes: a maker of
    ``[max_seqs]`` (or ``shape``) arrays, the rows' sampling
    (:class:`~jaxkv.nn.sampling.RowSampling`) and the PRNG keys' data, as
    the engine passes them (:func:`jaxkv.serve.caches.typed_keys`)."""
    from jaxkv.nn.sampling import RowSampling

    def vec(dtype, shape=None):
        return jax.ShapeDtypeStruct((max_seqs,) if shape is None else shape, jnp.dtype(dtype), sharding=sharding)

    sampling = RowSampling(vec(jnp.float32), vec(jnp.int32), vec(jnp.float32))
    keys = jax.eval_shape(lambda: jax.random.key_data(jax.random.split(jax.random.key(0), max_seqs)))
    return vec, sampling, jax.ShapeDtypeStruct(keys.shape, keys.dtype, sharding=sharding)


def admission(vec, manager) -> tuple:
    """A paged packed step's admission arguments as shapes (``vec``:
    :func:`row_inputs`' maker; ``manager``: the paged cache's): ``(rows,
    prefix blocks, lengths)``, as the paged cache's packed step takes them."""
    return vec(jnp.int32), vec(jnp.int32, manager.block_tables.shape), vec(jnp.int32)


def packed_batch(max_seqs: int, tokens: int, budget: int, has_gdn: bool, sharding=None):
    """The :class:`~jaxkv.nn.packed.PackedBatch` of a stream of ``tokens``
    as the caches' ``_packed_call`` packs it, as shapes: ``max_seqs``
    prefill lanes of ``tokens``; with Gated DeltaNet layers the largest
    lane class a stream of ``tokens`` takes, ``P = min(pow2(min(tokens,
    max_seqs)), max_seqs)`` lanes of ``budget // P``
    (:meth:`~jaxkv.serve.hybrid_cache.HybridCache.prefill_lane_cap`)."""
    from jaxkv.nn.packed import pack

    rows, width = max_seqs, tokens
    if has_gdn:
        rows = min(pow2_at_least(min(tokens, max_seqs)), max_seqs)
        width = min(tokens, max(budget // rows, 1))
    batch = jax.eval_shape(lambda: pack([], num_lanes=max_seqs, num_tokens=tokens, num_prefill_lanes=rows,
                                        max_prefill_len=width, num_prefill=0))
    return batch if sharding is None else as_shapes(batch, sharding)


def engine_programs(graphdef, params, cache: tuple, *, kind: str, max_seqs: int, decode_chunk: int,
                    stream_length: int | None, prefill_chunk: int, has_gdn: bool = False, window=None,
                    scrub: bool = False, sharding=None) -> list[tuple[str, Callable, tuple, dict]]:
    """``(label, jitted function, args, static kwargs)`` of the engine's
    largest programs: the packed step over ``stream_length`` tokens (None:
    the padded scheduler's prefill call of ``prefill_chunk`` a row) and the
    decode chunk of ``decode_chunk`` steps. ``cache``: the cache's arrays
    as the programs take them, as shapes (a paged cache's ``(manager
    without its host allocator, pool)``, a hybrid cache's ``(manager,)``);
    ``kind`` ``"paged"`` or ``"hybrid"``; ``window`` (a paged cache's),
    ``scrub``: the cache's static arguments; ``sharding``: the per-row inputs' (None on
    one device; replicated on a mesh)."""
    from jaxkv.serve import hybrid_cache, paged_cache
    from jaxkv.serve.caches import decode_chunk as decode_program

    vec, sampling, keys = row_inputs(max_seqs, sharding)
    out = []
    if stream_length is not None:
        batch = packed_batch(max_seqs, stream_length, stream_length, has_gdn, sharding)
        if kind == "paged":
            out.append((f"packed[{stream_length}]", paged_cache.jitted_packed,
                        (graphdef, params, *cache, admission(vec, cache[0]), batch, sampling, keys),
                        dict(window=window, scrub=scrub)))
        else:
            out.append((f"packed[{stream_length}]", hybrid_cache.jitted_packed,
                        (graphdef, params, *cache, batch, sampling, keys), {}))
    else:
        tokens = vec(jnp.int32, (max_seqs, prefill_chunk))
        label = f"prefill {max_seqs}x{prefill_chunk}"
        if kind == "paged":
            out.append((label, paged_cache.jitted_prefill, (graphdef, params, *cache, vec(jnp.int32),
                                                            vec(jnp.int32), vec(jnp.int32), tokens, sampling, keys),
                        {}))
        else:
            out.append((label, hybrid_cache.jitted_prefill, (graphdef, params, *cache, vec(jnp.int32), tokens,
                                                             vec(jnp.int32), sampling, keys), {}))
    manager, pool = cache if kind == "paged" else (cache[0], None)
    out.append((f"decode chunk x{decode_chunk}", decode_program,
                (graphdef, params, manager, pool, vec(jnp.int32), vec(jnp.bool_), vec(jnp.int32), vec(jnp.int32),
                 vec(jnp.int32), sampling, keys),
                dict(num_steps=decode_chunk, scrub=scrub)))
    return out


def measure(programs: list[tuple[str, Callable, tuple, dict]], compile_program=None) -> ProgramMemory:
    """Lower and compile each of ``programs`` (:func:`engine_programs`) and
    read its temporary bytes from XLA's memory analysis (0 where a backend
    gives none). ``compile_program(fn, args, kwargs)``: how to compile one
    (default: for the default backend, as the engine's call would; the
    deviceless H100 bench compiles for CUDA instead)."""
    start = time.perf_counter()
    temps = []
    for label, fn, args, kwargs in programs:
        if compile_program is None:
            compiled = fn.lower(*args, **kwargs).compile()
        else:
            compiled = compile_program(fn, args, kwargs)
        analysis = compiled.memory_analysis()
        temps.append((label, int(getattr(analysis, "temp_size_in_bytes", 0) or 0)))
    return ProgramMemory(tuple(temps), time.perf_counter() - start)


class MeasuredPrograms:
    """The engine's programs measured over a cache's shapes (what
    :func:`jaxkv.serve.build.room_for_programs` calls): ``self(shapes)``
    measures them with the packed step over ``token_budget`` tokens
    (``measure_at(shapes, tokens)`` -> :class:`ProgramMemory`, the packed
    step first). ``lowerable`` (the token budget was derived, not given):
    :meth:`lower` may pick a smaller one, at least ``floor`` (one token per
    sequence row: a packed step carries every decoding row's)."""

    def __init__(self, measure_at, token_budget: int | None, *, lowerable: bool = False, floor: int = 1):
        self._measure_at = measure_at
        self.token_budget = token_budget
        self.lowerable = lowerable and token_budget is not None
        self.floor = floor
        #: Set by :func:`~jaxkv.serve.build.room_for_programs` when the programs limited the cache: their
        #: measure and the bytes they left it.
        self.measured: ProgramMemory | None = None
        self.limited_to: int | None = None

    def __call__(self, shapes) -> ProgramMemory:
        return self._measure_at(shapes, self.token_budget)

    def lower(self, shapes, measured: ProgramMemory, allowed: int) -> ProgramMemory | None:
        """The largest token budget below ``token_budget`` (a packed stream
        length, :func:`jaxkv.serve.scheduler.stream_buckets`, at least
        ``floor``) whose programs' largest temporaries are at most
        ``allowed`` bytes, measured; ``token_budget`` set to it and its
        measure returned. None (nothing changed) when not lowerable or none
        fits. The first length tried is where the packed step's temporaries,
        drawn as a line through the decode chunk's (its step at no prompt
        token) and ``measured``'s, reach ``allowed``; then each smaller
        length until one fits."""
        from jaxkv.serve.scheduler import stream_buckets

        if not self.lowerable:
            return None
        packed, decode = measured.temp_bytes[0][1], measured.temp_bytes[-1][1]
        if decode > allowed:
            return None  # the decode chunk alone does not fit: no token budget helps
        per_token = max(packed - decode, 0) / self.token_budget
        guess = (allowed - decode) / per_token if per_token else self.token_budget
        lengths = [n for n in stream_buckets(self.token_budget) if self.floor <= n < self.token_budget]
        if self.floor < self.token_budget and self.floor not in lengths:
            lengths = sorted(set(lengths) | {self.floor})
        for tokens in sorted((n for n in lengths if n <= max(guess, self.floor)), reverse=True):
            memory = self._measure_at(shapes, tokens)
            if memory.largest <= allowed:
                self.token_budget = tokens
                return memory
        return None
