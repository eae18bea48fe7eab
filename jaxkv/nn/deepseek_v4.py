"""DeepSeek-V4 causal LM (Flax NNX) over the hybrid :class:`~jaxkv.KVCacheManager`.

The architecture as transformers (5.x) defines it, with transformers'
parameter names and layouts (every weight is stored ``[out, in]`` exactly as
in the checkpoint, so loading is a name-for-name copy)::

    embed_tokens -> hc_mult residual streams
    per layer:  attn_hc (hyper-connection: pre/post/comb weights, Sinkhorn) ->
                input_layernorm -> self_attn -> mix back into the streams
                ffn_hc -> post_attention_layernorm -> mlp (MoE) -> mix back
    hc_head (collapse the streams) -> norm -> lm_head

Attention (one shared KV head, K == V, RoPE on the last
``qk_rope_head_dim`` dims, GPT-J interleaved pairs): ``q`` from a low-rank
path (``q_a_proj`` -> ``q_a_norm`` -> ``q_b_proj`` -> per-head unweighted
RMSNorm), ``kv = kv_norm(kv_proj(x))``. Each query attends the keys of its
sliding window (``sliding_window`` tokens, itself included) and, in
CSA/HCA layers, compressed entries, with a per-head learned sink logit; the
output's RoPE dims are rotated back by the query's position, then the
grouped output projection (``o_a_proj`` per group of heads, ``o_b_proj``).

Compressed entries. Entry ``e`` of a layer with rate ``r`` pools the
compressor's ``kv_proj`` rows with softmax weights from ``gate_proj`` plus
``position_bias[p % r]`` (CSA: two overlapping windows, ``2r`` rows; HCA:
``r`` rows; the rule of :mod:`jaxkv.manager.dsv4_compressor`), then
``kv_norm`` and RoPE at position ``e * r``. **It exists once its window is
complete**: a query at position ``t`` sees entries ``e < (t + 1) // r``
(DeepSeek's paper and seed 004; also what transformers' no-cache forward
computes at its last position). HCA layers attend every such entry; CSA
layers the ``index_topk`` best by the lightning indexer
(``sum_h w_h relu(q_h . k)``, its own compressor over ``index_head_dim``).

The cache. All state lives in the manager: each layer's SWA ring, its
compressor and indexer rings (per request slot), its compressed entries and
indexer keys (paged blocks through its group's block table). A step reads
them through the ``kernels_pallas`` gathers (``gather_swa_kv``,
``gather_compressed_kv``, ``gather_all_compressed_kv``); the step is
``model(tokens [B, W], ...)`` or, packed (one flat stream of prefill pieces
and decode tokens, :class:`~jaxkv.nn.packed.PackedBatch`),
``model.forward_packed(batch, manager)``. Two entry formats
(:meth:`DeepseekV4ForCausalLM.make_cache`): ``"lossless"`` (entries in
float32: the model's exact arithmetic) and ``"fp8"`` (DeepSeek's production
format: e4m3 NoPE with a ue8m0 scale per 64 values, bf16 RoPE; indexer keys
e4m3 with an fp32 scale).

MoE. ``mlp.gate`` scores every routed expert (``scoring_func``); ``moe``
layers pick the top ``num_experts_per_tok`` of score + ``e_score_correction_bias``,
``hash_moe`` layers take ``tid2eid[token]``; the picked scores are
normalized, scaled by ``routed_scaling_factor``; experts are SwiGLU with
clamped pre-activations (``swiglu_limit``), run as grouped matmuls
(``lax.ragged_dot``), plus the shared expert.

Layers under a scan. With ``scan_layers`` (the default off a GPU) the decoder layers
run under one ``lax.scan`` over stacked parameters
(:class:`~jaxkv.nn.scan.DecoderStack`), so compile time does not grow with
depth. A layer's signature is its attention kind and its MLP kind (hash or
top-k routing): everything a layer module holds as static structure (the
compressor and indexer, the compression rate, the hash table), so layers of
one signature have identical graphdefs; the leading hash-routed layers that
break the pattern stay unrolled. The cache follows: the manager stacks the
arrays of the layers of one store class (same kind and ratio), and a layer
reached by the scan's traced index reads and writes its row of them in
place (:meth:`~jaxkv.KVCacheManager.acquire` with ``like=``).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from jaxkv._ops import place_kv, place_whole
from jaxkv.errors import InvalidArgument
from jaxkv.manager.dsv4_compressor import pool_entries
from jaxkv.manager.hybrid import KVCacheManager
from jaxkv.manager.hybrid_schema import INDEXER_FP8, AttentionKind, HybridConfig, LayerSpec
from jaxkv.nn.attention import check_implementation
from jaxkv.nn.deepseek_v4_config import DeepseekV4Config
from jaxkv.nn.layers import (Experts, Linear, RMSNorm, SwiGLU, fuse_experts, load_state, named_state, param,
                             read_checkpoint, save_checkpoint, unit_rms)
from jaxkv.nn.packed import PackedBatch, lane_logits
from jaxkv.nn.scan import DecoderStack
from kernels_pallas.formats import CompressedEntries, EntryFormat

__all__ = ["DeepseekV4ForCausalLM", "ENTRY_FORMATS", "entry_formats", "module_tensors"]

_F32 = jnp.float32
_KINDS = {"sliding_attention": AttentionKind.SWA, "compressed_sparse_attention": AttentionKind.CSA,
          "heavily_compressed_attention": AttentionKind.HCA}
#: Cache entry formats :meth:`DeepseekV4ForCausalLM.make_cache` takes.
ENTRY_FORMATS = ("lossless", "fp8")


def entry_formats(config: DeepseekV4Config, name: str, dtype=jnp.float32) -> tuple[EntryFormat, EntryFormat]:
    """``(entry format, indexer key format)`` of cache format ``name``:
    ``"lossless"`` (both in ``dtype``) or ``"fp8"`` (DeepSeek-V4's entries:
    e4m3 NoPE with a ue8m0 scale per 64 values + bf16 RoPE; indexer keys
    e4m3 with one fp32 scale, as DeepSeek-V3.2's indexer cache)."""
    rope = config.qk_rope_head_dim
    nope = config.head_dim - rope
    if name == "lossless":
        return EntryFormat.lossless(nope, rope, dtype), EntryFormat.lossless(config.index_head_dim, 0, dtype)
    if name == "fp8":
        if nope % 64:
            raise InvalidArgument(f"the fp8 entry format scales NoPE values in groups of 64; this model has "
                                  f"{nope} NoPE dims (head_dim {config.head_dim} - rope {rope})")
        index = dataclasses.replace(INDEXER_FP8, nope_dim=config.index_head_dim, group_size=config.index_head_dim)
        return EntryFormat("dsv4_fp8", nope_dim=nope, rope_dim=rope, group_size=64, scale_kind="ue8m0"), index
    raise InvalidArgument(f"entry format {name!r} is not one of {ENTRY_FORMATS}")


# --------------------------------------------------------------------------
# Small pieces.
# --------------------------------------------------------------------------


@functools.lru_cache(maxsize=32)
def _rope_table(config: DeepseekV4Config, which: str) -> tuple[np.ndarray, float]:
    params = config.rope_main if which == "main" else config.rope_compress
    return params.inv_freq(config.qk_rope_head_dim, config.max_position_embeddings)


def _rope(config: DeepseekV4Config, which: str, x, positions, *, inverse: bool = False):
    """Rotate the last ``qk_rope_head_dim`` dims of ``x [N, ..., D]`` by
    ``positions [N]`` (GPT-J interleaved pairs, float32); ``inverse``
    rotates back."""
    inv_freq, scaling = _rope_table(config, which)
    angles = jnp.maximum(positions, 0).astype(_F32)[:, None] * jnp.asarray(inv_freq)  # [N, R/2]
    cos, sin = jnp.cos(angles) * scaling, jnp.sin(angles) * scaling
    if inverse:
        sin = -sin
    shape = (x.shape[0],) + (1,) * (x.ndim - 2) + (inv_freq.shape[0],)
    cos, sin = cos.astype(x.dtype).reshape(shape).astype(_F32), sin.astype(x.dtype).reshape(shape).astype(_F32)
    rd = 2 * inv_freq.shape[0]
    head, tail = x[..., : x.shape[-1] - rd], x[..., x.shape[-1] - rd:].astype(_F32)
    x0, x1 = tail[..., 0::2], tail[..., 1::2]
    rotated = jnp.stack([x0 * cos - x1 * sin, x1 * cos + x0 * sin], axis=-1).reshape(tail.shape)
    return jnp.concatenate([head, rotated.astype(x.dtype)], axis=-1)


# On-disk names (DeepSeek's, which transformers' save_pretrained writes too)
# -> module names, in order (transformers' conversion mapping for deepseek_v4).
_RENAMES = [(re.compile(a), b) for a, b in (
    (r"\.attn\.", ".self_attn."), (r"\.ffn\.", ".mlp."), (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^embed\.weight", "embed_tokens.weight"), (r"^head\.weight", "lm_head.weight"),
    (r"^hc_head_fn", "hc_head.hc_fn"), (r"^hc_head_base", "hc_head.hc_base"), (r"^hc_head_scale", "hc_head.hc_scale"),
    (r"\.attn_norm\.", ".input_layernorm."), (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_attn_fn", ".attn_hc.fn"), (r"\.hc_attn_base", ".attn_hc.base"), (r"\.hc_attn_scale", ".attn_hc.scale"),
    (r"\.hc_ffn_fn", ".ffn_hc.fn"), (r"\.hc_ffn_base", ".ffn_hc.base"), (r"\.hc_ffn_scale", ".ffn_hc.scale"),
    (r"\.attn_sink", ".sinks"), (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."), (r"\.norm\.", ".kv_norm."),
    (r"\.ape", ".position_bias"), (r"\.wq_a\.", ".q_a_proj."), (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."),
    (r"\.wkv\.", ".kv_proj."), (r"\.wgate\.", ".gate_proj."), (r"\.wo_a\.", ".o_a_proj."), (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."), (r"\.gate\.bias", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."), (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."))]


def module_tensors(tensors: dict[str, np.ndarray], num_experts: int, source: str = "state dict"
                   ) -> dict[str, np.ndarray]:
    """Checkpoint tensors under the model's module names: DeepSeek's names
    (``layers.0.attn.wq_a.weight``, ``ffn.experts.3.w1.weight``, ``head.weight``,
    ... as DeepSeek ships them and transformers' ``save_pretrained``
    writes them, with or without a ``model.`` prefix) renamed as
    transformers' loader renames them; per-expert ``w1``/``w3`` (gate/up)
    and ``w2`` fused (:func:`~jaxkv.nn.layers.fuse_experts`). Names already
    in module form pass through."""
    renamed = {module_name(name): arr for name, arr in tensors.items()}
    origin = {module_name(name): name for name in tensors}  # errors name the checkpoint's tensors
    return fuse_experts(renamed, num_experts, ("w1", "w3", "w2"), source, origin=origin)


def module_name(name: str) -> str:
    """The module name :func:`module_tensors` gives checkpoint tensor ``name``."""
    new = name[len("model."):] if name.startswith("model.") else name
    for pattern, repl in _RENAMES:
        new = pattern.sub(repl, new)
    return new


def _top_k_valid(scores, valid, k: int):
    """The ``k`` best valid entries per row (``-1`` where fewer are valid).

    Equal scores go to the lower entry index (``lax.top_k``'s rule), the
    same choice at every row length, so cached decoding and a recompute
    agree. The indexer's ReLU makes exact ties (scores of 0.0) common in
    small all-RoPE indexers; ``torch.topk`` breaks them in no specified
    order, so on such ties transformers' tokens are not a reference."""
    values, idx = jax.lax.top_k(jnp.where(valid, scores, -jnp.inf), k)
    return jnp.where(values > -jnp.inf, idx, -1).astype(jnp.int32)


# --------------------------------------------------------------------------
# Attention.
# --------------------------------------------------------------------------


class Indexer(nnx.Module):
    """CSA's lightning indexer: its own compressor over ``index_head_dim``
    and ``index_n_heads`` query heads from the attention's ``q_residual``."""

    def __init__(self, config: DeepseekV4Config, *, rngs, param_dtype, precision):
        r, di, hi = config.compress_rates[0], config.index_head_dim, config.index_n_heads
        lin = functools.partial(Linear, rngs=rngs, param_dtype=param_dtype, precision=precision)
        self.kv_proj = lin(config.hidden_size, 2 * di)
        self.gate_proj = lin(config.hidden_size, 2 * di)
        self.position_bias = param((r, 2 * di), rngs, param_dtype, fill=0.0)
        self.kv_norm = RMSNorm(di, config.rms_norm_eps, param_dtype=param_dtype)
        self.q_b_proj = lin(config.q_lora_rank, hi * di)
        self.scorer = nnx.Dict(weights_proj=lin(config.hidden_size, hi))


class Compressor(nnx.Module):
    """A CSA (overlap 2, with an :class:`Indexer`) or HCA (overlap 1) compressor."""

    def __init__(self, config: DeepseekV4Config, kind: str, *, rngs, param_dtype, precision):
        csa = kind == "compressed_sparse_attention"
        r = config.compress_rates[0] if csa else config.compress_rates[1]
        width = (2 if csa else 1) * config.head_dim
        lin = functools.partial(Linear, rngs=rngs, param_dtype=param_dtype, precision=precision)
        self.kv_proj = lin(config.hidden_size, width)
        self.gate_proj = lin(config.hidden_size, width)
        self.position_bias = param((r, width), rngs, param_dtype, fill=0.0)
        self.kv_norm = RMSNorm(config.head_dim, config.rms_norm_eps, param_dtype=param_dtype)
        self.indexer = Indexer(config, rngs=rngs, param_dtype=param_dtype, precision=precision) if csa else None


class DeepseekV4Attention(nnx.Module):
    """One attention layer; :meth:`__call__` runs it through a
    :class:`~jaxkv.manager.layer_handle.LayerCacheHandle`,
    :meth:`forward_dense` recomputes it from the whole sequence (no cache)."""

    def __init__(self, config: DeepseekV4Config, layer: int, *, rngs, param_dtype, precision):
        c = config
        lin = functools.partial(Linear, rngs=rngs, param_dtype=param_dtype, precision=precision)
        self.config = c
        self.kind = c.layer_types[layer]
        self.rate = c.compress_rate(layer)
        self.q_a_proj = lin(c.hidden_size, c.q_lora_rank)
        self.q_a_norm = RMSNorm(c.q_lora_rank, c.rms_norm_eps, param_dtype=param_dtype)
        self.q_b_proj = lin(c.q_lora_rank, c.num_attention_heads * c.head_dim)
        self.kv_proj = lin(c.hidden_size, c.head_dim)
        self.kv_norm = RMSNorm(c.head_dim, c.rms_norm_eps, param_dtype=param_dtype)
        self.o_a_proj = lin(c.num_attention_heads * c.head_dim // c.o_groups, c.o_groups * c.o_lora_rank)
        self.o_b_proj = lin(c.o_groups * c.o_lora_rank, c.hidden_size)
        self.sinks = param((c.num_attention_heads,), rngs, param_dtype, fill=0.0)
        self.compressor = None if self.kind == "sliding_attention" else Compressor(
            c, self.kind, rngs=rngs, param_dtype=param_dtype, precision=precision)
        #: Set on a mesh by :func:`jaxkv.nn.sharding.place_heads`: the rows written to the (replicated) latent
        #: cache are placed whole first (:func:`jaxkv._ops.place_whole`).
        self.heads_placement = None

    @property
    def rope_kind(self) -> str:
        return "main" if self.kind == "sliding_attention" else "compress"

    # -- pieces shared by the cached and the no-cache path

    def _project(self, x, positions):
        c = self.config
        q_residual = self.q_a_norm(self.q_a_proj(x))
        q = self.q_b_proj(q_residual).reshape(x.shape[0], c.num_attention_heads, c.head_dim)
        q = _rope(c, self.rope_kind, unit_rms(q, c.rms_norm_eps), positions)
        kv = _rope(c, self.rope_kind, self.kv_norm(self.kv_proj(x)), positions)
        return q, kv, q_residual

    def _compressor_rows(self, module, x, positions):
        """``(kv, score)`` rows of this step's tokens for a compressor."""
        bias = module.position_bias[...].astype(_F32)[jnp.maximum(positions, 0) % self.rate]
        return module.kv_proj(x).astype(_F32), module.gate_proj(x).astype(_F32) + bias

    def _finish(self, norm):
        """The transform of a pooled vector into a stored entry: RMSNorm,
        then RoPE at the entry's first position ``e * rate``."""
        def finish(pooled, entry):
            return _rope(self.config, "compress", norm(pooled), entry * self.rate)
        return finish

    def _index_scores(self, x, q_residual, positions, keys):
        """``sum_h w_h relu(q_h . key)`` of each token against ``keys [N, E, Di]`` or ``[E, Di]``."""
        c, ix = self.config, self.compressor.indexer
        q = ix.q_b_proj(q_residual).reshape(x.shape[0], c.index_n_heads, c.index_head_dim)
        q = _rope(c, "compress", q, positions).astype(_F32)
        # On a mesh: each device its own heads (or all of them), never a slice of each head's features, which
        # would split the contraction with the replicated keys and the keys' pool with it (gathered back whole).
        (q,) = place_kv(self.heads_placement, q)
        spec = "ned" if keys.ndim == 3 else "ed"  # per token, or shared by every token
        scores = jax.nn.relu(jnp.einsum(f"nhd,{spec}->nhe", q, keys.astype(_F32))) * c.index_head_dim ** -0.5
        weights = ix.scorer["weights_proj"](x).astype(_F32) * c.index_n_heads ** -0.5
        return jnp.einsum("nhe,nh->ne", scores, weights)

    def _attend(self, q, keys, mask, positions):
        """Attention with the per-head sink over each token's ``keys [N, K, D]``
        (or ``[K, D]`` shared by every token; K == V), the output's RoPE
        undone, the grouped output projection."""
        c = self.config
        spec = "nkd" if keys.ndim == 3 else "kd"
        logits = jnp.einsum(f"nhd,{spec}->nhk", q.astype(_F32), keys.astype(_F32)) * c.head_dim ** -0.5
        logits = jnp.where(mask[:, None, :], logits, -jnp.inf)
        sinks = jnp.broadcast_to(self.sinks[...].astype(_F32)[None, :, None], logits.shape[:2] + (1,))
        probs = jax.nn.softmax(jnp.concatenate([logits, sinks], axis=-1), axis=-1)[..., :-1]
        out = jnp.einsum(f"nhk,{spec}->nhd", probs, keys.astype(_F32)).astype(q.dtype)
        out = _rope(c, self.rope_kind, out, positions, inverse=True)
        groups = out.reshape(out.shape[0], c.o_groups, -1)
        w = self.o_a_proj.weight[...].astype(groups.dtype).reshape(c.o_groups, c.o_lora_rank, -1)
        grouped = jnp.einsum("ngi,goi->ngo", groups, w, precision=self.o_a_proj.precision)
        return self.o_b_proj(grouped.reshape(out.shape[0], -1))

    # -- through the cache

    def __call__(self, x, handle):
        """This step's tokens (``handle.positions``; -1 = padding) through
        the cache. Returns ``(y [N, hidden], handle)``."""
        positions = handle.positions
        q, kv, q_residual = self._project(x, positions)
        (kv,) = place_whole(self.heads_placement, kv)
        window, window_ok = handle.gather_swa(kv)  # earlier steps from the ring, this step's rows from kv
        handle = handle.write_swa(kv, after=window)  # after the read: the ring is updated in place
        keys, masks = [window], [window_ok]
        if self.compressor is not None:
            comp = self.compressor
            handle = handle.compress(*place_whole(self.heads_placement, *self._compressor_rows(comp, x, positions)),
                                     finish=self._finish(comp.kv_norm))
            max_entries = handle.block_table.shape[1] * handle.schema.entries_per_block
            if comp.indexer is None:
                entries, entries_ok = handle.gather_all_compressed(max_entries)
            else:
                ix = comp.indexer
                handle = handle.compress_index(*place_whole(self.heads_placement,
                                                            *self._compressor_rows(ix, x, positions)),
                                               finish=self._finish(ix.kv_norm))
                index_keys, index_ok = handle.index_keys(max_entries)
                scores = self._index_scores(x, q_residual, positions, index_keys)
                chosen = _top_k_valid(scores, index_ok, min(self.config.index_topk, max_entries))
                entries, entries_ok = handle.gather_compressed(chosen)
            keys.append(entries)
            masks.append(entries_ok)
        keys = jnp.concatenate([k.astype(_F32) for k in keys], axis=1)
        return self._attend(q, keys, jnp.concatenate(masks, axis=1), positions), handle

    # -- without a cache

    def forward_dense(self, x, entry_format: EntryFormat, index_format: EntryFormat):
        """One sequence ``x [T, hidden]`` at positions ``0 .. T-1``,
        recomputed from scratch; window rows, entries and indexer keys are
        rounded through the cache formats as the cache stores them."""
        c = self.config
        t = x.shape[0]
        positions = jnp.arange(t, dtype=jnp.int32)
        q, kv, q_residual = self._project(x, positions)
        rounded = lambda v, fmt: CompressedEntries.quantize(v, fmt).dequantize().astype(_F32)  # noqa: E731
        keys = [rounded(kv, entry_format)]  # [T, D], shared by every query (masks say who sees what)
        earlier = positions[None, :] <= positions[:, None]
        masks = [earlier & (positions[None, :] > positions[:, None] - c.sliding_window)]
        if self.compressor is not None:
            comp, num = self.compressor, t // self.rate
            overlap = 1 if comp.indexer is None else 2
            pooled = pool_entries(*self._compressor_rows(comp, x, positions), ratio=self.rate, overlap=overlap,
                                  num_entries=num)
            entries = rounded(self._finish(comp.kv_norm)(pooled, jnp.arange(num, dtype=jnp.int32)), entry_format)
            visible = jnp.arange(num)[None, :] < ((positions + 1) // self.rate)[:, None]  # [T, E]
            if comp.indexer is not None and num:
                ix = comp.indexer
                pooled = pool_entries(*self._compressor_rows(ix, x, positions), ratio=self.rate, overlap=2,
                                      num_entries=num)
                index_keys = rounded(self._finish(ix.kv_norm)(pooled, jnp.arange(num, dtype=jnp.int32)),
                                     index_format)
                scores = self._index_scores(x, q_residual, positions, index_keys)
                chosen = _top_k_valid(scores, visible, min(c.index_topk, num))
                visible = visible & jnp.any(chosen[:, :, None] == jnp.arange(num)[None, None, :], axis=1)
            keys.append(entries)
            masks.append(visible)
        keys = jnp.concatenate(keys, axis=0)
        return self._attend(q, keys, jnp.concatenate(masks, axis=1), positions)


# --------------------------------------------------------------------------
# Hyper-connections, MoE, decoder layer.
# --------------------------------------------------------------------------


class HyperConnection(nnx.Module):
    """Manifold-constrained hyper-connection: from the ``hc_mult`` streams,
    ``pre`` (collapse to the block input), ``post`` (expand the block
    output) and ``comb`` (mix the streams; Sinkhorn-projected towards a
    doubly stochastic matrix)."""

    def __init__(self, config: DeepseekV4Config, *, rngs, param_dtype):
        n, d = config.hc_mult, config.hidden_size
        self.config = config
        self.fn = param(((2 + n) * n, n * d), rngs, param_dtype, std=0.02)
        self.base = param(((2 + n) * n,), rngs, param_dtype, fill=0.0)
        self.scale = param((3,), rngs, param_dtype, fill=1.0)

    def __call__(self, streams):
        c, n = self.config, self.config.hc_mult
        flat = unit_rms(streams.reshape(streams.shape[0], -1).astype(_F32), c.rms_norm_eps)
        mixed = flat @ self.fn[...].astype(_F32).T
        base, scale = self.base[...].astype(_F32), self.scale[...].astype(_F32)
        pre = jax.nn.sigmoid(mixed[:, :n] * scale[0] + base[:n]) + c.hc_eps
        post = 2 * jax.nn.sigmoid(mixed[:, n:2 * n] * scale[1] + base[n:2 * n])
        comb = mixed[:, 2 * n:].reshape(-1, n, n) * scale[2] + base[2 * n:].reshape(n, n)
        comb = jax.nn.softmax(comb, axis=-1) + c.hc_eps
        comb = comb / (comb.sum(axis=-2, keepdims=True) + c.hc_eps)
        def sinkhorn(_, comb):
            comb = comb / (comb.sum(axis=-1, keepdims=True) + c.hc_eps)
            return comb / (comb.sum(axis=-2, keepdims=True) + c.hc_eps)

        # A loop, not unrolled: the same arithmetic, a fraction of the compile time.
        comb = jax.lax.fori_loop(0, c.hc_sinkhorn_iters - 1, sinkhorn, comb)
        collapsed = jnp.sum(pre[..., None] * streams, axis=1).astype(streams.dtype)
        return post, comb, collapsed


def _mix(post, comb, block_out, streams):
    """``post * out + comb^T @ streams`` per token (streams ``[N, n, D]``)."""
    dtype = streams.dtype
    return (post.astype(dtype)[..., None] * block_out[:, None, :]
            + jnp.einsum("nji,njd->nid", comb.astype(dtype), streams))


class Router(nnx.Module):
    """``weight [E, D]``; top-k routers add ``e_score_correction_bias`` for
    the choice, hash routers read ``tid2eid [vocab, k]``."""

    def __init__(self, config: DeepseekV4Config, hashed: bool, *, rngs, param_dtype):
        self.config = config
        self.weight = param((config.n_routed_experts, config.hidden_size), rngs, param_dtype, std=0.02)
        if hashed:
            self.tid2eid = nnx.Variable(jnp.zeros((config.vocab_size, config.num_experts_per_tok), jnp.int32))
        else:
            self.e_score_correction_bias = param((config.n_routed_experts,), rngs, _F32, fill=0.0)

    def __call__(self, x, tokens):
        c = self.config
        logits = x @ self.weight[...].astype(x.dtype).T
        if c.scoring_func == "sqrtsoftplus":
            scores = jnp.sqrt(jax.nn.softplus(logits))
        elif c.scoring_func == "sigmoid":
            scores = jax.nn.sigmoid(logits)
        else:
            scores = jax.nn.softmax(logits, axis=-1)
        if hasattr(self, "tid2eid"):
            experts = self.tid2eid[...][tokens]
        else:
            biased = scores + self.e_score_correction_bias[...].astype(scores.dtype)
            experts = jax.lax.top_k(biased, c.num_experts_per_tok)[1]
        weights = jnp.take_along_axis(scores, experts, axis=-1)
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
        return experts.astype(jnp.int32), weights * c.routed_scaling_factor


class MoE(nnx.Module):
    def __init__(self, config: DeepseekV4Config, layer: int, *, rngs, param_dtype, precision):
        self.gate = Router(config, config.mlp_layer_types[layer] == "hash_moe", rngs=rngs, param_dtype=param_dtype)
        c = config
        self.experts = Experts(c.n_routed_experts, c.hidden_size, c.moe_intermediate_size, rngs=rngs,
                               param_dtype=param_dtype, precision=precision, limit=c.swiglu_limit)
        self.shared_experts = SwiGLU(c.hidden_size, c.moe_intermediate_size * c.n_shared_experts, rngs=rngs,
                                     param_dtype=param_dtype, precision=precision, limit=c.swiglu_limit)

    def __call__(self, x, tokens):
        experts, weights = self.gate(x, tokens)
        return self.experts(x, experts, weights) + self.shared_experts(x)


class DeepseekV4DecoderLayer(nnx.Module):
    def __init__(self, config: DeepseekV4Config, layer: int, *, rngs, param_dtype, precision):
        self.self_attn = DeepseekV4Attention(config, layer, rngs=rngs, param_dtype=param_dtype, precision=precision)
        self.mlp = MoE(config, layer, rngs=rngs, param_dtype=param_dtype, precision=precision)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, param_dtype=param_dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, param_dtype=param_dtype)
        self.attn_hc = HyperConnection(config, rngs=rngs, param_dtype=param_dtype)
        self.ffn_hc = HyperConnection(config, rngs=rngs, param_dtype=param_dtype)

    # A layer is split around its attention, which runs through the cache
    # (``self_attn(x, handle)``) or without it (``self_attn.forward_dense``).

    def attention_input(self, streams):
        """``(mix, x)``: the hyper-connection weights and the attention's input."""
        post, comb, collapsed = self.attn_hc(streams)
        return (post, comb), self.input_layernorm(collapsed)

    def after_attention(self, streams, mix, attention_out, tokens):
        """Mix the attention output into the streams, then the MoE block."""
        streams = _mix(*mix, attention_out, streams)
        post, comb, collapsed = self.ffn_hc(streams)
        return _mix(post, comb, self.mlp(self.post_attention_layernorm(collapsed), tokens), streams)


# --------------------------------------------------------------------------
# The model.
# --------------------------------------------------------------------------


class DeepseekV4ForCausalLM(nnx.Module):
    """DeepSeek-V4 over a :class:`~jaxkv.KVCacheManager` (see the module docstring).

    ``dtype``: compute dtype of activations and matmuls; ``param_dtype``:
    storage dtype of parameters. Norms, softmaxes, RoPE, the compressor
    pooling and the hyper-connection weights run in float32; logits are
    float32. ``implementation`` / ``interpret`` choose the gather kernels by
    :mod:`kernels_pallas`'s rule (None: Pallas on GPU, the reference elsewhere).
    ``scan_layers`` (default: stacked unless built on a
    GPU, :func:`jaxkv.nn.scan.default_scan_layers`): layers of the same attention and MLP
    kind run under one ``lax.scan`` (the module docstring), so compile time
    does not grow with depth; False unrolls them (same weights from the
    same seed, same tokens).
    """

    #: The cache contract (:func:`jaxkv.nn.packed.cache_kind`): a hybrid ``KVCacheManager`` (``make_cache``).
    cache_kind = "hybrid"

    def __init__(self, config: DeepseekV4Config, *, rngs: nnx.Rngs, dtype=_F32, param_dtype=_F32,
                 precision=None, implementation: str | None = None, scan_layers: bool | None = None):
        check_implementation(implementation, False)
        c = config
        self.config = c
        self.dtype = jnp.dtype(dtype)
        self.param_dtype = jnp.dtype(param_dtype)
        self.implementation = implementation
        self.embed_tokens = nnx.Dict(weight=param((c.vocab_size, c.hidden_size), rngs, param_dtype, std=1.0))
        # The signature: every static difference between layers (attention
        # kind, hence compressor / indexer / rate; hash or top-k routing,
        # hence the tid2eid table): layers of one signature stack.
        self.layers = DecoderStack(
            c.num_hidden_layers,
            lambda i, r: DeepseekV4DecoderLayer(c, i, rngs=r, param_dtype=param_dtype, precision=precision),
            signature=lambda i: (c.layer_types[i], c.mlp_layer_types[i]), rngs=rngs, scan=scan_layers)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, param_dtype=param_dtype)
        self.hc_head = nnx.Dict(hc_fn=param((c.hc_mult, c.hc_mult * c.hidden_size), rngs, param_dtype, std=0.02),
                                hc_base=param((c.hc_mult,), rngs, param_dtype, fill=0.0),
                                hc_scale=param((1,), rngs, param_dtype, fill=1.0))
        self.lm_head = Linear(c.hidden_size, c.vocab_size, rngs=rngs, param_dtype=param_dtype, precision=precision)

    # ---------------------------------------------------------------- cache

    def make_cache(self, max_requests: int, max_context_tokens: int, *, entry_format: str = "lossless",
                   num_blocks: dict[str, int] | None = None, kv_bytes: int | None = None, num_snapshots: int = 0,
                   capture_every: int = 0) -> KVCacheManager:
        """A :class:`~jaxkv.KVCacheManager` for this model: ``max_requests``
        slots, block tables of ``max_context_tokens`` tokens, entries in
        ``entry_format`` (``"lossless"``: the compute dtype, exact;
        ``"fp8"``: DeepSeek-V4's). Blocks per group, ``num_snapshots`` and
        ``capture_every`` as in ``KVCacheManager.create`` (default: every
        request at full length, no snapshots)."""
        c = self.config
        fmt, index_fmt = entry_formats(c, entry_format, self.dtype)
        schedule = [LayerSpec(i, _KINDS[t], c.compress_rate(i)) for i, t in enumerate(c.layer_types)]
        hybrid = HybridConfig(entry_format=fmt, window=c.sliding_window, index_head_dim=c.index_head_dim,
                              index_topk=c.index_topk, csa_overlap=2, hca_overlap=1, index_format=index_fmt,
                              num_query_heads=c.num_attention_heads)
        return KVCacheManager.create(hybrid, schedule, max_requests, max_context_tokens=max_context_tokens,
                                     num_blocks=num_blocks, kv_bytes=kv_bytes, num_snapshots=num_snapshots,
                                     capture_every=capture_every)

    def _check_cache(self, manager: KVCacheManager) -> None:
        c = self.config
        kinds = tuple((s.kind, s.compress_ratio) for s in manager.schemas)
        want = tuple((_KINDS[t], c.compress_rate(i)) for i, t in enumerate(c.layer_types))
        if kinds != want or manager.config.window != c.sliding_window or manager.config.head_dim != c.head_dim:
            raise InvalidArgument(f"the cache's schedule {[(k.value, r) for k, r in kinds]} (window "
                                  f"{manager.config.window}, head_dim {manager.config.head_dim}) is not this "
                                  f"model's; build it with model.make_cache")

    # ------------------------------------------------------------- forward

    def _embed(self, tokens):
        x = self.embed_tokens["weight"][...][tokens].astype(self.dtype)
        return jnp.broadcast_to(x[:, None, :], (x.shape[0], self.config.hc_mult, x.shape[1]))

    def _logits(self, streams):
        c = self.config
        head = self.hc_head
        flat = unit_rms(streams.reshape(streams.shape[0], -1).astype(_F32), c.rms_norm_eps)
        mixes = flat @ head["hc_fn"][...].astype(_F32).T
        pre = jax.nn.sigmoid(mixes * head["hc_scale"][...].astype(_F32) + head["hc_base"][...].astype(_F32)) + c.hc_eps
        x = jnp.sum(pre[..., None] * streams, axis=1).astype(streams.dtype)
        return self.lm_head(self.norm(x)).astype(_F32)

    def __call__(self, tokens: Int[Array, "B T"], manager: KVCacheManager, slots: Int[Array, " B"],
                 starts: Int[Array, " B"], num_new: Int[Array, " B"]) -> tuple[Float[Array, "B T V"], KVCacheManager]:
        """One step through the cache: row ``b`` (request slot ``slots[b]``,
        -1 = idle) brings ``tokens[b, :num_new[b]]`` at positions
        ``starts[b] + t``, which ``manager.reserve`` must have reserved.
        Returns ``(logits [B, T, vocab] float32, manager)``; logits of
        padding tokens are finite garbage."""
        tokens = jnp.asarray(tokens, jnp.int32)
        batch, width = tokens.shape
        lane = jnp.arange(width, dtype=jnp.int32)[None, :]
        positions = jnp.where(lane < num_new[:, None], starts[:, None] + lane, -1).reshape(-1)
        request_ids = jnp.repeat(jnp.arange(batch, dtype=jnp.int32), width)
        streams, manager = self._through_cache(tokens.reshape(-1), manager, slots, positions, request_ids)
        return self._logits(streams).reshape(batch, width, -1), manager

    def forward_packed(self, batch: PackedBatch, manager: KVCacheManager, verify=None,
                       width: int = 1) -> tuple[Float[Array, "S V"], KVCacheManager]:
        """One packed step (:class:`~jaxkv.nn.packed.PackedBatch`) through the
        cache: every layer runs over the flat stream of ``T`` tokens (no
        padding per lane; the handle tells the lanes apart by
        ``token_lanes``), lane ``s`` as request slot ``seq_ids[s]`` at its
        positions, which ``manager.reserve(batch.seq_ids, batch.q_lens,
        ...)`` must have reserved. Returns ``(logits [S, vocab] float32,
        manager)``: the logits of each lane's last token (the LM head runs on
        those ``S`` tokens only; finite garbage for a lane with none); with
        ``verify`` (speculative verify lanes) ``[S, width, vocab]``
        (:func:`~jaxkv.nn.packed.lane_logits`)."""
        streams, manager = self._through_cache(batch.token_ids, manager, batch.seq_ids, batch.positions,
                                               batch.token_lanes)
        return lane_logits(self._logits, streams, batch, verify, width), manager

    def _through_cache(self, tokens: Int[Array, " T"], manager: KVCacheManager, slots: Int[Array, " B"],
                       positions: Int[Array, " T"], request_ids: Int[Array, " T"]):
        """Every layer over a flat stream of tokens (request row
        ``request_ids[t]`` of ``slots``, at ``positions[t]``; -1: padding).
        Returns ``(streams [T, hc_mult, hidden], manager)``: the residual
        streams before ``hc_head``."""
        self._check_cache(manager)
        tokens = jnp.asarray(tokens, jnp.int32)

        def step(layer, i, like, carry):  # i: traced under the layer scan; like: a static layer of its signature
            streams, manager = carry
            handle = manager.acquire(i, slots, positions, request_ids, implementation=self.implementation,
                                     like=like)
            mix, x = layer.attention_input(streams)
            y, handle = layer.self_attn(x, handle)
            return layer.after_attention(streams, mix, y, tokens), manager.update(handle)

        return self.layers.run(step, (self._embed(tokens), manager), with_like=True)

    def forward_dense(self, tokens: Int[Array, " T"], *, entry_format: str = "lossless") -> Float[Array, "T V"]:
        """One sequence from scratch with no cache (positions ``0 .. T-1``),
        window rows, entries and indexer keys rounded through the cache's
        ``entry_format`` as the cache would store them: the check for the
        cached path. Every position's logits follow the causal rule (a
        token sees only entries whose window it completes or follows)."""
        tokens = jnp.asarray(tokens, jnp.int32).reshape(-1)
        fmt, index_fmt = entry_formats(self.config, entry_format, self.dtype)

        def step(layer, i, streams):
            mix, x = layer.attention_input(streams)
            return layer.after_attention(streams, mix, layer.self_attn.forward_dense(x, fmt, index_fmt), tokens)

        return self._logits(self.layers.run(step, self._embed(tokens)))

    # ---------------------------------------------------- HF checkpoints

    @classmethod
    def from_hf_state_dict(cls, config: DeepseekV4Config, tensors: dict[str, np.ndarray], *, dtype=None,
                           param_dtype=None, precision=None, implementation: str | None = None,
                           source: str = "state dict", scan_layers: bool | None = None) -> DeepseekV4ForCausalLM:
        """Build the model from transformers-named arrays. ``param_dtype``
        default: float32 (bf16 checkpoints are upcast); ``dtype`` default:
        ``param_dtype``; ``scan_layers`` as in the constructor (the
        checkpoint's per-layer tensors are stacked). Raises
        ``InvalidArgument`` naming a missing, misshapen or unexpected tensor."""
        param_dtype = jnp.dtype(param_dtype or jnp.float32)
        dtype = jnp.dtype(dtype or param_dtype)
        abstract = nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=param_dtype,
                                              precision=precision, implementation=implementation,
                                              scan_layers=scan_layers))
        raw, tensors = tensors, module_tensors(tensors, config.n_routed_experts, source)

        def check(name, arr):
            if name.endswith(".tid2eid") and (arr.min(initial=0) < 0 or arr.max(initial=0) >= config.n_routed_experts):
                raise InvalidArgument(f"checkpoint tensor {name!r} has expert ids outside [0, "
                                      f"{config.n_routed_experts}) ({source})")

        return load_state(abstract, tensors, lambda path: path, family="deepseek_v4", source=source, check=check,
                          ignored=lambda n: n.startswith("mtp.") or n.endswith("inv_freq"),
                          origin={module_name(name): name for name in raw})

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, *, dtype=None, param_dtype=None, precision=None,
                        implementation: str | None = None, scan_layers: bool | None = None) -> DeepseekV4ForCausalLM:
        """Load a local transformers checkpoint directory (``config.json`` and
        its safetensors, sharded or not; FP8 block-quantized weights with
        ``weight_scale_inv`` are dequantized at load)."""
        raw, tensors = read_checkpoint(path)
        return cls.from_hf_state_dict(DeepseekV4Config.from_hf(raw), tensors, dtype=dtype, param_dtype=param_dtype,
                                      precision=precision, implementation=implementation, source=os.fspath(path),
                                      scan_layers=scan_layers)

    def hf_state_dict(self) -> dict[str, np.ndarray]:
        """Parameters under the module names of transformers' model (fused
        experts; what ``from_hf_state_dict`` and transformers both read)."""
        return named_state(self)

    def save_pretrained(self, path: str | os.PathLike) -> None:
        """``config.json`` + ``model.safetensors`` in transformers' layout."""
        save_checkpoint(path, {**self.config.to_hf(), "torch_dtype": self.param_dtype.name}, self.hf_state_dict())
