"""Rotary position embeddings as in Hugging Face Llama (rotate-half form).

Head dim ``D`` is split in halves; pair ``(x[i], x[i + D/2])`` is rotated by
angle ``position * inv_freq[i]``::

    out = x * cos(angles ++ angles) + rotate_half(x) * sin(angles ++ angles)
    rotate_half(x) = (-x[D/2:]) ++ x[:D/2]

with ``inv_freq[i] = theta ** (-2i / D)``, optionally rescaled by
:class:`~jaxkv.nn.config.RopeScaling` (Llama 3's ``llama3`` rule, HF's
``_compute_llama3_parameters``; or ``linear``). The frequencies are
computed once on the host (float64, rounded to float32) and the rotation runs
in float32 whatever the input dtype.
"""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from jaxkv.nn.config import RopeScaling

__all__ = ["apply_rope", "rope_inv_freq"]


@functools.lru_cache(maxsize=64)
def _inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> np.ndarray:
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if scaling is None:
        pass
    elif scaling.rope_type == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling.rope_type == "llama3":
        old_len = scaling.original_max_position_embeddings
        low_freq_wavelen = old_len / scaling.low_freq_factor
        high_freq_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths (low frequencies) are divided by the factor, short
        # ones kept, and the band between interpolated smoothly.
        scaled = np.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor)
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        inv_freq = np.where(medium, smoothed, scaled)
    else:  # RopeScaling validates its type; kept for safety
        raise ValueError(scaling.rope_type)
    out = inv_freq.astype(np.float32)
    out.setflags(write=False)
    return out


def rope_inv_freq(head_dim: int, theta: float = 10000.0, scaling: RopeScaling | None = None) -> np.ndarray:
    """``[head_dim // 2]`` float32 inverse frequencies (host numpy, cached)."""
    return _inv_freq(int(head_dim), float(theta), scaling)


def apply_rope(
    x: Float[Array, "B T H D"],
    positions: Int[Array, "B T"],
    inv_freq: Float[Array, " D2"] | np.ndarray,
) -> Float[Array, "B T H D"]:
    """Rotate ``x`` (``[B, T, H, D]``) by each token's position (``[B, T]``).
    Returns ``x.dtype``."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)  # [B, T, D/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    x1, x2 = xf[..., :half], xf[..., half:]
    # (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin): HF's x*cos + rotate_half(x)*sin.
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
