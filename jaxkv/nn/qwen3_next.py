"""Qwen3-Next causal LM (Flax NNX): Gated DeltaNet and gated attention over the hybrid cache.

The architecture as transformers (5.x) defines it, with its parameter names
and layouts (weights ``[out, in]``)::

    embed_tokens
    per layer:  input_layernorm -> linear_attn (Gated DeltaNet) or self_attn
                (gated full attention) -> + residual
                post_attention_layernorm -> mlp (MoE with a gated shared
                expert, or a dense SwiGLU) -> + residual
    norm -> lm_head

Norms are zero-centred: ``x / rms(x) * (1 + weight)``.

**Gated DeltaNet** (``linear_attn``). ``in_proj_qkvz`` and ``in_proj_ba``
are laid out per key head (``[q, k, v..., z...]`` and ``[b..., a...]``, each
key head serving ``Hv / Hk`` value heads). ``q, k, v`` go through a causal
depthwise conv1d (kernel ``linear_conv_kernel_dim``, SiLU) whose state is
the last ``kernel - 1`` inputs; then ``beta = sigmoid(b)``, ``g = -exp(A_log)
* softplus(a + dt_bias)``, q and k are L2-normalized and q scaled by
``Dk ** -0.5``; per value head the state ``S [Dk, Dv]`` follows the gated
delta rule ``S <- exp(g) S + k (beta (v - (exp(g) S)^T k))^T`` and the output
is ``S^T q``; then a gated RMSNorm (``weight * norm(o) * silu(z)``) and
``out_proj``. Prefill runs the *chunked* form (chunks of 64: a unit
lower-triangular solve per chunk, then a scan over chunks, as transformers'
``torch_chunk_gated_delta_rule``), a one-token step the *recurrent* form;
both leave the same state (tested). The states live in the manager's
:class:`~jaxkv.GDNPool` (``[Dv, Dk]`` per head there: the transpose).

**Gated attention** (``self_attn``): ``q_proj`` gives, per head, the query
and a gate of ``head_dim`` each; per-head zero-centred RMSNorm on q and k;
RoPE (halves) on the first ``head_dim * partial_rotary_factor`` dims; the
output is multiplied by ``sigmoid(gate)`` before ``o_proj``. K/V live in the
manager's paged ``full`` group, read through :func:`kernels_pallas.paged_attention`.

**MoE**: softmax router, top ``num_experts_per_tok`` (renormalized with
``norm_topk_prob``), SwiGLU experts (grouped matmuls), plus a shared expert
scaled by ``sigmoid(shared_expert_gate(x))``.

The whole step (every layer, both kinds) is one jittable call:
``model(tokens, manager, slots, starts, num_new)`` after
``manager.reserve``, as :class:`~jaxkv.nn.DeepseekV4ForCausalLM`; so
:func:`jaxkv.nn.generate` serves it. ``model.forward_packed(batch, manager)``
runs a packed step (:class:`~jaxkv.nn.packed.PackedBatch`): one flat stream
of prefill pieces and decode tokens, the Gated DeltaNet's conv and delta rule
on the batch's per-lane-class segments.

With ``scan_layers`` (the default off a GPU) the decoder layers run under one
``lax.scan`` (:class:`~jaxkv.nn.scan.DecoderStack`): a layer's signature is
its kind and whether its MLP is MoE, so the usual three Gated DeltaNet
layers and one full-attention layer form the scanned pattern, and layers
that break it (``mlp_only_layers``, a depth the pattern does not divide)
stay unrolled. Inside the scan the layer index is traced; the cache is
acquired with ``like=`` the static layer of the same column. Checkpoints
name layers one by one either way (``load_state``/``named_state``).
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from jaxkv._ops import place_kv
from jaxkv.errors import InvalidArgument
from jaxkv.manager.hybrid import KVCacheManager
from jaxkv.manager.hybrid_schema import AttentionKind, HybridConfig, LayerSpec
from jaxkv.nn.attention import check_implementation
from jaxkv.nn.layers import (Experts, Linear, SwiGLU, ZeroCenteredRMSNorm, fuse_experts, load_state, named_state,
                             param, read_checkpoint, save_checkpoint)
from jaxkv.nn.packed import PackedBatch, lane_logits
from jaxkv.nn.qwen3_next_config import Qwen3NextConfig
from jaxkv.nn.rope import apply_rope, rope_inv_freq
from jaxkv.nn.scan import DecoderStack

__all__ = ["Qwen3NextForCausalLM", "cache_for", "chunk_gated_delta_rule", "recurrent_gated_delta_rule"]

_F32 = jnp.float32
CHUNK = 64  # transformers' chunk of the chunked form


class GatedRMSNorm(nnx.Module):
    """``weight * x / rms(x) * silu(gate)`` (the Gated DeltaNet output norm)."""

    def __init__(self, dim: int, eps: float, *, param_dtype=_F32):
        self.weight = param((dim,), None, param_dtype, fill=1.0)
        self.eps = eps

    def __call__(self, x, gate):
        xf = x.astype(_F32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (self.weight[...].astype(_F32) * xf.astype(x.dtype) * jax.nn.silu(gate.astype(_F32))).astype(x.dtype)


# --------------------------------------------------------------------------
# The gated delta rule, both forms. q, k [B, T, H, Dk] (normalized, q
# scaled), v [B, T, H, Dv], g, beta [B, T, H], state [B, H, Dk, Dv]; padded
# tokens carry k = 0, beta = 0, g = 0 (they change nothing).
# --------------------------------------------------------------------------


def recurrent_gated_delta_rule(q, k, v, g, beta, state):
    """Token by token: ``(out [B, T, H, Dv], state)``."""
    def step(s, x):
        q_t, k_t, v_t, g_t, b_t = x
        s = s * jnp.exp(g_t)[..., None, None]
        memory = jnp.sum(s * k_t[..., None], axis=-2)  # [B, H, Dv]
        delta = (v_t - memory) * b_t[..., None]
        s = s + k_t[..., None] * delta[..., None, :]
        return s, jnp.sum(s * q_t[..., None], axis=-2)

    xs = [jnp.moveaxis(a.astype(_F32), 1, 0) for a in (q, k, v, g, beta)]
    state, out = jax.lax.scan(step, state.astype(_F32), xs)
    return jnp.moveaxis(out, 0, 1), state


def unit_lower_inverse(ut):
    """``inv(I + strictly_lower(ut))`` over the last two axes, row by row as
    transformers computes it (row ``i`` of the inverse from rows ``< i``).

    Not ``solve_triangular``: on XLA's CPU backend its batched LAPACK call
    waits on a thread pool that the other devices of a multi-device mesh
    hold, and the program never finishes (seen with 2 and 8 host devices);
    this loop is plain matmuls on every backend."""
    size = ut.shape[-1]
    below = jnp.arange(size)[:, None] > jnp.arange(size)[None, :]
    rows = -jnp.where(below, ut, 0.0)

    def row(i, rows):
        current = rows[..., i, :]  # zero at columns >= i
        updated = current + jnp.einsum("...j,...jk->...k", current, rows)  # rows < i are final
        return rows.at[..., i, :].set(updated)

    return jax.lax.fori_loop(1, size, row, rows) + jnp.eye(size, dtype=rows.dtype)


def chunk_gated_delta_rule(q, k, v, g, beta, state, chunk: int = CHUNK):
    """The chunked (WY) form, transformers' ``torch_chunk_gated_delta_rule``
    step for step: ``(out [B, T, H, Dv], state)``."""
    b, t, h, dk = k.shape
    pad = (-t) % chunk
    q, k, v, g, beta = (jnp.pad(jnp.moveaxis(a.astype(_F32), 1, 2),
                                ((0, 0), (0, 0), (0, pad)) + ((0, 0),) * (a.ndim - 3))
                        for a in (q, k, v, g, beta))  # [B, H, T', ...]
    n = (t + pad) // chunk
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    q, k, k_beta, v_beta = (a.reshape(b, h, n, chunk, a.shape[-1]) for a in (q, k, k_beta, v_beta))
    cum = jnp.cumsum(g.reshape(b, h, n, chunk), axis=-1)
    upper = jnp.triu(jnp.ones((chunk, chunk), bool), 1)
    pairwise = jnp.exp(jnp.where(upper, -jnp.inf, cum[..., :, None] - cum[..., None, :]))
    ut = (k_beta @ jnp.swapaxes(k, -1, -2)) * pairwise
    intra = (q @ jnp.swapaxes(k, -1, -2)) * pairwise
    decayed_k_beta = k_beta * jnp.exp(cum)[..., None]
    inverse = unit_lower_inverse(ut)
    new_values, k_cumdecay = inverse @ v_beta, inverse @ decayed_k_beta
    q = q * jnp.exp(cum)[..., None]
    k = k * jnp.exp(cum[..., -1:] - cum)[..., None]
    chunk_decay = jnp.exp(cum[..., -1])[..., None, None]

    def step(s, x):
        nv, kc, q_i, k_i, intra_i, decay_i = x
        v_new = nv - kc @ s
        out = q_i @ s + intra_i @ v_new
        return s * decay_i + jnp.swapaxes(k_i, -1, -2) @ v_new, out

    xs = [jnp.moveaxis(a, 2, 0) for a in (new_values, k_cumdecay, q, k, intra, chunk_decay)]
    state, out = jax.lax.scan(step, state.astype(_F32), xs)  # out [n, B, H, C, Dv]
    out = jnp.moveaxis(out, 0, 2).reshape(b, h, n * chunk, -1)[:, :, :t]
    return jnp.moveaxis(out, 1, 2), state


class GatedDeltaNet(nnx.Module):
    """``linear_attn`` of one layer (module docstring)."""

    def __init__(self, config: Qwen3NextConfig, *, rngs, param_dtype, precision):
        c = config
        hk, hv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, \
            c.linear_value_head_dim
        lin = functools.partial(Linear, rngs=rngs, param_dtype=param_dtype, precision=precision)
        self.config = c
        self.in_proj_qkvz = lin(c.hidden_size, 2 * hk * dk + 2 * hv * dv)
        self.in_proj_ba = lin(c.hidden_size, 2 * hv)
        self.conv1d = nnx.Dict(weight=param((self.conv_dim, 1, c.linear_conv_kernel_dim), rngs, param_dtype,
                                            std=c.linear_conv_kernel_dim ** -0.5))
        self.dt_bias = param((hv,), rngs, param_dtype, fill=1.0)
        self.A_log = param((hv,), rngs, param_dtype, fill=0.0)
        self.norm = GatedRMSNorm(dv, c.rms_norm_eps, param_dtype=param_dtype)
        self.out_proj = lin(hv * dv, c.hidden_size)

    @property
    def conv_dim(self) -> int:
        c = self.config
        return 2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim

    def __call__(self, x, real, conv_state, state):
        """``x [B, W, hidden]`` of which ``real [B, W]`` are tokens (a
        prefix of each row), from states ``conv_state [B, conv_dim, K-1]``
        and ``state [B, Hv, Dk, Dv]``. Returns ``(y, conv_state, state)``:
        a one-token step runs the recurrent form, longer ones the chunked."""
        mixed, z, beta_in, a = self.project(x)
        out, conv_state, state = self.mix(mixed, beta_in, a, real, conv_state, state)
        return self.output(out, z), conv_state, state

    # The layer in three parts: ``project`` and ``output`` are per token (any
    # leading shape: a packed step runs them over its flat stream), ``mix``
    # (the causal conv and the delta rule) needs rows of one request each.

    def project(self, x):
        """Per token of ``x [..., hidden]``: ``(mixed [..., conv_dim], z [...,
        Hv, Dv], b [..., Hv], a [..., Hv])`` (the conv's input, the output
        gate, the pre-activations of ``beta`` and ``g``)."""
        c = self.config
        lead = x.shape[:-1]
        hk, hv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, \
            c.linear_value_head_dim
        r = hv // hk
        qkvz = self.in_proj_qkvz(x).reshape(*lead, hk, 2 * dk + 2 * r * dv)
        q, k = qkvz[..., :dk], qkvz[..., dk:2 * dk]
        v = qkvz[..., 2 * dk:2 * dk + r * dv].reshape(*lead, hv, dv)
        z = qkvz[..., 2 * dk + r * dv:].reshape(*lead, hv, dv)
        ba = self.in_proj_ba(x).reshape(*lead, hk, 2 * r)
        beta_in, a = ba[..., :r].reshape(*lead, hv), ba[..., r:].reshape(*lead, hv)
        mixed = jnp.concatenate([q.reshape(*lead, -1), k.reshape(*lead, -1), v.reshape(*lead, -1)], axis=-1)
        return mixed, z, beta_in, a

    def mix(self, mixed, beta_in, a, real, conv_state, state, recurrent: bool | None = None):
        """The sequence mixing of rows ``[B, W]`` (one request each; ``real``
        a prefix of each row) from :meth:`project`'s ``mixed``, ``b`` and
        ``a``: causal conv from ``conv_state``, then the gated delta rule
        from ``state`` (``recurrent``: the recurrent form, token by token,
        else the chunked; None: recurrent for width 1).
        Returns ``(out [B, W, Hv, Dv] float32, conv_state, state)``."""
        c = self.config
        b, w, _ = mixed.shape
        hk, hv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, \
            c.linear_value_head_dim
        r = hv // hk
        # Causal depthwise conv over [state ; this step's inputs].
        kernel = c.linear_conv_kernel_dim
        history = jnp.concatenate([jnp.swapaxes(conv_state, 1, 2).astype(mixed.dtype), mixed], axis=1)
        weight = self.conv1d["weight"][...][:, 0, :].astype(_F32)  # [C, K]
        windows = jnp.stack([history[:, j:j + w] for j in range(kernel)], axis=-1).astype(_F32)  # [B, W, C, K]
        conv_out = jax.nn.silu(jnp.sum(windows * weight, axis=-1)).astype(mixed.dtype)
        count = jnp.sum(real, axis=1)  # tokens per row: the new state is the last K-1 inputs
        keep = count[:, None] + jnp.arange(kernel - 1)[None, :]
        new_conv = jnp.swapaxes(jnp.take_along_axis(history, keep[..., None], axis=1), 1, 2)
        q = conv_out[..., :hk * dk].reshape(b, w, hk, dk).astype(_F32)
        k = conv_out[..., hk * dk:2 * hk * dk].reshape(b, w, hk, dk).astype(_F32)
        v = conv_out[..., 2 * hk * dk:].reshape(b, w, hv, dv).astype(_F32)
        l2 = lambda t: t * jax.lax.rsqrt(jnp.sum(t * t, axis=-1, keepdims=True) + 1e-6)  # noqa: E731
        q = jnp.repeat(l2(q), r, axis=2) * dk ** -0.5
        k = jnp.repeat(l2(k), r, axis=2)
        beta = jax.nn.sigmoid(beta_in.astype(_F32))
        g = -jnp.exp(self.A_log[...].astype(_F32)) * jax.nn.softplus(a.astype(_F32) + self.dt_bias[...].astype(_F32))
        mask = real[..., None]
        k, beta, g = jnp.where(mask[..., None], k, 0.0), jnp.where(mask, beta, 0.0), jnp.where(mask, g, 0.0)
        form = recurrent_gated_delta_rule if (w == 1 if recurrent is None else recurrent) else chunk_gated_delta_rule
        out, state = form(q, k, v, g, beta, state)
        return out, new_conv.astype(conv_state.dtype), state

    def output(self, out, z):
        """Per token: the gated RMSNorm of ``out [..., Hv, Dv]`` by ``z``, then ``out_proj``."""
        out = self.norm(out.astype(z.dtype), z)
        return self.out_proj(out.reshape(*out.shape[:-2], -1))

    def zero_states(self, batch: int, dtype):
        c = self.config
        return (jnp.zeros((batch, self.conv_dim, c.linear_conv_kernel_dim - 1), dtype),
                jnp.zeros((batch, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim), _F32))


class GatedAttention(nnx.Module):
    """``self_attn`` of one full-attention layer (module docstring)."""

    def __init__(self, config: Qwen3NextConfig, *, rngs, param_dtype, precision):
        c = config
        lin = functools.partial(Linear, rngs=rngs, param_dtype=param_dtype, precision=precision, bias=c.attention_bias)
        self.config = c
        self.q_proj = lin(c.hidden_size, c.num_attention_heads * c.head_dim * 2)
        self.k_proj = lin(c.hidden_size, c.num_key_value_heads * c.head_dim)
        self.v_proj = lin(c.hidden_size, c.num_key_value_heads * c.head_dim)
        self.o_proj = lin(c.num_attention_heads * c.head_dim, c.hidden_size)
        self.q_norm = ZeroCenteredRMSNorm(c.head_dim, c.rms_norm_eps, param_dtype=param_dtype)
        self.k_norm = ZeroCenteredRMSNorm(c.head_dim, c.rms_norm_eps, param_dtype=param_dtype)
        #: Set on a mesh (:func:`jaxkv.nn.sharding.place_heads`): the kernels run on each device's heads.
        self.heads_placement = None

    def project(self, x, positions):
        """``(q [B,W,H,D], k, v [B,W,KVH,D], gate [B,W,H*D])`` for ``x [B, W, hidden]``."""
        c = self.config
        b, w, _ = x.shape
        qg = self.q_proj(x).reshape(b, w, c.num_attention_heads, 2 * c.head_dim)
        q, gate = qg[..., :c.head_dim], qg[..., c.head_dim:].reshape(b, w, -1)
        k = self.k_proj(x).reshape(b, w, c.num_key_value_heads, c.head_dim)
        v = self.v_proj(x).reshape(b, w, c.num_key_value_heads, c.head_dim)
        inv_freq = rope_inv_freq(c.rotary_dim, c.rope_theta)
        rot = c.rotary_dim

        def rope(t):
            return jnp.concatenate([apply_rope(t[..., :rot], positions, inv_freq), t[..., rot:]], axis=-1)

        return rope(self.q_norm(q)), rope(self.k_norm(k)), v, gate

    def output(self, attended, gate):
        """``o_proj(attended * sigmoid(gate))``; ``attended [B, W, H, D]``."""
        flat = attended.reshape(*attended.shape[:2], -1)
        return self.o_proj(flat * jax.nn.sigmoid(gate.astype(_F32)).astype(flat.dtype))

    def through_cache(self, h, positions, handle):
        """``h [B, W, hidden]`` at ``positions [B, W]`` (-1: padding) through
        the paged cache: K/V written, each token attending its request's
        positions up to its own. Returns ``(y [B, W, hidden], handle)``."""
        c = self.config
        b, w = h.shape[:2]
        q, k, v, gate = self.project(h, jnp.maximum(positions, 0))
        handle = handle.write_kv(*place_kv(self.heads_placement, k.reshape(b * w, c.num_key_value_heads, c.head_dim),
                                           v.reshape(b * w, c.num_key_value_heads, c.head_dim)))
        attended = handle.attend(q.reshape(b * w, c.num_attention_heads, c.head_dim), sm_scale=c.head_dim ** -0.5,
                                 heads=self.heads_placement)
        return self.output(attended.reshape(b, w, c.num_attention_heads, c.head_dim).astype(h.dtype), gate), handle


class SparseMoeBlock(nnx.Module):
    def __init__(self, config: Qwen3NextConfig, *, rngs, param_dtype, precision):
        c = config
        self.config = c
        self.gate = nnx.Dict(weight=param((c.num_experts, c.hidden_size), rngs, param_dtype, std=0.02))
        self.experts = Experts(c.num_experts, c.hidden_size, c.moe_intermediate_size, rngs=rngs,
                               param_dtype=param_dtype, precision=precision)
        self.shared_expert = SwiGLU(c.hidden_size, c.shared_expert_intermediate_size, rngs=rngs,
                                    param_dtype=param_dtype, precision=precision)
        self.shared_expert_gate = Linear(c.hidden_size, 1, rngs=rngs, param_dtype=param_dtype, precision=precision)

    def __call__(self, x):
        c = self.config
        flat = x.reshape(-1, x.shape[-1])
        logits = flat @ self.gate["weight"][...].astype(flat.dtype).T
        probs = jax.nn.softmax(logits.astype(_F32), axis=-1)
        weights, experts = jax.lax.top_k(probs, c.num_experts_per_tok)
        if c.norm_topk_prob:
            weights = weights / weights.sum(axis=-1, keepdims=True)
        routed = self.experts(flat, experts.astype(jnp.int32), weights.astype(flat.dtype))
        shared = jax.nn.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return (routed + shared).reshape(x.shape)


class Qwen3NextDecoderLayer(nnx.Module):
    def __init__(self, config: Qwen3NextConfig, layer: int, *, rngs, param_dtype, precision):
        c = config
        self.kind = c.layer_types[layer]
        if self.kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(c, rngs=rngs, param_dtype=param_dtype, precision=precision)
        else:
            self.self_attn = GatedAttention(c, rngs=rngs, param_dtype=param_dtype, precision=precision)
        self.mlp = (SparseMoeBlock(c, rngs=rngs, param_dtype=param_dtype, precision=precision) if c.is_moe_layer(layer)
                    else SwiGLU(c.hidden_size, c.intermediate_size, rngs=rngs, param_dtype=param_dtype,
                                precision=precision))
        self.input_layernorm = ZeroCenteredRMSNorm(c.hidden_size, c.rms_norm_eps, param_dtype=param_dtype)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(c.hidden_size, c.rms_norm_eps, param_dtype=param_dtype)

    def finish(self, x, mixed):
        """Residual add of the token mixer's output, then the MLP block."""
        x = x + mixed
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3NextForCausalLM(nnx.Module):
    """Qwen3-Next over a :class:`~jaxkv.KVCacheManager` (see the module
    docstring): full-attention K/V in its paged ``full`` group, Gated
    DeltaNet states in its ``GDNPool``. ``implementation`` chooses the
    paged attention kernel by :mod:`kernels_pallas`'s rule.

    ``scan_layers`` (default: stacked unless built on a
    GPU, :func:`jaxkv.nn.scan.default_scan_layers`): layers of the same kind and MLP run
    under one ``lax.scan`` (module docstring), so compile time does not
    grow with depth; False unrolls them. Weights, checkpoints and tokens
    are the same either way (layers are built in order from the same
    ``rngs``). ``model.layers[i]`` reads layer ``i``; write through
    ``model.layers.parts()``."""

    #: The cache contract (:func:`jaxkv.nn.packed.cache_kind`): a hybrid ``KVCacheManager`` (``make_cache``).
    cache_kind = "hybrid"

    def __init__(self, config: Qwen3NextConfig, *, rngs: nnx.Rngs, dtype=_F32, param_dtype=_F32, precision=None,
                 implementation: str | None = None, scan_layers: bool | None = None):
        check_implementation(implementation, False)
        c = config
        self.config = c
        self.dtype = jnp.dtype(dtype)
        self.param_dtype = jnp.dtype(param_dtype)
        self.implementation = implementation
        self.embed_tokens = nnx.Dict(weight=param((c.vocab_size, c.hidden_size), rngs, param_dtype, std=1.0))
        # A layer's structure follows its kind and its MLP (MoE or dense): alike layers stack.
        self.layers = DecoderStack(
            c.num_hidden_layers,
            lambda i, rngs: Qwen3NextDecoderLayer(c, i, rngs=rngs, param_dtype=param_dtype, precision=precision),
            signature=lambda i: (c.layer_types[i], c.is_moe_layer(i)), rngs=rngs, scan=scan_layers)
        self.norm = ZeroCenteredRMSNorm(c.hidden_size, c.rms_norm_eps, param_dtype=param_dtype)
        if not c.tie_word_embeddings:
            self.lm_head = Linear(c.hidden_size, c.vocab_size, rngs=rngs, param_dtype=param_dtype, precision=precision)

    # ---------------------------------------------------------------- cache

    def make_cache(self, max_requests: int, max_context_tokens: int, *, entry_format: str = "lossless",
                   num_blocks: dict[str, int] | None = None, kv_bytes: int | None = None,
                   page_size: int = 16, max_track_slots: int = 0, num_snapshots: int = 0,
                   capture_every: int = 0) -> KVCacheManager:
        """A :class:`~jaxkv.KVCacheManager` for this model: full-attention K/V
        in pages of ``page_size`` (``entry_format`` ``"lossless"``: the
        compute dtype; ``"fp8"``: float8_e4m3fn with per-token scales), GDN
        states per request slot (conv state in the compute dtype, recurrent
        state float32), ``max_track_slots`` snapshot slots; ``num_snapshots``
        and ``capture_every`` as in ``KVCacheManager.create``."""
        return cache_for(self.config, max_requests, max_context_tokens, dtype=self.dtype, entry_format=entry_format,
                         num_blocks=num_blocks, kv_bytes=kv_bytes, page_size=page_size,
                         max_track_slots=max_track_slots, num_snapshots=num_snapshots, capture_every=capture_every)

    def _check_cache(self, manager: KVCacheManager) -> None:
        c = self.config
        want = tuple(AttentionKind.FULL if t == "full_attention" else AttentionKind.LINEAR for t in c.layer_types)
        got = tuple(s.kind for s in manager.schemas)
        hc = manager.config
        dims = (hc.num_kv_heads, hc.kv_head_dim, hc.linear_num_k_heads, hc.linear_num_v_heads, hc.linear_head_k_dim,
                hc.linear_head_v_dim, hc.linear_conv_kernel)
        want_dims = (c.num_key_value_heads, c.head_dim, c.linear_num_key_heads, c.linear_num_value_heads,
                     c.linear_key_head_dim, c.linear_value_head_dim, c.linear_conv_kernel_dim)
        if got != want or dims != want_dims:
            raise InvalidArgument(f"the cache's schedule {[k.value for k in got]} / dims {dims} are not this model's "
                                  f"({[k.value for k in want]} / {want_dims}); build it with model.make_cache")

    # ------------------------------------------------------------- forward

    def _embed(self, tokens):
        return self.embed_tokens["weight"][...][jnp.asarray(tokens, jnp.int32)].astype(self.dtype)

    def _logits(self, x):
        x = self.norm(x)
        if self.config.tie_word_embeddings:
            return jnp.einsum("...d,vd->...v", x, self.embed_tokens["weight"][...].astype(x.dtype)).astype(_F32)
        return self.lm_head(x).astype(_F32)

    def __call__(self, tokens: Int[Array, "B W"], manager: KVCacheManager, slots: Int[Array, " B"],
                 starts: Int[Array, " B"], num_new: Int[Array, " B"]) -> tuple[Float[Array, "B W V"], KVCacheManager]:
        """One step through the cache: row ``b`` (request slot ``slots[b]``,
        -1 = idle) brings ``tokens[b, :num_new[b]]`` at positions
        ``starts[b] + t``, which ``manager.reserve`` must have reserved.
        Returns ``(logits [B, W, vocab] float32, manager)``."""
        tokens = jnp.asarray(tokens, jnp.int32)
        b, w = tokens.shape
        lane = jnp.arange(w, dtype=jnp.int32)[None, :]
        positions = jnp.where(lane < num_new[:, None], starts[:, None] + lane, -1)
        request_ids = jnp.repeat(jnp.arange(b, dtype=jnp.int32), w)

        def linear(module, h, handle):  # the rows are the requests
            real = (handle.positions >= 0).reshape(b, w)  # reserved tokens of held slots
            rows = jnp.where(jnp.any(real, axis=1), handle.request_slots, -1)
            mixed, conv, state = module(h, real, *_gdn_states(handle, rows))
            return mixed, _set_gdn_states(handle, rows, conv, state)

        x, manager = self._through_cache(self._embed(tokens), manager, slots, positions, request_ids, linear)
        return self._logits(x), manager

    def forward_packed(self, batch: PackedBatch, manager: KVCacheManager, verify=None,
                       width: int = 1) -> tuple[Float[Array, "S V"], KVCacheManager]:
        """One packed step (:class:`~jaxkv.nn.packed.PackedBatch`) through the
        cache, lane ``s`` as request slot ``seq_ids[s]`` at its positions,
        which ``manager.reserve(batch.seq_ids, batch.q_lens, ...)`` must have
        reserved. Projections, norms, MoE and full attention run over the
        flat stream of ``T`` tokens (no padding per lane); a Gated DeltaNet
        layer's conv and delta rule run on :meth:`PackedBatch.segments`:
        the prefill lanes as ``[num_prefill_lanes, max_prefill_len]`` rows
        (the chunked form), the decode lanes as one-token rows (the
        recurrent form), each from its request's states, scattered back into
        the stream. Returns ``(logits [S, vocab] float32, manager)``: each
        lane's last token's (the LM head runs on those ``S`` tokens only;
        finite garbage for a lane with none); with ``verify`` (bool ``[S]``,
        speculative verify lanes: decode lanes of up to ``width`` tokens,
        which the GDN layers then run as ``[lanes, width]`` rows in the
        recurrent form) ``logits [S, width, vocab]``
        (:func:`~jaxkv.nn.packed.lane_logits`)."""
        num_tokens = batch.num_tokens
        decode_width = 1 if verify is None else width

        def linear(module, h, handle):  # the rows are the lanes' segments
            mixed, z, beta_in, a = module.project(h[0])
            real = handle.positions >= 0  # reserved tokens of held slots
            segments = []
            for lanes in ("prefill", "decode"):
                first, index, valid = batch.segments(lanes, decode_width)
                if index.shape[0]:
                    segments.append((lanes, first, index, valid & real[index]))  # lanes: the class
            rows = jnp.where(jnp.concatenate([jnp.any(r, axis=1) for *_, r in segments]), handle.request_slots, -1)
            conv, state = _gdn_states(handle, rows)
            out = jnp.zeros((num_tokens,) + z.shape[1:], _F32)
            convs, states = [], []
            for kind, first, index, seg_real in segments:
                lanes = slice(first, first + index.shape[0])
                # Decode lanes (one token, or a verify lane's k + 1) token by token: the chunked form would pad
                # them to its chunk.
                o, c, s = module.mix(mixed[index], beta_in[index], a[index], seg_real, conv[lanes], state[lanes],
                                     recurrent=True if kind == "decode" else None)
                out = out.at[jnp.where(seg_real, index, num_tokens)].set(o, mode="drop")
                convs.append(c)
                states.append(s)
            handle = _set_gdn_states(handle, rows, jnp.concatenate(convs), jnp.concatenate(states))
            return module.output(out, z)[None], handle

        x, manager = self._through_cache(self._embed(batch.token_ids)[None], manager, batch.seq_ids,
                                         batch.positions[None], batch.token_lanes, linear)
        return lane_logits(self._logits, x[0], batch, verify, width), manager

    def _through_cache(self, x, manager: KVCacheManager, slots, positions, request_ids, linear):
        """Every layer from the embeddings ``x [B, W, hidden]`` at
        ``positions [B, W]`` (-1: padding; token ``t`` of the flattened rows
        belongs to request row ``request_ids[t]`` of ``slots``). Full
        attention runs through the paged cache here; ``linear(module, h,
        handle) -> (y, handle)`` runs a Gated DeltaNet layer in the
        caller's row layout. Returns ``(x before the final norm, manager)``."""
        self._check_cache(manager)
        flat_positions = positions.reshape(-1)

        def step(layer, i, like, carry):
            # ``i`` is traced under the scan: the handle takes its schema from
            # ``like`` (a static layer of the same column, so of the same kind),
            # and ``layer.kind`` is the module's static attribute, never ``i``'s.
            x, manager = carry
            handle = manager.acquire(i, slots, flat_positions, request_ids, implementation=self.implementation,
                                     like=like)
            h = layer.input_layernorm(x)
            if layer.kind == "linear_attention":
                mixed, handle = linear(layer.linear_attn, h, handle)
            else:
                mixed, handle = layer.self_attn.through_cache(h, positions, handle)
            return layer.finish(x, mixed), manager.update(handle)

        return self.layers.run(step, (x, manager), with_like=True)

    def forward_dense(self, tokens: Int[Array, " T"]) -> Float[Array, "T V"]:
        """One sequence from scratch with no cache: the GDN layers in the
        chunked form from zero states, full attention dense and causal."""
        c = self.config
        tokens = jnp.asarray(tokens, jnp.int32).reshape(1, -1)
        t = tokens.shape[1]
        positions = jnp.arange(t, dtype=jnp.int32)[None, :]
        x = self._embed(tokens)

        def step(layer, i, x):
            h = layer.input_layernorm(x)
            if layer.kind == "linear_attention":
                conv, state = layer.linear_attn.zero_states(1, self.dtype)
                mixed, _, _ = layer.linear_attn(h, jnp.ones((1, t), bool), conv, state)
            else:
                attn = layer.self_attn
                q, k, v, gate = attn.project(h, positions)
                g = c.num_attention_heads // c.num_key_value_heads
                k, v = jnp.repeat(k, g, axis=2).astype(_F32), jnp.repeat(v, g, axis=2).astype(_F32)
                logits = jnp.einsum("bthd,bshd->bhts", q.astype(_F32), k) * c.head_dim ** -0.5
                causal = jnp.tril(jnp.ones((t, t), bool))
                probs = jax.nn.softmax(jnp.where(causal, logits, -jnp.inf), axis=-1)
                attended = jnp.einsum("bhts,bshd->bthd", probs, v).astype(h.dtype)
                mixed = attn.output(attended, gate)
            return layer.finish(x, mixed)

        return self._logits(self.layers.run(step, x))[0]

    # ---------------------------------------------------- HF checkpoints

    @classmethod
    def from_hf_state_dict(cls, config: Qwen3NextConfig, tensors: dict[str, np.ndarray], *, dtype=None,
                           param_dtype=None, precision=None, implementation: str | None = None,
                           source: str = "state dict", scan_layers: bool | None = None) -> Qwen3NextForCausalLM:
        """Build the model from transformers-named arrays (per-expert tensors
        fused as transformers' loader does). Raises ``InvalidArgument``
        naming a missing, misshapen or unexpected tensor."""
        param_dtype = jnp.dtype(param_dtype or jnp.float32)
        dtype = jnp.dtype(dtype or param_dtype)
        abstract = nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=param_dtype,
                                              precision=precision, implementation=implementation,
                                              scan_layers=scan_layers))
        tensors = fuse_experts(tensors, config.num_experts, source=source) if config.num_experts else tensors
        tied = config.tie_word_embeddings
        return load_state(abstract, tensors, lambda p: p if p.startswith("lm_head.") else "model." + p,
                          family="qwen3_next", source=source,
                          ignored=lambda n: n.endswith("inv_freq") or (tied and n == "lm_head.weight")
                          or n.startswith("mtp."))

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, *, dtype=None, param_dtype=None, precision=None,
                        implementation: str | None = None, scan_layers: bool | None = None) -> Qwen3NextForCausalLM:
        """Load a local transformers checkpoint directory (sharded or not)."""
        raw, tensors = read_checkpoint(path)
        return cls.from_hf_state_dict(Qwen3NextConfig.from_hf(raw), tensors, dtype=dtype, param_dtype=param_dtype,
                                      precision=precision, implementation=implementation, source=os.fspath(path),
                                      scan_layers=scan_layers)

    def save_pretrained(self, path: str | os.PathLike) -> None:
        """``config.json`` + ``model.safetensors`` under transformers' names (fused experts)."""
        save_checkpoint(path, {**self.config.to_hf(), "torch_dtype": self.param_dtype.name},
                        named_state(self, lambda p: p if p.startswith("lm_head.") else "model." + p))


def _gdn_states(handle, rows):
    """``(conv_state, state [B, Hv, Dk, Dv])`` of request slots ``rows``
    (-1: zeros) in the handle's Gated DeltaNet layer (the pool keeps the
    recurrent state transposed, ``[Dv, Dk]``)."""
    recurrent, conv = handle.gdn.get_states(handle.gdn_layer, rows)
    return conv, jnp.swapaxes(recurrent, -1, -2)


def _set_gdn_states(handle, rows, conv, state):
    """The handle with ``rows``' states replaced (-1: skipped)."""
    return handle.replace(gdn=handle.gdn.set_layer_state(handle.gdn_layer, rows, jnp.swapaxes(state, -1, -2), conv))


def cache_for(config: Qwen3NextConfig, max_requests: int, max_context_tokens: int, *, dtype=_F32,
              entry_format: str = "lossless", num_blocks: dict[str, int] | None = None, kv_bytes: int | None = None,
              page_size: int = 16, max_track_slots: int = 0, num_snapshots: int = 0,
              capture_every: int = 0) -> KVCacheManager:
    """The cache of :meth:`Qwen3NextForCausalLM.make_cache` from the config
    alone (no weights: sizing a real model costs nothing)."""
    if entry_format not in ("lossless", "fp8"):
        raise InvalidArgument(f"entry format {entry_format!r} is not one of ('lossless', 'fp8')")
    c = config
    kinds = {"full_attention": AttentionKind.FULL, "linear_attention": AttentionKind.LINEAR}
    schedule = [LayerSpec(i, kinds[t]) for i, t in enumerate(c.layer_types)]
    hybrid = HybridConfig(num_kv_heads=c.num_key_value_heads, kv_head_dim=c.head_dim, page_size=page_size,
                          kv_dtype=dtype if entry_format == "lossless" else jnp.float8_e4m3fn,
                          linear_num_k_heads=c.linear_num_key_heads, linear_num_v_heads=c.linear_num_value_heads,
                          linear_head_k_dim=c.linear_key_head_dim, linear_head_v_dim=c.linear_value_head_dim,
                          linear_conv_kernel=c.linear_conv_kernel_dim, linear_dtype=dtype,
                          num_query_heads=c.num_attention_heads)
    return KVCacheManager.create(hybrid, schedule, max_requests, max_context_tokens=max_context_tokens,
                                 num_blocks=num_blocks, kv_bytes=kv_bytes, max_track_slots=max_track_slots,
                                 num_snapshots=num_snapshots, capture_every=capture_every)
