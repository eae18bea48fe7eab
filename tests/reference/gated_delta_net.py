"""A reference Gated DeltaNet layer (linear attention) over a :class:`~jaxkv.GDNPool`.

The layer of Qwen3-Next (``Qwen3NextGatedDeltaNet``) and of the Gated DeltaNet
paper (Yang, Kautz, Hatamizadeh, ICLR 2025), in plain ``jnp``, float32
compute. For one token ``x``:

1. projections: ``[q, k, v] = x @ w_qkv`` (q, k: ``Hk`` heads of ``Dk``; v:
   ``Hv`` heads of ``Dv``), the output gate ``z = x @ w_z`` (``Hv x Dv``),
   ``b = x @ w_b`` and ``a = x @ w_a`` (one per value head);
2. a causal depthwise conv1d of width ``kernel`` over the ``conv_dim =
   2*Hk*Dk + Hv*Dv`` channels of ``[q, k, v]`` (zero left padding from a
   fresh state), then SiLU;
3. q and k L2-normalised per head (``x * rsqrt(sum(x^2) + 1e-6)``), q scaled
   by ``1/sqrt(Dk)``, q/k heads repeated to ``Hv`` heads (value head ``h``
   reads key head ``h // (Hv // Hk)``, GQA style);
4. decay ``alpha = exp(g)`` with ``g = -exp(A_log) * softplus(a + dt_bias)``
   and write strength ``beta = sigmoid(b)``;
5. the gated delta rule per value head, with the state ``S`` of shape
   ``[Dv, Dk]``: ``S = alpha S; S = S + beta (v - S k) k^T`` i.e.
   ``S_t = alpha_t S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T``, and the
   output ``o_t = S_t q_t``;
6. the gated RMSNorm of Qwen3-Next, included: per head
   ``o * rsqrt(mean(o^2) + 1e-6) * norm_weight * silu(z)``; then
   ``y = o @ w_o``.

The per-request cache is exactly the GDNPool's: the last ``kernel - 1`` conv
inputs (the projections before the conv, channel-major ``[conv_dim, kernel -
1]``, most recent last) and ``S`` per value head (``[Hv, Dv, Dk]``, float32).
A conv state stored in bf16 rounds those inputs; the recurrence never leaves
float32.

Functions: :func:`init_params`, :func:`forward_full` (no cache),
:func:`forward_with_state` (continue from given states), :func:`prefill`
(run a prompt or a chunk for one slot and store its states) and
:func:`decode_step` (one token for a batch of slots).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Float

from jaxkv.errors import InvalidArgument
from jaxkv.pool.gdn_pool import GDNPool
from jaxkv.types import Array, Count, Ids, Int

_EPS = 1e-6


@struct.dataclass
class GatedDeltaNetParams:
    """Weights of one Gated DeltaNet layer (float32 arrays; head counts static).

    Fields:
        w_qkv: ``[hidden, conv_dim]``, columns q (``Hk*Dk``), k (``Hk*Dk``), v (``Hv*Dv``).
        w_z: ``[hidden, Hv*Dv]``, the output gate of the gated RMSNorm.
        w_b: ``[hidden, Hv]`` (beta), w_a: ``[hidden, Hv]`` (decay input).
        conv_weight: ``[conv_dim, kernel]``, depthwise; ``[:, -1]`` multiplies
            the current token. No conv bias (as in Qwen3-Next).
        A_log, dt_bias: ``[Hv]``.
        norm_weight: ``[Dv]``, shared by the heads.
        w_o: ``[Hv*Dv, hidden]``.
    """

    w_qkv: Float[Array, "hidden conv_dim"]
    w_z: Float[Array, "hidden v_channels"]
    w_b: Float[Array, "hidden v_heads"]
    w_a: Float[Array, "hidden v_heads"]
    conv_weight: Float[Array, "conv_dim kernel"]
    A_log: Float[Array, "v_heads"]
    dt_bias: Float[Array, "v_heads"]
    norm_weight: Float[Array, "v_dim"]
    w_o: Float[Array, "v_channels hidden"]
    num_k_heads: int = struct.field(pytree_node=False)
    num_v_heads: int = struct.field(pytree_node=False)
    head_k_dim: int = struct.field(pytree_node=False)
    head_v_dim: int = struct.field(pytree_node=False)

    @property
    def hidden(self) -> int:
        return self.w_qkv.shape[0]

    @property
    def conv_dim(self) -> int:
        return self.w_qkv.shape[1]

    @property
    def conv_kernel(self) -> int:
        return self.conv_weight.shape[1]


def init_params(
    key: Array,
    hidden: int,
    num_k_heads: int,
    num_v_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    conv_kernel: int,
) -> GatedDeltaNetParams:
    """Random weights: projections ~ N(0, 1/fan_in), conv ~ N(0, 1/kernel),
    ``A = exp(A_log)`` uniform in [1, 16) (Qwen3-Next draws A in (0, 16)),
    ``dt_bias`` ~ N(0, 0.5^2), ``norm_weight`` ~ 1 + N(0, 0.1^2)."""
    sizes = dict(hidden=hidden, num_k_heads=num_k_heads, num_v_heads=num_v_heads,
                 head_k_dim=head_k_dim, head_v_dim=head_v_dim, conv_kernel=conv_kernel)
    bad = {name: value for name, value in sizes.items() if value < 1}
    if bad:
        raise InvalidArgument(f"sizes must be >= 1: {bad}")
    if num_v_heads % num_k_heads:
        raise InvalidArgument(f"num_v_heads={num_v_heads} must be a multiple of num_k_heads={num_k_heads}")
    return _init_params(key, hidden, num_k_heads, num_v_heads, head_k_dim, head_v_dim, conv_kernel)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4, 5, 6))
def _init_params(key, hidden, num_k_heads, num_v_heads, head_k_dim, head_v_dim, conv_kernel):
    # One compiled program, and one normal draw sliced into every weight:
    # each random call site costs its own threefry in the compile.
    conv_dim = GDNPool.conv_dim_for(num_k_heads, head_k_dim, num_v_heads, head_v_dim)
    v_channels = num_v_heads * head_v_dim
    shapes = {
        "w_qkv": (hidden, conv_dim), "w_z": (hidden, v_channels), "w_b": (hidden, num_v_heads),
        "w_a": (hidden, num_v_heads), "conv_weight": (conv_dim, conv_kernel), "dt_bias": (num_v_heads,),
        "norm_weight": (head_v_dim,), "w_o": (v_channels, hidden),
    }
    normal_key, uniform_key = jax.random.split(key)
    flat = jax.random.normal(normal_key, (sum(math.prod(s) for s in shapes.values()),), jnp.float32)
    draws, offset = {}, 0
    for name, shape in shapes.items():
        draws[name] = flat[offset : offset + math.prod(shape)].reshape(shape)
        offset += math.prod(shape)
    return GatedDeltaNetParams(
        w_qkv=draws["w_qkv"] / math.sqrt(hidden),
        w_z=draws["w_z"] / math.sqrt(hidden),
        w_b=draws["w_b"] / math.sqrt(hidden),
        w_a=draws["w_a"] / math.sqrt(hidden),
        conv_weight=draws["conv_weight"] / math.sqrt(conv_kernel),
        A_log=jnp.log(jax.random.uniform(uniform_key, (num_v_heads,), jnp.float32, 1.0, 16.0)),
        dt_bias=0.5 * draws["dt_bias"],
        norm_weight=1.0 + 0.1 * draws["norm_weight"],
        w_o=draws["w_o"] / math.sqrt(v_channels),
        num_k_heads=num_k_heads,
        num_v_heads=num_v_heads,
        head_k_dim=head_k_dim,
        head_v_dim=head_v_dim,
    )


# ----------------------------------------------------------------- pieces


def _l2norm(x: Array) -> Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + _EPS)


def _project(p: GatedDeltaNetParams, x: Float[Array, "... hidden"]):
    """``(mixed_qkv [..., conv_dim], z [..., Hv, Dv], beta [..., Hv], alpha [..., Hv])``."""
    x = x.astype(jnp.float32)
    mixed = x @ p.w_qkv
    z = (x @ p.w_z).reshape(*x.shape[:-1], p.num_v_heads, p.head_v_dim)
    beta = jax.nn.sigmoid(x @ p.w_b)
    g = -jnp.exp(p.A_log) * jax.nn.softplus(x @ p.w_a + p.dt_bias)
    return mixed, z, beta, jnp.exp(g)


def _split_heads(p: GatedDeltaNetParams, conv_out: Float[Array, "... conv_dim"]):
    """SiLU'd conv output -> ``q, k [..., Hv, Dk]`` (normalised, q scaled,
    repeated to Hv heads) and ``v [..., Hv, Dv]``."""
    h = jax.nn.silu(conv_out)
    lead = h.shape[:-1]
    key_channels = p.num_k_heads * p.head_k_dim
    q = h[..., :key_channels].reshape(*lead, p.num_k_heads, p.head_k_dim)
    k = h[..., key_channels : 2 * key_channels].reshape(*lead, p.num_k_heads, p.head_k_dim)
    v = h[..., 2 * key_channels :].reshape(*lead, p.num_v_heads, p.head_v_dim)
    q = _l2norm(q) * (1.0 / math.sqrt(p.head_k_dim))
    k = _l2norm(k)
    repeat = p.num_v_heads // p.num_k_heads
    return jnp.repeat(q, repeat, axis=-2), jnp.repeat(k, repeat, axis=-2), v


def _delta_rule_step(state, q, k, v, beta, alpha):
    """One token of the gated delta rule for all value heads.
    ``state [Hv, Dv, Dk]``, ``q, k [Hv, Dk]``, ``v [Hv, Dv]``, ``beta, alpha [Hv]``."""
    state = alpha[:, None, None] * state
    predicted = jnp.einsum("hvk,hk->hv", state, k)  # S k: what the memory recalls for k
    delta = beta[:, None] * (v - predicted)
    state = state + delta[:, :, None] * k[:, None, :]
    return state, jnp.einsum("hvk,hk->hv", state, q)


def _output(p: GatedDeltaNetParams, o: Float[Array, "... v_heads v_dim"], z: Array) -> Array:
    """Gated RMSNorm per head, then the output projection."""
    normed = o * jax.lax.rsqrt(jnp.mean(o * o, axis=-1, keepdims=True) + _EPS)
    gated = normed * p.norm_weight * jax.nn.silu(z)
    return gated.reshape(*o.shape[:-2], -1) @ p.w_o


def zero_states(p: GatedDeltaNetParams, dtype=jnp.float32):
    """``(conv [conv_dim, kernel - 1] dtype, recurrent [Hv, Dv, Dk] float32)``
    of a request that has seen no token."""
    return (jnp.zeros((p.conv_dim, p.conv_kernel - 1), dtype),
            jnp.zeros((p.num_v_heads, p.head_v_dim, p.head_k_dim), jnp.float32))


# ----------------------------------------------------------------- sequences


def forward_with_state(
    params: GatedDeltaNetParams,
    x: Float[Array, "T hidden"],
    conv_state: Float[Array, "conv_dim conv_width"],
    recurrent_state: Float[Array, "v_heads v_dim k_dim"],
    length: Count | None = None,
) -> tuple[Float[Array, "T hidden"], Float[Array, "conv_dim conv_width"], Float[Array, "v_heads v_dim k_dim"]]:
    """Run ``x`` after the given states: ``(y, conv_state, recurrent_state)``.

    The conv state is returned in float32 (the caller casts it for storage).
    ``length`` (traced, default ``T``) marks ``x[length:]`` as padding: the
    states returned are those after ``x[:length]``, and ``y[length:]`` is
    garbage.
    """
    p = params
    num_tokens = x.shape[0]
    width = p.conv_kernel - 1
    mixed, z, beta, alpha = _project(p, x)
    # Causal conv: output t sees inputs t-width .. t; the state supplies the
    # inputs before x (zeros for a fresh request).
    history = jnp.concatenate([conv_state.astype(jnp.float32).T, mixed], axis=0)  # [width + T, C]
    conv_out = sum(history[j : j + num_tokens] * p.conv_weight[:, j] for j in range(p.conv_kernel))
    q, k, v = _split_heads(p, conv_out)
    if length is None:
        length = num_tokens
        new_conv = history[num_tokens:].T
    else:
        length = jnp.asarray(length, jnp.int32)
        new_conv = jax.lax.dynamic_slice_in_dim(history, length, width, axis=0).T
    valid = jnp.arange(num_tokens) < length

    def step(state, inputs):
        q_t, k_t, v_t, beta_t, alpha_t, valid_t = inputs
        new_state, o_t = _delta_rule_step(state, q_t, k_t, v_t, beta_t, alpha_t)
        return jnp.where(valid_t, new_state, state), o_t

    final, o = jax.lax.scan(step, recurrent_state.astype(jnp.float32), (q, k, v, beta, alpha, valid))
    return _output(p, o, z), new_conv, final


def forward_full(params: GatedDeltaNetParams, x: Float[Array, "T hidden"]) -> Float[Array, "T hidden"]:
    """The whole sequence from the zero state, no cache: ``y [T, hidden]``."""
    conv, recurrent = zero_states(params)
    return forward_with_state(params, x, conv, recurrent)[0]


# --------------------------------------------------------------- over a pool


def prefill(
    params: GatedDeltaNetParams,
    pool: GDNPool,
    layer: int | Int[Array, ""],
    slot: Int[Array, ""] | int,
    x: Float[Array, "T hidden"],
    length: Count | None = None,
) -> tuple[GDNPool, Float[Array, "T hidden"]]:
    """Run ``x[:length]`` for one slot, continuing from its stored states, and
    store the states after it: ``(pool, y [T, hidden])``.

    A new request starts from :meth:`GDNPool.reset_states`; calling prefill
    again continues (chunked prefill). ``slot == -1`` computes from the zero
    state and writes nothing.
    """
    slot = jnp.asarray(slot, jnp.int32)
    recurrent, conv = pool.get_states(layer, slot)
    y, conv, recurrent = forward_with_state(params, x, conv, recurrent, length)
    return pool.set_layer_state(layer, slot[None], recurrent[None], conv[None]), y


def _decode_one(p: GatedDeltaNetParams, x, conv_state, recurrent_state):
    mixed, z, beta, alpha = _project(p, x)
    window = jnp.concatenate([conv_state.astype(jnp.float32), mixed[:, None]], axis=1)  # [C, kernel]
    q, k, v = _split_heads(p, jnp.sum(window * p.conv_weight, axis=1))
    recurrent_state, o = _delta_rule_step(recurrent_state, q, k, v, beta, alpha)
    return _output(p, o, z), window[:, 1:], recurrent_state


def decode_step(
    params: GatedDeltaNetParams,
    pool: GDNPool,
    layer: int | Int[Array, ""],
    slots: Ids,
    x: Float[Array, "B hidden"],
) -> tuple[GDNPool, Float[Array, "B hidden"]]:
    """One token for each of ``B`` requests: reads each slot's conv and
    recurrent state from ``layer`` of the pool, advances it, writes both back.

    ``slots [B]`` must be distinct; a row with slot -1 is padding: it computes
    from the zero state, its output is garbage and it changes no slot.
    Returns ``(pool, y [B, hidden])``.
    """
    slots = jnp.asarray(slots, jnp.int32).reshape(-1)
    if x.shape[0] != slots.shape[0]:
        raise InvalidArgument(f"decode_step: {slots.shape[0]} slots but x has {x.shape[0]} rows")
    recurrent, conv = pool.get_states(layer, slots)
    y, conv, recurrent = jax.vmap(_decode_one, in_axes=(None, 0, 0, 0))(params, x, conv, recurrent)
    return pool.set_layer_state(layer, slots, recurrent, conv), y


__all__ = [
    "GatedDeltaNetParams",
    "init_params",
    "zero_states",
    "forward_with_state",
    "forward_full",
    "prefill",
    "decode_step",
]
