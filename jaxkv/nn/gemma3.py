"""Gemma 3 text causal LM (Flax NNX): interleaved sliding-window and global attention.

The architecture as transformers (5.x) defines ``Gemma3ForCausalLM``
(``Gemma3TextModel``), with its parameter names and layouts (weights
``[out, in]``)::

    embed_tokens (scaled by sqrt(hidden_size), the scale rounded to the compute dtype)
    per layer:  input_layernorm -> self_attn -> post_attention_layernorm -> + residual
                pre_feedforward_layernorm -> mlp -> post_feedforward_layernorm -> + residual
    norm -> lm_head (tied to embed_tokens unless tie_word_embeddings is false)
         -> optional final_logit_softcapping: cap * tanh(logits / cap)

Every norm is zero-centred, ``x / rms(x) * (1 + weight)`` in float32 (also
the per-head ``q_norm`` / ``k_norm``). The MLP is ``down(gelu_tanh(gate(x)) *
up(x))``.

**Attention** (``self_attn``): q/k/v projections (GQA), per-head q_norm and
k_norm, RoPE (rotate-half) with the layer type's base and scaling (the
sliding layers: ``rope_local_base_freq``, usually unscaled; the global
layers: ``rope_theta`` with ``rope_scaling``, e.g. linear factor 8), logits
scaled by ``query_pre_attn_scalar ** -0.5``, then causal softmax (never
soft-capped: transformers' ``Gemma3Attention`` reads
``attn_logit_softcapping`` but never applies it, unlike Gemma 2; released
checkpoints set it null, and :class:`Gemma3Config` refuses a value rather
than ignore it); a ``sliding_attention`` layer sees only keys at positions
``(p - sliding_window, p]``.

The cache (:func:`cache_for`, :func:`jaxkv.nn.window_cache.interleaved_cache`):
the global layers' K/V in the paged full group; the sliding layers' K/V
either in a per-request ring of the last ``sliding_window`` tokens
(``window_cache="ring"``) or in the paged group too (``"paged"``). Every
layer goes through :func:`~jaxkv.nn.window_cache.attend_through_cache`.

The whole step is one jittable call: ``model(tokens, manager, slots,
starts, num_new)`` after ``manager.reserve``, so :func:`jaxkv.nn.generate`
serves it; ``model.forward_packed(batch, manager)`` runs a packed step
(:class:`~jaxkv.nn.packed.PackedBatch`); ``model.forward_dense(tokens)``
runs one sequence with no cache (the reference the cache paths are tested
against).
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from jaxkv.nn.attention import check_implementation
from jaxkv.nn.gemma3_config import Gemma3Config
from jaxkv.nn.layers import (
    Linear,
    ZeroCenteredRMSNorm,
    load_state,
    named_state,
    param,
    read_checkpoint,
    save_checkpoint,
)
from jaxkv.nn.rope import apply_rope, rope_inv_freq
from jaxkv.nn.scan import DecoderStack
from jaxkv.nn.window_cache import InterleavedWindowModel, attend_through_cache, config_cache

__all__ = ["Gemma3ForCausalLM", "cache_for"]

_F32 = jnp.float32


def _soft_cap(x, cap: float | None):
    return x if cap is None else cap * jnp.tanh(x / cap)


class GemmaMLP(nnx.Module):
    """``down(gelu(gate(x)) * up(x))`` (the tanh GELU unless the config says ``gelu``)."""

    def __init__(self, config: Gemma3Config, *, rngs, param_dtype, precision):
        c = config
        lin = functools.partial(Linear, rngs=rngs, param_dtype=param_dtype, precision=precision)
        self.gate_proj = lin(c.hidden_size, c.intermediate_size)
        self.up_proj = lin(c.hidden_size, c.intermediate_size)
        self.down_proj = lin(c.intermediate_size, c.hidden_size)
        self.approximate = c.gelu_approximate

    def __call__(self, x):
        return self.down_proj(jax.nn.gelu(self.gate_proj(x), approximate=self.approximate) * self.up_proj(x))


class Gemma3Attention(nnx.Module):
    """``self_attn`` of one layer (module docstring)."""

    def __init__(self, config: Gemma3Config, layer: int, *, rngs, param_dtype, precision):
        c = config
        lin = functools.partial(Linear, rngs=rngs, param_dtype=param_dtype, precision=precision, bias=c.attention_bias)
        self.config = c
        self.sliding_window = c.sliding_window if c.is_sliding(layer) else None
        #: Set on a mesh (:func:`jaxkv.nn.sharding.place_heads`): the kernels run on each device's heads.
        self.heads_placement = None
        # Gemma 3's attention logits are never capped (the config refuses attn_logit_softcapping).
        self.logit_soft_cap = None
        theta, scaling = c.rope_of(layer)
        self.rope = (theta, scaling)
        self.q_proj = lin(c.hidden_size, c.num_attention_heads * c.head_dim)
        self.k_proj = lin(c.hidden_size, c.num_key_value_heads * c.head_dim)
        self.v_proj = lin(c.hidden_size, c.num_key_value_heads * c.head_dim)
        self.o_proj = lin(c.num_attention_heads * c.head_dim, c.hidden_size)
        self.q_norm = ZeroCenteredRMSNorm(c.head_dim, c.rms_norm_eps, param_dtype=param_dtype)
        self.k_norm = ZeroCenteredRMSNorm(c.head_dim, c.rms_norm_eps, param_dtype=param_dtype)

    def project(self, x, positions):
        """``(q [B,W,H,D], k, v [B,W,KVH,D])`` for ``x [B, W, hidden]`` at ``positions [B, W]`` (>= 0)."""
        c = self.config
        b, w, _ = x.shape
        q = self.q_proj(x).reshape(b, w, c.num_attention_heads, c.head_dim)
        k = self.k_proj(x).reshape(b, w, c.num_key_value_heads, c.head_dim)
        v = self.v_proj(x).reshape(b, w, c.num_key_value_heads, c.head_dim)
        inv_freq = rope_inv_freq(c.head_dim, *self.rope)
        return apply_rope(self.q_norm(q), positions, inv_freq), apply_rope(self.k_norm(k), positions, inv_freq), v

    def output(self, attended):
        """``o_proj`` of ``attended [B, W, H, D]``."""
        return self.o_proj(attended.reshape(*attended.shape[:2], -1))

    def dense(self, h):
        """One sequence ``h [1, T, hidden]`` from position 0, no cache."""
        c = self.config
        t = h.shape[1]
        positions = jnp.arange(t, dtype=jnp.int32)[None, :]
        q, k, v = self.project(h, positions)
        g = c.num_attention_heads // c.num_key_value_heads
        k, v = jnp.repeat(k, g, axis=2).astype(_F32), jnp.repeat(v, g, axis=2).astype(_F32)
        logits = jnp.einsum("bthd,bshd->bhts", q.astype(_F32), k) * c.attention_scale
        logits = _soft_cap(logits, self.logit_soft_cap)
        qi, ki = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
        visible = ki <= qi
        if self.sliding_window is not None:
            visible &= ki > qi - self.sliding_window
        probs = jax.nn.softmax(jnp.where(visible, logits, -jnp.inf), axis=-1)
        return self.output(jnp.einsum("bhts,bshd->bthd", probs, v).astype(h.dtype))

    def through_cache(self, h, positions, handle):
        """``h [B, W, hidden]`` at ``positions [B, W]`` (-1: padding) through
        the layer's cache: K/V written, each token attending its request's
        keys up to its own (within the window on a sliding layer). Returns
        ``(y [B, W, hidden], handle)``."""
        c = self.config
        b, w = h.shape[:2]
        q, k, v = self.project(h, jnp.maximum(positions, 0))
        out, handle = attend_through_cache(
            handle, q.reshape(b * w, c.num_attention_heads, c.head_dim),
            k.reshape(b * w, c.num_key_value_heads, c.head_dim), v.reshape(b * w, c.num_key_value_heads, c.head_dim),
            sm_scale=c.attention_scale, sliding_window=self.sliding_window, logit_soft_cap=self.logit_soft_cap,
            heads=self.heads_placement)
        return self.output(out.reshape(b, w, c.num_attention_heads, c.head_dim).astype(h.dtype)), handle


class Gemma3DecoderLayer(nnx.Module):
    def __init__(self, config: Gemma3Config, layer: int, *, rngs, param_dtype, precision):
        c = config
        self.sliding = c.is_sliding(layer)
        self.self_attn = Gemma3Attention(c, layer, rngs=rngs, param_dtype=param_dtype, precision=precision)
        self.mlp = GemmaMLP(c, rngs=rngs, param_dtype=param_dtype, precision=precision)
        norm = functools.partial(ZeroCenteredRMSNorm, c.hidden_size, c.rms_norm_eps, param_dtype=param_dtype)
        self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.post_feedforward_layernorm = norm()

    def finish(self, x, attended):
        """The attention block's residual add (after its post-norm), then the MLP block."""
        x = x + self.post_attention_layernorm(attended)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3ForCausalLM(InterleavedWindowModel, nnx.Module):
    """Gemma 3 text over a :class:`~jaxkv.KVCacheManager` (see the module
    docstring): global layers' K/V paged, sliding layers' K/V in per-request
    rings (or paged). ``implementation`` chooses the attention kernel by
    :mod:`kernels_pallas`'s rule. ``scan_layers`` (default: stacked unless built on a
    GPU, :func:`jaxkv.nn.scan.default_scan_layers`): the
    layers run under one ``lax.scan`` over their repeating pattern of
    window and global layers (:class:`~jaxkv.nn.scan.DecoderStack`), so
    compile time does not grow with depth; False unrolls them (same
    weights from the same seed, same tokens)."""

    def __init__(self, config: Gemma3Config, *, rngs: nnx.Rngs, dtype=_F32, param_dtype=_F32, precision=None,
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
            lambda i, r: Gemma3DecoderLayer(c, i, rngs=r, param_dtype=param_dtype, precision=precision),
            signature=c.is_sliding, rngs=rngs, scan=scan_layers)
        self.norm = ZeroCenteredRMSNorm(c.hidden_size, c.rms_norm_eps, param_dtype=param_dtype)
        if not c.tie_word_embeddings:
            self.lm_head = Linear(c.hidden_size, c.vocab_size, rngs=rngs, param_dtype=param_dtype, precision=precision)

    # ---------------------------------------------------------------- cache

    # ------------------------------------------------------------- forward

    def _embed(self, tokens):
        x = self.embed_tokens["weight"][...][jnp.asarray(tokens, jnp.int32)].astype(self.dtype)
        # transformers: a float32 buffer sqrt(hidden_size), cast to the weights' dtype, times the embeddings.
        return x * jnp.asarray(np.float32(self.config.embed_scale), self.dtype)

    def _logits(self, x):
        x = self.norm(x)
        if self.config.tie_word_embeddings:
            logits = jnp.einsum("...d,vd->...v", x, self.embed_tokens["weight"][...].astype(x.dtype))
        else:
            logits = self.lm_head(x)
        return _soft_cap(logits.astype(_F32), self.config.final_logit_softcapping)

    def forward_dense(self, tokens: Int[Array, " T"]) -> Float[Array, "T V"]:
        """One sequence from position 0 with no cache (dense causal attention,
        the sliding layers masked to their window). Returns ``[T, vocab]`` float32."""
        x = self._embed(jnp.asarray(tokens, jnp.int32).reshape(1, -1))
        x = self.layers.run(lambda layer, i, x: layer.finish(x, layer.self_attn.dense(layer.input_layernorm(x))), x)
        return self._logits(x)[0]

    # ---------------------------------------------------- HF checkpoints

    @classmethod
    def from_hf_state_dict(cls, config: Gemma3Config, tensors: dict[str, np.ndarray], *, dtype=None,
                           param_dtype=None, precision=None, implementation: str | None = None,
                           source: str = "state dict", scan_layers: bool | None = None) -> Gemma3ForCausalLM:
        """Build the model from transformers-named arrays (``model.*``,
        ``lm_head.weight`` when untied). Raises ``InvalidArgument`` naming a
        missing, misshapen or unexpected tensor."""
        param_dtype = jnp.dtype(param_dtype or jnp.float32)
        dtype = jnp.dtype(dtype or param_dtype)
        abstract = nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=param_dtype,
                                              precision=precision, implementation=implementation,
                                              scan_layers=scan_layers))
        tied = config.tie_word_embeddings
        return load_state(abstract, tensors, lambda p: p if p.startswith("lm_head.") else "model." + p,
                          family="gemma3_text", source=source,
                          ignored=lambda n: n.endswith("inv_freq") or (tied and n == "lm_head.weight"))

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, *, dtype=None, param_dtype=None, precision=None,
                        implementation: str | None = None, scan_layers: bool | None = None) -> Gemma3ForCausalLM:
        """Load a local transformers checkpoint directory (sharded or not)."""
        raw, tensors = read_checkpoint(path)
        return cls.from_hf_state_dict(Gemma3Config.from_hf(raw), tensors, dtype=dtype, param_dtype=param_dtype,
                                      precision=precision, implementation=implementation, source=os.fspath(path),
                                      scan_layers=scan_layers)

    def save_pretrained(self, path: str | os.PathLike) -> None:
        """``config.json`` + ``model.safetensors`` under transformers' names."""
        save_checkpoint(path, {**self.config.to_hf(), "torch_dtype": self.param_dtype.name},
                        named_state(self, lambda p: p if p.startswith("lm_head.") else "model." + p))


#: The cache of :meth:`make_cache <jaxkv.nn.window_cache.InterleavedWindowModel.make_cache>` from the config
#: alone (no weights: sizing a real model costs nothing).
cache_for = config_cache
