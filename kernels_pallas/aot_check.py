"""Compile every kernel for a GPU that is not here, and report what it became.

    python -m kernels_pallas.aot_check [--target h100|a100] [--json] [--full] [--only TEXT]

Needs ``jax[cuda12]`` (0.10.x) installed; no GPU. It builds a deviceless
topology for the target (``jax.experimental.topologies.get_topology_desc``
with a ``GpuTargetConfig`` text proto: compute capability, SM count, shared
memory and register limits) and runs, per configuration,
``jax.jit(f).trace(...).lower(...).compile()`` against it: XLA's whole GPU
pipeline, Triton's passes, PTX and ``ptxas``, the 227 KiB shared-memory limit
included. It prints one row per configuration:

* ``ok`` or the error (``FAIL``);
* the kernel's launch grid and threads per program, and the shared memory
  Triton allocated, read from XLA's thunk sequence (``xla_dump_to``);
* registers per thread and spill bytes, from ``ptxas -v --gpu-name sm_XX``
  on the dumped PTX (``ptxas`` comes with the ``nvidia-cuda-nvcc`` wheel);
* the occupancy those give (programs per SM) beside the one jaxkv's default
  planned with (a lower bound), and the number of other XLA launches
  around the kernel (table padding, split merge, ...);
* for configurations the dispatch sends to the reference (float8 before
  sm_89), ``reference`` and the reason.

The default matrix covers what users run (DeepSeek-V4 and V3.2 gathers at
real sizes, GQA bf16/fp8 at head dims 64-512, page sizes 16 and 64, batch
1/8/64 at 1k-128k context, windows and soft caps, MLA 576/512 at 16 and 128
heads, float32 pages, a stacked pool read by a static and a traced layer
(also under ``lax.scan`` over the layers); the ragged kernel on
mixed, prefill-heavy and decode-only packed steps over the same axes, sinks
included: :func:`ragged_cases`); ``--full`` takes the whole product of the
decode kernel's axes (about 800 compiles).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import glob
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # no GPU: skip the driver version probe

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from kernels_pallas import _gpu  # noqa: E402
from kernels_pallas._util import ceil_div  # noqa: E402

__all__ = ["Case", "Result", "cases", "compile_case", "cuda_available", "main", "topology_device"]

TARGETS = {"h100": _gpu.H100, "a100": _gpu.A100}

# DeepSeek-V4 (Flash) cache at real sizes: 61 layers' worth is too much for
# one array, so one layer's CSA pool of a 1M-token budget (32 entries/page).
_DSV4_PAGES, _ENTRIES_PER_PAGE = 8192, 32


def cuda_available() -> bool:
    """Whether a CUDA PJRT plugin is importable (:func:`kernels_pallas._gpu.cuda_plugin_available`)."""
    return _gpu.cuda_plugin_available()


def target_config(spec: _gpu.GpuSpec) -> str:
    major, minor = spec.compute_capability
    return f"""
gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {spec.smem_per_sm}
  threads_per_core_limit: {spec.max_threads_per_sm}
  core_count: {spec.sm_count}
  fpus_per_core: {128 if major >= 9 else 64}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {3352320000000 if major >= 9 else 2039000000000}
  l2_cache_size: {52428800 if major >= 9 else 41943040}
  clock_rate_ghz: {1.98 if major >= 9 else 1.41}
  device_memory_size: 84929347584
  shared_memory_per_block_optin: {spec.smem_per_block}
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: {spec.registers_per_sm}
  registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: 9 minor: 8 }}
runtime_version {{ major: 12 minor: 8 patch: 0 }}
device_description_str: "{spec.name}"
"""


@functools.cache
def topology_device(target: str):
    """A compile-only device of the ``target`` GPU (no GPU needed)."""
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(platform="cuda", target_config=target_config(TARGETS[target]),
                                            topology="1x1x1")
    return topology.devices[0]


def _ptxas() -> str | None:
    try:
        import nvidia.cuda_nvcc as nvcc

        path = os.path.join(list(nvcc.__path__)[0], "bin", "ptxas")
        if os.access(path, os.X_OK):
            return path
    except ImportError:
        pass
    return shutil.which("ptxas")


# --------------------------------------------------------------------------
# Configurations.
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Case:
    """One configuration: ``build()`` returns ``(fn, args)`` with ``args``
    shape structs; ``fn`` calls one kernel through its public entry point
    (default dispatch, so the reference may be chosen)."""

    name: str
    kernel: str
    build: Callable
    params: dict = dataclasses.field(default_factory=dict)
    plan_kwargs: dict = dataclasses.field(default_factory=dict)  # paged_attention: plan()'s keywords


def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))


def _gather_case(kind: str, fmt_name: str, *, tokens=64, topk=512, batch=64, max_entries=2048, window=128,
                 pages=_DSV4_PAGES):
    import kernels_pallas as kp

    fmt = {"dsv4": kp.DSV4_FP8, "dsv32": kp.DSV32_FP8,
           "lossless": kp.EntryFormat.lossless(448, 64, "float32")}[fmt_name]

    def pool(lead):
        return kp.CompressedEntries.from_parts(_sds(lead + (fmt.nope_dim,), fmt.nope_dtype),
                                               _sds(lead + (fmt.num_groups,), fmt.scale_dtype),
                                               _sds(lead + (fmt.rope_dim,), fmt.out_dtype), fmt)

    width = ceil_div(max_entries, _ENTRIES_PER_PAGE)
    if kind == "csa":
        def build():
            return (lambda p, t, i, r, n: kp.gather_compressed_kv(p, t, i, r, num_entries=n),
                    (pool((pages, _ENTRIES_PER_PAGE)), _sds((batch, width), jnp.int32),
                     _sds((tokens, topk), jnp.int32), _sds((tokens,), jnp.int32), _sds((tokens,), jnp.int32)))
        params = dict(tokens=tokens, topk=topk, pages=pages)
    elif kind == "hca":
        def build():
            return (lambda p, t, n: kp.gather_all_compressed_kv(p, t, n, max_entries=max_entries),
                    (pool((pages, _ENTRIES_PER_PAGE)), _sds((batch, width), jnp.int32), _sds((batch,), jnp.int32)))
        params = dict(batch=batch, max_entries=max_entries, pages=pages)
    else:
        def build():
            return (kp.gather_swa_kv, (pool((batch * 4, window)), _sds((batch,), jnp.int32),
                                       _sds((batch,), jnp.int32)))
        params = dict(batch=batch, window=window)
    return Case(f"gather_{kind} {fmt_name} " + " ".join(f"{k}={v}" for k, v in params.items()),
                f"gather_{kind}", build, dict(params, format=fmt_name))


def _pool_specs(*, dtype, head_dim, page_size, seqs, context, kv_heads, mla_value_dim, layers):
    """Abstract pool arrays of an attention case: ``(width, q_dtype, dv,
    build)``; ``build()`` gives ``(k, v, k_scales, v_scales)`` for ``seqs``
    sequences whose tables cover ``context`` tokens (stacked ``[layers, ...]``
    when ``layers``)."""
    dtype = jnp.dtype(dtype)
    fp8 = dtype.itemsize == 1
    width = ceil_div(context, page_size)
    num_pages = seqs * width + 1
    lead = () if layers is None else (layers,)
    dv = None if mla_value_dim is not None else head_dim
    q_dtype = jnp.float32 if dtype == jnp.float32 else jnp.bfloat16

    def build():
        k = _sds(lead + (kv_heads, num_pages, page_size, head_dim), dtype)
        v = None if dv is None else _sds(lead + (kv_heads, num_pages, page_size, dv), dtype)
        ks = _sds(lead + (kv_heads, num_pages, page_size), jnp.float32) if fp8 else None
        vs = ks if (fp8 and v is not None) else None
        return k, v, ks, vs

    return width, q_dtype, dv, build


def _case_params(dtype, head_dim, dv, heads, kv_heads, page_size, shape: dict, options: dict, layers, layer,
                 knobs: dict) -> dict:
    """A case's name parameters: dtype, head dims, heads, page size, then
    ``shape``, the ``options`` that are set, the layer and the knobs."""
    params = dict(dtype=dtype.name, D=head_dim if dv is None else f"{head_dim}/{dv}", H=heads, KVH=kv_heads,
                  ps=page_size, **shape)
    params.update({key: value for key, value in options.items() if value})
    if layers:
        params["layer"] = f"{layer}/{layers}"
    params.update(knobs)
    return params


def _by_layer(call, layer, layers, num_args):
    """``(fn, extra args)`` of a case's call ``call(*args, layer=...)``:
    ``layer`` None or an int is passed as is; ``"traced"`` makes the layer
    one more (int32 scalar) argument of the compiled function; ``"scan"``
    runs ``call`` under ``lax.scan`` over all ``layers`` with the loop index
    as the layer (a decoder scanned over stacked layers), summing the outputs."""
    if layer == "traced":
        return (lambda *a: call(*a[:num_args], layer=a[num_args])), (_sds((), jnp.int32),)
    if layer == "scan":
        def scanned(*a):
            def step(acc, i):
                return acc + call(*a, layer=i).astype(jnp.float32), None
            first = jax.eval_shape(lambda *b: call(*b, layer=0), *a)
            return jax.lax.scan(step, jnp.zeros(first.shape, jnp.float32), jnp.arange(layers, dtype=jnp.int32))[0]
        return scanned, ()
    return (lambda *a: call(*a, layer=layer)), ()


def _attention_case(*, dtype, head_dim, page_size, batch, context, kv_heads=8, heads=32, window=None, cap=None,
                    mla_value_dim=None, layers=None, layer=None, **knobs):
    """A paged_attention call; ``layer`` None, an int, ``"traced"`` or
    ``"scan"`` (:func:`_by_layer`) of a stacked pool of ``layers``."""
    from kernels_pallas.paged_attention import paged_attention

    dtype = jnp.dtype(dtype)
    width, q_dtype, dv, pool = _pool_specs(dtype=dtype, head_dim=head_dim, page_size=page_size, seqs=batch,
                                           context=context, kv_heads=kv_heads, mla_value_dim=mla_value_dim,
                                           layers=layers)

    def build():
        k, v, ks, vs = pool()

        def call(q, k, v, t, n, ks, vs, *, layer):
            return paged_attention(q, k, v, t, n, ks, vs, layer=layer, sliding_window=window,
                                   logit_soft_cap=cap, mla_value_dim=mla_value_dim, **knobs)

        fn, extra = _by_layer(call, layer, layers, 7)
        return fn, (_sds((batch, heads, head_dim), q_dtype), k, v, _sds((batch, width), jnp.int32),
                    _sds((batch,), jnp.int32), ks, vs, *extra)

    kind = "mla" if mla_value_dim is not None else "gqa"
    params = _case_params(dtype, head_dim, dv, heads, kv_heads, page_size, dict(B=batch, ctx=context),
                          dict(window=window, cap=cap), layers, layer, knobs)
    name = f"attn_{kind} " + " ".join(f"{k}={v}" for k, v in params.items())
    plan_kwargs = dict(mla_value_dim=mla_value_dim, layer=None if layer is None else 0, **knobs)
    return Case(name, f"paged_attention_{kind}", build, params, plan_kwargs)


def _ragged_case(*, dtype, head_dim, page_size, tokens, seqs, context, kv_heads=8, heads=32, window=None, cap=None,
                 sinks=False, mla_value_dim=None, layers=None, layer=None, **knobs):
    """A ragged_paged_attention call: ``tokens`` packed queries over ``seqs``
    sequences whose tables cover ``context`` tokens each."""
    from kernels_pallas.ragged_attention import ragged_paged_attention

    dtype = jnp.dtype(dtype)
    width, q_dtype, dv, pool = _pool_specs(dtype=dtype, head_dim=head_dim, page_size=page_size, seqs=seqs,
                                           context=context, kv_heads=kv_heads, mla_value_dim=mla_value_dim,
                                           layers=layers)

    def build():
        k, v, ks, vs = pool()
        sink = _sds((heads,), jnp.float32) if sinks else None

        def call(q, k, v, t, n, cu, ks, vs, sink, *, layer):
            return ragged_paged_attention(q, k, v, t, n, cu, ks, vs, layer=layer, sliding_window=window,
                                          logit_soft_cap=cap, sinks=sink, mla_value_dim=mla_value_dim, **knobs)

        fn, extra = _by_layer(call, layer, layers, 9)
        return fn, (_sds((tokens, heads, head_dim), q_dtype), k, v, _sds((seqs, width), jnp.int32),
                    _sds((seqs,), jnp.int32), _sds((seqs + 1,), jnp.int32), ks, vs, sink, *extra)

    kind = "mla" if mla_value_dim is not None else "gqa"
    params = _case_params(dtype, head_dim, dv, heads, kv_heads, page_size, dict(T=tokens, S=seqs, kv=context),
                          dict(window=window, cap=cap, sinks=sinks or None), layers, layer, knobs)
    name = f"ragged_{kind} " + " ".join(f"{k}={v}" for k, v in params.items())
    plan_kwargs = dict(mla_value_dim=mla_value_dim, layer=None if layer is None else 0, soft_cap=bool(cap),
                       sinks=sinks, **knobs)
    return Case(name, f"ragged_paged_attention_{kind}", build, params, plan_kwargs)


def ragged_cases() -> list[Case]:
    """The ragged kernel's matrix: a mixed step (64 sequences, 512 tokens:
    decodes + prefill pieces), a prefill-heavy step (8 x 256), decodes only
    (64 x 1) at head dims 64-512, bf16/fp8/float32 pages, page sizes 16 and
    64, windows, soft caps, sinks, MLA 576/512 at 16 and 128 heads, a
    stacked pool read by a static and a traced layer (also under ``lax.scan``)."""
    out = []
    steps = ((512, 64, 4096), (2048, 8, 8192), (64, 64, 16384))
    for i, (dt, d) in enumerate(itertools.product(("bfloat16", "float8_e4m3fn"), (64, 128, 256, 512))):
        heads, kvh = (32, 8) if d <= 128 else (16, 4)
        t, s, ctx = steps[i % len(steps)]
        out.append(_ragged_case(dtype=dt, head_dim=d, page_size=16 if i % 2 == 0 else 64, tokens=t, seqs=s,
                                context=ctx, heads=heads, kv_heads=kvh, window=4096 if i % 3 == 1 else None,
                                cap=30.0 if i % 3 == 2 else None, sinks=i % 2 == 1))
    for t, s, ctx in steps:  # the step mixes at the common shape
        out.append(_ragged_case(dtype="bfloat16", head_dim=128, page_size=16, tokens=t, seqs=s, context=ctx))
    for dt, heads in itertools.product(("bfloat16", "float8_e4m3fn"), (16, 128)):
        out.append(_ragged_case(dtype=dt, head_dim=576, mla_value_dim=512, page_size=64, tokens=256, seqs=16,
                                context=8192, heads=heads, kv_heads=1))
    out.append(_ragged_case(dtype="float32", head_dim=128, page_size=16, tokens=512, seqs=64, context=4096))
    out.append(_ragged_case(dtype="bfloat16", head_dim=128, page_size=16, tokens=512, seqs=64, context=4096,
                            layers=4, layer=2))
    # A traced layer (also a lax.scan over stacked layers), read in place too:
    # the kernel bodies of static cases above (their measured.json keys).
    out.append(_ragged_case(dtype="bfloat16", head_dim=128, page_size=16, tokens=512, seqs=64, context=4096,
                            layers=4, layer="traced"))
    out.append(_ragged_case(dtype="float8_e4m3fn", head_dim=128, page_size=64, tokens=64, seqs=64, context=16384,
                            window=4096, cap=30.0, sinks=True, layers=4, layer="scan"))
    out.append(_ragged_case(dtype="float8_e4m3fn", head_dim=576, mla_value_dim=512, page_size=64, tokens=256,
                            seqs=16, context=8192, heads=16, kv_heads=1, layers=4, layer="traced"))
    return out


def cases(full: bool = False) -> list[Case]:
    """The configuration matrix (see the module docstring)."""
    out = [_gather_case(kind, fmt) for fmt in ("dsv4", "dsv32", "lossless") for kind in ("csa", "hca", "swa")]
    # 32-bit offsets: a DSV4 NoPE pool of 2.6 GB (refused: would wrap) and one above 4 GiB (64-bit offsets).
    out.append(_gather_case("hca", "dsv4", pages=180_000))
    out.append(_gather_case("hca", "dsv4", pages=320_000))
    batches = ((1, 131072), (8, 32768), (64, 1024), (8, 8192), (1, 1024), (64, 16384))
    head_dims, page_sizes, dtypes = (64, 128, 256, 512), (16, 64), ("bfloat16", "float8_e4m3fn")
    if full:
        grid = itertools.product(dtypes, head_dims, page_sizes, batches, (None, 4096), (None, 30.0))
    else:
        # Every dtype x head dim x page size, with the batch/context pairs,
        # windows and soft caps rotated through them.
        grid = ((dt, d, ps, batches[i % len(batches)], 4096 if i % 2 else None, 30.0 if i % 3 == 0 else None)
                for i, (dt, d, ps) in enumerate(itertools.product(dtypes, head_dims, page_sizes)))
    for dt, d, ps, (b, ctx), window, cap in grid:
        heads, kvh = (64, 8) if d <= 128 else (16, 4)
        out.append(_attention_case(dtype=dt, head_dim=d, page_size=ps, batch=b, context=ctx, heads=heads,
                                   kv_heads=kvh, window=window, cap=cap))
    if not full:
        for b, ctx in batches[:3]:  # the batch/context sweep at the common shape
            out.append(_attention_case(dtype="bfloat16", head_dim=128, page_size=16, batch=b, context=ctx))
    # MLA (DeepSeek-V3 latent 512 + RoPE 64), 16 and 128 heads, bf16 and fp8.
    for dt, heads, ps in itertools.product(dtypes, (16, 128), (16, 64)):
        out.append(_attention_case(dtype=dt, head_dim=576, mla_value_dim=512, page_size=ps, batch=8,
                                   context=8192, heads=heads, kv_heads=1))
    for bh in (32,):  # MLA 128 heads: a larger head block, measured (64 needs 288 KiB of smem: refused)
        out.append(_attention_case(dtype="bfloat16", head_dim=576, mla_value_dim=512, page_size=64, batch=8,
                                   context=8192, heads=128, kv_heads=1, block_h=bh))
    # float32 pages.
    for d in (64, 128, 256):
        out.append(_attention_case(dtype="float32", head_dim=d, page_size=16, batch=8, context=4096,
                                   heads=32, kv_heads=8))
    # A layer of a stacked 4-layer pool read in place.
    out.append(_attention_case(dtype="bfloat16", head_dim=128, page_size=16, batch=8, context=8192,
                               layers=4, layer=2))
    # A traced layer (also a lax.scan over stacked layers), read in place too:
    # bf16, fp8, MLA, the kernel bodies of static cases above (their measured.json keys).
    out.append(_attention_case(dtype="bfloat16", head_dim=128, page_size=16, batch=8, context=8192,
                               layers=4, layer="traced"))
    out.append(_attention_case(dtype="float8_e4m3fn", head_dim=128, page_size=16, batch=8, context=8192,
                               window=4096, layers=4, layer="scan"))
    out.append(_attention_case(dtype="float8_e4m3fn", head_dim=576, mla_value_dim=512, page_size=64, batch=8,
                               context=8192, heads=128, kv_heads=1, layers=4, layer="traced"))
    out.extend(ragged_cases())
    return out


# --------------------------------------------------------------------------
# Compiling and reading the artifacts.
# --------------------------------------------------------------------------


@dataclasses.dataclass
class Result:
    """What one configuration compiled to (None: not applicable or not read)."""

    name: str
    target: str
    status: str  # "ok", "FAIL", "reference"
    detail: str = ""  # error or fallback reason
    kernel: str | None = None
    grid: tuple | None = None
    threads: int | None = None
    smem_bytes: int | None = None
    registers: int | None = None
    spill_bytes: int | None = None
    occupancy: int | None = None
    planned: dict | None = None  # paged/ragged attention: the KernelShape / RaggedShape the default chose
    other_launches: int | None = None
    ptx_loads: tuple | None = None  # (global loads before the first global store, loads after it)
    seconds: float = 0.0
    hlo_copies: list = dataclasses.field(default_factory=list)  # attention: copies of a layer's pool

    def row(self) -> str:
        if self.status != "ok":
            return f"{self.status:9s} {self.name}: {self.detail}"
        copies = f" POOL COPIES: {self.hlo_copies}" if self.hlo_copies else ""
        plan = ""
        if self.planned and "k_splits" in self.planned:
            p = self.planned
            plan = (f" plan(tok={p['block_tokens']} bh={p['block_h']} splits={p['k_splits']} "
                    f"st={p['num_stages']} smem<={p['smem_bytes']} occ={p['occupancy']} {p['occupancy_from']})")
        elif self.planned:
            p = self.planned
            plan = (f" plan(bq={p['block_q']} rows={p['block_rows']}x{p['row_blocks']} tok={p['block_tokens']} "
                    f"st={p['num_stages']} smem<={p['smem_bytes']} occ={p['occupancy']} {p['occupancy_from']})")
        return (f"ok        {self.name}: grid={list(self.grid)} threads={self.threads} smem={self.smem_bytes} "
                f"regs={self.registers} spill={self.spill_bytes} occ={self.occupancy} "
                f"launches+{self.other_launches}{plan}{copies} [{self.seconds:.1f}s]")


_THUNK = re.compile(r"^\d+: \S+ \[.*?\] (\S+) grid: \[(\d+), (\d+), (\d+)\] threads: \[(\d+), (\d+), (\d+)\]"
                    r"\s+shared_memory: (\d+) bytes")


def _read_thunks(dump_dir: str) -> list[tuple]:
    files = glob.glob(os.path.join(dump_dir, "*.thunk_sequence.txt"))
    rows = []
    for line in open(files[0]).read().splitlines() if files else []:
        m = _THUNK.match(line.strip())
        if m:
            g = tuple(int(x) for x in m.group(2, 3, 4))
            rows.append((m.group(1), g, int(m.group(5)) * int(m.group(6)) * int(m.group(7)), int(m.group(8))))
    return rows


def _kernel_ptx(dump_dir: str, kernel: str) -> tuple[str, str] | None:
    for path in glob.glob(os.path.join(dump_dir, "*.ptx")):
        text = open(path).read()
        if f".entry {kernel}(" in text:
            return path, text
    return None


def _load_store_order(ptx: str) -> tuple[int, int]:
    ops = re.findall(r"\b(ld|st)\.global", ptx)
    first = ops.index("st") if "st" in ops else len(ops)
    return ops[:first].count("ld"), ops[first:].count("ld")


def _ptxas_info(ptx_path: str, sm: str) -> tuple[int | None, int | None]:
    """Registers per thread and spill bytes (stores + loads) of a PTX file."""
    ptxas = _ptxas()
    if ptxas is None:
        return None, None
    out = subprocess.run([ptxas, "-v", f"--gpu-name={sm}", ptx_path, "-o", os.devnull],
                         capture_output=True, text=True, check=False).stderr
    regs = re.search(r"Used (\d+) registers", out)
    spills = re.findall(r"(\d+) bytes spill (?:stores|loads)", out)
    return (int(regs.group(1)) if regs else None), sum(int(x) for x in spills)


def _big_copies(hlo: str, min_bytes: int) -> list[str]:
    """Instructions of the compiled HLO that make a buffer of at least
    ``min_bytes`` by copy, slice or fusion (a kernel operand XLA
    materialised, e.g. a layer sliced out of a stacked pool)."""
    sizes = {"f32": 4, "s32": 4, "bf16": 2, "f16": 2, "f8e4m3fn": 1, "f8e5m2": 1, "u8": 1, "s8": 1}
    found = []
    for line in hlo.splitlines():
        m = re.search(r"= (\w+)\[([\d,]*)\]\{[^}]*\} (copy|fusion|slice|dynamic-slice)\(", line)
        if not m or m.group(1) not in sizes:
            continue
        n = sizes[m.group(1)]
        for d in filter(None, m.group(2).split(",")):
            n *= int(d)
        if n >= min_bytes:
            found.append(line.strip()[:160])
    return found


def compile_case(case: Case, target: str = "h100") -> Result:
    """Compile ``case`` for ``target`` and read its artifacts."""
    from jax.sharding import SingleDeviceSharding

    from kernels_pallas import _dispatch
    from kernels_pallas.paged_attention import plan
    from kernels_pallas.ragged_kernel import plan_ragged

    spec = TARGETS[target]
    sharding = SingleDeviceSharding(topology_device(target))
    result = Result(case.name, target, "ok")
    started = time.perf_counter()
    with _gpu.building_for(spec), tempfile.TemporaryDirectory() as dump:
        fn, args = case.build()
        args = jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding), args)
        try:
            import warnings

            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", _dispatch.KernelFallbackWarning)
                traced = jax.jit(fn).trace(*args)
            fallback = [w for w in caught if issubclass(w.category, _dispatch.KernelFallbackWarning)]
            lowered = traced.lower(lowering_platforms=("cuda",))
            compiled = lowered.compile(compiler_options={
                "xla_dump_to": dump, "xla_backend_optimization_level": 3})
        except Exception as e:  # noqa: BLE001  the error is the report
            result.status, result.detail = "FAIL", f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            result.seconds = time.perf_counter() - started
            return result
        thunks = _read_thunks(dump)
        kernels = [t for t in thunks if t[0].startswith("jaxkv_")]
        if "paged_attention" in case.kernel and kernels:
            pages = args[1]  # K pages: one layer's pool is the smallest buffer a layer copy would make
            layer_bytes = pages.size * pages.dtype.itemsize // (pages.shape[0] if pages.ndim == 5 else 1)
            result.hlo_copies = _big_copies(compiled.as_text(), layer_bytes)
        if fallback:
            result.status, result.detail = "reference", str(fallback[0].message)
            result.other_launches = len(thunks)
        elif not kernels:
            result.status, result.detail = "FAIL", "no jaxkv kernel in the compiled program"
        else:
            name, grid, threads, smem = kernels[0]
            result.kernel, result.grid, result.threads, result.smem_bytes = name, grid, threads, smem
            result.other_launches = len(thunks) - len(kernels)
            found = _kernel_ptx(dump, name)
            if found:
                result.ptx_loads = _load_store_order(found[1])
                arch = f"sm_{spec.sm}a" if spec.sm >= 90 else f"sm_{spec.sm}"  # wgmma needs the "a" target
                result.registers, result.spill_bytes = _ptxas_info(found[0], arch)
            if result.registers is not None:
                result.occupancy = _gpu.occupancy(spec, smem_bytes=smem, num_warps=threads // 32,
                                                  registers=result.registers)
            if case.kernel.startswith("paged_attention"):
                q, k, v, t = args[:4]
                result.planned = dataclasses.asdict(plan(q, k, v, t, spec=spec, soft_cap=bool(case.params.get("cap")),
                                                         **case.plan_kwargs))
            elif case.kernel.startswith("ragged_paged_attention"):
                q, k, v, t, n = args[:5]
                result.planned = dataclasses.asdict(plan_ragged(q, k, v, t, n, spec=spec, **case.plan_kwargs))
    result.seconds = time.perf_counter() - started
    return result


MEASURED = os.path.join(os.path.dirname(__file__), "measured.json")


def record(results: list[Result], spec: _gpu.GpuSpec, path: str = MEASURED) -> None:
    """Merge the measured shared memory and registers of ``results`` into ``path``."""
    table = json.load(open(path)) if os.path.exists(path) else {}
    entries = table.setdefault(f"sm_{spec.sm}", {})
    for r in results:
        if "layer=traced" in r.name or "layer=scan" in r.name:
            # The same key as the static layer's kernel (one more scalar
            # load): measured.json keeps the static kernel's numbers.
            continue
        if r.status == "ok" and r.planned and r.registers is not None:
            entries[r.planned["key"]] = {"smem_bytes": r.smem_bytes, "registers": r.registers}
    table[f"sm_{spec.sm}"] = dict(sorted(entries.items()))
    with open(path, "w") as f:
        json.dump(table, f, indent=1)
        f.write("\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kernels_pallas.aot_check", description=__doc__.split("\n")[0])
    parser.add_argument("--target", choices=sorted(TARGETS), default="h100")
    parser.add_argument("--json", action="store_true", help="one JSON object per configuration")
    parser.add_argument("--full", action="store_true", help="the whole product of the matrix axes")
    parser.add_argument("--only", default="", help="only configurations whose name contains this text")
    parser.add_argument("--record", action="store_true",
                        help="write the measured shared memory and registers of every compiled paged_attention "
                             "and ragged_paged_attention kernel to kernels_pallas/measured.json (the occupancy "
                             "their plans report)")
    args = parser.parse_args(argv)
    if not cuda_available():
        print("kernels_pallas.aot_check needs the CUDA plugin: pip install 'jax[cuda12]>=0.10,<0.11'",
              file=sys.stderr)
        return 2
    failures = 0
    selected = [c for c in cases(args.full) if args.only in c.name]
    if not args.json:
        print(f"# {len(selected)} configurations, compiled for {TARGETS[args.target].name} "
              f"(sm_{TARGETS[args.target].sm}) without a GPU; jax {jax.__version__}")
    results = []
    for case in selected:
        r = compile_case(case, args.target)
        results.append(r)
        failures += r.status == "FAIL" or bool(r.spill_bytes) or bool(r.hlo_copies)
        print(json.dumps(dataclasses.asdict(r)) if args.json else r.row(), flush=True)
    if args.record:
        record(results, TARGETS[args.target])
    if not args.json:
        print(f"# {failures} configuration(s) failed, spilled registers or copied a pool-sized buffer")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
