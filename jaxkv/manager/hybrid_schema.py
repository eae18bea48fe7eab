"""Layer schedules and per-layer cache schemas of hybrid models (seed 004).

A hybrid model mixes attention kinds layer by layer. Each kind stores
something different per token and per request:

=========  ==================================================  ==========================
kind       paged (allocated in blocks as the request grows)    per-request state (fixed)
=========  ==================================================  ==========================
``full``   K/V of every token (``KVPool`` pages)               --
``mla``    one latent + RoPE per token (``KVPool``, MLA mode)  --
``swa``    --                                                  ring of the last W tokens
``csa``    one entry per 4 tokens (32 per 128-token block)     SWA ring; compressor ring
           + its fp8 indexer key                               (2r x 2d kv/score) and the
                                                               indexer's (2r x 2*index_dim)
``hca``    one entry per 128 tokens (1 per block)              SWA ring; compressor ring
                                                               (r x d kv/score)
``linear`` --                                                  Gated DeltaNet recurrent +
                                                               conv state (``GDNPool``)
``window`` --                                                  K/V ring of the last W
                                                               tokens (``WindowLayerCache``)
=========  ==================================================  ==========================

``window`` is the sliding-window layer of interleaved models (gpt-oss,
Gemma 3): GQA K/V like ``full`` (``num_kv_heads`` x ``kv_head_dim``, in
``window_dtype``), but only the last ``window`` tokens, per request.

``swa``, ``csa`` and ``hca`` are DeepSeek-V4's layers (compression ratio 0,
4, 128 in its ``compress_ratios``): every one attends its sliding window, CSA
layers add top-k compressed entries picked by the indexer, HCA layers add
every compressed entry. Compressed entries and SWA tokens are stored in
:data:`kernels_pallas.DSV4_FP8` (448 fp8 NoPE values with a ue8m0 scale per
64 + 64 bf16 RoPE values, 584 bytes); indexer keys in :data:`INDEXER_FP8`
(128 fp8 values, one fp32 scale, 132 bytes).

Compressor state (fp32, per request, a ring indexed by ``position % rows``):
entry ``i`` of a layer with ratio ``r`` and overlap ``o`` (2 for CSA, 1 for
HCA) pools the ``o * r`` tokens ``[(i + 1) * r - o * r, (i + 1) * r)``; the
ring keeps exactly those rows (``o * r`` of them, ``o * d`` wide: window ``k``
of the ``o`` contributes channel block ``k``). Initial kv 0, score -inf, so
rows before position 0 weigh nothing.

Blocks: compressed layers allocate blocks of 128 *original* tokens (32 CSA
entries, 1 HCA entry); full/MLA layers allocate pages of ``page_size``
tokens. Layers of the same kind and ratio allocate at exactly the same times,
so they share one allocator and one block table (a *group*, as vLLM's KV cache
groups), each layer with its own pool arrays indexed by the shared block ids.
"""

from __future__ import annotations

import dataclasses
import enum
import jax.numpy as jnp

from jaxkv import _host
from jaxkv._ops import ceil_div
from jaxkv.errors import InvalidArgument
from kernels_pallas.formats import DSV4_FP8, EntryFormat

__all__ = [
    "AttentionKind",
    "BLOCK_TOKENS",
    "HybridConfig",
    "INDEXER_FP8",
    "LayerCacheSchema",
    "LayerSpec",
    "block_budget",
    "block_bytes",
    "build_schemas",
    "deepseek_v4_schedule",
    "qwen3_next_schedule",
    "v4_flash_like_ratios",
]

BLOCK_TOKENS = 128  # original tokens per block of a compressed layer
INDEXER_FP8 = EntryFormat("indexer_fp8", nope_dim=128, rope_dim=0, group_size=128, scale_kind="fp32")


class AttentionKind(str, enum.Enum):
    FULL = "full"
    MLA = "mla"
    SWA = "swa"
    CSA = "csa"
    HCA = "hca"
    LINEAR = "linear"
    WINDOW = "window"


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """One layer of a schedule: its kind and (CSA/HCA) compression ratio."""

    layer_idx: int
    kind: AttentionKind
    compress_ratio: int = 0


@dataclasses.dataclass(frozen=True)
class HybridConfig:
    """Dimensions the cache needs, for every kind a schedule may use.

    DeepSeek-V4 (``swa``/``csa``/``hca``): ``entry_format`` (its
    ``head_dim = nope_dim + rope_dim``, one shared KV head), ``window``,
    ``index_head_dim``, ``index_topk``, ``csa_overlap`` / ``hca_overlap``,
    ``index_format`` (CSA indexer keys; None: :data:`INDEXER_FP8` at
    ``index_head_dim``; a model that wants exact parity gives lossless
    formats for both, :meth:`~kernels_pallas.formats.EntryFormat.lossless`).
    Full attention / MLA: ``num_kv_heads``, ``kv_head_dim`` (MLA: latent +
    RoPE dims, with ``mla_value_dim`` the latent), ``kv_dtype``, ``page_size``.
    Linear (Gated DeltaNet): ``linear_*``.
    ``num_query_heads``: the attention layers' query heads (the cache does
    not need it; handles report it, as seed 004's do). None: not given.
    ``ring_slack``: slots past ``window`` in each window layer's ring (a
    speculative verify step of that many drafts then rolls back by length
    alone: :class:`~jaxkv.pool.window.WindowLayerCache`).
    """

    entry_format: EntryFormat = DSV4_FP8
    window: int = 128
    index_head_dim: int = 128
    index_topk: int = 512
    csa_overlap: int = 2
    hca_overlap: int = 1
    num_kv_heads: int = 8
    kv_head_dim: int = 128
    mla_value_dim: int = 512
    kv_dtype: object = jnp.bfloat16
    page_size: int = 16
    linear_num_k_heads: int = 16
    linear_num_v_heads: int = 32
    linear_head_k_dim: int = 128
    linear_head_v_dim: int = 128
    linear_conv_kernel: int = 4
    linear_dtype: object = jnp.bfloat16
    num_query_heads: int | None = None
    index_format: EntryFormat | None = None
    window_dtype: object = None  # window rings' dtype (None: kv_dtype)
    ring_slack: int = 0

    @property
    def head_dim(self) -> int:
        return self.entry_format.head_dim

    @property
    def linear_conv_dim(self) -> int:
        return 2 * self.linear_num_k_heads * self.linear_head_k_dim + self.linear_num_v_heads * self.linear_head_v_dim


@dataclasses.dataclass(frozen=True)
class LayerCacheSchema:
    """What one layer stores. ``group`` names the allocator/block table the
    layer shares (None: nothing paged); ``entries_per_block`` entries per
    allocated block, ``tokens_per_entry`` original tokens per entry."""

    layer_idx: int
    kind: AttentionKind
    compress_ratio: int
    group: str | None
    entries_per_block: int
    tokens_per_entry: int
    entry_format: EntryFormat | None  # compressed entries (csa/hca)
    index_format: EntryFormat | None  # indexer keys (csa)
    window: int  # SWA ring length (0: none)
    compressor_rows: int  # compressor ring rows (0: none)
    compressor_width: int
    index_compressor_width: int  # csa only
    index_topk: int
    head_dim: int = 0  # per head of what the layer stores (DSV4: entry; full/MLA: K; linear: key)
    num_query_heads: int | None = None  # HybridConfig.num_query_heads (linear: its q/k heads)

    @property
    def tokens_per_block(self) -> int:
        return self.entries_per_block * self.tokens_per_entry

    @property
    def overlap(self) -> int:
        return self.compressor_rows // self.compress_ratio if self.compressor_rows else 0


def _schema(spec: LayerSpec, config: HybridConfig) -> LayerCacheSchema:
    kind = AttentionKind(spec.kind)
    common = dict(layer_idx=spec.layer_idx, kind=kind, compress_ratio=spec.compress_ratio,
                  entry_format=None, index_format=None, window=0, compressor_rows=0,
                  compressor_width=0, index_compressor_width=0, index_topk=0,
                  head_dim=config.head_dim, num_query_heads=config.num_query_heads)
    if kind in (AttentionKind.FULL, AttentionKind.MLA):
        common.update(head_dim=config.kv_head_dim)
        return LayerCacheSchema(**{**common, "group": kind.value, "entries_per_block": config.page_size,
                                   "tokens_per_entry": 1})
    if kind == AttentionKind.LINEAR:
        common.update(head_dim=config.linear_head_k_dim, num_query_heads=config.linear_num_k_heads)
        return LayerCacheSchema(**{**common, "group": None, "entries_per_block": 0, "tokens_per_entry": 0})
    common.update(window=config.window)
    if kind == AttentionKind.WINDOW:
        if config.window < 1:
            raise InvalidArgument(f"layer {spec.layer_idx}: a window layer needs window >= 1, got {config.window}")
        common.update(head_dim=config.kv_head_dim)
        return LayerCacheSchema(**{**common, "group": None, "entries_per_block": 0, "tokens_per_entry": 0})
    if kind == AttentionKind.SWA:
        return LayerCacheSchema(**{**common, "entry_format": config.entry_format, "group": None,
                                   "entries_per_block": 0, "tokens_per_entry": 0})
    r = spec.compress_ratio
    if r < 1 or BLOCK_TOKENS % r:
        raise InvalidArgument(f"layer {spec.layer_idx}: {kind.value} compression ratio must divide "
                              f"{BLOCK_TOKENS}, got {r}")
    overlap = config.csa_overlap if kind == AttentionKind.CSA else config.hca_overlap
    common.update(group=f"{kind.value}{r}", entries_per_block=BLOCK_TOKENS // r, tokens_per_entry=r,
                  entry_format=config.entry_format, compressor_rows=overlap * r,
                  compressor_width=overlap * config.head_dim)
    if kind == AttentionKind.CSA:
        index_format = config.index_format or dataclasses.replace(INDEXER_FP8, nope_dim=config.index_head_dim,
                                                                   group_size=config.index_head_dim)
        if index_format.head_dim != config.index_head_dim:
            raise InvalidArgument(f"index_format {index_format.name} has {index_format.head_dim} dims but "
                                  f"index_head_dim is {config.index_head_dim}")
        common.update(index_format=index_format,
                      index_compressor_width=overlap * config.index_head_dim, index_topk=config.index_topk)
    return LayerCacheSchema(**common)


def build_schemas(schedule: list[LayerSpec], config: HybridConfig) -> tuple[LayerCacheSchema, ...]:
    """One schema per layer, in schedule order (layer indices must be 0..n-1)."""
    if [s.layer_idx for s in schedule] != list(range(len(schedule))):
        raise InvalidArgument("schedule layer_idx values must be 0, 1, ..., n-1 in order")
    if not schedule:
        raise InvalidArgument("the schedule is empty")
    return tuple(_schema(spec, config) for spec in schedule)


# --------------------------------------------------------------------------
# Schedules.
# --------------------------------------------------------------------------


def deepseek_v4_schedule(compress_ratios: list[int]) -> list[LayerSpec]:
    """DeepSeek-V4's ``compress_ratios``: 0 = SWA only, 4 = CSA, 128 = HCA."""
    kinds = {0: AttentionKind.SWA, 4: AttentionKind.CSA, 128: AttentionKind.HCA}
    specs = []
    ratios = _host.int_array(compress_ratios, "compress_ratios", ndim=1).tolist()  # 4.5 or "128": refused
    for i, r in enumerate(ratios):
        if int(r) not in kinds:
            raise InvalidArgument(f"compress_ratios[{i}] = {r}: DeepSeek-V4 layers use 0, 4 or 128")
        specs.append(LayerSpec(i, kinds[int(r)], int(r)))
    return specs


def v4_flash_like_ratios(num_layers: int = 43) -> list[int]:
    """A V4-Flash-like ``compress_ratios``: two SWA-only layers, then CSA and
    HCA alternating (43 layers by default, as V4-Flash)."""
    return [0, 0] + [4 if i % 2 == 0 else 128 for i in range(num_layers - 2)]


def qwen3_next_schedule(num_layers: int, full_attention_interval: int = 4) -> list[LayerSpec]:
    """Qwen3-Next: every ``full_attention_interval``-th layer is full
    attention, the others Gated DeltaNet (3 linear : 1 full by default)."""
    return [LayerSpec(i, AttentionKind.FULL if (i + 1) % full_attention_interval == 0 else AttentionKind.LINEAR)
            for i in range(num_layers)]


# --------------------------------------------------------------------------
# Budgets.
# --------------------------------------------------------------------------


def block_bytes(schema: LayerCacheSchema, config: HybridConfig) -> int:
    """Bytes of one allocated block of this layer as jaxkv stores it (0 if
    nothing is paged)."""
    kind = schema.kind
    if kind == AttentionKind.FULL:
        per_token = 2 * config.num_kv_heads * config.kv_head_dim * jnp.dtype(config.kv_dtype).itemsize
        return per_token * config.page_size
    if kind == AttentionKind.MLA:
        return config.kv_head_dim * jnp.dtype(config.kv_dtype).itemsize * config.page_size
    if schema.group is None:
        return 0
    per_entry = _array_entry_bytes(schema.entry_format)
    if schema.index_format is not None:
        per_entry += _array_entry_bytes(schema.index_format)
    return per_entry * schema.entries_per_block


def _array_entry_bytes(fmt: EntryFormat) -> int:
    """Bytes of one entry as jaxkv stores it (arrays, no padding)."""
    return (fmt.nope_dim * fmt.nope_dtype.itemsize + fmt.rope_dim * fmt.out_dtype.itemsize
            + fmt.num_groups * fmt.scale_dtype.itemsize)


def block_budget(schemas, config: HybridConfig, *, max_context_tokens: int | None = None,
                 max_concurrent_requests: int | None = None, kv_bytes: int | None = None) -> dict[str, int]:
    """Blocks per group (null block included).

    Either ``max_context_tokens`` and ``max_concurrent_requests``: every
    request can reach the full context in every group at once
    (``requests * ceil(context / tokens_per_block) + 1``); or ``kv_bytes``:
    that many bytes of paged storage, split across groups so they all hold
    the same number of tokens (``tokens = kv_bytes / sum of bytes per token``).
    """
    groups: dict[str, list[LayerCacheSchema]] = {}
    for s in schemas:
        if s.group is not None:
            groups.setdefault(s.group, []).append(s)
    if kv_bytes is not None:
        per_token = sum(block_bytes(s, config) / s.tokens_per_block for g in groups.values() for s in g)
        tokens = int(kv_bytes // per_token) if per_token else 0
        return {name: tokens // g[0].tokens_per_block + 1 for name, g in groups.items()}
    if max_context_tokens is None or max_concurrent_requests is None:
        raise InvalidArgument("give kv_bytes, or both max_context_tokens and max_concurrent_requests")
    return {name: max_concurrent_requests * ceil_div(max_context_tokens, g[0].tokens_per_block) + 1
            for name, g in groups.items()}
