"""gpt-oss causal LM (Flax NNX): sliding-window and full attention with sinks, MoE experts, over the hybrid cache.

The architecture as transformers (5.x) defines it, with its parameter names
and layouts (``Linear`` weights ``[out, in]``; the experts ``[E, in, out]``
as transformers stores them)::

    embed_tokens
    per layer:  input_layernorm -> self_attn -> + residual
                post_attention_layernorm -> mlp (router + experts) -> + residual
    norm -> lm_head

Norms are RMSNorm ``weight * x / rms(x)`` in float32 (kept float32 whatever
``param_dtype``, as transformers' ``_keep_in_fp32_modules``).

**Attention** (``self_attn``): ``q_proj``, ``k_proj``, ``v_proj``,
``o_proj`` with biases (``attention_bias``), grouped-query heads of
``head_dim``; RoPE on halves with the config's YaRN (cos/sin times YaRN's
attention factor, rounded to the compute dtype as transformers does);
scale ``head_dim ** -0.5``; each head's learned ``sinks`` logit joins the
softmax denominator only (the probabilities of the real keys sum to less
than one). Layer ``i`` is ``layer_types[i]``: ``sliding_attention`` (token
``p`` attends positions ``(p - sliding_window, p]``) or ``full_attention``.

**MoE** (``mlp``): ``router`` (Linear with bias) logits, the top
``num_experts_per_tok`` of them, softmax over those logits; experts
``gate_up_proj [E, hidden, 2I]`` + ``gate_up_proj_bias`` whose output
columns interleave gate and up (``gate = y[..., 0::2]``, ``up = y[...,
1::2]``), ``gate`` clamped above and ``up`` both ways at ``swiglu_limit``,
``(up + 1) * gate * sigmoid(swiglu_alpha * gate)``, then ``down_proj [E, I,
hidden]`` + ``down_proj_bias``; grouped matmuls (``lax.ragged_dot``).

**MXFP4 checkpoints** (``quantization_config.quant_method == "mxfp4"``, the
released gpt-oss): experts stored as ``<proj>_blocks [E, out, G, 16]``
uint8 (two FP4 e2m1 values per byte, low nibble first; 32 values a group)
and ``<proj>_scales [E, out, G]`` uint8 (e8m0: ``2 ** (s - 127)``) are
dequantized at load (:func:`dequantize_mxfp4`) to ``[E, out, G * 32]`` and
transposed to the model's ``[E, in, out]``, as transformers'
``convert_moe_packed_tensors`` does.

**Cache**: :meth:`GptOssForCausalLM.make_cache` builds an interleaved
manager (:func:`jaxkv.nn.window_cache.interleaved_cache`): full layers in
the paged full group, sliding layers in a per-request ring of the last
``sliding_window`` tokens (``window_cache="ring"``) or kept paged
(``"paged"``). Each layer writes and attends through
:func:`jaxkv.nn.window_cache.attend_through_cache` with its window and
sinks. ``model(tokens, manager, slots, starts, num_new)`` (after
``manager.reserve``) is one jittable step, ``forward_packed(batch,
manager)`` a packed one, ``forward_dense(tokens)`` the no-cache check.
"""

from __future__ import annotations

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from jaxkv.errors import InvalidArgument
from jaxkv.nn.attention import check_implementation
from jaxkv.nn.gpt_oss_config import GptOssConfig
from jaxkv.nn.layers import (
    ExpertPlacement,
    Linear,
    RMSNorm,
    load_state,
    named_state,
    on_local_experts,
    param,
    save_checkpoint,
)
from jaxkv.nn.scan import DecoderStack
from jaxkv.nn.window_cache import InterleavedWindowModel, attend_through_cache, config_cache

__all__ = ["FP4_VALUES", "GptOssForCausalLM", "cache_for", "dequantize_mxfp4", "dequantize_mxfp4_experts"]

_F32 = jnp.float32

# --------------------------------------------------------------------------
# MXFP4
# --------------------------------------------------------------------------

#: FP4 e2m1 values by 4-bit code (bit 3: sign; bits 2-1: exponent, bias 1; bit 0: mantissa).
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
_MXFP4_SUFFIXES = ("_blocks", "_scales")


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray, *, name: str = "tensor") -> np.ndarray:
    """MXFP4 ``blocks [..., G, B]`` uint8 (two FP4 e2m1 codes a byte, low
    nibble first) with e8m0 ``scales [..., G]`` uint8 (``2 ** (s - 127)``
    per group of ``2 * B`` values) -> float32 ``[..., G * 2 * B]`` (the
    groups along the last axis, in order). No transpose. Raises
    ``InvalidArgument`` naming ``name`` for a wrong dtype or shape."""
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise InvalidArgument(f"mxfp4 tensor {name!r}: blocks and scales must be uint8, got {blocks.dtype} and "
                              f"{scales.dtype}")
    if blocks.ndim < 2 or blocks.shape[:-1] != scales.shape:
        raise InvalidArgument(f"mxfp4 tensor {name!r}: blocks {blocks.shape} must be scales' shape {scales.shape} "
                              f"plus one axis of bytes")
    values = np.empty(blocks.shape[:-1] + (2 * blocks.shape[-1],), np.float32)
    values[..., 0::2] = FP4_VALUES[blocks & 0x0F]
    values[..., 1::2] = FP4_VALUES[blocks >> 4]
    values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
    return values.reshape(*blocks.shape[:-2], -1)


def dequantize_mxfp4_experts(tensors: dict[str, np.ndarray], *, source: str = "state dict") -> dict[str, np.ndarray]:
    """``tensors`` with every ``X_blocks`` / ``X_scales`` pair replaced by
    ``X`` (:func:`dequantize_mxfp4`, the last two axes swapped: the
    checkpoint's ``[E, out, in]`` to transformers' parameter ``[E, in,
    out]``); other tensors pass through. Raises ``InvalidArgument`` naming
    a blocks tensor without scales (or the reverse) or a bad pair."""
    out, pairs = {}, {}
    for name, arr in tensors.items():
        suffix = next((s for s in _MXFP4_SUFFIXES if name.endswith(s)), None)
        if suffix is None:
            out[name] = arr
        else:
            pairs.setdefault(name[:-len(suffix)], {})[suffix] = arr
    for base, pair in pairs.items():
        for suffix in _MXFP4_SUFFIXES:
            if suffix not in pair:
                other = next(iter(pair))
                raise InvalidArgument(f"mxfp4 checkpoint ({source}) has {base + other!r} but no {base + suffix!r}")
        if base in out:
            raise InvalidArgument(f"checkpoint ({source}) has both {base!r} and its mxfp4 {base + '_blocks'!r}")
        values = dequantize_mxfp4(pair["_blocks"], pair["_scales"], name=base + "_blocks")
        if values.ndim < 2:
            raise InvalidArgument(f"mxfp4 tensor {base + '_blocks'!r} has too few axes: {np.shape(pair['_blocks'])}")
        out[base] = np.ascontiguousarray(np.swapaxes(values, -1, -2))
    return out


# --------------------------------------------------------------------------
# RoPE (YaRN)
# --------------------------------------------------------------------------


@functools.lru_cache(maxsize=32)
def _rope_table(config: GptOssConfig):
    return config.rope.inv_freq(config.head_dim, config.max_position_embeddings)


def _rope(config: GptOssConfig, x, positions):
    """RoPE (halves) on ``x [B, T, H, D]`` at ``positions [B, T]`` with
    YaRN's attention factor on cos/sin, cos/sin rounded to ``x.dtype`` as
    transformers' rotary embedding returns them."""
    inv_freq, scaling = _rope_table(config)
    angles = jnp.maximum(positions, 0).astype(_F32)[..., None] * jnp.asarray(inv_freq)  # [B, T, D/2]
    cos = (jnp.cos(angles) * scaling).astype(x.dtype).astype(_F32)[:, :, None, :]
    sin = (jnp.sin(angles) * scaling).astype(x.dtype).astype(_F32)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(_F32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


# --------------------------------------------------------------------------
# Modules
# --------------------------------------------------------------------------


class GptOssAttention(nnx.Module):
    """``self_attn`` of one layer (module docstring)."""

    def __init__(self, config: GptOssConfig, layer: int, *, rngs, param_dtype, precision):
        c = config
        lin = functools.partial(Linear, rngs=rngs, param_dtype=param_dtype, precision=precision, bias=c.attention_bias)
        self.config = c
        self.sliding_window = c.sliding_window if c.is_sliding(layer) else None
        #: Set on a mesh (:func:`jaxkv.nn.sharding.place_heads`): the kernels run on each device's heads.
        self.heads_placement = None
        self.q_proj = lin(c.hidden_size, c.num_attention_heads * c.head_dim)
        self.k_proj = lin(c.hidden_size, c.num_key_value_heads * c.head_dim)
        self.v_proj = lin(c.hidden_size, c.num_key_value_heads * c.head_dim)
        self.o_proj = lin(c.num_attention_heads * c.head_dim, c.hidden_size)
        self.sinks = param((c.num_attention_heads,), rngs, param_dtype, std=0.02)

    def project(self, x, positions):
        """``(q [..., W, H, D], k, v [..., W, KVH, D])`` for ``x [B, W, hidden]``
        at ``positions [B, W]`` (RoPE on q and k)."""
        c = self.config
        b, w, _ = x.shape
        q = self.q_proj(x).reshape(b, w, c.num_attention_heads, c.head_dim)
        k = self.k_proj(x).reshape(b, w, c.num_key_value_heads, c.head_dim)
        v = self.v_proj(x).reshape(b, w, c.num_key_value_heads, c.head_dim)
        return _rope(c, q, positions), _rope(c, k, positions), v

    def output(self, attended):
        """``o_proj`` of ``attended [B, W, H, D]``."""
        return self.o_proj(attended.reshape(*attended.shape[:2], -1))

    def through_cache(self, h, positions, handle):
        """``h [B, W, hidden]`` at ``positions [B, W]`` (-1: padding) through
        the layer's cache (:func:`~jaxkv.nn.window_cache.attend_through_cache`).
        Returns ``(y [B, W, hidden], handle)``."""
        c = self.config
        b, w = h.shape[:2]
        q, k, v = self.project(h, jnp.maximum(positions, 0))
        out, handle = attend_through_cache(
            handle, q.reshape(b * w, c.num_attention_heads, c.head_dim),
            k.reshape(b * w, c.num_key_value_heads, c.head_dim), v.reshape(b * w, c.num_key_value_heads, c.head_dim),
            sm_scale=c.sm_scale, sliding_window=self.sliding_window, sinks=self.sinks[...].astype(_F32),
            heads=self.heads_placement)
        return self.output(out.reshape(b, w, c.num_attention_heads, c.head_dim).astype(h.dtype)), handle

    def dense(self, h, positions):
        """No cache: ``h [B, T, hidden]``, every row one sequence at
        ``positions [B, T]``, causal (and windowed on a sliding layer)."""
        c = self.config
        t = h.shape[1]
        q, k, v = self.project(h, positions)
        g = c.num_attention_heads // c.num_key_value_heads
        k, v = jnp.repeat(k, g, axis=2).astype(_F32), jnp.repeat(v, g, axis=2).astype(_F32)
        logits = jnp.einsum("bthd,bshd->bhts", q.astype(_F32), k) * c.sm_scale
        rel = positions[:, :, None] - positions[:, None, :]  # [B, T, S]: query minus key position
        allowed = rel >= 0
        if self.sliding_window is not None:
            allowed &= rel < self.sliding_window
        logits = jnp.where(allowed[:, None], logits, -jnp.inf)
        sinks = jnp.broadcast_to(self.sinks[...].astype(_F32)[None, :, None, None], logits.shape[:3] + (1,))
        combined = jnp.concatenate([logits, sinks], axis=-1)
        probs = jax.nn.softmax(combined, axis=-1)[..., :t]
        attended = jnp.einsum("bhts,bshd->bthd", probs, v).astype(h.dtype)
        return self.output(attended)


class GptOssExperts(nnx.Module):
    """The experts in transformers' layout: ``gate_up_proj [E, hidden, 2I]``
    (gate and up columns interleaved) + ``gate_up_proj_bias [E, 2I]``,
    ``down_proj [E, I, hidden]`` + ``down_proj_bias [E, hidden]``."""

    def __init__(self, config: GptOssConfig, *, rngs, param_dtype, precision):
        c = config
        e, d, i = c.num_local_experts, c.hidden_size, c.intermediate_size
        self.gate_up_proj = param((e, d, 2 * i), rngs, param_dtype, std=d ** -0.5)
        self.gate_up_proj_bias = param((e, 2 * i), rngs, param_dtype, std=0.02)
        self.down_proj = param((e, i, d), rngs, param_dtype, std=i ** -0.5)
        self.down_proj_bias = param((e, d), rngs, param_dtype, std=0.02)
        self.alpha = float(c.swiglu_alpha)
        self.limit = float(c.swiglu_limit)
        self.precision = precision
        # Set by jaxkv.nn.sharding.place_experts when the expert axis is split over a mesh.
        self.placement: ExpertPlacement | None = None

    def __call__(self, x, experts, weights):
        """``sum_k weights[:, k] * expert[experts[:, k]](x)`` (``x [N, D]``,
        ``experts`` / ``weights`` ``[N, k]``): token copies sorted by
        expert, one ``ragged_dot`` per projection; on a mesh that splits the
        experts, each device's own experts under ``shard_map``
        (:func:`~jaxkv.nn.layers.on_local_experts`)."""
        params = (self.gate_up_proj[...], self.gate_up_proj_bias[...], self.down_proj[...], self.down_proj_bias[...])
        if self.placement is None:
            return self._routed(x, experts, weights, *params)
        return on_local_experts(self._routed, self.placement, x, experts, weights, params)

    def _routed(self, x, experts, weights, gate_up_proj, gate_up_bias, down_proj, down_bias, local=None):
        """The grouped matmuls over the experts of the given weights;
        ``local`` (``[N, k]`` bool, under ``on_local_experts``): which copies
        go to these experts (the others, their ids out of range, count in no
        group and add nothing)."""
        k = experts.shape[1]
        num_experts = gate_up_proj.shape[0]
        flat = experts.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        token, chosen = order // k, flat[order]
        sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)  # ids >= num_experts: not counted
        gate_up = jax.lax.ragged_dot(x[token], gate_up_proj.astype(x.dtype), sizes, precision=self.precision)
        gate_up = gate_up + gate_up_bias.astype(x.dtype)[chosen]
        gate, up = gate_up[..., 0::2], gate_up[..., 1::2]
        gate = jnp.minimum(gate, self.limit)
        up = jnp.clip(up, -self.limit, self.limit)
        glu = gate * jax.nn.sigmoid(gate * self.alpha)
        out = jax.lax.ragged_dot((up + 1) * glu, down_proj.astype(x.dtype), sizes, precision=self.precision)
        out = out + down_bias.astype(x.dtype)[chosen]
        out = out * weights.reshape(-1)[order][:, None].astype(out.dtype)
        if local is not None:  # the copies of other devices' experts (sorted last: rows past the groups)
            out = jnp.where(local.reshape(-1)[order][:, None], out, jnp.zeros_like(out))
        return jnp.zeros_like(x).at[token].add(out)


class GptOssMLP(nnx.Module):
    """``router`` (top-k of the logits, softmax over those) and ``experts``."""

    def __init__(self, config: GptOssConfig, *, rngs, param_dtype, precision):
        c = config
        self.config = c
        self.router = Linear(c.hidden_size, c.num_local_experts, rngs=rngs, param_dtype=param_dtype,
                             precision=precision, bias=True)
        self.experts = GptOssExperts(c, rngs=rngs, param_dtype=param_dtype, precision=precision)

    def __call__(self, x):
        flat = x.reshape(-1, x.shape[-1])
        logits = self.router(flat).astype(_F32)
        top, experts = jax.lax.top_k(logits, self.config.num_experts_per_tok)
        weights = jax.nn.softmax(top, axis=-1)
        return self.experts(flat, experts.astype(jnp.int32), weights.astype(flat.dtype)).reshape(x.shape)


class GptOssDecoderLayer(nnx.Module):
    def __init__(self, config: GptOssConfig, layer: int, *, rngs, param_dtype, precision):
        c = config
        self.kind = c.layer_types[layer]
        self.self_attn = GptOssAttention(c, layer, rngs=rngs, param_dtype=param_dtype, precision=precision)
        self.mlp = GptOssMLP(c, rngs=rngs, param_dtype=param_dtype, precision=precision)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, param_dtype=_F32)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, param_dtype=_F32)

    def finish(self, x, mixed):
        """Residual add of the attention output, then the MoE block."""
        x = x + mixed
        return x + self.mlp(self.post_attention_layernorm(x))


class GptOssForCausalLM(InterleavedWindowModel, nnx.Module):
    """gpt-oss over a :class:`~jaxkv.KVCacheManager` (module docstring).
    ``implementation`` chooses the paged attention kernel by
    :mod:`kernels_pallas`'s rule. ``scan_layers`` (default: stacked unless built on a
    GPU, :func:`jaxkv.nn.scan.default_scan_layers`): the
    alternating window and full layers run under one ``lax.scan`` over
    their pattern (:class:`~jaxkv.nn.scan.DecoderStack`), so compile time
    does not grow with depth; False unrolls them (same weights from the
    same seed, same tokens)."""

    def __init__(self, config: GptOssConfig, *, rngs: nnx.Rngs, dtype=_F32, param_dtype=_F32, precision=None,
                 implementation: str | None = None, scan_layers: bool | None = None):
        check_implementation(implementation, False)
        c = config
        self.config = c
        self.dtype = jnp.dtype(dtype)
        self.param_dtype = jnp.dtype(param_dtype)
        self.implementation = implementation
        self.embed_tokens = nnx.Dict(weight=param((c.vocab_size, c.hidden_size), rngs, param_dtype, std=1.0))
        self.layers = DecoderStack(
            c.num_hidden_layers,
            lambda i, r: GptOssDecoderLayer(c, i, rngs=r, param_dtype=param_dtype, precision=precision),
            signature=lambda i: c.layer_types[i], rngs=rngs, scan=scan_layers)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, param_dtype=_F32)
        if not c.tie_word_embeddings:
            self.lm_head = Linear(c.hidden_size, c.vocab_size, rngs=rngs, param_dtype=param_dtype, precision=precision)

    # ---------------------------------------------------------------- cache

    # ------------------------------------------------------------- forward

    def _embed(self, tokens):
        return self.embed_tokens["weight"][...][jnp.asarray(tokens, jnp.int32)].astype(self.dtype)

    def _logits(self, x):
        x = self.norm(x)
        if self.config.tie_word_embeddings:
            return jnp.einsum("...d,vd->...v", x, self.embed_tokens["weight"][...].astype(x.dtype)).astype(_F32)
        return self.lm_head(x).astype(_F32)

    def forward_dense(self, tokens: Int[Array, "*B T"]) -> Float[Array, "*B T V"]:
        """No cache: each row of ``tokens`` (``[T]`` or ``[B, T]``) one
        sequence from position 0, causal attention (windowed on sliding
        layers) with sinks. Returns float32 logits of the same leading
        shape."""
        tokens = jnp.asarray(tokens, jnp.int32)
        squeeze = tokens.ndim == 1
        tokens = tokens.reshape(-1, tokens.shape[-1])
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        x = self.layers.run(
            lambda layer, i, x: layer.finish(x, layer.self_attn.dense(layer.input_layernorm(x), positions)),
            self._embed(tokens))
        logits = self._logits(x)
        return logits[0] if squeeze else logits

    # ---------------------------------------------------- HF checkpoints

    @classmethod
    def from_hf_state_dict(cls, config: GptOssConfig, tensors: dict[str, np.ndarray], *, dtype=None,
                           param_dtype=None, precision=None, implementation: str | None = None,
                           source: str = "state dict", scan_layers: bool | None = None) -> GptOssForCausalLM:
        """Build the model from transformers-named arrays (MXFP4 expert pairs
        ``*_blocks`` / ``*_scales`` dequantized). Raises ``InvalidArgument``
        naming a missing, misshapen or unexpected tensor."""
        param_dtype = jnp.dtype(param_dtype or jnp.float32)
        dtype = jnp.dtype(dtype or param_dtype)
        abstract = nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=param_dtype,
                                              precision=precision, implementation=implementation,
                                              scan_layers=scan_layers))
        tensors = dequantize_mxfp4_experts(tensors, source=source)
        tied = config.tie_word_embeddings
        return load_state(abstract, tensors, lambda p: p if p.startswith("lm_head.") else "model." + p,
                          family="gpt_oss", source=source,
                          ignored=lambda n: n.endswith("inv_freq") or (tied and n == "lm_head.weight"))

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, *, dtype=None, param_dtype=None, precision=None,
                        implementation: str | None = None, scan_layers: bool | None = None) -> GptOssForCausalLM:
        """Load a local transformers checkpoint directory (sharded or not;
        MXFP4 experts dequantized to float32 first, then cast)."""
        from jaxkv.nn.checkpoint import dequantize_checkpoint, load_tensors, read_config

        raw = read_config(path)
        config = GptOssConfig.from_hf(raw)
        quant = raw.get("quantization_config")
        tensors = load_tensors(path)
        if isinstance(quant, dict) and quant.get("quant_method") == "mxfp4":
            tensors = dequantize_mxfp4_experts(tensors, source=os.fspath(path))
            quant = None
        elif any(n.endswith("_blocks") for n in tensors):
            name = next(n for n in tensors if n.endswith("_blocks"))
            raise InvalidArgument(f"checkpoint ({os.fspath(path)}) has mxfp4 tensor {name!r} but its "
                                  f"quantization_config is {json.dumps(quant)} (want quant_method 'mxfp4')")
        tensors = dequantize_checkpoint(tensors, quant)
        return cls.from_hf_state_dict(config, tensors, dtype=dtype, param_dtype=param_dtype, precision=precision,
                                      implementation=implementation, source=os.fspath(path), scan_layers=scan_layers)

    def save_pretrained(self, path: str | os.PathLike) -> None:
        """``config.json`` + ``model.safetensors`` under transformers' names
        (experts dequantized: no ``quantization_config``)."""
        hf = self.config.to_hf()
        hf.pop("quantization_config", None)
        save_checkpoint(path, {**hf, "torch_dtype": self.param_dtype.name},
                        named_state(self, lambda p: p if p.startswith("lm_head.") else "model." + p))


#: The cache of :meth:`make_cache <jaxkv.nn.window_cache.InterleavedWindowModel.make_cache>` from the config
#: alone (no weights: sizing a real model costs nothing).
cache_for = config_cache
