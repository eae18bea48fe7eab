"""DeepSeek-V3 causal LM (Flax NNX): multi-head latent attention over ``KVPool``'s MLA mode.

The architecture as transformers (5.x) defines it, with its parameter names
and layouts (weights ``[out, in]``)::

    embed_tokens
    per layer:  input_layernorm -> self_attn (MLA) -> + residual
                post_attention_layernorm -> mlp (dense SwiGLU below
                first_k_dense_replace, else routed experts + shared) -> + residual
    norm -> lm_head

**MLA and the cache.** ``q`` comes from ``q_b_proj(q_a_layernorm(q_a_proj(x)))``
(or ``q_proj``), ``[nope | rope]`` per head. ``kv_a_proj_with_mqa`` gives a
latent ``c`` of ``kv_lora_rank`` (normalized by ``kv_a_layernorm``) and one
RoPE key shared by all heads. The pool stores, per token, ``[c | k_rope]``
(576 values at real sizes) in :class:`~jaxkv.KVPool`'s MLA mode. ``kv_b_proj``
expands ``c`` into each head's ``k_nope`` and ``v``; attention never expands
it: the query is *absorbed* into the latent space (``q_lat_h = W_k,h^T
q_nope,h``) so ``q . k = [q_lat | q_rope] . [c | k_rope]``, attention runs
over the stored rows with the latent as the value, and each head's output
is ``W_v,h`` times its attended latent. Decode runs it through
:func:`kernels_pallas.paged_attention`'s MLA path (``mla_value_dim =
kv_lora_rank``), prefill through :func:`~jaxkv.nn.paged_prefill_attention`
(values = the latent part of the same pages). :meth:`DeepseekV3ForCausalLM.forward_dense`
is the expanded form without a cache, the check. RoPE: interleaved pairs
(``rope_interleave``, DeepSeek's layout; rotated into halves as
transformers does) or halves; YaRN with DeepSeek's softmax ``mscale``.

**Routing.** Sigmoid scores; for the choice only, plus
``e_score_correction_bias``; the ``topk_group`` of ``n_group`` groups with
the largest sum of their two best scores are eligible; the top
``num_experts_per_tok`` eligible experts are taken, weighted by their
(uncorrected) scores, normalized (``norm_topk_prob``) and scaled by
``routed_scaling_factor``.

Since every layer is MLA, the model runs on the paged path of the Llama
family (:class:`~jaxkv.BlockSpaceManager` block tables over the MLA pool):
``generate``, ``sample_n`` and ``beam_search`` take it as they take Llama.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from jaxkv._ops import is_fp8, on_local_heads, place_kv
from jaxkv.errors import InvalidArgument
from jaxkv.nn.attention import check_implementation, check_mode, paged_prefill_attention
from jaxkv.nn.deepseek_v3_config import DeepseekV3Config
from jaxkv.nn.layers import (Experts, Linear, RMSNorm, SwiGLU, fuse_experts, load_state, named_state, param,
                             read_checkpoint, save_checkpoint)
from jaxkv.nn.llama import LlamaDecoderLayer
from jaxkv.nn.packed import PackedBatch, packed_logits
from jaxkv.nn.scan import DecoderStack
from jaxkv.pool.kv_pool import KVPool, dequantize, quantize_fp8
from kernels_pallas import paged_attention
from kernels_pallas.ragged_attention import ragged_paged_attention

__all__ = ["DeepseekV3ForCausalLM"]

_F32 = jnp.float32
_LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: transformers builds them with the default eps


@functools.lru_cache(maxsize=32)
def _rope_table(config: DeepseekV3Config):
    return config.rope.inv_freq(config.qk_rope_head_dim, config.max_position_embeddings)


def _rope(config: DeepseekV3Config, x, positions):
    """RoPE on ``x [B, T, ..., R]`` at ``positions [B, T]``. Interleaved
    pairs come out as halves (rotated evens, then rotated odds), as
    transformers' ``apply_rotary_pos_emb_interleave`` returns them; q and k
    get the same layout, so their products are the interleaved rotation's."""
    inv_freq, scaling = _rope_table(config)
    angles = jnp.maximum(positions, 0).astype(_F32)[..., None] * jnp.asarray(inv_freq)  # [B, T, R/2]
    shape = angles.shape[:2] + (1,) * (x.ndim - 3) + angles.shape[2:]
    cos = (jnp.cos(angles) * scaling).astype(x.dtype).astype(_F32).reshape(shape)
    sin = (jnp.sin(angles) * scaling).astype(x.dtype).astype(_F32).reshape(shape)
    xf = x.astype(_F32)
    if config.rope_interleave:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
    else:
        x1, x2 = jnp.split(xf, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class DeepseekV3Attention(nnx.Module):
    """Multi-head latent attention of one layer over the MLA pool (module docstring)."""

    def __init__(self, config: DeepseekV3Config, *, rngs, param_dtype, precision, implementation, interpret):
        c = config
        lin = functools.partial(Linear, rngs=rngs, param_dtype=param_dtype, precision=precision)
        heads = c.num_attention_heads
        if c.q_lora_rank is None:
            self.q_proj = lin(c.hidden_size, heads * c.qk_head_dim)
        else:
            self.q_a_proj = lin(c.hidden_size, c.q_lora_rank, bias=c.attention_bias)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, _LATENT_NORM_EPS, param_dtype=param_dtype)
            self.q_b_proj = lin(c.q_lora_rank, heads * c.qk_head_dim)
        self.kv_a_proj_with_mqa = lin(c.hidden_size, c.kv_lora_rank + c.qk_rope_head_dim, bias=c.attention_bias)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, _LATENT_NORM_EPS, param_dtype=param_dtype)
        self.kv_b_proj = lin(c.kv_lora_rank, heads * (c.qk_nope_head_dim + c.v_head_dim))
        self.o_proj = lin(heads * c.v_head_dim, c.hidden_size, bias=c.attention_bias)
        self.config = c
        self.implementation = implementation
        self.interpret = interpret
        #: Set on a mesh (:func:`jaxkv.nn.sharding.place_heads`): the kernels run on each device's heads.
        self.heads_placement = None

    def _project(self, x, positions):
        """``(q_nope [B,T,H,n], q_rope [B,T,H,r], latent [B,T,R], k_rope [B,T,r])``."""
        c = self.config
        q = self.q_proj(x) if c.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.reshape(*x.shape[:2], c.num_attention_heads, c.qk_head_dim)
        q_nope, q_rope = q[..., :c.qk_nope_head_dim], q[..., c.qk_nope_head_dim:]
        compressed = self.kv_a_proj_with_mqa(x)
        latent = self.kv_a_layernorm(compressed[..., :c.kv_lora_rank])
        k_rope = compressed[..., c.kv_lora_rank:]
        return q_nope, _rope(c, q_rope, positions), latent, _rope(c, k_rope, positions)

    def _kv_b(self):
        """``kv_b_proj`` per head: ``(W_k [H, nope, R], W_v [H, v, R])``."""
        c = self.config
        w = self.kv_b_proj.weight[...].reshape(c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim, -1)
        return w[:, :c.qk_nope_head_dim], w[:, c.qk_nope_head_dim:]

    def _out(self, attended):
        """``o_proj`` of each head's ``W_v`` times its attended latent (``[B, T, H, R]``)."""
        _, w_v = self._kv_b()
        heads = jnp.einsum("bthr,hvr->bthv", attended, w_v.astype(attended.dtype),
                           precision=self.o_proj.precision)
        return self.o_proj(heads.reshape(*heads.shape[:2], -1))

    def __call__(self, x, positions, pool: KVPool, layer: int, slots, block_tables, starts, num_new, *,
                 mode: str = "prefill", batch=None):
        """Write this step's ``[latent | k_rope]`` rows and attend through the
        tables (the call of :class:`~jaxkv.nn.PagedAttention`). Returns
        ``(out [B, T, hidden], pool)``."""
        c = self.config
        b, t, _ = x.shape
        check_mode(mode, b, t, batch)
        if mode == "ragged":
            real = positions >= 0
            positions = jnp.maximum(positions, 0)
        else:
            real = jnp.arange(t, dtype=jnp.int32)[None, :] < num_new[:, None]
        q_nope, q_rope, latent, k_rope = self._project(x, positions)
        w_k, _ = self._kv_b()
        q_latent = jnp.einsum("bthn,hnr->bthr", q_nope, w_k.astype(q_nope.dtype), precision=self.o_proj.precision)
        query = jnp.concatenate([q_latent, q_rope.astype(q_latent.dtype)], axis=-1)
        rows = jnp.concatenate([latent, k_rope.astype(latent.dtype)], axis=-1).reshape(b * t, 1, -1)
        (rows,) = place_kv(self.heads_placement, rows)
        pool = pool.set_kv(layer, jnp.where(real, slots, -1).reshape(-1), rows)
        pages = (pool.k_pages, None, pool.k_scales, None)  # the latent rows are keys and values
        if mode == "decode":
            lengths = jnp.where(num_new > 0, starts + 1, 0)

            def decode(q, k_pages, _v, k_scales, _vs, _sinks, tables, lengths, layer):
                return paged_attention(q, k_pages, None, tables, lengths, k_scales, None, layer=layer,
                                       sm_scale=c.sm_scale, mla_value_dim=c.kv_lora_rank,
                                       implementation=self.implementation, interpret=self.interpret)

            attended = on_local_heads(self.heads_placement, decode, query[:, 0], pages,
                                      (block_tables, lengths, layer))[:, None]
        elif mode == "ragged":
            def ragged(q, k_pages, _v, k_scales, _vs, _sinks, tables, kv_lens, cu_q_lens, layer):
                return ragged_paged_attention(q, k_pages, None, tables, kv_lens, cu_q_lens, k_scales, None,
                                              layer=layer, sm_scale=c.sm_scale, mla_value_dim=c.kv_lora_rank,
                                              implementation=self.implementation, interpret=self.interpret)

            attended = on_local_heads(self.heads_placement, ragged, query[0], pages,
                                      (batch.block_tables, batch.kv_lens, batch.cu_q_lens, layer))[None]
        else:
            k_pages, _, k_scales, _ = pool.layer_arrays(layer)
            # The values are the latent part of the same rows (scales are per row: they apply to both).
            attended = paged_prefill_attention(query, k_pages, k_pages[..., :c.kv_lora_rank], block_tables, starts,
                                               num_new, k_scales, k_scales, sm_scale=c.sm_scale)
        return self._out(attended.astype(x.dtype)), pool

    def forward_dense(self, x, positions, *, kv_dtype=None):
        """The expanded form without a cache (transformers' arithmetic): every
        head's ``k = [W_k c | k_rope]``, ``v = W_v c``, causal softmax.
        ``kv_dtype`` rounds the stored rows through that pool dtype first."""
        c = self.config
        q_nope, q_rope, latent, k_rope = self._project(x, positions)
        if kv_dtype is not None:
            rows = jnp.concatenate([latent, k_rope.astype(latent.dtype)], axis=-1)
            rows = (dequantize(*quantize_fp8(rows, kv_dtype), rows.dtype) if is_fp8(kv_dtype)
                    else rows.astype(kv_dtype).astype(rows.dtype))
            latent, k_rope = rows[..., :c.kv_lora_rank], rows[..., c.kv_lora_rank:]
        w_k, w_v = self._kv_b()
        k_nope = jnp.einsum("bsr,hnr->bshn", latent, w_k.astype(latent.dtype))
        v = jnp.einsum("bsr,hvr->bshv", latent, w_v.astype(latent.dtype))
        q = jnp.concatenate([q_nope, q_rope], axis=-1).astype(_F32)
        k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope[:, :, None], k_nope.shape[:3] + k_rope.shape[-1:])],
                            axis=-1).astype(_F32)
        logits = jnp.einsum("bthd,bshd->bhts", q, k) * c.sm_scale
        allowed = positions[:, None, :] <= positions[:, :, None]  # [B, Tq, Tk]
        probs = jax.nn.softmax(jnp.where(allowed[:, None], logits, -jnp.inf), axis=-1)
        heads = jnp.einsum("bhts,bshv->bthv", probs, v.astype(_F32)).astype(x.dtype)
        return self.o_proj(heads.reshape(*heads.shape[:2], -1))


class Router(nnx.Module):
    """Sigmoid, group-limited top-k routing (module docstring)."""

    def __init__(self, config: DeepseekV3Config, *, rngs, param_dtype):
        self.config = config
        self.weight = param((config.n_routed_experts, config.hidden_size), rngs, param_dtype, std=0.02)
        self.e_score_correction_bias = param((config.n_routed_experts,), rngs, _F32, fill=0.0)

    def __call__(self, x):
        c = self.config
        scores = jax.nn.sigmoid(x.astype(_F32) @ self.weight[...].astype(_F32).T)  # [N, E]
        choice = scores + self.e_score_correction_bias[...].astype(_F32)
        groups = choice.reshape(-1, c.n_group, c.n_routed_experts // c.n_group)
        group_scores = jnp.sum(jax.lax.top_k(groups, 2)[0], axis=-1)  # [N, G]
        best = jax.lax.top_k(group_scores, c.topk_group)[1]
        eligible = jnp.zeros(group_scores.shape, bool).at[jnp.arange(best.shape[0])[:, None], best].set(True)
        choice = jnp.where(jnp.repeat(eligible, c.n_routed_experts // c.n_group, axis=1), choice, -jnp.inf)
        experts = jax.lax.top_k(choice, c.num_experts_per_tok)[1]
        weights = jnp.take_along_axis(scores, experts, axis=-1)
        if c.norm_topk_prob:
            weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
        return experts.astype(jnp.int32), weights * c.routed_scaling_factor


class MoE(nnx.Module):
    def __init__(self, config: DeepseekV3Config, *, rngs, param_dtype, precision):
        c = config
        self.gate = Router(c, rngs=rngs, param_dtype=param_dtype)
        self.experts = Experts(c.n_routed_experts, c.hidden_size, c.moe_intermediate_size, rngs=rngs,
                               param_dtype=param_dtype, precision=precision)
        self.shared_experts = SwiGLU(c.hidden_size, c.moe_intermediate_size * c.n_shared_experts, rngs=rngs,
                                     param_dtype=param_dtype, precision=precision)

    def __call__(self, x):
        flat = x.reshape(-1, x.shape[-1])
        experts, weights = self.gate(flat)
        return (self.experts(flat, experts, weights) + self.shared_experts(flat)).reshape(x.shape)


class DeepseekV3DecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm block (its ``__call__`` and ``forward_dense``) with
    MLA attention and, past ``first_k_dense_replace``, the MoE."""

    def __init__(self, config: DeepseekV3Config, layer: int, *, rngs, param_dtype, precision, implementation,
                 interpret):
        c = config
        self.self_attn = DeepseekV3Attention(c, rngs=rngs, param_dtype=param_dtype, precision=precision,
                                             implementation=implementation, interpret=interpret)
        self.mlp = (MoE(c, rngs=rngs, param_dtype=param_dtype, precision=precision) if c.is_moe_layer(layer)
                    else SwiGLU(c.hidden_size, c.intermediate_size, rngs=rngs, param_dtype=param_dtype,
                                precision=precision))
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, param_dtype=param_dtype)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, param_dtype=param_dtype)


class DeepseekV3ForCausalLM(nnx.Module):
    """DeepSeek-V3 over an MLA :class:`~jaxkv.KVPool` (see the module docstring).

    Same call as :class:`~jaxkv.nn.LlamaForCausalLM`: ``model(tokens,
    positions, pool, slots, block_tables, starts, num_new, mode=...)``, and
    ``make_pool`` builds its pool (``dtype`` float32/bf16 or an fp8 dtype,
    quantized per token). ``implementation`` / ``interpret`` choose the
    decode attention kernel by :mod:`kernels_pallas`'s rule.
    """

    #: The cache contract (:func:`jaxkv.nn.packed.cache_kind`): a paged ``KVPool`` (``make_pool``).
    cache_kind = "paged"

    def __init__(self, config: DeepseekV3Config, *, rngs: nnx.Rngs, dtype=_F32, param_dtype=_F32, precision=None,
                 implementation: str | None = None, interpret: bool = False, scan_layers: bool | None = None):
        check_implementation(implementation, interpret)
        c = config
        self.config = c
        #: The pool's layers this model runs over: its own depth, or a deeper target's for an early-exit
        #: draft that shares the target's pool (:func:`jaxkv.nn.speculative.early_exit_draft`).
        self.pool_layers = config.num_hidden_layers
        self.dtype = jnp.dtype(dtype)
        self.param_dtype = jnp.dtype(param_dtype)
        self.embed_tokens = nnx.Dict(weight=param((c.vocab_size, c.hidden_size), rngs, param_dtype, std=1.0))
        # The dense layers before first_k_dense_replace stay outside the scan of the MoE layers.
        self.layers = DecoderStack(
            c.num_hidden_layers,
            lambda i, rngs: DeepseekV3DecoderLayer(c, i, rngs=rngs, param_dtype=param_dtype, precision=precision,
                                                   implementation=implementation, interpret=bool(interpret)),
            signature=c.is_moe_layer, rngs=rngs, scan=scan_layers)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, param_dtype=param_dtype)
        if not c.tie_word_embeddings:
            self.lm_head = Linear(c.hidden_size, c.vocab_size, rngs=rngs, param_dtype=param_dtype,
                                  precision=precision)

    def _embed(self, tokens):
        return self.embed_tokens["weight"][...][jnp.asarray(tokens, jnp.int32)].astype(self.dtype)

    def logits_from_hidden(self, x) -> Float[Array, "B T V"]:
        x = self.norm(x)
        if self.config.tie_word_embeddings:
            return jnp.einsum("btd,vd->btv", x, self.embed_tokens["weight"][...].astype(x.dtype)).astype(_F32)
        return self.lm_head(x).astype(_F32)

    def __call__(self, tokens: Int[Array, "B T"], positions: Int[Array, "B T"], pool: KVPool,
                 slots: Int[Array, "B T"], block_tables: Int[Array, "B M"], starts: Int[Array, " B"],
                 num_new: Int[Array, " B"], *, mode: str = "prefill") -> tuple[Float[Array, "B T V"], KVPool]:
        """One prefill or decode step over the MLA pool (arguments as
        :meth:`jaxkv.nn.LlamaForCausalLM.__call__`)."""
        self._check_pool(pool)
        x = self._embed(tokens)
        starts, num_new = jnp.asarray(starts, jnp.int32), jnp.asarray(num_new, jnp.int32)
        slots = jnp.asarray(slots, jnp.int32)

        def step(layer, i, carry):
            x, pool = carry
            return layer(x, positions, pool, i, slots, block_tables, starts, num_new, mode=mode)

        x, pool = self.layers.run(step, (x, pool))
        return self.logits_from_hidden(x), pool

    def forward_packed(self, batch: PackedBatch, pool: KVPool, verify=None, width: int = 1
                       ) -> tuple[Float[Array, "S V"], KVPool]:
        """One packed step over the MLA pool (as
        :meth:`jaxkv.nn.LlamaForCausalLM.forward_packed`)."""
        return packed_logits(self, batch, pool, self._embed(batch.token_ids[None]), verify, width)

    def forward_dense(self, tokens: Int[Array, "B T"], positions: Int[Array, "B T"] | None = None, *,
                      kv_dtype=None) -> Float[Array, "B T V"]:
        """Full causal forward without a cache, in the expanded MLA form;
        ``kv_dtype`` rounds the latent rows through that pool dtype."""
        tokens = jnp.asarray(tokens, jnp.int32)
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        x = self._embed(tokens)
        x = self.layers.run(lambda layer, i, x: layer.forward_dense(x, positions, kv_dtype=kv_dtype), x)
        return self.logits_from_hidden(x)

    def make_pool(self, num_pages: int, page_size: int, dtype=None) -> KVPool:
        """A zero MLA pool: one ``[latent | k_rope]`` row per token and layer."""
        c = self.config
        return KVPool.create_mla(num_pages=num_pages, page_size=page_size, num_layers=self.pool_layers,
                                 kv_lora_rank=c.kv_lora_rank, rope_dim=c.qk_rope_head_dim,
                                 dtype=self.dtype if dtype is None else dtype)

    def _check_pool(self, pool: KVPool) -> None:
        c = self.config
        want = (self.pool_layers, c.kv_lora_rank + c.qk_rope_head_dim, c.kv_lora_rank)
        got = (pool.num_layers, pool.k_dim, pool.kv_lora_rank)
        if not pool.is_mla or got != want:
            raise InvalidArgument(f"pool has (layers, row dims, latent) = {got} (MLA: {pool.is_mla}) but the model "
                                  f"needs an MLA pool with {want}; use model.make_pool")

    # ---------------------------------------------------- HF checkpoints

    @classmethod
    def from_hf_state_dict(cls, config: DeepseekV3Config, tensors: dict[str, np.ndarray], *, dtype=None,
                           param_dtype=None, precision=None, implementation: str | None = None,
                           interpret: bool = False, source: str = "state dict",
                           scan_layers: bool | None = None) -> DeepseekV3ForCausalLM:
        """Build the model from transformers-named arrays (per-expert tensors
        fused as transformers' loader fuses them). Raises ``InvalidArgument``
        naming a missing, misshapen or unexpected tensor."""
        param_dtype = jnp.dtype(param_dtype or jnp.float32)
        dtype = jnp.dtype(dtype or param_dtype)
        abstract = nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=param_dtype,
                                              precision=precision, implementation=implementation,
                                              interpret=interpret, scan_layers=scan_layers))
        tensors = fuse_experts(tensors, config.n_routed_experts, source=source)

        def name_of(path):
            return path if path.startswith("lm_head.") else "model." + path

        tied = config.tie_word_embeddings
        return load_state(abstract, tensors, name_of, family="deepseek_v3", source=source,
                          ignored=lambda n: n.endswith("inv_freq") or (tied and n == "lm_head.weight")
                          or n.startswith(f"model.layers.{config.num_hidden_layers}."))  # the MTP layer

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, *, dtype=None, param_dtype=None, precision=None,
                        implementation: str | None = None, interpret: bool = False,
                        scan_layers: bool | None = None) -> DeepseekV3ForCausalLM:
        """Load a local transformers checkpoint directory (sharded or not;
        FP8 block-quantized weights dequantized at load)."""
        raw, tensors = read_checkpoint(path)
        return cls.from_hf_state_dict(DeepseekV3Config.from_hf(raw), tensors, dtype=dtype, param_dtype=param_dtype, precision=precision,
                                      implementation=implementation, interpret=interpret, source=os.fspath(path),
                                      scan_layers=scan_layers)

    def hf_state_dict(self) -> dict[str, np.ndarray]:
        """Parameters under transformers' names (fused experts)."""
        return named_state(self, lambda p: p if p.startswith("lm_head.") else "model." + p)

    def save_pretrained(self, path: str | os.PathLike) -> None:
        """``config.json`` + ``model.safetensors`` in transformers' layout."""
        save_checkpoint(path, {**self.config.to_hf(), "torch_dtype": self.param_dtype.name}, self.hf_state_dict())
