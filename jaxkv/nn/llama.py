"""Llama-family causal LM (Llama, Mistral, Qwen2, Qwen3) over the paged pool.

:class:`LlamaForCausalLM` is a Flax NNX module whose attribute names follow
transformers (``embed_tokens``, ``layers[i].self_attn.q_proj``, ...), so a
Hugging Face checkpoint maps onto it mechanically::

    HF name                                          NNX path (kernel = HF weight.T)
    model.embed_tokens.weight                        embed_tokens.embedding
    model.layers.{i}.self_attn.{q,k,v,o}_proj.weight layers.{i}.self_attn.{q,k,v,o}_proj.kernel
    model.layers.{i}.self_attn.{q,k,v}_proj.bias     ...bias                 (qwen2; attention_bias)
    model.layers.{i}.self_attn.{q,k}_norm.weight     ...{q,k}_norm.weight     (qwen3)
    model.layers.{i}.mlp.{gate,up,down}_proj.weight  layers.{i}.mlp.{gate,up,down}_proj.kernel
    model.layers.{i}.{input,post_attention}_layernorm.weight
    model.norm.weight                                norm.weight
    lm_head.weight                                   lm_head.kernel           (absent when tied)

(the NNX paths as unrolled; with ``scan_layers`` the layers of one sliding
window are stacked, ``layers.stacked.{u}.<...>`` holding the layers of run
``u`` of the repeating pattern as rows: :mod:`jaxkv.nn.scan`, whose :func:`layer_paths`
the loader and ``hf_state_dict`` use, so checkpoints keep naming layers one
by one)

A minimal paged prefill + decode (see ``tests/test_nn_llama.py`` for a full
one with a :class:`~jaxkv.BlockSpaceManager`)::

    model = LlamaForCausalLM.from_pretrained("path/to/checkpoint")
    pool = model.make_pool(num_pages=256, page_size=16)
    step = nnx.jit(lambda m, *a, mode: m(*a, mode=mode), static_argnames="mode")
    logits, pool = step(model, tokens, positions, pool, slots, tables, starts, num_new, mode="prefill")
"""

from __future__ import annotations

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, traverse_util
from jaxtyping import Array, Float, Int

from jaxkv.errors import InvalidArgument
from jaxkv.nn.attention import PagedAttention, RMSNorm, check_implementation
from jaxkv.nn.checkpoint import dequantize_checkpoint, load_tensors, read_config
from jaxkv.nn.packed import PackedBatch, packed_logits
from jaxkv.nn.scan import DecoderStack, layer_paths
from jaxkv.nn.config import LlamaConfig
from jaxkv.pool.kv_pool import KVPool

__all__ = ["LlamaDecoderLayer", "LlamaForCausalLM", "LlamaMLP"]

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# Tensors some checkpoints carry that the model recomputes.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


class LlamaMLP(nnx.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, bias: bool = False, dtype=jnp.float32,
                 param_dtype=jnp.float32, precision=None, rngs: nnx.Rngs):
        linear = functools.partial(nnx.Linear, use_bias=bias, dtype=dtype, param_dtype=param_dtype,
                                   precision=precision, rngs=rngs)
        self.gate_proj = linear(hidden_size, intermediate_size)
        self.up_proj = linear(hidden_size, intermediate_size)
        self.down_proj = linear(intermediate_size, hidden_size)

    def __call__(self, x: Array) -> Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nnx.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, config: LlamaConfig, layer: int, *, dtype=jnp.float32, param_dtype=jnp.float32,
                 precision=None, implementation: str | None = None, interpret: bool = False, rngs: nnx.Rngs):
        norm = functools.partial(RMSNorm, config.hidden_size, eps=config.rms_norm_eps, dtype=dtype,
                                 param_dtype=param_dtype)
        self.input_layernorm = norm()
        self.self_attn = PagedAttention.from_config(config, layer, rngs=rngs, dtype=dtype, param_dtype=param_dtype,
                                                    precision=precision, implementation=implementation,
                                                    interpret=interpret)
        self.post_attention_layernorm = norm()
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, bias=config.mlp_bias, dtype=dtype,
                            param_dtype=param_dtype, precision=precision, rngs=rngs)

    def __call__(self, x, positions, pool, layer, slots, block_tables, starts, num_new, *, mode, batch=None):
        """``layer``: this layer's index in the pool (a Python int, or traced
        under the model's scan)."""
        attn, pool = self.self_attn(self.input_layernorm(x), positions, pool, layer, slots, block_tables,
                                    starts, num_new, mode=mode, batch=batch)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), pool

    def forward_dense(self, x, positions, *, kv_dtype=None):
        x = x + self.self_attn.forward_dense(self.input_layernorm(x), positions, kv_dtype=kv_dtype)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nnx.Module):
    """A Llama-family decoder-only LM whose attention reads and writes a
    :class:`~jaxkv.KVPool` (layer ``i`` of the model uses layer ``i`` of the
    pool).

    ``dtype`` is the compute dtype of activations and matmuls,
    ``param_dtype`` the dtype parameters are stored in. Attention softmax,
    RMSNorm statistics and RoPE run in float32; logits are returned float32.

    ``implementation`` (None | ``"pallas"`` | ``"reference"``) and
    ``interpret`` choose every layer's decode attention kernel by the rule
    of :mod:`kernels_pallas` (None: the Pallas kernel on GPU, the ``jnp``
    reference elsewhere); ``InvalidArgument`` for any other value. They are
    static: each choice traces its own program.

    ``scan_layers`` (default: stacked unless built on a
    GPU, :func:`jaxkv.nn.scan.default_scan_layers`): layers of the same sliding window run
    under one ``lax.scan`` (:class:`~jaxkv.nn.scan.DecoderStack`), so
    compile time does not grow with depth; False unrolls them. The weights,
    checkpoints and tokens are the same either way.
    """

    #: The cache contract (:func:`jaxkv.nn.packed.cache_kind`): a paged ``KVPool`` (``make_pool``).
    cache_kind = "paged"

    def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32,
                 precision=None, implementation: str | None = None, interpret: bool = False,
                 scan_layers: bool | None = None):
        check_implementation(implementation, interpret)
        self.config = config
        #: The pool's layers this model runs over: its own depth, or a deeper target's for an early-exit
        #: draft that shares the target's pool (:func:`jaxkv.nn.speculative.early_exit_draft`).
        self.pool_layers = config.num_hidden_layers
        self.implementation = implementation
        self.interpret = bool(interpret)
        self.dtype = jnp.dtype(dtype)
        self.param_dtype = jnp.dtype(param_dtype)
        self.precision = precision
        self.embed_tokens = nnx.Embed(config.vocab_size, config.hidden_size, dtype=dtype, param_dtype=param_dtype,
                                      rngs=rngs)
        self.layers = DecoderStack(
            config.num_hidden_layers,
            lambda i, rngs: LlamaDecoderLayer(config, i, dtype=dtype, param_dtype=param_dtype, precision=precision,
                                              implementation=implementation, interpret=interpret, rngs=rngs),
            signature=config.layer_sliding_window, rngs=rngs, scan=scan_layers)
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, dtype=dtype, param_dtype=param_dtype)
        if not config.tie_word_embeddings:
            self.lm_head = nnx.Linear(config.hidden_size, config.vocab_size, use_bias=False, dtype=dtype,
                                      param_dtype=param_dtype, precision=precision, rngs=rngs)

    # ------------------------------------------------------------- forward

    def logits_from_hidden(self, x: Array) -> Float[Array, "B T V"]:
        """Final norm and LM head: float32 logits of hidden states ``x``."""
        x = self.norm(x)
        if self.config.tie_word_embeddings:
            table = self.embed_tokens.embedding[...].astype(self.dtype)
            logits = jnp.einsum("btd,vd->btv", x, table, precision=self.precision)
        else:
            logits = self.lm_head(x)
        return logits.astype(jnp.float32)

    def __call__(
        self,
        tokens: Int[Array, "B T"],
        positions: Int[Array, "B T"],
        pool: KVPool,
        slots: Int[Array, "B T"],
        block_tables: Int[Array, "B M"],
        starts: Int[Array, " B"],
        num_new: Int[Array, " B"],
        *,
        mode: str = "prefill",
    ) -> tuple[Float[Array, "B T V"], KVPool]:
        """One prefill or decode step over the paged pool.

        ``tokens [B, T]`` int32 (padding tokens: any id in range), the rest
        as in :meth:`PagedAttention.__call__` (``positions`` normally
        ``starts[:, None] + arange(T)``; ``slots`` the pool rows of the new
        tokens; ``mode`` ``"prefill"`` or ``"decode"`` (``T == 1``)). Returns
        ``(logits [B, T, vocab] float32, pool)`` with every layer's K/V of the
        real tokens written; logits of padding tokens are finite garbage.
        """
        self._check_pool(pool)
        x = self.embed_tokens(jnp.asarray(tokens, jnp.int32))

        def step(layer, i, carry):
            x, pool = carry
            return layer(x, positions, pool, i, slots, block_tables, starts, num_new, mode=mode)

        x, pool = self.layers.run(step, (x, pool))
        return self.logits_from_hidden(x), pool

    def forward_packed(self, batch: PackedBatch, pool: KVPool, verify=None, width: int = 1
                       ) -> tuple[Float[Array, "S V"], KVPool]:
        """One packed step (:class:`~jaxkv.nn.packed.PackedBatch`, its
        ``slots`` and ``block_tables`` filled in): every token's K/V written,
        ragged attention over the pool, and the float32 logits of each
        lane's last token only (finite garbage for a lane with none); with
        ``verify`` lanes, ``[S, width, V]`` (:func:`~jaxkv.nn.packed.packed_logits`)."""
        return packed_logits(self, batch, pool, self._embed_flat(batch.token_ids), verify, width)

    def _embed_flat(self, tokens):
        return self.embed_tokens(jnp.asarray(tokens, jnp.int32)[None])

    def forward_dense(
        self, tokens: Int[Array, "B T"], positions: Int[Array, "B T"] | None = None, *, kv_dtype=None
    ) -> Float[Array, "B T V"]:
        """Full causal forward with no cache and plain dense attention, the
        check for the paged path: token ``t`` of each row attends tokens
        ``0..t`` of its row (and the sliding window). ``positions`` default
        ``arange(T)``. ``kv_dtype`` rounds K/V through a pool storage dtype
        (e.g. ``float8_e4m3fn``) as a paged run on such a pool would."""
        tokens = jnp.asarray(tokens, jnp.int32)
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        x = self.embed_tokens(tokens)
        x = self.layers.run(lambda layer, i, x: layer.forward_dense(x, positions, kv_dtype=kv_dtype), x)
        return self.logits_from_hidden(x)

    # ---------------------------------------------------------------- pool

    def make_pool(self, num_pages: int, page_size: int, dtype=None) -> KVPool:
        """A zero :class:`~jaxkv.KVPool` for this model: one layer per decoder
        layer, ``num_key_value_heads`` heads of ``head_dim``, storage ``dtype``
        (default the compute dtype; fp8 dtypes keep scales). ``num_pages``
        counts the null page 0."""
        c = self.config
        return KVPool.create(num_pages=num_pages, page_size=page_size, num_layers=self.pool_layers,
                             k_heads=c.num_key_value_heads, k_dim=c.head_dim,
                             dtype=self.dtype if dtype is None else dtype)

    def _check_pool(self, pool: KVPool) -> None:
        c = self.config
        want = (self.pool_layers, c.num_key_value_heads, c.head_dim)
        got = (pool.num_layers, pool.k_heads, pool.k_dim)
        if pool.is_mla or got != want or (pool.v_heads, pool.v_dim) != want[1:]:
            raise InvalidArgument(
                f"pool has (layers, kv_heads, head_dim) = {got} but the model needs {want}; use model.make_pool")

    # ---------------------------------------------------- HF checkpoints

    def hf_state_dict(self) -> dict[str, np.ndarray]:
        """Parameters as numpy arrays under transformers' names and layouts
        (Linear weights ``[out, in]``), in ``param_dtype``."""
        out = {}
        per_layer = layer_paths(self)
        for path, value in _flat_params(self).items():
            arr = np.asarray(jax.device_get(value))
            paths = per_layer(path)
            for one, row in zip(paths, arr) if isinstance(paths, list) else [(paths, arr)]:  # stacked: its rows
                name, transpose = _hf_name(one)
                out[name] = np.ascontiguousarray(row.T) if transpose else row
        return out

    @classmethod
    def from_hf_state_dict(cls, config: LlamaConfig, tensors: dict[str, np.ndarray], *, dtype=None,
                           param_dtype=None, precision=None, source: str = "state dict",
                           implementation: str | None = None, interpret: bool = False,
                           scan_layers: bool | None = None) -> LlamaForCausalLM:
        """Build the model from transformers-named arrays (no random init).
        ``param_dtype`` default: ``config.torch_dtype`` (float32 if unset);
        ``dtype`` default: ``param_dtype``. Raises ``InvalidArgument`` naming a
        missing, misshapen or unexpected tensor."""
        if param_dtype is None:
            param_dtype = _DTYPES.get(config.torch_dtype or "float32", jnp.float32)
        if dtype is None:
            dtype = param_dtype
        abstract = nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(0), dtype=dtype, param_dtype=param_dtype,
                                              precision=precision, implementation=implementation,
                                              interpret=interpret, scan_layers=scan_layers))
        graphdef, state = nnx.split(abstract)
        flat = traverse_util.flatten_dict(nnx.to_pure_dict(state))
        used = set()
        loaded = {}
        per_layer = layer_paths(abstract)

        def tensor(path, shape):
            name, transpose = _hf_name(path)
            want = tuple(shape[::-1]) if transpose else tuple(shape)
            if name not in tensors:
                raise InvalidArgument(f"checkpoint ({source}) is missing tensor {name!r} (shape {want})")
            arr = np.asarray(tensors[name])
            if tuple(arr.shape) != want:
                raise InvalidArgument(
                    f"checkpoint tensor {name!r} has shape {tuple(arr.shape)}, expected {want} ({source})")
            used.add(name)
            return arr.T if transpose else arr

        for path, spec in flat.items():
            paths = per_layer(path)
            if isinstance(paths, list):  # stacked layers: one checkpoint tensor per row
                arr = np.stack([tensor(one, spec.shape[1:]) for one in paths])
            else:
                arr = tensor(paths, spec.shape)
            loaded[path] = jnp.asarray(arr, dtype=spec.dtype)
        extra = sorted(
            n for n in tensors
            if n not in used and not n.endswith(_IGNORED_SUFFIXES)
            and not (n == "lm_head.weight" and config.tie_word_embeddings)  # some tied checkpoints store it
        )
        if extra:
            more = f" and {len(extra) - 5} more" if len(extra) > 5 else ""
            raise InvalidArgument(
                f"checkpoint ({source}) has tensors this {config.model_type} config does not use: "
                f"{', '.join(map(repr, extra[:5]))}{more}")
        nnx.replace_by_pure_dict(state, traverse_util.unflatten_dict(loaded))
        return nnx.merge(graphdef, state)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, *, dtype=None, param_dtype=None, precision=None,
                        implementation: str | None = None, interpret: bool = False,
                        scan_layers: bool | None = None) -> LlamaForCausalLM:
        """Load a local Hugging Face checkpoint directory: ``config.json`` and
        its safetensors files (:func:`jaxkv.nn.checkpoint.load_tensors`: the
        shards ``model.safetensors.index.json`` names, else every
        ``*.safetensors`` file); fine-grained fp8 weights are dequantized
        (:func:`~jaxkv.nn.checkpoint.dequantize_checkpoint`). Dtype defaults as
        in :meth:`from_hf_state_dict`. Raises ``InvalidArgument`` for an
        unsupported config, no weight files, a tensor in two files, an index
        that does not match its shards, or a missing/misshapen/unexpected
        tensor (named in the message)."""
        path = os.fspath(path)
        raw_config = read_config(os.path.join(path, "config.json"))
        config = LlamaConfig.from_hf(raw_config)
        tensors = dequantize_checkpoint(load_tensors(path), raw_config.get("quantization_config"))
        return cls.from_hf_state_dict(config, tensors, dtype=dtype, param_dtype=param_dtype, precision=precision,
                                      source=path, implementation=implementation, interpret=interpret,
                                      scan_layers=scan_layers)

    def save_pretrained(self, path: str | os.PathLike, *, num_shards: int = 1) -> None:
        """Write ``config.json`` and the weights in transformers' layout:
        ``model.safetensors``, or with ``num_shards > 1`` the files
        ``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json``."""
        from safetensors.numpy import save_file

        path = os.fspath(path)
        os.makedirs(path, exist_ok=True)
        config = self.config.to_hf()
        config["torch_dtype"] = self.param_dtype.name
        with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2)
        tensors = self.hf_state_dict()
        if num_shards <= 1:
            save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
            return
        names = sorted(tensors)
        groups = [names[i::num_shards] for i in range(num_shards)]
        weight_map = {}
        for i, group in enumerate(groups):
            fname = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
            save_file({n: tensors[n] for n in group}, os.path.join(path, fname), metadata={"format": "pt"})
            weight_map.update({n: fname for n in group})
        index = {"metadata": {"total_size": int(sum(t.nbytes for t in tensors.values()))}, "weight_map": weight_map}
        with open(os.path.join(path, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
            json.dump(index, f, indent=2)


def _flat_params(model: nnx.Module) -> dict[tuple, Array]:
    return traverse_util.flatten_dict(nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def _hf_name(path: tuple) -> tuple[str, bool]:
    """NNX parameter path -> (transformers name, transpose?)."""
    *modules, leaf = path
    prefix = "" if modules[0] == "lm_head" else "model."
    suffix = "bias" if leaf == "bias" else "weight"
    return prefix + ".".join(str(m) for m in modules) + "." + suffix, leaf == "kernel"
